"""FP8 training matmuls: ``fp8_linear(x, w, recipe)``, the three GEMMs of a Linear in float8.

A Linear's step runs three matmuls: the output ``y = x w`` and, in backward, the input's gradient
``gy w^T`` and the weight's ``x^T gy``. A recipe says, for each operand of each, whether it is cast
to float8 -- e4m3 (more mantissa, range 448) or e5m2 (more range, 57344) -- and with one scale for the
whole tensor or one per row along the GEMM's reduction dimension, or kept in high precision:

======================  ============  ============  =================  ==============================
recipe                  x, w (fwd)    gy (bwd)      w for gy w^T       x, gy for x^T gy
======================  ============  ============  =================  ==============================
``tensorwise``          e4m3, tensor  e5m2, tensor  e4m3, tensor       e4m3 / e5m2, tensor
``rowwise``             e4m3, row     e4m3, row     e4m3, row          e4m3, row
``rowwise_gw_hp``       e4m3, row     e4m3, row     e4m3, tensor       high precision (the GEMM too)
======================  ============  ============  =================  ==============================

The scale of a tensor (or row) is ``finfo(dtype).max / max(amax, 1e-12)``, computed in fp64 and
rounded to fp32 -- for the row-wise recipes rounded down to a power of two, so scaling loses no
mantissa bits -- and the cast saturates: ``clamp(x * scale, -max, max)`` in fp32, then to float8.
The GEMM is ``torch._scaled_mm`` on the float8 operands with the inverse scales (it runs on the CPU
too). Row-wise products come out in bf16 (fp32 where the inputs were fp16 / fp32 is then a cast of
it, as the fast kernels give bf16 only); the gradients' row-wise GEMMs apply their scales after an
unscaled product (a separate multiply, exact accumulation), the output's inside it. These are
torchao's numerics (its ``Float8Linear`` under the same recipe names, ``rowwise_with_gw_hp`` there):
``cfx_tests/test_nn_fp8.py`` holds the two equal bit for bit on the CPU, and each equal to the
spec built from dequantised operands.

Each operand is scaled from the dtype it arrives in; the outputs and the input's gradient are in the
input's dtype, the weight's gradient in the weight's.

Split over a mesh (``Split``: the axes the tokens, ``w``'s input and its output dimension are split over),
a rank scales its piece by the amax of the whole tensor -- or of the whole row along the reduction
dimension -- that one device would take: the piece's amax all-reduced (max) over the axes the scale's
extent spans. So every rank's float8 operands are slices of one device's, bit for bit.
"""
from __future__ import annotations

import dataclasses

import torch

from cfx._src.core import tree as tree_util
from cfx._src.lax import comm, groups

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12


@dataclasses.dataclass(frozen=True)
class Cast:
    """How a GEMM operand is cast: to ``dtype`` (None: kept in high precision), one scale per row
    along the GEMM's reduction dimension (``rowwise``) or one for the tensor."""

    dtype: torch.dtype | None
    rowwise: bool = False


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The casts of a Linear's three GEMMs (module doc): ``y = x w`` (``x``, ``w``), ``gx = gy w^T``
    (``gy``, ``w_gx``), ``gw = x^T gy`` (``x_gw``, ``gy_gw``); ``pow2``: scales rounded down to powers
    of two."""

    name: str
    x: Cast
    w: Cast
    gy: Cast
    w_gx: Cast
    x_gw: Cast
    gy_gw: Cast
    pow2: bool = False


_T4, _T5, _R4, _HP = Cast(E4M3), Cast(E5M2), Cast(E4M3, True), Cast(None)
RECIPES = {
    "tensorwise": Recipe("tensorwise", _T4, _T4, _T5, _T4, _T4, _T5),
    "rowwise": Recipe("rowwise", _R4, _R4, _R4, _R4, _R4, _R4, pow2=True),
    "rowwise_gw_hp": Recipe("rowwise_gw_hp", _R4, _R4, _R4, _T4, _HP, _HP, pow2=True),
}


@dataclasses.dataclass(frozen=True)
class Split:
    """The mesh axes a Linear's operands are split over (module doc): ``tokens``, the rows of ``x`` and its
    gradients (the batch's axes); ``k``, ``w``'s first dim and ``x``'s last (a row-parallel Linear's);
    ``n``, ``w``'s second and the output's last (a column-parallel Linear's). Empty: one device's."""

    tokens: tuple[str, ...] = ()
    k: tuple[str, ...] = ()
    n: tuple[str, ...] = ()


ONE_DEVICE = Split()


def recipe(name: str | Recipe) -> Recipe:
    if isinstance(name, Recipe):
        return name
    if name not in RECIPES:
        raise ValueError(f"cfx.amp fp8: unknown recipe {name!r}; use one of {', '.join(RECIPES)}.")
    return RECIPES[name]


# -- scales and casts -----------------------------------------------------------------------------------
def scale_of(x: torch.Tensor, dtype: torch.dtype, dim: int | None = None, pow2: bool = False,
             over: tuple[str, ...] = ()) -> torch.Tensor:
    """``finfo(dtype).max / amax`` of ``x`` (``dim``: one per slice along it, kept as a size-1 dim), fp32; the
    amax taken over the pieces of ``x`` on the ranks of the mesh axes ``over`` too."""
    with torch.no_grad():
        amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
        if over:
            amax = comm.all_reduce(amax.float(), groups.axes(over, "cfx fp8 amax"), "max")
        return scale_from_amax(amax, dtype, pow2)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, pow2: bool = False) -> torch.Tensor:
    """``finfo(dtype).max / amax`` in fp64, rounded to fp32 (``pow2``: down to a power of two); an amax under
    1e-12 counts as 1e-12."""
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=EPS)).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def to_fp8(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """``x * scale`` (in fp32) saturated to ``dtype``'s finite range, in ``dtype``."""
    big = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-big, big).to(dtype)


