"""The functional Evoformer (``cfx._src.models.evoformer``) against the loop reference written from
AlphaFold 2's supplementary Algorithms 6-15 (``cfx_tests/evoformer_reference.py``): every layer over
sampled sizes and masks (fully masked rows and columns included), the block and the stack with and
without masks and batched, gradients, chunking, and the input checks."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import cfx
from cfx._src.models.evoformer import Evoformer, EvoformerBlock, EvoformerConfig
from cfx._src.models.evoformer_layers import (MSAColumnAttention, MSARowAttention, OuterProductMean, Transition,
                                              TriangleAttention, TriangleMultiplication)
from cfx_tests import evoformer_reference as ref
from cfx_tests.budget import examples

CONFIG = EvoformerConfig(n_blocks=2, c_m=8, c_z=6, c_hidden_msa_att=4, n_heads_msa=2, c_hidden_opm=3,
                         c_hidden_mul=5, c_hidden_pair_att=4, n_heads_pair=2, softmax_impl="reference")


# -- helpers -----------------------------------------------------------------------------------------
def randomized(params, seed: int):
    """``params`` with every leaf redrawn (the library's init zeroes biases and sets LayerNorm to the
    identity, which would hide mistakes in them): weights ~ N(0, 1/fan_in), the rest O(0.3)."""
    g = torch.Generator().manual_seed(seed)

    def walk(t, name):
        if isinstance(t, dict):
            return {k: walk(v, k) for k, v in t.items()}
        if isinstance(t, list):
            return [walk(v, name) for v in t]
        noise = torch.randn(t.shape, generator=g, dtype=t.dtype)
        if name == "w":
            return noise / math.sqrt(t.shape[0])
        return 1.0 + 0.3 * noise if name == "scale" else 0.3 * noise
    return walk(params, None)


def leaves(tree) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [x for k in sorted(tree) for x in leaves(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in leaves(v)]
    return [tree]


def randn(seed: int, *shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@st.composite
def masks(draw, shape):
    """None, or a random bool mask of ``shape``, sometimes with a fully masked row and/or column."""
    if draw(st.booleans()):
        return None
    n = shape[0] * shape[1]
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).reshape(shape)
    if draw(st.booleans()):
        mask[draw(st.integers(0, shape[0] - 1)), :] = False
    if draw(st.booleans()):
        mask[:, draw(st.integers(0, shape[1] - 1))] = False
    return mask


def fixed_masks(B: tuple, S: int, R: int):
    """Deterministic masks with a dead sequence, a dead residue column and a dead pair row/column."""
    msa = randn(11, *B, S, R) > -0.5
    msa[..., S - 1, :] = False            # a fully masked sequence
    msa[..., :, 0] = False                # a residue masked in every sequence
    pair = randn(12, *B, R, R) > -0.5
    pair[..., 1, :] = False               # a fully masked pair row
    pair[..., :, R - 1] = False           # and column
    return msa, pair


sizes = dict(S=st.integers(1, 4), R=st.integers(1, 5), seed=st.integers(0, 2 ** 16),
             chunk=st.sampled_from([None, 1, 2]))


def key(seed: int):
    return cfx.random.key(seed)


# -- each layer --------------------------------------------------------------------------------------
@examples(ci=6)
@given(data=st.data(), H=st.integers(1, 3), c=st.integers(1, 4), c_m=st.integers(2, 6),
       c_z=st.integers(2, 5), **sizes)
def test_msa_row_attention_matches_reference(data, H, c, c_m, c_z, S, R, seed, chunk):
    mask = data.draw(masks((S, R)))
    layer = MSARowAttention(c_m, c_z, c, H)
    p = randomized(layer.init(key(seed)), seed)
    m, z = randn(seed, S, R, c_m), randn(seed + 1, R, R, c_z)
    torch.testing.assert_close(layer.apply(p, m, z, mask, chunk_size=chunk), ref.msa_row_attention(p, m, z, mask))


@examples(ci=6)
@given(data=st.data(), H=st.integers(1, 3), c=st.integers(1, 4), c_m=st.integers(2, 6), **sizes)
def test_msa_column_attention_matches_reference(data, H, c, c_m, S, R, seed, chunk):
    mask = data.draw(masks((S, R)))
    layer = MSAColumnAttention(c_m, c, H)
    p = randomized(layer.init(key(seed)), seed)
    m = randn(seed, S, R, c_m)
    torch.testing.assert_close(layer.apply(p, m, mask, chunk_size=chunk), ref.msa_column_attention(p, m, mask, H))


@examples(ci=4)
@given(c=st.integers(1, 6), n=st.integers(1, 4), pair=st.booleans(), **sizes)
def test_transition_matches_reference(c, n, pair, S, R, seed, chunk):
    layer = Transition(c, n)
    p = randomized(layer.init(key(seed)), seed)
    x = randn(seed, R if pair else S, R, c)
    torch.testing.assert_close(layer.apply(p, x, chunk_size=chunk), ref.transition(p, x))


@examples(ci=6)
@given(data=st.data(), c_m=st.integers(2, 6), c_z=st.integers(1, 5), c=st.integers(1, 3), **sizes)
def test_outer_product_mean_matches_reference(data, c_m, c_z, c, S, R, seed, chunk):
    mask = data.draw(masks((S, R)))
    layer = OuterProductMean(c_m, c_z, c)
    p = randomized(layer.init(key(seed)), seed)
    m = randn(seed, S, R, c_m)
    torch.testing.assert_close(layer.apply(p, m, mask, chunk_size=chunk), ref.outer_product_mean(p, m, mask))


@examples(ci=6)
@given(data=st.data(), outgoing=st.booleans(), c_z=st.integers(2, 5), c=st.integers(2, 5), **sizes)
def test_triangle_multiplication_matches_reference(data, outgoing, c_z, c, S, R, seed, chunk):
    del S
    mask = data.draw(masks((R, R)))
    layer = TriangleMultiplication(c_z, c, outgoing=outgoing)
    p = randomized(layer.init(key(seed)), seed)
    z = randn(seed, R, R, c_z)
    torch.testing.assert_close(layer.apply(p, z, mask, chunk_size=chunk),
                               ref.triangle_multiplication(p, z, mask, outgoing=outgoing))


@examples(ci=6)
@given(data=st.data(), starting=st.booleans(), H=st.integers(1, 3), c=st.integers(1, 4), c_z=st.integers(2, 5),
       **sizes)
def test_triangle_attention_matches_reference(data, starting, H, c, c_z, S, R, seed, chunk):
    del S
    mask = data.draw(masks((R, R)))
    layer = TriangleAttention(c_z, c, H, starting=starting)
    p = randomized(layer.init(key(seed)), seed)
    z = randn(seed, R, R, c_z)
    torch.testing.assert_close(layer.apply(p, z, mask, chunk_size=chunk),
                               ref.triangle_attention(p, z, mask, starting=starting))


def test_fully_masked_keys_attend_uniformly():
    """The reference's masking convention, pinned by hand: every key masked -> the mean of v."""
    layer = MSAColumnAttention(4, 3, 2)
    p = randomized(layer.init(key(0)), 0)
    m = randn(0, 3, 1, 4)
    mask = torch.zeros(3, 1, dtype=torch.bool)
    x = ref.layer_norm(p["ln"], m[:, 0])                                     # (S, c_m)
    o = (x @ p["v"]["w"]).mean(0, keepdim=True)                              # (1, H c): uniform over keys
    want = (torch.sigmoid(x @ p["gate"]["w"] + p["gate"]["b"]) * o) @ p["out"]["w"] + p["out"]["b"]
    torch.testing.assert_close(ref.msa_column_attention(p, m, mask, 2)[:, 0], want)
    torch.testing.assert_close(layer.apply(p, m, mask)[:, 0], want)


