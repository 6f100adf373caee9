"""The Evoformer's layers (AlphaFold 2 supplement, Algorithms 7-15): gated attention and its four
uses (MSA row attention with pair bias, MSA column attention, triangle attention around the starting
and the ending node), the transitions, the outer product mean and the triangle multiplicative
updates. Each works over the trailing dims, takes ``chunk_size`` (rows computed a chunk at a time),
and is split into the parts ``cfx.parallel.dap`` runs between its collectives (see ``evoformer``)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from cfx._src.nn.linear import Linear, split_keys
from cfx._src.nn.norm import LayerNorm
from cfx_kernels.fused_softmax import fused_softmax


# -- helpers -----------------------------------------------------------------------------------------
def chunked(fn: Callable[..., torch.Tensor], chunk_size: int | None, dims: tuple, *args: Any,
            out_dim: int | None = None) -> torch.Tensor:
    """``fn(*args)`` computed over chunks of ``chunk_size`` along each arg's dim in ``dims`` (None:
    passed whole), concatenated along the output's ``out_dim`` (default: the first arg's dim).
    ``fn`` must treat those rows independently."""
    first = next(i for i, d in enumerate(dims) if d is not None)
    n = args[first].shape[dims[first]]
    if chunk_size is None or chunk_size >= n:
        return fn(*args)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"Evoformer: chunk_size must be a positive int or None, got {chunk_size!r}.")
    outs = []
    for s in range(0, n, chunk_size):
        part = [a if d is None or a is None else a.narrow(d, s, min(chunk_size, n - s)) for a, d in zip(args, dims)]
        outs.append(fn(*part))
    return torch.cat(outs, dim=dims[first] if out_dim is None else out_dim)


def mask_of(mask: torch.Tensor | None, shape: tuple, name: str) -> torch.Tensor | None:
    """``mask`` as a bool tensor of ``shape`` (its leading dims broadcast), or a ValueError."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape[-2:]) != tuple(shape[-2:]):
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"Evoformer: {name} must be (..., {shape[-2]}, {shape[-1]}) to match the inputs, got {got}.")
    return mask.bool() if mask.dtype != torch.bool else mask


