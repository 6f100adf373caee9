"""2D, 2.5D and 3D tensor parallelism of a ``TransformerBlock`` as a layer transform
(``GridBlock``), and of a whole model (``tensor_parallel_grid``); the grids are ``tp_grid``'s.

    tp = cfx.parallel.tensor_parallel_grid(model, mode="2d")      # axes ("row", "col")
    specs = cfx.parallel.grid_specs(tp, mesh=mesh)               # the params' specs on the grid
    loss = cfx.shard_map(lambda p, t: tp.loss(p, t[:, :-1], t[:, 1:]), mesh=mesh,
                         in_specs=(specs, P("data")), out_specs=P())  # loss is replicated over the grid

Inside a block every activation is split over the whole grid (``B T C / q^2`` per rank in 2D,
``/ (d q^2)`` in 2.5D, ``/ q^3`` in 3D) and every weight too (``/ q^2``, ``/ q^2``, ``/ q^3``). The
norms reduce their statistics over the split features (an all-reduce each way), the attention runs
on this rank's heads and batch rows, the Linears are ``tp_grid``'s. Outside the blocks the model
runs replicated over the grid, as it does outside Megatron's: the first block splits its input (a
local slice; an all-gather of the cotangent backward), the last gathers its output, so the
embeddings, the head and the loss are unchanged and every gradient comes out whole.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from cfx._src.core import random
from cfx._src.core import tree as tree_util
from cfx._src.lax import collectives as lax
from cfx._src.mesh.layout import check_spec
from cfx._src.mesh.spec import P, is_spec
from cfx._src.models.parts import hook, sequence_part
from cfx._src.nn.attention import attention
from cfx._src.nn.block import TransformerBlock
from cfx._src.nn.linear import split_keys
from cfx._src.nn.mlp import activation
from cfx._src.nn.norm import LayerNorm
from cfx._src.nn.rope import apply_rope, rope_cos_sin
from cfx._src.parallel.tp_grid import LinearSplit, TensorGrid, allsum, vary
from cfx._src.transforms.shapes import eval_shape


def gather_input(x: torch.Tensor, s: LinearSplit) -> torch.Tensor:
    """A Linear's input as its product needs it (gathered once for q, k and v alike)."""
    axis, dim = s.x_gather
    return lax.all_gather(x, axis, dim=dim, tiled=True)


def project(x: torch.Tensor, p: dict, s: LinearSplit, where: str) -> torch.Tensor:
    """``x @ w + b`` of a gathered input ``x``: the weight gathered over ``s.w_gather``, the product
    reduce-scattered over ``s.scatter`` (3D), the bias added on the output's layout."""
    w = p["w"]
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"{where}: the weight is a {type(w).__name__} (quantized or LoRA), which grid tensor "
                         "parallelism does not split; merge or dequantize it first.")
    w = lax.all_gather(vary(w, s.w_vary), s.w_gather, dim=0, tiled=True)  # (in / ..., out / q)
    y = x @ w
    if s.scatter is not None:
        y = lax.psum_scatter(y, s.scatter, dim=0, tiled=True)
    return y + vary(p["b"], s.b_vary) if "b" in p else y


