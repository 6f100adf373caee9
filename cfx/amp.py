"""Mixed-precision policies: ``cfx.amp.Policy``, ``cfx.amp.policy("bf16")``; float8 training matmuls:
``cfx.amp.float8(model, "rowwise")`` (``policy("fp8:rowwise")`` computes the rest in bf16)."""
from cfx._src.nn.fp8_layers import Float8Layer, float8
from cfx._src.precision.amp import Policy, dtype_of, policy

__all__ = ["Float8Layer", "Policy", "dtype_of", "float8", "policy"]
