"""``python -m cfx.diffusion.train``: the UNet it writes is the one a single-device loop over the
same draws trains (under ``data=2 zero=3 remat=blocks``), a resumed run continues where the saved
state stopped, the written pipeline loads back, and bad data or flags exit with the reason."""
from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL")

import cfx  # noqa: E402
from cfx._src.diffusion.finetune import batch_at, encode, rows_of  # noqa: E402
from cfx._src.diffusion.train import Denoiser  # noqa: E402
from cfx.diffusion.train import main  # noqa: E402
from cfx_tests.test_diffusion_pipeline import components  # noqa: E402
from cfx_tests.test_diffusion_sampling import tiny_tokenizer  # noqa: E402

CAPTIONS = ["a red square", "a blue circle", "a green bar", "a red dot"]


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory):
    unet, vae, text, sched = components()
    d = tmp_path_factory.mktemp("pipe")
    for name, part in (("unet", unet), ("vae", vae), ("text_encoder", text), ("scheduler", sched)):
        part.save_pretrained(d / name)
    tiny_tokenizer(d / "tokenizer")
    return d


def write_images(directory, sizes=((16, 16),) * 4, *, captions=True):
    from PIL import Image
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for i, (w, h) in enumerate(sizes):
        pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(directory / f"{i}.png")
        if captions:
            (directory / f"{i}.txt").write_text(CAPTIONS[i % len(CAPTIONS)])
    return directory


def reference(pipe_dir, data_dir, steps, *, batch=2, lr=1e-3, seed=0):
    """The CLI's run written out on one device: the same encodings, rows and draws, cfx.optim.adamw."""
    from cfx._src.diffusion.data import load_images
    from cfx._src.diffusion.pipeline import tokenizer
    pipe = cfx.diffusion.load_pipeline(pipe_dir)
    images, texts, _ = load_images(str(data_dir))
    data = encode(pipe, images, tokenizer(str(pipe_dir), 77)(texts))
    k_rows, k_steps = cfx.random.split(cfx.random.key(seed), 2)
    model, tx = Denoiser(pipe.unet, pipe.schedule), cfx.optim.adamw(lr, weight_decay=1e-2)
    params, state = pipe.unet_params, tx.init(pipe.unet_params)
    for step in range(steps):
        b = batch_at(pipe, data, rows_of(len(data), batch, step, k_rows), cfx.random.fold_in(k_steps, step))
        _, grads = cfx.value_and_grad(lambda p: model.loss(p, *b))(params)
        updates, state = tx.update(grads, state, params)
        params = cfx.optim.apply_updates(params, updates)
    return params


def assert_adamw_close(got, want, *, lr=1e-3, steps=3):
    """AdamW in fp32 on two paths: each leaf equal at the assert_close defaults but for at most
    0.5% of its elements, which differ by at most 2 lr per step (Adam turns rounding in a
    near-zero gradient into a step of the gradient's sign); a wrong row, draw or update moves
    most elements."""
    for (path, x), y in zip(cfx.tree.flatten_with_path(got)[0], cfx.tree.leaves(want)):
        off = ~torch.isclose(x, y, rtol=1.3e-6, atol=1e-5)
        assert off.float().mean() <= 0.005, f"{path}: {int(off.sum())} of {off.numel()} elements differ"
        assert float((x - y).abs().max()) <= 2 * lr * steps, path


def test_rows_are_epochs_of_permutations():
    key = cfx.random.key(0)
    rows = torch.cat([rows_of(5, 2, s, key) for s in range(5)])  # 10 rows: two epochs of 5
    assert sorted(rows[:5].tolist()) == list(range(5)) and sorted(rows[5:].tolist()) == list(range(5))
    assert torch.equal(rows_of(5, 2, 3, key), rows[6:8])


@pytest.mark.timeout(300)
def test_the_cli_trains_what_one_device_trains_and_resumes(pipe_dir, tmp_path):
    data = write_images(tmp_path / "data")
    flags = ["--pipeline", str(pipe_dir), "--data", str(data), "--batch-size", "2", "--lr", "1e-3", "--no-progress",
             "--mesh", "data=2", "--zero", "3", "--remat", "blocks"]
    out = tmp_path / "out"
    assert main([*flags, "--out", str(out), "--steps", "3", "--save-every", "2"]) == 0
    want = reference(pipe_dir, data, 3)
    got = cfx.diffusion.load_pipeline(out)
    assert_adamw_close(got.unet_params, want)
    assert (out / "tokenizer" / "vocab.json").exists()
    # the state saved at step 2 resumes to the same step 3, and on to step 4
    assert main([*flags, "--out", str(out), "--steps", "4", "--resume", "--mesh", "data=1", "--zero", "0"]) == 0
    assert_adamw_close(cfx.diffusion.load_pipeline(out).unet_params, reference(pipe_dir, data, 4), steps=4)


def test_bad_data_and_flags_exit_with_the_reason(pipe_dir, tmp_path, capsys):
    mixed = write_images(tmp_path / "mixed", sizes=((16, 16), (24, 16)))
    uncaptioned = write_images(tmp_path / "bare", captions=False)
    base = ["--pipeline", str(pipe_dir), "--out", str(tmp_path / "o"), "--no-progress"]
    cases = [(["--data", str(mixed)], "mixes image sizes: '0.png' is 16x16 and '1.png' is 24x16; give --resolution"),
             (["--data", str(uncaptioned)], "has no caption"),
             (["--data", str(mixed), "--mesh", "data=2,seq=2"], "data ranks and tensor-parallel model ranks"),
             (["--data", str(mixed), "--offload", "host"], "add --zero 3"),
             (["--data", str(tmp_path / "bare"), "--batch-size", "3", "--mesh", "data=2"], "has no caption"),
             (["--data", str(mixed), "--resolution", "16", "--resume"], "holds no train state")]
    for flags, says in cases:
        assert main([*base, *flags]) == 2
        assert says in capsys.readouterr().err
    # --resolution makes mixed sizes one size (resized and center-cropped)
    from cfx._src.diffusion.data import load_images
    images, texts, files = load_images(str(mixed), resolution=16)
    assert images.shape == (2, 3, 16, 16) and texts == CAPTIONS[:2] and files == ["0.png", "1.png"]
    assert -1 <= float(images.min()) and float(images.max()) <= 1
