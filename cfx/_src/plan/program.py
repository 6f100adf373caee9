"""A Plan applied to a model, an optimizer and a mesh: ``init`` and the pure train step.

The strategy is applied in one readable order (torchtitan's habit), each part a transform the
runtime already has:

1. sequence parallelism (``seq`` axis): each rank holds ``T/N`` positions of every sequence
   and attention gathers the rest (``sp=ring``: keys and values round the ring, positions in
   zigzag order; ``sp=ulysses``: all-to-alls between a sequence and a head split);
2. expert parallelism (``expert`` axis): a mixture of experts' experts split over it, the batch's rows
   split over it as over ``data``, each token sent to its experts' ranks and back; the routers'
   statistics summed over the batch's axes (the whole batch's load balance; or, with Mixtral's
   ``router_aux_group_size``, each rank's own groups', which a pipe axis needs), each rank's gradient
   averaged over ``expert`` (``expert_grads``); then tensor parallelism: every block Megatron-split
   over ``model``, the vocabulary too (with
   ``sp=megatron``: Megatron-SP, the sequence split over ``model`` between the blocks' matmuls,
   the vocabulary whole); the gradients of what the sequence split replicates are summed;
3. ZeRO-3 (``zero=3``): each block, then the rest of the model, gathered just before use;
4. activation checkpointing per block (``remat``), outermost (it re-gathers while recomputing),
   or ``remat=auto``: one Rotor schedule over the blocks (with a pipe axis: over one stage's
   blocks, for one microbatch, run by every stage), solved on the first batch;
   ``offload`` (with ZeRO-3): the pieces, their grads and the optimizer state live on the host
   and the gathered layers read their shards from Gemini chunk copies on the device
   (``zero.placed``: one chunk at a time, or what ``auto``'s plan fits in its budget);
5. pipeline stages over ``pipe``: each rank runs and *stores* only its own blocks (``layout``);
   gradients accumulate over the microbatches and leave the pipeline once per step;
6. data parallelism over ``data``: one flat all-reduce of the gradients (``zero=0``), or ZeRO
   1/2: one reduce-scatter per step into this rank's shard of the flat optimizer state, the
   update all-gathered back (ZeRO-3's gathered blocks reduce-scatter in backward);
7. the optimizer: on each rank's view of the model's tree where that differs from the stored
   layout (pipe stages' blocks one by one; ZeRO-3's pieces), on the stored layout otherwise,
   inside ``cfx.optim.sharded`` so global norms and inf/nan checks span every rank's part.

State between steps is ``TrainState(params, opt_state)`` of ShardedArrays, donated to each
step (the outputs are written into its buffers); nothing is ever gathered whole. With ``jit``
each rank runs its step as one compiled graph (``cfx.jit(shard_map(body))``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import weakref
from typing import Any

import torch

from cfx._src.precision import amp
from cfx._src.core import donation
from cfx._src.mesh import memory
from cfx._src.core import tree as tree_util
from cfx._src.gemini.mapped import mapped_copy
from cfx._src.generate.sample import sample_bytes
from cfx._src.transforms.jit import jit as cfx_jit
from cfx._src.lax import collectives as lax
from cfx._src.mesh.context import current_or_none
from cfx._src.mesh.spec import P
from cfx._src.models.parts import hook, parts_of
from cfx._src.optim.base import apply_gradients
from cfx._src.optim.loss_scale import loss_scale
from cfx._src.optim.reduction import sharded
from cfx._src.parallel.expert import expert_grads, expert_parallel
from cfx._src.parallel.sequence import sequence_grads
from cfx._src.parallel.state import tree_pmean
from cfx._src.pipeline.executor import pipeline
from cfx._src.plan.build import (check_jit, check_mesh, check_model, free_device_bytes, make_optimizer, make_placement,
                                 make_schedule, parallel_model, sequence_order, split_over_model, wrap_blocks)
from cfx._src.plan.layout import Layout, put_tree
from cfx._src.plan.protocol import TrainState
from cfx._src.plan.lora_base import place_base
from cfx._src.plan.saving import StateFiles
from cfx._src.remat.plan import solve as solve_remat
from cfx._src.spmd.shard_map import shard_map
from cfx._src.spmd.sharded import ShardedArray
from cfx._src.transforms.autodiff import value_and_grad
from cfx._src.zero.gathered import gathered
from cfx._src.zero.offload import probe_nvme_dir
from cfx._src.zero.params import ZeroParams
from cfx._src.zero.placed import Placement

class Program:
    """``plan`` applied to ``model``, ``tx`` on ``mesh``; callable as the train step."""

    def __init__(self, plan, model, tx, mesh, *, grad_clip: float = 0.0, nvme_dir: str | None = None,
                 jit: bool | str = False):
        check_model(plan, model)
        check_mesh(plan, mesh)
        check_jit(plan, jit)
        self.nvme_dir = None
        if plan.offload == "nvme":  # a directory this process can write, or a ValueError now
            if nvme_dir is None:  # a directory of our own, removed with the program (its files are
                self.nvme_dir = tempfile.mkdtemp(prefix="cfx-nvme-")  # unlinked as they are made)
                weakref.finalize(self, _remove_dir, self.nvme_dir)
            else:
                self.nvme_dir = os.fspath(nvme_dir)
            probe_nvme_dir(self.nvme_dir)
        # 0. a LoraModel's frozen base kept as its state will be: sharded, staged, offloaded
        model = place_base(model, plan, mesh, nvme_dir=self.nvme_dir)
        self.plan, self.model, self.tx, self.mesh, self.grad_clip = plan, model, tx, mesh, float(grad_clip)
        self.layout = layout = Layout(plan, model, mesh)
        self.policy = amp.policy(plan.precision)
        # 1. sequence, 2. tensor parallelism, 3. ZeRO-3: each block gathered just before use,
        # 4. remat per block (outermost; it re-gathers while recomputing), 5. pipeline stages
        self._blocks_wrapped = wrap_blocks(plan, model, plan.remat if plan.remat != "auto" else "none")
        self.local_model = local = self._outer(self._blocks_wrapped)
        self.eval_model = self._outer(parallel_model(plan, model))
        self.remat_plan = None  # remat=auto: the Rotor schedule, solved on the first batch
        self.pipe_step = None
        if plan.has("pipe"):
            sched = make_schedule(plan.schedule, plan.size("pipe"), plan.microbatches, plan.chunks)
            self.pipe_step = pipeline(local, sched, local_blocks=True)
        # 6-7. data parallelism and the optimizer, over the stored layout; clipping sees the
        # global norm across every shard through cfx.optim.sharded
        self.opt, self.state_specs = make_optimizer(plan, tx, layout, mesh, grad_clip=self.grad_clip)
        self._files = StateFiles(layout, mesh, tx, zero=plan.zero, clipped=self.grad_clip > 0, plan=str(plan))
        # offload: each rank's placement of its pieces (kept across steps: auto's warm-up record),
        # one built now on shapes so that a budget below one chunk fails before any rank runs
        self.home = {"none": "device", "nvme": "nvme"}.get(plan.offload, "host")
        self._placements: dict[int, Placement] = {}
        self.chunking = self._new_placement().chunks if plan.offload != "none" else None
        specs = TrainState(layout.specs, self.state_specs)
        # every tensor of a batch (tokens and targets; a Denoiser's four) splits as batch_spec says
        self._step = shard_map(self._body, mesh=mesh, in_specs=(specs, layout.batch_spec, P()),
                               out_specs=(specs, P()), donate_argnums=(0,))
        if jit:  # each rank's body compiled, the state donated to it
            self._step = cfx_jit(self._step, donate_argnums=(0,), backend="inductor" if jit is True else jit)
        self._solve = plan.remat == "auto"
        self._loss = shard_map(self._eval_loss, mesh=mesh, in_specs=(layout.specs, layout.batch_spec),
                               out_specs=P())

    # -- state ---------------------------------------------------------------------------------
    def init(self, key: torch.Tensor) -> TrainState:
        """Params and optimizer state as ShardedArrays; each process builds only its blocks."""
        return self._started(self.layout.init(self.model.init, key))

    def init_from(self, params: Any) -> TrainState:
        """A ``TrainState`` starting from ``params``, the model's tree of global tensors (pretrained
        weights): stored in the plan's layout, the optimizer's state initialised on them by each rank."""
        return self._started(self.layout.put(params))

    def _started(self, params: Any) -> TrainState:
        opt_init = (lambda p: self.opt.init(self.layout.local_view(p))) if self.layout.opt_on_local else self.opt.init
        opt_state = shard_map(opt_init, mesh=self.mesh, in_specs=(self.layout.specs,),
                              out_specs=self.state_specs)(params)
        return self._at_home(TrainState(params, opt_state))

    def _at_home(self, state: TrainState) -> TrainState:
        """offload=nvme: every block of the state moved into a file (``gemini.mapped``); the step
        writes into those blocks (donation), so the state stays there."""
        if self.nvme_dir is None:
            return state
        return tree_util.map(lambda a: ShardedArray(a.shape, a.spec, a.mesh, {
            r: mapped_copy(b, self.nvme_dir) for r, b in a.blocks.items()}), state)

    def params(self, state: TrainState) -> Any:
        """The model's params as global tensors (``device_get``: every process calls it)."""
        return self.layout.gather(state.params)

    def put(self, params: Any, opt_state: Any) -> TrainState:
        """A ``TrainState`` from global trees: the model's params and a state saved from this plan's
        ``device_get(state.opt_state)`` (a checkpoint)."""
        return self._at_home(TrainState(self.layout.put(params), put_tree(opt_state, self.state_specs, self.mesh)))

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
        return TrainState(params, opt_state), meta

    def _outer(self, model: Any) -> Any:
        """ZeRO-3: what is left of the model (embeddings, final norm) gathered around its use."""
        return gathered(model, axis="data") if self.layout.zero3 else model

    # -- the step ------------------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: tuple, key: torch.Tensor | None = None
                 ) -> tuple[TrainState, dict]:
        """``(state, (tokens, targets)) -> (state, {"loss": replicated scalar})``; ``state`` is
        donated; ``key`` drives dropout (None: none). A model with its own batch (``check_train_batch``,
        as ``cfx.diffusion.Denoiser``) takes that tuple instead of ``(tokens, targets)``."""
        batch = self._arrange(batch)
        if self._solve:
            self._solve_remat(batch[0], key)
        new, loss = self._step(state, batch, key)
        return new, {"loss": loss}

    def _solve_remat(self, tokens: torch.Tensor, key) -> None:
        """``remat=auto``: the fastest schedule whose activations fit the budget (Rotor), solved on
        one data rank's batch of the unsharded model (tensor-parallel blocks then hold less)."""
        meta = tree_util.map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta"),
                             self.layout.model_shapes)
        axis = self.plan.sequence_axis  # one rank's rows and positions
        rows = tokens[:tokens.shape[0] // self.plan.size("data"), :tokens.shape[1] // (self.plan.size(axis) if axis else 1)]
        self._solve = False
        if self.pipe_step is None:
            _, self.remat_plan = solve_remat(self.model, meta, rows, budget=self.plan.remat_budget, key=key)
            self.local_model = self._outer(dataclasses.replace(self._blocks_wrapped, remat_plan=self.remat_plan))
            return
        # a pipe axis: one stage's blocks on one microbatch, the chain every stage runs
        k = len(self.model.blocks) // (self.plan.size("pipe") * self.plan.chunks)
        x = torch.empty((rows.shape[0] // self.plan.microbatches, rows.shape[1], parts_of(self.model, "Plan").width),
                        device="meta")
        _, self.remat_plan = solve_remat([b.apply for b in self.model.blocks[:k]], meta["blocks"][:k], x,
                                         budget=self.plan.remat_budget)
        self.pipe_step = dataclasses.replace(self.pipe_step, chain=self.remat_plan)

    def _new_placement(self) -> Placement:
        return make_placement(self.plan, self.local_model, self.layout, self.plan.offload_budget
                              or free_device_bytes(self.mesh), home=self.home)

    def placement_of(self, rank: int) -> Placement | None:
        """Rank ``rank``'s placement of its offloaded pieces (its chunks, ``traffic`` and, under
        ``auto``, ``placer.record``); None without offload."""
        if self.plan.offload == "none":
            return None
        if rank not in self._placements:
            self._placements[rank] = self._new_placement()
        return self._placements[rank]

    def _body(self, state: TrainState, batch: tuple, key) -> tuple[TrainState, torch.Tensor]:
        params, opt_state = state.params, state.opt_state
        scale = loss_scale(opt_state) if self.policy.needs_loss_scaling else None
        local = self.layout.local_view(params)
        _watch(params, "param", self.home)  # booked while a cfx.memory tracker is active
        _watch(opt_state, "optim", self.home)
        loss, grads = self._loss_and_grads(local, batch, key, scale)
        _watch(grads, "grad", "device" if self.home == "device" else "host")
        if self.layout.zero3:  # grads are already reduce-scattered pieces; update this rank's view
            loss = lax.pmean(loss, self.plan.batch_axes)
            with donation.donated(tree_util.leaves(grads)):
                new, opt_state = apply_gradients(self.opt, grads, opt_state, local)
            return TrainState(self.layout.stack_local(new.pieces), opt_state), loss
        if self.plan.batch_axes:
            loss = lax.pmean(loss, self.plan.batch_axes)
        if self.plan.has("data"):
            if not self.plan.zero:  # plain data parallel: one flat all-reduce (ZeRO reduce-scatters)
                grads = tree_pmean(grads, "data")
        on = local if self.layout.opt_on_local else params  # what the optimizer steps
        if on is params:
            grads = self.layout.stack_local(grads)
        # norms (clipping, LAMB/LARS) and the fp16 inf/nan check span every rank's part (ZeRO
        # enters cfx.optim.sharded itself, with its flat shards' axes)
        with donation.donated(tree_util.leaves(grads)), self._sharded():  # spent grads: reusable
            new, opt_state = apply_gradients(self.opt, grads, opt_state, on)
        return TrainState(self.layout.stack_local(new) if on is local else new, opt_state), loss

    def _sharded(self):
        if self.plan.zero or not self.plan.mesh:
            return contextlib.nullcontext()
        split, total = self.layout.norm_axes()
        return sharded(split, total_axes=total, every=tuple(self.mesh.axis_names), psum=lax.psum)

    def _loss_and_grads(self, local: Any, batch: tuple, key, scale):
        if self.plan.offload == "none":  # (a compiled step reads nothing of its rank here)
            return self._run(local, batch, key, scale, self.policy.cast_to_compute)
        placement = self.placement_of(current_or_none().rank)
        agree = [a for a in ("data", "expert", "seq", "model") if self.plan.has(a)]  # ranks that run the same accesses
        with placement.step(local, agree=lambda v: lax.pmax(v, tuple(agree)) if agree else v):
            # the chunk copies are cast to the compute dtype; the pieces stay as stored
            return self._run(local, batch, key, scale, placement.tree)

    def _run(self, local: Any, batch: tuple, key, scale, view):
        """Loss and grads of ``local`` (what the rank stores, as the model's tree): ``view`` turns it
        into what the model runs on (cast; ZeRO-3's ShardedLeaf tree)."""
        if self.pipe_step is not None and self.layout.zero3:  # the stages gather their own pieces
            tree = view(local)  # a cast ZeroParams, or a placement's ShardedLeaf tree already
            tree = tree.sharded_leaves() if isinstance(tree, ZeroParams) else tree
            loss, pieces = self.pipe_step(tree, *batch, scale=scale)
            grads = ZeroParams(pieces, local.shapes, local.n)
        elif self.pipe_step is not None:
            loss, grads = self.pipe_step(view(local), *batch, scale=scale)
        else:
            def scaled(p):
                loss = self.local_model.loss(view(p), *batch, key=key)
                return (loss if scale is None else loss * scale), loss
            grad_fn = self.opt.value_and_grad if self.layout.zero3 else value_and_grad
            (_, loss), grads = grad_fn(scaled, has_aux=True)(local)
        grads = self._sum_sequence_shares(tree_util.map(lambda g, p: g.to(p.dtype), grads, local))
        return loss, self._mean_over_experts(grads)

    def _sum_sequence_shares(self, grads: Any) -> Any:
        """Each rank's gradient covers its own positions: summed over the sequence axis for every
        leaf it replicates (all of them over ``seq``; under Megatron-SP the norms, biases and
        embeddings, which ``model`` does not split). One flat all-reduce."""
        axis = self.plan.sequence_axis
        if axis is None:
            return grads
        pieces = grads.pieces if isinstance(grads, ZeroParams) else grads
        summed = sequence_grads(pieces, self.layout.local_specs if axis == "model" else P(), axis)
        return ZeroParams(summed, grads.shapes, grads.n) if isinstance(grads, ZeroParams) else summed

    def _mean_over_experts(self, grads: Any) -> Any:
        """Each expert rank's gradient covers its own rows: averaged over ``expert`` for every leaf it
        replicates; the experts' own, which the exchange's transpose summed over every rank's rows,
        divided by its size (``expert_grads``)."""
        if not self.plan.has("expert"):
            return grads
        pieces = grads.pieces if isinstance(grads, ZeroParams) else grads
        mean = expert_grads(pieces, self.layout.local_specs, "expert")
        return ZeroParams(mean, grads.shapes, grads.n) if isinstance(grads, ZeroParams) else mean

    # -- eval and sampling, sharded like the step ------------------------------------------------
    def _eval_loss(self, params, batch):
        local = self.policy.cast_to_compute(self.layout.local_view(params))
        if self.pipe_step is not None:  # the stages' own blocks: the schedule's forward half
            loss = self.pipe_step.loss(local.sharded_leaves() if self.layout.zero3 else local, *batch)
        else:
            with torch.no_grad():
                loss = self.eval_model.loss(local, *batch)
        return lax.pmean(loss, self.plan.batch_axes) if self.plan.batch_axes else loss

    def loss(self, state: TrainState, *batch: torch.Tensor) -> float:
        """The model's loss on a global batch (``tokens, targets``, or a ``check_train_batch`` model's;
        split over ``data``), without dropout."""
        return float(self._loss(state.params, self._arrange(batch)))

    def _arrange(self, batch: Any) -> tuple:
        """A checked global batch with its positions in the order the sequence split expects
        (the ring's zigzag); a per-token mean loss does not depend on the order."""
        check = hook(self.model, "check_train_batch")
        if check is not None:  # a model with a batch of its own (cfx.diffusion.Denoiser)
            check(batch, f"Plan {str(self.plan)!r}")
            self.plan.check_batch(batch[0].shape[0])
            return tuple(batch)
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ValueError(f"Plan {str(self.plan)!r}: a batch is (tokens, targets), each a (B, T) integer tensor.")
        tokens, targets = batch
        _check_batch(self.plan, tokens)
        order = sequence_order(self.plan, tokens.shape[1])
        if order is None:
            return tokens, targets
        return tokens[:, order], targets[:, order]

    def sample(self, state: TrainState, prompt: bytes, *, steps: int, key: torch.Tensor, context: int) -> bytes:
        """``sample_bytes`` with the tensor-parallel model on every rank (same key: same text; it
        gathers the vocabulary-parallel logits); under a pipe axis each rank first gathers the other
        stages' blocks, under ``tp`` the whole params (inference only)."""
        tp = self.plan.has("model") and self.plan.sp != "megatron"  # the vocabulary split over model
        model = expert_parallel(self.model, "expert", stats_axes=()) if self.plan.has("expert") else self.model
        model = split_over_model(model, vocab=tp) if self.plan.has("model") else model
        policy = self.policy
        if self.plan.tp is not None:  # a grid block keeps no KV cache: every rank samples the whole model
            whole = self.params(state)
            return shard_map(lambda p: sample_bytes(self.model, policy.cast_to_compute(p), prompt, steps=steps,
                                                    key=key, context=context),
                             mesh=self.mesh, in_specs=(P(),), out_specs=P())(whole)

        def body(params):
            whole = self.layout.gather_blocks(params)
            return sample_bytes(model, policy.cast_to_compute(whole), prompt, steps=steps, key=key, context=context)
        return shard_map(body, mesh=self.mesh, in_specs=(self.layout.specs,), out_specs=P())(state.params)


def _watch(tree: Any, kind: str, tier: str) -> None:
    if memory.is_tracking():
        for x in tree_util.leaves(tree):
            if isinstance(x, torch.Tensor):
                memory.watch(x, tier=tier, kind=kind)


def _check_batch(plan, tokens: Any) -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ValueError(f"Plan {str(plan)!r}: a batch is (tokens, targets), each a (B, T) integer tensor.")
    plan.check_batch(*tokens.shape)


def _remove_dir(directory: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(directory)
