"""``python -m cfx.bench moe``: a mixture of experts' dispatch, its expert-parallel traffic and its cost.

* ``alltoall_bytes_vs_formula``: the bytes an expert-parallel MoE layer's forward sends to other
  ranks (``cfx.comm_stats``, op ``ragged_all_to_all``: the rows, not padded), summed over ranks,
  over the textbook ``2 x tokens x k x hidden x bytes x (N-1)/N`` (dispatch and combine, with a
  uniform router's share of rows staying home); beside it the same over the rows this routing
  actually sent off-rank (1.00 means nothing but the rows moved);
* ``expert_load_imbalance``: the busiest expert's rows over the mean (1.00 is perfect balance);
* ``dispatch_vs_loop``: the sorted, grouped dispatch's forward + backward time over a Python loop
  over experts (transformers' way), same layer and tokens, with 64 fine-grained experts (target
  <= 0.5; at Mixtral's 8 wide experts the loop's overhead is small next to its matmuls on a CPU,
  shown beside it);
* ``moe_vs_dense_step``: a Mixtral training step (loss, grads, AdamW) over a Llama of the same
  active FLOPs (``top_k`` experts of width ``I`` per token = one MLP of width ``k I``); the MoE
  also routes, sorts and gathers its rows and keeps ``E / k`` times the MLP weights (information).

Sizes: GPT-2-small-like widths under the default, a quarter under ``--quick``, toy under ``--smoke``.
"""
from __future__ import annotations

import dataclasses

import torch

import cfx
from cfx import P, optim
from cfx.bench.common import Row, interleaved_medians, report, size_of

SIZES = {  # size -> (C, I, E, k, tokens, ranks, rounds)
    "smoke": (16, 32, 4, 2, 64, 2, 1),
    "quick": (192, 512, 8, 2, 1024, 4, 5),
    "full": (768, 2048, 8, 2, 4096, 4, 5),
}


def _loop(layer, p, x):
    """transformers' Mixtral dispatch: a Python loop over the experts."""
    flat = x.reshape(-1, layer.features)
    probs = torch.softmax((flat @ p["router"]).float(), -1)
    w, e = torch.topk(probs, layer.top_k, -1)
    w = w / w.sum(-1, keepdim=True)
    y = torch.zeros_like(flat)
    for ex in range(layer.n_experts):
        tok, slot = torch.where(e == ex)
        h = torch.nn.functional.silu(flat[tok] @ p["gate"][ex]) * (flat[tok] @ p["up"][ex])
        y = y.index_add(0, tok, (h @ p["down"][ex]) * w[tok, slot, None])
    return y.view(x.shape)


