"""Weight-only quantisation: ``cfx.quant.quantize(params, "int8")`` swaps Linear and convolution
weights for int8 + per-output-channel scales (``kinds=("linear",)`` keeps convolutions as they
are); ``cfx.nn.Linear.apply`` then runs the int8 matmul kernel and ``cfx.nn.Conv2d.apply``
dequantises one layer's weight at a time::

    qparams = cfx.quant.quantize(params, "int8")
    logits = model.apply(qparams, tokens)
"""
from cfx._src.precision.quant import QuantizedWeight, dequantize, is_quantized, quantize
from cfx_kernels.int8_matmul import int8_matmul, quantize_weight

__all__ = ["QuantizedWeight", "dequantize", "int8_matmul", "is_quantized", "quantize",
           "quantize_weight"]
