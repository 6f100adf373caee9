"""Generation, measured: ``cfx.generate`` against ``transformers``' ``generate`` on the same weights.

GPT-2 (``--quick``: 4 layers of width 256; ``--smoke``: one of width 32 on 8 + 4 tokens; otherwise
GPT-2 small), fp32, this process's torch
threads for both sides, greedy, a prompt of 64 tokens + 64 new ones (no early stop), batch 1 and
8. Both sides run in alternating rounds; each figure is the median (``interleaved_medians``), and
the tokens must agree (the row is not reported as ok otherwise).

* ``tokens_per_s_vs_hf_b1`` / ``_b8``: new tokens per second, cfx over HF (target >= 1.0);
* ``kv_cache_bytes_vs_formula``: the cache's buffers over ``2 L B (T + n) Hkv D`` x 4 bytes (1.00);
* ``decode_ops_per_token_vs_hf``: the aten ops one decode step dispatches (batch 8, counted by a
  ``TorchDispatchMode``), cfx over HF: on a GPU each is a kernel launch or a view, so this is the
  CPU's proxy for a GPU's launch overhead (lower is better);
* ``host_syncs_per_token``: the ops per decode step that read a value back to the host
  (``aten._local_scalar_dense``, ``aten.is_nonzero``: on a GPU each one stalls the launch queue);
  0 for cfx without ``eos_id``, HF's beside it;
* ``compiled_tokens_per_s_vs_eager`` (information on a CPU: the CUDA-graph replay that pays on a
  GPU does not exist here), ``compiled_same_tokens`` (1) and ``recompiles_after_warmup`` (10 more
  calls of the same shapes after a warm-up: 0), for ``cfx.generate(..., compile=True)``
  (inductor; ``--smoke`` checks the path with ``aot_eager``);
* ``int8_bytes_ratio``: params bytes after ``cfx.quant.quantize(params, "int8")`` over fp32's (the
  embeddings stay fp32; the Linear weights alone are shown too), and how often greedy int8
  decoding picks the fp32 run's token.
"""
from __future__ import annotations

import collections
import time
from typing import Callable

import torch

import cfx
from cfx.bench.common import Row, interleaved_medians, report, size_of

PROMPT, NEW = 64, 64
COMPILE_BACKEND = "inductor"  # compile=True's backend in the quick and full runs
SIZES = {  # size -> (GPT-2 small's overrides, rounds)
    "smoke": (dict(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32), 1),
    "quick": (dict(n_layer=4, n_embd=256, n_head=4), 2),
    "full": ({}, 5),
}


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    import transformers

    size = size_of(quick=quick, smoke=smoke)
    kw, rounds = SIZES[size]
    prompt_len, new = (8, 4) if size == "smoke" else (PROMPT, NEW)
    model = cfx.models.gpt2("small", **kw)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(model.hf_config()).eval()
    _, params = cfx.models.from_hf(hf, model)
    rows = []
    for B in (1, 8):
        prompt = cfx.random.randint(cfx.random.key(B), (B, prompt_len), 0, model.config.vocab_size)
        ours = cfx.generate(model, params, prompt, max_new_tokens=new)
        with torch.no_grad():
            theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0)
        same = torch.equal(ours, theirs)
        t_cfx, t_hf = interleaved_medians([
            lambda: cfx.generate(model, params, prompt, max_new_tokens=new),
            lambda: _hf_generate(hf, prompt, new)], rounds=rounds)
        ratio = t_hf / t_cfx
        rows.append(Row(f"tokens_per_s_vs_hf_b{B} (prompt {prompt_len} + {new} new, greedy)", ratio, "x", ">= 1.0",
                        ratio >= 1.0 and same))
        rows.append(Row(f"  cfx / HF tokens per second, batch {B}{'' if same else ' (TOKENS DIFFER)'}",
                        B * new / t_cfx, f"tok/s (HF {B * new / t_hf:,.0f})"))
    B, c = 8, model.config
    prompt = cfx.random.randint(cfx.random.key(B), (B, prompt_len), 0, c.vocab_size)
    rows += _dispatch_rows(model, params, hf, prompt, new)
    rows += _compiled_rows(model, params, prompt, new, "aot_eager" if size == "smoke" else COMPILE_BACKEND, rounds)
    cache = cfx.nn.KVCache(B, prompt_len + new, len(model.blocks))
    prompt = cfx.random.randint(cfx.random.key(0), (B, prompt_len), 0, c.vocab_size)
    with torch.no_grad():
        model.apply(params, prompt, positions=torch.arange(prompt_len).expand(B, prompt_len), cache=cache)
    formula = 2 * c.n_layer * B * (prompt_len + new) * c.n_embd * 4  # Hkv * D = C for GPT-2
    rows.append(Row("kv_cache_bytes_vs_formula (2 L B (T+n) Hkv D x 4)", cache.nbytes / formula, "x", "1.00",
                    cache.nbytes == formula))
    q = cfx.quant.quantize(params, "int8", axes=model.axes())
    nbytes = lambda tree: sum(x.numel() * x.element_size() for x in cfx.tree.leaves(tree))  # noqa: E731 (q + scales)
    linear = [x for x in cfx.tree.leaves(q, is_leaf=cfx.quant.is_quantized) if cfx.quant.is_quantized(x)]
    linear_fp32 = sum(x.q.numel() * 4 for x in linear)
    rows.append(Row("int8_bytes_ratio (all params after quantize / fp32; embeddings stay fp32)",
                    nbytes(q) / nbytes(params), "x"))
    rows.append(Row("  int8 Linear weights (q + column scales) / their fp32", nbytes(linear) / linear_fp32, "x"))
    agree = (cfx.generate(model, q, prompt, max_new_tokens=16)[:, prompt_len:] ==
             cfx.generate(model, params, prompt, max_new_tokens=16)[:, prompt_len:]).float().mean()
    rows.append(Row("  int8 greedy tokens equal to fp32's (batch 8, 16 new)", float(agree), "fraction"))
    return report("generate", rows, json_path)


