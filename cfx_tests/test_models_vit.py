"""cfx.models.ViT = transformers' ViTForImageClassification on drawn tiny configs: logits and loss, every
gradient (fp64: the claim is the same function, which fp32 settles only up to each CPU's kernels);
weights both ways (transformers 5's layout written, 4's read), Hugging Face directories too; dropout by
key; bad inputs named; and Plans over data, ZeRO-3, the model axis and pipe stages train it five AdamW
steps as one device does."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx_tests.budget import examples
from cfx_tests.hf_helpers import roughen

transformers = pytest.importorskip("transformers")

NORMS = ("layernorm_before.weight", "layernorm_after.weight", "layernorm.weight")


def tiny(**kw):
    return cfx.models.vit("tiny", **{**dict(image_size=8, patch_size=4, hidden_size=16, n_head=2, n_layer=2,
                                          intermediate_size=32, num_labels=3), **kw})


def twin(model, seed=0, dtype=torch.float32):
    """An HF ViTForImageClassification with weights moved off their init, and the same in cfx."""
    torch.manual_seed(seed)
    hf = roughen(transformers.ViTForImageClassification(model.hf_config()), NORMS, seed).eval().to(dtype)
    _, params = cfx.models.from_hf(hf, model)
    return hf, params


def images_and_labels(model, B, seed=0, dtype=torch.float32):
    c = model.config
    x = cfx.random.normal(cfx.random.key(seed), (B, c.num_channels, c.image_size, c.image_size), dtype=dtype)
    return x, cfx.random.randint(cfx.random.key(seed + 1), (B,), 0, c.num_labels)


configs = st.fixed_dictionaries(dict(
    image_size=st.sampled_from([8, 12, 16]), num_channels=st.integers(1, 3), n_layer=st.integers(1, 2),
    n_head=st.sampled_from([1, 2, 4]), intermediate_size=st.sampled_from([8, 24]),
    num_labels=st.integers(2, 5))).map(lambda kw: tiny(**kw))


@examples(ci=5)
@given(model=configs, B=st.integers(1, 3), seed=st.integers(0, 3))
def test_logits_and_loss_equal_transformers(model, B, seed):
    hf, params = twin(model, seed, torch.float64)
    x, y = images_and_labels(model, B, seed, torch.float64)
    with torch.no_grad():
        out = hf(pixel_values=x, labels=y)
    torch.testing.assert_close(model.apply(params, x), out.logits)  # fp64 defaults
    torch.testing.assert_close(model.loss(params, x, y), out.loss)  # fp64 both (cfx's loss: at least fp32)


@examples(ci=5)
@given(model=configs, B=st.integers(1, 3), seed=st.integers(0, 3))
def test_every_gradient_equals_transformers_in_fp64(model, B, seed):
    hf, params = twin(model, seed, torch.float64)
    x, y = images_and_labels(model, B, seed, torch.float64)
    # through the logits, with any cotangent: every op in fp64, so fp64's default tolerances
    ct = cfx.random.normal(cfx.random.key(seed + 2), (B, model.config.num_labels), dtype=torch.float64)
    (hf(pixel_values=x).logits * ct).sum().backward()
    got = cfx.models.to_hf(model, cfx.grad(lambda p: (model.apply(p, x) * ct).sum())(params))
    for name, p in hf.named_parameters():
        torch.testing.assert_close(got[name], p.grad, msg=lambda m: f"{name}: {m}")
        p.grad = None
    # through the loss: cfx's cross-entropy takes its softmax in fp32 (nn/loss.py), so d loss / d logits
    # carries fp32 rounding (~6e-8 of it) into every gradient, which are of order 1 here
    out = hf(pixel_values=x, labels=y)
    out.loss.backward()
    loss, grads = cfx.value_and_grad(lambda p: model.loss(p, x, y))(params)
    torch.testing.assert_close(loss.double(), out.loss, rtol=1e-6, atol=1e-7)
    got = cfx.models.to_hf(model, grads)
    for name, p in hf.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_weights_convert_both_ways_and_transformers_4_layout_reads(tmp_path):
    hf = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=12, patch_size=4, num_channels=2, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=24, num_labels=5)).eval()
    model, params = cfx.models.from_hf(hf)  # the model built from its config
    assert model.config == cfx.models.ViTConfig(image_size=12, patch_size=4, num_channels=2, hidden_size=16,
                                                 n_layer=2, n_head=4, intermediate_size=24, num_labels=5)
    sd = hf.state_dict()
    back = cfx.models.to_hf(model, params)
    assert set(back) == set(sd) and all(torch.equal(back[k], v) for k, v in sd.items())
    renames = (("vit.layers.", "vit.encoder.layer."), ("attention.q_proj", "attention.attention.query"),
               ("attention.k_proj", "attention.attention.key"), ("attention.v_proj", "attention.attention.value"),
               ("attention.o_proj", "attention.output.dense"), ("mlp.fc1", "intermediate.dense"),
               ("mlp.fc2", "output.dense"))
    old = {}
    for k, v in sd.items():  # transformers 4's names (the Hub's checkpoints), plus a ViTModel's pooler
        for a, b in renames:
            k = k.replace(a, b)
        old[k] = v
    old["vit.pooler.dense.weight"], old["vit.pooler.dense.bias"] = torch.zeros(16, 16), torch.zeros(16)
    _, again = cfx.models.from_hf(old, model)
    assert cfx.tree.allclose(again, params, rtol=0, atol=0)
    cfx.models.save_pretrained(tmp_path, model, params)  # a directory transformers loads, and cfx reads
    loaded = transformers.ViTForImageClassification.from_pretrained(tmp_path).eval()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in sd.items())
    same, read = cfx.models.from_pretrained(tmp_path)
    assert same == model and cfx.tree.allclose(read, params, rtol=0, atol=0)


def test_dropout_follows_the_key():
    model = tiny(dropout=0.2)
    hf, params = twin(model, dtype=torch.float64)
    x, y = images_and_labels(model, 3, dtype=torch.float64)
    a, b, c = (model.loss(params, x, y, key=cfx.random.key(k)) for k in (3, 3, 4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    with torch.no_grad():  # no key: no dropout, as HF in eval()
        torch.testing.assert_close(model.loss(params, x, y), hf(pixel_values=x, labels=y).loss)


def test_images_take_the_params_dtype():
    model = tiny()
    params = model.init(cfx.random.key(0))
    x, y = images_and_labels(model, 3)  # fp32 images into bf16 compute, as HF casts pixel_values
    half = model.loss(cfx.amp.policy("bf16").cast_to_compute(params), x, y)
    assert half.dtype == torch.float32  # the loss in fp32
    torch.testing.assert_close(half, model.loss(params, x, y), rtol=2e-2, atol=2e-2)


def test_bad_inputs_name_the_fix():
    model = tiny()
    params = model.init(cfx.random.key(0))
    x, y = images_and_labels(model, 3)
    with pytest.raises(ValueError, match=r"images must be \(B, 3, 8, 8\).*got \(3, 3, 12, 12\)"):
        model.apply(params, torch.zeros(3, 3, 12, 12))
    with pytest.raises(ValueError, match="images must be a floating"):
        model.apply(params, torch.zeros(3, 3, 8, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"labels must be integer class ids \(B,\) = \(3,\)"):
        model.loss(params, x, y[:2])
    with pytest.raises(ValueError, match=r"class ids must lie in \[0, num_labels=3\)"):
        model.loss(params, x, torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="must be a multiple of patch_size=4"):
        tiny(image_size=10)
    with pytest.raises(ValueError, match="num_labels must be >= 2"):
        tiny(num_labels=1)
    with pytest.raises(ValueError, match="ViTModel is not supported"):
        cfx.models.from_hf(transformers.ViTModel(model.hf_config()))
    with pytest.raises(ValueError, match="hidden_act='gelu_new'"):
        cfx.models.model_from_hf_config(transformers.ViTConfig(hidden_act="gelu_new"))
    with pytest.raises(ValueError, match="ViT takes a batch of its own.*remat=blocks"):
        cfx.parallel.Plan.parse("data=2 remat=auto:1MiB").check(model)
    with pytest.raises(ValueError, match="no vocabulary to split"):
        cfx.parallel.tensor_parallel(model, "model", vocab=True)
    with pytest.raises(ValueError, match=r"a ViT's batch is \(images, labels\)"):
        model.check_train_batch((x,), "here")


STEPS, B = 5, 8
# a Plan's 5 AdamW steps in fp32 against one device's (other sums, then Adam's normalisation), params of order
# 0.1-1: measured 5.5e-6 worst over threads 1/2/4 and both xdist layouts; x11
PLAN_FP32 = dict(rtol=0, atol=6e-5)


def batches():
    model = tiny()
    return [images_and_labels(model, B, seed) for seed in range(0, 2 * STEPS, 2)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("text", ["data=2 zero=3", "model=2", "pipe=2 microbatches=2",
                                  "pipe=2,data=2,model=2 zero=3 remat=blocks microbatches=2"])
def test_plans_train_vit_as_one_device(text):
    # the Plan reads the ViT through its batch axes (rows over data), its logical axes (heads and MLPs over
    # model) and the parts protocol (pipe stages), as it reads the language models
    from cfx_tests.test_plan import run_plan, single_device
    model, data = tiny(), batches()
    want_losses, want = single_device(model, cfx.optim.adamw(1e-3), data)
    losses, got = run_plan(cfx.parallel.Plan.parse(text), model, cfx.optim.adamw(1e-3), data)
    torch.testing.assert_close(losses, want_losses)
    cfx.tree.assert_tree_close(got, want, **PLAN_FP32)
