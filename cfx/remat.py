"""``cfx.remat``: activation checkpointing. The module is callable as the transform:
``cfx.remat(f, policy=...)`` decides per saved tensor (``cfx.checkpoint_policies``);
``cfx.remat.solve`` and ``cfx.remat.chen`` schedule a whole chain of blocks for a memory budget
(Rotor's dynamic program; Chen et al.'s sqrt(n) segments), returning the model under it
(``Chained``) and a ``RematSolution``; ``minimum_budget`` is the least a chain can run in.
"""
from cfx._src.core.modules import callable_module
from cfx._src.remat.chain import Chain
from cfx._src.remat.chained import Chained
from cfx._src.remat.engine import remat
from cfx._src.remat.plan import RematSolution, chen, minimum_budget, solve

RematPlan = RematSolution  # its name until 0.2 (one class per name: cfx.parallel.Plan is the strategy)

__all__ = ["Chain", "Chained", "RematPlan", "RematSolution", "chen", "minimum_budget", "remat", "solve"]

callable_module(__name__, remat)
