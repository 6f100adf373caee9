"""``cfx.autoshard``: from a single-device train step to the fastest sharded one that fits. The
module is callable as the search::

    step_auto, report = cfx.autoshard(step, mesh, (params, x, y), memory_budget="2GiB")
    loss, grads = step_auto(params, x, y)     # grads laid out like report.specs
    print(report)

``calibrate(mesh)`` measures a ``CostModel`` on the mesh; ``NoPlanFits`` (a ValueError) is raised
when no plan meets the budget; ``Report`` and ``AutoStep`` are what the search returns.
"""
from cfx._src.autoshard.api import AutoStep, autoshard
from cfx._src.autoshard.calibrate import calibrate
from cfx._src.autoshard.cost import CostModel
from cfx._src.autoshard.ilp import NoPlanFits
from cfx._src.autoshard.report import Report
from cfx._src.core.modules import callable_module

__all__ = ["AutoStep", "CostModel", "NoPlanFits", "Report", "autoshard", "calibrate"]

callable_module(__name__, autoshard)