def _sigmoid_gate(lin: Linear, p: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(lin.apply(p, x))


# -- attention ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GatedAttention:
    """Gated multi-head self-attention along dim -2 of ``x`` ``(..., N, L, c_in)`` (each of the N
    rows attends over its L positions), with an optional bias ``(..., H, L, L)`` shared by the rows
    and a key mask ``(..., N, L)``. Params: ``q``, ``k``, ``v`` (no bias), ``gate``, ``out``."""

    c_in: int
    c_hidden: int
    n_heads: int
    impl: str = "auto"

    def init(self, key: torch.Tensor) -> dict:
        kq, kk, kv, kg, ko = split_keys(key, 5)
        hc = self.c_hidden * self.n_heads
        return {"q": self._proj(False).init(kq), "k": self._proj(False).init(kk), "v": self._proj(False).init(kv),
                "gate": self._proj(True).init(kg), "out": Linear(hc, self.c_in, axes_names=("heads", "embed")).init(ko)}

    def _proj(self, bias: bool) -> Linear:
        return Linear(self.c_in, self.c_hidden * self.n_heads, bias=bias, axes_names=("embed", "heads"))

    def axes(self) -> dict:
        return {"q": self._proj(False).axes(), "k": self._proj(False).axes(), "v": self._proj(False).axes(),
                "gate": self._proj(True).axes(), "out": Linear(1, 1, axes_names=("heads", "embed")).axes()}

    def apply(self, p: dict, x: torch.Tensor, bias: torch.Tensor | None, mask: torch.Tensor | None,
              chunk_size: int | None = None) -> torch.Tensor:
        """``(..., N, L, c_in)``; rows of N chunked by ``chunk_size``."""
        return chunked(lambda x, m: self._rows(p, x, bias, m), chunk_size, (-3, -2), x, mask)

    def _rows(self, p: dict, x: torch.Tensor, bias: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        H, c = self.n_heads, self.c_hidden
        proj = self._proj(False)
        heads = lambda t: t.unflatten(-1, (H, c)).transpose(-2, -3)  # noqa: E731  (..., N, H, L, c)
        q, k, v = (heads(proj.apply(p[n], x)) for n in ("q", "k", "v"))
        logits = (q * c ** -0.5) @ k.transpose(-1, -2)  # (..., N, H, L, L)
        a = fused_softmax(logits, None if bias is None else bias.unsqueeze(-4),
                          None if mask is None else mask[..., None, None, :], impl=self.impl)
        o = (a @ v).transpose(-2, -3).flatten(-2)  # (..., N, L, H c)
        o = _sigmoid_gate(self._proj(True), p["gate"], x) * o
        return Linear(H * c, self.c_in).apply(p["out"], o)


@dataclasses.dataclass(frozen=True)
class MSARowAttention:
    """Algorithm 7: attention along residues in each sequence, biased by the pair representation.
    Params: ``ln_m``, ``ln_z``, ``bias`` (``c_z -> heads``, no bias term) and the attention's."""

    c_m: int
    c_z: int
    c_hidden: int
    n_heads: int
    eps: float = 1e-5
    impl: str = "auto"

    @property
    def att(self) -> GatedAttention:
        return GatedAttention(self.c_m, self.c_hidden, self.n_heads, self.impl)

    def init(self, key: torch.Tensor) -> dict:
        ka, kb = split_keys(key, 2)
        return {"ln_m": LayerNorm(self.c_m).init(None), "ln_z": LayerNorm(self.c_z).init(None),
                "bias": self._bias.init(kb), **self.att.init(ka)}

    @property
    def _bias(self) -> Linear:
        return Linear(self.c_z, self.n_heads, bias=False, axes_names=("pair_embed", "heads"))

    def axes(self) -> dict:
        return {"ln_m": LayerNorm(self.c_m).axes(), "ln_z": LayerNorm(self.c_z, axis_name="pair_embed").axes(),
                "bias": self._bias.axes(), **self.att.axes()}

    def pair_bias(self, p: dict, z: torch.Tensor) -> torch.Tensor:
        """``(..., H, R', R)`` from ``z`` ``(..., R', R, c_z)`` (R' = every row, or a shard of them)."""
        zn = LayerNorm(self.c_z, eps=self.eps).apply(p["ln_z"], z)
        return self._bias.apply(p["bias"], zn).movedim(-1, -3)

    def attend(self, p: dict, m: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor | None,
               chunk_size: int | None = None) -> torch.Tensor:
        """The update of ``m`` ``(..., S', R, c_m)`` given the whole pair bias."""
        mn = LayerNorm(self.c_m, eps=self.eps).apply(p["ln_m"], m)
        return self.att.apply(p, mn, bias, mask, chunk_size)

    def apply(self, p: dict, m: torch.Tensor, z: torch.Tensor, mask: torch.Tensor | None = None,
              chunk_size: int | None = None) -> torch.Tensor:
        return self.attend(p, m, self.pair_bias(p, z), mask, chunk_size)


@dataclasses.dataclass(frozen=True)
class MSAColumnAttention:
    """Algorithm 8: attention along sequences at each residue. Params: ``ln`` and the attention's."""

    c_m: int
    c_hidden: int
    n_heads: int
    eps: float = 1e-5
    impl: str = "auto"

    @property
    def att(self) -> GatedAttention:
        return GatedAttention(self.c_m, self.c_hidden, self.n_heads, self.impl)

    def init(self, key: torch.Tensor) -> dict:
        return {"ln": LayerNorm(self.c_m).init(None), **self.att.init(key)}

    def axes(self) -> dict:
        return {"ln": LayerNorm(self.c_m).axes(), **self.att.axes()}

    def apply(self, p: dict, m: torch.Tensor, mask: torch.Tensor | None = None,
              chunk_size: int | None = None) -> torch.Tensor:
        """The update of ``m`` ``(..., S, R', c_m)``, residues chunked."""
        mt = LayerNorm(self.c_m, eps=self.eps).apply(p["ln"], m).transpose(-2, -3)  # (..., R', S, c)
        mask_t = None if mask is None else mask.transpose(-1, -2)
        return self.att.apply(p, mt, None, mask_t, chunk_size).transpose(-2, -3)


@dataclasses.dataclass(frozen=True)
class TriangleAttention:
    """Algorithms 13-14: ``starting=True`` -- in row i, query ij attends over keys ik with bias
    b_jk; ``starting=False`` -- in column j, query ij attends over keys kj with bias b_ki (the same
    computation on the transposed pair). Params: ``ln``, ``bias`` (``c_z -> heads``) and the
    attention's."""

    c_z: int
    c_hidden: int
    n_heads: int
    starting: bool = True
    eps: float = 1e-5
    impl: str = "auto"

    @property
    def att(self) -> GatedAttention:
        return GatedAttention(self.c_z, self.c_hidden, self.n_heads, self.impl)

    @property
    def _bias(self) -> Linear:
        return Linear(self.c_z, self.n_heads, bias=False, axes_names=("pair_embed", "heads"))

    def init(self, key: torch.Tensor) -> dict:
        ka, kb = split_keys(key, 2)
        return {"ln": LayerNorm(self.c_z).init(None), "bias": self._bias.init(kb), **self.att.init(ka)}

    def axes(self) -> dict:
        att = tree_map_names(self.att.axes(), {"embed": "pair_embed"})
        return {"ln": LayerNorm(self.c_z, axis_name="pair_embed").axes(), "bias": self._bias.axes(), **att}

    def normed(self, p: dict, z: torch.Tensor) -> torch.Tensor:
        """LayerNorm of ``z`` as this attention sees it (the ending node: transposed)."""
        zt = z if self.starting else z.transpose(-2, -3)
        return LayerNorm(self.c_z, eps=self.eps).apply(p["ln"], zt)

    def pair_bias(self, p: dict, zn: torch.Tensor) -> torch.Tensor:
        """``(..., H, R', R)`` from ``normed`` rows."""
        return self._bias.apply(p["bias"], zn).movedim(-1, -3)

    def attend(self, p: dict, zn: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor | None,
               chunk_size: int | None = None) -> torch.Tensor:
        """The update in ``normed``'s orientation, rows of ``zn`` chunked."""
        return self.att.apply(p, zn, bias, mask, chunk_size)

    def apply(self, p: dict, z: torch.Tensor, mask: torch.Tensor | None = None,
              chunk_size: int | None = None) -> torch.Tensor:
        zn = self.normed(p, z)
        mask = mask if mask is None or self.starting else mask.transpose(-1, -2)
        out = self.attend(p, zn, self.pair_bias(p, zn), mask, chunk_size)
        return out if self.starting else out.transpose(-2, -3)


# -- transitions and updates -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Transition:
    """Algorithms 9 / 15: ``Linear(relu(Linear(LayerNorm(x))))`` widening by ``n``. Params:
    ``ln``, ``fc1``, ``fc2``."""

    c: int
    n: int = 4
    eps: float = 1e-5
    axis_name: str = "embed"

    def _layers(self):
        return (LayerNorm(self.c, eps=self.eps, axis_name=self.axis_name),
                Linear(self.c, self.n * self.c, axes_names=(self.axis_name, "mlp")),
                Linear(self.n * self.c, self.c, axes_names=("mlp", self.axis_name)))

    def init(self, key: torch.Tensor) -> dict:
        ln, fc1, fc2 = self._layers()
        k1, k2 = split_keys(key, 2)
        return {"ln": ln.init(None), "fc1": fc1.init(k1), "fc2": fc2.init(k2)}

    def axes(self) -> dict:
        ln, fc1, fc2 = self._layers()
        return {"ln": ln.axes(), "fc1": fc1.axes(), "fc2": fc2.axes()}

    def apply(self, p: dict, x: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
        ln, fc1, fc2 = self._layers()
        return chunked(lambda x: fc2.apply(p["fc2"], torch.relu(fc1.apply(p["fc1"], ln.apply(p["ln"], x)))),
                       chunk_size, (-3,), x)


@dataclasses.dataclass(frozen=True)
class OuterProductMean:
    """Algorithm 10, masked: ``o_ij = sum_s w_sij a_si (x) b_sj / (eps + sum_s w_sij)`` with
    ``w_sij = mask_si mask_sj``, flattened ``a``-channel-major, then ``out``. Params: ``ln``, ``a``,
    ``b``, ``out`` (``c_hidden^2 -> c_z``)."""

    c_m: int
    c_z: int
    c_hidden: int
    eps: float = 1e-5
    opm_eps: float = 1e-3

    def _layers(self):
        return (LayerNorm(self.c_m, eps=self.eps), Linear(self.c_m, self.c_hidden, axes_names=("embed", "mlp")),
                Linear(self.c_hidden ** 2, self.c_z, axes_names=("mlp", "pair_embed")))

    def init(self, key: torch.Tensor) -> dict:
        ln, proj, out = self._layers()
        ka, kb, ko = split_keys(key, 3)
        return {"ln": ln.init(None), "a": proj.init(ka), "b": proj.init(kb), "out": out.init(ko)}

    def axes(self) -> dict:
        ln, proj, out = self._layers()
        return {"ln": ln.axes(), "a": proj.axes(), "b": proj.axes(), "out": out.axes()}

    def project(self, p: dict, m: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a, b)`` ``(..., S, R', c_hidden)``, masked rows zero."""
        ln, proj, _ = self._layers()
        mn = ln.apply(p["ln"], m)
        a, b = proj.apply(p["a"], mn), proj.apply(p["b"], mn)
        if mask is not None:
            w = mask[..., None].to(a.dtype)
            a, b = a * w, b * w
        return a, b

    def combine(self, p: dict, a: torch.Tensor, b: torch.Tensor, mask_a: torch.Tensor | None,
                mask_b: torch.Tensor | None, chunk_size: int | None = None) -> torch.Tensor:
        """The update ``(..., R_a, R_b, c_z)`` from ``a`` ``(..., S, R_a, c)`` and ``b`` ``(..., S, R_b,
        c)`` and their masks ``(..., S, R_*)``; rows of ``a`` chunked."""
        _, _, out = self._layers()
        S = a.shape[-3]

        def rows(a, mask_a):
            o = torch.einsum("...sic,...sjd->...ijcd", a, b).flatten(-2)  # (..., i, j, c c)
            if mask_a is None or mask_b is None:
                norm = a.new_full((), float(S))
            else:
                norm = torch.einsum("...si,...sj->...ij", mask_a.to(a.dtype), mask_b.to(a.dtype))[..., None]
            return out.apply(p["out"], o / (self.opm_eps + norm))
        return chunked(rows, chunk_size, (-2, -1), a, mask_a, out_dim=-3)

    def apply(self, p: dict, m: torch.Tensor, mask: torch.Tensor | None = None,
              chunk_size: int | None = None) -> torch.Tensor:
        a, b = self.project(p, m, mask)
        return self.combine(p, a, b, mask, mask, chunk_size)


@dataclasses.dataclass(frozen=True)
class TriangleMultiplication:
    """Algorithms 11-12: ``outgoing`` -- ``x_ij = sum_k a_ik * b_jk``; incoming -- ``x_ij = sum_k
    a_ki * b_kj``; ``a = sigmoid(a_gate(z)) * a_proj(z) * mask`` (b alike), the update
    ``sigmoid(gate(z)) * out(LayerNorm(x))``. Params: ``ln_in``, ``a_proj``, ``a_gate``, ``b_proj``,
    ``b_gate``, ``gate``, ``ln_out``, ``out``."""

    c_z: int
    c_hidden: int
    outgoing: bool = True
    eps: float = 1e-5

    def _proj(self) -> Linear:
        return Linear(self.c_z, self.c_hidden, axes_names=("pair_embed", "mlp"))

    def init(self, key: torch.Tensor) -> dict:
        k = split_keys(key, 6)
        proj = self._proj()
        return {"ln_in": LayerNorm(self.c_z).init(None), "a_proj": proj.init(k[0]), "a_gate": proj.init(k[1]),
                "b_proj": proj.init(k[2]), "b_gate": proj.init(k[3]),
                "gate": Linear(self.c_z, self.c_z, axes_names=("pair_embed", "pair_embed_out")).init(k[4]),
                "ln_out": LayerNorm(self.c_hidden).init(None),
                "out": Linear(self.c_hidden, self.c_z, axes_names=("mlp", "pair_embed")).init(k[5])}

    def axes(self) -> dict:
        proj = self._proj().axes()
        return {"ln_in": LayerNorm(self.c_z, axis_name="pair_embed").axes(), "a_proj": proj, "a_gate": proj,
                "b_proj": proj, "b_gate": proj,
                "gate": Linear(1, 1, axes_names=("pair_embed", "pair_embed_out")).axes(),
                "ln_out": LayerNorm(self.c_hidden, axis_name="mlp").axes(),
                "out": Linear(1, 1, axes_names=("mlp", "pair_embed")).axes()}

    def project(self, p: dict, z: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """``(zn, a, b)``: the normed pair and the masked, gated projections (``(..., R', R, c_hidden)``)."""
        zn = LayerNorm(self.c_z, eps=self.eps).apply(p["ln_in"], z)
        proj = self._proj()
        a = torch.sigmoid(proj.apply(p["a_gate"], zn)) * proj.apply(p["a_proj"], zn)
        b = torch.sigmoid(proj.apply(p["b_gate"], zn)) * proj.apply(p["b_proj"], zn)
        if mask is not None:
            w = mask[..., None].to(a.dtype)
            a, b = a * w, b * w
        return zn, a, b

    def combine(self, p: dict, zn: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                chunk_size: int | None = None) -> torch.Tensor:
        """The update at ``zn``'s positions. Outgoing: rows of ``zn`` and ``a`` (``(..., i, k, c)``) with
        every row of ``b`` (``(..., j, k, c)``); incoming: columns of ``zn`` and ``b`` (``(..., k, j, c)``)
        with every column of ``a`` (``(..., k, i, c)``). Chunks: rows (outgoing), columns (incoming)."""
        gate = Linear(self.c_z, self.c_z)
        ln_out, out = LayerNorm(self.c_hidden, eps=self.eps), Linear(self.c_hidden, self.c_z)

        def finish(zn, x):
            return torch.sigmoid(gate.apply(p["gate"], zn)) * out.apply(p["out"], ln_out.apply(p["ln_out"], x))
        if self.outgoing:
            return chunked(lambda zn, a: finish(zn, torch.einsum("...ikc,...jkc->...ijc", a, b)),
                           chunk_size, (-3, -3), zn, a)
        return chunked(lambda zn, b: finish(zn, torch.einsum("...kic,...kjc->...ijc", a, b)),
                       chunk_size, (-2, -2), zn, b)

    def apply(self, p: dict, z: torch.Tensor, mask: torch.Tensor | None = None,
              chunk_size: int | None = None) -> torch.Tensor:
        zn, a, b = self.project(p, z, mask)
        return self.combine(p, zn, a, b, chunk_size)


def tree_map_names(axes: Any, rename: dict) -> Any:
    """``axes`` (nested dicts of name tuples) with names renamed."""
    if isinstance(axes, dict):
        return {k: tree_map_names(v, rename) for k, v in axes.items()}
    return tuple(rename.get(a, a) for a in axes)
