"""A training program over ``cfx.autoshard``'s plan (``python -m cfx.train --auto``): the searched
step gives the loss and each gradient in its param's spec, and an optimizer ``shard_map`` updates
every rank's blocks of the params and of their moments in place of the global tensors (an
elementwise optimizer is the same on any layout; a global-norm clip sums each leaf's squares over
the axes that split it, ``cfx.optim.sharded``). Params are built blockwise (``init_sharded``).
"""
from __future__ import annotations

from typing import Any

import torch

from cfx._src.core import tree as tree_util
from cfx._src.autoshard.api import autoshard
from cfx._src.autoshard.cost import CostModel
from cfx._src.spmd.init_sharded import init_sharded
from cfx._src.lax import collectives as lax
from cfx._src.mesh.spec import P, is_spec
from cfx._src.optim.base import apply_gradients, chain
from cfx._src.optim.clipping import clip_by_global_norm
from cfx._src.optim.reduction import sharded
from cfx._src.parallel.state import state_specs
from cfx._src.plan.layout import put_tree
from cfx._src.plan.protocol import TrainState
from cfx._src.core.random import key
from cfx._src.transforms.shapes import ShapeDtype, eval_shape
from cfx._src.spmd.shard_map import shard_map
from cfx._src.plan.build import check_clip_outside_scaling


class AutoProgram:
    """``init(key)``, ``(state, (x, y), key) -> (state, {"loss"})``, ``loss``, ``params``, ``put``:
    what the train loop asks of a ``Plan``'s program, over the searched plan."""

    def __init__(self, model, tx, mesh, *, batch: int, seq: int, memory_budget: int | str | None = None,
                 grad_clip: float = 0.0, cost: CostModel | None = None, reference: dict | None = None,
                 reference_name: str = "reference"):
        self.model, self.mesh = model, mesh
        self.remat_plan = None  # (what the train loop asks of a Plan's program: no remat schedule here)
        self.shapes = eval_shape(model.init, key(0))
        tokens = ShapeDtype((batch, seq), torch.int64)
        self.step_auto, self.report = autoshard(model.loss, mesh, (self.shapes, tokens, tokens),
                                                memory_budget=memory_budget, cost=cost, reference=reference,
                                                reference_name=reference_name)
        self.param_specs = self.step_auto.param_specs
        if grad_clip > 0:
            check_clip_outside_scaling(tx, self.shapes, "cfx.train --auto")
        self.tx = chain(clip_by_global_norm(grad_clip), tx) if grad_clip > 0 else tx
        self.state_specs = state_specs(eval_shape(self.tx.init, self.shapes), self.shapes, self.param_specs)
        split = [tuple(s.all_axes()) for s in tree_util.leaves(self.param_specs, is_leaf=is_spec)]
        every = tuple(mesh.axis_names)

        def update(params, grads, opt_state):
            with sharded(split, every=every, psum=lax.psum):
                return apply_gradients(self.tx, grads, opt_state, params)
        self._update = shard_map(update, mesh=mesh, in_specs=(self.param_specs, self.param_specs, self.state_specs),
                                 out_specs=(self.param_specs, self.state_specs), donate_argnums=(0, 2))
        self._init_opt = shard_map(self.tx.init, mesh=mesh, in_specs=(self.param_specs,), out_specs=self.state_specs)

    def init(self, key: torch.Tensor) -> TrainState:
        params = init_sharded(self.model.init, key, mesh=self.mesh, specs=self.param_specs)
        return TrainState(params, self._init_opt(params))

    def put(self, params: Any, opt_state: Any) -> TrainState:
        """A state from global trees (a single-file checkpoint)."""
        return TrainState(put_tree(params, self.param_specs, self.mesh), put_tree(opt_state, self.state_specs, self.mesh))

    def __call__(self, state: TrainState, batch: tuple, key: torch.Tensor | None = None) -> tuple[TrainState, dict]:
        del key  # the traced step has no dropout key: it trains deterministically
        loss, grads = self.step_auto(state.params, *batch)
        params, opt_state = self._update(state.params, grads, state.opt_state)
        return TrainState(params, opt_state), {"loss": loss}

    def loss(self, state: TrainState, *batch: torch.Tensor) -> float:
        from cfx._src.spmd.arrays import device_get
        return float(device_get(self.step_auto(state.params, *batch)[0]))

    def params(self, state: TrainState) -> Any:
        from cfx._src.spmd.arrays import device_get
        return device_get(state.params)

    def sample(self, state: TrainState, prompt: bytes, *, steps: int, key: torch.Tensor, context: int) -> bytes:
        """Text from the gathered params, on each process (the same bytes everywhere)."""
        from cfx._src.generate.sample import sample_bytes
        return sample_bytes(self.model, self.params(state), prompt, steps=steps, key=key, context=context)


def megatron_reference(model, mesh) -> dict[str, P] | None:
    """Megatron's param specs (``cfx.parallel.MEGATRON_RULES``) by path, where the mesh allows them."""
    from cfx._src.parallel.rules import Rules
    from cfx._src.parallel.megatron import MEGATRON_RULES
    try:
        specs = Rules(MEGATRON_RULES).specs(model.axes(), mesh=mesh)
        shapes = eval_shape(model.init, key(0))
    except ValueError:
        return None
    paths = [p for p, _ in tree_util.flatten_with_path(shapes)[0]]
    return dict(zip(paths, tree_util.leaves(specs, is_leaf=is_spec)))
