"""cfx's FP8 Linear (``cfx._src.precision.fp8``): each recipe's forward and both gradients equal torchao's
``Float8Linear`` under the same recipe bit for bit on the CPU (where ``torch._scaled_mm`` runs), and equal a
reference built here from the spec -- the scales from the amax, the saturating casts, the dequantised
operands multiplied in fp64 -- up to the fp32 accumulation of the product; the casts saturate."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from cfx._src.precision.fp8 import E4M3, E5M2, RECIPES, fp8_linear, quantize, to_fp8

TORCHAO = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise_gw_hp": "rowwise_with_gw_hp"}


def spec_quantize(x: torch.Tensor, dtype, dim, pow2: bool):
    """The spec, written out: amax (per slice along ``dim``, or whole), ``max / amax`` in fp64 to fp32, rounded
    down to a power of two for the row-wise recipes; ``x * scale`` in fp32, clamped to the finite range."""
    a = x.detach().abs().double()
    amax = a.max() if dim is None else a.amax(dim=dim, keepdim=True)
    scale = (torch.finfo(dtype).max / amax.clamp(min=1e-12)).float()
    if pow2:
        scale = 2.0 ** torch.floor(torch.log2(scale))
    big = torch.finfo(dtype).max
    return torch.clamp(x.detach().float() * scale, -big, big).to(dtype), scale


def spec_product(a, a_cast, b, b_cast, pow2):
    """``a @ b`` from dequantised operands, in fp64 (high-precision operands: as given)."""
    if a_cast.dtype is None:
        return a.double() @ b.double()
    qa, sa = spec_quantize(a, a_cast.dtype, -1 if a_cast.rowwise else None, pow2)
    qb, sb = spec_quantize(b, b_cast.dtype, 0 if b_cast.rowwise else None, pow2)
    return (qa.double() / sa.double()) @ (qb.double() / sb.double())


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(sorted(RECIPES)), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       m=st.sampled_from([16, 48]), k=st.sampled_from([16, 64]), n=st.sampled_from([16, 32]),
       magnitude=st.sampled_from([1e-3, 1.0, 300.0]), seed=st.integers(0, 2**16))
def test_each_recipe_equals_torchao_bit_for_bit(name, dtype, m, k, n, magnitude, seed):
    pytest.importorskip("torchao.float8")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n)
    theirs = torch.nn.Sequential(lin)
    convert_to_float8_training(theirs, config=Float8LinearConfig.from_recipe_name(TORCHAO[name]))
    x = (torch.randn(2, m // 2, k) * magnitude).to(dtype).requires_grad_()
    y = theirs(x)
    gy = (torch.randn_like(y.float()) * magnitude).to(y.dtype)
    y.backward(gy)
    w = lin.weight.detach().t().clone().requires_grad_()  # cfx's (in, out) layout
    b = lin.bias.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    y2 = fp8_linear(x2, w, name, b)
    y2.backward(gy)
    assert y2.dtype == y.dtype == dtype and torch.equal(y2, y)
    assert torch.equal(x2.grad, x.grad) and torch.equal(w.grad, lin.weight.grad.t()) and torch.equal(b.grad, lin.bias.grad)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_recipe_equals_the_spec_from_dequantised_operands(name):
    r = RECIPES[name]
    torch.manual_seed(0)
    x = torch.randn(32, 64) * 4
    w = torch.randn(64, 48) / 8
    gy = torch.randn(32, 48) * 1e-2
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(xx, ww, name)
    y.backward(gy)
    want = {"y": spec_product(x, r.x, w, r.w, r.pow2), "gx": spec_product(gy, r.gy, w.t(), r.w_gx, r.pow2),
            "gw": spec_product(gy.t(), r.gy_gw, x, r.x_gw, r.pow2).t()}
    got = {"y": y, "gx": xx.grad, "gw": ww.grad}
    for k in want:  # fp32 (bf16 where the product is row-wise: the kernels' output) rounding of an fp32 sum
        rowwise = k == "y" and r.x.rowwise or k == "gx" and r.gy.rowwise or k == "gw" and r.gy_gw.rowwise
        tol = 2 ** -7 if rowwise else 1e-5
        torch.testing.assert_close(got[k].double(), want[k], rtol=tol, atol=tol * want[k].abs().max().item(), msg=k)
    # the float8 operands themselves are the spec's, bit for bit
    for cast, t, dim in ((r.x, x, -1), (r.w, w, 0), (r.gy, gy, -1)):
        q, s = quantize(t, cast, dim, r.pow2)
        sq, ss = spec_quantize(t, cast.dtype, dim if cast.rowwise else None, r.pow2)
        assert torch.equal(q.view(torch.uint8), sq.view(torch.uint8)) and torch.equal(s, ss)


def test_the_casts_saturate_instead_of_overflowing():
    for dtype, big in ((E4M3, 448.0), (E5M2, 57344.0)):
        x = torch.tensor([1e6, -1e6, 1.0, float(big) * 1.5])
        q = to_fp8(x, dtype, torch.tensor(1.0))
        assert torch.isfinite(q.float()).all()
        assert q.float().tolist() == [big, -big, 1.0, big]
    # gradients far beyond e5m2's range (a loss scale): the scale brings them in, nothing is inf or NaN
    x = torch.randn(16, 32).requires_grad_()
    w = torch.randn(32, 16).requires_grad_()
    fp8_linear(x, w, "tensorwise").backward(torch.full((16, 16), 1e30))
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


def test_the_fp8_policy_marks_the_blocks_linears_but_the_first_and_trains():
    import cfx
    from cfx._src.precision.fp8 import Float8Weight

    model = cfx.models.gpt2("tiny", n_layer=3, n_embd=64, n_head=4, vocab_size=64, n_positions=32)
    params = model.init(cfx.random.key(0))
    policy = cfx.amp.policy("fp8:rowwise")
    assert (policy.compute_dtype, policy.fp8) == (torch.bfloat16, "rowwise")
    assert cfx.amp.policy("fp8").fp8 == "tensorwise" and cfx.amp.policy("bf16").fp8 is None
    with pytest.raises(ValueError, match="rowwise_gw_hp"):
        cfx.amp.policy("fp8:blockwise")
    cast = policy.cast_to_compute(params)
    leaves = dict(cfx.tree.flatten_with_path(cast, is_leaf=lambda x: isinstance(x, Float8Weight))[0])
    marked = {k for k, v in leaves.items() if isinstance(v, Float8Weight)}
    # every Linear weight of blocks 1 and 2 (6 each), none of block 0, the embeddings or the norms
    assert marked == {f"blocks.{i}.{m}.w" for i in (1, 2) for m in ("attn.q", "attn.k", "attn.v", "attn.o",
                                                                     "mlp.fc", "mlp.proj")}
    assert all(v.w.dtype == torch.float32 for k, v in leaves.items() if k in marked)  # scaled from the master
    assert all(v.dtype == torch.bfloat16 for k, v in leaves.items() if k not in marked)
    # a dim that is not a multiple of 16 stays in the compute dtype
    odd = cfx.models.gpt2("tiny", n_layer=2, n_embd=40, n_head=4, vocab_size=64, n_positions=32)
    assert not any(isinstance(v, Float8Weight) for v in cfx.tree.leaves(
        policy.cast_to_compute(odd.init(cfx.random.key(0))), is_leaf=lambda x: isinstance(x, Float8Weight)))
    # x @ w runs the same float8 product as the Linear
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    w = leaves["blocks.1.attn.q.w"]
    assert torch.equal(x @ w, fp8_linear(x, w.w, "rowwise"))

    # training: the loss falls as bf16's does, the float8 weights' gradients arriving in fp32
    tokens = cfx.random.randint(cfx.random.key(1), (8, 33), 0, 64)
    losses = {}
    for name in ("bf16", "fp8:tensorwise"):
        p = cfx.tree.map(lambda t: t.clone(), params)
        opt = cfx.optim.adamw(3e-3)
        state, pol = opt.init(p), cfx.amp.policy(name)
        run = []
        for _ in range(25):
            p = cfx.tree.map(lambda t: t.detach().requires_grad_(), p)
            loss = model.loss(pol.cast_to_compute(p), tokens[:, :-1], tokens[:, 1:])
            grads = torch.autograd.grad(loss, cfx.tree.leaves(p))
            grads = cfx.tree.unflatten(cfx.tree.structure(p), list(grads))
            assert grads["blocks"][1]["attn"]["q"]["w"].dtype == torch.float32
            updates, state = opt.update(grads, state, p)
            p = cfx.optim.apply_updates(p, updates)
            run.append(float(loss.detach()))
        losses[name] = run
    for run in losses.values():
        assert run[-1] < 0.8 * run[0]
    assert abs(losses["fp8:tensorwise"][-1] - losses["bf16"][-1]) < 0.05 * losses["bf16"][-1]


@pytest.mark.timeout(180)
def test_an_fp8_plan_over_data_and_model_trains_as_one_device_and_refuses_what_it_does_not_run(monkeypatch):
    import contextlib

    import cfx
    import cfx._src.precision.fp8 as fp8

    calls = []
    forward = fp8._Fp8Linear.forward
    monkeypatch.setattr(fp8._Fp8Linear, "forward", staticmethod(lambda ctx, *a: calls.append(1) or forward(ctx, *a)))
    model = cfx.models.gpt2("tiny", n_layer=3, n_embd=64, n_head=4, vocab_size=64, n_positions=32)
    tokens = cfx.random.randint(cfx.random.key(1), (3, 8, 33), 0, 64)

    def run(text):
        plan = cfx.parallel.Plan.parse(text)
        calls.clear()
        with plan.make_mesh() if plan.mesh_shape else contextlib.nullcontext() as mesh:
            step = plan.step(model, cfx.optim.adamw(1e-3), mesh=mesh)
            state, losses = step.init(cfx.random.key(0)), []
            for i in range(3):
                state, m = step(state, (tokens[i, :, :-1], tokens[i, :, 1:]))
                losses.append(float(m["loss"]))
        return losses, len(calls)

    # rowwise_gw_hp's scales do not span the batch's rows: the data split changes only the bf16 sums' order
    one, n_one = run("precision=fp8:rowwise_gw_hp")
    assert n_one == 3 * 12  # three steps, 12 float8 Linears (blocks 1 and 2)
    for text, ranks in (("data=2", 2), ("data=2,model=2 zero=1", 4)):
        losses, n = run(f"{text} precision=fp8:rowwise_gw_hp")
        assert n == ranks * n_one
        torch.testing.assert_close(losses, one, rtol=1e-3, atol=0)
    for text in ("data=2 zero=3", "pipe=2,data=2 microbatches=2", "row=2,col=2 tp=2d"):
        with pytest.raises(ValueError, match="float8 under data and model parallelism"):
            cfx.parallel.Plan.parse(f"{text} precision=fp8")
