"""Run by test_replication under torchrun (2 processes, the dist backend): each rank writes what
each call gave, or the first line of the error it raised, to ``<out_dir>/rank<r>.txt``."""
import os
import sys

import torch

import cfx
from cfx import P


def main(out_dir: str) -> None:
    lines = []
    with cfx.Mesh({"data": 2}, timeout=20) as mesh:
        def call(name, body, check_rep=True):
            try:
                out = cfx.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P(), check_rep=check_rep)(
                    torch.arange(4.0))
                lines.append(f"{name} ok {cfx.device_get(out).tolist()}")
            except ValueError as e:
                lines.append(f"{name} ValueError {str(e).splitlines()[0]}")

        call("reduced", lambda x: cfx.lax.psum(x, "data"))
        call("unreduced", lambda x: x * 2)
        call("opt_out", lambda x: x * 2, check_rep=False)
        call("nested", lambda x: {"a": cfx.lax.pmean(x, "data"), "b": [x.sum()]})
        call("sampled", lambda x: torch.zeros(641) + (torch.arange(641) == 5) * x[0])
        call("full", lambda x: torch.zeros(641) + (torch.arange(641) == 5) * x[0], check_rep="full")
        call("after", lambda x: cfx.lax.psum(x, "data") * 0)  # the mesh is still in step
        with open(os.path.join(out_dir, f"rank{mesh.backend.rank}.txt"), "w") as f:
            f.write("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
