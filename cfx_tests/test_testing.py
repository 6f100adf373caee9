"""cfx.testing's strategies draw what they promise: meshes with required axes and sizes dividing the
user's dims, plans over more than one rank (the expert axis for a mixture of experts only, or the
axes asked for), specs that fit."""
import math

import pytest
from hypothesis import given, strategies as st

import cfx


@given(cfx.testing.meshes(max_ranks=8, required=("model",), divides=(12, 8)))
def test_meshes_have_the_required_axes_and_divide_the_dims(shape):
    assert shape["model"] >= 2 and math.prod(shape.values()) <= 8
    assert all(12 % n == 0 and 8 % n == 0 for n in shape.values())


@given(cfx.testing.meshes(max_ranks=4, min_ranks=2))
def test_meshes_honour_min_ranks(shape):
    assert 2 <= math.prod(shape.values()) <= 4


@pytest.mark.parametrize("kwargs,match", [(dict(required=("seq",)), r"required axes \['seq'\] are not among names"),
                                          (dict(required=("model",), divides=(3, 5)), "no size of axis 'model' fits")])
def test_meshes_refuse_what_cannot_be_drawn(kwargs, match):
    @given(cfx.testing.meshes(**kwargs))
    def draw(shape):
        pass
    with pytest.raises(ValueError, match=match):
        draw()


@given(st.data())
def test_plans_shard_over_more_than_one_rank_and_specs_fit(data):
    plan = data.draw(cfx.testing.plans(cfx.models.gpt2("tiny", n_layer=2, vocab_size=64), max_ranks=4,
                                       remat=("none",), offload=("none",)))
    assert math.prod(dict(plan.mesh).values()) >= 2
    shape = data.draw(cfx.testing.meshes(max_ranks=4))
    spec = data.draw(cfx.testing.specs_for((8, 12), shape))
    for dim, axes in zip((8, 12), spec):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
        assert dim % math.prod(shape[a] for a in axes) == 0


@given(st.data())
def test_plans_draw_the_expert_axis_for_a_mixture_of_experts_only(data):
    dense = data.draw(cfx.testing.plans(cfx.models.gpt2("tiny", n_layer=2, vocab_size=64), max_ranks=4,
                                        remat=("none",), offload=("none",)))
    assert "expert" not in dict(dense.mesh)
    moe = cfx.models.mixtral("tiny", n_layer=2, vocab_size=64, hidden_size=32, intermediate_size=48, n_head=4,
                             n_kv_heads=2, n_experts=4)
    plan = data.draw(cfx.testing.plans(moe, axes=("data", "expert"), max_ranks=4, remat=("none",), offload=("none",)))
    assert set(dict(plan.mesh)) <= {"data", "expert"} and plan.batch_axes
    with pytest.raises(ValueError, match=r"axes=\('rows',\) must be a non-empty subset of PLAN_AXES"):
        data.draw(cfx.testing.plans(moe, axes=("rows",)))


def test_plans_draw_the_expert_axis_beside_data_by_default():
    from hypothesis import find
    moe = cfx.models.mixtral("tiny", n_layer=2, vocab_size=64, hidden_size=32, intermediate_size=48, n_head=4,
                             n_kv_heads=2, n_experts=4)
    plan = find(cfx.testing.plans(moe, max_ranks=4, remat=("none",), offload=("none",)),
                lambda p: dict(p.mesh).get("expert") == 2 and "data" in dict(p.mesh))
    assert set(plan.batch_axes) == {"data", "expert"}


def _own_loss(p, x, y):
    return ((x @ p["w1"] @ p["w2"] - y) ** 2).mean()


@given(st.data())
def test_plans_over_your_own_loss_function_draw_what_it_can_take(data):
    """``plans(loss_fn, params=, specs=)`` (the README offers it for your own model) draws data with
    ZeRO / offload and the model axis its specs name -- no draw a function cannot take, so hypothesis
    rejects few -- and each drawn plan builds its check for that function."""
    import torch
    params = {"w1": torch.randn(4, 8), "w2": torch.randn(8, 4)}
    specs = {"w1": cfx.P(None, "model"), "w2": cfx.P("model", None)}
    plan = data.draw(cfx.testing.plans(_own_loss, params=params, specs=specs, max_ranks=4))
    assert set(dict(plan.mesh)) <= {"data", "model"} and plan.remat != "auto" and plan.sp in (None, "none")
    plan.check(_own_loss, params=params, specs=specs)
    alone = data.draw(cfx.testing.plans(_own_loss, params=params, max_ranks=4))  # no specs: no model axis
    assert set(dict(alone.mesh)) == {"data"}


@given(st.data())
def test_plans_of_a_loss_function_without_its_params_say_so(data):
    # (it was hypothesis' Unsatisfiable: every draw rejected, no hint)
    with pytest.raises(ValueError, match=r"pass the starting params \(params=\) or a function making them"):
        data.draw(cfx.testing.plans(_own_loss))
