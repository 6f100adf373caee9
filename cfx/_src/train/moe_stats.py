"""What a mixture-of-experts model's routers did, for a run's summary and logs: over the held-out
batches and every layer, each expert's share of the routed rows, the busiest expert's load against an
even split (1.0: balanced; ``E``: every row to one expert), and the share of rows dropped over
capacity (``capacity_factor``; 0 without one). Computed once, at the end, on the whole params."""
from __future__ import annotations

from typing import Any, Iterable

import torch


def router_summary(model: Any, params: Any, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> dict | None:
    """``{"expert_share": [...], "max_load": x, "dropped": fraction}``, or None for a model without
    routers (one with no ``router_stats``)."""
    if not callable(getattr(model, "router_stats", None)):
        return None
    counts = dropped = None
    with torch.no_grad():
        for tokens, _ in batches:
            for s in model.router_stats(params, tokens)[1]:  # one RouterStats per layer
                c = s.counts.reshape(-1, s.counts.shape[-1]).sum(0).double()  # per group: summed
                d = s.dropped.sum().double()
                counts, dropped = (c, d) if counts is None else (counts + c, dropped + d)
    if counts is None:
        return None
    share = counts / counts.sum()
    return {"expert_share": [float(x) for x in share], "max_load": float(share.max() * share.numel()),
            "dropped": float(dropped / counts.sum())}
