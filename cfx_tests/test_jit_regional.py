"""``cfx.jit(step, compile="blocks")``: regional compilation. The step runs eagerly with the same
donation while each distinct block compiles once (forward and backward) and every equal block replays
that graph, so the graphs built do not grow with depth; the losses and params equal the eager step's."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import cfx
from cfx import optim
from cfx._src.transforms import regional


def run(model, compile, steps=3, jitted_out=None):
    tx = optim.adamw(1e-2)
    state = (model.init(cfx.random.key(0)), None)
    state = (state[0], tx.init(state[0]))

    def step(state, tokens, targets):
        params, opt = state
        loss, grads = cfx.value_and_grad(model.loss)(params, tokens, targets)
        return optim.apply_gradients(tx, grads, opt, params), loss

    jitted = cfx.jit(step, donate_argnums=0, compile=compile, backend="aot_eager")
    losses = []
    for i in range(steps):
        x = cfx.random.randint(cfx.random.key(i + 1), (2, 16), 0, 64)
        state, loss = jitted(state, x, x.roll(-1, 1))
        losses.append(loss)
    if jitted_out is not None:
        jitted_out.append(jitted)
    return torch.stack(losses), state[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_blocks_compile_once_whatever_the_depth_and_equal_eager(name):
    graphs = []
    for depth in (2, 6):
        build = cfx.models.gpt2 if name == "gpt2" else cfx.models.llama
        kw = dict(n_embd=32, n_head=4, n_positions=16) if name == "gpt2" else dict(
            hidden_size=32, n_head=4, n_kv_heads=2, intermediate_size=48, max_position_embeddings=16)
        model = build("tiny", n_layer=depth, vocab_size=64, **kw)
        want_losses, want = run(model, False)
        before, jitted = counters["stats"]["unique_graphs"], []
        losses, got = run(model, "blocks", jitted_out=jitted)
        graphs.append(counters["stats"]["unique_graphs"] - before)
        stats = jitted[0].stats()  # what it compiled, counted: the graph dynamo made, once
        assert (stats.signatures, stats.compiles, stats.calls) == (1, graphs[-1], 3), stats
        assert (stats.compile_seconds > 0) == (graphs[-1] > 0)
        torch.testing.assert_close(losses, want_losses)
        torch.testing.assert_close(got, want)
    assert graphs == [1, 0]  # one block graph for 2 layers; 6 layers of the same block reuse it
    assert regional.block_apply(model.blocks[0]) == model.blocks[0].apply  # outside a compile="blocks" step


def test_bad_compile_values_are_refused():
    with pytest.raises(ValueError, match="compile must be True"):
        cfx.jit(lambda x: x, compile="block")
    with pytest.raises(ValueError, match="compiles no whole graph"):
        cfx.jit(lambda x: x * 2, compile="blocks").lower(torch.ones(2))
