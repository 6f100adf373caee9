"""``python -m cfx.bench serve --http``: the OpenAI-compatible server under load, on 127.0.0.1.

The bench's GPT-2 (``serve``'s sizes) behind ``cfx.serve.app`` on uvicorn in this process, driven by
the official ``openai`` client (``AsyncOpenAI``, streamed, so each request's first token and the gaps
between tokens are timed at the client):

* requests/s and output tokens/s at concurrency 1, 8 and 32 (``--smoke``: 1 and 4), TTFT and ITL
  p50/p99 at the highest;
* ``http_overhead_vs_engine``: output tokens/s through HTTP at the highest concurrency over the engine
  called directly on the same requests with as many sequences at once (target >= 0.90);
* the load test: 500 requests (``--quick``: 200, ``--smoke``: 40) at the highest concurrency under a
  time cap: errors and lost requests (0), blocks held afterwards (0) and the process's RSS growth
  between the 100th finished request and the last (< 5%; the smoke run's is printed only).
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import torch

import cfx
from cfx.bench.common import Row, report, size_of, skipped
from cfx.bench.serve import SIZES, _pct, workload
from cfx.serve import Engine, EngineThread, SamplingParams, app

HTTP_SIZES = {"smoke": ((1, 4), 40), "quick": ((1, 8, 32), 200), "full": ((1, 8, 32), 500)}


def _text(ids: list[int]) -> str:
    """Printable ASCII of a drawn prompt (what the server's byte tokenizer encodes back to the same ids)."""
    return "".join(chr(32 + t % 95) for t in ids)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class _Server:
    def __init__(self, asgi):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(asgi, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


async def _drive(url: str, requests: list, concurrency: int, cap_s: float, progress=None) -> dict:
    """Every request streamed at ``concurrency``; per request: its text chunks' times, ok, the tokens it got
    (``usage``) and asked for."""
    import openai

    gate, out = asyncio.Semaphore(concurrency), []
    async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=cap_s) as client:
        async def one(prompt, n):
            async with gate:
                t0, times, ok, tokens = time.perf_counter(), [], True, 0
                try:
                    async for chunk in await client.completions.create(
                            model="bench", prompt=prompt, max_tokens=n, temperature=0, stream=True,
                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
                        if chunk.choices and chunk.choices[0].text:
                            times.append(time.perf_counter() - t0)
                        if chunk.usage is not None:
                            tokens = chunk.usage.completion_tokens
                except Exception:  # noqa: BLE001 -- counted as an error
                    ok = False
                out.append((times, ok, tokens, n))
                if progress is not None:
                    progress(len(out))
        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(one(p, n) for p, n in requests)), timeout=cap_s)
    return {"seconds": time.perf_counter() - t0, "results": out}


def rows(size: str) -> list[Row]:
    try:
        import openai  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        return [skipped("serve --http", why=f"{e.name} is not installed (pip install cfx[serve] openai)")]
    import transformers

    kw, _, prompts, outputs, _, _ = SIZES[size]
    kw = dict(kw, vocab_size=max(kw.get("vocab_size", 50257), 256))  # the server's byte tokenizer's ids
    levels, n_load = HTTP_SIZES[size]
    model = cfx.models.gpt2("small", **kw)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(model.hf_config()).eval()
    _, params = cfx.models.from_hf(hf, model)
    top = max(levels)
    engine = Engine(model, params, max_seqs=top, max_batch_tokens=max(512, top))
    runner = EngineThread(engine, max_waiting=n_load + top)
    server = _Server(app(runner, cfx.serve.ByteTokenizer(), model_name="bench"))
    url = f"http://127.0.0.1:{server.port}/v1"
    small = (prompts[0], max(prompts[0], prompts[1] // 4)), (outputs[0], max(outputs[0], outputs[1] // 4))
    out = []
    try:
        for c in levels:
            reqs = [(p, n) for p, n in workload(2 * c, *small, vocab=256, seed=c)]
            got = asyncio.run(_drive(url, [(_text(p), n) for p, n in reqs], c, 600))
            toks = sum(k for _, _, k, _ in got["results"])
            out.append(Row(f"concurrency {c}: requests/s / output tokens/s", len(reqs) / got["seconds"],
                           f"req/s; {toks / got['seconds']:,.0f} tok/s"))
        ttft = [t[0] for t, _, _, _ in got["results"] if t]
        itl = [b - a for t, _, _, _ in got["results"] for a, b in zip(t, t[1:])]
        out += [Row(f"ttft_p50_s / p99 (concurrency {top})", _pct(ttft, 0.5), f"s; p99 {_pct(ttft, 0.99):.3f} s"),
                Row(f"itl_p50_s / p99 (concurrency {top})", _pct(itl, 0.5), f"s; p99 {_pct(itl, 0.99):.3f} s")]
        direct = Engine(model, params, max_seqs=top, max_batch_tokens=max(512, top))
        t0 = time.perf_counter()
        direct.generate([list(_text(p).encode()) for p, _ in reqs],
                        [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in reqs])
        ratio = (toks / got["seconds"]) / (sum(n for _, n in reqs) / (time.perf_counter() - t0))
        out.append(Row(f"http_overhead_vs_engine (concurrency {top})", ratio, "x", ">= 0.90", ratio >= 0.90))
        out += _load(url, runner, size, n_load, top, small)
    finally:
        server.stop()
        runner.close(drain=False, timeout=30)
    return out


def _load(url: str, runner: EngineThread, size: str, n: int, concurrency: int, small) -> list[Row]:
    reqs = workload(n, *small, vocab=256, seed=99)
    rss = {}

    def progress(done: int):
        if done in (100, n) or (done == n // 5 and n < 100):
            rss[done] = _rss()
    got = asyncio.run(_drive(url, [(_text(p), m) for p, m in reqs], concurrency, 1200, progress))
    errors = sum(not ok or k != m for _, ok, k, m in got["results"])  # failed, or cut short
    lost = n - len(got["results"])
    deadline = time.monotonic() + 30
    while runner.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    held = runner.engine.blocks.held
    first = rss[min(rss)]
    growth = rss[n] / first - 1 if n in rss else float("nan")
    return [Row(f"load: {n} requests at concurrency {concurrency}: errors / lost", errors + lost,
                f"({errors} errors, {lost} lost, {got['seconds']:.1f} s)", "0", errors + lost == 0),
            Row("load: KV blocks held afterwards", held, "blocks", "0", held == 0),
            Row(f"load: RSS growth from request {min(rss)} to {n}", growth, f"({first / 2**20:,.0f} MiB at first)",
                "< 0.05" if size != "smoke" else "-", growth < 0.05 or size == "smoke")]


def run_http(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    """``python -m cfx.bench serve --http`` (a flag of the serve bench, not a bench of its own)."""
    return report("serve --http", rows(size_of(quick=quick, smoke=smoke)), json_path)
