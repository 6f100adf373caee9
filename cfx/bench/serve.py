"""Serving, measured: ``cfx.serve.Engine`` against transformers on one fixed, seeded workload.

A GPT-2 of width 256 and 4 layers (``--smoke``: width 32, one layer, a 64-token vocabulary), fp32,
this process's torch threads for every side, greedy, end-of-sequence ignored. The workload: 64
requests (``--quick``: 16; ``--smoke``: 6), prompt lengths uniform in 16-512 (``--quick``: 16-128),
output lengths in 16-256 (``--quick``: 16-64), all arriving at once; every side is held to the same
batch of 8 sequences at a time.

* ``throughput_vs_hf_static``: the engine's requested output tokens per second over transformers'
  ``generate`` on the same requests in padded batches of 8, in arrival order (each batch left-padded
  to its longest prompt and run to its longest output: what a server without continuous batching does);
  each side run twice, alternately, its faster run taken (``--smoke``: once): a busy 2-core machine
  moves either side's time by 20% between runs;
* ``throughput_vs_hf_continuous``: over transformers' own continuous batching, ``generate_batch``
  (which takes one ``max_new_tokens`` for every request: the longest; tokens past a request's own
  length are not counted);
* ``kv_utilisation``: token slots holding tokens over the slots the running sequences hold, averaged
  over the engine's steps (a padded, preallocated cache holds ``prompt + max_new_tokens`` per row);
* ``prefix_cache_prefill_ratio``: 32 requests (``--smoke``: 8) sharing a 256-token prefix (64), each
  with 16 tokens of its own: prompt tokens the engine computes with the prefix cache over without it;
* ``ttft_p50_s`` / ``ttft_p99_s`` (from the workload's start to a request's first token) and
  ``itl_p50_s`` / ``itl_p99_s`` (between a request's tokens), printed;
* ``same_tokens_as_generate``: the requests whose tokens equal ``cfx.generate`` on each alone (the
  smoke and quick runs check all of them, the full run the first 16), as a fraction (target 1).

``--http`` measures the HTTP server instead (``serve_http``).
"""
from __future__ import annotations

import time

import torch

import cfx
from cfx.bench.common import Row, report, size_of
from cfx.serve import Engine, SamplingParams

BATCH = 8  # sequences at a time, every side
SIZES = {  # size -> (GPT-2 overrides, requests, prompt range, output range, prefix requests, prefix length)
    "smoke": (dict(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=256), 6, (4, 24), (2, 8), 8, 64),
    "quick": (dict(n_layer=4, n_embd=256, n_head=4), 16, (16, 128), (16, 64), 32, 256),
    "full": (dict(n_layer=4, n_embd=256, n_head=4), 64, (16, 512), (16, 256), 32, 256),
}


def workload(n: int, prompts: tuple[int, int], outputs: tuple[int, int], vocab: int, seed: int = 0):
    """``n`` (prompt ids, output length) pairs, drawn once from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = int(torch.randint(prompts[0], prompts[1] + 1, (), generator=g))
        o = int(torch.randint(outputs[0], outputs[1] + 1, (), generator=g))
        out.append((torch.randint(0, vocab, (p,), generator=g).tolist(), o))
    return out


def run_engine(model, params, requests, **kw) -> tuple[float, Engine, list, list]:
    """Every request added at once and run to its end: (seconds, the engine, each request's tokens and
    the times they came at)."""
    engine = Engine(model, params, max_seqs=BATCH, **kw)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(max_tokens=o, ignore_eos=True)) for p, o in requests]
    times: dict[str, list[float]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            times[out.request_id].append(time.perf_counter() - t0)
    return time.perf_counter() - t0, engine, [engine.output(i)[0] for i in ids], list(times.values())


def hf_static(hf, requests) -> float:
    """Seconds for transformers' ``generate`` over the requests in padded batches of ``BATCH``."""
    t0 = time.perf_counter()
    for s in range(0, len(requests), BATCH):
        chunk = requests[s:s + BATCH]
        T = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), T, dtype=torch.long)
        mask = torch.zeros(len(chunk), T, dtype=torch.long)
        for b, (p, _) in enumerate(chunk):
            ids[b, T - len(p):] = torch.tensor(p)
            mask[b, T - len(p):] = 1
        new = max(o for _, o in chunk)
        with torch.no_grad():
            hf.generate(ids.to(hf.device), attention_mask=mask.to(hf.device), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                        pad_token_id=0, eos_token_id=None)
    return time.perf_counter() - t0


