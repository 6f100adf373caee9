"""cfx.generate: greedy decoding equals transformers' generate token for token (GPT-2, Llama, OPT,
left-padded batches); the KV cache's logits equal a full forward's; tensor-parallel decoding equals
one device; sampling is reproducible from its key; int8 params decode; bad input is refused; decode
steps read nothing back to the host."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx import P
from cfx_tests.budget import examples
from cfx._src.core.text import printable
from cfx._src.generate.decode import EOS_POLL
from torch.utils._python_dispatch import TorchDispatchMode

V = 96


def tiny(name, **kw):
    if name == "gpt2":
        return cfx.models.gpt2("tiny", n_layer=2, vocab_size=V, n_positions=64, **kw)
    if name == "llama":
        return cfx.models.llama("tiny", n_layer=2, vocab_size=V, max_position_embeddings=64, **kw)
    return cfx.models.opt("tiny", n_layer=2, vocab_size=V, max_position_embeddings=64, **kw)


NAMES = ["gpt2", "llama", "opt"]


def padded_prompts(B=3, T=10, seed=1):
    prompt = cfx.random.randint(cfx.random.key(seed), (B, T), 3, V)
    mask = torch.ones(B, T, dtype=torch.bool)
    for b in range(1, B):  # rows of different lengths, left-padded
        mask[b, :(3 * b) % T] = False
    return prompt.masked_fill(~mask, 0), mask


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_transformers_generate_on_a_left_padded_batch(name):
    import transformers
    model = tiny(name)
    torch.manual_seed(0)
    # fp64 on both sides: an argmax is exact there, in fp32 a near tie could go either way by the CPU's kernels
    hf = transformers.AutoModelForCausalLM.from_config(model.hf_config()).eval().double()
    _, params = cfx.models.from_hf(hf, model)
    prompt, mask = padded_prompts()
    got = cfx.generate(model, params, prompt, mask=mask, max_new_tokens=16)
    want = hf.generate(prompt, attention_mask=mask.long(), max_new_tokens=16, do_sample=False, pad_token_id=0,
                       eos_token_id=None)
    assert torch.equal(got, want), (got[:, 10:], want[:, 10:])


@pytest.mark.timeout(120)
@examples(ci=5)
@given(name=st.sampled_from(NAMES), T=st.integers(1, 12), steps=st.integers(1, 6), seed=st.integers(0, 99),
       static=st.booleans(), spare=st.integers(0, 5))
def test_cached_decoding_gives_the_full_forward_logits(name, T, steps, seed, static, spare):
    model = tiny(name)
    params = model.init(cfx.random.key(seed))
    tokens = cfx.random.randint(cfx.random.key(seed + 1), (2, T + steps), 0, V)
    full = model.apply(params, tokens)  # (2, T + steps, V)
    # a static cache reads every slot, the unwritten ``spare`` ones masked
    cache = cfx.nn.KVCache(2, T + steps + static * spare, len(model.blocks), static=static)
    with torch.no_grad():
        got = [model.apply(params, tokens[:, :T], positions=torch.arange(T).expand(2, T), cache=cache)]
        for t in range(T, T + steps):
            got.append(model.apply(params, tokens[:, t:t + 1], positions=torch.full((2, 1), t), cache=cache))
    assert cache.length == T + steps
    torch.testing.assert_close(torch.cat(got, 1), full.detach())


class HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value back to the host (a stall per op on a GPU)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += str(func) in ("aten._local_scalar_dense.default", "aten.is_nonzero.default")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", NAMES)
def test_decode_steps_read_nothing_back_to_the_host(name):
    model = tiny(name)
    params = model.init(cfx.random.key(0))
    prompt, mask = padded_prompts()
    reads = []
    for n in (1, 9):
        with HostReads() as h:
            cfx.generate(model, params, prompt, mask=mask, max_new_tokens=n)
        reads.append(h.n)
    assert reads[1] == reads[0]  # the eight steps after the first add no read: only the prefill's checks
    with HostReads() as h:
        cfx.generate(model, params, prompt, mask=mask, max_new_tokens=17, eos_id=V + 5)  # never emitted
    assert h.n - reads[0] == 16 // EOS_POLL  # a look every EOS_POLL steps (the 17th is the last: no look)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_tensor_parallel_decoding_equals_one_device(name):
    model = tiny(name)
    params = model.init(cfx.random.key(0))
    prompt, mask = padded_prompts()
    want = cfx.generate(model, params, prompt, mask=mask, max_new_tokens=8)
    tp = cfx.parallel.tensor_parallel(model, "model")
    with cfx.Mesh({"model": 2}) as mesh:
        specs = cfx.Rules(cfx.parallel.MEGATRON_RULES).specs(model.axes(), mesh=mesh)
        got = cfx.shard_map(lambda p, x, m: cfx.generate(tp, p, x, mask=m, max_new_tokens=8), mesh=mesh,
                            in_specs=(specs, P(), P()), out_specs=P())(params, prompt, mask)
    assert torch.equal(cfx.device_get(got), want)


def test_sampling_is_reproducible_and_its_cuts_reduce_to_greedy():
    model = tiny("gpt2")
    params = model.init(cfx.random.key(0))
    prompt, mask = padded_prompts()
    greedy = cfx.generate(model, params, prompt, mask=mask, max_new_tokens=8)
    sample = lambda **kw: cfx.generate(model, params, prompt, mask=mask, max_new_tokens=8,  # noqa: E731
                                       temperature=1.0, key=cfx.random.key(5), **kw)
    assert torch.equal(sample(), sample())
    assert not torch.equal(sample(), cfx.generate(model, params, prompt, mask=mask, max_new_tokens=8,
                                                  temperature=1.0, key=cfx.random.key(6)))
    assert torch.equal(sample(top_k=1), greedy)
    assert torch.equal(sample(top_p=1e-6), greedy)


def test_rows_that_emit_eos_are_padded_and_generation_stops_early():
    model = tiny("gpt2")
    params = model.init(cfx.random.key(0))
    prompt, mask = padded_prompts()
    free = cfx.generate(model, params, prompt, mask=mask, max_new_tokens=8)
    eos = int(free[0, 10 + 2])  # the first row's third new token
    out = cfx.generate(model, params, prompt, mask=mask, max_new_tokens=8, eos_id=eos, pad_id=1)
    first = out[0, 10:]
    hit = int((first == eos).nonzero()[0])
    assert hit <= 2 and (first[hit + 1:] == 1).all()
    stops = []
    for row in range(3):  # each row: its free run up to and including its first eos
        new, ref = out[row, 10:], free[row, 10:]
        stop = int((ref == eos).nonzero()[0]) + 1 if (ref == eos).any() else len(ref)
        assert torch.equal(new[:stop], ref[:stop][:len(new)])
        stops.append(stop)
    assert out.shape[1] == 10 + max(stops)  # it ends with the step where the last row finished


def test_int8_params_decode():
    model = cfx.models.gpt2("tiny", n_layer=2, vocab_size=V, n_positions=64, n_embd=128)
    params = model.init(cfx.random.key(0))
    q = cfx.quant.quantize(params, "int8")
    assert any(cfx.quant.is_quantized(x) for x in cfx.tree.leaves(q, is_leaf=cfx.quant.is_quantized))
    prompt, mask = padded_prompts()
    got = cfx.generate(model, q, prompt, mask=mask, max_new_tokens=8)
    want = cfx.generate(model, params, prompt, mask=mask, max_new_tokens=8)
    assert got.shape == want.shape and torch.equal(got[:, :10], prompt)
    assert (got[:, 10] == want[:, 10]).float().mean() >= 2 / 3  # the first new token mostly agrees


def test_bad_input_is_refused():
    model = tiny("gpt2")
    params = model.init(cfx.random.key(0))
    prompt, mask = padded_prompts()
    with pytest.raises(ValueError, match="10 prompt \\+ 60 new tokens exceed the model's n_positions=64"):
        cfx.generate(model, params, prompt, max_new_tokens=60)
    with pytest.raises(ValueError, match="the prompt's 64 tokens leave no room in the model's n_positions=64; "
                                         "shorten it to at most 63 tokens"):  # (not "at most 0 / -N tokens")
        cfx.generate(model, params, torch.zeros(1, 64, dtype=torch.long), max_new_tokens=1)
    with pytest.raises(ValueError, match="needs key=cfx.random.key"):
        cfx.generate(model, params, prompt, max_new_tokens=2, temperature=0.7)
    with pytest.raises(ValueError, match="a prompt row has no real token"):
        cfx.generate(model, params, prompt, mask=torch.zeros_like(mask), max_new_tokens=2)
    with pytest.raises(ValueError, match="integer \\(B, T\\) tensor"):
        cfx.generate(model, params, prompt.float(), max_new_tokens=2)
    with pytest.raises(ValueError, match="KVCache of 1 layers for 2 blocks"):
        model.apply(params, prompt, cache=cfx.nn.KVCache(3, 20, 1))


@pytest.mark.timeout(300)
def test_cli_streams_what_the_function_generates(tmp_path, capsys):
    import subprocess
    import sys
    from cfx.generate import main
    from cfx.train import TrainConfig, train
    model = cfx.models.gpt2("tiny", n_layer=2, vocab_size=256, n_positions=64)
    params = model.init(cfx.random.key(0))
    cfx.models.save_pretrained(tmp_path / "hf", model, params)
    want = cfx.generate(model, params, torch.tensor([list(b"def ")]), max_new_tokens=6)[0, 4:].tolist()
    assert main(["--checkpoint", str(tmp_path / "hf"), "--prompt", "def ", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    # streamed as UTF-8 (an invalid byte as U+FFFD), control characters shown as U+FFFD too
    assert out == printable(bytes(want).decode("utf-8", errors="replace")) + "\n"
    assert main(["--checkpoint", str(tmp_path / "hf"), "--prompt", "def ", "--max-new-tokens", "6",
                 "--mesh", "model=2"]) == 0
    assert capsys.readouterr().out == out  # tensor-parallel: the same text
    assert main(["--checkpoint", str(tmp_path / "hf"), "--prompt", "def ", "--max-new-tokens", "6",
                 "--mesh", "model=2", "--int8", "--temperature", "0.8", "--top-k", "20"]) == 0
    capsys.readouterr()
    # a python -m cfx.train checkpoint, through the real command line
    text = tmp_path / "corpus.txt"
    text.write_text("def main():\n    return 0\n" * 50)
    train(TrainConfig(steps=2, batch=2, seq=16, data=str(text), eval_every=0, eval_batches=1, progress=False,
                      sample_bytes=0, save=str(tmp_path / "run.safetensors")))
    proc = subprocess.run([sys.executable, "-m", "cfx.generate", "--checkpoint", str(tmp_path / "run.safetensors"),
                           "--prompt", "def", "--max-new-tokens", "4"], capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "RuntimeWarning" not in proc.stderr
    assert main(["--checkpoint", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "no such file or directory" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_cli_reads_a_sharded_train_directory_of_any_plan(tmp_path, capsys):
    from cfx.generate import main
    from cfx.train import TrainConfig, train
    text = tmp_path / "corpus.txt"
    text.write_text("def main():\n    return 0\n" * 50)
    run = train(TrainConfig(steps=2, batch=4, seq=16, data=str(text), eval_every=0, eval_batches=1, progress=False,
                            sample_bytes=0, mesh="pipe=2,data=2", zero=3, microbatches=2, save=str(tmp_path / "run")))
    capsys.readouterr()
    from cfx._src.train.model import build_model
    model = build_model(TrainConfig(seq=16))  # the CLI's default model, as trained
    want = cfx.generate(model, run["params"], torch.tensor([list(b"def ")]), max_new_tokens=5)[0, 4:].tolist()
    assert main(["--checkpoint", str(tmp_path / "run"), "--prompt", "def ", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out == bytes(want).decode("utf-8", errors="ignore") + "\n"
