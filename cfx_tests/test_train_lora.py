"""``python -m cfx.train --lora``: LoRA adapters fine-tuned over a frozen base (``--init-from`` a Hugging Face
directory here, stored int8 with ``--lora-base int8``). The command's losses and adapters equal a hand-written
one-device loop over ``cfx.lora`` and ``cfx.optim`` bitwise; its checkpoint holds the adapters and their AdamW
state (and says so), reads back as the pretrained base with the adapters merged, and resumes bitwise; a run
saved on ``--mesh model=2`` resumes on one device within the rounding of the split sums (``TOL``, as in
``test_train_resume``); flags that do not apply are refused before anything runs."""
from __future__ import annotations

import json

import pytest
import torch

import cfx
from cfx._src.checkpoint.file import open_stored
from cfx._src.train.data import run_keys, sample_batch, text_file as read_text, train_val_split
from cfx._src.train.saving import read_params
from cfx.train import TrainConfig, main, train

from cfx_tests.test_train_resume import TOL, corpus  # noqa: F401 (corpus: a fixture)

# read_params merges the adapters into fp32 weights (each rounded by up to 2**-24 relative), peft adds them in
# fp64: measured 4.8e-8 on the logits over threads 1/2/4 and both xdist layouts; x10
MERGED_FP32 = dict(rtol=0, atol=5e-7)

