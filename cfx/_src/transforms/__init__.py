"""Function transforms: autodiff over pytrees (``grad``, ``value_and_grad``, ``vmap``, ``jvp``), ``eval_shape``, and ``jit`` (torch.compile with donation)."""
