"""shard_map checks by default that an output is the same along the axes its out_spec leaves out
(``replication``): by the varying-axes types where tracked, by comparing samples (or every
element) of the replicas otherwise; under torchrun, see test_ledger's ``replication`` case."""
import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx import P
from cfx._src.spmd import replication


@pytest.mark.timeout(60)
def test_an_unreduced_output_with_a_replicated_spec_is_refused():
    # the case: arange(4) * 2 over data=2 came back as tensor([0., 2.])
    with cfx.Mesh({"data": 2}) as mesh:
        f = cfx.shard_map(lambda x: x * 2, mesh=mesh, in_specs=P("data"), out_specs=P())
        with pytest.raises(ValueError) as e:
            f(torch.arange(4.0))
    msg = str(e.value)
    assert "output '<root>' varies over mesh axis 'data'" in msg
    assert "rank 1 {'data': 1} differs from rank 0 {'data': 0}" in msg
    assert "cfx.lax.psum / pmean" in msg and "P('data')" in msg and "check_rep=False only skips" in msg


@pytest.mark.timeout(60)
def test_the_message_tells_a_forgotten_pvary_from_a_forgotten_psum_and_check_vma_fixes_the_first():
    """A replicated param meeting a column-split weight: its gradient is each rank's part. The message
    names both programs that end there; ``check_vma=True`` (JAX's implicit pvary) computes one device's."""
    def body(emb, w1, x):
        return cfx.grad(lambda e: torch.tanh(x @ e @ w1).sum())(emb)
    g = torch.Generator().manual_seed(0)
    emb, w1, x = torch.randn(3, 3, generator=g), torch.randn(3, 4, generator=g), torch.randn(2, 3, generator=g)
    with cfx.Mesh({"model": 2}) as mesh:
        f = lambda **kw: cfx.shard_map(body, mesh=mesh, in_specs=(P(), P(None, "model"), P()), out_specs=P(), **kw)  # noqa: E731
        with pytest.raises(ValueError, match=r"never summed.*cfx.lax.psum / pmean.*the gradient of a param the same "
                                             r"on every rank.*check_vma=True.*cfx.lax.pvary\(x, 'model'\)"):
            f()(emb, w1, x)
        torch.testing.assert_close(cfx.device_get(f(check_vma=True)(emb, w1, x)), body(emb, w1, x))


@pytest.mark.timeout(60)
def test_reduced_or_split_outputs_pass_and_check_rep_false_trusts_the_spec():
    x = torch.arange(8.0)
    with cfx.Mesh({"data": 2}) as mesh:
        total = cfx.shard_map(lambda b: cfx.lax.psum(b.sum(), "data"), mesh=mesh, in_specs=P("data"),
                              out_specs=P())(x)
        same = cfx.shard_map(lambda b: b * 2, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(x)
        first = cfx.shard_map(lambda b: b * 2, mesh=mesh, in_specs=P("data"), out_specs=P(),
                              check_rep=False)(x)
    assert float(cfx.device_get(total)) == 28.0
    assert torch.equal(cfx.device_get(same), x * 2)
    assert torch.equal(cfx.device_get(first), x[:4] * 2)  # the opt-out keeps rank 0's block


@pytest.mark.timeout(60)
def test_the_axis_named_is_the_one_it_varies_over():
    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        def body(p):  # p varies over model only (split there), reduced over nothing
            return {"ok": cfx.lax.psum(p, "model"), "w": p}
        f = cfx.shard_map(body, mesh=mesh, in_specs=P("model"), out_specs={"ok": P(), "w": P()})
        with pytest.raises(ValueError, match=r"output 'w' varies over mesh axis 'model' of Mesh\(\{'data': 2, "
                                             r"'model': 2\}.*rank 1 \{'data': 0, 'model': 1\} differs from rank 0"):
            f(torch.arange(4.0))
        both = cfx.shard_map(lambda x: x, mesh=mesh, in_specs=P(("data", "model")), out_specs=P())
        with pytest.raises(ValueError, match="varies over mesh axis 'data' and 'model'.*P\\(\\('data', 'model'\\)\\)"):
            both(torch.arange(4.0))


@pytest.mark.timeout(60)
def test_full_compares_every_element_where_the_sample_cannot_see():
    n = 10 * replication.SAMPLE + 1  # the sample reads elements 0, 10, 20, ...; element 5 is not among them

    def body(x):
        y = x.clone()
        y[5] += cfx.lax.axis_index("data")  # rank 1 differs in one element (a Python-made variation)
        return y
    with cfx.Mesh({"data": 2}) as mesh:
        x = torch.zeros(n)
        sampled = cfx.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())(x)
        assert float(cfx.device_get(sampled)[5]) == 0.0  # rank 0's: the default sample missed it
        with pytest.raises(ValueError, match="rank 1 \\{'data': 1\\} differs from rank 0 \\{'data': 0\\}\\)"):
            cfx.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_rep="full")(x)


