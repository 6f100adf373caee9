"""A sparse mixture-of-experts feed-forward layer: a top-k softmax router and SwiGLU experts.

Each token's router logits ``x @ router`` (``(N, E)``, softmax in fp32) choose its ``top_k``
experts; their probabilities, renormalised to sum to 1 (Mixtral; ``normalize=False`` keeps them),
weigh the experts' outputs. Dispatch is dropless and loop-free: the ``N k`` (token, expert) pairs
are sorted by expert, each expert's rows run through one grouped matmul per projection
(``F.grouped_mm``; a padded batched matmul where it does not apply, e.g. fp64), and the weighted
rows are added back to their tokens in expert order.

``model_axis`` (tensor parallelism, inside ``shard_map``): each expert's hidden units are split over
that axis (``gate`` / ``up`` by columns, ``down`` by rows, as Megatron's MLP), the rows enter
through ``pvary`` and the weighted partial outputs are summed with one ``psum``; the router stays
whole.

``capacity_factor`` instead gives every expert room for ``ceil(capacity_factor N k / E)`` rows:
an expert's rows beyond that, in token order, are dropped (their contribution is zero), the same
tokens every time, and ``RouterStats.dropped`` counts them. ``group_size=S`` makes the rule GShard's
groups: the tokens (in order: batch row by batch row) form consecutive groups of ``S``, and the
capacity, ``ceil(capacity_factor S k / E)``, is each expert's within each group. A split of the
batch's rows over ranks (data or expert parallelism, a pipeline's microbatches) whose every rank
holds whole groups then drops exactly the rows one device drops with the same ``group_size``: the
rule is the same, wherever the groups run. Without ``group_size`` the call's tokens are one group,
so a split batch would change what is dropped: an expert-parallel layer refuses it, and so do
``expert_parallel`` and a ``Plan`` that split the batch.

``apply_with_stats`` also returns the router's ``RouterStats`` (how many rows each expert got, the
sum of its probabilities, the rows, the sum of squared log-partition values) over this rank's
tokens, summed over layers -- and, where the batch is split, over ranks (``RouterStats.psum``) --
by the model; ``load_balancing_loss`` (Switch / Mixtral, as transformers computes it over all
layers) and ``z_loss`` (ST-MoE) are functions of the sum. ``apply_with_stats(...,
stats_group_size=S)`` returns them per group of ``S`` consecutive tokens instead (each field with a
leading dim of ``G = N / S`` groups, the losses then one per group): what an auxiliary loss computed
per group needs (Mixtral's ``router_aux_group_size``), wherever the groups run.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from cfx._src.lax import collectives as lax
from cfx._src.nn.linear import init_normal, split_keys
from cfx._src.nn.mlp import activation as act_fn


class RouterStats(NamedTuple):
    """What the router did, summable over layers: per expert ``counts`` (rows routed there, of
    ``N k``) and ``probs`` (the sum of its softmax probability over tokens), ``rows`` (tokens),
    ``z`` (the sum over tokens of ``logsumexp(logits)**2``) and ``dropped`` (rows over capacity).
    Per group (``apply_with_stats(..., stats_group_size=)``) each has a leading dim of groups: ``counts``
    (G, E), ``rows`` (G,)."""

    counts: torch.Tensor
    probs: torch.Tensor
    rows: torch.Tensor
    z: torch.Tensor
    dropped: torch.Tensor

    def __add__(self, other: "RouterStats") -> "RouterStats":  # summed over layers
        return RouterStats(*(a + b for a, b in zip(self, other)))

    def psum(self, axis) -> "RouterStats":
        """Summed over the ranks of mesh ``axis`` (a name or a tuple; the batch's), in one all-reduce."""
        flat = lax.psum(torch.cat([t.reshape(-1).float() for t in self]), axis)
        return RouterStats(*(f.view(t.shape) for f, t in zip(flat.split([t.numel() for t in self]), self)))


def load_balancing_loss(stats: RouterStats) -> torch.Tensor:
    """``E * sum_e f_e P_e``: ``f_e`` the rows routed to expert ``e`` per token, ``P_e`` its mean
    probability (Switch Transformer eq. 4-6; transformers' ``load_balancing_loss_func``); per group
    (G,) where the statistics are."""
    E, rows = stats.counts.shape[-1], stats.rows[..., None]
    return E * torch.sum((stats.counts / rows) * (stats.probs / rows), -1)


def z_loss(stats: RouterStats) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of ``logsumexp(logits)**2`` (per group where the
    statistics are)."""
    return stats.z / stats.rows


@dataclasses.dataclass(frozen=True)
class MoE:
    """``n_experts`` SwiGLU experts of width ``hidden`` behind a top-``top_k`` router (module doc).

    Params ``{"router": (C, E), "gate": (E, C, I), "up": (E, C, I), "down": (E, I, C)}``; the
    experts' first dim is the logical axis ``"experts"`` (what an expert-parallel mesh axis splits).
    """

    features: int
    hidden: int
    n_experts: int
    top_k: int = 2
    normalize: bool = True
    capacity_factor: float | None = None
    group_size: int | None = None   # capacity mode: tokens per group, each with its own capacity (module doc)
    init_std: float = 0.02
    expert_axis: str | None = None  # expert parallelism: the mesh axis the experts are split over
    model_axis: str | None = None   # tensor parallelism: the axis each expert's hidden units are split over

    def __post_init__(self):
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"MoE: top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}.")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"MoE: capacity_factor must be positive (or None: dropless), got "
                             f"{self.capacity_factor}.")
        if self.group_size is not None:
            if not (isinstance(self.group_size, int) and self.group_size >= 1):
                raise ValueError(f"MoE: group_size must be a positive number of tokens (or None: the call's tokens "
                                 f"are one group), got {self.group_size!r}.")
            if self.capacity_factor is None:
                raise ValueError(f"MoE(group_size={self.group_size}): groups only set where the capacity applies; "
                                 "pass capacity_factor= as well, or drop group_size (dropless routing has no groups).")

    def init(self, key: torch.Tensor) -> dict:
        C, I, E = self.features, self.hidden, self.n_experts
        k = split_keys(key, 4)
        return {"router": init_normal(k[0], (C, E), self.init_std),
                "gate": init_normal(k[1], (E, C, I), self.init_std),
                "up": init_normal(k[2], (E, C, I), self.init_std),
                "down": init_normal(k[3], (E, I, C), self.init_std)}

    def axes(self) -> dict:
        return {"router": ("embed", None), "gate": ("experts", "embed", "mlp"),
                "up": ("experts", "embed", "mlp"), "down": ("experts", "mlp", "embed")}

    def apply(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        """``(..., C) -> (..., C)``."""
        return self.apply_with_stats(params, x)[0]

    def apply_with_stats(self, params: dict, x: torch.Tensor, *, stats_group_size: int | None = None
                         ) -> tuple[torch.Tensor, RouterStats]:
        """``apply``'s output and the router's ``RouterStats``: over the call's tokens, or per group of
        ``stats_group_size`` consecutive tokens (module doc)."""
        if x.shape[-1] != self.features:
            raise ValueError(f"MoE.apply: x has {x.shape[-1]} features in its last dim, expected "
                             f"features={self.features} (x shape {tuple(x.shape)}).")
        flat = x.reshape(-1, self.features)  # (N, C)
        N, E, k = flat.shape[0], self.n_experts, self.top_k
        self._check_groups(N, tuple(x.shape), stats_group_size)
        logits = flat @ params["router"].to(flat.dtype)  # (N, E)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, k, dim=-1)  # (N, k) each
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        pair_expert = experts.reshape(-1)  # (N k,): row j is token j // k
        order = torch.argsort(pair_expert, stable=True)  # by expert, token order within one
        counts = torch.bincount(pair_expert, minlength=E)  # (E,)
        keep = self._kept(counts, order, pair_expert)
        token = order // k  # (N k,): each sorted row's token
        # tensor parallelism: Megatron's f into the split hidden units (the router keeps the input whole)
        xs = (flat if self.model_axis is None else lax.pvary(flat, self.model_axis))[token]  # (N k, C)
        if self.expert_axis is None:
            out = self._experts(params, xs, counts)  # (N k, C)
        else:
            out = self._experts_over_axis(params, xs, counts)
        w = weights.reshape(-1)[order, None]
        if self.model_axis is not None:  # replicated weights meet each rank's partial rows: their
            w = lax.pvary(w.to(torch.promote_types(w.dtype, out.dtype)), self.model_axis)  # cotangents summed wide
        out = out * w.to(out.dtype)
        if keep is not None:
            out = out * keep[:, None].to(out.dtype)
        y = torch.zeros_like(flat).index_add(0, token, out.to(flat.dtype))  # (N, C), in expert order
        if self.model_axis is not None:  # Megatron's g: the partial sums over the hidden units
            y = lax.psum(y, self.model_axis)
        stats = self._stats(logits, probs, pair_expert, counts, keep, token, stats_group_size)
        return y.view(x.shape), stats  # this rank's tokens' (a model sums them over layers and ranks)

    def _stats(self, logits: torch.Tensor, probs: torch.Tensor, pair_expert: torch.Tensor, counts: torch.Tensor,
               keep: torch.Tensor | None, token: torch.Tensor, S: int | None) -> RouterStats:
        """The call's ``RouterStats``: over its tokens, or per group of ``S`` of them (module doc).
        ``logits`` / ``probs`` (N, E); ``pair_expert`` (N k,) each pair's expert; ``counts`` (E,);
        ``keep`` / ``token`` (N k,) each sorted row's fate and token."""
        (N, E), k, dev = probs.shape, self.top_k, probs.device
        z = torch.logsumexp(logits.float(), -1).pow(2)  # (N,)
        if S is None:
            dropped = torch.zeros((), device=dev) if keep is None else (~keep).sum().float()
            return RouterStats(counts.float(), probs.sum(0), torch.tensor(float(N), device=dev), z.sum(), dropped)
        G = N // S
        group = torch.arange(N * k, device=dev) // (k * S)  # (N k,): each pair's group
        per_group = torch.bincount(group * E + pair_expert, minlength=G * E).view(G, E)
        dropped = torch.zeros(G, device=dev)
        if keep is not None:
            dropped = dropped.index_add(0, token // S, (~keep).float())
        return RouterStats(per_group.float(), probs.view(G, S, E).sum(1), torch.full((G,), float(S), device=dev),
                           z.view(G, S).sum(1), dropped)

    def _check_groups(self, N: int, shape: tuple, stats_group_size: int | None) -> None:
        """ValueError where the capacity's groups do not fit this call (module doc), on every rank alike:
        before any collective."""
        S = stats_group_size
        if S is not None and not (isinstance(S, int) and S >= 1 and N % S == 0):
            raise ValueError(f"MoE.apply_with_stats(stats_group_size={S!r}): this call's {N} tokens (x shape {shape}) "
                             f"do not form whole groups of {S}; use a positive group size dividing the tokens each "
                             "rank (and pipeline microbatch) sees.")
        if self.capacity_factor is None:
            return
        if self.group_size is None and self.expert_axis is not None:
            raise ValueError(f"MoE(capacity_factor={self.capacity_factor}, expert_axis={self.expert_axis!r}): the "
                             "batch is split over the expert axis, so each rank's capacity would cover only its own "
                             "tokens and drop other rows than one device does; set group_size= (tokens per group, "
                             "dividing each rank's tokens) so both apply the same rule.")
        if self.group_size is not None and N % self.group_size:
            raise ValueError(f"MoE(group_size={self.group_size}): this call's {N} tokens (x shape {shape}) do not "
                             f"form whole groups of {self.group_size}; use a group size dividing the tokens each "
                             "rank (and pipeline microbatch) sees, e.g. a multiple of the sequence length that "
                             "divides them.")

    def _kept(self, counts: torch.Tensor, order: torch.Tensor, pair_expert: torch.Tensor) -> torch.Tensor | None:
        """Capacity mode: which sorted rows fit their expert's capacity in their group (token order
        decides). ``order`` (N k,) sorts the rows of ``pair_expert`` (N k,) by expert, stably."""
        if self.capacity_factor is None:
            return None
        rows, k, E = order.shape[0], self.top_k, self.n_experts
        size = rows if self.group_size is None else self.group_size * k  # rows per group
        capacity = math.ceil(self.capacity_factor * size / E)
        starts = torch.cumsum(counts, 0) - counts  # (E,): each expert's first sorted row
        rank = torch.arange(rows, device=counts.device) - torch.repeat_interleave(starts, counts)
        if size < rows:  # several groups: a row's rank among its expert's rows of earlier groups taken off
            group = order // size  # (N k,): each sorted row's group (rows of a token stay in its group)
            per_group = torch.bincount(torch.arange(rows, device=order.device) // size * E + pair_expert,
                                       minlength=rows // size * E).view(-1, E)  # (G, E)
            before = torch.cumsum(per_group, 0) - per_group  # (G, E): each expert's rows in earlier groups
            rank = rank - before[group, pair_expert[order]]
        return rank < capacity  # (N k,)

    def _experts_over_axis(self, params: dict, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: this rank holds experts ``[r E/n, (r+1) E/n)`` of ``expert_axis``'s
        ``n``; the rows sorted by expert (R, C) go to their experts' ranks (``ragged_all_to_all``),
        are computed there grouped by local expert, and come back in the order they left."""
        axis, E = self.expert_axis, self.n_experts
        n = lax.axis_size(axis)
        El = E // n  # experts per rank
        if E % n or params["gate"].shape[0] != El:
            raise ValueError(f"MoE(expert_axis={axis!r}): {E} experts over {n} ranks need E % n == 0 and this "
                             f"rank's {El} experts in params (got {params['gate'].shape[0]}); split the experts' "
                             "dim with Rules({'experts': axis}).")
        per_rank = counts.view(n, El)  # (dest, local expert)
        came = lax.all_to_all(per_rank, axis, split_dim=0, concat_dim=0)  # (source, local expert)
        rows, back_sizes = lax.ragged_all_to_all(xs, axis, per_rank.sum(1))  # by source, then local expert
        local = torch.arange(El, device=xs.device).repeat(n)  # each (source, expert) block's expert
        grouped = torch.argsort(torch.repeat_interleave(local, came.reshape(-1)), stable=True)
        out = self._experts(params, rows[grouped], came.sum(0))  # grouped by local expert
        out = out[torch.argsort(grouped)]  # back to (source, expert) order
        return lax.ragged_all_to_all(out, axis, back_sizes)[0]  # (R, C), as the rows left

    def _experts(self, params: dict, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # sorted rows (R, C), each expert's consecutive -> down(silu(gate x) * up x): (R, C)
        h = act_fn("silu", grouped_matmul(xs, params["gate"], counts)) * grouped_matmul(xs, params["up"], counts)
        return grouped_matmul(h, params["down"], counts)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x`` (R, K) as consecutive groups of ``counts`` (E,) rows, group ``e`` times ``w[e]`` (K, M):
    (R, M). One ``F.grouped_mm`` where it takes the operands; otherwise the groups padded to the
    largest (one read of the counts on the host) and one batched matmul."""
    w = w.to(x.dtype)
    if _grouped_mm_takes(x, w):
        return F.grouped_mm(x.contiguous(), w.contiguous(), offs=torch.cumsum(counts, 0).to(torch.int32))
    E, R = w.shape[0], x.shape[0]
    width = int(counts.max()) if R else 0
    starts = torch.cumsum(counts, 0) - counts
    group = torch.repeat_interleave(torch.arange(E, device=x.device), counts, output_size=R)  # (R,)
    slot = torch.arange(R, device=x.device) - starts[group]  # (R,): the row's place in its group
    padded = x.new_zeros(E, width, x.shape[1]).index_put((group, slot), x)  # (E, width, K)
    return torch.bmm(padded, w)[group, slot]  # (R, M)


def _grouped_mm_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """``F.grouped_mm`` (torch >= 2.9) takes fp32 / bf16 / fp16 rows whose widths are 16-byte multiples."""
    size = x.element_size()
    return (hasattr(F, "grouped_mm") and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and (x.shape[1] * size) % 16 == 0 and (w.shape[2] * size) % 16 == 0)
