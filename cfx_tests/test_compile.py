"""The models trace whole under ``torch.compile(fullgraph=True)`` (no graph break: value checks and
the tree checks step aside while tracing) and the compiled loss and its gradients equal eager."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo

import cfx

MODELS = {
    "gpt2": lambda: cfx.models.gpt2("tiny", n_layer=2, vocab_size=64, n_embd=32, n_head=4, n_positions=16),
    "llama": lambda: cfx.models.llama("tiny", vocab_size=64, n_layer=2, hidden_size=32, n_head=4, n_kv_heads=2,
                                      intermediate_size=48, max_position_embeddings=16),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", MODELS)
def test_model_loss_compiles_whole_and_equals_eager(name):
    model = MODELS[name]()
    params = model.init(cfx.random.key(0))
    x, y = cfx.random.randint(cfx.random.key(1), (2, 2, 16), 0, 64)
    dynamo.reset()
    explained = dynamo.explain(model.loss)(params, x, y)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(model.loss, fullgraph=True, backend="aot_eager")  # inductor: test_jit
    loss, grads = cfx.value_and_grad(lambda p: compiled(p, x, y))(params)
    ref_loss, ref_grads = cfx.value_and_grad(lambda p: model.loss(p, x, y))(params)
    torch.testing.assert_close(loss, ref_loss)
    cfx.tree.assert_tree_close(grads, ref_grads)
    with pytest.raises(ValueError, match="token ids must lie in"):  # eager calls still check values
        model.loss(params, x + 64, y)
