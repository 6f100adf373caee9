"""cfx's FP8 Linear (``cfx._src.nn.fp8``): each recipe's forward and both gradients equal torchao's
``Float8Linear`` under the same recipe bit for bit on the CPU (where ``torch._scaled_mm`` runs), and equal a
reference built here from the spec -- the scales from the amax, the saturating casts, the dequantised
operands multiplied in fp64 -- up to the fp32 accumulation of the product; the casts saturate."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from cfx._src.nn.fp8 import E4M3, E5M2, RECIPES, fp8_linear, quantize, to_fp8

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


def test_float8_converts_the_blocks_linears_but_the_first_and_trains():
    import cfx
    from cfx._src.nn.fp8 import Float8Weight

    model = cfx.models.gpt2("tiny", n_layer=3, n_embd=64, n_head=4, vocab_size=64, n_positions=32)
    params = model.init(cfx.random.key(0))
    policy = cfx.amp.policy("fp8:rowwise")
    assert (policy.compute_dtype, policy.fp8) == (torch.bfloat16, "rowwise")
    assert cfx.amp.policy("fp8").fp8 == "tensorwise" and cfx.amp.policy("bf16").fp8 is None
    for bad in (lambda: cfx.amp.policy("fp8:blockwise"), lambda: cfx.amp.float8(model, "blockwise")):
        with pytest.raises(ValueError, match="rowwise_gw_hp"):
            bad()
    f8 = cfx.amp.float8(model, "rowwise")
    assert type(f8.blocks[0]) is type(model.blocks[0]) and all(isinstance(b, cfx.amp.Float8Layer) for b in f8.blocks[1:])
    # every Linear weight of blocks 1 and 2 (6 each) reaches its Linear marked; none of block 0
    assert {p for p, _ in f8.blocks[1].linears} == {f"{m}.w" for m in ("attn.q", "attn.k", "attn.v", "attn.o",
                                                                        "mlp.fc", "mlp.proj")}
    marked = f8.blocks[1].marked(policy.cast_to_compute(params["blocks"][1]))
    assert isinstance(marked["attn"]["q"]["w"], Float8Weight) and marked["attn"]["q"]["w"].recipe == "rowwise"
    assert marked["attn"]["q"]["w"].w.dtype == torch.bfloat16  # scaled from the compute copy, as under FSDP2
    # the same params and init; a dim that is not a multiple of 16 stays in the compute dtype
    torch.testing.assert_close(f8.init(cfx.random.key(0)), params)
    mlp_only = cfx.amp.float8(model, where=lambda i, path: path.startswith("mlp."))  # a filter of one's own
    assert [{p for p, _ in b.linears} for b in mlp_only.blocks] == [{"mlp.fc.w", "mlp.proj.w"}] * 3
    odd = cfx.models.gpt2("tiny", n_layer=2, n_embd=40, n_head=4, vocab_size=64, n_positions=32)
    assert not any(isinstance(b, cfx.amp.Float8Layer) for b in cfx.amp.float8(odd).blocks)
    # x @ w runs the same float8 product as the Linear
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    assert torch.equal(x @ marked["attn"]["q"]["w"], fp8_linear(x, marked["attn"]["q"]["w"].w, "rowwise"))

    # training: the loss falls as bf16's does, every block 1 Linear running in float8
    tokens = cfx.random.randint(cfx.random.key(1), (8, 33), 0, 64)
    losses, calls = {}, []
    for name in ("bf16", "fp8:tensorwise"):
        pol = cfx.amp.policy(name)
        m = cfx.amp.float8(model, pol.fp8) if pol.fp8 else model
        p = cfx.tree.map(lambda t: t.clone(), params)
        opt = cfx.optim.adamw(3e-3)
        state = opt.init(p)
        run = []
        for _ in range(25):
            p = cfx.tree.map(lambda t: t.detach().requires_grad_(), p)
            loss = m.loss(pol.cast_to_compute(p), tokens[:, :-1], tokens[:, 1:])
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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_split_linears_scale_with_the_whole_tensors_amax(name):
    """A column- and a row-parallel float8 Linear on ``data=2,model=2``: every rank scales its pieces with the
    amax of the whole tensor (row) one device takes, so what no split reduction sums equals one device's bit for
    bit -- a column-parallel output, a row-parallel input gradient -- and the sums over ranks equal it up to
    their rounding. With one device's Split (each rank's own amax) the tensor-wise products differ."""
    import cfx
    from cfx import P
    from cfx._src.nn.fp8 import ONE_DEVICE, Split

    g = torch.Generator().manual_seed(7)
    x, gy = torch.randn(32, 64, generator=g), torch.randn(32, 48, generator=g)
    w = torch.randn(64, 48, generator=g) * torch.linspace(0.1, 3, 48)  # amax differs between the halves
    x[3, 40] = 9.0  # the row-parallel halves of x differ in amax
    gy[20, 5] = -7.0  # the data halves of gy differ in amax
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y1 = fp8_linear(xr, wr, name)
    gx1, gw1 = torch.autograd.grad(y1, (xr, wr), gy)
    bound = 1e-6 if name == "tensorwise" else 2**-7  # of the largest element: fp32 sums, or the bf16 products'

    def close(a, ref):  # a sum over ranks of partial products: their rounding, relative to the largest
        assert (a - ref).abs().max() <= bound * ref.abs().max(), float((a - ref).abs().max() / ref.abs().max())

    def run(column: bool, split):
        def body(x, w, gy):
            x, w = x.requires_grad_(), w.requires_grad_()
            y = fp8_linear(x, w, name, split=split)
            gx, gw = torch.autograd.grad(y, (x, w), gy)
            partial_y = () if column else ("model",)
            return (cfx.lax.psum(y.detach(), "model") if partial_y else y.detach(),
                    cfx.lax.psum(gx, "model") if column else gx, cfx.lax.psum(gw, "data"))
        w_spec = P(None, "model") if column else P("model", None)
        x_spec, gy_spec = (P("data"), P("data", "model")) if column else (P("data", "model"), P("data"))
        with cfx.Mesh({"data": 2, "model": 2}) as mesh:
            f = cfx.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec, gy_spec),
                              out_specs=(gy_spec, x_spec, w_spec), check_rep=False)
            return cfx.device_get(f(x, w, gy))

    y, gx, gw = run(True, Split(("data",), (), ("model",)))
    assert torch.equal(y, y1)  # nothing split along K: the same float8 operands, the same products
    close(gx, gx1)
    close(gw, gw1)
    y, gx, gw = run(False, Split(("data",), ("model",), ()))
    assert torch.equal(gx, gx1)
    close(y, y1)
    close(gw, gw1)
    if name == "tensorwise":  # each rank's own amax: other scales, other products
        assert not torch.equal(run(True, ONE_DEVICE)[0], y1) and not torch.equal(run(False, ONE_DEVICE)[1], gx1)


@pytest.mark.timeout(240)
def test_an_fp8_plan_scales_as_one_device_on_every_axis_it_runs(monkeypatch):
    """``precision=fp8`` under ``data=2``, ``data=2,model=2``, ``data=2 zero=3``, ``pipe=2,data=2`` and ZeRO-3 with
    offload: every float8 Linear runs on every rank (counted), each tensor-wise scale a rank takes in the first step
    is one one device takes -- the gradients' up to the data size, a power of two (a rank's loss is the mean of
    its own rows) -- and three steps' losses equal one device's within 1e-4. The compute is fp32 here (the
    policy patched) so that scales compare to 1e-6; the plans' bf16 is the same code."""
    import bisect
    import collections
    import contextlib
    import threading

    import cfx
    import cfx._src.nn.fp8 as fp8
    import cfx._src.plan.local as local
    from cfx._src.precision import amp

    policy = amp.policy
    fp32 = lambda name, **k: amp.Policy(fp8=name.partition(":")[2] or "tensorwise") if name.startswith("fp8") \
        else policy(name, **k)
    monkeypatch.setattr(amp, "policy", fp32)
    monkeypatch.setattr(local, "amp_policy", fp32)
    scales, calls = collections.defaultdict(list), []
    scale_of, forward = fp8.scale_of, fp8._Fp8Linear.forward

    def recorded(x, dtype, dim=None, pow2=False, over=()):
        s = scale_of(x, dtype, dim, pow2, over)
        scales[threading.get_ident()].append(float(s))
        return s
    monkeypatch.setattr(fp8, "scale_of", recorded)
    monkeypatch.setattr(fp8._Fp8Linear, "forward", staticmethod(lambda ctx, *a: calls.append(1) or forward(ctx, *a)))
    model = cfx.models.gpt2("tiny", n_layer=4, n_embd=64, n_head=4, vocab_size=64, n_positions=32)
    tokens = cfx.random.randint(cfx.random.key(1), (3, 8, 33), 0, 64)

    def run(text):
        plan = cfx.parallel.Plan.parse(f"{text} precision=fp8")
        calls.clear()
        losses, first = [], None
        with plan.make_mesh() if plan.mesh_shape else contextlib.nullcontext() as mesh:
            step = plan.step(model, cfx.optim.adamw(1e-3), mesh=mesh)
            state = step.init(cfx.random.key(0))
            for i in range(3):
                scales.clear()
                state, m = step(state, (tokens[i, :, :-1], tokens[i, :, 1:]))
                losses.append(float(m["loss"]))
                first = first or [s for per_rank in scales.values() for s in per_rank]
        return losses, len(calls), first

    one, n_one, ref = run("")
    assert n_one == 3 * 18  # three steps, 18 float8 Linears (blocks 1-3)
    ref = sorted(ref)

    def known(s):
        return any(ref[i] <= t * (1 + 1e-6) for t in (s, 2 * s) for i in [bisect.bisect_left(ref, t * (1 - 1e-6))]
                   if i < len(ref))
    for text, ranks in (("data=2", 2), ("data=2,model=2", 4), ("data=2 zero=3", 2), ("pipe=2,data=2", 4),
                        ("data=2 zero=3 offload=host", 2)):
        losses, n, first = run(text)
        assert n == (ranks * n_one if "pipe" not in text else 2 * n_one), text  # (a stage runs half the blocks)
        assert len(first) == n // 3 * 6 and all(known(s) for s in first), text
        torch.testing.assert_close(losses, one, rtol=1e-4, atol=0)
    for text in ("row=2,col=2 tp=2d", "seq=2", "data=2,model=2 sp=megatron"):
        with pytest.raises(ValueError, match="float8 under data, model and pipe parallelism"):
            cfx.parallel.Plan.parse(f"{text} precision=fp8")
    with pytest.raises(ValueError, match="multiples of 16 on every rank"):
        odd = cfx.models.gpt2("tiny", n_layer=2, n_embd=48, n_head=4, vocab_size=64, n_positions=32)
        cfx.parallel.Plan.parse("model=2 precision=fp8").step(odd, cfx.optim.adamw(1e-3), mesh=cfx.Mesh({"model": 2}))
