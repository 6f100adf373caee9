"""``python -m cfx.bench serve --http``: the OpenAI-compatible server under load, on 127.0.0.1.

The bench's GPT-2 (``serve``'s sizes), saved as a Hugging Face directory with a byte-level BPE
tokenizer of as many ids as the model's vocabulary (``pair_tokenizer``), served by ``python -m
cfx.serve`` in a process of its own, as a deployment runs it; the official ``openai`` client drives it
from this process (``AsyncOpenAI``, streamed, so each request's first token and the gaps between
tokens are timed at the client):

* requests/s and output tokens/s at concurrency 1, 8 and 32 (``--smoke``: 1 and 4), TTFT and ITL
  p50/p99 at the highest;
* ``http_overhead_vs_engine``: output tokens/s through HTTP at the highest concurrency over the engine
  called directly on the same requests (the same ids) with as many sequences at once (target >= 0.90):
  at equal compute -- the server pinned to one core and one torch thread, the client to another, the
  direct engine on the server's core with one thread, each run twice alternately (``_overhead_one_core``)
  -- and, printed, on the whole machine with the client sharing its cores;
* the load test: 500 requests (``--quick``: 200, ``--smoke``: 40) at the highest concurrency under a
  time cap: errors and lost requests (0), KV blocks held afterwards (0: ``/metrics``' free blocks equal
  its total) and the server process's RSS growth between the 100th finished request and the last (< 5%;
  the smoke run's is printed only);
* ``throughput_vs_transformers_serve`` (not ``--smoke``): output tokens/s of ``python -m cfx.serve`` over
  ``transformers serve --continuous-batching`` (its OpenAI-compatible server; ``pip install fastapi``) on the
  same directory and requests, non-streamed, greedy, at concurrency 32; each server alone on the machine,
  each workload run twice and the faster run taken (target >= 1.0).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

import cfx
from cfx.bench.common import Row, free_port, report, size_of, skipped
from cfx.bench.serve import SIZES, _pct, workload
from cfx.serve import Engine, HFTokenizer, SamplingParams

HTTP_SIZES = {"smoke": ((1, 4), 40), "quick": ((1, 8, 32), 200), "full": ((1, 8, 32), 500)}
PEER = {"quick": (32, (16, 128), (16, 64)), "full": (96, (16, 512), (16, 256))}  # requests, prompts, outputs


def _text(ids: list[int]) -> str:
    """Printable ASCII of drawn ids, two characters an id (``pair_tokenizer`` makes most pairs one token)."""
    return "".join(chr(32 + t % 95) + chr(32 + (t * 7 + 3) % 95) for t in ids)


def pair_tokenizer(directory: str | os.PathLike, vocab_size: int):
    """A byte-level BPE tokenizer of ``vocab_size`` ids, saved in ``directory``: the 256 bytes, every pair of
    them as one merged token until the vocabulary is full, then ``<|endoftext|>`` -- a real tokenizer (what
    both servers load) whose every id decodes, at GPT-2's vocabulary size, with nothing downloaded."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab, merges = {c: i for i, c in enumerate(alphabet)}, []
    for a in alphabet:
        for b in alphabet:
            if len(vocab) >= vocab_size - 1:
                break
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    vocab["<|endoftext|>"] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|endoftext|>",
                                               bos_token="<|endoftext|>")
    tok.save_pretrained(directory)
    return tok



