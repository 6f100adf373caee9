"""cfx.pipeline executor: every schedule equals single-device value_and_grad, alone and in 3D
(DP x PP x TP), with remat, over training steps; measured in-flight activations; bad input."""
import dataclasses
import time

import pytest
import torch

import cfx
from cfx import P
from cfx import pipeline
from cfx.parallel import MEGATRON_RULES, state_specs, tensor_parallel, tree_pmean

B, T, V = 8, 16, 256
SCHEDULES = {
    "gpipe": lambda p, m: pipeline.gpipe(p, m),
    "1f1b": lambda p, m: pipeline.one_f_one_b(p, m),
    "interleaved": lambda p, m: pipeline.interleaved_1f1b(p, m, 2),
    "zb_h1": lambda p, m: pipeline.zb_h1(p, m),
}


def gpt2(n_layer=4, **kw):
    return cfx.models.gpt2("tiny", n_layer=n_layer, vocab_size=V, n_embd=kw.pop("n_embd", 64),
                           n_head=4, n_positions=T, **kw)


def batch(seed=1, rows=B):
    d = cfx.random.randint(cfx.random.key(seed), (rows, T + 1), 0, V)
    return d[:, :-1], d[:, 1:]


def pipelined(step, mesh, params, x, y):
    return cfx.device_get(cfx.shard_map(step, mesh=mesh, in_specs=(P(), P(), P()), out_specs=(P(), P()),
                         check_rep=True)(params, x, y))


def check_against_single_device(model, schedules, *, x, y, params=None):
    params = model.init(cfx.random.key(0)) if params is None else params
    ref_loss, ref_grads = cfx.value_and_grad(lambda p: model.loss(p, x, y))(params)
    with cfx.Mesh({"pipe": schedules[0].n_ranks}) as mesh:
        for sched in schedules:
            loss, grads = pipelined(pipeline(model, sched), mesh, params, x, y)
            torch.testing.assert_close(loss, ref_loss)
            cfx.tree.assert_tree_close(grads, ref_grads)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_equals_value_and_grad_on_pipe2(name):
    x, y = batch()
    y = y.clone()
    y[0, :5] = -100  # ignored targets: microbatch losses are weighted by their valid tokens
    check_against_single_device(gpt2(), [SCHEDULES[name](2, m) for m in (2, 4)], x=x, y=y)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", SCHEDULES)
def test_loss_runs_only_the_forward_half(name):
    model, (x, y) = gpt2(), batch()
    y = y.clone()
    y[1, :7] = -100
    params = model.init(cfx.random.key(0))
    sched = SCHEDULES[name](2, 4)
    step = pipeline(model, sched)
    with cfx.Mesh({"pipe": 2}) as mesh, cfx.comm_stats() as stats:
        loss = cfx.device_get(cfx.shard_map(step.loss, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(),
                                            check_rep=True)(params, x, y))
    torch.testing.assert_close(loss, model.loss(params, x, y))
    sends = stats.select(op="send")
    # each microbatch's activation crosses every stage boundary once; no gradient comes back
    assert len(sends) == (sched.n_stages - 1) * 4 and all(not r.backward for r in sends)


@pytest.mark.timeout(90)
def test_pipe4_schedules_and_llama():
    x, y = batch()
    check_against_single_device(gpt2(8, n_embd=32), [SCHEDULES[n](4, 4) for n in SCHEDULES], x=x, y=y)
    llama = cfx.models.llama("tiny", vocab_size=V, n_layer=4, hidden_size=32, n_head=4, n_kv_heads=2,
                             intermediate_size=48, max_position_embeddings=T)
    check_against_single_device(llama, [pipeline.zb_h1(4, 8), pipeline.one_f_one_b(4, 2)], x=x, y=y)


@pytest.mark.timeout(60)
def test_remat_blocks_and_contributions_psum_to_the_full_gradient():
    model = gpt2()
    params = model.init(cfx.random.key(0))
    x, y = batch()
    check_against_single_device(model.map_blocks(cfx.remat), [pipeline.one_f_one_b(2, 4),
                                                               pipeline.zb_h1(2, 4)], x=x, y=y)
    ref_loss, ref_grads = cfx.value_and_grad(lambda p: model.loss(p, x, y))(params)
    step = pipeline(model, pipeline.one_f_one_b(2, 2), sum_grads=False)
    with cfx.Mesh({"pipe": 2}) as mesh:
        per_rank = cfx.device_get(cfx.shard_map(lambda *a: step(*a)[1], mesh=mesh, in_specs=(P(), P(), P()),
                                 out_specs=P("pipe"))(params, x, y))  # dim 0 concatenated by rank
    halves = [cfx.tree.map(lambda g, r=r: g.chunk(2)[r] if g.dim() else g, per_rank) for r in (0, 1)]
    assert all(float(g.abs().sum()) == 0 for g in cfx.tree.leaves(halves[0]["blocks"][2:]))
    assert float(halves[1]["wpe"]["w"].abs().sum()) == 0  # rank 1 holds no position embedding
    cfx.tree.assert_tree_close(cfx.tree.map(torch.add, *halves), ref_grads)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["1f1b", "zb_h1"])
