"""Activation checkpointing: the saved-tensor-hook engine behind ``cfx.remat(f, policy=...)``
(``engine``), policies, and the budgeted chain solver (``plan``: Rotor's dynamic program in
``solver``, fake-tensor profiles in ``profile``, the schedule's executor in ``execute``)."""
