"""Triton kernels, each beside its plain-PyTorch reference (``norms`` and ``norms_reference``, ...),
imported by module; nothing here imports cfx. The package itself exports nothing."""

__all__: list[str] = []