def quantize(x: torch.Tensor, cast: Cast, dim: int, pow2: bool, over: tuple[str, ...] = (),
             along: tuple[str, ...] = (), scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in ``cast.dtype`` and its scale (per slice along ``dim`` where ``cast.rowwise``); ``x`` split over
    the mesh axes ``over``, of which ``along`` split ``dim`` (what a row-wise scale spans). ``scale`` given (delayed
    scaling's): that one, no amax taken."""
    if scale is None:
        scale = scale_of(x, cast.dtype, dim if cast.rowwise else None, pow2, along if cast.rowwise else over)
    return to_fp8(x, cast.dtype, scale), scale


# -- one GEMM ---------------------------------------------------------------------------------------------
def gemm(a: torch.Tensor, a_cast: Cast, b: torch.Tensor, b_cast: Cast, pow2: bool, out_dtype: torch.dtype,
         fast: bool, split: tuple[tuple[str, ...], ...] = ((), (), ()),
         scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
         b_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``a @ b`` for 2-D ``a`` ``(M, K)`` and ``b`` ``(K, N)`` with each operand cast as told (row-wise: ``a``
    per row, ``b`` per column, along ``K``); both kept in high precision: a plain matmul in ``out_dtype``.
    ``fast``: the output GEMM (scales applied inside the product), else a gradient's (module doc). ``split``:
    the mesh axes ``M``, ``K`` and ``N`` are split over; ``scales``: the operands' given scales (delayed scaling);
    ``b_fp8``: ``b`` cast already (``(b8, scale)``, a per-tensor cast: ZeRO-3's float8 all-gather's)."""
    if a_cast.dtype is None:
        return a.to(out_dtype) @ b.to(out_dtype)
    m, k, n = split
    a8, sa = quantize(a, a_cast, -1, pow2, m + k, k, scales[0])
    b8, sb = quantize(b, b_cast, 0, pow2, k + n, k, scales[1]) if b_fp8 is None else b_fp8
    a8, b8 = a8.contiguous(), b8.t().contiguous().t()  # (row-major times column-major: what _scaled_mm takes)
    if a_cast.rowwise != b_cast.rowwise:  # one row-wise: the other's single scale repeated along its side
        if a_cast.rowwise:
            sb = sb.repeat(b.shape[1]).reshape(1, -1)
        else:
            sa = sa.repeat(a.shape[0]).reshape(-1, 1)
    ia, ib = sa.reciprocal(), sb.reciprocal()
    rowwise = ia.dim() == 2 and ib.dim() == 2 and ia.shape == (a.shape[0], 1) and ib.shape == (1, b.shape[1])
    dtype = torch.bfloat16 if rowwise and out_dtype in (torch.float16, torch.float32) else out_dtype
    if rowwise and not fast:  # the product unscaled, then its scales: exact accumulation
        one = ia.new_ones(())
        out = torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=dtype)
        out *= ia * ib
    else:
        out = torch._scaled_mm(a8, b8, scale_a=ia, scale_b=ib, out_dtype=dtype)
    return out.to(out_dtype)


# -- the Linear ---------------------------------------------------------------------------------------------
class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, r: Recipe, s: Split, d, w8=None, sw=None) -> torch.Tensor:
        ctx.save_for_backward(x, w, w8)  # (w8: a view of ZeRO-3's float8 buffer, re-gathered for backward)
        ctx.recipe, ctx.split, ctx.delayed, ctx.sw = r, s, d, sw
        x2 = x.reshape(-1, x.shape[-1])
        given = (None, None)
        if d is not None:  # delayed scaling: the scales the history gave; this step's amaxes noted for the next
            sx, sw_, _ = d.scales()
            d.observe(0, x2), d.observe(1, w)
            given = (sx, sw_)
        y = gemm(x2, r.x, w, r.w, r.pow2, x.dtype, True, (s.tokens, s.k, s.n), given,
                 None if w8 is None else (w8, sw))
        return y.reshape(*x.shape[:-1], w.shape[1])

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, w, w8 = ctx.saved_tensors
        r, s, d = ctx.recipe, ctx.split, ctx.delayed
        gy2 = gy.reshape(-1, gy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        on_gx, on_gw = (None, None), (None, None)
        if d is not None:
            sx, sw, sg = d.scales()
            d.observe(2, gy2)
            on_gx, on_gw = (sg, sw), (sg, sx)
        gx = gemm(gy2, r.gy, w.t(), r.w_gx, r.pow2, gy.dtype, False, (s.tokens, s.n, s.k), on_gx,
                  None if w8 is None else (w8.t(), ctx.sw)).reshape(x.shape)
        gw = gemm(gy2.t(), r.gy_gw, x2, r.x_gw, r.pow2, gy.dtype, False, (s.n, s.tokens, s.k), on_gw).t()  # -> w's
        return gx.to(x.dtype), gw.to(w.dtype), None, None, None, None, None


def fp8_linear(x: torch.Tensor, w: torch.Tensor, r: str | Recipe = "tensorwise",
               b: torch.Tensor | None = None, split: Split = ONE_DEVICE, delayed=None,
               w_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``x @ w (+ b)`` with ``w`` ``(in, out)`` (cfx's Linear layout), its three GEMMs in float8 by recipe ``r``
    (module doc); the bias added after, in the output's dtype. ``split``: the mesh axes a rank's ``x`` and ``w``
    are pieces over (inside ``shard_map``), whose amaxes its scales take. ``delayed``: delayed scaling's slots of
    this Linear (``fp8_delayed.Slots``: ``scales()`` of ``x``, ``w`` and ``gy``, and ``observe(i, t)``), whose
    scales the casts take instead of the tensors' own amaxes. ``w_fp8``: ``w`` cast to e4m3 already, ``(w8, scale)``
    (``tensorwise``: the one cast of ``w`` both GEMMs take), ``w`` then only its shape and gradient's way back."""
    r = recipe(r)
    if w_fp8 is not None and (r.w != r.w_gx or r.w.rowwise or r.w.dtype != w_fp8[0].dtype):
        raise ValueError(f"fp8_linear: a weight cast before the Linear (a float8 all-gather's) serves both of its "
                         f"GEMMs only under the tensorwise recipe, not {r.name!r}.")
    y = _Fp8Linear.apply(x, w, r, split, delayed, *(w_fp8 or (None, None)))
    return y if b is None else y + b.to(y.dtype)


# -- a Linear's weight, marked for float8 --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class Float8Weight:
    """A Linear weight ``w`` ``(in, out)`` whose matmuls run in float8 by ``recipe``, its pieces ``split`` as said
    (``Linear.apply`` and ``x @ w`` call ``fp8_linear``); a pytree node whose one child is ``w``. A
    ``Float8Layer`` puts them in for its Linears (``fp8_layers.py``)."""

    w: torch.Tensor
    recipe: str = "tensorwise"
    split: Split = ONE_DEVICE
    delayed: object = None  # delayed scaling's slots of this Linear (``fp8_delayed.Slots``), or None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape)

    def linear(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, self.w, self.recipe, b, self.split, self.delayed)

    def __rmatmul__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


tree_util.register_node(Float8Weight, lambda f: ((f.w,), (f.recipe, f.split, f.delayed), ("w",)),
                        lambda meta, children: Float8Weight(children[0], *meta))


@dataclasses.dataclass(frozen=True, eq=False)
class Float8Gathered(Float8Weight):
    """A ``Float8Weight`` cast to e4m3 before it came (ZeRO-3's float8 all-gather): ``w8`` with its ``scale``;
    ``w`` stands for its shape and takes its gradient (the gather's backward reduce-scatters it)."""

    w8: torch.Tensor = None
    scale: torch.Tensor = None

    def linear(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, self.w, self.recipe, b, self.split, self.delayed, (self.w8, self.scale))


tree_util.register_node(Float8Gathered, lambda f: ((f.w, f.w8, f.scale), (f.recipe, f.split, f.delayed),
                                                   ("w", "w8", "scale")),
                        lambda meta, children: Float8Gathered(children[0], *meta, *children[1:]))


def takes(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a layer's leaf ``name`` (its last path part) of ``shape`` is a Linear weight the float8 GEMM takes:
    a ``w`` of two dims, both multiples of 16 (others stay in the compute dtype)."""
    return name == "w" and len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % 16 == 0
