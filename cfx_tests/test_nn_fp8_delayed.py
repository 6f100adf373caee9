"""Delayed scaling (``cfx._src.nn.fp8_delayed``): the update is Transformer Engine's rule, checked against that
rule written out here as loops over a scripted amax history (TE's ``amax_and_scale_update`` kernel, slot by
slot, in fp32); a Linear casts with the meta's scales in all six of its casts and notes its three amaxes;
Plans carry the meta in the optimizer's state -- split over data, model, ZeRO-3 and pipe the same scales as one
device, and a checkpoint resumes it bit for bit."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from cfx._src.nn.fp8 import E4M3, E5M2, fp8_linear, scale_of
from cfx._src.nn.fp8_delayed import DelayedScaling, Fp8Meta, Slots, step_scope, update

FMAX = {0: 448.0, 1: 448.0, 2: 57344.0}  # a Linear's slots: x, w (e4m3), gy (e5m2)


def te_rule(history: np.ndarray, scale: np.ndarray, amax: np.ndarray, algo: str, margin: float):
    """TE's kernel, one slot at a time: this step's amax into h[0]; roll left, h[0] zeroed; the amax the max of
    the old history or its most recent entry; scale = fmax * 2^-margin / amax in fp32 if finite and > 0."""
    L, M = history.shape
    new_h, new_s = np.zeros_like(history), scale.copy()
    for j in range(M):
        h = history[:, j].copy()
        h[0] = amax[j]
        last, best = h[0], np.float32(0)
        for i in range(L):
            a = h[i + 1] if i < L - 1 else last
            best = np.fmax(best, a)
            new_h[i, j] = a if i > 0 else np.float32(0)
        chosen = last if algo == "most_recent" else best
        scaled_max = np.float32(FMAX[j % 3]) * np.float32(2.0) ** np.float32(-margin)
        if np.isfinite(chosen) and chosen > 0:
            new_s[j] = np.float32(scaled_max / chosen)
    return new_h, new_s


amaxes = st.one_of(st.floats(2.0**-100, 2.0**100, width=32), st.sampled_from([0.0, float("inf"), float("nan")]))


@settings(max_examples=60, deadline=None)
@given(L=st.integers(1, 6), linears=st.integers(1, 3), steps=st.integers(1, 8), algo=st.sampled_from(["max", "most_recent"]),
       margin=st.sampled_from([0.0, 1.0, 2.5]), data=st.data())
def test_the_update_is_transformer_engines_rule_over_scripted_histories(L, linears, steps, algo, margin, data):
    cfg = DelayedScaling(history=L, algo=algo, margin=margin)
    M = 3 * linears
    meta = Fp8Meta(torch.zeros(L, M), torch.ones(M))
    h, s = np.zeros((L, M), np.float32), np.ones(M, np.float32)
    for _ in range(steps):
        a = np.array(data.draw(st.lists(amaxes, min_size=M, max_size=M)), np.float32)
        meta = update(meta, torch.from_numpy(a), cfg)
        h, s = te_rule(h, s, a, algo, margin)
        assert torch.equal(meta.history.nan_to_num(nan=-1.0), torch.from_numpy(h).nan_to_num(nan=-1.0))
        assert torch.equal(meta.scale, torch.from_numpy(s))  # bit for bit (no nan: a bad amax keeps the scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_delayed_linear_casts_with_the_metas_scales_and_notes_its_amaxes(dtype):
    g = torch.Generator().manual_seed(3)
    x, w, gy = (torch.randn(*s, generator=g).to(dtype) for s in ((24, 32), (32, 16), (24, 16)))
    w = w.float()

    def run(delayed):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(xr, wr, "tensorwise", delayed=delayed)
        return (y, *torch.autograd.grad(y, (xr, wr), gy))

    dynamic = run(None)
    # the meta's scales set to the tensors' own: every cast takes them, so the products are dynamic scaling's
    own = torch.stack([scale_of(x, E4M3), scale_of(w, E4M3), scale_of(gy, E5M2)])
    meta = Fp8Meta(torch.zeros(4, 6), torch.cat([torch.ones(3), own]))  # the Linear at slots 3-5
    with step_scope(meta) as step:
        delayed = run(Slots(3))
    for a, b in zip(delayed, dynamic):
        assert torch.equal(a, b)
    expect = torch.stack([t.abs().amax().float() for t in (x, w, gy)])
    assert torch.equal(step.amax, torch.cat([torch.zeros(3), expect]))
    # other scales, other products; none outside a step
    with step_scope(Fp8Meta(torch.zeros(4, 6), torch.ones(6))):
        assert not torch.equal(run(Slots(3))[0], dynamic[0])
    with pytest.raises(ValueError, match="inside cfx.amp.fp8_step"):
        run(Slots(0))
    with step_scope(Fp8Meta(torch.zeros(4, 3), torch.ones(3))), pytest.raises(ValueError, match="past the 3 slots"):
        run(Slots(3))


@pytest.mark.timeout(300)
def test_fp8_delayed_plans_scale_as_one_device_and_resume_bit_for_bit(monkeypatch, tmp_path):
    """``precision=fp8:delayed`` on one device and on ``data=2``, ``data=2,model=2``, ``data=2 zero=3`` and
    ``pipe=2,data=2 microbatches=2``: after the first step every rank's meta holds one device's input and weight
    scales and amaxes (to fp32 rounding; fp32 compute patched in so they compare that closely) -- the gradients' in
    one device's units, a rank's loss being the mean of its own rows -- and the losses equal one device's within
    1e-4.
    A run saved after two steps and loaded goes on as the run never stopped, meta and params bit for bit."""
    import cfx
    import cfx._src.plan.local as local
    from cfx._src.precision import amp

    policy = amp.policy
    fp32 = lambda name, **k: amp.Policy(fp8="tensorwise", fp8_scaling="delayed") if name == "fp8:delayed" \
        else policy(name, **k)
    monkeypatch.setattr(amp, "policy", fp32)
    monkeypatch.setattr(local, "amp_policy", fp32)
    model = cfx.models.gpt2("tiny", n_layer=4, n_embd=64, n_head=4, vocab_size=64, n_positions=32)
    tokens = cfx.random.randint(cfx.random.key(1), (4, 8, 33), 0, 64)
    batch = [(tokens[i, :, :-1], tokens[i, :, 1:]) for i in range(4)]

    def run(text, steps=3, stop=None):
        plan = cfx.parallel.Plan.parse(f"{text} precision=fp8:delayed")
        with plan.make_mesh() if plan.mesh_shape else contextlib.nullcontext() as mesh:
            step = plan.step(model, cfx.optim.adamw(1e-3), mesh=mesh)
            state, losses = step.init(cfx.random.key(0)), []
            for i in range(steps):
                if i == stop:
                    step.save(str(tmp_path / text.replace(" ", "_")), state)
                    state, _ = step.load(str(tmp_path / text.replace(" ", "_")), step.init(cfx.random.key(5)))
                state, m = step(state, batch[i])
                losses.append(float(m["loss"]))
                if i == 0:  # the first step's amaxes, from the same params on every plan
                    meta = cfx.amp.fp8_meta(cfx.device_get(state.opt_state))
                    first = Fp8Meta(meta.history[:1024], meta.scale[:54])  # (per-rank states: stacked)
            return losses, first, step.params(state), cfx.amp.fp8_meta(cfx.device_get(state.opt_state))

    one, m1, _, last = run("")
    assert m1.scale.shape == (54,) and (m1.history[-1] > 0).all() and (m1.history[:-1] == 0).all()
    assert (last.history[-3:] > 0).all() and (last.history[:-3] == 0).all()  # (three steps of TE's 1,024)
    for text in ("data=2", "data=2,model=2", "data=2 zero=3", "pipe=2,data=2 microbatches=2"):
        losses, m, _, _ = run(text)
        torch.testing.assert_close(losses, one, rtol=1e-4, atol=0)
        torch.testing.assert_close(m.scale, m1.scale, rtol=1e-5, atol=0, msg=text)
        torch.testing.assert_close(m.history, m1.history, rtol=1e-5, atol=0, msg=text)
    for text in ("", "data=2"):
        straight, resumed = run(text, steps=4), run(text, steps=4, stop=2)
        assert straight[0] == resumed[0]
        for a, b in zip(straight[2:], resumed[2:]):
            assert all(torch.equal(x, y) for x, y in zip(cfx.tree.leaves(a), cfx.tree.leaves(b))), text
    with pytest.raises(ValueError, match="not offload"):
        cfx.parallel.Plan.parse("data=2 zero=3 offload=host precision=fp8:delayed")
    with pytest.raises(ValueError, match="scales each tensor whole"):
        cfx.amp.policy("fp8:rowwise", scaling="delayed")
