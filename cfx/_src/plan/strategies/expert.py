"""Expert parallelism over ``expert``: a mixture of experts' experts split over it, the batch's rows
split over it as over ``data``, each token sent to its experts' ranks and back; the routers'
statistics summed over every axis the batch is split over (with or without an expert axis), and
each rank's gradient averaged over ``expert`` (``expert_grads``)."""
from __future__ import annotations

from typing import Any

from cfx._src.models.parts import parts_of
from cfx._src.parallel.expert import EXPERT_RULES, check_capacity_groups, expert_grads, expert_parallel, has_experts
from cfx._src.plan.strategy import Built, Strategy, on_pieces


class Expert(Strategy):
    name, axes = "expert", ("expert",)

    def check(self, plan, model, where: str) -> None:
        moe = has_experts(model)
        if plan.has("expert"):
            n = plan.size("expert")
            if not moe:
                raise ValueError(f"{where}: the expert axis splits a mixture of experts' experts; {type(model).__name__} "
                                 "has none (TransformerBlock(moe=...), as cfx.models.mixtral). Drop expert= (or use "
                                 "data=).")
            for i, b in enumerate(model.blocks):
                if b.moe is not None and b.moe.n_experts % n:
                    raise ValueError(f"{where}: block {i}'s {b.moe.n_experts} experts do not split over expert={n}; "
                                     f"use an expert axis size dividing {b.moe.n_experts}.")
        if not moe:
            return
        if plan.has("seq") or plan.sp == "megatron" or plan.remat == "auto":
            raise ValueError(f"{where}: sequence parallelism (seq=, sp=megatron) and remat=auto do not carry the "
                             "routers' statistics yet; train a mixture of experts with data / expert / tensor "
                             "parallelism (model=, sp=none), ZeRO and remat=blocks or dots.")
        try:
            if plan.batch_axes:  # its routers' statistics must sum over the batch's axes
                expert_parallel(model, None, stats_axes=plan.batch_axes)
            if plan.has("pipe"):  # the stages' parts, if they carry what its loss needs (Mixtral's aux losses)
                parts_of(model, f"{where} (pipe axis)")
                if plan.microbatches > 1:  # each microbatch routed on its own: capacity needs explicit groups
                    check_capacity_groups(model, f"microbatches={plan.microbatches}")
        except ValueError as e:
            raise ValueError(e.args[0] if str(e).startswith(where) else f"{where}: {e}") from None

    def rules(self, plan) -> dict[str, Any]:
        return dict(EXPERT_RULES) if plan.has("expert") else {}

    def parallelize(self, plan, model) -> Any:
        if not (has_experts(model) and plan.batch_axes):
            return model
        return expert_parallel(model, "expert" if plan.has("expert") else None, stats_axes=plan.batch_axes)

    def sampling_form(self, plan, model) -> Any:
        return expert_parallel(model, "expert", stats_axes=()) if plan.has("expert") else model

    def reduce(self, plan, grads: Any, built: Built) -> Any:
        """Each expert rank's gradient covers its own rows: averaged over ``expert`` for every leaf it
        replicates; the experts' own, which the exchange's transpose summed over every rank's rows,
        divided by its size (``expert_grads``)."""
        if not plan.has("expert"):
            return grads
        return on_pieces(grads, lambda g: expert_grads(g, built.layout.local_specs, "expert"))
