"""ShardedArray as shard_map's currency: no copies on the way in or out, planned reshards, donation,
errors before any collective, gradients that compose with global ops."""
import pytest
import torch

import cfx
from cfx import P

pytestmark = pytest.mark.timeout(120)


def test_outputs_are_sharded_arrays_holding_the_body_blocks():
    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        seen = {}

        def body(b):
            out = b * 2
            seen[cfx.lax.axis_index(("data", "model"))] = out
            return out
        x = torch.arange(16.0).reshape(4, 4)
        out = cfx.shard_map(body, mesh=mesh, in_specs=P("data", "model"), out_specs=P("data", "model"))(x)
    assert isinstance(out, cfx.ShardedArray) and out.shape == (4, 4) and out.block_shape == (2, 2)
    assert repr(out) == ("ShardedArray(shape=(4, 4), dtype=float32, spec=P('data', 'model'), "
                         "Mesh({'data': 2, 'model': 2}, backend='local'))")
    for r, b in out.blocks.items():  # the body's own tensors: nothing was copied or assembled
        assert b.data_ptr() == seen[r].data_ptr()
    torch.testing.assert_close(cfx.device_get(out), x * 2)


def test_a_matching_spec_is_used_block_for_block_and_another_is_resharded_in_the_ranks():
    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        x = torch.arange(32.0).reshape(4, 8)
        arr = cfx.device_put(x, mesh, P("data", "model"))
        ptrs = {}

        def body(b):
            ptrs[cfx.lax.axis_index(("data", "model"))] = b.data_ptr()
            return b.sum()[None]
        with cfx.comm_stats() as stats:
            cfx.shard_map(body, mesh=mesh, in_specs=P("data", "model"), out_specs=P(("data", "model")))(arr)
        assert stats.count() == 0
        assert ptrs == {r: b.data_ptr() for r, b in arr.blocks.items()}  # the same storage, no copy

        with cfx.comm_stats() as stats:
            out = cfx.shard_map(lambda b: b, mesh=mesh, in_specs=P(None, ("data", "model")),
                                out_specs=P(None, ("data", "model")))(arr)
        torch.testing.assert_close(cfx.device_get(out), x)
        plan = cfx.reshard_plan(arr, P(None, ("data", "model")))
        assert [r.op for r in stats.select(rank=0)] == [s.op for s in plan.steps if s.op != "split"]
        assert plan.nbytes < plan.naive_bytes  # the planned moves, not a gather of the whole array


def test_state_stays_sharded_across_calls_and_donation_reuses_the_buffers():
    with cfx.Mesh({"data": 2}) as mesh:
        w = cfx.device_put(torch.ones(4, 2), mesh, P("data"))
        step = cfx.shard_map(lambda w, g: w - 0.5 * g, mesh=mesh, in_specs=(P("data"), P("data")),
                             out_specs=P("data"), donate_argnums=0)
        ptrs = {r: b.data_ptr() for r, b in w.blocks.items()}
        w2 = step(w, torch.full((4, 2), 2.0))
        assert {r: b.data_ptr() for r, b in w2.blocks.items()} == ptrs  # written in place
        assert w.is_deleted()
        with pytest.raises(ValueError, match="donated"):
            step(w, torch.zeros(4, 2))
        with pytest.raises(ValueError, match="donated"):
            cfx.device_get(w)
        torch.testing.assert_close(cfx.device_get(w2), torch.zeros(4, 2))


def test_scalar_conversion_only_for_replicated_single_values():
    with cfx.Mesh({"data": 2}) as mesh:
        s = cfx.shard_map(lambda x: cfx.lax.psum(x.sum(), "data"), mesh=mesh, in_specs=P("data"),
                          out_specs=P())(torch.arange(4.0))
        assert float(s) == 6.0 and s.item() == 6.0 and int(s) == 6
        v = cfx.device_put(torch.arange(2.0), mesh, P("data"))
        with pytest.raises(ValueError, match="device_get"):
            float(v)


def test_print_shows_the_global_value_and_repr_the_layout():
    with cfx.Mesh({"data": 2}) as mesh:
        arr = cfx.device_put(torch.arange(6.0).reshape(2, 3), mesh, P("data"))
        assert str(arr).startswith(repr(arr)) and "[3., 4., 5.]" in str(arr) and "tensor" not in repr(arr)


def test_device_get_maps_a_tree_and_leaves_other_leaves_alone():
    with cfx.Mesh({"data": 2}) as mesh:
        tree = {"a": cfx.device_put(torch.arange(4.0), mesh, P("data")), "b": torch.ones(2), "c": 3}
        got = cfx.device_get(tree)
    assert torch.equal(got["a"], torch.arange(4.0)) and got["b"] is tree["b"] and got["c"] == 3


