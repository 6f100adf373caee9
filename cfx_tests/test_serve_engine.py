"""``cfx.serve.Engine``: every request of a continuously batched workload decodes exactly what it would
alone. Greedy tokens equal ``cfx.generate`` on the request by itself and transformers' ``generate``, for
hypothesis-drawn workloads (arrival steps, prompt and output lengths, shared prefixes, a pool so small
that sequences are preempted and recomputed, aborts) and for every decoder family; seeded sampled tokens
depend on the seed alone (any batch, any arrival order; equal to ``cfx.generate`` with that key); the
``n`` samples of a prompt share its blocks; the prefix cache skips the shared prefix's prefill; and once
every request is done, every block is free or cached and nobody's.

Everything is fp64: an argmax compared across batch shapes is exact there (in fp32 a near tie could go
either way with the batch's reduction order, which is not what these tests are about)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx.serve import Engine, SamplingParams
from cfx_tests.budget import examples

V = 96


def family(name: str):
    """A tiny decoder of ``name`` and its transformers twin, fp64, from the twin's random init (varied tokens)."""
    import transformers
    if name == "gpt2":
        model = cfx.models.gpt2("tiny", n_layer=2, vocab_size=V, n_positions=128)
    elif name == "llama":  # grouped-query attention: 4 query heads over 2 kv heads
        model = cfx.models.llama("tiny", n_layer=2, vocab_size=V, hidden_size=32, intermediate_size=48, n_head=4,
                                 n_kv_heads=2, max_position_embeddings=128)
    elif name == "opt":
        model = cfx.models.opt("tiny", n_layer=2, vocab_size=V, max_position_embeddings=128)
    else:
        model = cfx.models.mixtral("tiny", n_layer=2, vocab_size=V, hidden_size=32, intermediate_size=48, n_head=4,
                                   n_kv_heads=2, n_experts=4, max_position_embeddings=128)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(model.hf_config()).eval().double()
    if hasattr(hf, "set_experts_implementation"):
        hf.set_experts_implementation("eager")  # transformers' grouped_mm takes no fp64
    _, params = cfx.models.from_hf(hf, model)
    return model, params, hf


@pytest.fixture(scope="module")
def gpt2():
    return family("gpt2")


def alone(model, params, prompt, n: int, key=None, temperature: float = 0.0) -> list[int]:
    """``cfx.generate`` on one request by itself: its ``n`` new tokens."""
    out = cfx.generate(model, params, torch.tensor([prompt]), max_new_tokens=n, temperature=temperature, key=key)
    return out[0, len(prompt):].tolist()


def prompts_with_prefixes(draw_lengths: list[int], shared: int, seed: int) -> list[list[int]]:
    """Prompts of the given lengths; every other one starts with the same ``shared`` tokens."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, V, (shared,), generator=g).tolist()
    out = []
    for i, n in enumerate(draw_lengths):
        own = torch.randint(3, V, (n,), generator=g).tolist()
        out.append((prefix + own) if i % 2 == 0 and shared else own)
    return out


def drive(engine: Engine, arrivals: list[tuple[int, list[int], SamplingParams]], aborts: dict[int, int] = {}
          ) -> dict[str, list[list[int]]]:
    """Add each request at its step, abort ``aborts[request index]`` at its step; run until all are done."""
    ids, step = {}, 0
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    while pending or engine.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, sp) = pending.pop(0)
            ids[i] = engine.add_request(prompt, sp)
        for i, at in aborts.items():
            if at == step and i in ids:
                engine.abort(ids[i])
        engine.step()
        engine.blocks.check([s.table for seqs in engine.seqs.values() for s in seqs])
        step += 1
        assert step < 2000, "the engine made no progress"
    return {i: engine.output(rid) for i, rid in ids.items()}


@pytest.mark.timeout(300)
@examples(ci=4)
@given(lengths=st.lists(st.integers(1, 24), min_size=1, max_size=7), shared=st.sampled_from([0, 8, 13]),
       news=st.lists(st.integers(1, 12), min_size=7, max_size=7), gaps=st.lists(st.integers(0, 3), min_size=7, max_size=7),
       num_blocks=st.sampled_from([12, 40]), budget=st.sampled_from([8, 32]), abort=st.integers(-1, 6),
       seed=st.integers(0, 9))
def test_greedy_tokens_of_every_request_are_its_own_alone(gpt2, lengths, shared, news, gaps, num_blocks, budget,
                                                           abort, seed):
    """A drawn workload: requests arriving over the steps, some sharing a prefix, a pool small enough
    (12 blocks of 4) that sequences are preempted and recomputed, a token budget small enough that
    prompts are prefilled in chunks, maybe one request aborted. Every request that was not aborted
    produces ``cfx.generate``'s tokens on it alone; at the end no block is held."""
    model, params, _ = gpt2
    prompts = prompts_with_prefixes(lengths, shared, seed)
    step, arrivals = 0, []
    for p, n, gap in zip(prompts, news, gaps):
        step += gap
        arrivals.append((step, p, SamplingParams(max_tokens=n, ignore_eos=True)))
    engine = Engine(model, params, block_size=4, num_blocks=num_blocks, max_batch_tokens=budget, max_seqs=4)
    aborts = {abort: arrivals[abort][0] + 1} if 0 <= abort < len(arrivals) else {}
    got = drive(engine, arrivals, aborts)
    for i, (_, p, sp) in enumerate(arrivals):
        if i not in aborts:
            assert got[i] == [alone(model, params, p, sp.max_tokens)], (i, p)
    assert not engine.has_unfinished() and engine.blocks.held == 0
    engine.blocks.check([])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpt2", "llama", "opt", "mixtral"])
