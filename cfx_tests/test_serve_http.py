"""``cfx.serve``'s HTTP server, live on 127.0.0.1 (uvicorn, a free port, bounded), driven by the official
``openai`` client: concurrent completions and chat completions equal transformers' greedy ``generate``
on the same directory (GPT-2 in this process, Llama under torchrun), streamed chunks concatenate to the whole answer, bad input gets OpenAI's error
JSON and its status while the server keeps serving, a client that leaves mid-stream has its request
aborted and its blocks given back, a bounded load test loses nothing, and ``python -m cfx.serve`` under
torchrun serves from rank 0 while every rank steps, and exits 0 on SIGTERM.

The in-process server runs the model in fp64 beside an fp64 transformers model (an argmax compared
across batch shapes is exact there); the command-line server runs a Llama directory saved in fp64."""
from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import cfx
from cfx.bench.common import free_port
from cfx.serve import Engine, EngineThread, HFTokenizer, app

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAT = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")


def byte_tokenizer(directory: pathlib.Path):
    """A byte-level BPE tokenizer without merges (every byte a token, 256 + <|endoftext|> + <|pad|>: 258, which
    splits over two ranks) and a chat template."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    vocab["<|pad|>"] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                               pad_token="<|pad|>")
    tok.chat_template = CHAT
    tok.save_pretrained(directory)
    return transformers.AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import transformers
    d = tmp_path_factory.mktemp("gpt2")
    tok = byte_tokenizer(d)
    model = cfx.models.gpt2("tiny", n_layer=2, vocab_size=len(tok), n_positions=256)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(model.hf_config()).eval().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory):
    """A peft LoRA of the directory's model (random B: it changes the output), saved by peft."""
    import peft
    import transformers
    torch.manual_seed(1)
    hf = transformers.GPT2LMHeadModel.from_pretrained(model_dir)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                                  init_lora_weights=False, fan_in_fan_out=True))
    d = tmp_path_factory.mktemp("adapter")
    pm.save_pretrained(d)
    return d


class Live:
    """An app served by uvicorn on a thread of this process, until ``stop``."""

    def __init__(self, asgi, runner):
        self.runner, self.port = runner, free_port()
        self.server = uvicorn.Server(uvicorn.Config(asgi, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def stop(self):
        self.client.close()
        self.server.should_exit = True
        self.thread.join(30)
        self.runner.close(drain=False, timeout=30)


@pytest.fixture(scope="module")
def served(model_dir, adapter_dir):
    """The directory's model in fp64 behind the server (with the peft adapter as the model "tiny-lora"), its
    transformers twin (fp64) and tokenizer."""
    import transformers
    model, params = cfx.models.from_pretrained(model_dir)
    params = cfx.tree.map(lambda x: x.double(), params)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    engine = Engine(model, params, block_size=8, num_blocks=256, max_batch_tokens=64, max_seqs=8)
    config, adapters = cfx.lora.load_peft(adapter_dir, model)
    engine.add_adapter("tiny-lora", cfx.tree.map(lambda x: x.double(), adapters), config)
    runner = EngineThread(engine, max_waiting=64)
    live = Live(app(runner, HFTokenizer(tok, skip_special=True), model_name="tiny"), runner)
    hf = transformers.GPT2LMHeadModel.from_pretrained(model_dir).eval().double()
    yield live, hf, tok
    live.stop()


def hf_text(hf, tok, ids: list[int], n: int) -> str:
    x = torch.tensor([ids])  # an explicit mask: generate would otherwise hide every id equal to pad_token_id
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


def wait_idle(runner, engine, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while runner.in_flight or engine.has_unfinished():
        assert time.monotonic() < deadline, "requests still in flight"
        time.sleep(0.02)


PROMPTS = ["Hello there", "The quick brown fox", "a", "Once upon a time, in a land", "0123456789",
           "cfx serves", "many requests", "at once", "Zebra", "tokens!", "paged KV", "blocks", "prefix caching",
           "continuous batching", "preempt", "done"]


@pytest.mark.timeout(240)
def test_concurrent_completions_and_chats_equal_transformers(served):
    live, hf, tok = served
    client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)

    async def completion(p, n):
        r = await client.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0,
                                            extra_body={"ignore_eos": True})
        return r.choices[0].text, r.usage

    async def chat(p, n):
        r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                                 max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
        return r.choices[0].message.content, r.usage

    async def all_of_them():
        async with client:
            jobs = [completion(p, 4 + i % 5) for i, p in enumerate(PROMPTS)]
            jobs += [chat(p, 3 + i % 4) for i, p in enumerate(PROMPTS)]
            return await asyncio.gather(*jobs)
    got = asyncio.run(all_of_them())
    for i, p in enumerate(PROMPTS):
        ids = tok.encode(p)
        assert got[i][0] == hf_text(hf, tok, ids, 4 + i % 5), p
        assert got[i][1].prompt_tokens == len(ids) and got[i][1].completion_tokens == 4 + i % 5
        chat_ids = list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True)["input_ids"])
        assert got[len(PROMPTS) + i][0] == hf_text(hf, tok, chat_ids, 3 + i % 4), p
    wait_idle(live.runner, live.runner.engine)
    assert live.runner.engine.blocks.held == 0 and not live.runner.engine.seqs  # nothing kept after answering


