"""LoRA's frozen base made from a model's params, one recipe for every model: ``frozen_base``."""
from __future__ import annotations

from typing import Any

import torch

from cfx._src.core import tree as tree_util
from cfx._src.nn.lora_weight import is_weight_node
from cfx._src.precision.quant import quantize

BASES = ("fp32", "bf16", "fp16", "int8")  # how a frozen base is stored
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.float32}


def frozen_base(params: Any, axes: Any, base: str = "fp32", *, dtype: torch.dtype | None = None,
                min_size: int = 4096) -> Any:
    """``params`` (a model's, ``axes`` its logical axes) as LoRA's frozen base, detached: with
    ``base="int8"`` every Linear and convolution weight of at least ``min_size`` elements weight-only
    int8 per output channel (``cfx.quant.quantize``; QLoRA's recipe), every other floating leaf in
    ``dtype`` (default: the base's own, ``fp32`` for int8's norms, biases and tables); with ``fp32`` /
    ``bf16`` / ``fp16`` every floating leaf in that dtype (or ``dtype``)."""
    if base not in BASES:
        raise ValueError(f"frozen_base: base must be one of {BASES}, got {base!r}.")
    dtype = DTYPES[base] if dtype is None else dtype
    params = tree_util.map(lambda x: x.detach(), params)
    if base == "int8":
        params = quantize(params, "int8", axes=axes, min_size=min_size)
    return tree_util.map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
                         params, is_leaf=is_weight_node)
