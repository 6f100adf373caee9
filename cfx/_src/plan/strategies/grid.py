"""2D / 2.5D / 3D tensor parallelism (``tp=2d|2.5d|3d``): every block's activations and weights split
over the ``row`` x ``col`` (x ``dep``) grid (``cfx.parallel.tensor_parallel_grid``), its params laid
out by ``grid_specs``; wired with data parallelism and ZeRO."""
from __future__ import annotations

from typing import Any

from cfx._src.models.function import LossModel
from cfx._src.parallel.tp_block import GridBlock, grid_specs, tensor_parallel_grid
from cfx._src.plan.strategy import Strategy

GRID_AXES = {"2d": ("row", "col"), "2.5d": ("row", "col", "dep"), "3d": ("row", "col", "dep")}


class Grid(Strategy):
    name, axes = "grid", ("row", "col", "dep")

    def check_plan(self, plan) -> None:
        """``tp`` names exactly the grid axes the mesh has, its shape, and only the axes it is wired with."""
        grid = [a for a in self.axes if plan.has(a)]
        if plan.tp is None:
            if grid:
                raise ValueError(f"Plan: the axes {grid} of the mesh {dict(plan.mesh)} are a tensor-parallel grid; "
                                 "name its scheme: tp=2d (row, col), tp=2.5d or tp=3d (row, col, dep).")
            return
        want = GRID_AXES[plan.tp]
        if tuple(grid) != want:
            raise ValueError(f"Plan: tp={plan.tp} splits every block over the axes {want}; the mesh "
                             f"{dict(plan.mesh)} has {tuple(grid)}. Give the mesh exactly "
                             f"{', '.join(a + '=N' for a in want)} (and data=N).")
        q = plan.size("row")
        if plan.size("col") != q or (plan.tp == "3d" and plan.size("dep") != q):
            need = "row = col = dep (a cube)" if plan.tp == "3d" else "row = col (a square grid)"
            raise ValueError(f"Plan: tp={plan.tp} needs {need}; the mesh {dict(plan.mesh)} has "
                             + ", ".join(f"{a}={plan.size(a)}" for a in want) + ". Give those axes equal sizes.")
        other = [a for a in ("pipe", "expert", "seq", "model") if plan.has(a)]
        if other:
            raise ValueError(f"Plan: tp={plan.tp} is wired with data parallelism (and ZeRO) only, not with the "
                             f"axes {other} of the mesh {dict(plan.mesh)}; drop {', '.join(a + '=' for a in other)} "
                             "(or use Megatron's model= axis without tp=).")
        if plan.offload != "none" or plan.remat == "auto":
            raise ValueError(f"Plan: tp={plan.tp} does not take offload={plan.offload} / remat={plan.remat} yet; "
                             "use offload=none and remat=none, blocks or dots.")

    def check(self, plan, model, where: str) -> None:
        """The model's blocks are plain TransformerBlocks whose heads, features and hidden units split
        over the grid (``GridBlock.check``)."""
        if plan.tp is None:
            return
        if isinstance(model, LossModel):
            raise ValueError(f"{where}: tp={plan.tp} splits the TransformerBlocks of a model; the loss function "
                             f"{model.name!r} has none. Drop tp= and the grid axes (or pass a cfx model).")
        try:
            grid = tensor_parallel_grid(model, plan.tp)
        except ValueError as e:
            raise ValueError(f"{where}: {e} Drop tp= and the grid axes for this model.") from None
        for i, b in enumerate(grid.blocks if not isinstance(grid, GridBlock) else (grid,)):
            b.check(plan.size("row"), f"{where}, block {i}")

    def param_specs(self, plan, model, mesh) -> Any:
        """The grid's specs: the blocks split over row, col (, dep); the rest replicated."""
        return grid_specs(tensor_parallel_grid(model, plan.tp), mesh=mesh) if plan.tp is not None else None

    def sampling_form(self, plan, model) -> Any:
        return None if plan.tp is not None else model  # a grid block keeps no KV cache

    def parallelize(self, plan, model) -> Any:
        return tensor_parallel_grid(model, plan.tp) if plan.tp is not None else model
