"""A user's own pure loss function as a model a Plan trains.

    def loss_fn(params, x, y):                     # any pure function: a mean over the batch rows
        h = torch.relu(x @ params["w1"] + params["b1"])
        return ((h @ params["w2"] - y) ** 2).mean()

    step = plan.step(loss_fn, tx, mesh=mesh, params=params)   # or init=init_fn (then step.init(key))
    state = step.init(key)                                    # the given params, laid out by the plan
    state, metrics = step(state, (x, y))

``LossModel`` is what ``Plan.step`` / ``describe`` / ``check`` wrap such a function in: its batch is a
tuple of tensors whose rows (first dim) split over ``data``; ``data``, ZeRO 1-3 (stage 3 gathers the
whole tree around the loss), ``offload`` and ``remat`` (the whole function recomputed in backward)
need nothing more of it. ``specs`` (a ``P`` or a pytree of them, a prefix of the params) lays params
out over ``model`` too: the function then gets each rank's blocks and does its own collectives
(``cfx.lax``), as inside ``shard_map``. What needs structure (``pipe``, remat and ZeRO-3 gathering
per block) asks for the parts protocol (``cfx.models.ChainModel``).

``frozen=`` gives it weights it reads and never trains (a LoRA base: ``cfx.diffusion``'s
``lora_denoiser``), which the function receives as ``frozen=`` and the plan keeps as it keeps the
params (``models.frozen``): ZeRO-3's pieces gathered whole around the loss, offload's host memory or
files; they get no gradients and no optimizer state.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import torch

from cfx._src.core import random
from cfx._src.core import tree as tree_util
from cfx._src.lax import vma
from cfx._src.mesh.spec import is_spec
from cfx._src.spmd.spec_tree import broadcast_specs
from cfx._src.models.frozen import HeldWhole, is_placed
from cfx._src.transforms.shapes import ShapeDtype, eval_shape

WHERE = "Plan over a loss function"


@dataclasses.dataclass(frozen=True, eq=False)
class LossModel:
    """``loss_fn(params, *batch[, key=]) -> scalar`` with its params (module doc)."""

    loss_fn: Callable[..., torch.Tensor]
    params: Any = None                      # the starting params (tensors), or their ShapeDtype tree
    init_fn: Callable[[torch.Tensor], Any] | None = None
    param_specs: Any = None                 # specs over the mesh (a P, or a pytree prefix of the params)
    batch_axes: tuple = ("batch",)          # every batch tensor's rows split over data
    frozen: Any = None                      # weights read, never trained (module doc): a tree, or placed

    def __post_init__(self):
        if not callable(self.loss_fn):
            raise ValueError(f"{WHERE}: expected a function loss_fn(params, *batch), got {type(self.loss_fn).__name__}.")
        if (self.params is None) == (self.init_fn is None):
            raise ValueError(f"{WHERE}: pass the starting params (params=) or a function making them (init=), "
                             "exactly one of the two.")
        object.__setattr__(self, "_takes_key", _takes(self.loss_fn, "key"))
        if self.frozen is not None:
            if not _takes(self.loss_fn, "frozen"):
                raise ValueError(f"{WHERE}: frozen= weights reach the loss function as its keyword argument frozen; "
                                 f"{self.name!r} takes none (def loss_fn(params, *batch, frozen): ...).")
            object.__setattr__(self, "_held", self.frozen if is_placed(self.frozen) else HeldWhole(self.frozen))

    @property
    def name(self) -> str:
        return getattr(self.loss_fn, "__name__", type(self.loss_fn).__name__)

    def init(self, key: torch.Tensor) -> Any:
        """``init_fn(key)``, or a copy of the given params (``key`` unused)."""
        if self.init_fn is not None:
            return self.init_fn(key)
        if any(not isinstance(x, torch.Tensor) for x in tree_util.leaves(self.params)):
            raise ValueError(f"{WHERE} {self.name!r}: its params are shapes only; pass tensors (params=) or "
                             "init=, or start from values with program.init_from(params).")
        return tree_util.map(lambda x: x.detach().clone(), self.params)

    def shapes(self) -> Any:
        if self.init_fn is not None:
            return eval_shape(self.init, random.key(0))
        return tree_util.map(lambda x: ShapeDtype(tuple(x.shape), x.dtype), self.params)

    def axes(self) -> Any:
        """No logical names (the specs, if any, say the layout): one ``None`` per dim."""
        return tree_util.map(lambda x: (None,) * len(x.shape), self.shapes())

    def apply(self, params: Any, *batch: Any, key: torch.Tensor | None = None) -> torch.Tensor:
        return self.loss(params, *batch, key=key)

    def loss(self, params: Any, *batch: Any, key: torch.Tensor | None = None) -> torch.Tensor:
        kw = {"key": key} if self._takes_key else {}
        params = self._typed(params)
        if self.frozen is None:
            return self._checked(self.loss_fn(params, *batch, **kw))
        device = next(x.device for x in tree_util.leaves((batch, params)) if isinstance(x, torch.Tensor))
        with self._held.gathered(device) as frozen:
            return self._checked(self.loss_fn(params, *batch, frozen=frozen, **kw))

    def _split_axes(self) -> set:
        return {a for s in tree_util.leaves(self.param_specs, is_leaf=is_spec) if is_spec(s) for a in s.all_axes()}

    def _typed(self, params: Any) -> Any:
        """Where the body tracks varying axes: each param typed over the axes its spec names, among the
        axes the specs split over (what ZeRO's flat pieces and gathers cannot tell), so that a param the
        same on every rank of ``model`` meets a split value through an implicit pvary."""
        if not vma.is_tracking() or self.param_specs is None:
            return params
        split = self._split_axes()
        for _, x, spec in broadcast_specs(self.param_specs, params, "params", None, where=WHERE):
            if isinstance(x, torch.Tensor):
                vma.mark(x, (vma.varying_axes(x) - split) | (set(spec.all_axes()) & split))
        return params

    def _checked(self, loss: Any) -> Any:
        """Where the body tracks varying axes (a Plan with a model axis over this function): a loss that
        still varies over an axis its params are split over is a program that never summed the split (the
        forgotten ``psum``), refused before its gradient is taken, on every rank alike."""
        bad = sorted(vma.varying_axes(loss) & self._split_axes()) if vma.is_tracking() else []
        if bad:
            names = " and ".join(repr(a) for a in bad)
            raise ValueError(f"{WHERE} {self.name!r}: its loss varies over {names}: a value computed from params split "
                             f"over {names} (specs=) reaches the loss without being summed, so each rank would train "
                             f"on its own part. Sum it where the split ends, e.g. cfx.lax.psum(h @ p['w2'], {bad[0]!r}) "
                             "after a row-split matmul. (A param the same on every rank needs nothing: it is cast "
                             "implicitly, JAX's pvary.)")
        return loss

    def place_frozen(self, placer: Any) -> "LossModel":
        """The same function over its frozen weights as a plan's ``placer`` keeps them (``models.frozen``)."""
        return dataclasses.replace(self, frozen=placer.place(self.frozen))

    def check_train_batch(self, batch: Any, where: str) -> None:
        """A tuple of tensors sharing their number of rows (what splits over ``data``)."""
        if not isinstance(batch, (tuple, list)) or not batch or not all(isinstance(t, torch.Tensor) for t in batch):
            raise ValueError(f"{where}: a batch for {self.name!r} is a tuple of tensors (its arguments after params), "
                             f"got {type(batch).__name__}.")
        rows = {t.shape[0] if t.dim() else None for t in batch}
        if len(rows) != 1 or None in rows:
            raise ValueError(f"{where}: the batch tensors of {self.name!r} must share their first dim (the rows "
                             f"that split over data), got shapes {[tuple(t.shape) for t in batch]}.")

    def tensor_parallel(self, axis: str) -> "LossModel":
        """Its own split over ``axis``: ``param_specs`` lays the params out, the function does the rest."""
        del axis
        return self


def _takes(fn: Callable, name: str) -> bool:
    """Whether ``fn`` takes the keyword argument ``name`` (a builtin or C callable: no)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def as_model(model: Any, *, params: Any = None, init: Callable | None = None, specs: Any = None,
             batch_axes: tuple = ("batch",)) -> Any:
    """A ``LossModel`` of ``model`` when it is a loss function (given ``params=`` / ``init=`` /
    ``specs=``, or a plain function without ``init``), else ``model`` itself."""
    function = params is not None or init is not None or specs is not None
    if not function and (hasattr(model, "init") or not callable(model)):
        return model
    if hasattr(model, "init") and hasattr(model, "axes"):
        raise ValueError(f"{WHERE}: params=, init= and specs= are for a loss function; {type(model).__name__} is a "
                         "model (it has init and axes): pass it alone, or its loss function with them.")
    return LossModel(model, params=params, init_fn=init, param_specs=specs, batch_axes=tuple(batch_axes))
