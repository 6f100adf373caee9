"""device_put / gather round trips and reshard between random specs (values and bytes)."""
import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx import P
from cfx import testing as cfxt

pytestmark = pytest.mark.timeout(120)


@given(cfxt.meshes(max_ranks=8), st.data())
def test_device_put_gather_round_trip(mesh_shape, data):
    shape = data.draw(cfxt.divisible_shapes(mesh_shape, ndim=data.draw(st.integers(1, 3))))
    spec = data.draw(cfxt.specs_for(shape, mesh_shape))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    with cfx.Mesh(mesh_shape) as mesh:
        arr = cfx.device_put(x, mesh, spec)
        assert torch.equal(arr.gather(), x)
        assert all(tuple(b.shape) == arr.block_shape for b in arr.blocks.values())


@given(cfxt.meshes(max_ranks=8), st.data())
def test_reshard_preserves_values_and_never_beats_naive_bytes_backwards(mesh_shape, data):
    shape = data.draw(cfxt.divisible_shapes(mesh_shape, ndim=data.draw(st.integers(1, 3))))
    src = data.draw(cfxt.specs_for(shape, mesh_shape))
    dst = data.draw(cfxt.specs_for(shape, mesh_shape))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    with cfx.Mesh(mesh_shape) as mesh:
        arr = cfx.device_put(x, mesh, src)
        plan = cfx.reshard_plan(arr, dst)
        assert plan.nbytes <= plan.naive_bytes + 1e-6
        with cfx.comm_stats() as stats:
            out = cfx.reshard(arr, dst)
        assert out.spec == dst
        assert torch.equal(out.gather(), x)
        expected = {s.op for s in plan.steps} - {"split"}
        seen = {r.op.replace("reduce_scatter", "psum_scatter").replace("all_reduce", "psum") for r in stats.records}
        assert seen == expected


def test_partial_sums_reduce_by_scatter_when_the_target_splits():
    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        x = torch.randn(8, 4)
        blocks = {r: x / 2 if mesh.coords(r)["model"] == 0 else x / 2 for r in range(4)}
        part = cfx.ShardedArray((8, 4), P(), mesh, blocks, partial=("model",))
        plan = cfx.reshard_plan(part, P("model"))
        assert [s.op for s in plan.steps] == ["psum_scatter"]
        assert plan.nbytes < plan.naive_bytes
        torch.testing.assert_close(cfx.reshard(part, P("model")).gather(), x)
        torch.testing.assert_close(cfx.reshard(part, P()).gather(), x)


def test_known_plan_and_bad_spec():
    with cfx.Mesh({"a": 2, "b": 2}) as mesh:
        arr = cfx.device_put(torch.zeros(8, 8), mesh, P("a", None))
        plan = cfx.reshard_plan(arr, P(None, "a"))
        assert [s.op for s in plan.steps] == ["all_to_all"]  # one all-to-all, not gather + split
        assert plan.nbytes == 8 * 8 * 4 / 2 / 2 and plan.naive_bytes == 8 * 8 * 4 / 2
        with pytest.raises(ValueError, match="not divisible"):
            cfx.reshard(cfx.device_put(torch.zeros(6, 3), mesh, P()), P(None, "a"))


@given(cfxt.meshes(max_ranks=4), st.data())
def test_testing_helper_checks_a_sharded_matmul(mesh_shape, data):
    axes = tuple(mesh_shape)
    n = 1
    for a in axes:
        n *= mesh_shape[a]
    x = torch.randn(4, 2 * n, dtype=torch.float64)
    w = torch.randn(2 * n, 3, dtype=torch.float64)
    with cfx.Mesh(mesh_shape) as mesh:  # row-parallel matmul: contraction dim split, psum the partials
        cfxt.assert_matches_reference(lambda xb, wb: cfx.lax.psum(xb @ wb, axes), lambda x, w: x @ w, (x, w),
                                      mesh=mesh, in_specs=(P(None, axes), P(axes)), out_specs=P())
