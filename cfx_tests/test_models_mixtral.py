"""cfx.models.Mixtral = transformers' MixtralForCausalLM on tiny random configs, in fp64 (the claim is the
same function, which fp32 settles only up to each CPU's kernels): logits, the loss with and without the
routers' auxiliary loss (as transformers adds it with output_router_logits), every gradient, top-1 and
top-2; weights both ways (transformers 5's layout written, 4's read too); greedy decoding token for token.
With ``router_aux_group_size`` the auxiliary losses are each group's and layer's, averaged, which is what
a pipeline's stages compute (without it they are refused there)."""
from __future__ import annotations

import pytest
import torch

import cfx
from cfx_tests.hf_helpers import FP32_LOSS, FP32_LOSS_GRADS

V = 64


def tiny(**kw):
    return cfx.models.mixtral("tiny", vocab_size=V, hidden_size=32, intermediate_size=48, n_head=4, n_kv_heads=2,
                              n_experts=4, max_position_embeddings=64, **kw)


def pair(dtype=torch.float32, **kw):
    import transformers
    model = tiny(**kw)
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(model.hf_config()).eval().to(dtype)
    if dtype == torch.float64 and hasattr(hf, "set_experts_implementation"):
        hf.set_experts_implementation("eager")  # transformers' grouped_mm takes no fp64: its per-expert loop
    _, params = cfx.models.from_hf(hf, model)
    return model, params, hf


def shifted(tokens):  # transformers shifts its labels inside; cfx's targets are already the next tokens
    return torch.cat([tokens[:, 1:], torch.full((tokens.shape[0], 1), -100)], 1)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("aux", [0.0, 0.02])
def test_logits_and_loss_equal_transformers(top_k, aux):
    model, params, hf = pair(torch.float64, top_k=top_k, router_aux_loss_coef=aux)
    tokens = cfx.random.randint(cfx.random.key(1), (2, 12), 0, V)
    with torch.no_grad():
        out = hf(tokens, labels=tokens, output_router_logits=True)
    torch.testing.assert_close(model.apply(params, tokens), out.logits)
    loss = model.loss(params, tokens, shifted(tokens))
    # cfx keeps an fp64 model's loss in fp64; transformers' takes its logits in fp32 (hf_helpers.FP32_LOSS)
    assert loss.dtype == torch.float64 and out.loss.dtype == torch.float32
    torch.testing.assert_close(loss.float(), out.loss, **FP32_LOSS)
    if aux:
        assert float(out.aux_loss) > 1.0  # the auxiliary term is in the loss (E f.P is about 1 per unit)


def test_gradients_equal_transformers_in_fp64():
    model, params, hf = pair(torch.float64)
    tokens = cfx.random.randint(cfx.random.key(2), (2, 10), 0, V)
    hf(tokens, labels=tokens, output_router_logits=True).loss.backward()
    grads = cfx.grad(lambda p: model.loss(p, tokens, shifted(tokens)))(params)
    got = cfx.models.to_hf(model, grads)
    for name, p in hf.named_parameters():  # d loss / d logits from fp32 losses (hf_helpers.FP32_LOSS_GRADS)
        torch.testing.assert_close(got[name], p.grad, **FP32_LOSS_GRADS, msg=name)


def test_weights_convert_both_ways_and_transformers_4_layout_reads():
    model, params, hf = pair()
    sd = cfx.models.to_hf(model, params)
    assert set(sd) == set(hf.state_dict()) and all(torch.equal(sd[k], v) for k, v in hf.state_dict().items())
    old = {k: v for k, v in sd.items() if ".mlp." not in k}  # transformers 4: one module per expert
    for i, p in enumerate(params["blocks"]):
        pre = f"model.layers.{i}.block_sparse_moe."
        old[pre + "gate.weight"] = p["mlp"]["router"].T
        for e in range(4):
            for w, name in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
                old[pre + f"experts.{e}.{w}.weight"] = p["mlp"][name][e].T
    _, again = cfx.models.from_hf(old, model)
    assert cfx.tree.allclose(again, params, rtol=0, atol=0)


def test_greedy_decoding_equals_transformers():
    model, params, hf = pair(torch.float64)  # an argmax is exact in fp64; an fp32 near tie would go by the CPU
    prompt = cfx.random.randint(cfx.random.key(3), (2, 8), 0, V)
    want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                       pad_token_id=0)
    assert torch.equal(cfx.generate(model, params, prompt, max_new_tokens=8), want)


def test_routing_statistics_per_layer():
    model, params, _ = pair()
    tokens = cfx.random.randint(cfx.random.key(4), (3, 5), 0, V)
    x, stats = model.router_stats(params, tokens)
    assert x.shape == (3, 5, 32) and len(stats) == 2
    assert all(float(s.counts.sum()) == 15 * 2 and float(s.rows) == 15 for s in stats)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("text", ["data=2 zero=3", "data=2 zero=1 remat=blocks"])
