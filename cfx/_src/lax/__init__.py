"""``cfx.lax``: collectives over named mesh axes with JAX's transposes, their varying-axes typing (``vma``) and their counters (``stats``)."""
