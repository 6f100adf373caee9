"""``Rules``: logical axis names -> mesh axes, turning ``model.axes()`` into specs.

    rules = cfx.Rules({"batch": "data", "mlp": "model", "heads": "model", "kv_heads": "model"})
    param_specs = rules.specs(model.axes())     # pytree of P, same structure as the params
    batch_spec = rules.spec(("batch", None))    # P("data", None)

Names the rules do not mention are replicated. Data parallelism and Megatron tensor
parallelism are rules, not model rewrites.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from cfx._src.core import tree as tree_util
from cfx._src.mesh.spec import P


class Rules:
    def __init__(self, mapping: Mapping[str, str | Sequence[str] | None]):
        norm = {}
        for logical, mesh_axes in mapping.items():
            if not isinstance(logical, str):
                raise ValueError(f"Rules: logical axis names must be strings, got {logical!r}.")
            if mesh_axes is None:
                norm[logical] = ()
            elif isinstance(mesh_axes, str):
                norm[logical] = (mesh_axes,)
            else:
                norm[logical] = tuple(mesh_axes)
        self.mapping: dict[str, tuple[str, ...]] = norm

    def __repr__(self) -> str:
        return f"Rules({ {k: (v[0] if len(v) == 1 else (v or None)) for k, v in self.mapping.items()} })"

    def spec(self, logical: Sequence[str | None], *, path: str = "<value>", mesh=None) -> P:
        """The spec of one tensor whose dims have the logical names ``logical``."""
        entries, used = [], []
        for name in logical:
            axes = self.mapping.get(name, ()) if name is not None else ()
            used.extend(axes)
            entries.append(axes if len(axes) > 1 else (axes[0] if axes else None))
        dup = sorted({a for a in used if used.count(a) > 1})
        if dup:
            raise ValueError(f"Rules: leaf {path!r} with logical axes {tuple(logical)} maps mesh axis "
                             f"{dup[0]!r} to two dimensions under {self!r}; map at most one of its "
                             "logical axes to it.")
        if mesh is not None:
            for a in used:
                if a not in mesh.shape:
                    raise ValueError(f"Rules: leaf {path!r} maps to unknown mesh axis {a!r} under {self!r}; "
                                     f"{mesh!r} has axes {list(mesh.axis_names)}.")
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    def specs(self, axes_tree: Any, *, mesh=None) -> Any:
        """A pytree of specs from a pytree of logical-axis tuples (e.g. ``model.axes()``)."""
        return tree_util.map_with_path(lambda path, names: self.spec(names, path=path, mesh=mesh),
                                       axes_tree, is_leaf=tree_util.is_axes_leaf)
