"""The LoRA bench's figures that hold at any size: the trained bytes equal the textbook count, and an
int8 base with adapters holds and peaks below full fine-tuning (``python -m cfx.bench lora``; README)."""
import cfx
from cfx.bench import lora


def test_trainable_bytes_equal_the_formula_and_int8_lora_holds_less(tmp_path):
    out = lora.run(smoke=True, json_path=str(tmp_path / "lora.json"))
    rows = {r["metric"]: r for r in out["rows"]}
    assert abs(rows["trainable_bytes_vs_formula"]["value"] - 1) < 1e-3
    assert rows["peak_memory_int8_lora_vs_full_ft"]["ok"] and rows["state_bytes_int8_lora_vs_full_ft"]["ok"]


def test_the_formula_counts_r_in_plus_out_per_adapted_weight():
    model = cfx.models.gpt2("tiny", n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    config = cfx.lora.LoraConfig(r=2, targets=("attn",))  # 4 weights of (16, 16)
    assert lora._formula(model, config) == 4 * 3 * 4 * 2 * (16 + 16)
