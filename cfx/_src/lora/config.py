"""``LoraConfig``, and which of a model's Linear weights it adapts (``resolve``: a list of ``Unit``).

A target is a preset name (``PRESETS``, or ``"all-linear"``) or an ``fnmatch`` pattern over the dotted
path of a Linear weight leaf (``blocks.*.attn.q.w``; the trailing ``.w`` may be left off). The decoders'
and the CLIP text encoder's attention is ``"attn"``, a diffusion UNet's ``"unet-attn"``. A Linear
weight is a 2-D ``w`` in a ``{"w"}`` / ``{"w", "b"}`` params dict whose first logical axis is not a
lookup table's (``"vocab"``, ``"positions"``: embeddings, and so a tied LM head, are not Linears).

``shared_a`` groups sibling Linears (names under one parent, e.g. ``("q", "k", "v")``) into one
adapter with one ``A`` and a ``B`` per member: Hugging Face GPT-2 fuses q, k and v into one ``c_attn``,
so peft's adapter on it is exactly that.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Any

from cfx._src.core import random
from cfx._src.core import tree as tree_util
from cfx._src.precision.quant import TABLE_AXES
from cfx._src.transforms.shapes import eval_shape

PRESETS: dict[str, tuple[str, ...]] = {
    "attn": ("*.attn.q.w", "*.attn.k.w", "*.attn.v.w", "*.attn.o.w"),
    "qkv": ("*.attn.q.w", "*.attn.k.w", "*.attn.v.w"),
    "mlp": ("*.mlp.*.w",),
    # diffusers' attention projections (a Stable Diffusion UNet's attn1 / attn2: peft's "to_q", "to_k",
    # "to_v", "to_out.0"); the CLIP text encoder's are the "attn" preset's
    "unet-attn": ("*.to_q.w", "*.to_k.w", "*.to_v.w", "*.to_out.w"),
}
ALL_LINEAR = "all-linear"  # every Linear weight but the LM head (peft's "all-linear")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Rank ``r``, ``alpha`` (scale ``alpha / r``, or ``alpha / sqrt(r)`` with ``rslora``), ``dropout``
    on the adapters' input, the ``targets`` (module doc) and the ``shared_a`` groups. The defaults
    are peft's (``r=8``, ``lora_alpha=8``, no dropout)."""

    r: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("attn",)
    shared_a: tuple[tuple[str, ...], ...] = ()
    rslora: bool = False

    def __post_init__(self):
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r <= 0:
            raise ValueError(f"cfx.lora.LoraConfig: r must be a positive int, got {self.r!r}.")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 0:
            raise ValueError(f"cfx.lora.LoraConfig: alpha must be a positive number, got {self.alpha!r}.")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"cfx.lora.LoraConfig: dropout must be in [0, 1), got {self.dropout!r}.")
        if (isinstance(self.targets, str) or not isinstance(self.targets, tuple) or not self.targets
                or not all(isinstance(t, str) and t for t in self.targets)):
            raise ValueError(f"cfx.lora.LoraConfig: targets must be a non-empty tuple of presets "
                             f"{sorted(PRESETS) + [ALL_LINEAR]} or path patterns, got {self.targets!r} "
                             "(e.g. targets=('attn', 'mlp') or targets=('blocks.*.attn.q.w',)).")
        ok = isinstance(self.shared_a, tuple) and all(
            isinstance(g, tuple) and len(g) >= 2 and len(set(g)) == len(g)
            and all(isinstance(n, str) and n and "+" not in n for n in g) for g in self.shared_a)
        if not ok or len({n for g in self.shared_a for n in g}) != sum(len(g) for g in self.shared_a):
            raise ValueError(f"cfx.lora.LoraConfig: shared_a must be a tuple of disjoint groups of 2 or more "
                             f"sibling Linear names, got {self.shared_a!r} (e.g. shared_a=(('q', 'k', 'v'),)).")

    @classmethod
    def parse(cls, text: str, *, where: str | None = None, **defaults: Any) -> "LoraConfig":
        """``"r=4,alpha=8,targets=attn+mlp"`` -> a ``LoraConfig`` (a command line's ``--lora``):
        comma-separated ``KEY=VALUE``, KEY among ``r``, ``alpha``, ``dropout``, ``targets`` (presets and
        patterns joined by ``+``), ``rslora`` (0 or 1) and ``shared_a`` (groups of names joined by ``+``,
        separated by ``/``: ``shared_a=q+k+v``, GPT-2's c_attn for peft), each once; a key not given takes ``defaults``,
        then the field's default. A ValueError starts with ``where`` (default ``--lora 'TEXT'``)."""
        where = f"--lora {text!r}" if where is None else where
        kinds = {"r": int, "alpha": float, "dropout": float, "rslora": lambda v: {"0": False, "1": True}[v],
                 "targets": lambda v: tuple(v.split("+")),
                 "shared_a": lambda v: tuple(tuple(g.split("+")) for g in v.split("/"))}
        fields = dict(defaults)
        seen = set()
        for part in text.split(","):
            key, eq, value = (s.strip() for s in part.partition("="))
            if key not in kinds or not eq or key in seen:
                raise ValueError(f"{where}: expected comma-separated KEY=VALUE, each KEY once, from {sorted(kinds)} "
                                 "(e.g. r=4,alpha=4,targets=unet-attn).")
            seen.add(key)
            try:
                fields[key] = kinds[key](value)
            except (KeyError, ValueError):
                raise ValueError(f"{where}: {key}={value!r} is not a valid {key} (r: a positive int; alpha, dropout: "
                                 "numbers; rslora: 0 or 1; targets: presets or patterns joined by +; shared_a: "
                                 "groups like q+k+v joined by /).") from None
        try:
            return cls(**fields)
        except ValueError as e:
            raise ValueError(f"{where}: {e.args[0].removeprefix('cfx.lora.LoraConfig: ')}") from None

    @property
    def scale(self) -> float:
        """The adapters' factor: ``alpha / r`` (``alpha / sqrt(r)`` with ``rslora``)."""
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)

    def patterns(self) -> tuple[str, ...]:
        """The targets with the presets spelled out (``all-linear`` stays a name)."""
        return tuple(p for t in self.targets for p in PRESETS.get(t, (t,)))