@pytest.mark.timeout(120)
def test_a_lora_model_name_answers_what_peft_merged_answers(served, model_dir, adapter_dir):
    import peft
    import transformers
    live, hf, tok = served
    fresh = transformers.GPT2LMHeadModel.from_pretrained(model_dir)  # peft adapts the module it is given
    merged = peft.PeftModel.from_pretrained(fresh, adapter_dir).merge_and_unload().eval().double()
    assert [m.id for m in live.client.models.list().data] == ["tiny", "tiny-lora"]
    for p in PROMPTS[:4]:
        got = live.client.completions.create(model="tiny-lora", prompt=p, max_tokens=6, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
        assert got == hf_text(merged, tok, tok.encode(p), 6), p
    assert hf_text(merged, tok, tok.encode(p), 6) != hf_text(hf, tok, tok.encode(p), 6)  # the adapter matters


@pytest.mark.timeout(120)
def test_streamed_chunks_concatenate_to_the_whole_answer(served):
    live, _, _ = served
    c = live.client
    for kw in (dict(temperature=0), dict(temperature=0.9, seed=5, top_p=0.9, n=2)):
        whole = c.completions.create(model="tiny", prompt="stream me", max_tokens=12, **kw)
        parts = {}
        for chunk in c.completions.create(model="tiny", prompt="stream me", max_tokens=12, stream=True, **kw):
            for ch in chunk.choices:
                parts[ch.index] = parts.get(ch.index, "") + ch.text
        assert [parts[ch.index] for ch in whole.choices] == [ch.text for ch in whole.choices]
    msgs = [{"role": "user", "content": "hi"}]
    whole = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True) if ch.choices)
    assert text == whole.choices[0].message.content and whole.choices[0].finish_reason == "length"


@pytest.mark.timeout(120)
def test_a_stop_string_ends_the_text_before_it(served):
    live, hf, tok = served
    full = live.client.completions.create(model="tiny", prompt="Hello there", max_tokens=12, temperature=0).choices[0]
    stop = full.text[5:7]
    assert stop.strip() and len(full.text) > 7, f"the greedy text {full.text!r} has nothing visible to stop at"
    cut = live.client.completions.create(model="tiny", prompt="Hello there", max_tokens=12, temperature=0,
                                         stop=[stop]).choices[0]
    assert cut.text == full.text[:full.text.find(stop)] and cut.finish_reason == "stop"