def test_device_put_lays_out_a_pytree_by_a_spec_tree_or_one_spec():
    model = cfx.models.gpt2("tiny", n_layer=1, vocab_size=64)
    params = model.init(cfx.random.key(0))
    is_spec = lambda s: isinstance(s, P)  # noqa: E731
    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        specs = cfx.Rules(cfx.parallel.MEGATRON_RULES).specs(model.axes(), mesh=mesh)
        put = cfx.device_put(params, mesh, specs)  # a spec per leaf
        for (path, got), spec, want in zip(cfx.tree.flatten_with_path(put)[0], cfx.tree.leaves(specs, is_leaf=is_spec),
                                           cfx.tree.leaves(params)):
            assert isinstance(got, cfx.ShardedArray) and got.spec == spec and torch.equal(got.gather(), want), path
        assert any(s != P() for s in cfx.tree.leaves(specs, is_leaf=is_spec))
        one = cfx.device_put(params, mesh, P())  # one P for the whole tree: every leaf replicated
        assert all(a.spec == P() for a in cfx.tree.leaves(one))
        cfx.tree.assert_close(cfx.device_get(one), params, rtol=0, atol=0)
        prefix = cfx.device_put(params, mesh, {**{k: P() for k in params}, "wte": P("model")})  # a prefix
        assert prefix["wte"]["w"].spec == P("model") and prefix["ln_f"]["scale"].spec == P()
        with pytest.raises(ValueError, match=r"cfx.device_put: leaf 'w' with shape \(3, 4\).*divisible"):
            cfx.device_put({"w": torch.zeros(3, 4)}, mesh, P("data"))
        with pytest.raises(ValueError, match=r"cfx.device_put: specs do not match the values at '<root>'.*prefix"):
            cfx.device_put({"w": torch.zeros(4)}, mesh, {"b": P()})
        with pytest.raises(ValueError, match=r"leaf 'n' is a int, not a torch.Tensor"):
            cfx.device_put({"n": 3}, mesh, P())
    with pytest.raises(ValueError, match=r"cfx.device_put: mesh must be a cfx.Mesh, got NoneType"):
        cfx.device_put(torch.zeros(4), None, P("data"))  # (was a raw AttributeError)


@pytest.mark.parametrize("make,match", [
    (lambda m, other: cfx.device_put(torch.zeros(4), other, P("x")), "on Mesh.*'x': 2.*this call runs on"),
    (lambda m, other: {"w": torch.zeros(4)}, r"at 'args\[0\]'.*entries \['b', 'w'\].*entries \['w'\]"),
    (lambda m, other: cfx.device_put(torch.zeros(6), m, P()), "not divisible by 4"),
])
def test_bad_inputs_raise_before_any_rank_runs(make, match):
    ran = []
    with cfx.Mesh({"data": 2, "model": 2}) as mesh, cfx.Mesh({"x": 2}) as other:
        arg = make(mesh, other)
        spec = {"w": P(), "b": P()} if isinstance(arg, dict) else P(("data", "model"))
        f = cfx.shard_map(lambda a: ran.append(1) or a, mesh=mesh, in_specs=(spec,), out_specs=P())
        with cfx.comm_stats() as stats, pytest.raises(ValueError, match=match) as e:
            f(arg)
    assert "Mesh({'data': 2, 'model': 2}" in str(e.value)
    assert not ran and stats.count() == 0


def test_a_structure_mismatch_names_the_leaf_and_the_fix():
    with cfx.Mesh({"data": 2}) as mesh:
        f = cfx.shard_map(lambda p: p, mesh=mesh, in_specs=({"w": P("data"), "b": P()},), out_specs=P())
        with pytest.raises(ValueError, match="'args.0.'.*pytree prefix"):
            f({"w": cfx.device_put(torch.zeros(4), mesh, P("data")), "bias": torch.zeros(2)})
        g = cfx.shard_map(lambda p: p, mesh=mesh, in_specs=({"blocks": [{"w": P("data")}]},), out_specs=P())
        with pytest.raises(ValueError, match=r"'args\[0\].blocks.0'.*\['w'\].*\['b', 'w'\]"):
            g({"blocks": [{"w": torch.zeros(4), "b": torch.zeros(2)}]})


def test_grad_wrt_sharded_arrays_keeps_their_layout_and_composes_with_global_ops():
    torch.manual_seed(0)
    x, w, v = torch.randn(8, 6), torch.randn(6, 4), torch.randn(4)
    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        ws = cfx.device_put(w, mesh, P(None, "model"))

        def f(ws, v):
            h = cfx.shard_map(lambda xb, wb: xb @ wb, mesh=mesh, in_specs=(P("data"), P(None, "model")),
                              out_specs=P("data", "model"))(x, ws)
            h = cfx.reshard(h, P(None, "data"))                       # a planned move, differentiated
            g = torch.tanh(cfx.device_get(h)) * v                      # global torch ops in between
            back = cfx.device_put(g, mesh, P("data"))
            return cfx.shard_map(lambda b: cfx.lax.psum((b ** 2).sum(), "data"), mesh=mesh,
                                 in_specs=P("data"), out_specs=P())(back)
        loss, (gw, gv) = cfx.value_and_grad(f, argnums=(0, 1))(ws, v)
    ref_loss, (rw, rv) = cfx.value_and_grad(lambda w, v: ((torch.tanh(x @ w) * v) ** 2).sum(), argnums=(0, 1))(w, v)
    assert isinstance(gw, cfx.ShardedArray) and gw.spec == P(None, "model")
    torch.testing.assert_close(float(loss), float(ref_loss))
    torch.testing.assert_close(cfx.device_get(gw), rw)
    torch.testing.assert_close(gv, rv)


