"""2D, 2.5D and 3D tensor parallelism (``tensor_parallel_grid``): a block's output and every gradient
equal one device's (fp64, sizes and block variants drawn by hypothesis), in and out of the grid's
layout, differentiated inside the body or from outside; whole GPT-2 and ViT models likewise; bad
grids, sizes and models are ValueErrors naming what to fix."""
import dataclasses

import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx import P
from cfx.parallel import GridBlock, TensorGrid, grid_specs, tensor_parallel_grid
from cfx_tests.budget import examples

MESHES = {"2d": {"row": 2, "col": 2}, "2.5d": {"row": 2, "col": 2, "dep": 2}, "3d": {"row": 2, "col": 2, "dep": 2}}
ROWS = {"2d": 2, "2.5d": 4, "3d": 4}  # the ranks a block's batch splits over


def f64(tree):
    return cfx.tree.map(lambda t: t.double() if t.is_floating_point() else t, tree)


def perturbed(block, seed=0):
    """fp64 params with nonzero biases and norm params (so their gradients are checked for real)."""
    g = torch.Generator().manual_seed(seed)
    return cfx.tree.map(lambda t: t.double() + 0.1 * torch.randn(t.shape, generator=g, dtype=torch.float64),
                        block.init(cfx.random.key(seed)))


def run_block(gb, params, x, mesh, *, inside=True, key=None):
    """(output, param grads, input grads) of ``sum(out * w)`` under ``shard_map``; ``inside``: the
    gradient taken in the body (each rank's own), else from outside through the shard_map."""
    xs = P() if gb.enter else gb.grid.a.spec()
    w = torch.linspace(-1, 1, x.numel(), dtype=x.dtype).view(x.shape)
    specs = grid_specs(gb)
    if inside:
        def body(p, x, w):
            def f(p, x):
                y = gb.apply(p, x, key=key)
                return (y * w).sum(), y
            (_, y), g = cfx.value_and_grad(f, argnums=(0, 1), has_aux=True)(p, x)
            return y, g
        return cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=(specs, xs, xs),
                                            out_specs=(xs, (specs, xs)))(params, x, w))
    f = cfx.shard_map(lambda p, x: gb.apply(p, x, key=key), mesh=mesh, in_specs=(specs, xs), out_specs=xs)
    y = cfx.device_get(f(params, x))
    return (y, cfx.device_get(cfx.grad(lambda p, x: (cfx.device_get(f(p, x)) * w).sum(), argnums=(0, 1))(params, x)))


def check_block(mode, block, B, T, *, enter=True, inside=True, key=None, seed=0):
    x = torch.randn(B, T, block.features, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    params = perturbed(block, seed)
    gb = tensor_parallel_grid(block, mode)
    gb = dataclasses.replace(gb, enter=enter, leave=enter)
    with cfx.Mesh(MESHES[mode]) as mesh:
        y, (gp, gx) = run_block(gb, params, x, mesh, inside=inside, key=key)
    w = torch.linspace(-1, 1, x.numel(), dtype=x.dtype).view(x.shape)
    ref_y = block.apply(params, x, key=key)
    ref_gp, ref_gx = cfx.grad(lambda p, x: (block.apply(p, x, key=key) * w).sum(), argnums=(0, 1))(params, x)
    # RMSNorm takes its statistic in fp32 whatever the dtype (HF Llama's), summed in another order over the
    # split features: fp32's tolerance there; fp64's everywhere else
    tol = dict(rtol=1.3e-6, atol=1e-5) if block.norm == "rmsnorm" else {}
    torch.testing.assert_close(y, ref_y, **tol)
    torch.testing.assert_close(gx, ref_gx, **tol)
    cfx.tree.assert_tree_close(gp, ref_gp, **tol)


blocks = st.builds(
    lambda q_heads, D, kv_half, F_mult, post_norm, rope, act, norm, bias, causal: cfx.nn.TransformerBlock(
        4 * q_heads * D, 4 * q_heads, 4 * F_mult, n_kv_heads=(2 * q_heads if kv_half else None), activation=act,
        norm=norm, bias=bias, rope=rope, post_norm=post_norm, causal=causal),
    st.sampled_from([1, 2]), st.sampled_from([2, 4]), st.booleans(), st.sampled_from([2, 3, 4]), st.booleans(),
    st.booleans(), st.sampled_from(["gelu_tanh", "gelu", "swiglu"]), st.sampled_from(["layernorm", "rmsnorm"]),
    st.booleans(), st.booleans())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["2d", "2.5d", "3d"])