def test_every_family_decodes_as_transformers_does(name):
    """Llama with grouped-query attention, OPT's offset positions, Mixtral's experts: a batch of mixed
    lengths under a pool that forces preemption equals transformers' ``generate`` (fp64), request by request."""
    model, params, hf = family(name)
    prompts = prompts_with_prefixes([5, 17, 2, 30, 9, 11], 6, seed=3)
    news = [9, 4, 12, 6, 10, 3]
    engine = Engine(model, params, block_size=4, num_blocks=20, max_batch_tokens=16, max_seqs=4)
    got = engine.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in news])
    assert engine.stats["preemptions"] > 0  # the pool was too small for every request at once
    for p, n, out in zip(prompts, news, got):
        x = torch.tensor([p])  # an explicit mask: generate would otherwise hide any id equal to pad_token_id
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
        assert out == [want[0, len(p):].tolist()], (name, p)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_tensor_parallel_ranks_hold_their_heads_and_decode_what_one_device_does(name):
    """``mesh=`` with a ``model`` axis of 2 (local threads): each rank computes and caches its own heads (a pool of
    half one device's bytes, the same block tables), the logits are gathered, and every request's tokens are
    one device's -- through chunked prefill and preemption."""
    model, params, _ = family(name)
    prompts = prompts_with_prefixes([5, 13, 3, 9], 4, seed=6)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    kw = dict(block_size=4, num_blocks=10, max_batch_tokens=8, max_seqs=3)
    one = Engine(model, params, **kw)
    want = one.generate(prompts, sp)
    with cfx.Mesh({"model": 2}) as mesh:
        engine = Engine(model, params, mesh=mesh, **kw)
        got = engine.generate(prompts, sp)
    assert got == want and engine.stats["preemptions"] > 0
    assert [p.nbytes for p in engine.pools.values()] == [one.pools[0].nbytes // 2] * 2


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_requests_under_different_lora_adapters_share_a_batch(name):
    """Two adapters (different targets, ranks and alphas) and the base model in one batch, the same prompt
    under each too: every request decodes what ``cfx.generate`` decodes alone on ``attach(params, its
    adapters)``; the prefix cache never hands one adapter's blocks to another."""
    model, params, _ = family(name)
    configs = {"a": cfx.lora.LoraConfig(r=4, alpha=8, targets=("attn",)),
               "b": cfx.lora.LoraConfig(r=2, alpha=2, targets=("attn", "mlp"))}
    g = torch.Generator().manual_seed(9)  # B far from 0: each adapter changes the greedy output
    adapters = {k: cfx.tree.map(lambda t: (t + torch.randn(t.shape, generator=g)).double(),
                                cfx.lora.init(model, c, cfx.random.key(i)))
                for i, (k, c) in enumerate(configs.items())}
    engine = Engine(model, params, block_size=4, num_blocks=64, max_batch_tokens=32, max_seqs=6)
    for k in configs:
        engine.add_adapter(k, adapters[k], configs[k])
    shared = prompts_with_prefixes([9], 0, seed=8)[0]
    prompts = prompts_with_prefixes([5, 12, 7], 0, seed=7) + [shared] * 3
    loras = ["a", "b", None, "a", "b", None]
    got = engine.generate(prompts, [SamplingParams(max_tokens=5, ignore_eos=True, lora=k) for k in loras])
    for p, k, out in zip(prompts, loras, got):
        p_k = params if k is None else cfx.lora.attach(params, adapters[k], configs[k])
        assert out == [alone(model, p_k, p, 5)], (k, p)
    assert len({tuple(o[0]) for o in got[3:]}) == 3  # the same prompt, three answers
    with pytest.raises(ValueError, match="no adapter named 'c'"):
        engine.add_request([1, 2], SamplingParams(lora="c"))


@pytest.mark.timeout(120)
def test_int8_params_decode_as_cfx_generate_does(gpt2):
    model, params, _ = gpt2
    q = cfx.quant.quantize(params, "int8", axes=model.axes(), min_size=0)
    prompts = prompts_with_prefixes([7, 3, 12], 0, seed=1)
    got = Engine(model, q, block_size=4, num_blocks=32, max_batch_tokens=8, max_seqs=3).generate(
        prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert got == [[alone(model, q, p, 6)] for p in prompts]


@pytest.mark.timeout(120)
def test_seeded_samples_depend_on_the_seed_alone(gpt2):
    """The same seeded requests in two arrival orders, batched with different others (and preempted and
    recomputed in the second run), give the same tokens, which are ``cfx.generate``'s with
    ``key=cfx.random.key(seed)`` on each alone."""
    model, params, _ = gpt2
    prompts = prompts_with_prefixes([4, 9, 6, 12], 0, seed=2)
    sps = [SamplingParams(max_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=s, ignore_eos=True)
           for s in (11, 12, 13, 14)]
    one = Engine(model, params, block_size=4, num_blocks=40, max_batch_tokens=16, max_seqs=4).generate(prompts, sps)
    order = [3, 1, 0, 2]
    other = Engine(model, params, block_size=4, num_blocks=7, max_batch_tokens=6, max_seqs=3)
    extra = other.add_request(prompts[0], SamplingParams(max_tokens=5, ignore_eos=True))
    two = other.generate([prompts[i] for i in order], [sps[i] for i in order])
    assert [two[order.index(i)] for i in range(4)] == one
    assert other.stats["preemptions"] > 0
    assert other.output(extra)  # the greedy neighbour ran too
    sp = sps[1]
    want = cfx.generate(model, params, torch.tensor([prompts[1]]), max_new_tokens=8, temperature=sp.temperature,
                        top_k=sp.top_k, top_p=sp.top_p, key=cfx.random.key(sp.seed))[0, len(prompts[1]):].tolist()
    assert one[1] == [want]


@pytest.mark.timeout(120)
def test_n_samples_share_their_prompts_blocks_and_each_is_its_own_key(gpt2):
    """``n=3``: one prefill, the prompt's blocks shared (its partial last block copied on write); sample ``j``
    draws with ``fold_in(key(seed), j)``, as ``cfx.generate`` with that key does alone."""
    model, params, _ = gpt2
    prompt = prompts_with_prefixes([10], 0, seed=4)[0]
    engine = Engine(model, params, block_size=4, num_blocks=32, max_batch_tokens=32, max_seqs=4)
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=3, ignore_eos=True)
    rid = engine.add_request(prompt, sp)
    engine.step()  # the prefill: sample 0 computes the prompt, the others fork from it
    tables = [s.table for s in engine.seqs[rid]]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # the two full blocks of the 10 tokens, shared
    assert engine.blocks.refs[tables[0][0]] == 3
    while engine.has_unfinished():
        engine.step()
    assert engine.stats["prefill_tokens"] == len(prompt)
    key = cfx.random.key(7)
    for j, out in enumerate(engine.output(rid)):
        assert out == alone(model, params, prompt, 6, key=cfx.random.fold_in(key, j), temperature=1.0)
    engine.blocks.check([])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("together", [False, True])
def test_the_prefix_cache_computes_a_shared_prefix_once(gpt2, together):
    """Eight requests sharing a 32-token prefix, one after the other or all at once: the prefix is
    prefilled once -- the later requests find its full blocks in the cache, and those arriving with the
    first wait a step for them rather than computing them too -- and each decodes what it would alone."""
    model, params, _ = gpt2
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, V, (32,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, V, (3,), generator=g).tolist() for _ in range(8)]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    counts = {}
    for caching in (True, False):
        engine = Engine(model, params, block_size=4, num_blocks=64, max_batch_tokens=64, max_seqs=4,
                        prefix_caching=caching)
        outs = engine.generate(prompts, sp) if together else [engine.generate([p], sp)[0] for p in prompts]
        counts[caching] = engine.stats["prefill_tokens"]
        assert outs == [[alone(model, params, p, 4)] for p in prompts]
    assert counts[False] == 8 * 35 and counts[True] == 35 + 7 * 3


def test_what_the_engine_refuses(gpt2):
    model, params, _ = gpt2
    engine = Engine(model, params, block_size=4, num_blocks=8, max_batch_tokens=8, max_seqs=2)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.add_request([1, V + 5])
    with pytest.raises(ValueError, match="exceed the model's context of 128"):
        engine.add_request([1] * 100, SamplingParams(max_tokens=40))
    with pytest.raises(ValueError, match="the prompt's 130 tokens leave no room in the model's context of 128; "
                                         "shorten it to at most 127"):
        engine.add_request([1] * 130)
    with pytest.raises(ValueError, match="needs a seed"):
        engine.add_request([1, 2], SamplingParams(temperature=0.5))
    with pytest.raises(ValueError, match="more than the pool's 8 blocks"):
        engine.add_request([1] * 30, SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="max_batch_tokens=2 < max_seqs=4"):
        Engine(model, params, max_batch_tokens=2, max_seqs=4)
    with pytest.raises(ValueError, match="not a decoder language model"):
        Engine(cfx.models.bert("tiny"), params)