def _hf_generate(hf, prompt, new: int):
    with torch.no_grad():
        hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                    do_sample=False, pad_token_id=0)


HOST_READS = ("aten._local_scalar_dense.default", "aten.is_nonzero.default")


def _per_token(run: Callable[[int], None], new: int) -> collections.Counter:
    """The aten ops one decode step dispatches: a run of ``new`` tokens less a run of one (the
    prefill and the first pick), over ``new - 1`` steps."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for n in (1, new):
        with Count() as c:
            run(n)
        counts.append(c.ops)
    return collections.Counter({k: v / (new - 1) for k, v in (counts[1] - counts[0]).items()})


def _dispatch_rows(model, params, hf, prompt: torch.Tensor, new: int) -> list[Row]:
    ours = _per_token(lambda n: cfx.generate(model, params, prompt, max_new_tokens=n), new)
    theirs = _per_token(lambda n: _hf_generate(hf, prompt, n), new)
    ops, hf_ops = sum(ours.values()), sum(theirs.values())
    syncs, hf_syncs = (sum(c[k] for k in HOST_READS) for c in (ours, theirs))
    return [Row(f"decode_ops_per_token_vs_hf (aten ops per step, batch {prompt.shape[0]})", ops / hf_ops, "x",
                "<= 1.0", ops <= hf_ops),
            Row("  cfx / HF aten ops per decode step", ops, f"ops (HF {hf_ops:.0f})"),
            Row("host_syncs_per_token (reads back to the host per decode step)", syncs, f"reads (HF {hf_syncs:.0f})",
                "0", syncs == 0)]


def _compiled_rows(model, params, prompt: torch.Tensor, new: int, backend: str, rounds: int) -> list[Row]:
    from cfx._src.generate.compiled import compiled_graphs

    eager = cfx.generate(model, params, prompt, max_new_tokens=new)
    t0 = time.perf_counter()
    got = cfx.generate(model, params, prompt, max_new_tokens=new, compile=backend)  # compiles
    first = time.perf_counter() - t0
    warm = compiled_graphs(model)
    t_eager, t_compiled = interleaved_medians([
        lambda: cfx.generate(model, params, prompt, max_new_tokens=new),
        lambda: cfx.generate(model, params, prompt, max_new_tokens=new, compile=backend)], rounds=max(rounds, 2))
    for _ in range(10 - max(rounds, 2)):  # ten calls after the warm-up in all
        cfx.generate(model, params, prompt, max_new_tokens=new, compile=backend)
    recompiles = compiled_graphs(model) - warm
    same = torch.equal(got, eager)
    return [Row(f"compiled_tokens_per_s_vs_eager ({backend}, batch {prompt.shape[0]}; information on a CPU)",
                t_eager / t_compiled, "x"),
            Row("  first compiled call (compiles the prefill and the step)", first, "s"),
            Row("compiled_same_tokens (compile=True vs eager, greedy)", float(same), "", "1", same),
            Row("recompiles_after_warmup (10 calls, same shapes)", recompiles, "graphs", "0", recompiles == 0)]
