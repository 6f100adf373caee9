"""The Vision Transformer (Dosovitskiy et al., 2021) as a pure function over a params pytree: images
cut into patches by a strided convolution, a learned [CLS] token and learned positions, pre-norm
bidirectional blocks, a final LayerNorm and a linear classifier on the [CLS] token.

Params: ``{"patch": {"w" (C, channels, p, p), "b"}, "cls" (C,), "wpe": {"w" (1 + N, C)}, "blocks":
[...], "ln_f", "classifier"}`` with ``N = (image_size / patch_size) ** 2`` patches. Weights convert
to and from Hugging Face ``ViTForImageClassification`` with ``cfx.models.to_hf`` / ``from_hf``.
A batch is ``(images (B, channels, H, W) float, labels (B,) int)``: its rows split over ``data``
(``batch_axes``), and the blocks are ``TransformerBlock`` s, so a ``cfx.parallel.Plan`` runs it over
data, ZeRO, Megatron's model axis and pipe stages (the parts protocol) as it runs the language models.

Sequence parallelism (its ``"sequence"`` sublayer swapped for a split: ``sequence_parallel`` 's ring or Ulysses over a ``seq`` axis, or
Megatron-SP's ``tensor_parallel(model, "model", sequence=True)``): the images stay whole on every
rank (replicated over the sequence axis), each rank embeds them all (one strided convolution) and
keeps its share of the ``1 + N`` tokens in the split's order (the ring's zigzag). ``1 + N`` seldom
splits (197 for ViT-B/16), so ``SequenceSplit.share`` pads it to a multiple of the split (``2n`` for
the zigzag) with zero tokens that every attention masks out as keys; the head reads the [CLS] token,
which position 0 puts on the axis's rank 0, and the loss counts it once (``SequenceSplit.from_first``).
Pipeline stages do not carry that mask: pipe with a split sequence is refused.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cfx._src.models.common import DecoderLM, check_params, config_from_preset, dropout_keys, init_blocks
from cfx._src.nn.loss import cross_entropy
from cfx._src.models.parts import ModelParts
from cfx._src.nn.block import TransformerBlock
from cfx._src.nn.conv import Conv2d
from cfx._src.nn.dropout import dropout
from cfx._src.nn.embedding import Embedding
from cfx._src.nn.linear import Linear, init_normal, split_keys
from cfx._src.nn.norm import LayerNorm
from cfx._src.nn.sequence import WholeSequence
from cfx._src.transforms.shapes import is_abstract

VIT_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(image_size=32, patch_size=4, n_layer=2, n_head=4, hidden_size=128, intermediate_size=512,
                 num_labels=10),
    "base": dict(image_size=224, patch_size=16, n_layer=12, n_head=12, hidden_size=768, intermediate_size=3072,
                 num_labels=1000),  # ViT-B/16: 86M
}


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """ViT hyperparameters (defaults: ViT-B/16 on ImageNet-1k's 1000 classes). Images are square,
    ``image_size`` a multiple of ``patch_size``. ``dropout`` is HF's ``hidden_dropout_prob`` (the
    embeddings and both residual branches); attention probabilities are not dropped."""

    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    hidden_size: int = 768
    n_layer: int = 12
    n_head: int = 12
    intermediate_size: int = 3072
    num_labels: int = 1000
    dropout: float = 0.0
    layer_norm_eps: float = 1e-12
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("image_size", "patch_size", "num_channels", "hidden_size", "n_layer", "n_head",
                     "intermediate_size", "num_labels"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ViTConfig: {name} must be a positive int, got {v!r}.")
        if self.image_size % self.patch_size:
            raise ValueError(f"ViTConfig: image_size={self.image_size} must be a multiple of "
                             f"patch_size={self.patch_size} (the patches tile the image).")
        if self.hidden_size % self.n_head:
            raise ValueError(f"ViTConfig: hidden_size={self.hidden_size} must be divisible by "
                             f"n_head={self.n_head}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ViTConfig: dropout must be in [0, 1), got {self.dropout!r}.")
        if self.num_labels < 2:
            raise ValueError(f"ViTConfig: num_labels must be >= 2 (cross-entropy over classes), got "
                             f"{self.num_labels}; regression heads are not implemented.")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "ViTConfig":
        """A named size (``tiny``, ``base``) with field overrides."""
        return config_from_preset(cls, VIT_PRESETS, name, overrides)


@dataclasses.dataclass(frozen=True)
class ViT(DecoderLM):
    """The ViT encoder and its classifier. ``blocks`` defaults to ``n_layer`` pre-norm,
    bidirectional ``TransformerBlock`` s (exact-erf GELU, biases everywhere)."""

    config: ViTConfig
    blocks: tuple = None
    layers: tuple = ()       # (name, layer) pairs replacing sublayers (``DecoderLM.with_layers``)
    batch_axes = ("batch",)  # images (B, channels, H, W) and labels (B,): rows split over data, nothing else

    def __post_init__(self):
        c = self.config
        self._init_blocks(lambda: TransformerBlock(
            c.hidden_size, c.n_head, c.intermediate_size, activation="gelu", norm="layernorm",
            norm_eps=c.layer_norm_eps, bias=True, dropout=c.dropout, init_std=c.init_std, causal=False), c.n_layer)

    def _build_layers(self) -> dict:
        c = self.config
        C, std = c.hidden_size, c.init_std
        return {
            "patch": Conv2d(c.num_channels, C, kernel_size=c.patch_size, stride=c.patch_size,
                            axes_names=("embed", "channels"), init_std=std),
            "wpe": Embedding(1 + c.n_patches, C, axes_names=("positions", "embed"), init_std=std),
            "ln_f": LayerNorm(C, eps=c.layer_norm_eps),
            "classifier": Linear(C, c.num_labels, axes_names=("embed", "labels"), init_std=std),
            "sequence": WholeSequence(),
        }

    def init(self, key: torch.Tensor) -> dict:
        layers, c = self._layers(), self.config
        k_patch, k_cls, k_wpe, k_blocks, k_head = split_keys(key, 5)
        return {"patch": layers["patch"].init(k_patch), "cls": init_normal(k_cls, (c.hidden_size,), c.init_std),
                "wpe": layers["wpe"].init(k_wpe),
                "blocks": init_blocks(self.blocks, k_blocks),
                "ln_f": layers["ln_f"].init(None), "classifier": layers["classifier"].init(k_head)}

    # -- forward -----------------------------------------------------------------------------
    def encode(self, params: dict, images: torch.Tensor, *, key: torch.Tensor | None = None) -> torch.Tensor:
        """The final LayerNorm's output ``(B, 1 + N, C)``: the [CLS] token, then the patches row by row
        (with the sequence split over an axis: this rank's share of the padded sequence, the module doc)."""
        c = self.config
        self.check_images(f"{type(self).__name__}.apply", images)
        check_params(f"{type(self).__name__}.apply", self, params)
        keys = dropout_keys(key, c.dropout, 1 + len(self.blocks))
        x = dropout(self._embed(params, images), c.dropout, keys[0])  # (B, 1 + N, C): every rank the same
        x, mask = self._layers()["sequence"].share(x)  # this rank's (B, T/n, C), padding masked (a split sequence)
        x = self.run_blocks(params["blocks"], x, mask=mask, keys=keys[1:])
        return self._layers()["ln_f"].apply(params["ln_f"], x)

    def apply(self, params: dict, images: torch.Tensor, *, key: torch.Tensor | None = None) -> torch.Tensor:
        """Class logits ``(B, num_labels)`` for images ``(B, num_channels, image_size, image_size)``
        (cast to the params' dtype); ``key=None`` means no dropout."""
        logits = self._classify(params, self.encode(params, images, key=key))
        return self._layers()["sequence"].from_first(logits)  # every rank: the [CLS] token's

    def loss(self, params: dict, images: torch.Tensor, labels: torch.Tensor, *,
             key: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy (fp32) of the logits against ``labels (B,)``, one class id per image."""
        self._check_labels(f"{type(self).__name__}.loss", images, labels)
        return self._loss(self._classify(params, self.encode(params, images, key=key)), labels)

    def _embed(self, params: dict, images: torch.Tensor) -> torch.Tensor:
        table = params["wpe"]["w"]  # (1 + N, C); never quantised: its dtype is the params'
        x = self._layers()["patch"].apply(params["patch"], images.to(table.dtype))  # (B, C, H/p, W/p)
        x = x.flatten(2).transpose(1, 2)  # (B, N, C): the patches row by row
        cls = params["cls"].expand(x.shape[0], 1, -1)  # (B, 1, C)
        return torch.cat([cls, x], dim=1) + table  # (B, 1 + N, C)

    def _classify(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        return self._layers()["classifier"].apply(params["classifier"], x[:, 0])  # (B, C) -> (B, L): [CLS]

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = cross_entropy(logits[:, None, :], labels[:, None])  # (B, 1, L) against (B, 1)
        # sequence split: rank 0 holds the [CLS] token; its loss counts once (the others add 0),
        # so each rank's gradient is its share (summed over the axis, as every split model's)
        return self._layers()["sequence"].from_first(loss)

    # -- checks --------------------------------------------------------------------------------
    def check_images(self, where: str, images: Any) -> None:
        c = self.config
        want = (c.num_channels, c.image_size, c.image_size)
        if not isinstance(images, torch.Tensor) or not images.is_floating_point() or images.dim() != 4:
            got = (f"a {images.dim()}-D {images.dtype} tensor" if isinstance(images, torch.Tensor)
                   else type(images).__name__)
            raise ValueError(f"{where}: images must be a floating (B, {', '.join(map(str, want))}) tensor, got {got}.")
        if tuple(images.shape[1:]) != want or images.shape[0] == 0:
            raise ValueError(f"{where}: images must be (B, {', '.join(map(str, want))}) with B >= 1 (num_channels, "
                             f"image_size, image_size), got {tuple(images.shape)}; resize them, or build the model "
                             "with their size.")

    def _check_labels(self, where: str, images: torch.Tensor, labels: Any) -> None:
        B, n = images.shape[0] if isinstance(images, torch.Tensor) else None, self.config.num_labels
        if (not isinstance(labels, torch.Tensor) or labels.dtype == torch.bool or labels.is_floating_point()
                or labels.is_complex() or tuple(labels.shape) != (B,)):
            got = f"shape {tuple(labels.shape)} {labels.dtype}" if isinstance(labels, torch.Tensor) else \
                type(labels).__name__
            raise ValueError(f"{where}: labels must be integer class ids (B,) = ({B},), one per image, got {got}.")
        if not is_abstract(labels) and (int(labels.min()) < 0 or int(labels.max()) >= n):
            raise ValueError(f"{where}: class ids must lie in [0, num_labels={n}), got "
                             f"[{int(labels.min())}, {int(labels.max())}].")

    def check_batch(self, where: str, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.check_images(where, images)
        self._check_labels(where, images, labels)

    def check_train_batch(self, batch: Any, where: str) -> None:
        """ValueError unless ``batch`` is ``(images, labels)`` for this model (a Plan's step)."""
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError(f"{where}: a ViT's batch is (images, labels): images (B, channels, H, W) and "
                             f"labels (B,), got {type(batch).__name__}"
                             f"{f' of {len(batch)}' if isinstance(batch, (tuple, list)) else ''}.")
        self.check_batch(where, *batch)

    # -- protocols -----------------------------------------------------------------------------
    def parts(self) -> ModelParts:
        """Patch embedding + [CLS] + positions | blocks | final norm + classifier + loss (dropout off)."""
        c = self.config
        seq = self._layers()["sequence"]
        if seq.axis is not None:
            raise ValueError(f"ViT.parts(): pipeline stages of a ViT whose sequence is split over {seq.axis!r} "
                             "(their padded [CLS] + patches need a key mask the stages do not carry); drop pipe= "
                             "or the sequence split (seq=, sp=megatron).")

        def head_loss(params: dict, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            x = self._layers()["ln_f"].apply(params["ln_f"], x)  # (b, 1 + N, C)
            return self._loss(self._classify(params, x), labels)

        return ModelParts(("patch", "cls", "wpe"), ("ln_f", "classifier"), self._embed, head_loss,
                          lambda x, y: self.check_batch("ViT stage", x, y), c.hidden_size,
                          act_shape=lambda shape: (shape[0], 1 + c.n_patches, c.hidden_size))

    def hf_config(self) -> Any:
        """The ``transformers.ViTConfig`` of this architecture (attention dropout off, as in cfx)."""
        import transformers

        c = self.config
        return transformers.ViTConfig(
            image_size=c.image_size, patch_size=c.patch_size, num_channels=c.num_channels,
            hidden_size=c.hidden_size, num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
            intermediate_size=c.intermediate_size, hidden_act="gelu", hidden_dropout_prob=c.dropout,
            attention_probs_dropout_prob=0.0, initializer_range=c.init_std, layer_norm_eps=c.layer_norm_eps,
            qkv_bias=True, num_labels=c.num_labels)

    def axes(self) -> dict:
        layers = self._layers()
        return {"patch": layers["patch"].axes(), "cls": ("embed",), "wpe": layers["wpe"].axes(),
                "blocks": [b.axes() for b in self.blocks], "ln_f": layers["ln_f"].axes(),
                "classifier": layers["classifier"].axes()}


def vit(preset: str = "tiny", **overrides: Any) -> ViT:
    """``ViT(ViTConfig.preset(preset, **overrides))``."""
    return ViT(ViTConfig.preset(preset, **overrides))
