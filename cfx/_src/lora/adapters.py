"""LoRA adapters as an ordinary params pytree: ``init``, ``axes``, ``attach``, ``merge``, ``unmerge``.

The adapters tree mirrors the params down to the parents of the adapted Linears: the adapter of
``blocks.0.attn.q`` sits at ``adapters["blocks"][0]["attn"]["q"] = {"A": (in, r), "B": (r, out)}``; a
``shared_a`` group's at ``...["attn"]["q+k+v"] = {"A": (in, r), "B": {"q": (r, out_q), ...}}``. Lists keep
their positions (``{}`` where a block has no adapter). ``A`` starts as peft's (kaiming-uniform with
``a=sqrt(5)`` on its ``(r, in)`` transpose: ``U(-1/sqrt(in), 1/sqrt(in))``), ``B`` at zero, both fp32.

``attach(params, adapters, config)`` returns the params with each adapted ``w`` a ``LoraWeight``, which
``Linear.apply`` runs as ``x @ w (+ b) + scale * (x A) B``; differentiating a loss of ``attach(params,
adapters, config)`` with respect to ``adapters`` trains the adapters alone, and the optimizer's state
covers them alone.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from cfx._src.core import random
from cfx._src.core import tree as tree_util
from cfx._src.lora.config import LoraConfig, Unit, join, resolve
from cfx._src.nn.lora_weight import LoraWeight
from cfx._src.precision.quant import QuantizedWeight
from cfx._src.transforms.shapes import eval_shape


def build(template: Any, at: dict[str, dict], path: str = "") -> Any:
    """A tree shaped like ``template`` (a params tree) down to the paths in ``at``, holding
    ``at[path]`` (``{adapter name: subtree}``) there; branches without adapters are pruned, list
    positions kept (``{}``). None when nothing is under ``template``."""
    here = dict(at.get(path, {}))
    if isinstance(template, dict):
        for k, v in template.items():
            sub = build(v, at, join(path, k))
            if sub is not None:
                here[k] = sub
        return here or None
    if type(template) in (list, tuple):
        subs = [build(v, at, join(path, i)) for i, v in enumerate(template)]
        if all(s is None for s in subs):
            return here or None
        return type(template)({} if s is None else s for s in subs)
    return here or None


def _template(model: Any) -> Any:
    return eval_shape(model.init, random.key(0))


def place(model: Any, units: list[Unit], make: Callable[[Unit], Any]) -> Any:
    """The adapters tree of ``model`` holding ``make(unit)`` at each unit's place."""
    at: dict[str, dict] = {}
    for u in units:
        at.setdefault(u.parent, {})[u.name] = make(u)
    return build(_template(model), at) or {}


def units_of(adapters: Any, config: LoraConfig, model: Any, where: str) -> list[Unit]:
    """The units of ``adapters``, checked to be ``init``'s for ``model`` and ``config`` (ValueError)."""
    units = resolve(model, config, where)
    ref = place(model, units, lambda u: {"A": 0, "B": 0 if len(u.members) == 1 else dict.fromkeys(u.members, 0)})
    tree_util.check_same_structure(f"{where}: adapters (make them with cfx.lora.init(model, config, key)) and "
                                   "the model's", ref, adapters)
    return units


def adapter_at(adapters: Any, path: str) -> Any:
    """The ``{"A", "B"}`` adapter at a unit's dotted ``path`` (list positions as numbers)."""
    for part in path.split("."):
        adapters = adapters[int(part)] if isinstance(adapters, (list, tuple)) else adapters[part]
    return adapters


def init(model: Any, config: LoraConfig, key: torch.Tensor) -> Any:
    """The adapters ``config`` puts on ``model`` (module doc): ``A`` drawn from ``key``, ``B`` zero."""
    units = resolve(model, config, "cfx.lora.init")
    keys = dict(zip((u.path for u in units), random.split(key, len(units))))
    r = config.r

    def make(u: Unit) -> dict:
        bound = 1.0 / math.sqrt(u.in_features)  # kaiming_uniform(a=sqrt(5)) on (r, in): gain sqrt(1/3)
        A = random.uniform(keys[u.path], (u.in_features, r), minval=-bound, maxval=bound)  # (in, r)
        Bs = [torch.zeros(r, n) for n in u.out_features]  # (r, out) each
        return {"A": A, "B": Bs[0] if len(u.members) == 1 else dict(zip(u.members, Bs))}

    return place(model, units, make)


def axes(model: Any, config: LoraConfig) -> Any:
    """The logical axes of ``init``'s adapters: ``A`` ``(in axis, None)``, ``B`` ``(None, out axis)`` of
    the base Linear's, so a rule that splits the base splits its adapter alike."""
    def make(u: Unit) -> dict:
        Bs = [(None, a) for a in u.out_axes]
        return {"A": (u.in_axis, None), "B": Bs[0] if len(u.members) == 1 else dict(zip(u.members, Bs))}

    return place(model, resolve(model, config, "cfx.lora.axes"), make)


def _is_unit(node: Any) -> bool:
    return isinstance(node, dict) and set(node) == {"A", "B"} and isinstance(node["A"], torch.Tensor)


def _in_out(w: Any) -> tuple[int, int] | None:
    if isinstance(w, QuantizedWeight):
        w = w.q
    return tuple(w.shape) if isinstance(w, torch.Tensor) and w.dim() == 2 else None


