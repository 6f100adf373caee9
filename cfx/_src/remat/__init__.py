"""Activation checkpointing: ``cfx.remat`` is the transform, with the budgeted solver attached.

``cfx.remat(f, policy=...)`` (``engine.py``) decides per saved tensor; ``cfx.remat.solve`` and
``cfx.remat.chen`` (``plan.py``) schedule a whole chain of blocks for a memory budget.
"""
from cfx._src.remat import plan as _plan
from cfx._src.remat.chain import Chain
from cfx._src.remat.engine import remat

remat.solve = _plan.solve
remat.chen = _plan.chen
remat.minimum_budget = _plan.minimum_budget
remat.RematPlan = _plan.RematPlan
remat.Chain = Chain
