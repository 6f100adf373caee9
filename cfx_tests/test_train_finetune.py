"""``python -m cfx.train --data DIR --tokenizer DIR --init-from HF_DIR --save-hf OUT``: a full fine-tune of a
Hugging Face model on its own tokenizer's ids (documents packed with its end-of-text token between), whose
saved directory transformers loads with the trained weights -- the logits of cfx's trained params. Byte data
over a pretrained tokenizer's vocabulary is refused before anything runs."""
import dataclasses

import pytest
import torch

import cfx
from cfx._src.train.saving import read_params
from cfx.train import TrainConfig, main, train

transformers = pytest.importorskip("transformers")

WORDS = [f"w{i}" for i in range(301)]  # a vocabulary past the job's 256 bytes, 303 with the two specials: odd


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A word-level tokenizer (whitespace words, 301 of them + <unk> + <|endoftext|>) and a tiny random GPT-2 of
    its vocabulary, saved in one directory as a Hugging Face model directory holds them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    d = tmp_path_factory.mktemp("hf")
    vocab = {w: i for i, w in enumerate(["<unk>", "<|endoftext|>", *WORDS])}
    t = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|endoftext|>", unk_token="<unk>")
    tok.save_pretrained(d)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=32, n_layer=2,
                                                         n_head=4)).save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    d = tmp_path_factory.mktemp("docs")
    g = torch.Generator().manual_seed(0)
    for name in ("a.txt", "b.txt"):
        ids = torch.randint(0, 40, (400,), generator=g).tolist()  # a few dozen words, often repeated
        (d / name).write_text(" ".join(WORDS[i] for i in ids))
    return str(d)


def test_documents_are_packed_with_the_end_of_text_token_between(hf_dir, docs):
    from cfx._src.train import data as data_lib
    tok = data_lib.load_tokenizer(hf_dir)
    ids = data_lib.tokenized(docs, tok)
    assert ids.dtype == torch.int64 and len(ids) == 802
    assert ids.tolist().count(tok.eos_token_id) == 2 and ids[400] == ids[801] == tok.eos_token_id


@pytest.mark.timeout(240)
def test_a_full_fine_tune_saves_what_transformers_loads(hf_dir, docs, tmp_path, capsys):
    """Tensor-parallel over model=2, which cannot split 303 ids: --pad-vocab auto pads them to 384 (masked), the
    checkpoint holds the padded model, --save-hf the real 303-id vocabulary."""
    out, ck = tmp_path / "out", str(tmp_path / "ck")
    cfg = TrainConfig(data=docs, tokenizer=hf_dir, init_from=hf_dir, save_hf=str(out), steps=4, batch=4, seq=16,
                      lr=3e-3, warmup=0, eval_every=2, eval_batches=2, progress=False, plot=str(tmp_path / "loss.png"),
                      mesh="model=2", pad_vocab="auto", save=ck)
    with pytest.raises(ValueError, match=r"303 does not split over model=2 .* --pad-vocab auto"):
        train(dataclasses.replace(cfg, pad_vocab=None))
    summary = train(cfg)
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # --plot: the loss curves
    assert summary["eval_loss_last"] < summary["eval_loss_first"]  # it trained from the pretrained weights
    model, start = cfx.models.from_pretrained(hf_dir)
    tokens = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(1)) + 2
    hf_start = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    torch.testing.assert_close(model.apply(start, tokens), hf_start(tokens).logits, rtol=1e-4, atol=1e-4)
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()  # what --save-hf wrote
    assert transformers.AutoTokenizer.from_pretrained(out).eos_token == "<|endoftext|>"
    padded, params = read_params(ck)  # what --save wrote, as python -m cfx.generate reads it
    assert (padded.config.vocab_size, padded.real_vocab_size, hf.config.vocab_size) == (384, 303, 303)
    logits = padded.apply(params, tokens)
    assert (logits[..., 303:] == torch.finfo(logits.dtype).min).all()  # no softmax ever gives them weight
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, logits[..., :303], rtol=1e-4, atol=1e-4)
        assert not torch.allclose(hf(tokens).logits, hf_start(tokens).logits, atol=1e-3)  # the trained weights
    printed = capsys.readouterr().out
    assert f"next: python -m cfx.generate --checkpoint {out}" in printed


def test_byte_data_over_a_pretrained_vocabulary_is_refused(hf_dir, docs, capsys):
    assert main(["--data", docs, "--init-from", hf_dir, "--steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "a pretrained vocabulary of 303 tokens, but --data is read as bytes" in err and f"--tokenizer {hf_dir}" in err
    with pytest.raises(ValueError, match="--save-hf writes a whole model; under --lora, --save-peft"):
        train(TrainConfig(lora="r=2,alpha=4", init_from=hf_dir, tokenizer=hf_dir, save_hf="x", steps=1))