LORA = "r=4,alpha=8,targets=attn"
STEPS = 4


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A small byte-level GPT-2 written as a Hugging Face directory (its Linears big enough for int8)."""
    model = cfx.models.gpt2("tiny", n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    cfx.models.save_pretrained(path, model, model.init(cfx.random.key(7)))
    return str(path)


def config(corpus, pretrained, **kw):
    return TrainConfig(**{**dict(steps=STEPS, batch=2, seq=16, eval_every=0, eval_batches=1, sample_bytes=0,
                                 progress=False, data=corpus, lora=LORA, lora_base="int8", init_from=pretrained),
                          **kw})


def hand_written(corpus, pretrained):
    """``(losses, adapters, frozen base)`` of the loop ``--lora`` stands for, written with cfx.lora and cfx.optim."""
    cfg = config(corpus, pretrained)
    model, params = cfx.models.from_pretrained(pretrained)
    base = cfx.quant.quantize(params, "int8", axes=model.axes())
    lora = cfx.lora.LoraConfig(r=4, alpha=8, targets=("attn",))
    keys = run_keys(cfg.seed)
    adapters = cfx.lora.init(model, lora, keys.init)
    schedule = cfx.optim.warmup_cosine_decay_schedule(init_value=0.0, peak_value=cfg.lr,
                                                      warmup_steps=min(cfg.warmup, STEPS), decay_steps=STEPS,
                                                      end_value=cfg.lr * cfg.min_lr_ratio)
    tx = cfx.optim.chain(cfx.optim.clip_by_global_norm(cfg.grad_clip),
                         cfx.optim.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay,
                                         mask=lambda p: cfx.tree.map(lambda x: x.dim() == 2, p)))
    state = tx.init(adapters)
    train_data, _ = train_val_split(read_text(corpus))
    losses = []
    for step in range(STEPS):
        x, y = sample_batch(train_data, cfx.random.fold_in(keys.data, step), cfg.batch, cfg.seq)
        loss, grads = cfx.value_and_grad(lambda ad: model.loss(cfx.lora.attach(base, ad, lora), x, y))(adapters)
        adapters, state = cfx.optim.apply_gradients(tx, grads, state, adapters)
        losses.append(float(loss))
    return losses, adapters, base, lora


def test_the_command_trains_adapters_as_the_hand_written_loop(tmp_path, corpus, pretrained):
    ckpt, summary = tmp_path / "lora.safetensors", tmp_path / "summary.json"
    assert main(["--lora", LORA, "--lora-base", "int8", "--init-from", pretrained, "--steps", str(STEPS),
                 "--batch", "2", "--seq", "16", "--eval-every", "0", "--eval-batches", "1", "--sample-bytes", "0",
                 "--no-progress", "--data", corpus, "--save", str(ckpt), "--json", str(summary)]) == 0
    losses, adapters, base, lora = hand_written(corpus, pretrained)
    assert [loss for _, loss in json.loads(summary.read_text())["history"]["train"]] == losses  # bitwise
    with open_stored(str(ckpt)) as stored:  # the adapters and their AdamW state, nothing else
        meta, leaves = stored.metadata, stored.leaves
    assert meta["lora"]["adapters"] == LORA and meta["lora"]["stored"] == "int8"
    assert {p.split(".")[0] for p in leaves} == {"params", "opt_state"}
    assert all(p.endswith((".A", ".B")) for p in leaves if p.startswith("params."))
    model, merged = read_params(str(ckpt))  # the pretrained base, untouched, with the trained adapters merged
    want = cfx.lora.merge(cfx.quant.dequantize(base), adapters, lora)
    assert all(torch.equal(a, b) for a, b in zip(cfx.tree.leaves(merged), cfx.tree.leaves(want)))


@pytest.fixture(scope="module")
def full(corpus, pretrained):
    return train(config(corpus, pretrained))


def test_a_lora_run_resumes_bitwise_and_only_as_lora(tmp_path, corpus, pretrained, full):
    train(config(corpus, pretrained, stop_after=2, save=str(tmp_path / "half.safetensors")))
    resumed = train(config(corpus, pretrained, resume=str(tmp_path / "half.safetensors")))
    assert resumed["history"]["train"] == full["history"]["train"][2:]
    assert all(torch.equal(a, b) for a, b in zip(cfx.tree.leaves(resumed["params"]), cfx.tree.leaves(full["params"])))
    with pytest.raises(ValueError, match="saved with --lora r=4"):
        train(config(corpus, pretrained, lora=None, lora_base=None, init_from=None,
                     resume=str(tmp_path / "half.safetensors")))


@pytest.mark.timeout(240)
def test_a_tensor_parallel_run_resumes_on_one_device(tmp_path, corpus, pretrained, full):
    half = train(config(corpus, pretrained, mesh="model=2", stop_after=2, save=str(tmp_path / "tp")))
    resumed = train(config(corpus, pretrained, resume=str(tmp_path / "tp")))
    losses = [loss for _, loss in half["history"]["train"] + resumed["history"]["train"]]
    torch.testing.assert_close(losses, [loss for _, loss in full["history"]["train"]], **TOL)
    cfx.tree.assert_close(resumed["params"], full["params"], **TOL)


@pytest.mark.parametrize("flags, match", [
    (dict(lora=None, init_from=None), "--lora-base sets up the frozen base of --lora"),  # (--init-from alone: a full fine-tune)
    (dict(lora="r=0"), "--lora 'r=0': r must be a positive int"),
    (dict(lora_base="bf16"), "--lora-base bf16: the frozen base computes beside the adapters"),
    (dict(model="llama"), "--init-from gives the model"),
    (dict(lora=LORA + ",dropout=0.1"), "adapter dropout is not wired"),
    (dict(remat="auto"), "--remat auto"),
    (dict(lora=None, lora_base=None, init_from=None, save_peft="out"), "--save-peft writes the adapters of --lora"),
    (dict(save_peft="out"), r"'blocks\.0\.attn\.k' has no module in peft's layout.*shared_a=q\+k\+v"),
])
def test_flags_that_do_not_apply_are_refused(flags, match, corpus, pretrained):
    with pytest.raises(ValueError, match=match):
        train(config(corpus, pretrained, **flags))


def test_an_init_from_that_is_no_model_is_refused(tmp_path, corpus):
    with pytest.raises(ValueError, match="neither a Hugging Face model directory"):
        train(config(corpus, str(tmp_path)))


def test_under_zero3_the_frozen_base_is_sharded_and_the_run_is_one_devices(tmp_path, corpus, pretrained, full):
    """``--mesh data=2 --zero 3``: each rank keeps half of the int8 base (``plan.frozen``),
    and the losses and adapters are one device's within the rounding of the split batch."""
    from cfx._src.plan.frozen import ShardedTree
    from cfx._src.train import loop
    made = []
    real = loop.program_of

    def spy(cfg, plan, model, mesh):
        made.append(model)
        return real(cfg, plan, model, mesh)
    loop.program_of = spy
    try:
        got = train(config(corpus, pretrained, mesh="data=2", zero=3))
    finally:
        loop.program_of = real
    assert isinstance(made[0].base, ShardedTree)
    whole = _whole_base_bytes(pretrained)
    assert 0.5 * whole <= made[0].base_bytes(0) <= 0.51 * whole  # half of it, up to ZeRO's padding
    torch.testing.assert_close([loss for _, loss in got["history"]["train"]],
                               [loss for _, loss in full["history"]["train"]], **TOL)
    cfx.tree.assert_close(got["params"], full["params"], **TOL)


