"""``Program.sample``: text from a Plan's state on every rank, the model in each strategy's sampling
form (``Strategy.sampling_form``) over the rank's share of the params -- the other stages' blocks
all-gathered over ``pipe``, ZeRO-3's pieces over ``data`` -- or, where a form keeps no KV cache (the
tensor grid's), the whole model sampled on every rank from the gathered params. The same key gives
the same text on every rank."""
from __future__ import annotations

from typing import Any

import torch

from cfx._src.generate.sample import sample_bytes
from cfx._src.mesh.spec import P
from cfx._src.plan.build import strategies
from cfx._src.spmd.shard_map import shard_map


def sample(program: Any, state: Any, prompt: bytes, *, steps: int, key: torch.Tensor, context: int) -> bytes:
    """``sample_bytes`` with the plan's sampling form of ``program.model`` (module doc)."""
    plan, cast = program.plan, program.policy.cast_to_compute
    model = program.model
    for s in strategies():
        model = s.sampling_form(plan, model) if model is not None else None
    if model is None:
        whole = program.params(state)
        return shard_map(lambda p: sample_bytes(program.model, cast(p), prompt, steps=steps, key=key, context=context),
                         mesh=program.mesh, in_specs=(P(),), out_specs=P())(whole)

    def body(params):
        whole = program.layout.gather_blocks(params)
        return sample_bytes(model, cast(whole), prompt, steps=steps, key=key, context=context)
    return shard_map(body, mesh=program.mesh, in_specs=(program.layout.specs,), out_specs=P())(state.params)
