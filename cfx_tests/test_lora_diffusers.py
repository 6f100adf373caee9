"""cfx.lora on Stable Diffusion against diffusers (tiny random components, nothing downloaded): the file
``save_diffusers`` writes, ``StableDiffusionPipeline.load_lora_weights`` loads with equal text states,
noise predictions and DDIM latents; what diffusers saves (peft's adapters, its metadata, or its
scripts' older names without it), ``load_diffusers`` reads with equal outputs; ``python -m
cfx.diffusion.dreambooth --lora`` trains the adapters alone (fp32 and int8 bases) as a one-device loop
does, and diffusers samples with its file what cfx samples with the adapters attached."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
PIL = pytest.importorskip("PIL")

import cfx  # noqa: E402
from cfx._src.diffusion.finetune import batch_at, rows_of  # noqa: E402
from cfx._src.diffusion.sampling import sample, text_states  # noqa: E402
from cfx._src.diffusion.train import denoising_loss, unet_base  # noqa: E402
from cfx.diffusion.dreambooth import main  # noqa: E402
from cfx_tests import test_diffusion_finetune  # noqa: E402
from cfx_tests.test_diffusion_dreambooth import (INSTANCE, assert_losses, encoded, flags, run_losses,  # noqa: E402
                                                 subject)
from cfx_tests.test_diffusion_pipeline import in_float64  # noqa: E402

pipe_dir = test_diffusion_finetune.pipe_dir  # the tiny pipeline, saved with a char-level tokenizer
UNET = cfx.lora.LoraConfig(r=4, alpha=8, targets=("unet-attn",))          # alpha != r: the metadata carries it
TEXT = cfx.lora.LoraConfig(r=2, alpha=3, targets=("attn",), rslora=True)
PEFT_UNET = ["to_k", "to_out.0", "to_q", "to_v"]                          # diffusers' DreamBooth-LoRA targets
PEFT_TEXT = ["k_proj", "out_proj", "q_proj", "v_proj"]


@pytest.fixture(scope="module")
def base(pipe_dir):
    return cfx.diffusion.load_pipeline(pipe_dir)


def reference_pipeline(pipe_dir):
    """diffusers' pipeline of the same base weights (read from the directory cfx reads)."""
    return diffusers.StableDiffusionPipeline(
        vae=diffusers.AutoencoderKL.from_pretrained(pipe_dir / "vae"),
        text_encoder=transformers.CLIPTextModel.from_pretrained(pipe_dir / "text_encoder"), tokenizer=None,
        unet=diffusers.UNet2DConditionModel.from_pretrained(pipe_dir / "unet"),
        scheduler=diffusers.DDIMScheduler.from_pretrained(pipe_dir / "scheduler"), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False)


def trained(model, config, seed):
    """Adapters with every B moved off zero, as after training."""
    ad = cfx.lora.init(model, config, cfx.random.key(seed))
    return cfx.tree.map(lambda x: x if x.abs().max() > 0 else 0.3 * cfx.random.normal(cfx.random.key(seed + 1), x.shape),
                        ad)


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 99, (2, 7), generator=g), torch.randn(2, 4, 8, 8, generator=g, dtype=torch.float64)


def to64(tree):
    return cfx.tree.map(lambda x: x.double(), tree)


def outputs_cfx(p, unet=None, text=None, *, seed=1):
    """(text states, noise prediction at t=10) of cfx's models, each with its adapters attached."""
    tokens, latents = inputs(seed)
    tp = p.text_params if text is None else cfx.lora.attach(p.text_params, *text)
    up = p.unet_params if unet is None else cfx.lora.attach(p.unet_params, *unet)
    with torch.no_grad():
        h = p.text_encoder.apply(tp, tokens)[0]
        return h, p.unet.apply(up, latents, 10, h)


def outputs_diffusers(pipe, *, seed=1):
    tokens, latents = inputs(seed)
    with torch.no_grad():
        h = pipe.text_encoder(tokens).last_hidden_state
        return h, pipe.unet(latents, 10, h).sample