def _members(where: str, params: dict, path: str, name: str, unit: dict, r: int) -> list[tuple[str, torch.Tensor]]:
    """``[(member, B)]`` of the adapter ``unit`` at ``path`` over the Linears in ``params``, its shapes
    checked against theirs (ValueErrors name the leaf and the fix)."""
    A, B = unit["A"], unit["B"]
    members = name.split("+")
    Bs = [B] if len(members) == 1 else (B if isinstance(B, dict) else {})
    if len(members) > 1 and (not isinstance(B, dict) or sorted(B) != sorted(members)):
        raise ValueError(f"{where}: the shared-A adapter {path!r} needs B as {{{', '.join(map(repr, members))}: "
                         f"tensor}}, got {type(B).__name__}{sorted(B) if isinstance(B, dict) else ''}.")
    if A.dim() != 2 or A.shape[1] != r:
        raise ValueError(f"{where}: {path}.A has shape {tuple(A.shape)}, expected (in, r={r}); pass the config the "
                         "adapters were made with (cfx.lora.init(model, config, key)).")
    out = []
    for m in members:
        b = Bs[0] if len(members) == 1 else Bs[m]
        lin = params.get(m)
        w = lin.get("w") if isinstance(lin, dict) else None
        if isinstance(w, LoraWeight):
            raise ValueError(f"{where}: {join(path.rpartition('.')[0], m)}.w already carries an adapter (a LoraWeight); "
                             "attach adapters to the plain params, once.")
        shape = _in_out(w)
        if shape is None:
            raise ValueError(f"{where}: the adapter {path!r} names {join(path.rpartition('.')[0], m)!r}, which is not a "
                             "Linear with a 2-D weight in these params: adapters of another structure (make them "
                             "with cfx.lora.init for this model).")
        want = (r, shape[1])
        if A.shape[0] != shape[0] or not isinstance(b, torch.Tensor) or tuple(b.shape) != want:
            got = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
            raise ValueError(f"{where}: the adapter {path!r} (A {tuple(A.shape)}, B {got}) does not fit "
                             f"{join(path.rpartition('.')[0], m)}.w of shape {shape} (expected A {(shape[0], r)}, "
                             f"B {want}): adapters of another model or config.")
        out.append((m, b))
    return out


def rewrite(where: str, params: Any, adapters: Any, config: LoraConfig,
            visit: Callable[[str, Any, torch.Tensor, torch.Tensor, int], Any]) -> Any:
    """``params`` with each adapted Linear's ``w`` replaced by ``visit(w path, w, A, B, adapter index)``;
    ValueErrors name the leaf where ``adapters`` and ``params`` part ways."""
    if not isinstance(config, LoraConfig):
        raise ValueError(f"{where}: expected a cfx.lora.LoraConfig, got {type(config).__name__}.")
    count = [0]

    def walk(p: Any, a: Any, path: str) -> Any:
        if isinstance(a, dict):
            if not isinstance(p, dict):
                raise _apart(where, path, p)
            out = dict(p)
            for k, sub in a.items():
                here = join(path, k)
                if _is_unit(sub):
                    for m, b in _members(where, p, here, k, sub, config.r):
                        out[m] = {**p[m], "w": visit(join(join(path, m), "w"), p[m]["w"], sub["A"], b, count[0])}
                    count[0] += 1
                elif k in p:
                    out[k] = walk(p[k], sub, here)
                else:
                    raise _apart(where, here, None)
            return out
        if type(a) in (list, tuple):
            if type(p) not in (list, tuple) or len(p) != len(a):
                raise _apart(where, path, p)
            return type(p)(walk(pi, ai, join(path, i)) for i, (pi, ai) in enumerate(zip(p, a)))
        raise _apart(where, path, p, leaf=a)

    out = walk(params, adapters, "")
    if not count[0]:
        raise ValueError(f"{where}: the adapters hold no adapter ({{'A', 'B'}} dict); make them with "
                         "cfx.lora.init(model, config, key).")
    return out


def _apart(where: str, path: str, p: Any, leaf: Any = None) -> ValueError:
    what = (f"a {type(leaf).__name__} outside any {{'A', 'B'}} adapter" if leaf is not None
            else "no such node in the params" if p is None else f"a {type(p).__name__} in the params")
    return ValueError(f"{where}: the adapters and the params part ways at {path or '<root>'!r} ({what}): "
                      "adapters of another structure; make them with cfx.lora.init for this model and config.")


def attach(params: Any, adapters: Any, config: LoraConfig, *, key: torch.Tensor | None = None) -> Any:
    """``params`` with each adapted Linear weight a ``LoraWeight(w, A, B)`` (module doc); ``key`` draws
    the dropout on the adapters' input (``config.dropout``; None: no dropout, for evaluation). The
    members of a ``shared_a`` group share one dropout mask, as in peft's fused module."""
    keys = {}

    def visit(path: str, w: Any, A: torch.Tensor, B: torch.Tensor, i: int) -> LoraWeight:
        k = None
        if key is not None and config.dropout:
            k = keys.setdefault(i, random.fold_in(key, i))
        return LoraWeight(w, A, B, config.scale, config.dropout, k)

    return rewrite("cfx.lora.attach", params, adapters, config, visit)


def merge(params: Any, adapters: Any, config: LoraConfig) -> Any:
    """``params`` with each adapted weight ``w + scale * A @ B`` in ``w``'s dtype (peft's
    ``merge_and_unload``): plain params that run at the base model's cost."""
    return rewrite("cfx.lora.merge", params, adapters, config,
                   lambda path, w, A, B, i: LoraWeight(w, A, B, config.scale).merged())


def unmerge(params: Any, adapters: Any, config: LoraConfig) -> Any:
    """``merge``'s inverse: each adapted weight ``w - scale * A @ B`` (equal up to rounding)."""
    return rewrite("cfx.lora.unmerge", params, adapters, config,
                   lambda path, w, A, B, i: LoraWeight(w, A, B, config.scale).merged(-1.0))

