"""The HTTP bench's tokenizer: a byte-level BPE of any vocabulary size >= 257 whose every id decodes and whose
pairs merge, loaded back by transformers as both servers load it."""
import pytest


@pytest.mark.timeout(60)
def test_pair_tokenizer_has_every_id_and_round_trips(tmp_path):
    import transformers

    from cfx.bench.serve_http import _text, pair_tokenizer
    pair_tokenizer(tmp_path, 320)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 320 and tok.eos_token_id == 319
    text = _text(list(range(40)))
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text)  # (some pairs merged, nothing lost)
    assert all(isinstance(tok.decode([i]), str) and tok.decode([i]) for i in range(319))