def test_save_diffusers_loads_in_diffusers_with_equal_outputs(base, pipe_dir, tmp_path):
    """The fp32 file, then both sides in fp64 at assert_close's fp64 defaults: the same sums in peft's
    order of operations (in fp32 each CPU's kernels decide the last bits); the adapters move both
    outputs by far more (> 0.1)."""
    ua, ta = trained(base.unet, UNET, 0), trained(base.text_encoder, TEXT, 2)
    cfx.lora.save_diffusers(tmp_path, base, unet=(ua, UNET), text_encoder=(ta, TEXT))
    pipe = reference_pipeline(pipe_dir)
    pipe.load_lora_weights(tmp_path)
    want = outputs_diffusers(pipe.to(torch.float64))
    base64 = in_float64(base)
    got = outputs_cfx(base64, (to64(ua), UNET), (to64(ta), TEXT))
    plain = outputs_cfx(base64)
    for g, w, p in zip(got, want, plain):
        assert (g - p).abs().max() > 0.1
        torch.testing.assert_close(g, w)
    q = pipe.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q
    assert q.scaling == {"default_0": 2.0}  # alpha / r from the file's metadata, not diffusers' alpha = r
    # and back: load_diffusers reads the same configs (the presets) and adapters
    back = cfx.lora.load_diffusers(tmp_path, base)
    assert (back["unet"][0], back["text_encoder"][0]) == (UNET, TEXT)
    cfx.tree.assert_close(back["unet"][1], ua, rtol=0, atol=0)
    cfx.tree.assert_close(back["text_encoder"][1], ta, rtol=0, atol=0)


def peft_pipeline(pipe_dir, *, r=4, alpha=8):
    """diffusers' pipeline with peft LoRA (random A and B) on the UNet's attention and the text
    encoder's, as diffusers' DreamBooth-LoRA script adds it."""
    pipe = reference_pipeline(pipe_dir)
    torch.manual_seed(3)
    pipe.unet.add_adapter(peft.LoraConfig(r=r, lora_alpha=alpha, init_lora_weights=False, target_modules=PEFT_UNET))
    text_cfg = peft.LoraConfig(r=2, lora_alpha=2, init_lora_weights=False, target_modules=PEFT_TEXT)
    peft.inject_adapter_in_model(text_cfg, pipe.text_encoder)
    return pipe, pipe.unet.peft_config["default"], text_cfg


@pytest.mark.parametrize("layout", ["peft+metadata", "diffusers-names"])
def test_a_diffusers_saved_lora_loads_into_cfx_with_equal_outputs(base, pipe_dir, tmp_path, layout):
    """``save_lora_weights`` of peft's state dicts with their configs as metadata, or renamed by
    ``convert_state_dict_to_diffusers`` (``lora.down`` / ``lora_linear_layer.up``) with none (then
    alpha = r, diffusers' rule, so that case trains with alpha = r). Equal in fp64 at assert_close's
    defaults; the keys cfx writes for the same adapters are diffusers' (up to ``text_model.``)."""
    from peft.utils import get_peft_model_state_dict

    metadata = layout == "peft+metadata"
    pipe, unet_cfg, text_cfg = peft_pipeline(pipe_dir, alpha=8 if metadata else 4)
    layers = [get_peft_model_state_dict(pipe.unet), get_peft_model_state_dict(pipe.text_encoder)]
    if not metadata:
        layers = [diffusers.utils.convert_state_dict_to_diffusers(sd) for sd in layers]
        assert any(".lora.down." in k for k in layers[0]) and any("lora_linear_layer.up" in k for k in layers[1])
    extra = dict(unet_lora_adapter_metadata=unet_cfg.to_dict(),
                 text_encoder_lora_adapter_metadata=text_cfg.to_dict()) if metadata else {}
    diffusers.StableDiffusionPipeline.save_lora_weights(tmp_path / "theirs", unet_lora_layers=layers[0],
                                                        text_encoder_lora_layers=layers[1], **extra)
    loaded = cfx.lora.load_diffusers(tmp_path / "theirs", base)
    (uc, ua), (tc, ta) = loaded["unet"], loaded["text_encoder"]
    assert (uc.r, uc.alpha, uc.targets, tc.r, tc.alpha, tc.targets) == (4, 8 if metadata else 4, ("unet-attn",),
                                                                         2, 2, ("attn",))
    want = outputs_diffusers(pipe.to(torch.float64))
    for g, w in zip(outputs_cfx(in_float64(base), (to64(ua), uc), (to64(ta), tc)), want):
        torch.testing.assert_close(g, w)
    if metadata:
        cfx.lora.save_diffusers(tmp_path / "ours", base, unet=(ua, uc), text_encoder=(ta, tc))
        from safetensors import safe_open
        keys = [set(safe_open(str(d / "pytorch_lora_weights.safetensors"), "pt").keys()) for d in
                (tmp_path / "theirs", tmp_path / "ours")]
        assert {k.replace("text_encoder.text_model.", "text_encoder.") for k in keys[1]} == keys[0]


