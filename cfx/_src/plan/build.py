"""What a ``Program`` is built from, each by asking the plan's strategies (``strategies.STRATEGIES``,
the protocol in ``strategy.py``) in their order -- no strategy is named here: the checks of a model
against the plan (``check_model``, before any rank starts), the model each rank runs (``rank_model``),
the optimizer over the stored layout (``make_optimizer``), how a rank computes its loss and
gradients (``make_runner``).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from cfx._src.core import tree as tree_util
from cfx._src.mesh import memory
from cfx._src.mesh.layout import block_shape
from cfx._src.mesh.spec import is_spec
from cfx._src.models.parts import hook
from cfx._src.optim.base import chain
from cfx._src.optim.clipping import clip_by_global_norm
from cfx._src.lax import collectives as lax, vma
from cfx._src.mesh.spec import P
from cfx._src.optim.loss_scale import LossScaleState
from cfx._src.optim.reduction import sharded
from cfx._src.parallel.state import state_specs
from cfx._src.plan import strategies as strategies_lib
from cfx._src.plan.layout import Layout
from cfx._src.plan.frozen import Placer, place
from cfx._src.plan.on_rank import eval_on_rank, per_rank_specs
from cfx._src.plan.strategies.float8 import with_meta
from cfx._src.plan.strategy import Account, Built
from cfx._src.spmd.shard_map import shard_map
from cfx._src.spmd.spec_tree import broadcast_specs
from cfx._src.transforms.autodiff import value_and_grad
from cfx._src.transforms.jit import jit as cfx_jit
from cfx._src.transforms.shapes import ShapeDtype, eval_shape
from cfx._src.zero.params import ZeroParams


def strategies() -> tuple:
    """The strategies a Plan is made of, in the order they apply (read when a program is built)."""
    return strategies_lib.STRATEGIES


def check_model(plan, model) -> None:
    """What the plan needs of the model, checked without a mesh by every strategy: ValueErrors naming
    the two parts that do not fit and the fix."""
    where = f"Plan {str(plan)!r}"
    for s in strategies():
        s.check(plan, model, where)


def check_jit(plan, jit) -> None:
    """ValueError unless ``plan.step(..., jit=...)`` can compile this plan's step."""
    if not (isinstance(jit, bool) or isinstance(jit, str) and jit):
        raise ValueError(f"Plan.step: jit={jit!r}; pass True (inductor), False, or a torch.compile backend name.")
    bad = [why for why in (s.jit_refusal(plan) for s in strategies()) if why] if jit else []
    if bad:
        raise ValueError(f"Plan {str(plan)!r}: jit cannot compile this step: {'; '.join(bad)}. Drop jit, or "
                         "use remat=blocks / offload=none / no pipe axis.")


def check_mesh(plan, mesh) -> None:
    if dict(mesh.shape) != plan.mesh_shape:
        raise ValueError(f"Plan {str(plan)!r}: the mesh {mesh!r} is not the plan's {plan.mesh_shape}; open "
                         "it with plan.make_mesh().")


def prepare(plan, model: Any, mesh: Any, *, nvme_dir: str | None = None) -> Built:
    """What a program starts from: each strategy's preparation (offload=nvme's directory, made and
    checked now), then the model's frozen weights kept as the state will be (sharded, staged,
    offloaded: ``frozen_placer``)."""
    built = Built(plan, model, None, mesh, nvme_dir=nvme_dir)
    for s in strategies():
        s.prepare(plan, built)
    built.model = place(model, frozen_placer(plan, model, mesh, built.nvme_dir))
    return built


def frozen_placer(plan, model: Any, mesh: Any, nvme_dir: str | None) -> Placer:
    """Where ``plan`` keeps ``model``'s frozen weights on ``mesh``: each strategy's ``place_frozen`` in turn."""
    placer = Placer(mesh, nvme_dir=nvme_dir)
    for s in strategies():
        placer = s.place_frozen(plan, placer, model)
    return placer


def scheduled(plan, built: Built, tokens: torch.Tensor, key: Any) -> Built:
    """``built`` for a batch like ``tokens``: the schedule the strategies solve for it (``remat=auto``'s;
    None otherwise) and the model each rank runs under it."""
    schedule = None
    for s in strategies():
        schedule = s.solve(plan, built, tokens, key) or schedule
    if schedule is None:
        return built
    return dataclasses.replace(built, local=rank_model(plan, built.model, schedule=schedule), schedule=schedule)


def tracks_varying(plan, model: Any) -> bool:
    """Whether the step's body tracks varying axes (JAX's ``check_vma=True``): for a loss function of the
    user's own over a ``model`` axis. There a param the same on every model rank (an embedding, a norm)
    that meets a value split over ``model`` gets JAX's implicit ``pvary``, whose transpose sums its
    gradient over ``model`` -- what cfx's own tensor-parallel layers do by construction, and what the
    user's function would otherwise have to say with ``cfx.lax.pvary``."""
    return getattr(model, "param_specs", None) is not None and dict(plan.mesh).get("model", 1) > 1