@pytest.mark.timeout(120)
def test_bad_requests_get_their_status_and_the_server_keeps_serving(served):
    import httpx2 as httpx
    live, _, _ = served
    c = live.client
    cases = [
        (dict(model="tiny", prompt="x" * 300, max_tokens=4), openai.BadRequestError, "context"),
        (dict(model="tiny", prompt="x", max_tokens=-3), openai.BadRequestError, "max_tokens must be at least 1"),
        (dict(model="tiny", prompt="x", max_tokens=4, n=99), openai.BadRequestError, "n must be between"),
        (dict(model="tiny", prompt="x", max_tokens=4, extra_body={"top_k": "many"}), openai.BadRequestError,
         "'top_k' must be int"),
        (dict(model="tiny", prompt="x", max_tokens=4, extra_body={"beams": 3}), openai.BadRequestError,
         "unknown field 'beams'"),
        (dict(model="gpt-9", prompt="x", max_tokens=4), openai.NotFoundError, "does not exist"),
    ]
    for kw, error, says in cases:
        with pytest.raises(error, match=says) as e:
            c.completions.create(**kw)
        assert "Traceback" not in str(e.value)
    r = httpx.post(live.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert c.completions.create(model="tiny", prompt="still here", max_tokens=2, temperature=0).choices[0].text


@pytest.mark.timeout(120)
def test_a_full_queue_answers_429_with_retry_after(model_dir):
    import httpx2 as httpx
    model, params = cfx.models.from_pretrained(model_dir)
    import transformers
    runner = EngineThread(Engine(model, params, block_size=8, num_blocks=64, max_seqs=2), max_waiting=0)
    live = Live(app(runner, HFTokenizer(transformers.AutoTokenizer.from_pretrained(model_dir)), model_name="tiny"),
                runner)
    try:
        r = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        live.stop()


@pytest.mark.timeout(120)
def test_a_client_leaving_mid_stream_aborts_its_request(served):
    import httpx2 as httpx
    live, _, _ = served
    engine = live.runner.engine
    body = {"model": "tiny", "prompt": "a long answer", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the first token came
    wait_idle(live.runner, engine)
    assert engine.blocks.held == 0 and engine.stats["decode_tokens"] < 200 * 10


@pytest.mark.timeout(120)
def test_models_health_and_metrics(served):
    import httpx2 as httpx
    live, _, _ = served
    assert [m.id for m in live.client.models.list().data] == ["tiny", "tiny-lora"]
    assert httpx.get(live.url + "/health").json()["status"] == "ok"
    text = httpx.get(live.url + "/metrics").text
    for name in ("cfx_requests_running", "cfx_requests_waiting", "cfx_kv_blocks_free", "cfx_kv_blocks_total",
                 "cfx_prefix_cache_hits_total", "cfx_time_to_first_token_seconds_bucket",
                 "cfx_inter_token_latency_seconds_bucket"):
        assert name in text, name
    total = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("cfx_kv_blocks_total"))
    assert total == live.runner.engine.blocks.num_blocks


@pytest.mark.timeout(240)
def test_a_bounded_load_loses_nothing_and_frees_every_block(served):
    """120 requests at concurrency 16 (the bench's --http runs 500 at 32): every one answered in full."""
    live, _, _ = served
    client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)
    gate = asyncio.Semaphore(16)

    async def one(i):
        async with gate:
            r = await client.completions.create(model="tiny", prompt=f"request {i}", max_tokens=1 + i % 7,
                                                temperature=0.7, seed=i, extra_body={"ignore_eos": True})
            return r.usage.completion_tokens == 1 + i % 7

    async def load():
        async with client:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(120))), timeout=180)
    assert all(asyncio.run(load()))
    wait_idle(live.runner, live.runner.engine)
    assert live.runner.engine.blocks.held == 0 and not live.runner.engine.seqs


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny Llama (grouped-query attention: 4 query heads over 2 kv heads) saved in fp64 with the byte tokenizer."""
    import transformers
    d = tmp_path_factory.mktemp("llama")
    tok = byte_tokenizer(d)
    model = cfx.models.llama("tiny", n_layer=2, vocab_size=len(tok), hidden_size=32, intermediate_size=48, n_head=4,
                             n_kv_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(model.hf_config()).eval().double().save_pretrained(d)
    return d


@pytest.mark.timeout(240)
def test_torchrun_serves_from_rank_0_while_every_rank_steps_and_sigterm_exits_0(llama_dir, tmp_path):
    """``torchrun --nproc-per-node 2 -m cfx.serve --mesh model=2`` on a Llama directory: two processes each holding
    half the heads (one of the two kv heads) and their KV pool; rank 0 serves HTTP and schedules, rank 1 steps with
    it. 16 concurrent completions and 16 chat completions equal transformers' greedy output on the same (fp64)
    directory; SIGTERM to rank 0 finishes what runs, stops rank 1, and the job exits 0."""
    import transformers
    import httpx2 as httpx
    port, log = free_port(), tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                 "-m", "cfx.serve", "--model", str(llama_dir), "--port", str(port), "--kv-bytes",
                                 "8MiB", "--name", "tiny", "--mesh", "model=2"], cwd=ROOT,
                                env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"), stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        banner = next(line for line in log.read_text().splitlines() if "on http://127.0.0.1" in line)
        assert "rank 0 serving, every rank stepping" in banner, banner
        tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
        hf = transformers.LlamaForCausalLM.from_pretrained(llama_dir).eval()
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)

        async def completion(p, n):
            r = await client.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0,
                                                extra_body={"ignore_eos": True}, n=2 if n == 5 else 1)
            return [c.text for c in r.choices]

        async def chat(p, n):
            r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                                     max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
            return [r.choices[0].message.content]

        async def all_of_them():
            async with client:
                jobs = [completion(p, 3 + i % 4) for i, p in enumerate(PROMPTS)]
                return await asyncio.gather(*jobs, *[chat(p, 2 + i % 3) for i, p in enumerate(PROMPTS)])
        got = asyncio.run(all_of_them())
        for i, p in enumerate(PROMPTS):  # (n=2: the samples fork sample 0's blocks, copied on write on each rank)
            want = hf_text(hf, tok, tok.encode(p), 3 + i % 4)
            assert got[i] == [want] * len(got[i]), p
            chat_ids = list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                    tokenize=True)["input_ids"])
            assert got[len(PROMPTS) + i] == [hf_text(hf, tok, chat_ids, 2 + i % 3)], p
        pid = int(banner.rsplit("pid ", 1)[1].rstrip(")"))
        os.kill(pid, signal.SIGTERM)  # rank 0's: it drains, then tells rank 1 to stop
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