def test_load_diffusers_errors_name_the_key_and_the_fix(base, tmp_path):
    with pytest.raises(ValueError, match=r"no pytorch_lora_weights\.safetensors in"):
        cfx.lora.load_diffusers(tmp_path, base)
    from safetensors.torch import save_file
    save_file({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(2, 16)},
              str(tmp_path / "pytorch_lora_weights.safetensors"))
    with pytest.raises(ValueError, match=r"no LoRA weight in diffusers' layout.*kohya.*load_lora_weights"):
        cfx.lora.load_diffusers(tmp_path, base)
    save_file({"unet.down_blocks.0.attentions.0.transformer_blocks.0.attn9.to_q.lora_A.weight": torch.zeros(2, 16),
               "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn9.to_q.lora_B.weight": torch.zeros(16, 2)},
              str(tmp_path / "pytorch_lora_weights.safetensors"))
    with pytest.raises(ValueError, match=r"unet adapter on 'down_blocks\.0.*attn9\.to_q' has no Linear.*another model"):
        cfx.lora.load_diffusers(tmp_path, base)
    with pytest.raises(ValueError, match=r"shares one A among \('to_q', 'to_k', 'to_v'\).*Drop shared_a"):
        cfg = cfx.lora.LoraConfig(targets=("*.attn1.to_[qkv]",), shared_a=(("to_q", "to_k", "to_v"),))
        cfx.lora.save_diffusers(tmp_path, base, unet=(cfx.lora.init(base.unet, cfg, cfx.random.key(0)), cfg))
    with pytest.raises(ValueError, match=r"nothing to save"):
        cfx.lora.save_diffusers(tmp_path, base)
    with pytest.raises(ValueError, match=r"no leaf matched the targets \('unet-attn',\).*blocks\.0\.attn"):
        cfx.lora.init(base.text_encoder, UNET, cfx.random.key(0))


# -- python -m cfx.diffusion.dreambooth --lora ---------------------------------------------------------
def reference_lora(pipe, instance_dir, class_dir, steps, *, config, w, base="fp32", batch=2, lr=1e-3, seed=0):
    """The CLI's LoRA run written out on one device: the adapters from the CLI's key, the same rows
    and draws, ``mse(instance) + w * mse(class)`` of the frozen UNet (``base``: fp32, or every Linear
    and conv weight int8 by ``cfx.quant``) with the adapters attached, AdamW on the adapters alone."""
    inst = encoded(pipe, instance_dir, INSTANCE)
    both = inst
    if w:
        from cfx._src.diffusion.finetune import Encoded
        cls = encoded(pipe, class_dir, "a square")
        both = Encoded(*(torch.cat([a, b]) for a, b in zip((inst.mean, inst.logvar, inst.text),
                                                             (cls.mean, cls.logvar, cls.text))))
    frozen = pipe.unet_params
    if base == "int8":
        frozen = cfx.quant.quantize(frozen, "int8", axes=pipe.unet.axes(), min_size=0)
    _, k_train = cfx.random.split(cfx.random.key(seed), 2)
    k_inst, k_cls, k_steps = cfx.random.split(k_train, 3)
    adapters = cfx.lora.init(pipe.unet, config, cfx.random.fold_in(k_train, 1))
    tx = cfx.optim.adamw(lr, weight_decay=1e-2)
    state, losses = tx.init(adapters), []
    for step in range(steps):
        rows = rows_of(len(inst), batch, step, k_inst)
        if w:
            rows = torch.cat([rows, len(inst) + rows_of(len(cls), batch, step, k_cls)])
        b = batch_at(pipe, both, rows, cfx.random.fold_in(k_steps, step))

        def loss(ad):
            p = cfx.lora.attach(frozen, ad, config)
            halves = [x.chunk(2) if w else (x,) for x in b]
            prior = w * denoising_loss(pipe.unet, pipe.schedule, p, *(h[1] for h in halves)) if w else 0.0
            return denoising_loss(pipe.unet, pipe.schedule, p, *(h[0] for h in halves)) + prior
        value, grads = cfx.value_and_grad(loss)(adapters)
        losses.append(float(value))
        updates, state = tx.update(grads, state, adapters)
        adapters = cfx.optim.apply_updates(adapters, updates)
    return adapters, losses


