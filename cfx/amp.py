"""Mixed-precision policies: ``cfx.amp.Policy``, ``cfx.amp.policy("bf16")``; float8 training matmuls:
``cfx.amp.float8(model, "rowwise")`` (``policy("fp8:rowwise")`` computes the rest in bf16), with Transformer
Engine's delayed scaling (``DelayedScaling``, its ``Fp8Meta`` kept in the optimizer's state by
``fp8_meta_state``, each step run in ``fp8_step``)."""
from cfx._src.nn.fp8_delayed import DelayedScaling, Fp8Meta, step_scope as fp8_step
from cfx._src.nn.fp8_layers import Float8Layer, float8, slots_of as fp8_slots
from cfx._src.optim.fp8_meta import find_meta as fp8_meta, meta_state as fp8_meta_state, replace_meta as replace_fp8_meta
from cfx._src.precision.amp import Policy, dtype_of, policy

__all__ = ["DelayedScaling", "Float8Layer", "Fp8Meta", "Policy", "dtype_of", "float8", "fp8_meta", "fp8_meta_state",
           "fp8_slots", "fp8_step", "policy", "replace_fp8_meta"]
