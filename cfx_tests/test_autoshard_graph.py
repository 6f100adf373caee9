"""``autoshard.graph.trace``: a train step's forward and backward as one aten graph on fake
tensors, each op's FLOPs as the textbook counts them (GPT-2: 2 x tokens x matmul weights forward,
twice that backward; attention 4 B H T^2 D forward), its phase, and the params / batch / outputs
named by pytree path."""
from __future__ import annotations

import torch

import cfx
from cfx._src.autoshard.graph import trace

L, C, V, B, T, H = 2, 128, 256, 4, 32, 4


def _traced():
    model = cfx.models.gpt2("tiny", n_layer=L, vocab_size=V, n_positions=64, n_embd=C, n_head=H)
    params = model.init(cfx.random.key(0))
    tokens = torch.randint(0, V, (B, T + 1))
    return model, params, tokens, trace(lambda p, x, y: model.loss(p, x, y), params, tokens[:, :-1], tokens[:, 1:])


def test_flops_are_the_textbook_counts():
    model, params, tokens, g = _traced()
    matmuls = lambda phase: sum(o.flops for o in g.ops if o.phase == phase and "mm" in o.target)  # noqa: E731
    weights = 12 * L * C * C + V * C  # qkv, o, fc, proj per block; the tied head
    assert matmuls("forward") == 2 * B * T * weights
    assert matmuls("backward") == 2 * matmuls("forward")  # input and weight gradients
    attention = [o.flops for o in g.ops if "attention" in o.target]
    assert attention[:L] == [4 * B * H * T * T * (C // H)] * L  # forward, per block
    # against PyTorch's own counter on the real step (it has no formula for the CPU attention ops)
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        cfx.value_and_grad(lambda p: model.loss(p, tokens[:, :-1], tokens[:, 1:]))(params)
    assert counter.get_total_flops() == g.flops() - sum(attention)


def test_inputs_outputs_and_phases():
    model, params, tokens, g = _traced()
    paths = [p for p, _ in cfx.tree.flatten_with_path(params)[0]]
    assert [g.ops[i].path for i in g.params] == [f"params.{p}" for p in paths]
    assert [g.ops[i].target for i in g.batch] == ["input", "input"]
    assert len(g.outputs) == 1 + len(paths) and g.ops[g.outputs[0]].shape == ()
    for i, leaf in zip(g.outputs[1:], cfx.tree.leaves(params)):  # the gradients, shaped like their params
        assert g.ops[i].shape == tuple(leaf.shape) and g.ops[i].phase == "backward"
    assert g.ops[g.outputs[0]].phase == "forward"
    consumers = g.consumers()
    assert all(consumers[i] for i in g.params)  # every param is read