def assert_adapters_close(got, want, steps):
    """AdamW on two paths (``assert_adamw_close``'s rule: equal at the fp32 defaults but for at most
    0.5% of the elements, each within 2 lr per step)."""
    test_diffusion_finetune.assert_adamw_close(got, want, steps=steps)
    assert any(float(x.abs().max()) > 0 for p, x in cfx.tree.flatten_with_path(got)[0] if p.endswith(".B"))


@pytest.mark.timeout(300)
def test_the_lora_cli_trains_the_adapters_alone_and_diffusers_samples_the_same(pipe_dir, base, tmp_path, capsys,
                                                                              monkeypatch):
    instance_dir, out = subject(tmp_path / "instance"), tmp_path / "out"
    runs = run_losses(monkeypatch)
    assert main(flags(pipe_dir, instance_dir, out, "--steps", "3", "--prior-loss-weight", "0.5", "--mesh", "data=2",
                      "--lora", "r=4,alpha=8")) == 0
    printed = capsys.readouterr().out.strip()
    assert not (out / "unet").exists()  # the adapters alone: no pipeline written
    loaded = cfx.lora.load_diffusers(out, base)
    assert list(loaded) == ["unet"]
    config, got = loaded["unet"]
    assert config == UNET
    # r (in + out) per projection: 56 C + 128 per transformer of width C (r=4; attn2's to_k and to_v
    # read the 16-wide text states), three of width 16 and the mid block's of width 32
    n = cfx.tree.size(got)
    assert n == 3 * (56 * 16 + 128) + (56 * 32 + 128)
    assert printed.endswith(f"LoRA adapters ({n:,} params) in {out / 'pytorch_lora_weights.safetensors'}"), printed
    want, losses = reference_lora(base, instance_dir, out / "class_images", 3, config=UNET, w=0.5)
    assert_losses(printed, runs[-1], losses)
    assert_adapters_close(got, want, 3)
    # diffusers with the file on the same base weights: the same DDIM latents (4 steps, guidance 7.5) as
    # cfx's sampler with the adapters attached, both in fp64 at assert_close's fp64 defaults (in fp32 the
    # CPU's kernels decide the last bits: 2e-5 apart on one machine, bitwise on another)
    pipe = reference_pipeline(pipe_dir)
    pipe.load_lora_weights(out)
    pipe.set_progress_bar_config(disable=True)
    pipe.to(torch.float64)
    base64 = in_float64(base)
    tokens, _ = inputs(2)
    cond, uncond = text_states(base64, tokens), text_states(base64, torch.zeros_like(tokens))
    latents = cfx.random.normal(cfx.random.key(5), (2, 4, 8, 8)).double()
    tuned = dataclasses.replace(base64, unet_params=cfx.lora.attach(base64.unet_params, to64(got), config))
    ours = sample(tuned, cond, uncond, steps=4, guidance_scale=7.5, latents=latents, decode=False)
    theirs = pipe(prompt_embeds=cond, negative_prompt_embeds=uncond, latents=latents, num_inference_steps=4,
                  guidance_scale=7.5, output_type="latent", height=16, width=16).images
    assert ours.dtype == theirs.dtype == torch.float64
    torch.testing.assert_close(ours, theirs)
    plain = sample(base64, cond, uncond, steps=4, guidance_scale=7.5, latents=latents, decode=False)
    assert (ours - plain).abs().max() > 1e-3
    meta = json.loads(__import__("safetensors").safe_open(str(out / "pytorch_lora_weights.safetensors"), "pt")
                      .metadata()["lora_adapter_metadata"])
    assert (meta["unet.r"], meta["unet.lora_alpha"], len(meta["unet.target_modules"])) == (4, 8, 4 * 8)


