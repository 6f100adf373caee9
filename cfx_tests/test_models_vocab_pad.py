"""``cfx.models.pad_vocab``: a vocabulary padded to split over a model axis, the padded ids masked -- the loss,
its gradients and greedy tokens are the unpadded model's (fp64, every language family), a Plan over ``model=2``
trains the padded model as one device trains the unpadded one, and Hugging Face export strips the padding."""
import pytest
import torch

import cfx
from cfx.models import pad_vocab, unpad_vocab
from cfx.parallel import Plan

V, T = 101, 12  # 101: prime, so no model axis splits it

FAMILIES = {
    "gpt2": lambda: cfx.models.gpt2("tiny", vocab_size=V, n_layer=1, n_embd=32, n_head=4, n_positions=16),
    "llama": lambda: cfx.models.llama("tiny", vocab_size=V, n_layer=1, hidden_size=32, n_head=4, n_kv_heads=2,
                                      intermediate_size=48, max_position_embeddings=16),
    "mixtral": lambda: cfx.models.mixtral("tiny", vocab_size=V, n_layer=1),
    "opt": lambda: cfx.models.opt("tiny", vocab_size=V, n_layer=1),
    "bert": lambda: cfx.models.bert("tiny", vocab_size=V, n_layer=1, head="mlm"),
}


def batch(seed=0, n=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n, T), generator=g), torch.randint(0, V, (n, T), generator=g)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_padded_model_computes_what_the_unpadded_one_does(name):
    model = FAMILIES[name]()
    params = cfx.tree.map(lambda x: x.double(), model.init(cfx.random.key(0)))
    padded, pparams = pad_vocab(model, params, multiple=64)
    assert (padded.config.vocab_size, padded.real_vocab_size, model.real_vocab_size) == (128, V, V)
    tokens, targets = batch()
    loss, grads = cfx.value_and_grad(model.loss)(params, tokens, targets)
    ploss, pgrads = cfx.value_and_grad(padded.loss)(pparams, tokens, targets)
    torch.testing.assert_close(ploss, loss, rtol=1e-13, atol=0)
    back, bgrads = unpad_vocab(padded, pgrads)
    assert back == model
    cfx.tree.assert_close(bgrads, grads, rtol=1e-12, atol=1e-15)
    table = pgrads["wte" if "wte" in pgrads else "embed"]["w"]
    assert (table[V:] == 0).all()  # the padding never trains
    logits = padded.apply(pparams, tokens)
    assert (logits[..., V:] == torch.finfo(torch.float64).min).all()
    torch.testing.assert_close(logits[..., :V], model.apply(params, tokens), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_greedy_tokens_are_the_unpadded_models_and_samples_never_padding(name):
    model = FAMILIES[name]()
    params = model.init(cfx.random.key(1))
    padded, pparams = pad_vocab(model, params, multiple=128)
    # the padding's rows made to attract every head: were they unmasked, every token would be one of them
    pparams["wte" if "wte" in pparams else "embed"]["w"][V:] = 50.0
    if "lm_head" in pparams:
        pparams["lm_head"]["w"][:, V:] = 50.0
    prompt = batch(2)[0][:, :4]
    want = cfx.generate(model, params, prompt, max_new_tokens=6)
    torch.testing.assert_close(cfx.generate(padded, pparams, prompt, max_new_tokens=6), want)
    sampled = cfx.generate(padded, pparams, prompt, max_new_tokens=8, temperature=5.0, key=cfx.random.key(3))
    assert int(sampled.max()) < V


@pytest.mark.timeout(240)
def test_a_plan_over_model_2_trains_the_padded_vocabulary_as_one_device_trains_the_real_one():
    model, tx = FAMILIES["gpt2"](), cfx.optim.sgd(0.5)  # (Adam would blow rounding up: k.b's gradient is 0)
    batches = [batch(s, n=4) for s in range(3)]
    plan = Plan.parse("model=2")
    with pytest.raises(ValueError, match=r"vocabulary of 101 does not split over model=2 .*pad_vocab\(model, "
                                         r"params, multiple=128\)"):
        plan.check(model)
    params = model.init(cfx.random.key(0))
    one = Plan().step(model, tx)
    state, want = one.init_from(params), []
    for b in batches:
        state, metrics = one(state, b)
        want.append(float(metrics["loss"]))
    padded, pparams = pad_vocab(model, params, multiple=2)
    with plan.make_mesh() as mesh:
        step = plan.step(padded, tx, mesh=mesh)
        pstate, got = step.init_from(pparams), []
        for b in batches:
            pstate, metrics = step(pstate, b)
            got.append(float(metrics["loss"]))
        trained = step.params(pstate)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    _, real = unpad_vocab(padded, cfx.device_get(trained))
    cfx.tree.assert_close(real, one.params(state), rtol=1e-4, atol=1e-5)
    assert (cfx.device_get(trained)["wte"]["w"][V:] == 0).all()  # the padding never trains


def test_hugging_face_export_writes_the_real_vocabulary(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = FAMILIES["gpt2"]()
    params = cfx.tree.map(lambda x: x.double(), model.init(cfx.random.key(0)))  # fp64: the same function, exactly
    padded, pparams = pad_vocab(model, params, multiple=64)
    assert cfx.models.hf_config(padded).vocab_size == V
    assert cfx.models.to_hf(padded, pparams)["transformer.wte.weight"].shape == (V, 32)
    cfx.models.save_pretrained(tmp_path, padded, pparams)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert hf.transformer.wte.weight.dtype == torch.float64
    tokens = batch()[0]
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model.apply(params, tokens), rtol=1e-12, atol=1e-12)


def test_refusals_name_the_fix():
    model = FAMILIES["gpt2"]()
    with pytest.raises(ValueError, match="multiple must be a positive int"):
        pad_vocab(model, multiple=0)
    with pytest.raises(ValueError, match="ViT has no vocabulary to pad"):
        pad_vocab(cfx.models.vit("tiny"), multiple=8)
    with pytest.raises(ValueError, match=r"already replaced \(a parallel split\?\); pad the vocabulary of the plain"):
        pad_vocab(cfx.parallel.tensor_parallel(model, "model"), multiple=8)
    padded, pparams = pad_vocab(model, model.init(cfx.random.key(0)), multiple=64)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, vocab_size=101\)"):
        padded.apply(pparams, torch.tensor([[100, 101]]))  # a padded id is no token
    assert pad_vocab(model, multiple=101) == model and unpad_vocab(model) == model  # nothing to pad
    twice = pad_vocab(pad_vocab(model, multiple=64), multiple=8)  # padded anew from the real size
    assert (twice.config.vocab_size, twice.real_vocab_size) == (104, V)
