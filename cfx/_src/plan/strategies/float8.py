"""Float8 training matmuls (``precision=fp8[:recipe]``): every block but the first runs its Linears' three
GEMMs in float8 (``cfx.amp.float8``, a layer transform under all the others: ZeRO-3 gathers, offload
streams and a pipeline stage runs the weights as any others), the rest in bf16. Each rank scales its
pieces with the amax one device takes: the weights' dims split as the plan's rules lay them (Megatron's
``model``), the batch's rows over ``data``. Grids, sequence and expert parallelism split a Linear's
operands in ways this does not know yet: refused."""
from __future__ import annotations

import math
from typing import Any

from cfx._src.core import random, tree as tree_util
from cfx._src.nn.fp8_delayed import DelayedScaling
from cfx._src.nn.fp8_layers import float8, linears_of, slots_of
from cfx._src.optim.base import chain
from cfx._src.optim.fp8_meta import meta_state
from cfx._src.plan.strategies.expert import Expert
from cfx._src.plan.strategies.megatron import Megatron
from cfx._src.plan.strategy import Strategy
from cfx._src.precision.amp import policy
from cfx._src.transforms.shapes import eval_shape


def recipe_of(plan) -> str | None:
    """The plan's float8 recipe (its precision's policy's: ``fp8`` and ``fp8:delayed`` are tensorwise), or None."""
    return policy(plan.precision).fp8


def delayed_of(plan) -> DelayedScaling | None:
    """``precision=fp8:delayed``'s scaling (Transformer Engine's defaults), else None."""
    return DelayedScaling() if policy(plan.precision).fp8_scaling == "delayed" else None


def with_meta(plan, model, tx) -> Any:
    """``tx`` with delayed scaling's meta chained in front (its state holds it; ``fp8_delayed``) where the plan
    scales so, else ``tx``."""
    cfg = delayed_of(plan)
    if cfg is None or not isinstance(getattr(model, "blocks", None), tuple):
        return tx
    return chain(meta_state(slots_of(float8(model, scaling=cfg)), cfg), tx)


def _rules(plan) -> dict[str, Any]:
    """The layout rules of the strategies whose parallel forms split a block's weights before this one wraps
    them (the experts' split 3-D weights, which stay in bf16; the grid is refused)."""
    return {k: v for s in (Expert(), Megatron()) for k, v in s.rules(plan).items()}


class Float8(Strategy):
    name = "precision"

    def check_plan(self, plan) -> None:
        comm = plan.fp8_comm.split("+")
        if "all_gather" in comm and (recipe_of(plan) != "tensorwise" or delayed_of(plan) or plan.zero != 3
                                     or plan.offload != "none"):
            raise ValueError(f"Plan: fp8_comm={plan.fp8_comm} all-gathers ZeRO-3's weights as the e4m3 casts the "
                             "tensorwise recipe makes of them (each by its own amax), held on the device; use "
                             "precision=fp8 (or fp8:tensorwise) with zero=3 and offload=none, or drop fp8_comm "
                             f"(here: precision={plan.precision} zero={plan.zero} offload={plan.offload}).")
        if "reduce_scatter" in comm and (recipe_of(plan) is None or plan.zero != 3 or plan.offload != "none"):
            raise ValueError(f"Plan: fp8_comm={plan.fp8_comm} reduce-scatters ZeRO-3's gradients in e5m2 (an "
                             "all-to-all of the casts, summed in fp32): it takes an fp8 precision, zero=3 and "
                             "offload=none; use them, or drop fp8_comm.")
        if "pipe" in comm and (recipe_of(plan) is None or not plan.has("pipe")):
            raise ValueError(f"Plan: fp8_comm={plan.fp8_comm} sends a pipeline's activations as e4m3 casts: it "
                             "takes a pipe axis and an fp8 precision; add them, or drop fp8_comm.")
        if recipe_of(plan) is None:
            return
        other = [f"{a}=" for a in ("row", "col", "dep", "seq", "expert") if plan.has(a)]
        other += [f"sp={plan.sp}"] if plan.sp not in ("none", None) else []
        other += [f"offload={plan.offload} (its chunks each hold their own optimizer state)"] if (
            delayed_of(plan) and plan.offload != "none") else []
        if other:
            raise ValueError(f"Plan: precision={plan.precision} runs the Linear matmuls in float8 under data, "
                             f"model and pipe parallelism, ZeRO and offload (fp8:delayed: not offload), not with "
                             f"{', '.join(other)}; use precision=bf16 there, or drop them.")

    def jit_refusal(self, plan) -> str | None:
        if plan.fp8_comm != "none":
            return f"fp8_comm={plan.fp8_comm}'s float8 collectives run eagerly"
        return "fp8:delayed notes each step's amaxes outside the graph" if delayed_of(plan) else None

    def check(self, plan, model, where: str) -> None:
        if recipe_of(plan) is None or not isinstance(getattr(model, "blocks", None), tuple):
            return
        rules, tokens = _rules(plan), plan.batch_axes
        for i, block in enumerate(model.blocks[1:], 1):
            shapes = dict(tree_util.flatten_with_path(eval_shape(block.init, random.key(0)))[0])
            for path, split in linears_of(block, rules, tokens):
                shape = shapes[path].shape
                piece = (shape[0] // math.prod(plan.size(a) for a in split.k),
                         shape[1] // math.prod(plan.size(a) for a in split.n))
                if piece[0] % 16 or piece[1] % 16:
                    raise ValueError(f"{where}: blocks.{i}.{path} {tuple(shape)} is split into {piece} pieces over "
                                     f"{', '.join(split.k + split.n)}, which the float8 GEMM does not take (dims "
                                     "must be multiples of 16 on every rank); use a model axis that leaves them "
                                     "so, or precision=bf16.")

    def parallelize(self, plan, model) -> Any:
        r = recipe_of(plan)
        if r is None or not isinstance(getattr(model, "blocks", None), tuple):
            return model
        return float8(model, r, rules=_rules(plan), tokens=plan.batch_axes, scaling=delayed_of(plan),
                      gather="all_gather" in plan.fp8_comm.split("+"))
