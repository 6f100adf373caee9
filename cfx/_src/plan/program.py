"""A Plan applied to a model, an optimizer and a mesh: ``init`` and the pure train step.

The strategy is applied in one readable order (torchtitan's habit), each part a transform the
runtime already has:

1. tensor parallelism: every block Megatron-split over ``model``, the vocabulary too;
2. ZeRO-3 (``zero=3``): each block, then the rest of the model, gathered just before use;
3. activation checkpointing per block (``remat``), outermost (it re-gathers while recomputing),
   or ``remat=auto``: one Rotor schedule over the blocks, solved on the first batch;
4. pipeline stages over ``pipe``: each rank runs and *stores* only its own blocks (``layout``);
   gradients accumulate over the microbatches and leave the pipeline once per step;
5. data parallelism over ``data``: one flat all-reduce of the gradients (``zero=0``), or ZeRO
   1/2: one reduce-scatter per step into this rank's shard of the flat optimizer state, the
   update all-gathered back (ZeRO-3's gathered blocks reduce-scatter in backward);
6. the optimizer: on each rank's view of the model's tree where that differs from the stored
   layout (pipe stages' blocks one by one; ZeRO-3's pieces), on the stored layout otherwise,
   inside ``cfx.optim.sharded`` so global norms and inf/nan checks span every rank's part.

State between steps is ``TrainState(params, opt_state)`` of ShardedArrays, donated to each
step (the outputs are written into its buffers); nothing is ever gathered whole.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, NamedTuple

import torch

from cfx._src import amp, donation, memory
from cfx._src import tree as tree_util
from cfx._src.lax import collectives as lax
from cfx._src.mesh.spec import P
from cfx._src.models.parts import parts_of
from cfx._src.optim.base import apply_updates, chain
from cfx._src.optim.clipping import clip_by_global_norm
from cfx._src.optim.loss_scale import loss_scale
from cfx._src.optim.reduction import sharded
from cfx._src.parallel.megatron import tensor_parallel
from cfx._src.parallel.state import state_specs, tree_pmean
from cfx._src.pipeline import schedule as schedules
from cfx._src.pipeline.executor import pipeline
from cfx._src.plan.layout import Layout, put_tree, stored_order
from cfx._src.remat import policies as cp
from cfx._src.remat import remat
from cfx._src.mesh.context import Group, RankContext, installed
from cfx._src.shapes import eval_shape
from cfx._src.shard_map import shard_map
from cfx._src.models.sample import sample_bytes
from cfx._src.transforms import value_and_grad
from cfx._src.zero.gathered import gathered
from cfx._src.zero.optimizer import ZeroTransformation
from cfx._src.zero.params import ZeroParams


class TrainState(NamedTuple):
    params: Any      # the stored layout (``Layout``), ShardedArrays
    opt_state: Any   # the optimizer's state over the stored params, ShardedArrays


def remat_blocks(model: Any, mode: str) -> Any:
    """``model`` with every block under ``cfx.remat``: ``blocks`` keeps only each block's input,
    ``dots`` also its matmul outputs; ``none`` returns the model."""
    if mode == "none":
        return model
    policy = {"blocks": cp.nothing_saveable, "dots": cp.dots_saveable}[mode]
    return model.map_blocks(lambda b: remat(b, policy=policy))


def make_schedule(name: str, pipe: int, microbatches: int, chunks: int) -> schedules.Schedule:
    """The pipeline schedule named ``name`` for ``pipe`` ranks."""
    if name == "gpipe":
        return schedules.gpipe(pipe, microbatches)
    if name == "1f1b":
        return schedules.one_f_one_b(pipe, microbatches)
    if name == "interleaved":
        return schedules.interleaved_1f1b(pipe, microbatches, chunks)
    if name == "zb-h1":
        return schedules.zb_h1(pipe, microbatches)
    raise ValueError(f"schedule {name!r}: expected gpipe, 1f1b, interleaved or zb-h1.")


def make_optimizer(plan, tx, layout: Layout, mesh, *, grad_clip: float = 0.0) -> tuple[Any, Any]:
    """``(the optimizer a step runs, its state's specs)``: ``tx`` itself over the stored layout,
    or wrapped in ZeRO 1/2 over it, or ZeRO-3 over each rank's view of the model's tree."""
    if grad_clip > 0:  # the global norm over every shard: cfx.optim.sharded, or ZeRO's ghost leaf
        tx = chain(clip_by_global_norm(grad_clip), tx)
    if plan.zero and layout.opt_on_local:  # ZeRO over each rank's view: its blocks, its pieces
        split, total = layout.norm_axes()
        opt = ZeroTransformation(tx, plan.zero, "data", layout.local_specs,
                                 owner_axes=[t[len(s):] for s, t in zip(split, total)])
        return opt, per_rank_specs(mesh, opt.init, layout.local_abstract())
    if plan.zero:
        opt = ZeroTransformation(tx, plan.zero, "data", layout.specs)
        return opt, opt.state_specs(layout.shapes, mesh=mesh)
    if layout.opt_on_local:  # pipe stages: each rank's state for its own blocks, one by one
        return tx, per_rank_specs(mesh, tx.init, layout.local_abstract())
    return tx, state_specs(eval_shape(tx.init, layout.shapes), layout.shapes, layout.specs)


class Program:
    """``plan`` applied to ``model``, ``tx`` on ``mesh``; callable as the train step."""

    def __init__(self, plan, model, tx, mesh, *, grad_clip: float = 0.0):
        self.plan, self.model, self.tx, self.mesh, self.grad_clip = plan, model, tx, mesh, float(grad_clip)
        check_model(plan, model)
        _check_mesh(plan, mesh)
        self.layout = layout = Layout(plan, model, mesh)
        self.policy = amp.policy(plan.precision)
        # 1. tensor parallelism, 2. ZeRO-3: each block gathered just before use, 3. remat per
        # block (outermost; it re-gathers while recomputing), 4. pipeline stages
        local = tensor_parallel(model, "model") if plan.has("model") else model
        if layout.zero3:
            local = local.map_blocks(lambda b: gathered(b, axis="data"))
        self._blocks_wrapped = remat_blocks(local, plan.remat if plan.remat != "auto" else "none")
        self.local_model = local = self._outer(self._blocks_wrapped)
        self.eval_model = self._outer(tensor_parallel(model, "model") if plan.has("model") else model)
        self.remat_plan = None  # remat=auto: the Rotor schedule, solved on the first batch
        self.pipe_step = None
        if plan.has("pipe"):
            sched = make_schedule(plan.schedule, plan.size("pipe"), plan.microbatches, plan.chunks)
            self.pipe_step = pipeline(local, sched, local_blocks=True)
        # 4-5. data parallelism and the optimizer, over the stored layout; under ZeRO the clip sees
        # the global norm through ZeRO's ghost leaf, otherwise the step clips across the shards
        self.opt, self.state_specs = make_optimizer(plan, tx, layout, mesh, grad_clip=self.grad_clip)
        specs = TrainState(layout.specs, self.state_specs)
        batch = (layout.batch_spec, layout.batch_spec)
        self._step = shard_map(self._body, mesh=mesh, in_specs=(specs, batch, P()), out_specs=(specs, P()),
                               donate_argnums=(0,))
        self._solve = plan.remat == "auto"
        self._loss = shard_map(self._eval_loss, mesh=mesh, in_specs=(layout.specs, layout.batch_spec,
                                                                      layout.batch_spec), out_specs=P())

    # -- state ---------------------------------------------------------------------------------
    def init(self, key: torch.Tensor) -> TrainState:
        """Params and optimizer state as ShardedArrays; each process builds only its blocks."""
        params = self.layout.init(self.model.init, key)
        opt_init = (lambda p: self.opt.init(self.layout.local_view(p))) if self.layout.opt_on_local else self.opt.init
        opt_state = shard_map(opt_init, mesh=self.mesh, in_specs=(self.layout.specs,),
                              out_specs=self.state_specs)(params)
        return TrainState(params, opt_state)

    def params(self, state: TrainState) -> Any:
        """The model's params as global tensors (``device_get``: every process calls it)."""
        return self.layout.gather(state.params)

    def put(self, params: Any, opt_state: Any) -> TrainState:
        """A ``TrainState`` from global trees: the model's params and a state saved from this plan's
        ``device_get(state.opt_state)`` (a checkpoint)."""
        return TrainState(self.layout.put(params), put_tree(opt_state, self.state_specs, self.mesh))

    def _outer(self, model: Any) -> Any:
        """ZeRO-3: what is left of the model (embeddings, final norm) gathered around its use."""
        return gathered(model, axis="data") if self.layout.zero3 else model

    # -- the step ------------------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: tuple, key: torch.Tensor | None = None
                 ) -> tuple[TrainState, dict]:
        """``(state, (tokens, targets)) -> (state, {"loss": replicated scalar})``; ``state`` is
        donated; ``key`` drives dropout (None: none)."""
        tokens, targets = batch
        _check_batch(self.plan, tokens)
        if self._solve:
            self._solve_remat(tokens, key)
        new, loss = self._step(state, (tokens, targets), key)
        return new, {"loss": loss}

    def _solve_remat(self, tokens: torch.Tensor, key) -> None:
        """``remat=auto``: the fastest schedule whose activations fit the budget (Rotor), solved on
        one data rank's batch of the unsharded model (tensor-parallel blocks then hold less)."""
        meta = tree_util.map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta"),
                             self.layout.model_shapes)
        rows = tokens[:tokens.shape[0] // self.plan.size("data")]
        _, self.remat_plan = remat.solve(self.model, meta, rows, budget=self.plan.remat_budget, key=key)
        self.local_model = self._outer(dataclasses.replace(self._blocks_wrapped, remat_plan=self.remat_plan))
        self._solve = False

    def _body(self, state: TrainState, batch: tuple, key) -> tuple[TrainState, torch.Tensor]:
        params, opt_state = state
        tokens, targets = batch
        scale = loss_scale(opt_state) if self.policy.needs_loss_scaling else None
        local = self.layout.local_view(params)
        _watch(params, "param")  # booked while a cfx.memory tracker is active
        _watch(opt_state, "optim")
        loss, grads = self._loss_and_grads(local, tokens, targets, key, scale)
        _watch(grads, "grad")
        if self.layout.zero3:  # grads are already reduce-scattered pieces; update this rank's view
            loss = lax.pmean(loss, "data")
            with donation.donated(tree_util.leaves(grads)):
                updates, opt_state = self.opt.update(grads, opt_state, local)
            return TrainState(self.layout.stack_local(apply_updates(local, updates).pieces), opt_state), loss
        if self.plan.has("data"):
            loss = lax.pmean(loss, "data")
            if not self.plan.zero:  # plain data parallel: one flat all-reduce (ZeRO reduce-scatters)
                grads = tree_pmean(grads, "data")
        on = local if self.layout.opt_on_local else params  # what the optimizer steps
        if on is params:
            grads = self.layout.stack_local(grads)
        # norms (clipping, LAMB/LARS) and the fp16 inf/nan check span every rank's part; ZeRO's
        # ghost leaf does the same for its flat shards
        with donation.donated(tree_util.leaves(grads)), self._sharded():  # spent grads: reusable
            updates, opt_state = self.opt.update(grads, opt_state, on)
        new = apply_updates(on, updates)
        return TrainState(self.layout.stack_local(new) if on is local else new, opt_state), loss

    def _sharded(self):
        if self.plan.zero or not self.plan.mesh:
            return contextlib.nullcontext()
        split, total = self.layout.norm_axes()
        return sharded(split, total_axes=total, every=tuple(self.mesh.axis_names), psum=lax.psum)

    def _loss_and_grads(self, local: Any, tokens: torch.Tensor, targets: torch.Tensor, key, scale):
        compute = self.policy.cast_to_compute
        if self.pipe_step is not None and self.layout.zero3:  # the stages gather their own pieces
            loss, pieces = self.pipe_step(compute(local).sharded_leaves(), tokens, targets, scale=scale)
            grads = ZeroParams(pieces, local.shapes, local.n)
        elif self.pipe_step is not None:
            loss, grads = self.pipe_step(compute(local), tokens, targets, scale=scale)
        else:
            def scaled(p):
                loss = self.local_model.loss(compute(p), tokens, targets, key=key)
                return (loss if scale is None else loss * scale), loss
            grad_fn = self.opt.value_and_grad if self.layout.zero3 else value_and_grad
            (_, loss), grads = grad_fn(scaled, has_aux=True)(local)
        return loss, tree_util.map(lambda g, p: g.to(p.dtype), grads, local)

    # -- eval and sampling, sharded like the step ------------------------------------------------
    def _eval_loss(self, params, tokens, targets):
        local = self.policy.cast_to_compute(self.layout.local_view(params))
        if self.pipe_step is not None:  # the stages' own blocks: run the schedule, drop the grads
            loss, _ = self.pipe_step(local.sharded_leaves() if self.layout.zero3 else local, tokens, targets)
        else:
            with torch.no_grad():
                loss = self.eval_model.loss(local, tokens, targets)
        return lax.pmean(loss, "data") if self.plan.has("data") else loss

    def loss(self, state: TrainState, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """The model's loss on a global batch (split over ``data``), without dropout."""
        _check_batch(self.plan, tokens)
        return float(self._loss(state.params, tokens, targets))

    def sample(self, state: TrainState, prompt: bytes, *, steps: int, key: torch.Tensor, context: int) -> bytes:
        """``sample_bytes`` with the tensor-parallel model on every rank (same key: same text);
        under a pipe axis each rank first gathers the other stages' blocks (inference only)."""
        model = tensor_parallel(self.model, "model") if self.plan.has("model") else self.model
        policy, tp = self.policy, self.plan.has("model")

        def logits(p, tokens):  # vocab-parallel logits (B, T, V/n) -> (B, T, V)
            out = model.apply(p, tokens)
            return lax.all_gather(out, "model", dim=-1, tiled=True) if tp else out

        def body(params):
            whole = self.layout.gather_blocks(params)
            return sample_bytes(model, policy.cast_to_compute(whole), prompt, steps=steps, key=key,
                                context=context, logits=logits)
        return shard_map(body, mesh=self.mesh, in_specs=(self.layout.specs,), out_specs=P())(state.params)


def check_model(plan, model) -> None:
    """What the plan needs of the model, checked without a mesh: ValueErrors naming the two parts
    that do not fit and the fix."""
    where = f"Plan {str(plan)!r}"
    if plan.offload != "none":
        raise ValueError(f"{where}: offload (Gemini chunk placement) is not composed into a Plan step yet; "
                         "use offload=none, or cfx.zero.GeminiEngine by hand.")
    if plan.remat == "auto" and plan.has("pipe"):
        raise ValueError(f"{where}: remat=auto solves one checkpointing schedule over all blocks, and the "
                         "pipe axis cuts them into stages; use remat=blocks or remat=dots with a pipe axis.")
    if plan.remat == "auto" and plan.zero == 3:
        raise ValueError(f"{where}: remat=auto runs the blocks as one solved chain over whole tensors, and "
                         "zero=3 hands each block its gathered pieces; use remat=blocks or remat=dots with "
                         "zero=3.")
    if plan.has("model"):
        n = plan.size("model")
        for block in tensor_parallel(model, "model").blocks:
            block.check(n)
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if vocab is not None and vocab % n:
            raise ValueError(f"{where}: the vocabulary of {vocab} does not split over model={n} (vocab-parallel "
                             "embedding and loss); use a model axis size dividing it, or pad the vocabulary.")
    if plan.has("pipe"):
        parts_of(model, f"{where} (pipe axis)")
        if getattr(getattr(model, "config", None), "dropout", 0.0) > 0:
            raise ValueError(f"{where}: pipeline stages run without dropout; build the model with dropout=0.")
        stored_order(len(model.blocks), plan.size("pipe"), plan.chunks, type(model).__name__)
        make_schedule(plan.schedule, plan.size("pipe"), plan.microbatches, plan.chunks)


def _check_mesh(plan, mesh) -> None:
    if dict(mesh.shape) != plan.mesh_shape:
        raise ValueError(f"Plan {str(plan)!r}: the mesh {mesh!r} is not the plan's {plan.mesh_shape}; open "
                         "it with plan.make_mesh().")


def _watch(tree: Any, kind: str) -> None:
    if memory.is_tracking():
        for x in tree_util.leaves(tree):
            if isinstance(x, torch.Tensor):
                memory.watch(x, tier="device", kind=kind)


def eval_on_rank(mesh, fn, *args) -> Any:
    """``eval_shape(fn, *args)`` in rank 0's context: axis sizes and indices, no process groups
    (a collective would raise), no allocation. ``mesh`` may be an ``AbstractMesh``."""
    coords = mesh.coords(0)
    ctx = RankContext(mesh, 0, coords, lambda axes: Group(axes, mesh.axes_size(axes), mesh.index_in(axes, coords), None))
    with installed(ctx):
        return eval_shape(fn, *args)


def per_rank_specs(mesh, fn, *args) -> Any:
    """Specs for what ``fn(*args)`` returns on each rank when every rank's result has the same
    shapes but its own values (ZeRO's flat state): 1-D and larger leaves split over all of the
    mesh's axes, scalars replicated."""
    every = tuple(mesh.axis_names)
    return tree_util.map(lambda x: P(every) if len(x.shape) else P(), eval_on_rank(mesh, fn, *args))


def _check_batch(plan, tokens: Any) -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ValueError(f"Plan {str(plan)!r}: a batch is (tokens, targets), each a (B, T) integer tensor.")
    plan.check_batch(tokens.shape[0])
