"""A Plan applied to a model, an optimizer and a mesh: ``init`` and the pure train step.

The Program knows no strategy by name: it asks the plan's strategies (``strategies.STRATEGIES``;
the protocol and its phases in ``strategy.py``) in their order, through ``build``, for the checks,
the stored layout's rules, the model each rank runs, how a rank computes its loss and gradients,
their reductions, the optimizer and where the state lives. A step is then, on every rank:

1. the rank's view of its stored params (``Layout.local_view``: its pipe stages' blocks, ZeRO-3's
   pieces) and the loss and gradients of its share of the batch (``Runner.grads``);
2. the gradients reduced by each strategy in turn (``Strategy.reduce``: over ``expert``, ``seq``,
   Megatron-SP's ``model``, then averaged over ``data``), the loss averaged over the batch's axes;
3. the optimizer (ZeRO's where the plan shards it), on the rank's view where that differs from the
   stored layout, inside ``cfx.optim.sharded`` so that global norms and inf/nan checks span every
   rank's part.

State between steps is ``TrainState(params, opt_state, frozen)`` of ShardedArrays (``protocol.py``),
donated to each step (the outputs are written into its buffers); nothing is ever gathered whole.
With ``jit`` each rank runs its step as one compiled graph (``cfx.jit(shard_map(body))``). Under
``remat=auto`` the step is built once per batch shape, with the schedule solved for it.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch

from cfx._src.core import donation, tree as tree_util
from cfx._src.lax import collectives as lax, vma
from cfx._src.mesh.spec import P
from cfx._src.models.parts import hook
from cfx._src.optim import base as optim
from cfx._src.optim.loss_scale import loss_scale
from cfx._src.plan import build
from cfx._src.plan.layout import Layout, put_tree
from cfx._src.plan.protocol import TrainState
from cfx._src.plan.sampling import sample
from cfx._src.plan.saving import StateFiles
from cfx._src.nn.fp8_delayed import Fp8Meta, step_scope
from cfx._src.optim.fp8_meta import find_meta, replace_meta
from cfx._src.plan.strategies.float8 import delayed_of, with_meta
from cfx._src.precision import amp
from cfx._src.spmd.shard_map import shard_map


class Program:
    """``plan`` applied to ``model``, ``tx`` on ``mesh``; callable as the train step (a ``TrainProgram``)."""

    def __init__(self, plan, model, tx, mesh, *, grad_clip: float = 0.0, nvme_dir: str | None = None,
                 jit: bool | str = False):
        build.check_model(plan, model)
        build.check_mesh(plan, mesh)
        build.check_jit(plan, jit)
        built = self._built = build.prepare(plan, model, mesh, nvme_dir=nvme_dir)  # a LoRA base placed, ...
        self.plan, self.model, self.tx, self.mesh, self.nvme_dir = plan, built.model, tx, mesh, built.nvme_dir
        model = built.model
        self.layout = built.layout = Layout(plan, model, mesh, build.strategies())
        self.policy = amp.policy(plan.precision)
        self._delayed = delayed_of(plan)  # fp8:delayed: its meta in the optimizer's state, each step scoped
        self._rows = math.prod([plan.size(a) for a in plan.batch_axes])  # (a rank's gradients: rows x one device's)
        tx = with_meta(plan, model, tx)
        built.local = build.rank_model(plan, model)
        self.eval_model = build.rank_model(plan, model, blocks=False)  # what a rank evaluates (no remat)
        self.opt, self.state_specs = build.make_optimizer(plan, tx, built, grad_clip=grad_clip)
        built.opt = self.opt
        self._files = StateFiles(self.layout, mesh, tx, zero=plan.zero, clipped=grad_clip > 0, plan=str(plan))
        self._jit, self._steps, self._last = jit, {}, None
        self._eval_run = build.make_runner(plan, built)  # also: offload's budget checked on shapes now
        self._specs = TrainState(self.layout.specs, self.state_specs)
        self._loss = build.sharded_loss(self._eval_loss, self.layout) if self._delayed is None else shard_map(
            self._eval_scaled, mesh=mesh, in_specs=(self.layout.specs, find_meta(self.state_specs),
                                                    self.layout.batch_spec), out_specs=P())

    # -- state ---------------------------------------------------------------------------------
    def init(self, key: torch.Tensor) -> TrainState:
        """Params and optimizer state as ShardedArrays; each process builds only its blocks."""
        return self._started(self.layout.init(self.model.init, key))

    def init_from(self, params: Any) -> TrainState:
        """A ``TrainState`` starting from ``params``, the model's tree of global tensors (pretrained
        weights): stored in the plan's layout, the optimizer's state initialised on them by each rank."""
        return self._started(self.layout.put(params))

    def _started(self, params: Any) -> TrainState:
        return self._placed(TrainState(params, build.init_optimizer(self.opt, params, self.layout, self.state_specs)))

    def _placed(self, state: TrainState) -> TrainState:
        for s in build.strategies():
            state = s.place_state(self.plan, state, self._built)
        return state._replace(frozen=hook(self.model, "frozen"))  # placed already (build.prepare)

    def params(self, state: TrainState) -> Any:
        """The model's params as global tensors (``device_get``: every process calls it)."""
        return self.layout.gather(state.params)

    def put(self, params: Any, opt_state: Any) -> TrainState:
        """A ``TrainState`` from global trees: the model's params and a state saved from this plan's
        ``device_get(state.opt_state)`` (a checkpoint)."""
        return self._placed(TrainState(self.layout.put(params), put_tree(opt_state, self.state_specs, self.mesh)))

    def save(self, directory: str, state: TrainState, *, metadata: dict | None = None, async_: bool = False):
        """``state`` as a sharded checkpoint directory in model coordinates (``plan.saving``): every
        process writes the regions its ranks own and none gathers anything (every process calls it);
        a ``.safetensors`` path writes one file of whole tensors instead (process 0 writes it).
        ``async_``: return once the regions are copied to host memory; a background thread writes
        and commits them while training goes on (returns its ``PendingSave``; ``cfx.checkpoint.wait()``
        waits for it; the next save waits for it first)."""
        return self._files.save(directory, state, metadata=metadata, async_=async_)

    def whole(self, state: TrainState) -> dict[str, torch.Tensor]:
        """``{"params.<path>" / "opt_state.<path>": whole tensor}``: the state in model coordinates
        as one device holds it, on the CPU of process 0 (a collective under ``dist``: every process
        calls it; the other processes' tensors are no use)."""
        return self._files.whole(state)

    def load(self, directory: str, like: TrainState) -> tuple[TrainState, dict]:
        """``(state, metadata)`` from a checkpoint ``save`` wrote under any plan of this model and
        optimizer (another mesh, ZeRO stage or pipe axis), read into ``like`` (this program's state,
        e.g. ``init``'s, donated as the step donates its state: its buffers receive the checkpoint,
        so no second copy is made); each process reads only its blocks' slices. ``directory`` may
        also be a ``.safetensors`` file (read whole tensors) or an opened checkpoint."""
        params, opt_state, meta = self._files.load(directory, like)
        return TrainState(params, opt_state, like.frozen), meta

    # -- the step ------------------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: tuple, key: torch.Tensor | None = None
                 ) -> tuple[TrainState, dict]:
        """``(state, (tokens, targets)) -> (state, {"loss": replicated scalar})``; ``state`` is
        donated; ``key`` drives dropout (None: none). A model with its own batch (``check_train_batch``,
        as ``cfx.diffusion.Denoiser``) takes that tuple instead of ``(tokens, targets)``."""
        batch = build.arrange_batch(self.plan, self.model, batch)
        new, loss = self.step_for(batch, key)(state._replace(frozen=None), batch, key)
        return new._replace(frozen=state.frozen), {"loss": loss}  # the model reads its frozen trees itself

    def step_for(self, batch: tuple, key: Any = None) -> Any:
        """The step (``shard_map(body)``, compiled with ``jit``) for ``batch`` (global, arranged)."""
        return self._built_for(batch, key)[2]

    def body_for(self, batch: tuple, key: Any = None) -> Any:
        """One rank's step body for ``batch`` (global, arranged): ``body(state, batch, key)``."""
        return self._built_for(batch, key)[1]

    def _built_for(self, batch: tuple, key: Any) -> tuple:
        """``(schedule, body, step)``: one for every batch, or under ``remat=auto`` one per batch shape,
        its schedule solved for it on shapes the first time (``remat_plan``)."""
        shape = tuple(tuple(x.shape) for x in batch) if self.plan.remat == "auto" else None
        if shape not in self._steps:
            built = build.scheduled(self.plan, self._built, batch[0], key)  # remat=auto: solved for this shape
            body = functools.partial(self.body, build.make_runner(self.plan, built), built)
            self._steps[shape] = built.schedule, body, build.sharded_step(
                body, self._specs, self.layout, self._jit, check_vma=build.tracks_varying(self.plan, self.model))
        self._last = self._steps[shape][0]
        return self._steps[shape]

    @property
    def remat_plan(self) -> Any:
        """``remat=auto``: the schedule of the batch shape stepped last (None before the first step)."""
        return self._last

    def placement_of(self, rank: int) -> Any:
        """Rank ``rank``'s placement of its offloaded pieces (its chunks, ``traffic`` and, under
        ``auto``, ``placer.record``); None without offload."""
        return getattr(self._eval_run, "placement_of", lambda r: None)(rank)

    def body(self, run: Any, built: Any, state: TrainState, batch: tuple, key) -> tuple[TrainState, torch.Tensor]:
        """One rank's step (module doc): ``run`` computes its loss and gradients."""
        plan, layout, home = self.plan, self.layout, self.plan.home
        scale = loss_scale(state.opt_state) if self.policy.needs_loss_scaling else None
        local = layout.local_view(state.params)
        build.watch(state.params, "param", home)  # booked while a cfx.memory tracker is active
        build.watch(state.opt_state, "optim", home)
        with step_scope(find_meta(state.opt_state), self._rows) if self._delayed else contextlib.nullcontext() as fp8_step:
            loss, grads = run.grads(build.batch_varying(local, plan), batch, key, scale, self.policy.cast_to_compute)
        grads = tree_util.map(lambda g, p: g.to(p.dtype), grads, local)
        for s in build.strategies():
            grads = s.reduce(plan, grads, built)
        build.watch(grads, "grad", "device" if home == "device" else "host")
        if plan.batch_axes:
            loss = lax.pmean(loss, plan.batch_axes)
        on = local if layout.opt_on_local else state.params  # what the optimizer steps
        if on is state.params:
            grads = layout.stack_local(grads)
        with donation.donated(tree_util.leaves(grads)), build.norms_over_ranks(plan, layout):  # spent grads: reusable
            new, opt_state = optim.apply_gradients(self.opt, grads, state.opt_state, on)
        if self._delayed is not None:  # the step's amaxes over every rank, into the history (TE's rule)
            opt_state = replace_meta(opt_state, fp8_step.finish(self._delayed, tuple(layout.mesh.axis_names)))
        out = TrainState(layout.stack_local(new) if on is local else new, opt_state)
        return (build.typed_as_stored(out, self._specs, layout.mesh) if vma.is_tracking() else out), loss

    # -- eval and sampling, sharded like the step ------------------------------------------------
    def _eval_loss(self, params, batch):
        loss = self._eval_run.loss(self.policy.cast_to_compute(self.layout.local_view(params)), batch)
        return lax.pmean(loss, self.plan.batch_axes) if self.plan.batch_axes else loss

    def _eval_scaled(self, params, meta: Fp8Meta, batch):
        with step_scope(meta):  # fp8:delayed: the scales the next step would take
            return self._eval_loss(params, batch)

    def loss(self, state: TrainState, *batch: torch.Tensor) -> float:
        """The model's loss on a global batch (``tokens, targets``, or a ``check_train_batch`` model's;
        split over ``data``), without dropout."""
        batch = build.arrange_batch(self.plan, self.model, batch)
        if self._delayed is not None:
            return float(self._loss(state.params, find_meta(state.opt_state), batch))
        return float(self._loss(state.params, batch))

    def sample(self, state: TrainState, prompt: bytes, *, steps: int, key: torch.Tensor, context: int) -> bytes:
        """Text from the model on every rank (the same key: the same text; ``sampling.py``)."""
        return sample(self, state, prompt, steps=steps, key=key, context=context)