@examples(ci=5)
@given(block=blocks, rows=st.sampled_from([1, 2]), T=st.integers(1, 5), enter=st.booleans())
def test_block_equals_one_device(mode, block, rows, T, enter):
    # heads, widths, GQA, norms, activations, biases, rope, post-norm, causal: all drawn; fp64
    check_block(mode, block, ROWS[mode] * rows, T, enter=enter)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["2d", "3d"])
def test_gradient_from_outside_the_shard_map(mode):
    # cfx.grad through shard_map (varying-axes tracking on): the same gradients as inside the body
    check_block(mode, cfx.nn.TransformerBlock(16, 4, 32), ROWS[mode], 3, inside=False)


@pytest.mark.timeout(120)
def test_dropout_drops_what_one_device_drops():
    block = cfx.nn.TransformerBlock(16, 4, 32, dropout=0.3)
    for mode in ("2d", "3d"):
        check_block(mode, block, ROWS[mode], 3, key=cfx.random.key(5))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["2d", "2.5d", "3d"])
def test_activations_and_weights_split_over_the_whole_grid(mode):
    block = cfx.nn.TransformerBlock(16, 4, 32)
    gb = dataclasses.replace(tensor_parallel_grid(block, mode), enter=False, leave=False)
    B, T, held = 8, 4, {}

    def body(p, x):
        held[cfx.lax.axis_index(gb.grid.axes)] = (x.shape, p["attn"]["q"]["w"].shape, p["mlp"]["proj"]["w"].shape)
        return gb.apply(p, x)
    with cfx.Mesh(MESHES[mode]) as mesh:
        cfx.shard_map(body, mesh=mesh, in_specs=(grid_specs(gb), gb.grid.a.spec()),
                      out_specs=gb.grid.a.spec())(block.init(cfx.random.key(0)), torch.randn(B, T, 16))
    x_shape, wq, wproj = held[0]
    n = {"2d": 4, "2.5d": 8, "3d": 8}[mode]  # every rank of the grid holds 1/n of the activations
    assert x_shape[0] * x_shape[2] * n == B * 16 and x_shape[1] == T
    split = {"2d": 4, "2.5d": 4, "3d": 8}[mode]  # the weights: 1/q^2 (2.5D: shared over dep), 1/q^3
    assert wq[0] * wq[1] * split == 16 * 16 and wproj[0] * wproj[1] * split == 32 * 16


def models():
    T = 6
    return {"gpt2": (cfx.models.gpt2("tiny", vocab_size=64, n_layer=2, n_embd=16, n_head=4, n_positions=T),
                     lambda B: cfx.random.randint(cfx.random.key(1), (B, T), 0, 64)),
            "vit": (cfx.models.vit("tiny", image_size=8, patch_size=4, n_layer=2, n_head=4, hidden_size=16,
                                   intermediate_size=32, num_labels=5),
                    lambda B: torch.randn(B, 3, 8, 8, dtype=torch.float64))}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["gpt2", "vit"])