def batch_varying(local: Any, plan) -> Any:
    """In a tracking body, the params as each rank differentiates them: typed as varying over the batch
    axes too (views, no pvary), since the strategies reduce their gradients over those axes themselves;
    so the implicit pvarys are over the model axis only."""
    if not (vma.is_tracking() and plan.batch_axes) or isinstance(local, ZeroParams):
        return local  # (ZeRO's value_and_grad types its own copies)
    return tree_util.map(lambda x: vma.declare_varying(x.view_as(x), plan.batch_axes)
                         if isinstance(x, torch.Tensor) else x, local)


def typed_as_stored(state: Any, specs: Any, mesh) -> Any:
    """A tracking body's new state, each tensor typed as varying over the axes its stored spec names: the
    optimizers' flat buffers (fused AdamW, ZeRO's reduce-scatter) mix every leaf's type, while the update
    is elementwise per leaf. The value check of ``shard_map``'s outputs still compares the replicas."""
    for _, x, spec in broadcast_specs(specs, state, "state", mesh, where="Plan"):
        if isinstance(x, torch.Tensor):
            vma.mark(x, spec.all_axes())
    return state


def sharded_step(body: Any, specs: Any, layout: Layout, jit: bool | str, *, check_vma: bool = False) -> Any:
    """``shard_map(body)`` over the state (``specs``, donated), the batch and a key; with ``jit`` each
    rank's body compiled (``cfx.jit``), the state donated to it; ``check_vma``: ``tracks_varying``."""
    step = shard_map(body, mesh=layout.mesh, in_specs=(specs, layout.batch_spec, P()), out_specs=(specs, P()),
                     donate_argnums=(0,), check_vma=check_vma)
    return cfx_jit(step, donate_argnums=(0,), backend="inductor" if jit is True else jit) if jit else step


def init_optimizer(opt: Any, params: Any, layout: Layout, specs: Any) -> Any:
    """The optimizer's state on the stored ``params``, each rank initialising its own (on its view of
    the model's tree where the optimizer steps that: ``Layout.opt_on_local``)."""
    opt_init = (lambda p: opt.init(layout.local_view(p))) if layout.opt_on_local else opt.init
    return shard_map(opt_init, mesh=layout.mesh, in_specs=(layout.specs,), out_specs=specs)(params)


def sharded_loss(fn: Any, layout: Layout) -> Any:
    """``shard_map(fn)`` over the stored params and a batch, to a replicated loss."""
    return shard_map(fn, mesh=layout.mesh, in_specs=(layout.specs, layout.batch_spec), out_specs=P())


def norms_over_ranks(plan, layout: Layout) -> Any:
    """Norms (clipping, LAMB/LARS) and the fp16 inf/nan check over every rank's part of the tree
    (ZeRO enters ``cfx.optim.sharded`` itself, with its flat shards' axes)."""
    if plan.zero or not plan.mesh:
        return contextlib.nullcontext()
    split, total = layout.norm_axes()
    return sharded(split, total_axes=total, every=tuple(layout.mesh.axis_names), psum=lax.psum)


def rank_model(plan, model: Any, *, schedule: Any = None, blocks: bool = True) -> Any:
    """The model each rank runs: every strategy's parallel form (``parallelize``), then each block
    wrapped (``wrap_block``, the first strategy innermost), how they run as one chain (``wrap_chain``:
    a remat ``schedule``, a loss function recomputed whole), and the whole (``wrap_root``). With
    ``blocks=False`` the blocks and their chain are left as they are (what evaluation runs)."""
    order = strategies()
    for s in order:
        model = s.parallelize(plan, model)
    if not blocks:
        return _wrap_root(plan, model, order)
    if isinstance(getattr(model, "blocks", None), tuple):
        def wrap(block: Any) -> Any:
            for s in order:
                block = s.wrap_block(plan, block)
            return block
        model = model.map_blocks(wrap)
    for s in order:
        model = s.wrap_chain(plan, model, schedule)
    return _wrap_root(plan, model, order)


def _wrap_root(plan, model: Any, order: tuple) -> Any:
    for s in order:
        model = s.wrap_root(plan, model)
    return model


def check_clip_outside_scaling(tx, shapes: Any, where: str) -> None:
    """ValueError if ``tx`` scales the loss (fp16): a clip in front of it would see the scaled grads."""
    state = eval_shape(tx.init, shapes)
    if any(isinstance(x, LossScaleState) for x in tree_util.leaves(state, is_leaf=lambda x: isinstance(x, LossScaleState))):
        raise ValueError(f"{where}: grad_clip= would clip the loss-scaled gradients of a dynamic_loss_scale "
                         "optimizer (by the scale, e.g. 65536x too hard); clip inside it instead: "
                         "cfx.optim.dynamic_loss_scale(cfx.optim.chain(cfx.optim.clip_by_global_norm(c), tx)), "
                         "and drop grad_clip=.")