def test_dp_pp_tp_training_equals_single_device(name):
    model = gpt2(2, n_embd=32)
    params = model.init(cfx.random.key(0))
    tx = cfx.optim.sgd(0.3, momentum=0.9)  # linear in the gradients, see test_megatron
    data = cfx.random.randint(cfx.random.key(3), (3, 8, T + 1), 0, V)
    ref_p, ref_s, ref_losses = params, tx.init(params), []
    for d in data:
        loss, g = cfx.value_and_grad(lambda p: model.loss(p, d[:, :-1], d[:, 1:]))(ref_p)
        u, ref_s = tx.update(g, ref_s, ref_p)
        ref_p, ref_losses = cfx.optim.apply_updates(ref_p, u), ref_losses + [loss]
    with cfx.Mesh({"pipe": 2, "data": 2, "model": 2}) as mesh:
        rules = cfx.Rules({"batch": "data", **MEGATRON_RULES})
        pspecs = rules.specs(model.axes(), mesh=mesh)
        sspecs = state_specs(tx.init(params), params, pspecs)
        step = pipeline(tensor_parallel(model, "model"), SCHEDULES[name](2, 2))

        def train(p, s, d):  # per rank: its data shard, its TP shard, its pipeline stage's work
            loss, g = step(p, d[:, :-1], d[:, 1:])
            u, s = tx.update(tree_pmean(g, "data"), s, p)
            return cfx.optim.apply_updates(p, u), s, cfx.lax.pmean(loss, "data")
        f = cfx.shard_map(train, mesh=mesh, in_specs=(pspecs, sspecs, rules.spec(("batch",))),
                          out_specs=(pspecs, sspecs, P()), check_rep=True)
        p, s, losses = params, tx.init(params), []
        for d in data:
            p, s, loss = f(p, s, d)
            losses.append(cfx.device_get(loss))
        p = cfx.device_get(p)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    cfx.tree.assert_tree_close(p, ref_p)


@pytest.mark.timeout(60)
def test_five_adamw_steps_match_single_device():
    model = gpt2(4, n_embd=32)
    params = model.init(cfx.random.key(0))
    tx = cfx.optim.adamw(1e-3, weight_decay=0.1)
    data = cfx.random.randint(cfx.random.key(5), (5, B, T + 1), 0, V)
    ref_p, ref_s = params, tx.init(params)
    for d in data:
        _, g = cfx.value_and_grad(lambda p: model.loss(p, d[:, :-1], d[:, 1:]))(ref_p)
        u, ref_s = tx.update(g, ref_s, ref_p)
        ref_p = cfx.optim.apply_updates(ref_p, u)
    step = pipeline(model, pipeline.interleaved_1f1b(2, 4, 2))

    def train(p, s, d):
        _, g = step(p, d[:, :-1], d[:, 1:])
        u, s = tx.update(g, s, p)
        return cfx.optim.apply_updates(p, u), s
    with cfx.Mesh({"pipe": 2}) as mesh:
        f = cfx.shard_map(train, mesh=mesh, in_specs=(P(), P(), P()), out_specs=(P(), P()),
                          check_rep=True)
        p, s = params, tx.init(params)
        for d in data:
            p, s = f(p, s, d)
        p = cfx.device_get(p)
    cfx.tree.assert_tree_close(p, ref_p)