@dataclasses.dataclass(frozen=True)
class Unit:
    """One adapter: an ``A`` ``(in, r)`` shared by the Linears ``members`` under ``parent`` (a dotted
    path), one ``B`` ``(r, out)`` each. It sits at ``parent.name`` in the adapters tree."""

    parent: str
    members: tuple[str, ...]
    in_features: int
    out_features: tuple[int, ...]
    in_axis: str | None
    out_axes: tuple[str | None, ...]

    @property
    def name(self) -> str:
        return "+".join(self.members)

    @property
    def path(self) -> str:
        return join(self.parent, self.name)


def join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def linear_weights(shapes: Any, axes: Any) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """``{w path: (shape, logical axes)}`` of every Linear weight (module doc)."""
    items = dict(tree_util.flatten_with_path(shapes)[0])
    names = dict(tree_util.flatten_with_path(axes, is_leaf=tree_util.is_axes_leaf)[0])
    children: dict[str, set[str]] = {}
    for path in items:
        parent, _, name = path.rpartition(".")
        children.setdefault(parent, set()).add(name)
    out = {}
    for path, x in items.items():
        parent, _, name = path.rpartition(".")
        ax = names.get(path)
        if (name == "w" and len(x.shape) == 2 and children[parent] <= {"w", "b"}
                and ax is not None and len(ax) == 2 and ax[0] not in TABLE_AXES):
            out[path] = (tuple(x.shape), ax)
    return out


