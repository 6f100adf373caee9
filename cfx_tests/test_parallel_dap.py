"""Dynamic Axial Parallelism (``cfx.parallel.dap``): the Evoformer over an ``axial`` axis equals one
device -- outputs in fp32 at ``assert_close``'s defaults, gradients of params and inputs in fp64
(the sharded sums only reorder additions) -- on 2 and 4 ranks, with masks, hypothesis over sizes;
composes with data parallelism over a batch dim; each block moves the formula's bytes; shards
that do not fit together are refused on every rank before any collective."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx import P
from cfx._src.models.evoformer_dap import comm_bytes
from cfx.parallel import tree_psum
from cfx_tests.budget import examples

pytestmark = pytest.mark.timeout(300)


def config(**kw):
    return cfx.models.EvoformerConfig.preset("tiny", n_blocks=2, softmax_impl="reference", **kw)


def inputs(S, R, cfg, *, batch=(), masks=True, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = lambda *s: torch.randn(*batch, *s, generator=g, dtype=dtype)  # noqa: E731
    m, z = t(S, R, cfg.c_m), t(R, R, cfg.c_z)
    mm = torch.rand(*batch, S, R, generator=g) > 0.25 if masks else None
    pm = torch.rand(*batch, R, R, generator=g) > 0.25 if masks else None
    return m, z, mm, pm, t(S, R, cfg.c_m), t(R, R, cfg.c_z)


def objective(model, params, m, z, mm, pm, cm, cz):
    mo, zo = model.apply(params, m, z, msa_mask=mm, pair_mask=pm)
    return (mo * cm).sum() + (zo * cz).sum(), (mo, zo)


def single(model, params, *xs):
    (value, outs), grads = cfx.value_and_grad(lambda p, m, z: objective(model, p, m, z, *xs[2:]), argnums=(0, 1, 2),
                                              has_aux=True)(params, *xs[:2])
    return value, outs, grads


def sharded(model, params, xs, shape, spec):
    """The DAP run of ``single`` on a mesh of ``shape``: m, z, masks and cotangents split by ``spec``."""
    dmodel = cfx.parallel.dap(model, "axial")
    reduce = tuple(a for a in shape)

    def body(p, m, z, mm, pm, cm, cz):
        (value, outs), grads = cfx.value_and_grad(lambda p, m, z: objective(dmodel, p, m, z, mm, pm, cm, cz),
                                                  argnums=(0, 1, 2), has_aux=True)(p, m, z)
        return cfx.lax.psum(value, reduce), outs, (tree_psum(grads[0], reduce), *grads[1:])

    specs = tuple(None if x is None else spec for x in xs)
    with cfx.Mesh(shape) as mesh:
        f = cfx.shard_map(body, mesh=mesh, in_specs=(P(), *[s or P() for s in specs]),
                          out_specs=(P(), (spec, spec), (P(), spec, spec)))
        return cfx.device_get(f(params, *xs))


@pytest.mark.parametrize("n", [2, 4])
@examples(ci=2)
@given(data=st.data())
def test_dap_equals_one_device(n, data):
    cfg = config()
    model = cfx.models.Evoformer(cfg)
    S = n * data.draw(st.integers(1, 2), label="sequences per rank")
    R = n * data.draw(st.integers(1, 3), label="residues per rank")
    masks = data.draw(st.booleans(), label="masks")
    params = model.init(cfx.random.key(data.draw(st.integers(0, 3))))
    xs = inputs(S, R, cfg, masks=masks)
    _, outs, _ = single(model, params, *xs)
    _, got_outs, _ = sharded(model, params, xs, {"axial": n}, P("axial"))
    cfx.tree.assert_tree_close(got_outs, outs)  # fp32 forward: the defaults
    # the objective and gradients in fp64: the sharded sums only reorder additions
    p64 = cfx.tree.map(lambda x: x.double(), params)
    xs64 = tuple(x if x is None or x.dtype == torch.bool else x.double() for x in xs)
    value, _, grads = single(model, p64, *xs64)
    got_value, _, got = sharded(model, p64, xs64, {"axial": n}, P("axial"))
    torch.testing.assert_close(got_value, value)
    cfx.tree.assert_tree_close(got, grads)


def test_dap_composes_with_data_parallelism():
    cfg = config()
    model = cfx.models.Evoformer(cfg)
    params = model.init(cfx.random.key(1))
    xs = inputs(4, 6, cfg, batch=(2,))
    _, outs, _ = single(model, params, *xs)
    _, got_outs, _ = sharded(model, params, xs, {"data": 2, "axial": 2}, P("data", "axial"))
    cfx.tree.assert_tree_close(got_outs, outs)  # fp32 forward: the defaults
    # the objective and gradients in fp64: the sharded sums only reorder additions (in fp32 the
    # outer-product-mean weight's gradient lands ~2e-5 off, which depends on the thread count)
    p64 = cfx.tree.map(lambda x: x.double(), params)
    xs64 = tuple(x if x is None or x.dtype == torch.bool else x.double() for x in xs)
    value, _, grads = single(model, p64, *xs64)
    got_value, _, got = sharded(model, p64, xs64, {"data": 2, "axial": 2}, P("data", "axial"))
    torch.testing.assert_close(got_value, value)
    cfx.tree.assert_tree_close(got, grads)


@pytest.mark.parametrize("n", [2, 4])
def test_each_block_moves_the_formulas_bytes(n):
    cfg = config()
    model = cfx.parallel.dap(cfx.models.Evoformer(cfg), "axial")
    params = model.init(cfx.random.key(0))
    S, R = 2 * n, 3 * n
    m, z, *_ = inputs(S, R, cfg, masks=False)
    with cfx.Mesh({"axial": n}) as mesh, cfx.comm_stats() as stats:
        cfx.shard_map(lambda p, m, z: model.apply(p, m, z), mesh=mesh, in_specs=(P(), P("axial"), P("axial")),
                      out_specs=(P("axial"), P("axial")))(params, m, z)
    want = comm_bytes(cfg, S, R, n)
    for op in ("all_to_all", "all_gather"):
        assert stats.bytes(op=op, axes="axial", rank=0) == cfg.n_blocks * want[op], op
    assert stats.count(op="all_to_all", rank=0) == 6 * cfg.n_blocks


def test_shards_that_do_not_fit_are_refused_before_any_collective():
    cfg = config()
    model = cfx.parallel.dap(cfx.models.Evoformer(cfg), "axial")
    params = model.init(cfx.random.key(0))

    def run(m, z, specs=(P("axial"), P("axial")), **kw):
        with cfx.Mesh({"axial": 2}) as mesh, cfx.comm_stats() as stats:
            try:
                cfx.shard_map(lambda p, m, z: model.apply(p, m, z, **kw), mesh=mesh, in_specs=(P(), *specs),
                              out_specs=(P("axial"), P("axial")))(params, m, z)
            finally:
                assert stats.count() == 0  # refused before any collective
    m, z, *_ = inputs(4, 6, cfg)
    with pytest.raises(ValueError, match="the MSA has 6 residues but the pair representation 4"):
        run(m, torch.randn(4, 4, cfg.c_z))
    with pytest.raises(ValueError, match="6 residues do not split into 2 row blocks"):
        run(m, z, specs=(P("axial"), P()))  # z whole on every rank: not a row shard
    with pytest.raises(ValueError, match="msa_mask"):
        run(m, z, msa_mask=torch.ones(2, 5, dtype=torch.bool))
    m5, z5, *_ = inputs(4, 5, cfg)
    with pytest.raises(ValueError, match="not divisible|split"):  # shard_map itself: 5 rows over 2 ranks
        run(m5, z5)