@pytest.mark.timeout(60)
def test_in_flight_activations_measured_on_rank0():
    model = gpt2()
    params = model.init(cfx.random.key(0))
    p, m = 2, 4

    def activation_peaks(sched, x, y):
        with cfx.Mesh({"pipe": p}) as mesh, cfx.memory.track() as mem:
            pipelined(pipeline(model, sched), mesh, params, x, y)
            assert mem.live("device", kind="activation") == 0  # all freed by the backwards
            return [mem.peak_by_kind("device", rank=r)["activation"] for r in range(p)]
    x, y = batch()
    one = activation_peaks(pipeline.gpipe(p, 1), x[:B // m], y[:B // m])  # one microbatch's worth
    gpipe = activation_peaks(pipeline.gpipe(p, m), x, y)
    ofob = activation_peaks(pipeline.one_f_one_b(p, m), x, y)
    assert one[0] > 0
    assert gpipe[0] == m * one[0]            # GPipe: all m forwards before any backward
    assert ofob[0] == min(p, m) * one[0]     # 1F1B: at most p on rank 0
    assert ofob[0] < gpipe[0]


@pytest.mark.timeout(60)
def test_trace_gives_the_measured_timeline_and_messages_are_send_recv():
    model = gpt2()
    sched = pipeline.zb_h1(2, 4)
    x, y = batch()
    with cfx.Mesh({"pipe": 2}) as mesh, cfx.comm_stats() as stats, pipeline.trace() as tr:
        pipelined(pipeline(model, sched), mesh, model.init(cfx.random.key(0)), x, y)
    tl = tr.timeline()
    assert tl.schedule is sched and tl.makespan > 0 and 0 <= tl.bubble_fraction < 1
    for r in range(2):
        assert [a for a, _, _ in tl.events[r]] == sched.compute_actions(r)
        starts = [s for _, s, _ in tl.events[r]]
        assert starts == sorted(starts) and all(s < e for _, s, e in tl.events[r])
    assert pipeline.grid(tl).startswith("zb_h1: p=2 m=4")
    msg = B // 4 * T * 64 * 4  # one (b, T, C) fp32 activation or gradient
    for kind in ("send", "recv"):
        recs = stats.select(op=kind, rank=0)
        assert len(recs) == sum(a.kind.startswith(kind.upper()) for a in sched.actions[0])
        assert all(r.nbytes == msg for r in recs)


@pytest.mark.timeout(60)
def test_bad_input_raises_on_every_rank_before_any_message():
    model = gpt2(2)
    params = model.init(cfx.random.key(0))
    x, y = batch(rows=6)
    cases = [  # (mesh, step factory run on each rank, message)
        ({"pipe": 2}, lambda: pipeline(model, pipeline.one_f_one_b(2, 4)), "batch of 6 rows does not split"),
        ({"data": 2}, lambda: pipeline(model, pipeline.one_f_one_b(2, 2)), "has no 'pipe' axis"),
        ({"pipe": 4}, lambda: pipeline(model, pipeline.zb_h1(2, 2)), "is for 2 ranks but axis 'pipe'"),
        ({"pipe": 2}, lambda: pipeline(model, pipeline.interleaved_1f1b(2, 2, 2)),
         "4 stages but the model has only 2"),
    ]
    for shape, factory, message in cases:
        with cfx.Mesh(shape) as mesh:
            def body(p, x, y):
                try:
                    factory()(p, x, y)
                except ValueError as e:
                    assert message in str(e), str(e)
                    return torch.ones(1)
                return torch.zeros(1)
            with cfx.comm_stats() as stats:
                flags = cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()),
                                      out_specs=P(tuple(mesh.axis_names)))(params, x, y))
            assert flags.tolist() == [1.0] * mesh.size, message  # every rank raised
            assert stats.count() == 0, stats.table()              # before any message
            with pytest.raises(ValueError, match=message):        # and it surfaces as is
                cfx.device_get(cfx.shard_map(lambda p, x, y: factory()(p, x, y), mesh=mesh,
                              in_specs=(P(), P(), P()), out_specs=(P(), P()))(params, x, y))
    with pytest.raises(ValueError, match="outside any mesh"):
        pipeline(model, pipeline.gpipe(1, 2))(params, x[:2], y[:2])
    with pytest.raises(pipeline.ScheduleError):
        sched = pipeline.gpipe(2, 2)
        bad = pipeline.Schedule("bad", 2, 2, 1, (sched.actions[0][:-1], sched.actions[1]))
        pipeline(model, bad)


@dataclasses.dataclass(frozen=True)
class _Failing:
    """A block whose apply raises: a failure in the middle of a schedule."""

    block: object

    def init(self, key):
        return self.block.init(key)

    def axes(self):
        return self.block.axes()

    def apply(self, params, x, **kw):
        raise RuntimeError("block failed")


@pytest.mark.timeout(60)
def test_a_rank_failing_mid_schedule_fails_every_rank_fast_and_the_mesh_recovers():
    model = gpt2()
    bad = dataclasses.replace(model, blocks=model.blocks[:3] + (_Failing(model.blocks[3]),))
    params = model.init(cfx.random.key(0))
    x, y = batch()
    with cfx.Mesh({"pipe": 2}, timeout=30) as mesh:
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match="block failed"):  # rank 0 waits in a RECV meanwhile
            pipelined(pipeline(bad, pipeline.one_f_one_b(2, 4)), mesh, params, x, y)
        assert time.perf_counter() - t0 < 15  # well within the 30 s collective timeout
        loss, _ = pipelined(pipeline(model, pipeline.one_f_one_b(2, 4)), mesh, params, x, y)
    torch.testing.assert_close(loss, model.loss(params, x, y))