def hf_continuous(hf, requests) -> float:
    """Seconds for transformers' ``generate_batch`` (its continuous batching) over the requests."""
    import transformers

    new = max(o for _, o in requests)
    longest = max(len(p) for p, _ in requests) + new
    gen = transformers.GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                                        pad_token_id=0)
    t0 = time.perf_counter()
    hf.generate_batch([p for p, _ in requests], generation_config=gen,
                      continuous_batching_config=transformers.ContinuousBatchingConfig(
                          page_size=16, num_blocks=BATCH * (longest // 16 + 2) + 8, max_batch_tokens=512,
                          max_requests_per_batch=BATCH), warmup=False)
    return time.perf_counter() - t0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def prefix_ratio(model, params, n: int, shared: int) -> tuple[float, int, int]:
    """Prompt tokens computed with the prefix cache over without, for ``n`` requests sharing ``shared`` tokens."""
    g = torch.Generator().manual_seed(1)
    V = model.config.vocab_size
    prefix = torch.randint(0, V, (shared,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, V, (16,), generator=g).tolist() for _ in range(n)]
    counts = []
    for caching in (True, False):
        engine = Engine(model, params, max_seqs=BATCH, prefix_caching=caching)
        engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
        counts.append(engine.stats["prefill_tokens"])
    return counts[0] / counts[1], counts[0], counts[1]


def device_rows(size: str, device: str) -> list[Row]:
    """``serve_throughput_gpu``: the workload above on ``device`` (bf16 there, fp32 on the CPU smoke), the
    engine with the paged-attention kernel (``attention="triton"``) against its gather-then-attend
    reference, each warmed on two requests first; transformers' padded batches beside them."""
    import transformers

    kw, n, prompts, outputs, _, _ = SIZES[size]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tag = "" if device == "cuda" else " [cpu smoke]"
    model = cfx.models.gpt2("small", **kw)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(model.hf_config()).eval()
    _, params = cfx.models.from_hf(hf, model)
    hf = hf.to(device=device, dtype=dtype)
    params = cfx.tree.map(lambda x: x.to(device=device, dtype=dtype), params)
    requests = workload(n, prompts, outputs, model.config.vocab_size)
    wanted = sum(o for _, o in requests)
    impls = ("triton", "reference") if device == "cuda" else ("reference",)
    t, tokens = {}, {}
    for impl in impls:
        run_engine(model, params, requests[:2], attention=impl)  # the kernels' compiles
        t[impl], _, tokens[impl], _ = run_engine(model, params, requests, attention=impl)
    t_static = hf_static(hf, requests)
    rows = [Row(f"serve_throughput_gpu {impl} ({n} requests, batch {BATCH}, {str(dtype)[6:]}){tag}", wanted / t[impl],
                "output tok/s") for impl in impls]
    rows.append(Row(f"  transformers generate, padded batches of {BATCH}{tag}", wanted / t_static, "output tok/s"))
    rows.append(Row(f"throughput_vs_hf_static_gpu (engine, {impls[0]} / transformers){tag}", t_static / t[impls[0]],
                    "x", ">= 2.0", t_static / t[impls[0]] >= 2.0))
    if len(impls) == 2:
        ratio = t["reference"] / t["triton"]
        same = sum(a == b for a, b in zip(tokens["triton"], tokens["reference"])) / n
        rows += [Row("serve_kernel_vs_reference_gpu (throughput, paged kernel / gather reference)", ratio, "x",
                     ">= 1.00", ratio >= 1.0),
                 Row("  requests with the same tokens, kernel vs reference (bf16: near-ties may flip)", same, "of requests")]
    return rows


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    import transformers

    size = size_of(quick=quick, smoke=smoke)
    kw, n, prompts, outputs, n_prefix, shared = SIZES[size]
    model = cfx.models.gpt2("small", **kw)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(model.hf_config()).eval()
    _, params = cfx.models.from_hf(hf, model)
    requests = workload(n, prompts, outputs, model.config.vocab_size)
    wanted = sum(o for _, o in requests)
    runs = [] if size == "smoke" else [run_engine(model, params, requests)[0], hf_static(hf, requests)]
    t_cfx, engine, tokens, times = run_engine(model, params, requests)
    t_static = min([hf_static(hf, requests), *runs[1:]])
    t_cfx = min([t_cfx, *runs[:1]])
    rows = []
    cfx_tps = wanted / t_cfx
    ratio = t_static / t_cfx
    rows.append(Row(f"throughput_vs_hf_static ({n} requests, batch {BATCH}, best of {1 + bool(runs)} each)", ratio,
                    f"x ({cfx_tps:,.0f} vs {wanted / t_static:,.0f} output tok/s)", ">= 2.0", ratio >= 2.0))
    hf.config._attn_implementation = "sdpa"
    try:
        t_cont = hf_continuous(hf, requests)
        ratio = t_cont / t_cfx
        rows.append(Row("throughput_vs_hf_continuous (generate_batch)", ratio,
                        f"x ({wanted / t_cont:,.0f} output tok/s)", ">= 1.0", ratio >= 1.0))
    except Exception as e:  # noqa: BLE001 -- an API that moved: the row says why
        rows.append(Row("throughput_vs_hf_continuous (generate_batch)", 0.0, f"skipped: {type(e).__name__}: {e}"[:120],
                        ">= 1.0", False))
    occ = engine.stats["occupancy"]
    util = sum(occ) / len(occ)
    rows.append(Row("kv_utilisation (token slots holding tokens / slots held, mean over steps)", util, "",
                    ">= 0.95", util >= 0.95))
    ratio, w, wo = prefix_ratio(model, params, n_prefix, shared)
    rows.append(Row(f"prefix_cache_prefill_ratio ({n_prefix} requests sharing {shared} tokens)", ratio,
                    f"({w:,} / {wo:,} prompt tokens)", "<= 0.125", ratio <= 0.125))
    ttft = [t[0] for t in times]
    itl = [b - a for t in times for a, b in zip(t, t[1:])]
    rows += [Row("ttft_p50_s", _pct(ttft, 0.5), "s"), Row("ttft_p99_s", _pct(ttft, 0.99), "s"),
             Row("itl_p50_s", _pct(itl, 0.5), "s"), Row("itl_p99_s", _pct(itl, 0.99), "s"),
             Row("  engine steps / preemptions", engine.stats["steps"], f"steps; {engine.stats['preemptions']} preempted")]
    check = list(zip(requests, tokens))[:n if size != "full" else 16]
    same = sum(out == cfx.generate(model, params, torch.tensor([p]), max_new_tokens=len(out))[0, len(p):].tolist()
               for (p, _), out in check) / len(check)
    rows.append(Row(f"same_tokens_as_generate ({len(check)} requests checked)", same, "of requests", "1", same == 1.0))
    return report("serve", rows, json_path)