def _selected(config: LoraConfig, items: dict, linears: dict, where: str) -> list[str]:
    """The leaf paths the targets pick, in params order; ValueError for a pick that is no Linear weight
    and for no pick at all."""
    pats = config.patterns()

    def picked(path: str) -> bool:
        if ALL_LINEAR in pats and path in linears and linears[path][1][1] != "vocab":
            return True
        bare = path[:-2] if path.endswith(".w") else None
        return any(fnmatch.fnmatchcase(path, p) or (bare is not None and fnmatch.fnmatchcase(bare, p))
                   for p in pats if p != ALL_LINEAR)

    chosen = [p for p in items if picked(p)]
    wrong = [p for p in chosen if p not in linears]
    if wrong:
        p = wrong[0]
        raise ValueError(f"{where}: the targets {config.targets!r} pick {p!r} (shape {tuple(items[p].shape)}), "
                         f"which is not a 2-D Linear weight; LoRA adapts Linear weights (paths like "
                         f"{_examples(linears)}). Narrow the pattern, e.g. to end in '.w'."
                         + (f" ({len(wrong) - 1} more such leaves.)" if len(wrong) > 1 else ""))
    if not chosen:
        raise ValueError(f"{where}: no leaf matched the targets {config.targets!r}; this model's Linear "
                         f"weights have paths like {_examples(linears)}. Use a preset "
                         f"{sorted(PRESETS) + [ALL_LINEAR]} or a pattern such as 'blocks.*.attn.q.w'.")
    return chosen


def _examples(linears: dict) -> str:
    paths = list(linears)
    return repr(paths[:4])[:-1] + (", ...]" if len(paths) > 4 else "]")


def resolve_shapes(shapes: Any, axes: Any, config: LoraConfig, where: str) -> list[Unit]:
    """The adapters ``config`` puts on params of ``shapes`` (``ShapeDtype`` or tensor leaves) with
    logical ``axes``, in params order."""
    items = dict(tree_util.flatten_with_path(shapes)[0])
    linears = linear_weights(shapes, axes)
    chosen = _selected(config, items, linears, where)
    by_parent: dict[str, dict[str, str]] = {}
    for p in chosen:
        parent, _, name = p[:-2].rpartition(".")
        by_parent.setdefault(parent, {})[name] = p
    units = []
    for parent, names in by_parent.items():
        for group in _groups(config, parent, names, where):
            (d_in, _), (in_axis, _) = linears[names[group[0]]]
            dims = [linears[names[m]] for m in group]
            if any(s[0] != d_in for s, _ in dims):
                raise ValueError(f"{where}: the shared_a group {group!r} under {parent!r} has Linears of "
                                 f"different input sizes {[s[0] for s, _ in dims]}; one A needs one input size.")
            units.append(Unit(parent, group, d_in, tuple(s[1] for s, _ in dims), in_axis,
                              tuple(a[1] for _, a in dims)))
    return units


def _groups(config: LoraConfig, parent: str, names: dict[str, str], where: str) -> list[tuple[str, ...]]:
    """The chosen Linears under ``parent`` as adapters: each ``shared_a`` group whole, the rest alone."""
    out, taken = [], set()
    for group in config.shared_a:
        present = [n for n in group if n in names]
        if not present:
            continue
        if len(present) != len(group):
            missing = [join(parent, n) + ".w" for n in group if n not in names]
            raise ValueError(f"{where}: the shared_a group {group!r} under {parent!r} needs all its Linears "
                             f"targeted, but not {missing}; target them too (e.g. the 'qkv' preset) or drop "
                             "the group.")
        out.append(group)
        taken.update(group)
    out += [(n,) for n in names if n not in taken]
    return out


def resolve(model: Any, config: LoraConfig, where: str) -> list[Unit]:
    """The adapters ``config`` puts on ``model`` (shapes from ``model.init`` run without allocating)."""
    if not isinstance(config, LoraConfig):
        raise ValueError(f"{where}: expected a cfx.lora.LoraConfig, got {type(config).__name__}.")
    if not (hasattr(model, "init") and hasattr(model, "axes")):
        raise ValueError(f"{where}: expected a cfx model (with init and axes), got {type(model).__name__}.")
    shapes = eval_shape(model.init, random.key(0))
    return resolve_shapes(shapes, model.axes(), config, where)
