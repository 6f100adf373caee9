"""``cfx.zero``: ZeRO (stages 0-3) as an optimizer transform and a layer transform, with Gemini
placement. The module is callable as the optimizer transform::

    ztx = cfx.zero(cfx.optim.adamw(1e-3), stage=2, axis="data")     # stages 0-3
    zmodel = model.map_blocks(lambda b: cfx.zero.gathered(b, axis="data"))  # stage 3's layers
    zparams = cfx.zero.shard_params(params, axis="data")             # stage 3's stored params
    zparams = cfx.zero.init_params(model.init, key, mesh=mesh)       # ... built sharded, no full copy
    params = cfx.zero.gather_params(zparams, axis="data")
    engine = cfx.zero.GeminiEngine(zmodel, zparams, tx, axis="data",
                                   offload=cfx.zero.offload(cfx.gemini.auto(512 << 20)))
"""
from cfx._src.core.modules import callable_module
from cfx._src.zero.api import zero
from cfx._src.zero.buckets import ShardGrads
from cfx._src.zero.engine import GeminiEngine
from cfx._src.zero.gathered import Gathered, gathered
from cfx._src.zero.offload import Offload, offload
from cfx._src.zero.optimizer import ZeroState, ZeroTransformation
from cfx._src.zero.params import ShardedLeaf, ZeroParams, gather_params, init_params, param_specs, shard_params

__all__ = ["Gathered", "GeminiEngine", "Offload", "ShardGrads", "ShardedLeaf", "ZeroParams", "ZeroState",
           "ZeroTransformation", "gather_params", "gathered", "init_params", "offload", "param_specs", "shard_params",
           "zero"]

callable_module(__name__, zero)
