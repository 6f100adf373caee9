"""The denoising step under a ``cfx.parallel.Plan`` (``cfx.diffusion.Denoiser``): data parallelism,
ZeRO 1-3, offload, remat per block and tensor parallelism (heads, feed-forward units and resnet
channels over ``model``) train the UNet as one device does (3 SGD-momentum steps, params at the
``assert_close`` defaults), bf16 stays close to fp32, ZeRO-3 gathers the UNet block by block, and
the axes a UNet has no use for are refused before any rank runs."""
from __future__ import annotations

import pytest
import torch

import cfx
from cfx._src.diffusion.train import Denoiser
from cfx._src.zero.gathered import gathered, gathered_children, sublayer_at

CONFIG = cfx.diffusion.UNet2DConditionConfig(
    in_channels=4, out_channels=4, block_out_channels=(16, 32), layers_per_block=1,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=16, attention_head_dim=4, norm_num_groups=8)


def _model() -> Denoiser:
    return Denoiser(cfx.diffusion.UNet2DCondition(CONFIG), cfx.diffusion.Schedule())


def _batches(model: Denoiser, n: int = 3, rows: int = 4) -> list[tuple]:
    g = torch.Generator().manual_seed(1)
    out = []
    for s in range(n):
        latents, text = torch.randn(rows, 4, 8, 8, generator=g), torch.randn(rows, 5, 16, generator=g)
        out.append((latents, text, *cfx.diffusion.draw(model.schedule, cfx.random.key(s), latents)))
    return out


def _single_device(model, tx, params, batches):
    state, losses = tx.init(params), []
    for b in batches:
        loss, grads = cfx.value_and_grad(lambda p: model.loss(p, *b))(params)
        updates, state = tx.update(grads, state, params)
        params = cfx.optim.apply_updates(params, updates)
        losses.append(float(loss))
    return params, losses


def _planned(text: str, model, tx, params, batches, *, held: dict | None = None):
    """The params and losses of ``batches`` under ``text``; ``held``: filled with the frozen bytes each
    rank keeps (``TrainState.frozen``)."""
    from cfx._src.plan.frozen import frozen_bytes
    plan = cfx.parallel.Plan.parse(text)
    with plan.make_mesh() as mesh:
        step = plan.step(model, tx, mesh=mesh)
        state = step.init_from(params)
        losses = []
        for b in batches:
            state, metrics = step(state, b)
            losses.append(float(metrics["loss"]))
        if held is not None:
            held["bytes"] = [frozen_bytes(state.frozen, r) for r in mesh.local_ranks]
        return step.params(state), losses


@pytest.mark.timeout(300)
@pytest.mark.parametrize("text", ["data=2", "data=2 zero=1", "data=2 zero=3",
                                  "data=2 zero=3 offload=host remat=blocks", "data=2 zero=2 remat=dots",
                                  "model=2", "data=2,model=2 zero=3 remat=blocks"])
def test_plans_train_the_unet_as_one_device(text):
    model, tx = _model(), cfx.optim.sgd(0.05, momentum=0.9)
    params = model.init(cfx.random.key(3))
    batches = _batches(model)
    want, want_losses = _single_device(model, tx, params, batches)
    got, losses = _planned(text, model, tx, params, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses))
    cfx.tree.assert_tree_close(got, want)


@pytest.mark.timeout(300)
def test_bf16_plan_stays_close_to_fp32():
    model, tx = _model(), cfx.optim.adamw(1e-3)
    params = model.init(cfx.random.key(3))
    batches = _batches(model, n=2)
    _, want = _single_device(model, tx, params, batches)
    _, got = _planned("data=2 zero=3 precision=bf16 remat=blocks", model, tx, params, batches)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-2, atol=0)


def test_zero3_gathers_block_by_block():
    model = _model()
    wrapped = model.map_blocks(lambda b: gathered(b, axis="data"))
    children = gathered_children(wrapped)
    # every resnet and transformer is its own gathered layer, at its path in the params tree
    assert len(children) == len(model.blocks) == 12
    paths = [p for p, _ in cfx.tree.flatten_with_path(model.init(cfx.random.key(0)))[0]]
    for prefix in children:
        assert any(p.startswith(prefix + ".") for p in paths), prefix
        assert sublayer_at(wrapped, prefix).layer in model.blocks
    plan = cfx.parallel.Plan.parse("data=2 zero=3")
    with plan.make_mesh() as mesh:
        step = plan.step(model, cfx.optim.sgd(0.1), mesh=mesh)
        state = step.init(cfx.random.key(0))
        with cfx.comm_stats() as stats:
            step(state, _batches(model, n=1)[0])
    # forward: the root's own params and each block's, one all-gather each (per rank)
    assert stats.count(op="all_gather", axes=("data",), rank=0, backward=False) >= 13
    assert stats.count(op="reduce_scatter", axes=("data",), rank=0, backward=True) == 13