class Server:
    """A server command (``argv`` without its port) on 127.0.0.1 in a process of its own, up once ``/health``
    answers; ``close`` stops it (SIGTERM, then kill)."""

    def __init__(self, argv: list[str], log: pathlib.Path, timeout: float = 180, cpus: set[int] | None = None):
        import httpx2 as httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "wb") as out:
            env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
            if cpus is not None:
                env["OMP_NUM_THREADS"] = str(len(cpus))
            pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
            self.proc = subprocess.Popen(argv + ["--port", str(self.port)], stdout=out, stderr=subprocess.STDOUT,
                                         env=env, preexec_fn=pin)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{argv[:3]} did not come up:\n{log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)

    def metric(self, name: str) -> float:
        import httpx2 as httpx

        text = httpx.get(self.url + "/metrics", timeout=10).text
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/statm") as f:
            return int(f.read().split()[1]) * 4096

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _drive(url: str, model: str, requests: list, concurrency: int, cap_s: float, progress=None,
                 stream: bool = True, ignore_eos: bool = True) -> dict:
    """Every request at ``concurrency`` (streamed, or not); per request: its text chunks' times, ok, the tokens
    it got (``usage``) and asked for."""
    import openai

    gate, out = asyncio.Semaphore(concurrency), []
    extra = {"extra_body": {"ignore_eos": True}} if ignore_eos else {}
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=cap_s) as client:
        async def one(prompt, n):
            async with gate:
                t0, times, ok, tokens = time.perf_counter(), [], True, 0
                try:
                    if stream:
                        async for chunk in await client.completions.create(
                                model=model, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                stream_options={"include_usage": True}, **extra):
                            if chunk.choices and chunk.choices[0].text:
                                times.append(time.perf_counter() - t0)
                            if chunk.usage is not None:
                                tokens = chunk.usage.completion_tokens
                    else:
                        r = await client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                                            **extra)
                        tokens = r.usage.completion_tokens
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
        import httpx2  # noqa: F401
        import openai  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        return [skipped("serve --http", why=f"{e.name} is not installed (pip install cfx[serve] openai)")]
    import transformers

    kw, _, prompts, outputs, _, _ = SIZES[size]
    kw = dict(kw, vocab_size=max(kw.get("vocab_size", 50257), 320))  # (the tokenizer's 256 bytes and some pairs)
    levels, n_load = HTTP_SIZES[size]
    model = cfx.models.gpt2("small", **kw)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(model.hf_config()).eval()
    top = max(levels)
    small = (prompts[0], max(prompts[0], prompts[1] // 4)), (outputs[0], max(outputs[0], outputs[1] // 4))
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
        hf.save_pretrained(d)
        tok = HFTokenizer(pair_tokenizer(d, model.config.vocab_size))
        server = Server([sys.executable, "-m", "cfx.serve", "--model", d, "--name", "bench", "--max-seqs", str(top),
                         "--max-batch-tokens", str(max(512, top)), "--max-waiting", str(n_load + top)],
                        pathlib.Path(d) / "cfx.log")
        stack.callback(server.close)
        out = []
        for c in levels:
            reqs = [(_text(p), n) for p, n in workload(2 * c, *small, vocab=256, seed=c)]
            got = asyncio.run(_drive(server.url, "bench", reqs, c, 600))
            toks = sum(k for _, _, k, _ in got["results"])
            out.append(Row(f"concurrency {c}: requests/s / output tokens/s", len(reqs) / got["seconds"],
                           f"req/s; {toks / got['seconds']:,.0f} tok/s"))
        ttft = [t[0] for t, _, _, _ in got["results"] if t]
        itl = [b - a for t, _, _, _ in got["results"] for a, b in zip(t, t[1:])]
        out += [Row(f"ttft_p50_s / p99 (concurrency {top})", _pct(ttft, 0.5), f"s; p99 {_pct(ttft, 0.99):.3f} s"),
                Row(f"itl_p50_s / p99 (concurrency {top})", _pct(itl, 0.5), f"s; p99 {_pct(itl, 0.99):.3f} s")]
        from cfx._src.train.cli_generate import load
        model, params, _ = load(d)  # as the server reads it
        engine_kw = dict(max_seqs=top, max_batch_tokens=max(512, top))
        ids = [(tok.encode(p), n) for p, n in reqs]
        ratio = (toks / got["seconds"]) / _engine_tokens_per_s(model, params, ids, engine_kw)
        out.append(Row(f"http_overhead_vs_engine, sharing the cores with the client (concurrency {top})", ratio, "x"))
        out += _load(server, size, n_load, top, small)
        out += _vs_transformers_serve(server, d, size)
        server.close()
        out.append(_overhead_one_core(d, model, params, reqs, ids, top, engine_kw))
    return out


def _engine_tokens_per_s(model, params, ids: list, engine_kw: dict) -> float:
    """Output tokens/s of the engine called directly on ``ids`` (every request added at once)."""
    direct = Engine(model, params, **engine_kw)
    t0 = time.perf_counter()
    direct.generate([p for p, _ in ids], [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in ids])
    return sum(n for _, n in ids) / (time.perf_counter() - t0)


def _overhead_one_core(directory: str, model, params, reqs: list, ids: list, top: int, engine_kw: dict) -> Row:
    """``http_overhead_vs_engine`` at equal compute: the server process pinned to the last core with one torch
    thread, the client (this process) to the first; then the engine called directly on that same core with one
    thread. Each side run twice, alternately, the faster taken. (On two cores the client, which parses every
    streamed chunk, otherwise takes CPU from the engine that the direct run has to itself: a cost of the bench's
    machine, not of the server.)"""
    name = f"http_overhead_vs_engine (concurrency {top}; server and engine on one core each, client apart)"
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return skipped(name, why="one CPU: the client cannot run apart from the server")
    argv = [sys.executable, "-m", "cfx.serve", "--model", directory, "--name", "bench", "--max-seqs", str(top),
            "--max-batch-tokens", str(engine_kw["max_batch_tokens"])]
    server = Server(argv, pathlib.Path(directory) / "cfx-one-core.log", cpus={cores[-1]})
    threads, http, direct = torch.get_num_threads(), [], []
    try:
        asyncio.run(_drive(server.url, "bench", reqs[:4], 4, 600))  # warm
        for _ in range(2):
            os.sched_setaffinity(0, {cores[0]})
            got = asyncio.run(_drive(server.url, "bench", reqs, top, 600))
            http.append(sum(k for _, _, k, _ in got["results"]) / got["seconds"])
            os.sched_setaffinity(0, {cores[-1]})
            torch.set_num_threads(1)
            direct.append(_engine_tokens_per_s(model, params, ids, engine_kw))
            torch.set_num_threads(threads)
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
        server.close()
    ratio = max(http) / max(direct)
    return Row(name, ratio, f"x ({max(http):,.0f} / {max(direct):,.0f} tok/s)", ">= 0.90", ratio >= 0.90)


def _load(server: Server, size: str, n: int, concurrency: int, small) -> list[Row]:
    reqs = workload(n, *small, vocab=256, seed=99)
    rss = {}

    def progress(done: int):
        if done in (100, n) or (done == n // 5 and n < 100):
            rss[done] = server.rss()
    got = asyncio.run(_drive(server.url, "bench", [(_text(p), m) for p, m in reqs], concurrency, 1200, progress))
    errors = sum(not ok or k != m for _, ok, k, m in got["results"])  # failed, or cut short
    lost = n - len(got["results"])
    deadline = time.monotonic() + 30
    while server.metric("cfx_requests_running") + server.metric("cfx_requests_waiting") \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    held = int(server.metric("cfx_kv_blocks_total") - server.metric("cfx_kv_blocks_free"))
    first = rss[min(rss)]
    growth = rss[n] / first - 1 if n in rss else float("nan")
    return [Row(f"load: {n} requests at concurrency {concurrency}: errors / lost", errors + lost,
                f"({errors} errors, {lost} lost, {got['seconds']:.1f} s)", "0", errors + lost == 0),
            Row("load: KV blocks held afterwards", held, "blocks", "0", held == 0),
            Row(f"load: RSS growth from request {min(rss)} to {n}", growth, f"({first / 2**20:,.0f} MiB at first)",
                "< 0.05" if size != "smoke" else "-", growth < 0.05 or size == "smoke")]


def _vs_transformers_serve(cfx_server: Server, directory: str, size: str) -> list[Row]:
    """Output tokens/s of the cfx server over ``transformers serve`` on the same directory and requests (module
    doc): greedy without ``ignore_eos`` (which transformers does not take), so both compute the same tokens."""
    name = "throughput_vs_transformers_serve"
    if size == "smoke":
        return [skipped(name, why="--quick and the full run only (a second server's start-up)")]
    from transformers.utils.import_utils import is_serve_available
    if not is_serve_available():
        return [skipped(name, why="transformers serve needs fastapi (pip install fastapi)")]
    n, prompts, outputs = PEER[size]
    reqs = [(_text(p), m) for p, m in workload(n, prompts, outputs, vocab=256, seed=7)]

    def best(server: Server, model: str) -> tuple[float, int]:
        asyncio.run(_drive(server.url, model, reqs[:4], 4, 600, stream=False, ignore_eos=False))  # warm
        runs = [asyncio.run(_drive(server.url, model, reqs, 32, 1200, stream=False, ignore_eos=False))
                for _ in range(2)]
        if any(not ok for r in runs for _, ok, _, _ in r["results"]):
            raise RuntimeError(f"{model}: a request failed")
        tokens = sum(k for _, _, k, _ in runs[0]["results"])
        return tokens / min(r["seconds"] for r in runs), tokens
    ours, our_tokens = best(cfx_server, "bench")
    cfx_server.close()  # each server alone on the machine
    peer = Server([sys.executable, "-m", "transformers.cli.transformers", "serve", directory, "--continuous-batching",
                   "--device", "cpu", "--host", "127.0.0.1"], pathlib.Path(directory) / "transformers.log")
    try:
        theirs, their_tokens = best(peer, directory)
    finally:
        peer.close()
    return [Row(f"cfx.serve output tokens/s ({n} requests, concurrency 32)", ours, "tok/s"),
            Row("transformers serve --continuous-batching output tokens/s", theirs,
                f"tok/s ({their_tokens} tokens; cfx {our_tokens})"),
            Row(name, ours / theirs, "x", ">= 1.0", ours >= theirs)]


def run_http(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    """``python -m cfx.bench serve --http`` (a flag of the serve bench, not a bench of its own)."""
    return report("serve --http", rows(size_of(quick=quick, smoke=smoke)), json_path)
