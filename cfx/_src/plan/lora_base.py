"""A ``LoraModel``'s frozen base kept as a Plan keeps its state (``place_base``): what ``Program``
does to a ``LoraModel`` before it lays the model out, and what ``cfx.lora.place_base`` offers."""
from __future__ import annotations

from typing import Any

from cfx._src.lora.model import LoraModel
from cfx._src.plan.layout import stored_order


def place_base(model: Any, plan: Any, mesh: Any, *, nvme_dir: str | None = None) -> Any:
    """A ``LoraModel`` with its frozen base kept as ``plan`` keeps its state on ``mesh``
    (``LoraModel.shard_base``): under ZeRO-3 sharded over ``data``, under a pipe axis held only by the
    stage that runs each block (the Plan's stored order: ``stored_order``), and with ``offload`` in
    host memory (``host``, and ``auto``, whose chunks' home is the host too) or in files under
    ``nvme_dir`` (``nvme``); each block's is brought to the device just before it runs. Any other
    model, a plan that keeps its state whole on every rank, or a base placed already comes back as it
    is. ``plan.step`` places a ``LoraModel``'s base this way itself."""
    zero3 = plan.zero == 3 and plan.has("data")
    if not isinstance(model, LoraModel) or not (zero3 or plan.has("pipe")) or model.base_placed:
        return model
    stages = None
    if plan.has("pipe"):
        p = plan.size("pipe")
        order = stored_order(len(model.blocks), p, plan.chunks, type(model.model).__name__)
        rows = len(order) // p
        stages = [order[c * rows:(c + 1) * rows] for c in range(p)]
    if plan.offload == "nvme" and nvme_dir is None:
        raise ValueError(f"Plan {str(plan)!r}: offload=nvme keeps the frozen base in files; pass the directory "
                         "(nvme_dir=) the plan's program writes its own into.")
    return model.shard_base(mesh, axis="data" if zero3 else None, host=plan.offload in ("host", "auto"),
                            nvme_dir=nvme_dir if plan.offload == "nvme" else None, stages=stages)