@pytest.mark.timeout(300)
def test_the_lora_cli_over_an_int8_base_trains_what_one_device_trains(pipe_dir, base, tmp_path, capsys, monkeypatch):
    """Every Linear and conv weight of the frozen UNet int8 (the adapted ones too); the adapters as a
    one-device loop over ``cfx.quant.quantize``'s weights trains them."""
    instance_dir, out = subject(tmp_path / "instance"), tmp_path / "out"
    runs = run_losses(monkeypatch)
    config = cfx.lora.LoraConfig(r=2, alpha=2, targets=("unet-attn", "*.ff.proj"))
    assert main(flags(pipe_dir, instance_dir, out, "--steps", "2", "--prior-loss-weight", "0", "--lora",
                      "r=2,alpha=2,targets=unet-attn+*.ff.proj", "--lora-base", "int8")) == 0
    got_config, got = cfx.lora.load_diffusers(out, base)["unet"]
    assert got_config.targets == tuple(sorted(p[:-2] + ".w" for p in cfx.tree.leaf_paths(got) if p.endswith(".A")))
    want, losses = reference_lora(base, instance_dir, None, 2, config=config, w=0, base="int8")
    assert_losses(capsys.readouterr().out, runs[-1], losses)
    assert_adapters_close(got, want, 2)
    int8 = unet_base(base.unet, base.unet_params, "int8")  # what the CLI froze: the adapted weights too
    chosen = [x for p, x in cfx.tree.flatten_with_path(int8, is_leaf=cfx.quant.is_quantized)[0]
              if p.endswith((".to_q.w", "conv_in.w"))]
    assert len(chosen) == 8 + 1 and all(isinstance(x, cfx.quant.QuantizedWeight) for x in chosen)  # 4 x attn1, attn2


def test_a_bf16_base_computes_the_fp32_loss_within_bf16_rounding(base):
    """bf16 weights (the UNet computes in bf16), fp32 adapters: the loss within 2% of the fp32 base's."""
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 16, 16, generator=g), torch.tensor([10, 700]),
             torch.randn(2, 4, 8, 8, generator=g))
    adapters = trained(base.unet, UNET, 0)
    from cfx._src.diffusion.train import lora_denoiser
    losses = {b: lora_denoiser(base.unet, base.schedule, unet_base(base.unet, base.unet_params, b), UNET, adapters)
              .loss(adapters, *batch) for b in ("fp32", "bf16")}
    bf16 = unet_base(base.unet, base.unet_params, "bf16")
    assert {x.dtype for x in cfx.tree.leaves(bf16) if x.is_floating_point()} == {torch.bfloat16}
    assert losses["fp32"].dtype == losses["bf16"].dtype == torch.float32
    torch.testing.assert_close(losses["bf16"], losses["fp32"], rtol=2e-2, atol=0)


def test_bad_lora_flags_exit_with_the_flags_name(pipe_dir, tmp_path, capsys):
    instance_dir = subject(tmp_path / "instance")
    cases = [(["--lora", "r=4,alpha"], "--lora 'r=4,alpha': expected comma-separated KEY=VALUE"),
             (["--lora", "r=four"], "--lora 'r=four': r='four' is not a valid r"),
             (["--lora", "r=0"], "--lora 'r=0': r must be a positive int"),
             (["--lora", "r=4,targets=ff.nope"], "no leaf matched the targets ('ff.nope',)"),
             (["--lora-base", "int8"], "--lora-base int8 is the frozen UNet of LoRA training; add --lora"),
             (["--lora", "r=4", "--precision", "bf16"], "--precision bf16 casts the trained weights; --lora"),
             (["--lora", "r=4", "--mesh", "data=1,model=2"], "--mesh data=1,model=2: --lora trains over data ranks")]
    for extra, says in cases:
        assert main(flags(pipe_dir, instance_dir, tmp_path / "o", "--prior-loss-weight", "0", "--steps", "1",
                          *extra)) == 2
        assert says in capsys.readouterr().err, says
