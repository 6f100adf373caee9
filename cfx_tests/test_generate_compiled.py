"""cfx.generate(..., compile=True): the same tokens as eager decoding (GPT-2, Llama with GQA, OPT;
left-padded batches, sampling, eos, int8 params, tensor parallelism on the local mesh), and no
graph built after the warm-up for calls whose shapes fall in the same buckets.

Most cases compile with ``aot_eager`` (dynamo's capture and AOT autograd without code generation,
seconds on a CPU); one compiles with inductor, what ``compile=True`` runs."""
from __future__ import annotations

import pytest
import torch

import cfx
from cfx import P
from cfx._src.generate.compiled import bucket, compiled_graphs
from cfx_tests.test_generate import NAMES, V, padded_prompts, tiny


def llama_gqa():
    return cfx.models.llama("tiny", n_layer=2, vocab_size=V, max_position_embeddings=64, n_head=4, n_kv_heads=2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NAMES)
def test_compiled_greedy_equals_eager_and_compiles_once(name):
    model = llama_gqa() if name == "llama" else tiny(name)
    params = model.init(cfx.random.key(0))
    prompt, mask = padded_prompts()
    run = lambda p, m, **kw: cfx.generate(model, params, p, mask=m, max_new_tokens=12, **kw)  # noqa: E731
    assert torch.equal(run(prompt, mask, compile="aot_eager"), run(prompt, mask))
    warm = compiled_graphs(model)
    assert warm == 2  # the prefill of the 16-token bucket and the step
    shorter, short_mask = prompt[:, 3:], mask[:, 3:]  # 7 tokens: the same bucket
    short_mask[:, 0] |= ~short_mask.any(1)  # every row keeps a real token
    assert bucket(7) == bucket(10)
    assert torch.equal(run(shorter, short_mask, compile="aot_eager"), run(shorter, short_mask))
    assert torch.equal(run(prompt, None, compile="aot_eager"), run(prompt, None))
    assert compiled_graphs(model) == warm  # no recompile


@pytest.mark.timeout(300)
def test_compiled_sampling_eos_and_int8_equal_eager():
    model = llama_gqa()
    params = model.init(cfx.random.key(0))
    prompt, mask = padded_prompts()
    kw = dict(mask=mask, max_new_tokens=10, temperature=0.9, top_k=20, top_p=0.9, key=cfx.random.key(3))
    assert torch.equal(cfx.generate(model, params, prompt, compile="aot_eager", **kw),
                       cfx.generate(model, params, prompt, **kw))
    free = cfx.generate(model, params, prompt, mask=mask, max_new_tokens=10)
    eos = int(free[0, 12])
    kw = dict(mask=mask, max_new_tokens=10, eos_id=eos, pad_id=1)
    assert torch.equal(cfx.generate(model, params, prompt, compile="aot_eager", **kw),
                       cfx.generate(model, params, prompt, **kw))
    q = cfx.quant.quantize(params, "int8")
    assert torch.equal(cfx.generate(model, q, prompt, mask=mask, max_new_tokens=10, compile="aot_eager"),
                       cfx.generate(model, q, prompt, mask=mask, max_new_tokens=10))


@pytest.mark.timeout(300)
def test_compiled_tensor_parallel_decoding_equals_one_device():
    model = llama_gqa()
    params = model.init(cfx.random.key(0))
    prompt, mask = padded_prompts()
    want = cfx.generate(model, params, prompt, mask=mask, max_new_tokens=8)
    tp = cfx.parallel.tensor_parallel(model, "model")
    with cfx.Mesh({"model": 2}) as mesh:
        specs = cfx.Rules(cfx.parallel.MEGATRON_RULES).specs(model.axes(), mesh=mesh)
        run = cfx.shard_map(lambda p, x, m: cfx.generate(tp, p, x, mask=m, max_new_tokens=8, compile="aot_eager"),
                            mesh=mesh, in_specs=(specs, P(), P()), out_specs=P())
        assert torch.equal(cfx.device_get(run(params, prompt, mask)), want)  # each rank compiles its own
        warm = compiled_graphs(tp)
        assert torch.equal(cfx.device_get(run(params, prompt, mask)), want)
    assert compiled_graphs(tp) == warm


@pytest.mark.timeout(600)
def test_inductor_compiled_decoding_equals_eager():
    model = tiny("gpt2")
    params = model.init(cfx.random.key(1))
    prompt, mask = padded_prompts()
    want = cfx.generate(model, params, prompt, mask=mask, max_new_tokens=6)
    assert torch.equal(cfx.generate(model, params, prompt, mask=mask, max_new_tokens=6, compile=True), want)
    warm = compiled_graphs(model)
    assert torch.equal(cfx.generate(model, params, prompt, mask=mask, max_new_tokens=6, compile=True), want)
    assert compiled_graphs(model) == warm