def test_plans_train_mixtral_as_one_device(text):
    from cfx_tests.test_plan import data, run_plan, single_device
    model = tiny(router_aux_loss_coef=0.0)  # under data parallelism each rank balances its own tokens
    batches = [(x % V, y % V) for x, y in data(3)]
    want_losses, want = single_device(model, cfx.optim.adamw(1e-3), batches)
    losses, got = run_plan(cfx.parallel.Plan.parse(text), model, cfx.optim.adamw(1e-3), batches)
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_grouped_auxiliary_losses_are_each_groups_and_layers_averaged():
    coefs = dict(router_aux_loss_coef=0.02, router_z_loss_coef=0.01)
    model, whole, plain = tiny(router_aux_group_size=8, **coefs), tiny(**coefs), tiny(router_aux_loss_coef=0.0)
    params = model.init(cfx.random.key(0))
    tokens = cfx.random.randint(cfx.random.key(6), (3, 9), 0, V)
    x, y = tokens[:, :-1], tokens[:, 1:]  # 3 rows of 8 tokens: a group a row
    want = plain.loss(params, x, y)
    for row in range(3):  # a row's routing is its own: the whole-batch rule on it alone, over 3 rows and 2 layers
        for s in whole.router_stats(params, x[row:row + 1])[1]:
            want = want + (0.02 * cfx.nn.load_balancing_loss(s) + 0.01 * cfx.nn.z_loss(s)) / 3 / 2
    torch.testing.assert_close(model.loss(params, x, y), want)
    assert model.router_stats(params, x)[1][0].counts.shape == (3, 4)
    assert abs(float(model.loss(params, x, y)) - float(whole.loss(params, x, y))) > 1e-4  # a rule of its own
    with pytest.raises(ValueError, match=r"its 24 tokens \(shape \(3, 8\)\) do not form whole groups of "
                                         "router_aux_group_size=16"):
        tiny(router_aux_group_size=16, **coefs).loss(params, x, y)


def test_what_does_not_carry_the_routers_statistics_is_refused():
    model = tiny()
    with pytest.raises(ValueError, match="a pipeline cannot compute the auxiliary losses over the whole batch.*"
                                         "set router_aux_group_size=S"):
        model.parts()
    assert tiny(router_aux_group_size=8).parts().block_loss is not None
    assert tiny(router_aux_loss_coef=0.0).parts().block_loss is None
    with pytest.raises(ValueError, match="router_aux_group_size must be a positive number of tokens"):
        tiny(router_aux_group_size=0)
    with pytest.raises(ValueError, match="split them over an expert axis instead"):
        cfx.parallel.tensor_parallel(model, "model")


def test_hugging_face_directories_both_ways(tmp_path):
    import transformers
    model, params, _ = pair()
    cfx.models.save_pretrained(tmp_path, model, params)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(hf).__name__ == "MixtralForCausalLM"
    tokens = cfx.random.randint(cfx.random.key(5), (1, 6), 0, V)
    if hasattr(hf, "set_experts_implementation"):
        hf.set_experts_implementation("eager")  # as pair(): grouped_mm takes no fp64
    with torch.no_grad():  # in fp64, as above
        torch.testing.assert_close(hf.double()(tokens).logits, model.apply(cfx.tree.map(lambda x: x.double(), params),
                                                                           tokens))
    again, same = cfx.models.from_pretrained(tmp_path)
    assert type(again).__name__ == "Mixtral" and cfx.tree.allclose(same, params, rtol=0, atol=0)


def test_hugging_face_directories_keep_cfxs_own_training_rules(tmp_path):
    """The fields transformers' MixtralConfig has no name for (z-loss, capacity and aux groups) travel
    in config.json as ``cfx_<field>``; transformers still loads the directory."""
    import transformers
    model = tiny(router_z_loss_coef=1e-3, capacity_factor=1.25, capacity_group_size=8, router_aux_group_size=4)
    params = model.init(cfx.random.key(0))
    cfx.models.save_pretrained(tmp_path, model, params)
    assert type(transformers.AutoModelForCausalLM.from_pretrained(tmp_path)).__name__ == "MixtralForCausalLM"
    again, _ = cfx.models.from_pretrained(tmp_path)
    assert again.config == model.config
    plain, _ = cfx.models.from_pretrained(_saved(tmp_path / "plain", tiny()))
    assert plain.config == tiny().config


def _saved(path, model):
    cfx.models.save_pretrained(path, model, model.init(cfx.random.key(0)))
    return path

