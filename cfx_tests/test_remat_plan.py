"""cfx.remat.solve / chen: profiled chains run under Rotor and Chen schedules equal no-remat, and
the activation memory measured in the real run stays within the budget."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import cfx
from cfx._src.remat import solver
from cfx._src.remat.profile import profile_chain

pytestmark = pytest.mark.timeout(300)


def _setup(n_layer=4, dropout=0.0, B=2, T=32, preset="tiny", family="gpt2"):
    make = getattr(cfx.models, family)
    model = (make(preset, n_layer=n_layer, dropout=dropout, vocab_size=256) if family == "gpt2"
             else make(preset, n_layer=n_layer, vocab_size=256))
    params = model.init(cfx.random.key(0))
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    tokens = torch.randint(0, V, (B, T), generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    return model, params, tokens, targets


@pytest.fixture(scope="module")
def gpt2_setup():
    model, params, tokens, targets = _setup()
    ref = cfx.value_and_grad(model.loss)(params, tokens, targets)
    _, plan = cfx.remat.chen(model, params, tokens, segment=10**6)  # one segment: no recompute
    return model, params, tokens, targets, ref, solver.no_remat(plan.chain).peak


def _run(model_r, params, tokens, targets, **kw):
    with cfx.activation_stats() as stats:
        loss, grads = cfx.value_and_grad(model_r.loss)(params, tokens, targets, **kw)
    (name, peak), = stats.chain_peaks
    return loss, grads, peak


@given(frac=st.floats(0.0, 1.0))
def test_solved_schedule_equals_no_remat_and_fits_the_budget(gpt2_setup, frac):
    model, params, tokens, targets, (ref_loss, ref_grads), no_peak = gpt2_setup
    lo = cfx.remat.minimum_budget(model, params, tokens)
    budget = int(lo + frac * (no_peak - lo))
    model_r, plan = cfx.remat.solve(model, params, tokens, budget=budget)
    loss, grads, measured = _run(model_r, params, tokens, targets)
    torch.testing.assert_close(loss, ref_loss)
    cfx.tree.assert_tree_close(grads, ref_grads)
    assert measured <= budget
    # the fake-tensor profile predicts the real run's activations exactly
    assert measured == plan.peak


def test_full_memory_budget_recomputes_nothing(gpt2_setup):
    model, params, tokens, _, _, no_peak = gpt2_setup
    _, plan = cfx.remat.solve(model, params, tokens, budget=no_peak)
    assert plan.recompute_flops == 0
    assert plan.peak == no_peak


@pytest.mark.parametrize("segment", [None, 1, 3])
def test_chen_runs_exactly_and_the_solver_is_never_worse(gpt2_setup, segment):
    model, params, tokens, targets, (ref_loss, ref_grads), _ = gpt2_setup
    model_c, chen_plan = cfx.remat.chen(model, params, tokens, segment=segment)
    loss, grads, measured = _run(model_c, params, tokens, targets)
    torch.testing.assert_close(loss, ref_loss)
    cfx.tree.assert_tree_close(grads, ref_grads)
    assert measured == chen_plan.peak
    _, plan = cfx.remat.solve(model, params, tokens, budget=chen_plan.peak)
    assert plan.peak <= chen_plan.peak
    assert plan.recompute_flops <= chen_plan.recompute_flops


def test_dropout_keys_replay_identically_under_the_plan():
    model, params, tokens, targets = _setup(dropout=0.2)
    key = cfx.random.key(7)
    ref_loss, ref_grads = cfx.value_and_grad(model.loss)(params, tokens, targets, key=key)
    lo = cfx.remat.minimum_budget(model, params, tokens, key=key)
    model_r, plan = cfx.remat.solve(model, params, tokens, budget=lo, key=key)
    assert plan.recompute_flops > 0
    loss, grads, measured = _run(model_r, params, tokens, targets, key=key)
    torch.testing.assert_close(loss, ref_loss)
    cfx.tree.assert_tree_close(grads, ref_grads)
    assert measured <= lo


def test_llama_chain():
    model, params, tokens, targets = _setup(family="llama")
    ref_loss, ref_grads = cfx.value_and_grad(model.loss)(params, tokens, targets)
    lo = cfx.remat.minimum_budget(model, params, tokens)
    model_r, _ = cfx.remat.solve(model, params, tokens, budget=lo)
    loss, grads, measured = _run(model_r, params, tokens, targets)
    torch.testing.assert_close(loss, ref_loss)
    cfx.tree.assert_tree_close(grads, ref_grads)
    assert measured <= lo


def test_a_list_of_stage_functions():
    torch.manual_seed(0)
    ws = [torch.randn(16, 16, requires_grad=True) for _ in range(6)]
    stages = [lambda p, x: torch.tanh(x @ p["w"])] * 6
    params = [{"w": w} for w in ws]
    x = torch.randn(8, 16, requires_grad=True)

    def plain(params, x):
        for f, p in zip(stages, params):
            x = f(p, x)
        return x.square().sum()
    ref = cfx.grad(plain, argnums=(0, 1))(params, x)
    lo = cfx.remat.minimum_budget(stages, params, x)
    run, plan = cfx.remat.solve(stages, params, x, budget=lo)
    got = cfx.grad(lambda p, x: run(p, x).square().sum(), argnums=(0, 1))(params, x)
    cfx.tree.assert_tree_close(got, ref)
    assert "rotor" in str(plan) and "recomputed" in str(plan)


def test_profile_of_a_gpt2_block_matches_the_textbook_count():
    # the same derivation as test_remat's engine test (sbh(60 + 4a/h + 16/h) bytes, fp32, CPU flash
    # SDPA), here from the fake-tensor trace that no real compute backs
    b, s, h, a = 2, 64, 128, 4
    block = cfx.models.gpt2("tiny", n_embd=h, n_head=a, n_positions=s).blocks[0]
    params = block.init(cfx.random.key(0))
    chain, (prof,) = profile_chain([block.apply], [params], torch.empty(b, s, h), [{}])
    expected = s * b * h * (60 + 4 * a / h + 16 / h) + 4 * s * b * h  # + the output, as xbar counts
    assert abs(prof.saved_bytes - expected) <= 0.05 * expected
    assert chain.x == (4 * b * s * h, 4 * b * s * h)
    # forward matmul FLOPs: 2 * b*s * (4h^2 + 8h^2) for QKV, o-proj and the MLP, + attention 4 b s^2 h
    assert prof.fw_flops == 2 * b * s * 12 * h * h + 4 * b * s * s * h
    # backward: twice the matmuls; flash attention's backward is 5 s x s matmuls (scores recomputed)
    assert prof.bw_flops == 2 * 2 * b * s * 12 * h * h + 10 * b * s * s * h


def test_budget_below_the_minimum_states_it(gpt2_setup):
    model, params, tokens, *_ = gpt2_setup
    lo = cfx.remat.minimum_budget(model, params, tokens)
    with pytest.raises(ValueError, match=f"minimum feasible budget {lo} bytes"):
        cfx.remat.solve(model, params, tokens, budget=lo - 1)
    with pytest.raises(ValueError, match="'512MiB'"):
        cfx.remat.solve(model, params, tokens, budget="lots")


def test_plan_inside_shard_map_with_tensor_parallel_blocks():
    model, params, tokens, targets = _setup()
    ref_loss, ref_grads = cfx.value_and_grad(model.loss)(params, tokens, targets)
    lo = cfx.remat.minimum_budget(model, params, tokens)
    model_r, _ = cfx.remat.solve(model, params, tokens, budget=lo)
    tp = cfx.parallel.tensor_parallel(model_r, "model")
    assert isinstance(tp, cfx.remat.Chained) and tp.schedule is not None
    specs = cfx.Rules(cfx.parallel.MEGATRON_RULES).specs(model.axes())
    with cfx.Mesh({"model": 2}, backend="local") as mesh:
        loss, grads = cfx.device_get(cfx.shard_map(cfx.value_and_grad(tp.loss), mesh=mesh,
                                    in_specs=(specs, cfx.P(), cfx.P()),
                                    out_specs=(cfx.P(), specs))(params, tokens, targets))
    torch.testing.assert_close(loss, ref_loss)
    cfx.tree.assert_tree_close(grads, ref_grads)
