"""``LoraModel`` (``cfx._src.lora.model``): the adapters over a frozen base as a model a Plan trains through
the parts protocol, so tensor parallelism (a column-parallel Linear's ``B`` split with its output, a
row-parallel one's ``A`` with its input), pipeline stages and ZeRO-3 take it like any chain of blocks.
Over an int8 base (every Linear quantised), three AdamW steps under ``model=2``, ``pipe=2,data=2``,
``data=2 zero=3`` and ``data=2,model=2 zero=3`` equal one device's hand-written loop over
``cfx.lora.attach`` within ``assert_close``'s fp32 defaults (measured: 2e-7 at most; the plans split
sums over ranks and halve the batch, so only rounding moves), and the frozen base is bitwise what it
was."""
from __future__ import annotations

import pytest
import torch

import cfx
from cfx._src.lora.model import LoraModel
from cfx._src.nn.lora_weight import LoraWeight
from cfx._src.train.model import lora_model
from cfx_tests.test_plan_own_model import one_device

V = 64


def llama():
    return cfx.models.llama("tiny", n_layer=2, vocab_size=V, hidden_size=32, n_head=4, n_kv_heads=2,
                            intermediate_size=48, max_position_embeddings=16)


def int8_base(model):
    base = cfx.quant.quantize(model.init(cfx.random.key(0)), "int8", axes=model.axes(), min_size=1)
    assert isinstance(base["blocks"][0]["attn"]["o"]["w"], cfx.quant.QuantizedWeight)  # every Linear is int8
    return base


def batches():
    data = cfx.random.randint(cfx.random.key(2), (3, 8, 17), 0, V)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def test_the_model_is_the_base_model_over_attached_adapters():
    model = llama()
    base = int8_base(model)
    config = cfx.lora.LoraConfig(r=4, alpha=8, targets=("attn", "mlp"))
    lm = lora_model(model, config, base)
    adapters = cfx.tree.map(lambda t: t + 0.01, lm.init(cfx.random.key(1)))  # B != 0: the adapters count
    x, y = batches()[0]
    assert torch.equal(lm.loss(adapters, x, y), model.loss(cfx.lora.attach(base, adapters, config), x, y))
    assert cfx.tree.structure(lm.axes()) == cfx.tree.structure(cfx.lora.axes(model, config))
    # x @ w for a LoraWeight (what Megatron's row-parallel projections run) is Linear.apply's sum
    w = cfx.lora.attach(base, adapters, config)["blocks"][0]["attn"]["o"]["w"]
    h = cfx.random.normal(cfx.random.key(3), (2, 5, 32))
    assert isinstance(w, LoraWeight)
    assert torch.equal(h @ w, cfx.nn.Linear(32, 32, bias=False).apply({"w": w}, h))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("text", ["model=2", "pipe=2,data=2", "data=2 zero=3", "data=2,model=2 zero=3", "data=2 zero=3 remat=blocks"])
def test_adapters_over_an_int8_base_train_under_a_plan_as_on_one_device(text):
    model = llama()
    base = int8_base(model)
    before = cfx.tree.map(lambda t: t.clone(), base)
    config = cfx.lora.LoraConfig(r=4, alpha=8, targets=("attn", "mlp"))
    adapters = cfx.tree.map(lambda t: t + 0.01, cfx.lora.init(model, config, cfx.random.key(1)))
    tx = cfx.optim.adamw(1e-2)

    def hand_written(ad, x, y):
        return model.loss(cfx.lora.attach(base, ad, config), x, y)
    got = _run(text, lora_model(model, config, base), adapters, tx)
    cfx.tree.assert_close(got, one_device(hand_written, adapters, batches(), tx))
    assert not cfx.tree.allclose(got, adapters)  # they trained
    assert all(torch.equal(a, b) for a, b in zip(cfx.tree.leaves(base), cfx.tree.leaves(before)))


def _run(text, lm, adapters, tx, *, prepare=lambda lm, plan, mesh: lm):
    """The adapters after three steps of ``lm`` (``prepare(lm, plan, mesh)`` first) under Plan ``text``."""
    plan = cfx.parallel.Plan.parse(text)
    with plan.make_mesh() as mesh:
        step = plan.step(prepare(lm, plan, mesh), tx, mesh=mesh)
        state = step.init_from(adapters)
        for b in batches():
            state, _ = step(state, b)
        return step.params(state)


@pytest.mark.parametrize("config, match", [
    (cfx.lora.LoraConfig(targets=("lm_head.w",)), "outside the blocks"),
    (cfx.lora.LoraConfig(dropout=0.1), "dropout"),
])
def test_what_a_lora_model_cannot_do_is_refused(config, match):
    model = llama()
    with pytest.raises(ValueError, match=match):
        lm = lora_model(model, config, model.init(cfx.random.key(0)))
        cfx.parallel.Plan.parse("model=2").check(lm)


def test_a_split_needs_a_splitter_and_a_base_of_the_model():
    model = llama()
    base = model.init(cfx.random.key(0))
    with pytest.raises(ValueError, match="no split over a model axis"):
        cfx.parallel.Plan.parse("model=2").check(LoraModel(model, cfx.lora.LoraConfig(), base))
    with pytest.raises(ValueError, match="frozen base"):
        lora_model(model, cfx.lora.LoraConfig(), {**base, "blocks": base["blocks"][:1]})