def _traffic_rows(layer, p, x, n: int) -> list[Row]:
    ep = dataclasses.replace(layer, expert_axis="expert")
    with cfx.Mesh({"expert": n}) as mesh, cfx.comm_stats() as stats:
        specs = cfx.Rules(cfx.parallel.EXPERT_RULES).specs(layer.axes(), mesh=mesh)
        cfx.shard_map(lambda p, x: ep.apply(p, x), mesh=mesh, in_specs=(specs, P("expert")),
                      out_specs=P("expert"))(p, x)
    sent = stats.bytes(op="ragged_all_to_all")
    tokens, k, C, nbytes = x.shape[0] * x.shape[1], layer.top_k, layer.features, x.element_size()
    uniform = 2 * tokens * k * C * nbytes * (n - 1) / n
    # the rows this routing sent off-rank: a row of rank r's tokens to expert e leaves unless e is r's
    flat = x.reshape(n, -1, C)
    off = 0
    for r in range(n):
        experts = torch.topk(flat[r] @ p["router"], k, -1).indices  # (tokens/n, k)
        off += int((experts // (layer.n_experts // n) != r).sum())
    exact = 2 * off * C * nbytes
    _, router = layer.apply_with_stats(p, x)
    imbalance = float(router.counts.max() / router.counts.mean())
    return [Row(f"alltoall_bytes_vs_formula (2 tokens k hidden bytes (N-1)/N; N={n} ranks, {tokens} tokens)",
                sent / uniform, "x", "1.00 +- routing", abs(sent / uniform - 1) < 0.25),
            Row("  over the rows this routing sent off-rank (2 x rows x hidden x bytes)", sent / exact, "x", "1.00",
                sent == exact),
            Row(f"expert_load_imbalance (busiest expert's rows / mean, {layer.n_experts} experts, top-{k})",
                imbalance, "x")]


def _dispatch_rows(C: int, I: int, E: int, k: int, x: torch.Tensor, rounds: int) -> list[Row]:
    """At Mixtral's 8 experts and at 8x as many of an eighth the width (the same weights, fine-grained
    as DeepSeek's and Qwen's), where a loop's per-expert overhead is what the grouped dispatch saves."""
    rows = []
    for experts, width, target in ((E, I, None), (8 * E, max(1, I // 8), 0.5)):
        layer = cfx.nn.MoE(C, width, experts, top_k=k)
        leaves = cfx.tree.map(lambda t: (t * 10).requires_grad_(), layer.init(cfx.random.key(0)))

        def step(fn, layer=layer, leaves=leaves):
            return lambda: torch.autograd.grad(fn(layer, leaves, x).pow(2).sum(), cfx.tree.leaves(leaves))
        grouped = lambda layer, p, x: layer.apply(p, x)  # noqa: E731
        t_grouped, t_loop = interleaved_medians([step(grouped), step(_loop)], rounds=rounds)
        ratio = t_grouped / t_loop
        name = "dispatch_vs_loop" if target else "  information: dispatch_vs_loop"
        rows += [Row(f"{name} (sorted + grouped matmuls / a loop over {experts} experts of width {width}, fwd+bwd, "
                     f"{t_grouped * 1e3:.1f} vs {t_loop * 1e3:.1f} ms)", ratio, "x", f"<= {target}" if target else "-",
                     ratio <= target if target else True)]
    return rows


def _step_rows(C: int, I: int, E: int, k: int, tokens: int, rounds: int) -> list[Row]:
    common = dict(vocab_size=256, hidden_size=C, n_layer=2, n_head=max(1, C // 64), n_kv_heads=max(1, C // 64),
                  max_position_embeddings=256)
    moe = cfx.models.mixtral("tiny", intermediate_size=I, n_experts=E, top_k=k, **common)
    dense = cfx.models.llama("tiny", intermediate_size=k * I, **common)
    T = 128
    x = cfx.random.randint(cfx.random.key(0), (max(1, tokens // T), T), 0, 256)
    steps = []
    for model in (moe, dense):
        tx = optim.adamw(1e-4)
        state = [model.init(cfx.random.key(1))]
        state.append(tx.init(state[0]))

        def run(model=model, tx=tx, state=state):
            _, g = cfx.value_and_grad(model.loss)(state[0], x, x)
            state[0], state[1] = optim.apply_gradients(tx, g, state[1], state[0])
        steps.append(run)
    t_moe, t_dense = interleaved_medians(steps, rounds=rounds)
    return [Row(f"moe_vs_dense_step (Mixtral {E}x top-{k} of width {I} / Llama of MLP width {k * I}, same active "
                "FLOPs)", t_moe / t_dense, "x", "-"),
            Row("  why: the MoE also routes, sorts and gathers its rows, and steps E/k times the MLP weights in "
                "AdamW", E / k, "x weights")]


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    size = size_of(quick=quick, smoke=smoke)
    C, I, E, k, tokens, n, rounds = SIZES[size]
    layer = cfx.nn.MoE(C, I, E, top_k=k)
    p = cfx.tree.map(lambda t: t * 10, layer.init(cfx.random.key(0)))  # a router with opinions
    x = cfx.random.normal(cfx.random.key(1), (n, tokens // n, C))
    rows = _traffic_rows(layer, p, x, n) + _dispatch_rows(C, I, E, k, x, rounds)
    rows += _step_rows(C, I, E, k, tokens, rounds)
    return report("moe", rows, json_path)