@pytest.mark.parametrize("text, says", [
    ("model=3", "do not split 3 ways"), ("seq=2", "drop seq="), ("pipe=2", "drop the pipe axis"),
    ("data=2 remat=auto:1GiB", "remat=blocks"), ("model=2 sp=megatron", "Drop sp=")])
def test_axes_a_unet_cannot_use_are_refused(text, says):
    with pytest.raises(ValueError, match=says):
        cfx.parallel.Plan.parse(text).check(_model())


@pytest.mark.timeout(120)
def test_bad_batches_are_refused_before_any_rank_runs():
    model = _model()
    plan = cfx.parallel.Plan.parse("data=2")
    latents, text, t, noise = _batches(model, n=1, rows=3)[0]
    with plan.make_mesh() as mesh:
        step = plan.step(model, cfx.optim.sgd(0.1), mesh=mesh)
        state = step.init(cfx.random.key(0))
        with pytest.raises(ValueError, match="does not split over data=2"):
            step(state, (latents, text, t, noise))
        with pytest.raises(ValueError, match="four tensors"):
            step(state, (latents, text, t))
        with pytest.raises(ValueError, match="noise must be shaped like the latents"):
            step(state, (latents[:2], text[:2], t[:2], noise))


def test_describe_gives_the_unets_state_per_rank():
    model = _model()
    n = sum(x.numel() for x in cfx.tree.leaves(model.init(cfx.random.key(0))))
    d = cfx.parallel.Plan.parse("data=2 zero=3 offload=host").describe(model)
    assert abs(d.bytes["params"] - 4 * n / 2) <= 4 * 2 * len(cfx.tree.leaves(model.init(cfx.random.key(0))))  # padding
    largest = max(sum(x.numel() for x in cfx.tree.leaves(b.init(cfx.random.key(0)))) for b in model.blocks)
    assert 4 * largest <= d.bytes["gathered block"] <= 4 * (largest + 2 * 16)
    with pytest.raises(ValueError, match="takes a batch of its own"):
        cfx.parallel.Plan.parse("data=2").describe(model, batch=(4, 8))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("text", ["data=2 zero=3", "data=2 zero=3 offload=host"])
def test_lora_adapters_of_a_frozen_unet_train_under_zero3_and_offload_as_one_device(text):
    """``lora_denoiser``: the adapters (ZeRO-3 pieces, with offload in host memory) over a frozen fp32 UNet
    train as the single-device plan trains them (the same program protocol, ``Plan().step``); the frozen
    UNet is the state's ``frozen``, kept as the adapters are: half of it on each rank (ZeRO-3's pieces,
    up to their padding)."""
    from cfx._src.diffusion.train import lora_denoiser, unet_base
    unet, schedule = cfx.diffusion.UNet2DCondition(CONFIG), cfx.diffusion.Schedule()
    config = cfx.lora.LoraConfig(r=2, alpha=4, targets=("unet-attn",))
    base = unet_base(unet, unet.init(cfx.random.key(3)), "fp32")
    adapters = cfx.tree.map(lambda x: x + 0.01, cfx.lora.init(unet, config, cfx.random.key(4)))  # B != 0: every factor learns
    model = lora_denoiser(unet, schedule, base, config, adapters)
    tx, batches = cfx.optim.adamw(1e-2), _batches(Denoiser(unet, schedule))
    one = cfx.parallel.Plan().step(model, tx)
    state, want_losses = one.init_from(adapters), []
    for b in batches:
        state, metrics = one(state, b)
        want_losses.append(float(metrics["loss"]))
    held = {}
    got, losses = _planned(text, model, tx, adapters, batches, held=held)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses))
    cfx.tree.assert_tree_close(got, one.params(state))
    assert not cfx.tree.allclose(got, adapters)  # the adapters moved
    whole = cfx.tree.nbytes(base)
    assert state.frozen is base  # one device: the whole UNet, as given
    assert all(whole / 2 <= b <= whole / 2 * 1.01 for b in held["bytes"]), (held, whole)
