"""``python -m cfx.diffusion.dreambooth``: the weighted loss is diffusers' ``mse(instance) +
w * mse(class)``; the UNet the CLI writes (under ``data=2``) is the one a single-device loop on that
loss trains over the same rows and draws; the class images are the base pipeline's samples, drawn
once and reused; a run on a tiny subject lowers its loss without raising the prior's; bad flags
exit with the flag's name."""
from __future__ import annotations

import os

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL")

import cfx  # noqa: E402
from cfx._src.diffusion import unet  # noqa: E402
from cfx._src.diffusion.data import load_images  # noqa: E402
from cfx._src.diffusion.finetune import Encoded, batch_at, encode, rows_of  # noqa: E402
from cfx._src.diffusion.pipeline import tokenizer  # noqa: E402
from cfx._src.diffusion.sampling import latent_shape, sample, text_states  # noqa: E402
from cfx._src.diffusion.train import Denoiser, denoising_loss  # noqa: E402
from cfx.diffusion.dreambooth import main  # noqa: E402
from cfx_tests import test_diffusion_finetune  # noqa: E402
from cfx_tests.test_diffusion_finetune import assert_adamw_close  # noqa: E402

INSTANCE, CLASS = "a sks square", "a square"
pipe_dir = test_diffusion_finetune.pipe_dir  # the tiny pipeline, saved with a char-level tokenizer


@pytest.fixture(scope="module")
def base(pipe_dir):
    return cfx.diffusion.load_pipeline(pipe_dir)  # loading builds the UNet's shapes: seconds, so once