def test_grad_inside_a_plain_body_gives_each_ranks_partial_gradient():
    # not differentiated from outside: no implicit pvary, so data parallelism reduces explicitly
    x = torch.arange(8.0).reshape(4, 2)
    w = torch.ones(2)

    def body(xb, w):
        g = cfx.grad(lambda w: (xb @ w).sum())(w)
        return g[None], cfx.lax.psum(g, "data")
    with cfx.Mesh({"data": 2}) as mesh:
        local, total = cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=(P("data"), P()),
                                                    out_specs=(P("data"), P()))(x, w))
    torch.testing.assert_close(local, torch.stack([x[:2].sum(0), x[2:].sum(0)]))
    torch.testing.assert_close(total, x.sum(0))


def test_varying_axes_follow_jax_and_need_tracking():
    def body(xb, w):
        y = xb * w
        s = cfx.lax.psum(y, "data")
        g = cfx.lax.all_gather(w, "model", tiled=True)
        return torch.tensor([sorted(cfx.lax.varying_axes(t)) == want
                             for t, want in ((xb, ["data"]), (w, []), (y, ["data"]), (s, []), (g, ["model"]))])
    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        ok = cfx.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P(), check_vma=True)
        assert bool(cfx.device_get(ok(torch.ones(4, 2), torch.ones(2))).all())
        with pytest.raises(ValueError, match="check_vma=True"):
            cfx.shard_map(lambda x: cfx.lax.varying_axes(x), mesh=mesh, in_specs=P(), out_specs=P())(torch.ones(1))


def test_grad_through_a_body_that_also_returns_plain_values():
    # a static output before the array output must not shift which cotangent goes where
    x = torch.arange(4.0)
    with cfx.Mesh({"data": 2}) as mesh:
        def f(w):
            n, loss = cfx.shard_map(lambda xb, w: ("tag", cfx.lax.psum((xb * w).sum(), "data")), mesh=mesh,
                                    in_specs=(P("data"), P()), out_specs=(P(), P()))(x, w)
            assert n == "tag"
            return loss
        g = cfx.grad(f)(cfx.device_put(torch.ones(1), mesh))
    torch.testing.assert_close(cfx.device_get(g), x.sum()[None])


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_grad_from_outside_through_a_dp_x_tp_model_equals_single_device(family):
    # the replicated params meet the data-split batch: implicit pvary sums their cotangents over
    # `data`; Megatron's own f/g points do the rest. No tree_pmean anywhere.
    from cfx._src.parallel.megatron import MEGATRON_RULES, tensor_parallel
    model = (cfx.models.gpt2 if family == "gpt2" else cfx.models.llama)("tiny", vocab_size=64, n_layer=2)
    tokens = cfx.random.randint(cfx.random.key(1), (4, 17), 0, 64)
    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        specs = cfx.Rules({"batch": "data", **MEGATRON_RULES}).specs(model.axes(), mesh=mesh)
        tp = tensor_parallel(model, "model")
        f = cfx.shard_map(lambda p, t: cfx.lax.pmean(tp.loss(p, t[:, :-1], t[:, 1:]), "data"), mesh=mesh,
                          in_specs=(specs, P("data")), out_specs=P())
        params = cfx.init_sharded(model.init, cfx.random.key(0), mesh=mesh, specs=specs)
        loss, grads = cfx.value_and_grad(f)(params, tokens)
        grads = cfx.device_get(grads)
    ref_loss, ref = cfx.value_and_grad(lambda p: model.loss(p, tokens[:, :-1], tokens[:, 1:]))(
        model.init(cfx.random.key(0)))
    torch.testing.assert_close(float(loss), float(ref_loss))
    cfx.tree.assert_tree_close(grads, ref, rtol=1e-4, atol=1e-6)


def test_pvary_over_an_axis_the_value_already_varies_over_is_refused_when_tracked():
    with cfx.Mesh({"data": 2}) as mesh:
        f = cfx.shard_map(lambda x: cfx.lax.psum(cfx.lax.pvary(x, "data").sum(), "data"), mesh=mesh,
                          in_specs=P("data"), out_specs=P())
        with pytest.raises(ValueError, match=r"already varies over \['data'\]"):
            cfx.grad(lambda x: f(x))(torch.ones(4))