@pytest.mark.timeout(60)
def test_equal_values_pass_bit_for_bit_including_nan_and_signed_zero():
    def body(x):
        r = cfx.lax.axis_index("data")
        return torch.tensor([float("nan"), -0.0 if r else 0.0, 1.5], dtype=torch.bfloat16), int(x.numel())
    with cfx.Mesh({"data": 2}) as mesh:
        out, n = cfx.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P(), check_rep="full")(torch.ones(4))
    assert cfx.device_get(out)[2] == 1.5 and n == 2


@pytest.mark.timeout(60)
def test_python_outputs_are_compared_too():
    with cfx.Mesh({"data": 2}) as mesh:
        f = cfx.shard_map(lambda x: {"rank": cfx.lax.axis_index("data")}, mesh=mesh, in_specs=P(), out_specs=P())
        with pytest.raises(ValueError, match="output 'rank' varies over mesh axis 'data'"):
            f(torch.ones(2))


@pytest.mark.timeout(60)
def test_tracked_types_refuse_a_varying_output_even_when_the_values_agree():
    # as JAX's check_vma: x * 0 is zero everywhere, but its type varies over data
    with cfx.Mesh({"data": 2}) as mesh:
        f = cfx.shard_map(lambda x: x * 0, mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=True)
        with pytest.raises(ValueError, match="varies over mesh axis 'data'.*its type, cfx.lax.varying_axes, says so"):
            f(torch.ones(4))
        ok = cfx.shard_map(lambda x: cfx.lax.pmean(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P(),
                           check_vma=True)(torch.ones(4))
    assert torch.equal(cfx.device_get(ok), torch.ones(2))


@pytest.mark.timeout(60)
def test_differentiated_bodies_are_checked_by_their_types():
    w = torch.randn(2, requires_grad=True)
    with cfx.Mesh({"data": 2}) as mesh:
        bad = cfx.shard_map(lambda w, x: (w * x).sum(), mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
        with pytest.raises(ValueError, match="output '<root>' varies over mesh axis 'data'.*its type"):
            cfx.grad(lambda w: bad(w, torch.ones(4)))(w)
        good = cfx.shard_map(lambda w, x: cfx.lax.psum((w * x).sum(), "data"), mesh=mesh,
                             in_specs=(P(), P("data")), out_specs=P())
        g = cfx.grad(lambda w: good(w, torch.ones(4)))(w)
    assert torch.equal(g, torch.full((2,), 2.0))  # w's cotangent summed over data


def test_bad_check_rep_values_are_refused():
    with cfx.Mesh({"data": 2}) as mesh:
        with pytest.raises(ValueError, match="check_rep must be True .*'full'.*or False"):
            cfx.shard_map(lambda x: x, mesh=mesh, in_specs=P(), out_specs=P(), check_rep="sample")


MESHES = [{"data": 2}, {"data": 2, "model": 2}, {"pipe": 2, "data": 1, "model": 2}]


@pytest.mark.timeout(120)
@given(shape=st.sampled_from(MESHES), data=st.data())
def test_refused_exactly_when_an_axis_it_varies_over_is_left_out(shape, data):
    axes = list(shape)
    varies = data.draw(st.sets(st.sampled_from(axes)), label="varies")      # the body adds axis_index there
    named = data.draw(st.lists(st.sampled_from(axes), unique=True, max_size=1), label="named")
    spec = P(tuple(named)) if named else P()

    def body(x):  # x is replicated; a Python-made variation along `varies`
        return x + sum(10.0 ** i * cfx.lax.axis_index(a) for i, a in enumerate(sorted(varies)))
    with cfx.Mesh(shape) as mesh:
        f = cfx.shard_map(body, mesh=mesh, in_specs=P(), out_specs=spec)
        bad = [a for a in axes if a in varies and a not in named and shape[a] > 1]
        if bad:
            with pytest.raises(ValueError, match="varies over mesh axis " + " and ".join(repr(a) for a in bad)):
                f(torch.zeros(4))
        else:
            f(torch.zeros(4))


@pytest.mark.timeout(120)
def test_under_torchrun_every_rank_reaches_the_same_verdict(tmp_path):
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "cfx_tests.replication_script", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(2):
        got = dict(line.split(" ", 1) for line in (tmp_path / f"rank{r}.txt").read_text().splitlines())
        assert got["reduced"] == "ok [2.0, 4.0]"
        assert got["unreduced"].startswith("ValueError shard_map: output '<root>' varies over mesh axis 'data'")
        assert "rank 1 {'data': 1} differs from rank 0 {'data': 0} in a sample of 64 elements" in got["unreduced"]
        assert got["opt_out"] == f"ok {[0.0, 2.0] if r == 0 else [4.0, 6.0]}"  # each process keeps its own
        assert got["nested"].startswith("ValueError shard_map: output 'b.0' varies over mesh axis 'data'")
        assert got["sampled"].startswith("ok ")  # element 5 is outside the default sample
        assert got["full"].startswith("ValueError") and "differs from rank 0 {'data': 0})" in got["full"]
        assert got["after"] == "ok [0.0, 0.0]"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [True, "full"])
def test_the_dist_exchange_names_the_leaf_with_one_gather_when_all_agree(mode):
    # the dist path run on local ranks: more leaves than digest slots, two sets of left-out axes
    def outputs(bad_leaf):
        r = cfx.lax.axis_index("model")
        items = [(f"w{i}", torch.full((3, 5), float(i)), P()) for i in range(2 * replication.SLOTS + 3)]
        items += [(f"s{i}", torch.full((4,), float(i)), P("model")) for i in range(5)]
        if bad_leaf is not None:
            items[bad_leaf][1][1, 2] += r  # in the default sample: it reads every element of 15
        return items

    def body(x, bad_leaf, want):
        me = cfx.lax.axis_index(("data", "model"))
        with cfx.comm_stats() as stats:
            try:
                replication.check_values_dist(outputs(bad_leaf), mesh, mode, cfx.lax.all_gather)
                said = ""
            except ValueError as e:
                said = str(e)
        gathers = sum(r.rank == me and r.op == "all_gather" for r in stats.records)
        return torch.tensor([float(want in said and (said == "") == (want == "")), float(gathers)])

    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        for bad_leaf, want in [(None, ""), (70, "output 'w70' varies over mesh axis 'model'")]:
            got = cfx.device_get(cfx.shard_map(lambda x: body(x, bad_leaf, want), mesh=mesh, in_specs=P(),
                                               out_specs=P(("data", "model")))(torch.ones(2))).view(4, 2)
            assert got[:, 0].tolist() == [1.0] * 4, got  # every rank: the same verdict
            # one gather when all agree; the samples too only on a mismatch
            assert got[:, 1].tolist() == [1.0 if bad_leaf is None else 2.0] * 4, got
