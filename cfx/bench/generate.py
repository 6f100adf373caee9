"""Generation, measured: ``cfx.generate`` against ``transformers``' ``generate`` on the same weights.

GPT-2 (``--quick``: 4 layers of width 256; ``--smoke``: one of width 32 on 8 + 4 tokens; otherwise
GPT-2 small), fp32, this process's torch
threads for both sides, greedy, a prompt of 64 tokens + 64 new ones (no early stop), batch 1 and
8. Both sides run in alternating rounds; each figure is the median (``interleaved_medians``), and
the tokens must agree (the row is not reported as ok otherwise).

* ``tokens_per_s_vs_hf_b1`` / ``_b8``: new tokens per second, cfx over HF (target >= 1.0);
* ``kv_cache_bytes_vs_formula``: the cache's buffers over ``2 L B (T + n) Hkv D`` x 4 bytes (1.00);
* ``int8_bytes_ratio``: params bytes after ``cfx.quant.quantize(params, "int8")`` over fp32's (the
  embeddings stay fp32; the Linear weights alone are shown too), and how often greedy int8
  decoding picks the fp32 run's token.
"""
from __future__ import annotations

import torch

import cfx
from cfx.bench.common import Row, interleaved_medians, report, size_of

PROMPT, NEW = 64, 64
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
