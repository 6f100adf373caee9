"""Tensor parallelism over ``model`` (Megatron): every block's heads and MLP split over it, the
vocabulary too; with ``sp=megatron`` (Megatron-SP) the sequence split over ``model`` between the
blocks' matmuls, the vocabulary whole, and the gradients of what that split replicates (norms,
biases, embeddings) summed over ``model``. A mixture of experts splits inside each expert
(``tensor_parallel_experts``)."""
from __future__ import annotations

from typing import Any

from cfx._src.core import tree as tree_util
from cfx._src.mesh.spec import is_spec
from cfx._src.models.function import LossModel
from cfx._src.models.parts import hook
from cfx._src.nn.block import TransformerBlock
from cfx._src.parallel.expert import has_experts, tensor_parallel_experts
from cfx._src.parallel.megatron import MEGATRON_RULES, tensor_parallel
from cfx._src.parallel.sequence import sequence_grads
from cfx._src.plan.strategy import Built, Strategy, on_pieces


def split_over_model(model: Any, *, sequence: bool = False, vocab: bool | None = None) -> Any:
    """``model`` Megatron-split over ``model``: ``tensor_parallel``, or for a mixture of experts
    ``tensor_parallel_experts`` (each expert's hidden units split; no Megatron-SP, checked by the plan)."""
    if has_experts(model):
        return tensor_parallel_experts(model, "model")
    return tensor_parallel(model, "model", sequence=sequence, vocab=vocab)


class Megatron(Strategy):
    name, axes = "model", ("model",)

    def check_plan(self, plan) -> None:
        if plan.sp == "megatron" and not plan.has("model"):
            raise ValueError(f"Plan: sp=megatron splits the sequence over the model axis (with tensor "
                             f"parallelism), and the mesh {dict(plan.mesh)} has none; add model=N to the mesh.")

    def check(self, plan, model, where: str) -> None:
        own_batch = hook(model, "check_train_batch") is not None
        if own_batch and plan.sp == "megatron":
            raise ValueError(f"{where}: sp=megatron splits a token sequence; {type(model).__name__} has none. Drop sp=.")
        if not plan.has("model"):
            return
        if isinstance(model, LossModel):
            if "model" not in {a for s in tree_util.leaves(model.param_specs, is_leaf=is_spec) for a in s.all_axes()}:
                raise ValueError(f"{where}: no spec of {model.name!r} names the model axis, so every model rank would "
                                 "compute the same; pass specs= laying params over 'model' (the function then gets "
                                 "each rank's blocks and does its own collectives), or drop model=.")
            return
        blocks = getattr(model, "blocks", ())
        if own_batch and not callable(hook(model, "tensor_parallel")) and not (
                blocks and all(isinstance(b, TransformerBlock) for b in blocks)):
            raise ValueError(f"{where}: the model axis splits the heads and MLPs of TransformerBlocks (Megatron); "
                             f"{type(model).__name__} has no such blocks and no tensor_parallel(axis) of its own. Drop "
                             "model= and shard its state with data= and zero=3 (and offload=) instead.")
        n = plan.size("model")
        for block in getattr(split_over_model(model), "blocks", ()):
            block.check(n)
        vocab = getattr(hook(model, "config"), "vocab_size", None)
        if plan.sp != "megatron" and vocab is not None and vocab % n:
            raise ValueError(f"{where}: the vocabulary of {vocab} does not split over model={n} (vocab-parallel "
                             "embedding and loss); use a model axis size dividing it, or pad it: model, params = "
                             f"cfx.models.pad_vocab(model, params, multiple={64 * n}) (the padded ids masked: the same "
                             "loss and tokens; python -m cfx.train: --pad-vocab auto).")

    def rules(self, plan) -> dict[str, Any]:
        if not plan.has("model"):
            return {}
        return {k: "model" for k in MEGATRON_RULES if not (k == "vocab" and plan.sp == "megatron")}

    def parallelize(self, plan, model) -> Any:
        if not plan.has("model"):
            return model
        return split_over_model(model, sequence=plan.sp == "megatron")

    def sampling_form(self, plan, model) -> Any:
        """Megatron's split, the vocabulary split with it unless Megatron-SP keeps it whole (decoding
        splits no sequence)."""
        return split_over_model(model, vocab=plan.sp != "megatron") if plan.has("model") else model

    def reduce(self, plan, grads: Any, built: Built) -> Any:
        """Megatron-SP: each rank's gradient of a leaf ``model`` does not split covers its own positions:
        summed over ``model`` (one flat all-reduce)."""
        if plan.sp != "megatron":
            return grads
        return on_pieces(grads, lambda g: sequence_grads(g, built.layout.local_specs, "model"))
