"""Mixed-precision policies: ``cfx.amp.Policy``, ``cfx.amp.policy("bf16")``."""
from cfx._src.precision.amp import Policy, dtype_of, policy

__all__ = ["Policy", "dtype_of", "policy"]
