"""cfx.models.ViT with its [CLS] + patches split over a sequence axis equals one device: ring (zigzag)
and Ulysses over ``seq``, the USP hybrid over two axes and Megatron-SP over ``model`` -- logits, loss
and every gradient in fp64, on a sequence that needs padding (1 + 4 patches) and one that does not
(1 + 9 over Ulysses' 2 ranks); a Plan with seq=2 trains it three AdamW steps as one device does."""
from __future__ import annotations

import pytest
import torch

import cfx
from cfx import P
from cfx.parallel import MEGATRON_RULES, sequence_grads, sequence_parallel, tensor_parallel

NO_VOCAB = {k: v for k, v in MEGATRON_RULES.items() if k != "vocab"}


def tiny(**kw):
    return cfx.models.vit("tiny", **{**dict(image_size=8, patch_size=4, hidden_size=16, n_head=2, n_layer=2,
                                          intermediate_size=32, num_labels=3), **kw})


def images_and_labels(model, B, seed=0, dtype=torch.float32):
    c = model.config
    x = cfx.random.normal(cfx.random.key(seed), (B, c.num_channels, c.image_size, c.image_size), dtype=dtype)
    return x, cfx.random.randint(cfx.random.key(seed + 1), (B,), 0, c.num_labels)


def split(model, how):
    """The split model, its mesh and the axis (or pair) its sequence is split over."""
    if how in ("ring", "ulysses"):
        return sequence_parallel(model, "seq", method=how), {"seq": 2}, "seq"
    if how == "hybrid":
        return sequence_parallel(model, ("ring", "uly"), method="hybrid"), {"ring": 2, "uly": 2}, ("ring", "uly")
    return tensor_parallel(model, "model", sequence=True), {"model": 2}, "model"


def sharded(model, params, x, y, how, data=False):
    sp, shape, axis = split(model, how)
    shape = {"data": 2, **shape} if data else shape

    def body(p, x, y):
        loss, g = cfx.value_and_grad(lambda p: sp.loss(p, x, y))(p)
        g = sequence_grads(g, specs, axis)  # each rank's gradient is its positions' share
        if data:
            loss, g = cfx.lax.pmean(loss, "data"), cfx.parallel.tree_pmean(g, "data")
        return loss, sp.apply(p, x), g
    with cfx.Mesh(shape) as mesh:
        specs = cfx.Rules(NO_VOCAB).specs(model.axes(), mesh=mesh) if how == "megatron" else P()
        rows = P("data") if data else P()
        return cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=(specs, rows, rows),
                                            out_specs=(P(), rows, specs))(params, x, y))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["ring", "ulysses", "hybrid", "megatron"])
@pytest.mark.parametrize("image_size", [8, 12], ids=["5tokens", "10tokens"])
def test_split_sequence_equals_one_device_in_fp64(how, image_size):
    # 5 tokens pad to 8 (ring, hybrid: zigzag chunks of 2 x 2 ranks) or 6 (Ulysses, Megatron-SP); 10
    # tokens split over Ulysses' and Megatron-SP's 2 ranks unpadded, and pad to 12 for the ring
    model = tiny(image_size=image_size)
    params = cfx.tree.map(lambda t: t.double(), model.init(cfx.random.key(0)))
    x, y = images_and_labels(model, 3, dtype=torch.float64)
    want_loss, want = cfx.value_and_grad(lambda p: model.loss(p, x, y))(params)
    loss, logits, grads = sharded(model, params, x, y, how)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(logits, model.apply(params, x))
    cfx.tree.assert_tree_close(grads, want)


@pytest.mark.timeout(120)
def test_split_sequence_with_data_rows_equals_one_device():
    model = tiny()
    params = model.init(cfx.random.key(0))
    x, y = images_and_labels(model, 4)
    parts = [cfx.value_and_grad(lambda p: model.loss(p, x[r], y[r]))(params) for r in (slice(0, 2), slice(2, 4))]
    loss, logits, grads = sharded(model, params, x, y, "ring", data=True)
    torch.testing.assert_close(loss, (parts[0][0] + parts[1][0]) / 2)
    torch.testing.assert_close(logits, model.apply(params, x))
    cfx.tree.assert_tree_close(grads, cfx.tree.map(lambda a, b: (a + b) / 2, parts[0][1], parts[1][1]))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("text", ["seq=2,data=2", "seq=2 sp=ulysses"])
def test_plans_with_a_seq_axis_train_vit_as_one_device(text):
    from cfx_tests.test_plan import run_plan, single_device
    model = tiny()
    data = [images_and_labels(model, 4, seed) for seed in (0, 2, 4)]
    want_losses, want = single_device(model, cfx.optim.adamw(1e-3), data)
    losses, got = run_plan(cfx.parallel.Plan.parse(text), model, cfx.optim.adamw(1e-3), data)
    torch.testing.assert_close(losses, want_losses)
    cfx.tree.assert_tree_close(got, want)


@pytest.mark.timeout(60)
def test_pipeline_stages_of_a_split_sequence_are_refused():
    with pytest.raises(ValueError, match="ViT.parts\\(\\): pipeline stages of a ViT whose sequence is split over "
                                         "'seq'.*drop pipe="):
        sequence_parallel(tiny(), "seq").parts()
    plan = cfx.parallel.Plan.parse("pipe=2,seq=2")  # the Plan builds its stages before any collective
    with plan.make_mesh() as mesh, pytest.raises(ValueError, match="drop pipe= or the sequence split"):
        plan.step(tiny(), cfx.optim.adamw(1e-3), mesh=mesh)