def subject(directory, n=4):
    """``n`` 16x16 images of one red 5x5 square, shifted a pixel or two, on white."""
    from PIL import Image
    directory.mkdir(parents=True, exist_ok=True)
    for i, (x, y) in enumerate([(4, 4), (6, 5), (5, 7), (7, 6)][:n]):
        pixels = torch.full((16, 16, 3), 255, dtype=torch.uint8)
        pixels[y:y + 5, x:x + 5] = torch.tensor([220, 20, 20], dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(directory / f"{i}.png")
    return directory


def flags(pipe_dir, instance_dir, out, *extra):
    return ["--pipeline", str(pipe_dir), "--instance-dir", str(instance_dir), "--instance-prompt", INSTANCE,
            "--class-prompt", CLASS, "--out", str(out), "--num-class-images", "4", "--sample-steps", "2",
            "--batch-size", "2", "--lr", "1e-3", "--no-progress", *extra]


def encoded(pipe, directory, prompt):
    images, _, _ = load_images(str(directory), captions=False)
    return encode(pipe, images, tokenizer(pipe.directory, 77)([prompt] * len(images)))


def test_the_weighted_loss_is_instance_plus_weighted_prior(base):
    p = base  # the tiny pipeline's UNet, on made-up latents and text states
    g = torch.Generator().manual_seed(0)
    B = 3
    latents, text = torch.randn(2 * B, 4, 8, 8, generator=g), torch.randn(2 * B, 16, 16, generator=g)
    t, noise = torch.randint(0, 1000, (2 * B,), generator=g), torch.randn(2 * B, 4, 8, 8, generator=g)
    model = Denoiser(p.unet, p.schedule)
    for w in (0.5, 1.0, 3.0):
        weights = torch.tensor([2.0] * B + [2.0 * w] * B)
        got = model.loss(p.unet_params, latents, text, t, noise, weights)
        # train_dreambooth.py: the prediction chunked into instance and class halves, one mse each
        pred = p.unet.apply(p.unet_params, cfx.diffusion.add_noise(p.schedule, latents, noise, t), t, text)
        (pred_i, pred_c), (noise_i, noise_c) = pred.chunk(2), noise.chunk(2)
        mse = torch.nn.functional.mse_loss
        torch.testing.assert_close(got, mse(pred_i, noise_i) + w * mse(pred_c, noise_c))
    torch.testing.assert_close(model.loss(p.unet_params, latents, text, t, noise, torch.ones(2 * B)),
                               model.loss(p.unet_params, latents, text, t, noise))


def reference(pipe, instance_dir, class_dir, steps, *, w, batch=2, lr=1e-3, seed=0):
    """The CLI's training written out on one device as diffusers does it: the same rows and draws,
    the loss ``mse(instance half) + w * mse(class half)`` (``w == 0``: the instance rows alone);
    ``(the params, the losses)``."""
    inst = encoded(pipe, instance_dir, INSTANCE)
    both = inst
    if w:
        cls = encoded(pipe, class_dir, CLASS)
        both = Encoded(*(torch.cat([a, b]) for a, b in zip((inst.mean, inst.logvar, inst.text),
                                                             (cls.mean, cls.logvar, cls.text))))
    _, k_train = cfx.random.split(cfx.random.key(seed), 2)
    k_inst, k_cls, k_steps = cfx.random.split(k_train, 3)
    tx = cfx.optim.adamw(lr, weight_decay=1e-2)
    params, state, losses = pipe.unet_params, tx.init(pipe.unet_params), []
    for step in range(steps):
        rows = rows_of(len(inst), batch, step, k_inst)
        if w:
            rows = torch.cat([rows, len(inst) + rows_of(len(cls), batch, step, k_cls)])
        b = batch_at(pipe, both, rows, cfx.random.fold_in(k_steps, step))

        def loss(p):
            halves = [x.chunk(2) if w else (x,) for x in b]
            prior = w * denoising_loss(pipe.unet, pipe.schedule, p, *(h[1] for h in halves)) if w else 0.0
            return denoising_loss(pipe.unet, pipe.schedule, p, *(h[0] for h in halves)) + prior
        value, grads = cfx.value_and_grad(loss)(params)
        losses.append(float(value))
        updates, state = tx.update(grads, state, params)
        params = cfx.optim.apply_updates(params, updates)
    return params, losses


def printed_losses(out):
    """The first and last loss of the CLI's line ``OUT: N steps, loss A -> B...``."""
    import re
    return [float(x) for x in re.search(r"loss ([0-9.]+) -> ([0-9.]+)", out).groups()]


# the CLI's fp32 losses (data=2: a mean of the ranks' means, then AdamW) against the one-device loop's, step
# by step (losses of order 1): measured 2.4e-7 worst over threads 1/2/4 and both xdist layouts; x12
FP32_LOSSES = dict(rtol=0, atol=3e-6)


def run_losses(monkeypatch):
    """Each CLI run's losses as ``run`` returns them, unrounded (its printed line shows 4 decimals)."""
    from cfx._src.diffusion import cli_dreambooth
    runs, real = [], cli_dreambooth.run

    def run(a):
        losses, note = real(a)
        runs.append(losses)
        return losses, note
    monkeypatch.setattr(cli_dreambooth, "run", run)
    return runs


def assert_losses(printed, run, want):
    """The printed line rounds ``run``'s first and last loss; ``run`` is ``want`` within ``FP32_LOSSES``."""
    assert printed_losses(printed) == [float(f"{run[0]:.4f}"), float(f"{run[-1]:.4f}")], printed
    torch.testing.assert_close(run, want, **FP32_LOSSES)


def written_unet(out):
    """The UNet's weights as the CLI wrote them (diffusers' names; no pipeline built: that takes seconds)."""
    from safetensors.torch import load_file
    return load_file(out / "unet" / "diffusion_pytorch_model.safetensors")


@pytest.mark.timeout(300)
def test_the_cli_trains_diffusers_loss_on_the_base_pipelines_class_images(pipe_dir, base, tmp_path, capsys,
                                                                          monkeypatch):
    instance_dir, out = subject(tmp_path / "instance"), tmp_path / "out"
    runs = run_losses(monkeypatch)
    assert main(flags(pipe_dir, instance_dir, out, "--steps", "3", "--prior-loss-weight", "0.5",
                      "--mesh", "data=2")) == 0
    printed = capsys.readouterr().out.strip()
    assert printed.endswith(f"4 class images in {out / 'class_images'} (4 drawn)")
    class_dir = out / "class_images"
    assert sorted(os.listdir(class_dir)) == [f"class_{i:04d}.png" for i in range(4)]
    # the class images: the BASE pipeline's DDIM samples of the class prompt against the empty one, image j
    # from fold_in(its key, j), drawn as one batch of four (write_class_images' chunk) in this process: the
    # PNGs hold write_png's 8-bit rounding of them, bit for bit
    tok = tokenizer(str(pipe_dir), 77)
    k_class, _ = cfx.random.split(cfx.random.key(0), 2)
    latents = torch.cat([cfx.random.normal(cfx.random.fold_in(k_class, j), latent_shape(base, 1, 16, 16))
                         for j in range(4)])
    cond, uncond = text_states(base, tok(CLASS)), text_states(base, tok(""))
    want = sample(base, cond.expand(4, -1, -1), uncond.expand(4, -1, -1), steps=2, latents=latents)
    got, _, _ = load_images(str(class_dir), captions=False)
    torch.testing.assert_close(((got + 1) * 127.5).round(), (want * 255).round(), rtol=0, atol=0)
    want, losses = reference(base, instance_dir, class_dir, 3, w=0.5)
    # the loss's scale (which AdamW's update barely sees) at every step; then the weights
    assert_losses(printed, runs[-1], losses)
    assert_adamw_close(written_unet(out), unet.to_diffusers_state_dict(base.unet, want))
    # --prior-loss-weight 0: no class images, the instance rows alone
    plain = tmp_path / "plain"
    assert main(flags(pipe_dir, instance_dir, plain, "--steps", "2", "--prior-loss-weight", "0")) == 0
    assert not (plain / "class_images").exists()
    want, losses = reference(base, instance_dir, None, 2, w=0)
    assert_adamw_close(written_unet(plain), unet.to_diffusers_state_dict(base.unet, want), steps=2)
    assert_losses(capsys.readouterr().out, runs[-1], losses)


def mean_loss(pipe, params, data, draws=4):
    """The denoising loss over all of ``data``'s rows, averaged over ``draws`` fixed draws of
    latents, timesteps and noise (the same for every ``params``)."""
    rows = torch.arange(len(data))
    with torch.no_grad():
        return sum(float(denoising_loss(pipe.unet, pipe.schedule, params, *batch_at(pipe, data, rows,
                                                                                      cfx.random.key(100 + k))))
                   for k in range(draws)) / draws


@pytest.mark.timeout(300)
def test_a_run_learns_the_subject_keeps_the_prior_and_reuses_class_images(pipe_dir, base, tmp_path, capsys):
    instance_dir, out = subject(tmp_path / "instance"), tmp_path / "out"
    assert main(flags(pipe_dir, instance_dir, out, "--steps", "15", "--num-class-images", "2")) == 0
    class_dir = out / "class_images"
    tuned = cfx.diffusion.load_pipeline(out)
    inst, cls = encoded(base, instance_dir, INSTANCE), encoded(base, class_dir, CLASS)
    before = mean_loss(base, base.unet_params, inst), mean_loss(base, base.unet_params, cls)
    after = mean_loss(base, tuned.unet_params, inst), mean_loss(base, tuned.unet_params, cls)
    # measured (15 steps, lr 1e-3): instance 1.12 -> 0.68, prior 1.08 -> 0.64. The tiny random UNet
    # first learns the noise's scale, which every image shares, so the prior falls with the instance
    # loss (this cannot see the subject leak into the class; the reference test pins the weights and
    # rows): the instance loss must fall by a fifth, the prior at least not rise (before and after
    # see the same draws, so neither needs a margin for noise; 0.61 and 0.59 measured).
    assert after[0] <= 0.8 * before[0], (before, after)
    assert after[1] <= 1.0 * before[1], (before, after)
    # a second run reuses the two images (untouched) and draws only the third it now asks for
    stamps = {n: (class_dir / n).stat().st_mtime_ns for n in os.listdir(class_dir)}
    capsys.readouterr()
    assert main(flags(pipe_dir, instance_dir, tmp_path / "again", "--steps", "1", "--class-dir", str(class_dir),
                      "--num-class-images", "3")) == 0
    assert capsys.readouterr().out.strip().endswith("(1 drawn)")
    assert {n: (class_dir / n).stat().st_mtime_ns for n in stamps} == stamps
    assert sorted(os.listdir(class_dir)) == ["class_0000.png", "class_0001.png", "class_0002.png"]


def test_bad_flags_exit_with_the_flags_name(pipe_dir, tmp_path, capsys):
    instance_dir, empty = subject(tmp_path / "instance"), tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as e:  # argparse's own exit for a missing required flag
        main([f for f in flags(pipe_dir, instance_dir, tmp_path / "o")
              if f not in ("--instance-dir", str(instance_dir))])
    assert e.value.code == 2 and "--instance-dir" in capsys.readouterr().err
    from PIL import Image
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    Image.new("RGB", (24, 24), "white").save(mixed / "0.png")
    cases = [([], tmp_path / "nowhere", f"--instance-dir: {str(tmp_path / 'nowhere')!r} is not a directory"),
             ([], empty, f"--instance-dir: {str(empty)!r} holds no images"),
             (["--prior-loss-weight", "-1"], instance_dir, "--prior-loss-weight -1.0: must be at least 0"),
             (["--num-class-images", "0"], instance_dir, "--num-class-images and --sample-steps must be at least 1"),
             (["--class-dir", str(mixed), "--num-class-images", "1"], instance_dir,
              f"--class-dir {str(mixed)!r}: its images are 24x24 pixels, the instance images 16x16; give --resolution"),
             (["--resolution", "18"], instance_dir,
              "its images are 18x18 pixels; 18x18 pixels do not map to whole latents: use multiples of 4.")]
    for extra, directory, says in cases:
        assert main(flags(pipe_dir, directory, tmp_path / "o", *extra)) == 2
        assert says in capsys.readouterr().err, says
