"""LoRA under a Plan: the adapters are an ordinary params pytree, so a Plan trains them through its
loss-function path (``plan.step(loss_fn, tx, params=adapters)``) with the frozen base -- fp32 or int8 --
closed over and replicated: data parallelism and ZeRO 1-3 (the adapters and their AdamW state
sharded) equal one device. Tensor and pipeline parallelism of an adapted model go through the parts
protocol instead (``LoraModel``: ``test_lora_model``)."""
from __future__ import annotations

import pytest
import torch

import cfx
from cfx_tests.test_plan_own_model import one_device, run_plan

V = 64


@pytest.mark.timeout(180)
@pytest.mark.parametrize("text, int8", [("data=2", False), ("data=2 zero=3", True), ("data=4 zero=1", False)])
def test_adapters_train_under_a_plan_as_on_one_device(text, int8):
    model = cfx.models.llama("tiny", n_layer=2, vocab_size=V, hidden_size=32, n_head=4, n_kv_heads=2,
                             intermediate_size=48, max_position_embeddings=16)
    base = model.init(cfx.random.key(0))
    frozen = cfx.quant.quantize(base, "int8", axes=model.axes(), min_size=1) if int8 else base
    config = cfx.lora.LoraConfig(r=4, alpha=8, targets=("attn", "mlp"))
    adapters = cfx.tree.map(lambda t: t + 0.01, cfx.lora.init(model, config, cfx.random.key(1)))  # B != 0

    def loss_fn(ad, x, y):
        return model.loss(cfx.lora.attach(frozen, ad, config), x, y)
    data = cfx.random.randint(cfx.random.key(2), (3, 8, 17), 0, V)
    batches = [(d[:, :-1], d[:, 1:]) for d in data]
    tx = cfx.optim.adamw(1e-2)
    got = run_plan(text, loss_fn, batches, tx, params=adapters)
    cfx.tree.assert_close(got, one_device(loss_fn, adapters, batches, tx), rtol=1e-5, atol=1e-6)
    assert not cfx.tree.allclose(got, adapters)  # they trained