def _whole_base_bytes(pretrained) -> int:
    model, params = cfx.models.from_pretrained(pretrained)
    base = cfx.quant.quantize(params, "int8", axes=model.axes())
    return sum(x.numel() * x.element_size() for x in cfx.tree.leaves(base))


def _hf_dir(tmp_path, family: str) -> str:
    """A tiny randomly initialised Hugging Face model of ``family`` (vocabulary 256: the job's bytes), saved."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32,
                                                                  n_layer=2, n_head=4))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False))
    hf.save_pretrained(tmp_path / family)
    return str(tmp_path / family)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family, lora, mesh", [
    ("gpt2", "r=4,alpha=8,targets=attn+mlp,shared_a=q+k+v", []),  # HF GPT-2's c_attn: q, k, v with one A
    ("llama", "r=4,alpha=8,targets=attn+mlp", ["--mesh", "data=2", "--zero", "3"]),  # the adapters gathered
])
def test_save_peft_writes_what_peft_loads_as_the_merged_model(tmp_path, corpus, family, lora, mesh):
    """``--save-peft DIR``: peft loads the trained adapters onto the transformers model of ``--init-from``
    with the logits of cfx's merged model (the run's own checkpoint read back, adapters merged)."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    hf_dir, out, ckpt = _hf_dir(tmp_path, family), tmp_path / "adapter", tmp_path / "ckpt"
    assert main(["--lora", lora, "--init-from", hf_dir, "--steps", "2", "--lr", "0.05", "--warmup", "0",
                 "--batch", "2", "--seq", "16", "--eval-every", "0", "--eval-batches", "1", "--sample-bytes", "0",
                 "--no-progress", "--data", corpus, "--save", str(ckpt), "--save-peft", str(out), *mesh]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    model, merged = read_params(str(ckpt))
    tok = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    pm = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(hf_dir), str(out)).eval()
    pm.double()  # compared in fp64: the same function, which fp32 settles only up to each CPU's kernels
    with torch.no_grad():
        got = pm(input_ids=tok).logits
        with pm.disable_adapter():
            plain = pm(input_ids=tok).logits
    assert (got - plain).abs().max() > 1e-3  # the trained adapters were applied
    torch.testing.assert_close(got, model.apply(cfx.tree.map(lambda x: x.double(), merged), tok), **MERGED_FP32)


@pytest.mark.timeout(240)
def test_under_pipe_zero3_and_nvme_offload_the_run_is_one_devices_and_samples(corpus, pretrained, full):
    """``--mesh pipe=2,data=2 --zero 3 --offload nvme``: each stage keeps its own blocks' base, sharded over
    data, in files (``place_base``); the losses and adapters are one device's within the rounding of the
    split batch, and the closing sample runs the whole model on every rank."""
    got = train(config(corpus, pretrained, mesh="pipe=2,data=2", zero=3, offload="nvme", microbatches=1,
                       sample_bytes=4))
    torch.testing.assert_close([loss for _, loss in got["history"]["train"]],
                               [loss for _, loss in full["history"]["train"]], **TOL)
    cfx.tree.assert_close(got["params"], full["params"], **TOL)
    assert len(got["sample"].encode("utf-8", errors="replace")) >= 4