def make_optimizer(plan, tx, built: Built, *, grad_clip: float = 0.0) -> tuple[Any, Any]:
    """``(the optimizer a step runs, its state's specs)``: ``tx`` (after a global-norm clip) as a
    strategy wraps it (ZeRO's), else itself over each rank's view of the model's tree where the
    optimizer steps that (a pipe stage's blocks), over the stored layout otherwise."""
    layout, mesh = built.layout, built.mesh
    if grad_clip > 0:  # the global norm over every shard (cfx.optim.sharded)
        check_clip_outside_scaling(tx, layout.shapes, f"Plan {str(plan)!r}")
        tx = chain(clip_by_global_norm(grad_clip), tx)
    for s in strategies():
        wrapped = s.wrap_optimizer(plan, tx, built)
        if wrapped is not None:
            return wrapped
    if layout.opt_on_local:  # pipe stages: each rank's state for its own blocks, one by one
        return tx, per_rank_specs(mesh, tx.init, layout.local_abstract())
    return tx, state_specs(eval_shape(tx.init, layout.shapes), layout.shapes, layout.specs)


class ModelRunner:
    """A rank's loss and gradients of the model it runs (``strategy.Runner``): ``cfx.value_and_grad``
    of its loss, or under ZeRO-3 the optimizer's own (its gathered layers reduce-scatter in backward)."""

    def __init__(self, model: Any, eval_model: Any, opt: Any):
        self.model, self.eval_model, self.opt = model, eval_model, opt

    def grads(self, local: Any, batch: tuple, key: Any, scale: Any, view: Any) -> tuple[torch.Tensor, Any]:
        def scaled(p):
            loss = self.model.loss(view(p), *batch, key=key)
            return (loss if scale is None else loss * scale), loss
        grad_fn = self.opt.value_and_grad if isinstance(local, ZeroParams) else value_and_grad
        (_, loss), grads = grad_fn(scaled, has_aux=True)(local)
        return loss, grads

    def loss(self, local: Any, batch: tuple) -> torch.Tensor:
        with torch.no_grad():
            return self.eval_model.loss(local, *batch)


def make_runner(plan, built: Built) -> Any:
    """How each rank computes its loss and gradients: the model's own, as each strategy replaces or
    wraps it (the pipeline's schedule, offload's placement)."""
    run = ModelRunner(built.local, rank_model(plan, built.model, blocks=False), built.opt)
    for s in strategies():
        run = s.runner(plan, run, built)
    return run


def arrange_batch(plan, model: Any, batch: Any) -> tuple:
    """A checked global batch, in the order the strategies split it (the ring's zigzag positions; a
    per-token mean loss does not depend on the order). A model with a batch of its own
    (``check_train_batch``: ``cfx.diffusion.Denoiser``, a loss function) checks it itself."""
    where = f"Plan {str(plan)!r}"
    check = hook(model, "check_train_batch")
    if check is not None:
        check(batch, where)
        plan.check_batch(batch[0].shape[0])
        return tuple(batch)
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ValueError(f"{where}: a batch is (tokens, targets), each a (B, T) integer tensor.")
    tokens, targets = batch
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ValueError(f"{where}: a batch is (tokens, targets), each a (B, T) integer tensor.")
    plan.check_batch(*tokens.shape)
    for s in strategies():
        tokens, targets = s.arrange(plan, tokens, targets)
    return tokens, targets


def watch(tree: Any, kind: str, tier: str) -> None:
    """Book ``tree``'s tensors as ``kind`` on ``tier`` while a ``cfx.memory`` tracker is active."""
    if memory.is_tracking():
        for x in tree_util.leaves(tree):
            if isinstance(x, torch.Tensor):
                memory.watch(x, tier=tier, kind=kind)


def account(plan, model: Any, tx: Any, mesh: Any) -> Account:
    """Per-rank bytes by kind and tier of ``plan`` training ``model`` with ``tx`` on ``mesh`` (an
    ``AbstractMesh`` will do), on shapes: the params one rank stores (its blocks, its pieces), as many
    gradient bytes, the optimizer's state (a shape-only ``init`` in a rank's context), then what each
    strategy adds (``Strategy.account``)."""
    layout = Layout(plan, model, mesh, strategies())
    built = Built(plan, model, layout, mesh, local=rank_model(plan, model))
    built.opt, _ = make_optimizer(plan, with_meta(plan, model, tx), built)  # (fp8:delayed: its meta too)
    if layout.opt_on_local:  # the optimizer steps each rank's view: its blocks, its pieces
        local = layout.local_abstract()
    else:
        specs = tree_util.leaves(layout.specs, is_leaf=is_spec)
        leaves, treedef = tree_util.flatten(layout.shapes)
        local = tree_util.unflatten(treedef, [ShapeDtype(block_shape(x.shape, s, mesh), x.dtype)
                                              for x, s in zip(leaves, specs)])
    params = tree_util.nbytes(local)
    acc = Account()
    acc.add("params", params, plan.home)
    acc.add("grads", params, "device" if plan.home == "device" else "host")
    acc.add("optimizer", tree_util.nbytes(eval_on_rank(mesh, built.opt.init, local)), plan.home)
    for s in strategies():
        s.account(plan, acc, built)
    return acc

