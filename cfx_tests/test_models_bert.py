"""BERT equals Hugging Face ``BertForMaskedLM`` / ``BertForSequenceClassification`` (logits, loss
and gradients, with padding and token types; in fp64, where the claim of the same function does not
rest on each CPU's fp32 kernels), converts both ways, and runs tensor-parallel and as pipeline
stages like the decoders."""
import pytest
import torch

import cfx
from cfx import P
from cfx.parallel import MEGATRON_RULES, tensor_parallel

transformers = pytest.importorskip("transformers")

V, T = 96, 12


def small(head="mlm", **kw):
    return cfx.models.bert("tiny", vocab_size=V, max_position_embeddings=32, head=head, **kw)


def batch(B=3, seed=0):
    tokens = cfx.random.randint(cfx.random.key(seed), (B, T), 1, V)
    lengths = torch.tensor([T, T - 4, 5, T - 1][:B])
    mask = torch.arange(T)[None, :] < lengths[:, None]                                # (B, T) True = real
    types = (torch.arange(T)[None, :] >= (lengths[:, None] // 2)).long() * mask       # segment A then B
    targets = torch.where(cfx.random.uniform(cfx.random.key(seed + 1), (B, T)) < 0.3, tokens, -100)
    return tokens.masked_fill(~mask, 0), mask, types, targets.masked_fill(~mask, -100)


def hf_twin(model, params):
    cls = transformers.BertForMaskedLM if model.config.head == "mlm" else transformers.BertForSequenceClassification
    hf = cls(model.hf_config()).eval().to(cfx.tree.leaves(params)[0].dtype)
    hf.load_state_dict(cfx.models.to_hf(model, params), strict=True)
    return hf


def to64(tree):
    return cfx.tree.map(lambda x: x.double(), tree)


@pytest.mark.parametrize("head", ["mlm", "classify"])
def test_logits_loss_and_grads_equal_hugging_face(head):
    model = small(head, num_labels=3)
    params = to64(model.init(cfx.random.key(0)))
    tokens, mask, types, targets = batch()
    if head == "classify":
        targets = torch.tensor([0, 2, 1])
    hf = hf_twin(model, params)
    out = hf(input_ids=tokens, attention_mask=mask.long(), token_type_ids=types, labels=targets)
    logits = model.apply(params, tokens, mask=mask, token_types=types)
    torch.testing.assert_close(logits, out.logits)
    # transformers' BERT losses are fp64 here, and so is cfx's: the same function, compared in fp64
    loss, grads = cfx.value_and_grad(model.loss)(params, tokens, targets, mask=mask, token_types=types)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, out.loss)
    out.loss.backward()
    want = {k: p.grad for k, p in hf.named_parameters()}
    got = cfx.models.to_hf(model, grads)
    for k, g in want.items():
        torch.testing.assert_close(got[k], g, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("cls,head", [("BertForMaskedLM", "mlm"), ("BertForSequenceClassification", "classify")])
def test_from_hf_builds_the_model_and_round_trips(cls, head):
    config = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=20, num_labels=4,
                                     attention_probs_dropout_prob=0.0)
    hf = getattr(transformers, cls)(config).eval()
    model, params = cfx.models.from_hf(hf)
    assert model.config.head == head and model.config.n_layer == 2
    tokens, mask, types, _ = batch()
    want = hf.double()(input_ids=tokens, attention_mask=mask.long(), token_type_ids=types).logits
    torch.testing.assert_close(model.apply(to64(params), tokens, mask=mask, token_types=types), want)
    hf.float()
    back = cfx.models.to_hf(model, params)
    sd = hf.state_dict()
    assert set(back) == {k for k in sd if not k.endswith("position_ids")}
    for k, t in back.items():
        assert torch.equal(t, sd[k]), k


def test_padding_never_changes_the_real_tokens():
    model = small()
    params = model.init(cfx.random.key(0))
    tokens, mask, types, _ = batch()
    full = model.apply(params, tokens, mask=mask, token_types=types)
    junk = tokens.masked_fill(~mask, 7)  # other ids in the padding
    torch.testing.assert_close(model.apply(params, junk, mask=mask, token_types=types)[mask], full[mask])
    short = model.apply(params, tokens[2:, :5], token_types=types[2:, :5])  # row 2 has 5 real tokens
    torch.testing.assert_close(full[2, :5], short[0])


def test_dropout_follows_the_key():
    model = small(dropout=0.1)
    params = model.init(cfx.random.key(0))
    tokens, mask, _, targets = batch()
    a = model.loss(params, tokens, targets, mask=mask, key=cfx.random.key(3))
    b = model.loss(params, tokens, targets, mask=mask, key=cfx.random.key(3))
    c = model.loss(params, tokens, targets, mask=mask, key=cfx.random.key(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    plain = model.loss(to64(params), tokens, targets, mask=mask)  # no key: no dropout, as HF in eval()
    hf = hf_twin(small(), to64(params))
    torch.testing.assert_close(plain, hf(input_ids=tokens, attention_mask=mask.long(), labels=targets).loss)


def test_bad_inputs_name_the_fix():
    model, cls = small(), small("classify")
    params, cparams = model.init(cfx.random.key(0)), cls.init(cfx.random.key(0))
    tokens, mask, types, targets = batch()
    with pytest.raises(ValueError, match=r"token_types must lie in \[0, type_vocab_size=2\)"):
        model.apply(params, tokens, token_types=types + 2)
    with pytest.raises(ValueError, match="integer targets \\(B,\\) = \\(3,\\)"):
        cls.loss(cparams, tokens, targets)
    with pytest.raises(ValueError, match=r"class ids must lie in \[0, num_labels=2\)"):
        cls.loss(cparams, tokens, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="num_labels >= 2"):
        small("classify", num_labels=1)
    with pytest.raises(ValueError, match="head must be one of"):
        small("regress")
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=32"):
        model.apply(params, torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="no token loss over them .*head='classify'.*vocab=False"):
        tensor_parallel(cls, "model")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", [{"model": 2}, {"data": 2, "model": 2}])
def test_tensor_parallel_equals_single_device(shape):
    # post-norm blocks through Megatron's f/g points; the vocab-parallel MLM head and loss
    model = small()
    params = model.init(cfx.random.key(0))
    tokens, mask, types, targets = batch(B=4 if "data" in shape else 3)
    ref_loss, ref = cfx.value_and_grad(model.loss)(params, tokens, targets, mask=mask, token_types=types)
    tp = tensor_parallel(model, "model")

    def step(p, t, m, s, y):
        loss, g = cfx.value_and_grad(tp.loss)(p, t, y, mask=m, token_types=s)
        if "data" in shape:  # means over the batch shards: equal shards of real targets here
            loss, g = cfx.lax.pmean(loss, "data"), cfx.parallel.tree_pmean(g, "data")
        return loss, g
    with cfx.Mesh(shape) as mesh:
        specs = cfx.Rules(MEGATRON_RULES).specs(model.axes(), mesh=mesh)
        b = P("data") if "data" in shape else P()
        loss, grads = cfx.device_get(cfx.shard_map(step, mesh=mesh, in_specs=(specs, b, b, b, b),
                                                   out_specs=(P(), specs))(params, tokens, mask, types, targets))
    if "data" not in shape:
        torch.testing.assert_close(loss, ref_loss)
        cfx.tree.assert_tree_close(grads, ref)
    else:  # the mean of the shards' means: compare with the same on one device
        halves = [cfx.value_and_grad(model.loss)(params, tokens[i:i + 2], targets[i:i + 2], mask=mask[i:i + 2],
                                                 token_types=types[i:i + 2]) for i in (0, 2)]
        torch.testing.assert_close(loss, (halves[0][0] + halves[1][0]) / 2)
        cfx.tree.assert_tree_close(grads, cfx.tree.map(lambda a, b: (a + b) / 2, halves[0][1], halves[1][1]))


@pytest.mark.timeout(120)
def test_pipeline_stages_equal_single_device():
    model = small()
    params = model.init(cfx.random.key(0))
    tokens = batch(B=4)[0][:, :8]  # unpadded; every position a target, so microbatch means average to the batch's
    targets = tokens.roll(1, dims=1)
    ref_loss, ref = cfx.value_and_grad(model.loss)(params, tokens, targets)
    with cfx.Mesh({"pipe": 2}) as mesh:
        step = cfx.pipeline(model, cfx.pipeline.one_f_one_b(2, 2))
        loss, grads = cfx.device_get(cfx.shard_map(step, mesh=mesh, in_specs=(P(), P(), P()),
                                                   out_specs=(P(), P()))(params, tokens, targets))
    torch.testing.assert_close(loss, ref_loss)
    cfx.tree.assert_tree_close(grads, ref)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("text", ["data=2,model=2 zero=2", "pipe=2,data=2 zero=3 remat=blocks microbatches=2"])
def test_plans_train_bert_like_one_device(text):
    # the Plan reads BERT through the parts protocol and the logical axes, as it reads the decoders
    model, tx = small(), cfx.optim.sgd(0.3, momentum=0.9)  # linear in the grads: the strict tolerance holds
    tokens = cfx.random.randint(cfx.random.key(5), (3, 4, 8), 1, V)
    batches = [(t, t.roll(1, dims=1)) for t in tokens]  # every position a target: microbatch means agree
    params, ref = model.init(cfx.random.key(0)), []
    state = tx.init(params)
    for x, y in batches:
        loss, g = cfx.value_and_grad(model.loss)(params, x, y)
        u, state = tx.update(g, state, params)
        params = cfx.optim.apply_updates(params, u)
        ref.append(loss)
    plan = cfx.parallel.Plan.parse(text)
    with plan.make_mesh() as mesh:
        step = plan.step(model, tx, mesh=mesh)
        s, losses = step.init(cfx.random.key(0)), []
        for batch in batches:
            s, metrics = step(s, batch)
            losses.append(float(metrics["loss"]))
        got = step.params(s)
    torch.testing.assert_close(torch.tensor(losses), torch.stack(ref))
    cfx.tree.assert_tree_close(got, params)
