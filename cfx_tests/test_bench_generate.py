"""``python -m cfx.bench generate``: the KV cache holds exactly its formula's bytes; int8 shrinks the
Linear weights; cfx and HF decode the same tokens (speed is reported by the bench, not asserted)."""
import pytest
import torch

import cfx
from cfx.bench import generate as bench


@pytest.mark.timeout(120)
def test_kv_cache_bytes_are_the_formula_for_grouped_query_attention():
    model = cfx.models.llama("tiny", n_layer=2, vocab_size=64, n_kv_heads=2, max_position_embeddings=64)
    params = model.init(cfx.random.key(0))
    cache = cfx.nn.KVCache(3, 40, len(model.blocks))
    with torch.no_grad():
        model.apply(params, torch.zeros(3, 5, dtype=torch.long), positions=torch.arange(5).expand(3, 5), cache=cache)
    c = model.config
    assert cache.nbytes == 2 * c.n_layer * 3 * 40 * 2 * (c.hidden_size // c.n_head) * 4


@pytest.mark.timeout(300)
def test_quick_rows(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "NEW", 8)  # the rows' mechanics, on fewer tokens
    # inductor's compile of cfx.generate is test_generate_compiled's (a cold C++ compile costs ~15 s); here
    # the compiled rows' mechanics (same tokens, no recompiles) on the graph-capturing backend
    monkeypatch.setattr(bench, "COMPILE_BACKEND", "aot_eager")
    out = bench.run(quick=True, json_path=str(tmp_path / "g.json"))["rows"]
    rows = {r["metric"].split(" ")[0]: r for r in out}
    assert rows["kv_cache_bytes_vs_formula"]["ok"]
    assert not any("TOKENS DIFFER" in r["metric"] for r in out)  # cfx and HF decoded the same tokens
    assert rows["int8_bytes_ratio"]["value"] < 1.0