# -- the block and the stack -------------------------------------------------------------------------
S_, R_ = 3, 5


def case(batch: tuple = (), masked: bool = True, seed: int = 0, dtype: torch.dtype = torch.float32):
    m, z = randn(seed + 1, *batch, S_, R_, CONFIG.c_m), randn(seed + 2, *batch, R_, R_, CONFIG.c_z)
    msa, pair = fixed_masks(batch, S_, R_) if masked else (None, None)
    return m.to(dtype), z.to(dtype), msa, pair


@pytest.mark.parametrize("masked", [False, True])
def test_block_matches_reference(masked):
    block = EvoformerBlock(CONFIG)
    p = randomized(block.init(key(3)), 3)
    m, z, msa, pair = case(masked=masked)
    got = block.apply(p, (m, z), msa_mask=msa, pair_mask=pair)
    want = ref.evoformer_block(p, m, z, msa, pair, n_heads_msa=CONFIG.n_heads_msa)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("batch, masked, float_masks", [
    ((), False, False), ((), True, False), ((), True, True), ((2,), False, False), ((2,), True, False)])
def test_stack_matches_reference(batch, masked, float_masks):
    model = Evoformer(CONFIG)
    params = randomized(model.init(key(4)), 4)
    m, z, msa, pair = case(batch, masked)
    if float_masks:
        msa, pair = msa.float(), pair.float()
    got = model.apply(params, m, z, msa_mask=msa, pair_mask=pair)
    want = ref.evoformer(params, m, z, msa, pair, n_heads_msa=CONFIG.n_heads_msa)
    torch.testing.assert_close(got, want)


