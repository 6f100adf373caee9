"""``cfx.parallel.Plan``: the whole strategy (pipe x data x seq x model, ZeRO, offload, remat, precision) as one object, and the Program that runs it."""