@pytest.mark.parametrize("mode", ["2d", "2.5d", "3d"])
def test_model_logits_and_gradients_equal_one_device(name, mode):
    model, batch = models()[name]
    params, x = f64(model.init(cfx.random.key(0))), batch(ROWS[mode])
    tp = tensor_parallel_grid(model, mode)
    assert [(b.enter, b.leave) for b in tp.blocks] == [(True, False), (False, True)]
    with cfx.Mesh(MESHES[mode]) as mesh:
        specs = grid_specs(tp, mesh=mesh)
        out, g = cfx.device_get(cfx.shard_map(
            lambda p, x: (tp.apply(p, x), cfx.grad(lambda p: tp.apply(p, x).pow(2).mean())(p)), mesh=mesh,
            in_specs=(specs, P()), out_specs=(P(), specs))(params, x))
    torch.testing.assert_close(out, model.apply(params, x))
    cfx.tree.assert_tree_close(g, cfx.grad(lambda p: model.apply(p, x).pow(2).mean())(params))


# -- mistakes: ValueErrors naming the fix, raised on every rank before any collective --------------------
def test_a_grid_that_is_not_square_is_refused():
    gb = tensor_parallel_grid(cfx.nn.TransformerBlock(16, 4, 32), "2d")
    with cfx.Mesh({"row": 2, "col": 1}) as mesh:
        f = cfx.shard_map(gb.apply, mesh=mesh, in_specs=(grid_specs(gb), P()), out_specs=P())
        with pytest.raises(ValueError, match=r"q x q grid \(row = col\), got row=2 x col=1"):
            f(gb.init(cfx.random.key(0)), torch.randn(2, 3, 16))


def test_heads_and_batch_that_do_not_split_are_refused():
    gb = tensor_parallel_grid(cfx.nn.TransformerBlock(16, 2, 32, n_kv_heads=1), "2d")
    with cfx.Mesh(MESHES["2d"]) as mesh:
        f = cfx.shard_map(gb.apply, mesh=mesh, in_specs=(grid_specs(gb), P()), out_specs=P())
        with pytest.raises(ValueError, match="n_kv_heads=1 is not divisible by 2"):
            f(gb.init(cfx.random.key(0)), torch.randn(2, 3, 16))
    gb = tensor_parallel_grid(cfx.nn.TransformerBlock(16, 4, 32), "3d")
    with cfx.Mesh(MESHES["3d"]) as mesh:
        f = cfx.shard_map(gb.apply, mesh=mesh, in_specs=(grid_specs(gb), P()), out_specs=P())
        with pytest.raises(ValueError, match=r"batch of 2 rows does not split over the 4 ranks of axes "
                                             r"\('dep', 'row'\)"):
            f(gb.init(cfx.random.key(0)), torch.randn(2, 3, 16))


def test_grid_specs_name_the_leaf_the_grid_does_not_divide():
    model = cfx.models.gpt2("tiny", vocab_size=64, n_layer=1, n_embd=6, n_head=2, n_positions=8)
    with cfx.Mesh(MESHES["3d"]) as mesh:  # 3D splits q's input dim over col x dep: 6 is not a multiple of 4
        with pytest.raises(ValueError, match=r"'blocks\.0\.attn\.[kqv]\.w' with shape \(6, 6\).*Mesh"):
            grid_specs(tensor_parallel_grid(model, "3d"), mesh=mesh)


def test_bad_modes_axes_and_models_are_refused():
    with pytest.raises(ValueError, match="unknown mode '4d'"):
        TensorGrid("4d")
    with pytest.raises(ValueError, match="3 distinct mesh axis names"):
        TensorGrid("3d", axes=("row", "col"))
    model = cfx.models.gpt2("tiny", vocab_size=64, n_layer=1, n_embd=16, n_head=4, n_positions=8)
    with pytest.raises(ValueError, match="already splits its vocabulary"):
        tensor_parallel_grid(cfx.parallel.tensor_parallel(model, "model"), "2d")
    with pytest.raises(ValueError, match="pass the model tensor_parallel_grid returned"):
        grid_specs(model)
    assert isinstance(tensor_parallel_grid(model.blocks[0], "2.5d", axes=("r", "c", "d")), GridBlock)
