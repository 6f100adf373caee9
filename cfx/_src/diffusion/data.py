"""Images with captions from a directory, as the training CLIs read them.

Two layouts, as Hugging Face's ``imagefolder`` and diffusers' example scripts use them::

    data/                          data/
      metadata.jsonl                 a.png   a.txt     (the caption beside the image)
      a.png                          b.jpg   b.txt
      b.jpg
    {"file_name": "a.png", "text": "a red square"} per line

``load_images(directory, resolution=None)`` returns the images as ``(N, 3, H, W)`` fp32 in
``[-1, 1]`` (what the VAE encodes), their captions (None where a directory holds no captions and
none are required, as DreamBooth's instance images) and the file names. Without ``resolution``
every image must have the same size; with it, each is resized (shorter side) and center-cropped to
``resolution`` x ``resolution``, as diffusers' ``train_text_to_image.py`` does. ``write_png`` writes
an image the other way.
"""
from __future__ import annotations

import json
import os

import torch

EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def load_images(directory: str, *, resolution: int | None = None, captions: bool = True
                ) -> tuple[torch.Tensor, list[str] | None, list[str]]:
    """``(images, captions, files)`` from ``directory`` (module doc); ValueErrors name the file
    and the fix."""
    try:
        from PIL import Image
    except ImportError:
        raise ValueError("reading images needs Pillow: pip install pillow.") from None
    if not os.path.isdir(directory):
        raise ValueError(f"{directory!r} is not a directory of images.")
    files = sorted(n for n in os.listdir(directory) if n.lower().endswith(EXTENSIONS))
    if not files:
        raise ValueError(f"{directory!r} holds no images ({', '.join(EXTENSIONS)}).")
    texts = _captions(directory, files) if captions else None
    pixels, sizes = [], {}
    for name in files:
        with Image.open(os.path.join(directory, name)) as im:
            im = im.convert("RGB")
            if resolution is not None:
                im = _resize_crop(im, resolution)
            sizes.setdefault(im.size, name)
            if len(sizes) > 1:
                (s0, f0), (s1, f1) = list(sizes.items())[:2]
                raise ValueError(f"{directory!r} mixes image sizes: {f0!r} is {s0[0]}x{s0[1]} and {f1!r} is "
                                 f"{s1[0]}x{s1[1]}; give --resolution N to resize and center-crop every image to "
                                 "N x N, or resize them to one size first.")
            data = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
            pixels.append(data.view(im.size[1], im.size[0], 3).permute(2, 0, 1))
    images = torch.stack(pixels).float() / 127.5 - 1.0  # (N, 3, H, W) in [-1, 1]
    return images, texts, files


def _captions(directory: str, files: list[str]) -> list[str]:
    meta = os.path.join(directory, "metadata.jsonl")
    if os.path.exists(meta):
        found = {}
        with open(meta) as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    found[row["file_name"]] = str(row["text"])
                except (ValueError, KeyError, TypeError):
                    raise ValueError(f"{meta}:{i}: expected a JSON object with \"file_name\" and \"text\", got "
                                     f"{line.strip()[:80]!r}.") from None
        missing = [n for n in files if n not in found]
        if missing:
            raise ValueError(f"{meta} has no caption for {missing[0]!r}"
                             f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; add a line "
                             f"{{\"file_name\": \"{missing[0]}\", \"text\": \"...\"}}.")
        return [found[n] for n in files]
    out = []
    for name in files:
        path = os.path.join(directory, os.path.splitext(name)[0] + ".txt")
        if not os.path.exists(path):
            raise ValueError(f"{os.path.join(directory, name)!r} has no caption: write it to {path!r}, or list every "
                             "image in a metadata.jsonl ({\"file_name\": ..., \"text\": ...} per line).")
        with open(path) as f:
            out.append(f.read().strip())
    return out


def _resize_crop(im, size: int):
    """The shorter side resized to ``size`` (bilinear), then the center ``size`` x ``size``."""
    from PIL import Image
    w, h = im.size
    scale = size / min(w, h)
    im = im.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.BILINEAR)
    w, h = im.size
    left, top = (w - size) // 2, (h - size) // 2
    return im.crop((left, top, left + size, top + size))


def write_png(image: torch.Tensor, path: str) -> None:
    """``image`` ``(3, H, W)`` in ``[0, 1]`` as an 8-bit RGB PNG (Pillow)."""
    try:
        from PIL import Image
    except ImportError:
        raise ValueError("writing the PNG needs Pillow: pip install pillow.") from None
    pixels = (image.detach().cpu().permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    Image.fromarray(pixels).save(path)