@dataclasses.dataclass(frozen=True)
class GridBlock:
    """A ``TransformerBlock`` split over a ``TensorGrid``: same ``init`` / ``axes`` (params are global;
    shard them with ``specs()``), ``apply`` inside ``shard_map``. ``enter``: the input arrives
    replicated over the grid (else already in ``grid.a``'s layout); ``leave``: return it replicated."""

    block: Any
    grid: TensorGrid
    enter: bool = True
    leave: bool = True

    def init(self, key: torch.Tensor) -> dict:
        return self.block.init(key)

    def axes(self) -> dict:
        return self.block.axes()

    def specs(self) -> dict:
        """The block's params' specs on the grid (same structure as ``init``'s)."""
        s_in, s_out = self.grid.linear(self.grid.a), self.grid.linear(self.grid.inner)
        norm = P(self.grid.a.feature)
        out = {}
        for name, sub in self.block.axes().items():  # norm1 / attn / norm2 / mlp
            if name.startswith("norm"):
                out[name] = {k: norm for k in sub}
                continue
            last = "o" if name == "attn" else self.block._layers()["mlp"].out_name  # back into grid.a
            out[name] = {}
            for lin, leaves in sub.items():  # q, k, v, o / fc, proj / gate, up, down
                s = s_out if lin == last else s_in
                out[name][lin] = {k: s.w_spec if k == "w" else s.b_spec for k in leaves}
        return out

    def check(self, q: int, where: str) -> None:
        """ValueError unless the block's heads, features and MLP hidden units split over the grid."""
        layers = self.block._layers()
        attn, mlp = layers["attn"], layers["mlp"]
        cube = self.grid.mode == "3d"
        need = [("n_heads", attn.n_heads, q), ("n_kv_heads", attn.kv_heads, q),
                ("features", attn.features, q * q if cube else q), ("mlp hidden", mlp.hidden, q * q if cube else q)]
        if cube:
            need.append(("n_heads * head_dim", attn.n_heads * attn.dim, q * q))
        for what, size, n in need:
            if size % n:
                raise ValueError(f"{where}: {self.grid.mode} tensor parallelism over {self.grid.axes} with q={q}: the "
                                 f"block's {what}={size} is not divisible by {n}; use a mesh whose grid divides it.")

    def apply(self, params: dict, x: torch.Tensor, *, mask: torch.Tensor | None = None,
              positions: torch.Tensor | None = None, key: torch.Tensor | None = None,
              cache=None) -> torch.Tensor:
        # x (B, T, C) replicated over the grid (enter) or this rank's block of grid.a -> the same
        where, g, blk = "GridBlock.apply", self.grid, self.block
        if cache is not None:
            raise ValueError(f"{where}: a KV cache under {g.mode} tensor parallelism; decode with the unsplit or "
                             "Megatron (cfx.parallel.tensor_parallel) model.")
        q, d = g.sizes(where)
        self.check(q, where)
        n_rows = q * d  # the batch's ranks: (row), (dep, row); 3D's d is q
        if self.enter:
            if x.shape[0] % n_rows:
                raise ValueError(f"{where}: the batch of {x.shape[0]} rows does not split over the {n_rows} ranks "
                                 f"of axes {g.a.batch} ({g.mode}); use a batch (per data rank) that is a multiple "
                                 f"of {n_rows}.")
            x = g.enter(x)
        full = (x.shape[0] * n_rows, x.shape[1], x.shape[2] * q)  # the (B, T, C) one device sees
        layers = blk._layers()
        k_attn = k_mlp = None
        if key is not None and blk.dropout > 0.0:
            k_attn, k_mlp = split_keys(key, 2)
        norm1, norm2 = (lambda h, n=n: self._norm(layers[n], params[n], h) for n in ("norm1", "norm2"))
        h = self._attention(params["attn"], x if blk.post_norm else norm1(x), mask, positions)
        x = x + self._dropout(h, k_attn, full)
        x = norm1(x) if blk.post_norm else x
        h = self._mlp(params["mlp"], x if blk.post_norm else norm2(x))
        x = x + self._dropout(h, k_mlp, full)
        x = norm2(x) if blk.post_norm else x
        return g.leave(x) if self.leave else x

    def _norm(self, layer: Any, p: dict, x: torch.Tensor) -> torch.Tensor:
        """LayerNorm / RMSNorm over features split over ``grid.a.feature``: each statistic's partial
        sums all-reduced (both ways); scale and bias pvary'd over the batch's axes."""
        axis, n = self.grid.a.feature, layer.features
        if isinstance(layer, LayerNorm):  # statistics in fp32 at least
            h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
            mean = allsum(h.sum(-1, keepdim=True), axis) / n
            c = h - mean
            y = c * torch.rsqrt(allsum((c * c).sum(-1, keepdim=True), axis) / n + layer.eps)
        else:  # RMSNorm: HF Llama's, the statistic in fp32 whatever x's dtype (cfx_kernels.norms)
            h = x.float()
            y = h * torch.rsqrt(allsum((h * h).sum(-1, keepdim=True), axis) / n + layer.eps)
        batch = self.grid.a.batch
        y = y.to(x.dtype) * vary(p["scale"], batch)
        return y + vary(p["bias"], batch) if "bias" in p else y

    def _attention(self, p: dict, x: torch.Tensor, mask, positions) -> torch.Tensor:
        # x: this rank's block of grid.a -> q, k, v in grid.inner (heads split) -> o back in grid.a
        g, attn = self.grid, self.block._layers()["attn"]
        s_in, s_out = g.linear(g.a), g.linear(g.inner)
        h = gather_input(x, s_in)
        qkv = [project(h, p[n], s_in, f"GridBlock attn.{n}") for n in ("q", "k", "v")]
        b, T = qkv[0].shape[:2]
        D = attn.dim
        q_, k_, v_ = (t.view(b, T, -1, D) for t in qkv)  # (b, T, heads here, D)
        if attn.rope:
            pos = torch.arange(T) if positions is None else positions
            pos = g.rows(pos, g.inner) if pos.dim() == 2 else pos
            cos, sin = rope_cos_sin(pos.to(x.device), D, theta=attn.rope_theta, dtype=q_.dtype)
            q_, k_ = apply_rope(q_, cos, sin), apply_rope(k_, cos, sin)
        if mask is not None:
            mask = g.rows(mask, g.inner)
        out = attention(q_, k_, v_, causal=attn.causal, mask=mask, impl=attn.impl)  # (b, T, heads here, D)
        return project(gather_input(out.reshape(b, T, -1), s_out), p["o"], s_out, "GridBlock attn.o")

    def _mlp(self, p: dict, x: torch.Tensor) -> torch.Tensor:
        g, mlp = self.grid, self.block._layers()["mlp"]
        s_in, s_out = g.linear(g.a), g.linear(g.inner)
        h = gather_input(x, s_in)
        if mlp.activation == "swiglu":
            h = F.silu(project(h, p["gate"], s_in, "GridBlock mlp.gate")) * project(h, p["up"], s_in,
                                                                                   "GridBlock mlp.up")
        else:
            h = activation(mlp.activation, project(h, p["fc"], s_in, "GridBlock mlp.fc"))
        out = mlp.out_name
        return project(gather_input(h, s_out), p[out], s_out, f"GridBlock mlp.{out}")

    def _dropout(self, h: torch.Tensor, key: torch.Tensor | None, full: tuple) -> torch.Tensor:
        """One device's dropout of the residual branch: its mask for the whole ``(B, T, C)``, this
        rank's block of it (so the same key drops the same elements on every layout)."""
        if key is None:
            return h
        rate = self.block.dropout
        keep = self.grid.block_of(random.bernoulli(key, 1.0 - rate, full, device=h.device), self.grid.a)
        return torch.where(keep, h / (1.0 - rate), torch.zeros((), dtype=h.dtype, device=h.device))


