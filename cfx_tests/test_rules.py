"""cfx.Rules: logical axes to specs."""
import pytest

import cfx
from cfx import P


def test_specs_from_model_axes():
    model = cfx.models.gpt2("tiny")
    rules = cfx.Rules({"batch": "data", "mlp": "model", "heads": "model", "kv_heads": "model"})
    specs = rules.specs(model.axes())
    assert cfx.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == cfx.tree.structure(
        model.init(cfx.random.key(0)))
    blk = specs["blocks"][0]
    assert blk["attn"]["q"]["w"] == P(None, "model") and blk["attn"]["q"]["b"] == P("model")
    assert blk["attn"]["o"]["w"] == P("model") and blk["attn"]["o"]["b"] == P()
    assert blk["mlp"]["fc"]["w"] == P(None, "model") and blk["mlp"]["proj"]["w"] == P("model")
    assert specs["wte"]["w"] == P() and blk["norm1"]["scale"] == P()
    assert rules.spec(("batch", None)) == P("data")
    assert cfx.Rules({"batch": ("data", "model")}).spec(("batch",)) == P(("data", "model"))


def test_bad_rules():
    with pytest.raises(ValueError, match=r"leaf 'x'.*maps mesh axis 'model' to two dimensions"):
        cfx.Rules({"embed": "model", "mlp": "model"}).spec(("embed", "mlp"), path="x")
    with cfx.Mesh({"data": 2}) as mesh:
        with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
            cfx.Rules({"mlp": "model"}).specs(cfx.models.gpt2("tiny").axes(), mesh=mesh)
