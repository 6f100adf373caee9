"""``cfx.zero``: the ZeRO optimizer transform (the public module ``cfx/zero.py`` is callable as it
and lists the helpers below in its ``__all__``).

    ztx = cfx.zero(cfx.optim.adamw(1e-3), stage=2, axis="data")     # stages 0-3
    zmodel = cfx.zero.gathered(model.map_blocks(lambda b: cfx.zero.gathered(b, axis="data")),
                               axis="data")                          # stage 3's layers
    zparams = cfx.zero.shard_params(params, axis="data")             # stage 3's stored params
    zparams = cfx.zero.init_params(model.init, key, mesh=mesh)       # ... built sharded, no full copy
    params = cfx.zero.gather_params(zparams, axis="data")
    engine = cfx.zero.GeminiEngine(zmodel, zparams, tx, axis="data",
                                   offload=cfx.zero.offload(cfx.gemini.auto(512 << 20)))

See ``optimizer``, ``gathered``, ``params`` and ``offload`` for the contracts.
"""
from __future__ import annotations

from typing import Any

from cfx._src.zero.optimizer import ZeroTransformation


def zero(tx: Any, *, stage: int, axis: str = "data", param_specs: Any = None,
         bucket_numel: int = 1 << 22) -> ZeroTransformation:
    """``tx`` as a ZeRO stage-``stage`` optimizer over mesh axis ``axis`` (used inside shard_map).

    ``param_specs``: the params' specs on the mesh's other axes (tensor parallelism), so global
    norms and inf checks cover every shard; ``bucket_numel``: elements per gradient bucket.
    """
    return ZeroTransformation(tx, stage, axis, param_specs, bucket_numel)
