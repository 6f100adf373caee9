"""The parts protocol: a family the library has never seen pipelines by implementing ``parts()``;
GPT-2 and Llama's parts compose back to their ``loss``; a model without it is refused by name."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import cfx
from cfx import P
from cfx import pipeline


@dataclasses.dataclass(frozen=True)
class ResBlock:
    width: int

    def init(self, key):
        return {"w": cfx.random.normal(key, (self.width, self.width)) * 0.2}

    def apply(self, p, x, *, mask=None, key=None):
        del mask, key
        return x + torch.tanh(x @ p["w"])  # (B, T, C)

    def axes(self):
        return {"w": ("embed", "mlp")}


@dataclasses.dataclass(frozen=True)
class ToyLM:
    """A family defined only here: embedding | residual tanh blocks | linear head."""

    vocab: int = 32
    width: int = 16
    blocks: tuple = (ResBlock(16),) * 4

    def init(self, key):
        k_e, k_h, *k_b = cfx.random.split(key, 2 + len(self.blocks))
        return {"emb": cfx.random.normal(k_e, (self.vocab, self.width)),
                "blocks": [b.init(k) for b, k in zip(self.blocks, k_b)],
                "head": cfx.random.normal(k_h, (self.width, self.vocab)) * 0.2}

    def axes(self):
        return {"emb": ("vocab", "embed"), "blocks": [b.axes() for b in self.blocks], "head": ("embed", "vocab")}

    def map_blocks(self, f):
        return dataclasses.replace(self, blocks=tuple(f(b) for b in self.blocks))

    def parts(self):
        def check(tokens, targets):
            if tokens.shape != targets.shape:
                raise ValueError("ToyLM: targets must have the tokens' shape")
        return cfx.models.ModelParts(
            ("emb",), ("head",), lambda p, t: p["emb"][t],
            lambda p, x, y: F.cross_entropy((x @ p["head"]).flatten(0, 1), y.flatten()), check, self.width)

    def loss(self, params, tokens, targets):
        parts = self.parts()
        x = parts.embed(params, tokens)
        for b, p in zip(self.blocks, params["blocks"]):
            x = b.apply(p, x)
        return parts.head_loss(params, x, targets)


@pytest.mark.timeout(60)
def test_a_new_family_pipelines_through_the_protocol_alone():
    model, key = ToyLM(), cfx.random.key(0)
    params = model.init(key)
    d = cfx.random.randint(cfx.random.key(1), (8, 9), 0, model.vocab)
    x, y = d[:, :-1], d[:, 1:]
    ref_loss, ref_grads = cfx.value_and_grad(lambda p: model.loss(p, x, y))(params)
    with cfx.Mesh({"pipe": 2}) as mesh:
        step = pipeline(model, pipeline.one_f_one_b(2, 4))
        loss, grads = cfx.device_get(cfx.shard_map(step, mesh=mesh, in_specs=(P(), P(), P()),
                                                   out_specs=(P(), P()))(params, x, y))
    torch.testing.assert_close(loss, ref_loss)
    cfx.tree.assert_tree_close(grads, ref_grads)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_builtin_parts_compose_to_the_loss(family):
    if family == "gpt2":
        model = cfx.models.gpt2("tiny", n_layer=2, vocab_size=64, n_embd=32, n_head=4, n_positions=16)
    else:
        model = cfx.models.llama("tiny", vocab_size=64, n_layer=2, hidden_size=32, n_head=4, n_kv_heads=2,
                                 intermediate_size=48, max_position_embeddings=16)
    params = model.init(cfx.random.key(0))
    d = cfx.random.randint(cfx.random.key(1), (2, 9), 0, 64)
    x, y = d[:, :-1], d[:, 1:]
    parts = model.parts()
    h = parts.embed(params, x)
    assert h.shape == (2, 8, parts.width)
    for b, p in zip(model.blocks, params["blocks"]):
        h = b.apply(p, h)
    torch.testing.assert_close(parts.head_loss(params, h, y), model.loss(params, x, y))
    assert set(parts.first) | set(parts.last) | {"blocks"} == set(params)
    with pytest.raises(ValueError, match="sequence length 20"):
        parts.check(torch.zeros(1, 20, dtype=torch.long), torch.zeros(1, 20, dtype=torch.long))


def test_a_model_without_the_protocol_is_refused_naming_it():
    @dataclasses.dataclass(frozen=True)
    class NoParts:
        blocks: tuple = (ResBlock(4),) * 2

    with pytest.raises(ValueError, match="NoParts does not implement the parts protocol.*parts\\(\\)"):
        pipeline(NoParts(), pipeline.gpipe(2, 2))