def test_batched_stack_with_shared_masks():
    """Masks without the batch dim broadcast over it."""
    model = Evoformer(CONFIG)
    params = randomized(model.init(key(5)), 5)
    m, z, _, _ = case((2,), masked=False)
    msa, pair = fixed_masks((), S_, R_)
    got = model.apply(params, m, z, msa_mask=msa, pair_mask=pair)
    torch.testing.assert_close(got, ref.evoformer(params, m, z, msa, pair, n_heads_msa=CONFIG.n_heads_msa))


# Gradients run in float64: in fp32 the summed parameter gradients (up to ~40 here) of the 2-block
# stack differ between any two summation orders (even chunked vs unchunked library runs) by ~1e-6
# relative, ~5e-5 absolute, past assert_close's fp32 defaults; in float64 the library and the
# reference agree to ~1e-13, so the float64 defaults (1e-7) stay sharp.
def stack_grads(fn, params, m, z, seed: int = 7):
    """Gradients of ``(m' * cm).sum() + (z' * cz).sum()`` w.r.t. every param leaf, m and z."""
    params = [x.clone().requires_grad_() for x in leaves(params)]
    m, z = m.clone().requires_grad_(), z.clone().requires_grad_()
    out_m, out_z = fn(params, m, z)
    cm, cz = randn(seed, *out_m.shape).to(out_m.dtype), randn(seed + 1, *out_z.shape).to(out_z.dtype)
    loss = (out_m * cm).sum() + (out_z * cz).sum()
    return torch.autograd.grad(loss, [*params, m, z])


def as64(params):
    return unleaves(params, [x.double() for x in leaves(params)])


def unleaves(template, flat: list):
    it = iter(flat)

    def build(t):
        if isinstance(t, dict):
            return {k: build(t[k]) for k in sorted(t)}
        if isinstance(t, list):
            return [build(v) for v in t]
        return next(it)
    return build(template)


@pytest.mark.parametrize("masked", [False, True])
def test_stack_gradients_match_reference(masked):
    model = Evoformer(CONFIG)
    params = as64(randomized(model.init(key(6)), 6))
    m, z, msa, pair = case(masked=masked, dtype=torch.float64)
    got = stack_grads(lambda ps, m, z: model.apply(unleaves(params, ps), m, z, msa_mask=msa, pair_mask=pair),
                      params, m, z)
    want = stack_grads(lambda ps, m, z: ref.evoformer(unleaves(params, ps), m, z, msa, pair,
                                                      n_heads_msa=CONFIG.n_heads_msa), params, m, z)
    assert len(got) == len(leaves(params)) + 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("chunk_size", [1, 2])
