"""What a ``Program`` is built from, each decided by the plan alone: the model each rank runs
(tensor parallel, ZeRO-3 gathered, checkpointed), the pipeline schedule, the optimizer over the
stored layout, the offload placement, and the checks of the model against the plan (``check_model``,
run before any rank starts). ``eval_on_rank`` / ``per_rank_specs`` run code on shapes in a rank's
context, for specs and ``Plan.describe``.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from cfx._src.precision import amp
from cfx._src.core import tree as tree_util
from cfx._src.gemini.policy import auto as auto_policy, host as host_policy
from cfx._src.mesh.context import Group, RankContext, installed
from cfx._src.mesh.spec import P, is_spec
from cfx._src.models.function import LossModel
from cfx._src.models.parts import has_hook, hook, parts_of
from cfx._src.nn.block import TransformerBlock
from cfx._src.optim.base import chain
from cfx._src.optim.clipping import clip_by_global_norm
from cfx._src.optim.loss_scale import LossScaleState
from cfx._src.parallel.expert import check_capacity_groups, expert_parallel, has_experts, tensor_parallel_experts
from cfx._src.parallel.megatron import tensor_parallel
from cfx._src.parallel.sequence import SequenceSplit, sequence_parallel
from cfx._src.parallel.state import state_specs
from cfx._src.parallel.tp_block import GridBlock, tensor_parallel_grid
from cfx._src.pipeline import schedule as schedules
from cfx._src.plan.layout import Layout, stored_order
from cfx._src.remat import policies as cp
from cfx._src.remat.engine import remat
from cfx._src.transforms.shapes import eval_shape
from cfx._src.zero.gathered import gathered
from cfx._src.zero.optimizer import ZeroTransformation
from cfx._src.zero.placed import Placement


def remat_blocks(model: Any, mode: str) -> Any:
    """``model`` with every block under ``cfx.remat``: ``blocks`` keeps only each block's input,
    ``dots`` also its matmul outputs; ``none`` returns the model. A loss function without blocks
    (``LossModel``) is checkpointed whole."""
    if mode == "none":
        return model
    policy = {"blocks": cp.nothing_saveable, "dots": cp.dots_saveable}[mode]
    if isinstance(model, LossModel):
        return dataclasses.replace(model, loss_fn=remat(model.loss_fn, policy=policy))
    return model.map_blocks(lambda b: remat(b, policy=policy))


def parallel_model(plan, model: Any) -> Any:
    """Steps 1-2 of ``program``'s doc: the sequence split over ``seq`` (ring / Ulysses attention),
    a mixture of experts' experts over ``expert`` and its routers' statistics summed over the batch's
    axes, then every block tensor-parallel over ``model`` (with ``sp=megatron``, Megatron-SP), or with
    ``tp`` over the 2D / 2.5D / 3D grid of ``row``, ``col`` (and ``dep``)."""
    if plan.sp in ("ring", "ulysses"):
        model = sequence_parallel(model, "seq", method=plan.sp)
    if has_experts(model) and plan.batch_axes:
        model = expert_parallel(model, "expert" if plan.has("expert") else None, stats_axes=plan.batch_axes)
    if plan.has("model"):
        model = split_over_model(model, sequence=plan.sp == "megatron")
    if plan.tp is not None:
        model = tensor_parallel_grid(model, plan.tp)
    return model


def split_over_model(model: Any, *, sequence: bool = False, vocab: bool | None = None) -> Any:
    """``model`` Megatron-split over ``model``: ``tensor_parallel``, or for a mixture of experts
    ``tensor_parallel_experts`` (each expert's hidden units split; no Megatron-SP, checked by the plan)."""
    if has_experts(model):
        return tensor_parallel_experts(model, "model")
    return tensor_parallel(model, "model", sequence=sequence, vocab=vocab)


def sequence_order(plan, length: int) -> torch.Tensor | None:
    """The permutation of a batch's positions the plan's sequence split expects (the ring's zigzag
    order), or None where positions stay in order."""
    if plan.sp != "ring":
        return None
    return SequenceSplit("seq", "ring", "zigzag").order(length, plan.size("seq"))


def wrap_blocks(plan, model: Any, remat_mode: str) -> Any:
    """Steps 1-4 of the module doc: the sequence-split, tensor-parallel model whose blocks are
    gathered (ZeRO-3) and checkpointed (``remat_mode``)."""
    local = parallel_model(plan, model)
    if plan.zero == 3 and not isinstance(local, LossModel):  # a loss function is gathered whole (_outer)
        local = local.map_blocks(lambda b: gathered(b, axis="data"))
    return remat_blocks(local, remat_mode)


def gathered_model(plan, model: Any) -> Any:
    """The model a rank runs (without remat): ZeRO-3 also gathers what is left of it."""
    local = wrap_blocks(plan, model, "none")
    return gathered(local, axis="data") if plan.zero == 3 else local


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


def check_clip_outside_scaling(tx, shapes: Any, where: str) -> None:
    """ValueError if ``tx`` scales the loss (fp16): a clip in front of it would see the scaled grads."""
    state = eval_shape(tx.init, shapes)
    if any(isinstance(x, LossScaleState) for x in tree_util.leaves(state, is_leaf=lambda x: isinstance(x, LossScaleState))):
        raise ValueError(f"{where}: grad_clip= would clip the loss-scaled gradients of a dynamic_loss_scale "
                         "optimizer (by the scale, e.g. 65536x too hard); clip inside it instead: "
                         "cfx.optim.dynamic_loss_scale(cfx.optim.chain(cfx.optim.clip_by_global_norm(c), tx)), "
                         "and drop grad_clip=.")


def make_optimizer(plan, tx, layout: Layout, mesh, *, grad_clip: float = 0.0) -> tuple[Any, Any]:
    """``(the optimizer a step runs, its state's specs)``: ``tx`` itself over the stored layout,
    or wrapped in ZeRO 1/2 over it, or ZeRO-3 over each rank's view of the model's tree."""
    if grad_clip > 0:  # the global norm over every shard (cfx.optim.sharded)
        check_clip_outside_scaling(tx, layout.shapes, f"Plan {str(plan)!r}")
        tx = chain(clip_by_global_norm(grad_clip), tx)
    if plan.zero and layout.opt_on_local:  # ZeRO over each rank's view: its blocks, its pieces
        split, total = layout.norm_axes()
        opt = ZeroTransformation(tx, plan.zero, "data", layout.local_specs,
                                 owner_axes=[t[len(s):] for s, t in zip(split, total)],
                                 tier={"none": "device", "nvme": "nvme"}.get(plan.offload, "host"))
        return opt, per_rank_specs(mesh, opt.init, layout.local_abstract())
    if plan.zero:
        opt = ZeroTransformation(tx, plan.zero, "data", layout.specs)
        return opt, opt.state_specs(layout.shapes, mesh=mesh)
    if layout.opt_on_local:  # pipe stages: each rank's state for its own blocks, one by one
        return tx, per_rank_specs(mesh, tx.init, layout.local_abstract())
    return tx, state_specs(eval_shape(tx.init, layout.shapes), layout.shapes, layout.specs)


def make_placement(plan, local_model, layout: Layout, budget: int, *, home: str = "host") -> Placement:
    """One rank's placement of its ZeRO-3 pieces for ``offload`` (``host`` and ``nvme``: a chunk at
    a time; ``auto`` within ``budget`` device bytes); ValueError if the budget cannot hold one chunk."""
    policy = auto_policy(budget) if plan.offload == "auto" else host_policy()
    return Placement(local_model, layout.local_abstract(), policy, home=home,
                     dtype=amp.policy(plan.precision).compute_dtype, where=f"Plan {str(plan)!r}")


def check_model(plan, model) -> None:
    """What the plan needs of the model, checked without a mesh: ValueErrors naming the two parts
    that do not fit and the fix."""
    where = f"Plan {str(plan)!r}"
    if isinstance(model, LossModel):
        _check_loss_function(plan, model, where)
    if hook(model, "check_train_batch") is not None:  # not a token model (cfx.diffusion.Denoiser)
        _check_own_batch_model(plan, model, where)
    if plan.has("seq"):
        if not has_hook(model, "seq"):
            raise ValueError(f"{where}: {type(model).__name__} cannot split its sequence (it has no `seq` field, "
                             "as GPT2, Llama and Bert do); drop seq= from the mesh.")
        _check_ulysses_heads(plan, model, where)
    _check_experts(plan, model, where)
    if plan.tp is not None:
        _check_grid(plan, model, where)
    if plan.has("model"):
        n = plan.size("model")
        for block in getattr(split_over_model(model), "blocks", ()):
            block.check(n)
        vocab = getattr(hook(model, "config"), "vocab_size", None)
        if plan.sp != "megatron" and vocab is not None and vocab % n:
            raise ValueError(f"{where}: the vocabulary of {vocab} does not split over model={n} (vocab-parallel "
                             "embedding and loss); use a model axis size dividing it, or pad the vocabulary.")
    if plan.has("pipe"):
        parts_of(model, f"{where} (pipe axis)")
        if getattr(hook(model, "config"), "dropout", 0.0) > 0:
            raise ValueError(f"{where}: pipeline stages run without dropout; build the model with dropout=0.")
        stored_order(len(model.blocks), plan.size("pipe"), plan.chunks, type(model).__name__)
        make_schedule(plan.schedule, plan.size("pipe"), plan.microbatches, plan.chunks)


def _check_grid(plan, model, where: str) -> None:
    """``tp``: the model's blocks are plain TransformerBlocks whose heads, features and hidden units
    split over the grid (``GridBlock.check``)."""
    if isinstance(model, LossModel):
        raise ValueError(f"{where}: tp={plan.tp} splits the TransformerBlocks of a model; the loss function "
                         f"{model.name!r} has none. Drop tp= and the grid axes (or pass a cfx model).")
    try:
        grid = tensor_parallel_grid(model, plan.tp)
    except ValueError as e:
        raise ValueError(f"{where}: {e} Drop tp= and the grid axes for this model.") from None
    for i, b in enumerate(grid.blocks if not isinstance(grid, GridBlock) else (grid,)):
        b.check(plan.size("row"), f"{where}, block {i}")


def _check_experts(plan, model, where: str) -> None:
    """An expert axis splits the experts of a mixture-of-experts model, each block's over its ranks;
    what does not carry the routers' statistics yet is refused."""
    moe = has_experts(model)
    if plan.has("expert"):
        n = plan.size("expert")
        if not moe:
            raise ValueError(f"{where}: the expert axis splits a mixture of experts' experts; {type(model).__name__} "
                             "has none (TransformerBlock(moe=...), as cfx.models.mixtral). Drop expert= (or use data=).")
        for i, b in enumerate(model.blocks):
            if b.moe is not None and b.moe.n_experts % n:
                raise ValueError(f"{where}: block {i}'s {b.moe.n_experts} experts do not split over expert={n}; "
                                 f"use an expert axis size dividing {b.moe.n_experts}.")
    if not moe:
        return
    if plan.has("seq") or plan.sp == "megatron" or plan.remat == "auto":
        raise ValueError(f"{where}: sequence parallelism (seq=, sp=megatron) and remat=auto do not carry the routers' "
                         "statistics yet; train a mixture of experts with data / expert / tensor parallelism "
                         "(model=, sp=none), ZeRO and remat=blocks or dots.")
    try:
        if plan.batch_axes:  # its routers' statistics must sum over the batch's axes
            expert_parallel(model, None, stats_axes=plan.batch_axes)
        if plan.has("pipe"):  # the stages' parts, if they carry what its loss needs (Mixtral's aux losses)
            parts_of(model, f"{where} (pipe axis)")
            if plan.microbatches > 1:  # each microbatch routed on its own: capacity needs explicit groups
                check_capacity_groups(model, f"microbatches={plan.microbatches}")
    except ValueError as e:
        raise ValueError(e.args[0] if str(e).startswith(where) else f"{where}: {e}") from None


def _check_loss_function(plan, model: LossModel, where: str) -> None:
    """What a bare loss function cannot take: the axes that need its structure, and a model axis
    its specs do not use."""
    name = model.name
    if plan.has("pipe"):
        raise ValueError(f"{where}: the pipe axis cuts a model into stages of blocks; the loss function {name!r} has "
                         "none. Implement the parts protocol (cfx.models.ChainModel: blocks, map_blocks, parts(); "
                         "the README's 'Your own model' section), or drop pipe=.")
    if plan.remat == "auto":
        raise ValueError(f"{where}: remat=auto schedules a chain of blocks; the loss function {name!r} has none. Use "
                         "remat=blocks (the whole function recomputed in backward), or implement the parts protocol.")
    if plan.has("model") and "model" not in {a for s in tree_util.leaves(model.param_specs, is_leaf=is_spec)
                                             for a in s.all_axes()}:
        raise ValueError(f"{where}: no spec of {name!r} names the model axis, so every model rank would compute the "
                         "same; pass specs= laying params over 'model' (the function then gets each rank's blocks "
                         "and does its own collectives), or drop model=.")


def _check_own_batch_model(plan, model, where: str) -> None:
    """A model with a batch of its own takes ZeRO, offload, remat per block and precision over
    ``data``, and a model axis where it splits itself (``tensor_parallel``) or its blocks are
    ``TransformerBlock`` s (Megatron's split: ``cfx.models.ViT``); remat=auto and Megatron-SP are
    written for token models."""
    name = type(model).__name__
    blocks = getattr(model, "blocks", ())
    megatron = bool(blocks) and all(isinstance(b, TransformerBlock) for b in blocks)
    if plan.has("model") and not callable(hook(model, "tensor_parallel")) and not megatron:
        raise ValueError(f"{where}: the model axis splits the heads and MLPs of TransformerBlocks (Megatron); "
                         f"{name} has no such blocks and no tensor_parallel(axis) of its own. Drop model= and shard "
                         "its state with data= and zero=3 (and offload=) instead.")
    if plan.sp == "megatron":
        raise ValueError(f"{where}: sp=megatron splits a token sequence; {name} has none. Drop sp=.")
    if plan.remat == "auto":
        raise ValueError(f"{where}: remat=auto solves its schedule on a token model's batch through its chain of "
                         f"blocks; {name} takes a batch of its own (and a UNet's blocks are no chain: skip "
                         "connections). Use remat=blocks or remat=dots.")


def _check_ulysses_heads(plan, model, where: str) -> None:
    """sp=ulysses: each rank's attention heads (after the model axis's split) divide over seq."""
    if plan.sp != "ulysses":
        return
    n = plan.size("seq")
    for i, block in enumerate(model.blocks):
        heads = getattr(block, "n_heads", None)
        per_rank = heads // plan.size("model") if heads else 0
        if per_rank % n:
            raise ValueError(f"{where}: sp=ulysses splits the {per_rank} attention heads of each rank's block {i} "
                             f"over seq={n}, which does not divide them; use sp=ring, or a seq size dividing "
                             f"{per_rank}.")


def check_jit(plan, jit) -> None:
    """ValueError unless ``plan.step(..., jit=...)`` can compile this plan's step."""
    if not (isinstance(jit, bool) or isinstance(jit, str) and jit):
        raise ValueError(f"Plan.step: jit={jit!r}; pass True (inductor), False, or a torch.compile backend name.")
    if not jit:
        return
    why = {"pipe": plan.has("pipe") and "a pipe axis runs its schedule's sends and receives eagerly",
           "offload": plan.offload != "none" and f"offload={plan.offload} moves chunks between tiers in Python",
           "remat": plan.remat == "auto" and "remat=auto runs its Rotor schedule through saved-tensor hooks"}
    bad = [w for w in why.values() if w]
    if bad:
        raise ValueError(f"Plan {str(plan)!r}: jit cannot compile this step: {'; '.join(bad)}. Drop jit, or "
                         "use remat=blocks / offload=none / no pipe axis.")


def check_mesh(plan, mesh) -> None:
    if dict(mesh.shape) != plan.mesh_shape:
        raise ValueError(f"Plan {str(plan)!r}: the mesh {mesh!r} is not the plan's {plan.mesh_shape}; open "
                         "it with plan.make_mesh().")


def free_device_bytes(mesh) -> int:
    """offload=auto without a budget: the device memory free now, shared by this process's ranks
    (no bound on an ``AbstractMesh``: nothing runs there)."""
    if mesh.backend is None:
        return 1 << 62
    if torch.cuda.is_available():
        free = torch.cuda.mem_get_info()[0]
    else:  # a CPU-only machine: the device is host memory
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1, free // len(mesh.local_ranks))


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