def tensor_parallel_grid(model: Any, mode: str = "2d", *, axes: tuple[str, ...] | None = None) -> Any:
    """``model`` with every ``TransformerBlock`` split over a 2D / 2.5D / 3D grid of mesh axes
    ``axes`` (default ``("row", "col")``, ``("row", "col", "dep")``); a lone block becomes a
    ``GridBlock``. The first block splits its input and the last gathers its output, so the rest of the
    model (embeddings, head, loss) runs replicated over the grid. Shard the params with
    ``grid_specs(result, mesh=mesh)``; the batch splits over data axes only."""
    grid = TensorGrid(mode, axes)
    if isinstance(model, TransformerBlock):
        _check_block(model, 0, type(model).__name__)
        return GridBlock(model, grid)
    name, blocks = type(model).__name__, getattr(model, "blocks", None)
    if not isinstance(blocks, tuple) or not blocks:
        raise ValueError(f"tensor_parallel_grid: {name} has no blocks tuple to split; pass a model speaking the "
                         "parts protocol (GPT-2, Llama, ViT, ...) or a TransformerBlock.")
    if hook(model, "logits_axis") is not None or getattr(sequence_part(model), "axis", None) is not None:
        raise ValueError(f"tensor_parallel_grid: {name} already splits its vocabulary or sequence over a mesh axis; "
                         "apply the grid to the plain model.")
    for i, b in enumerate(blocks):
        _check_block(b, i, name)
    n = len(blocks)
    return dataclasses.replace(model, blocks=tuple(
        GridBlock(b, grid, enter=i == 0, leave=i == n - 1) for i, b in enumerate(blocks)))


def _check_block(b: Any, i: int, name: str) -> None:
    if not isinstance(b, TransformerBlock) or b.moe is not None:
        what = "a mixture-of-experts block" if isinstance(b, TransformerBlock) else type(b).__name__
        raise ValueError(f"tensor_parallel_grid: {name}'s block {i} is {what}; the grid splits plain "
                         "TransformerBlocks (apply it before remat / ZeRO-3 wrappers).")


def grid_specs(model: Any, *, mesh=None) -> Any:
    """The params' specs of a ``tensor_parallel_grid`` model (or ``GridBlock``): the blocks' on the grid,
    everything else replicated. With ``mesh``, a ValueError names the first leaf whose shape the grid
    does not divide."""
    if isinstance(model, GridBlock):
        specs = model.specs()
    else:
        blocks = getattr(model, "blocks", ())
        if not blocks or not all(isinstance(b, GridBlock) for b in blocks):
            raise ValueError("grid_specs: pass the model tensor_parallel_grid returned (its blocks are GridBlocks), "
                             f"got {type(model).__name__}.")
        specs = tree_util.map(lambda a: P(), model.axes(), is_leaf=tree_util.is_axes_leaf)
        specs["blocks"] = [b.specs() for b in blocks]
    if mesh is not None:
        shapes = eval_shape(model.init, random.key(0))
        for (path, leaf), spec in zip(tree_util.flatten_with_path(shapes)[0], tree_util.leaves(specs, is_leaf=is_spec)):
            check_spec(path, tuple(leaf.shape), spec, mesh, "grid_specs")
    return specs