def test_chunked_stack_matches_unchunked(chunk_size):
    model = Evoformer(CONFIG)
    params = randomized(model.init(key(8)), 8)
    m, z, msa, pair = case((2,), masked=True)

    def run(chunk):
        return lambda ps, m, z: model.apply(unleaves(params, ps), m, z, msa_mask=msa, pair_mask=pair,
                                            chunk_size=chunk)
    torch.testing.assert_close(run(chunk_size)(leaves(params), m, z), run(None)(leaves(params), m, z))
    params, m, z = as64(params), m.double(), z.double()   # gradients: float64 (see stack_grads)
    got, want = stack_grads(run(chunk_size), params, m, z), stack_grads(run(None), params, m, z)
    assert len(got) == len(leaves(params)) + 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


# -- input checks ------------------------------------------------------------------------------------
def test_bad_inputs_raise():
    model = Evoformer(CONFIG)
    params = model.init(key(9))
    m, z, msa, pair = case(masked=True)
    with pytest.raises(ValueError, match="residues"):
        model.apply(params, m[:, :-1], z)
    with pytest.raises(ValueError, match="msa_mask must be"):
        model.apply(params, m, z, msa_mask=msa[:, :-1])
    with pytest.raises(ValueError, match="pair_mask must be"):
        model.apply(params, m, z, pair_mask=pair[:-1])


# -- layer transforms ----------------------------------------------------------------------------------
def test_remat_blocks_equal_the_plain_stack():
    """The stack's blocks take the layer transforms the decoders take, through ``map_blocks``:
    ``cfx.remat`` per block (values and gradients), ZeRO-3's gathered blocks (below)."""
    model = Evoformer(CONFIG)
    params = randomized(model.init(key(10)), 10)
    m, z, msa, pair = case(masked=True)

    def loss(model, p):
        mo, zo = model.apply(p, m, z, msa_mask=msa, pair_mask=pair)
        return mo.square().mean() + zo.square().mean()
    want, want_g = cfx.value_and_grad(lambda p: loss(model, p))(params)
    got, got_g = cfx.value_and_grad(lambda p: loss(model.map_blocks(cfx.remat), p))(params)
    torch.testing.assert_close(got, want)
    cfx.tree.assert_tree_close(got_g, want_g)
    assert model.map_blocks(cfx.remat).axes() == model.axes()


@pytest.mark.timeout(120)
def test_zero3_gathered_blocks_on_a_data_axis_equal_one_device():
    model = Evoformer(CONFIG)
    params = randomized(model.init(key(11)), 11)
    m, z = randn(1, 2, 3, 4, CONFIG.c_m), randn(2, 2, 4, 4, CONFIG.c_z)  # a batch of 2, split over data

    def loss(model, p, m, z):
        mo, zo = model.apply(p, m, z)
        return mo.square().mean() + zo.square().mean()
    want, want_g = cfx.value_and_grad(lambda p: loss(model, p, m, z))(params)
    net = cfx.zero.gathered(model.map_blocks(lambda b: cfx.zero.gathered(b, axis="data")), axis="data")
    ztx = cfx.zero(cfx.optim.sgd(0.1), stage=3, axis="data")

    def body(params, m, z):
        p = cfx.zero.shard_params(params, axis="data")
        value, grads = ztx.value_and_grad(lambda p: loss(net, p, m, z))(p)
        return cfx.lax.pmean(value, "data"), cfx.zero.gather_params(grads, axis="data")
    with cfx.Mesh({"data": 2}) as mesh:
        got, got_g = cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=(cfx.P(), cfx.P("data"), cfx.P("data")),
                                                  out_specs=(cfx.P(), cfx.P()))(params, m, z))
    torch.testing.assert_close(got, want)
    cfx.tree.assert_tree_close(got_g, want_g, rtol=1e-5, atol=1e-6)  # the mean over ranks: fp32 reordering
