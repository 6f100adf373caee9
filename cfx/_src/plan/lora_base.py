"""A model's frozen weights kept as a Plan keeps its state, before the Plan runs: ``place_base``, what
``cfx.lora.place_base`` offers and what ``Program`` does itself (``build.prepare``)."""
from __future__ import annotations

from typing import Any

from cfx._src.plan import build
from cfx._src.plan.frozen import place


def place_base(model: Any, plan: Any, mesh: Any, *, nvme_dir: str | None = None) -> Any:
    """``model`` (a ``LoraModel``, or any model with frozen weights: ``models.frozen``) over its frozen
    weights kept as ``plan`` keeps its state on ``mesh``: under ZeRO-3 sharded over ``data``, under a
    pipe axis held only by the stage that runs each block (the Plan's stored order), and with
    ``offload`` in host memory (``host``, and ``auto``, whose chunks' home is the host too) or in files
    under ``nvme_dir`` (``nvme``); each block's is brought to the device just before it runs. Any other
    model, a plan that keeps its state whole on every rank, or weights placed already come back as they
    are. ``plan.step`` places them this way itself."""
    return place(model, build.frozen_placer(plan, model, mesh, nvme_dir))
