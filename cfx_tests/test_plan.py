"""cfx.parallel.Plan: text round-trips; drawn plans train GPT-2 and Llama exactly as one device does,
sequence-parallel ones included; pipe stages store only their own blocks; every bad combination is
refused before any rank runs."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx.parallel import Plan
from cfx_tests.budget import examples

B, T, V = 8, 16, 64
STEPS = 5


def gpt2():
    return cfx.models.gpt2("tiny", n_layer=4, vocab_size=V, n_embd=32, n_head=4, n_positions=T)


def llama():
    return cfx.models.llama("tiny", vocab_size=V, n_layer=4, hidden_size=32, n_head=4, n_kv_heads=2,
                            intermediate_size=48, max_position_embeddings=T)


MODELS = {"gpt2": gpt2(), "llama": llama()}


def data(steps=STEPS):
    d = cfx.random.randint(cfx.random.key(1), (steps, B, T + 1), 0, V)
    return [(x[:, :-1], x[:, 1:]) for x in d]


def single_device(model, tx, batches):
    params = model.init(cfx.random.key(0))
    state, losses = tx.init(params), []
    for x, y in batches:
        loss, g = cfx.value_and_grad(lambda p: model.loss(p, x, y))(params)
        u, state = tx.update(g, state, params)
        params = cfx.optim.apply_updates(params, u)
        losses.append(loss)
    return torch.stack(losses), params


REFERENCE = {}


def reference(name):
    if name not in REFERENCE:
        REFERENCE[name] = single_device(MODELS[name], cfx.optim.adamw(1e-3), data())
    return REFERENCE[name]


def run_plan(plan, model, tx, batches):
    with plan.make_mesh() as mesh:
        step = plan.step(model, tx, mesh=mesh)
        state, losses = step.init(cfx.random.key(0)), []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        return torch.tensor(losses), step.params(state)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", MODELS)
@examples(ci=5)
@given(data=st.data())
def test_drawn_plans_match_the_single_device_trajectory(name, data):
    model = MODELS[name]
    plan = data.draw(cfx.testing.plans(model, batch=B, length=T), label="plan")
    assert Plan.parse(str(plan)) == plan
    ref_losses, ref_params = reference(name)
    losses, params = run_plan(plan, model, cfx.optim.adamw(1e-3), globals()["data"]())
    torch.testing.assert_close(losses, ref_losses)
    cfx.tree.assert_tree_close(params, ref_params)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("text", ["pipe=2,data=2,model=2 zero=2 remat=blocks schedule=zb-h1 microbatches=2",
                                  "model=2,pipe=2 schedule=interleaved microbatches=2",
                                  "data=2,pipe=2 zero=1 remat=dots schedule=gpipe microbatches=4",
                                  "model=2,data=4 zero=3 remat=blocks",
                                  "pipe=2,data=2,model=2 zero=3 remat=blocks schedule=interleaved microbatches=2",
                                  "pipe=2,data=2,model=2 zero=3 schedule=zb-h1 microbatches=2"])
def test_3d_plans_match_single_device(text):
    plan = Plan.parse(text)
    ref_losses, ref_params = reference("gpt2")
    losses, params = run_plan(plan, MODELS["gpt2"], cfx.optim.adamw(1e-3), data())
    torch.testing.assert_close(losses, ref_losses)
    cfx.tree.assert_tree_close(params, ref_params)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, text", [("gpt2", "seq=4"), ("llama", "data=2,seq=2 sp=ulysses zero=3"),
                                        ("llama", "seq=2,model=2 remat=blocks"),
                                        ("gpt2", "data=2,model=2 sp=megatron zero=2"),
                                        ("gpt2", "pipe=2,seq=2 microbatches=2")])
def test_sequence_parallel_plans_match_single_device(name, text):
    ref_losses, ref_params = reference(name)
    losses, params = run_plan(Plan.parse(text), MODELS[name], cfx.optim.adamw(1e-3), data())
    torch.testing.assert_close(losses, ref_losses)
    cfx.tree.assert_tree_close(params, ref_params)


@pytest.mark.timeout(60)
def test_sequence_parallel_plans_refuse_what_does_not_split_before_any_rank_runs():
    with pytest.raises(ValueError, match="4 attention heads of each rank's block 0 over seq=8.*sp=ring"):
        Plan.parse("seq=8 sp=ulysses").check(gpt2())
    with pytest.raises(ValueError, match="2 attention heads.*over seq=4"):
        Plan.parse("model=2,seq=4 sp=ulysses").check(gpt2())
    Plan.parse("seq=8").check(gpt2())  # the ring splits positions, not heads
    with pytest.raises(ValueError, match="cannot split its sequence"):
        Plan.parse("seq=2").check(_NoSeq())
    plan = Plan.parse("seq=4")
    with plan.make_mesh() as mesh:
        step = plan.step(gpt2(), cfx.optim.sgd(0.1), mesh=mesh)
        state = step.init(cfx.random.key(0))
        x, y = data(1)[0]
        with pytest.raises(ValueError, match="sequences of 12 positions do not split over seq=4.*two zigzag chunks"
                                             ".*multiple of 8.*targets -100"):
            step(state, (x[:, :12], y[:, :12]))
        state, m = step(state, (x, y))  # nothing ran: still usable
        assert float(m["loss"]) > 0
    with pytest.raises(ValueError, match="sequences of 6 positions do not split over model=4 \\(sp=megatron\\)"):
        Plan.parse("model=4 sp=megatron").check_batch(8, 6)


class _NoSeq:
    """A model without a ``seq`` field."""
    blocks = ()


@pytest.mark.timeout(60)
def test_pipe_stages_store_only_their_own_blocks():
    model = MODELS["llama"]
    plan = Plan.parse("pipe=2,model=2 microbatches=2")
    shapes = cfx.eval_shape(model.init, cfx.random.key(0))
    specs = cfx.Rules({k: "model" for k in cfx.parallel.MEGATRON_RULES}).specs(model.axes())
    # a block leaf split by the Megatron rules holds half of it on each model rank
    block_bytes = sum(x.numel() * 4 // (2 if any(s.all_axes()) else 1)
                      for x, s in zip(cfx.tree.leaves(shapes["blocks"]), cfx.tree.leaves(specs["blocks"],
                                                                                          is_leaf=lambda v: isinstance(v, cfx.P))))
    rest_bytes = sum(x.numel() * 4 for k, v in shapes.items() if k != "blocks" for x in cfx.tree.leaves(v))
    with plan.make_mesh() as mesh:
        state = plan.init(model, cfx.optim.adamw(1e-3), cfx.random.key(0), mesh=mesh)
        for rank in range(mesh.size):
            held = {k: sum(x.blocks[rank].numel() * 4 for x in cfx.tree.leaves(v)) for k, v in state.params.items()}
            # a rank holds its 2 of the 4 blocks (TP-split leaves halved), the rest by model at most
            assert held["blocks"] == block_bytes // 2
            assert rest_bytes // 2 <= sum(v for k, v in held.items() if k != "blocks") <= rest_bytes
            # AdamW's two moments of exactly what the rank holds, and a step count
            moments = sum(x.blocks[rank].numel() * x.blocks[rank].element_size()
                          for x in cfx.tree.leaves(state.opt_state))
            assert 0 < moments - 2 * sum(held.values()) <= 16


@given(st.data())
def test_text_round_trips(data):
    plan = data.draw(cfx.testing.plans(MODELS["gpt2"], batch=B, zero=(0, 1, 2)))
    assert Plan.parse(str(plan)) == plan
    for text in ["pipe=2,data=2,model=2 zero=3 offload=auto remat=auto:512MiB",
                 "data=4 zero=3 offload=auto:64MiB", "model=2 precision=bf16", "seq=4",
                 "data=2,seq=2 sp=ulysses", "model=2 sp=megatron"]:
        assert str(Plan.parse(text)) == text and Plan.parse(str(Plan.parse(text))) == Plan.parse(text)


@pytest.mark.parametrize("text, match", [
    ("data=2 zero=1 pipe=2 zero=3", "zero is given twice"),
    ("data=2,data=2", "appears twice"),
    ("model=2 zero=3", "zero=3 shards over the data axis.*add data=N"),
    ("data=2 offload=host", "offload=host places ZeRO-3 chunks.*needs zero=3"),
    ("data=2 zero=3 offload=host:64MiB", "only offload=auto takes a device budget"),
    ("data=2 remat=auto", "remat=auto needs an activation budget"),
    ("data=2 microbatches=4", "describe a pipeline.*no pipe axis"),
    ("pipe=2 chunks=3", "needs schedule=interleaved"),
    ("seq=2 sp=megatron", "seq axis splits the sequence, which sp=megatron does not"),
    ("data=2 sp=ulysses", "sp=ulysses splits the sequence over a seq axis.*add seq=N"),
    ("data=2 sp=megatron", "sp=megatron splits the sequence over the model axis.*add model=N"),
    ("seq=2 sp=tree", "sp='tree'; use one of none, ring, ulysses, megatron"),
    ("tensor=2", "unknown key 'tensor'"),
    ("data=two", "not a non-negative integer"),
    ("zero=5 data=2", "zero=5; use one of 0, 1, 2, 3"),
])
def test_bad_text_names_the_fix(text, match):
    with pytest.raises(ValueError, match=match):
        Plan.parse(text)


@pytest.mark.timeout(60)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("text", ["data=2 zero=3 remat=auto:200KiB",
                                  "pipe=2,data=2,model=2 zero=3 offload=auto:4MiB remat=auto:100KiB schedule=zb-h1 microbatches=2"])
def test_remat_auto_solves_over_zero3_pieces_and_per_pipe_stage(text):
    plan = Plan.parse(text)
    with plan.make_mesh() as mesh:
        step = plan.step(MODELS["gpt2"], cfx.optim.adamw(1e-3), mesh=mesh)
        state, losses = step.init(cfx.random.key(0)), []
        for batch in data():
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        params = step.params(state)
    assert step.remat_plan.recompute_fraction > 0  # the budget makes it recompute
    assert step.remat_plan.chain.n == (2 if plan.has("pipe") else 4)  # one stage's blocks, or all of them
    ref_losses, ref_params = reference("gpt2")
    torch.testing.assert_close(torch.tensor(losses), ref_losses)
    cfx.tree.assert_tree_close(params, ref_params)


@pytest.mark.timeout(60)
def test_bad_combinations_are_refused_before_any_rank_runs():
    tx = cfx.optim.adamw(1e-3)
    with pytest.raises(ValueError, match="8 blocks|do not split evenly into pipe=4 x chunks=2"):
        Plan.parse("pipe=4 schedule=interleaved microbatches=4").check(gpt2())
    with pytest.raises(ValueError, match="n_kv_heads=2 is not divisible by 4"):
        Plan.parse("model=4").check(llama())
    with pytest.raises(ValueError, match="dropout"):
        Plan.parse("pipe=2").check(cfx.models.gpt2("tiny", n_layer=2, dropout=0.1))
    plan = Plan.parse("pipe=2,data=2 microbatches=4")
    with plan.make_mesh() as mesh:
        step = plan.step(gpt2(), tx, mesh=mesh)
        state = step.init(cfx.random.key(0))
        x, y = data(1)[0]
        with pytest.raises(ValueError, match="4 rows do not split into microbatches=4|multiple of 8"):
            step(state, (x[:4], y[:4]))
        with pytest.raises(ValueError, match="7 rows does not split over data=2"):
            step(state, (x[:7], y[:7]))
        state, m = step(state, (x, y))  # still usable: nothing ran
        assert float(m["loss"]) > 0
    with cfx.Mesh({"data": 4}) as mesh:
        with pytest.raises(ValueError, match="not the plan's.*plan.make_mesh"):
            plan.step(gpt2(), tx, mesh=mesh)


@pytest.mark.timeout(120)
def test_zero3_on_pipe_data_model_holds_what_describe_says_and_the_formula():
    model = cfx.models.gpt2("tiny", vocab_size=256, n_positions=64)
    plan = Plan.parse("pipe=2,data=2,model=2 zero=3 microbatches=2")
    described = plan.describe(model)  # before any rank starts
    psi = described.n_params
    tokens = cfx.random.randint(cfx.random.key(1), (8, 65), 0, 256)
    batch = (tokens[:, :-1], tokens[:, 1:])
    with plan.make_mesh() as mesh:
        step = plan.step(model, cfx.optim.adamw(1e-3), mesh=mesh)
        state, _ = step(step.init(cfx.random.key(0)), batch)
        with cfx.memory.track() as mem:
            state, _ = step(state, batch)
        for rank in range(mesh.size):
            peak = mem.peak_by_kind("device", rank=rank)
            measured = peak["param"] + peak["grad"] + peak["optim"]
            assert 0.9 <= measured / described.model_state <= 1.1, (rank, measured, described.bytes)
            assert peak["gathered"] == described.bytes["gathered block"]
            formula = 16 * psi / 8 + described.bytes["gathered block"]
            assert 0.9 <= (measured + peak["gathered"]) / formula <= 1.1, (rank, measured, formula)


def test_describe_divides_block_params_by_pipe():
    model = MODELS["gpt2"]
    one, piped = Plan.parse("data=1").describe(model), Plan.parse("pipe=2").describe(model)
    shapes = cfx.eval_shape(model.init, cfx.random.key(0))
    blocks = sum(x.numel() * 4 for x in cfx.tree.leaves(shapes["blocks"]))
    assert one.bytes["params"] - piped.bytes["params"] == blocks // 2
    assert "optimizer" in str(piped)
    assert 0 < piped.model_state - 4 * piped.bytes["params"] <= 16  # AdamW: m, v and a step count


def _trajectory(plan_text, model, tx, batches, **step_kw):
    plan = Plan.parse(plan_text)
    with plan.make_mesh() as mesh:
        step = plan.step(model, tx, mesh=mesh, **step_kw)
        state, losses = step.init(cfx.random.key(0)), []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        return torch.tensor(losses), step.params(state), cfx.device_get(state.opt_state)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("text", ["pipe=2,model=2 microbatches=2", "data=2,model=2", "data=2,model=2 zero=1",
                                  "pipe=2,data=2 zero=3 microbatches=2"])
def test_clipping_sees_the_global_norm_across_every_shard(text):
    model, batches = MODELS["gpt2"], data(3)
    clip = 0.05  # well below the grads' norm: every step is clipped
    ref_losses, ref_params = single_device(model, cfx.optim.chain(cfx.optim.clip_by_global_norm(clip),
                                                                  cfx.optim.adamw(1e-3)), batches)
    losses, params, _ = _trajectory(text, model, cfx.optim.adamw(1e-3), batches, grad_clip=clip)
    torch.testing.assert_close(losses, ref_losses)
    cfx.tree.assert_tree_close(params, ref_params)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, text", [("lamb", "pipe=2,model=2 microbatches=2"), ("lars", "pipe=2,model=2 microbatches=2"),
                                        ("lamb", "data=2,model=2 zero=1"), ("lamb", "pipe=2,data=2 zero=2 microbatches=2"),
                                        ("lars", "data=2,model=2 zero=3"), ("lamb", "pipe=2,data=2 zero=3 microbatches=2")])
def test_trust_ratios_use_norms_reduced_over_the_shards(name, text):
    model, batches = MODELS["llama"], data(3)
    make = (lambda: cfx.optim.lamb(1e-3, weight_decay=0.1)) if name == "lamb" else (lambda: cfx.optim.lars(0.1))
    ref_losses, ref_params = single_device(model, make(), batches)
    losses, params, _ = _trajectory(text, model, make(), batches)
    torch.testing.assert_close(losses, ref_losses)
    cfx.tree.assert_tree_close(params, ref_params)


@pytest.mark.timeout(300)
def test_fp16_loss_scaling_skips_together_across_model_and_pipe():
    model, batches = MODELS["gpt2"], data(4)
    make = lambda: cfx.optim.dynamic_loss_scale(cfx.optim.adamw(1e-3), init_scale=2.0 ** 40)  # noqa: E731
    losses, _, opt_state = _trajectory("pipe=2,model=2 microbatches=2 precision=fp16", model, make(), batches)
    scale = [x for x in cfx.tree.leaves(opt_state, is_leaf=lambda v: isinstance(v, cfx.optim.LossScaleState))
             if isinstance(x, cfx.optim.LossScaleState)][0]
    assert int(scale.skipped) >= 1  # 2**40 overflows fp16: the first steps are skipped ...
    assert float(scale.scale) == 2.0 ** 40 * 0.5 ** int(scale.skipped)  # ... by every rank alike
    assert torch.isfinite(losses).all()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("text", ["data=2,model=2 zero=1", "pipe=2,data=2 zero=3 microbatches=2",
                                  "pipe=2,data=2,model=2 zero=2 remat=blocks schedule=zb-h1 microbatches=2",
                                  "model=2 sp=megatron", "data=2,seq=2 collectives", "seq=2 sp=ulysses collectives"])
def test_describe_rehearses_the_step_collectives_and_activations_on_shapes(text):
    # (the rehearsal books the gradient reduction's flat buffers about twice over, and where they,
    # not activations, make the peak -- the sequence-split plans at this tiny size -- only the
    # collectives are compared)
    compare_activations = not text.endswith(" collectives")
    text = text.removesuffix(" collectives")
    plan, model = Plan.parse(text), MODELS["gpt2"]
    described = plan.describe(model, batch=(B, T))  # every rank's step on fake tensors, nothing sent
    x, y = data(1)[0]
    with plan.make_mesh() as mesh:
        step = plan.step(model, cfx.optim.adamw(1e-3), mesh=mesh)
        state, _ = step(step.init(cfx.random.key(0)), (x, y))
        with cfx.comm_stats() as stats, cfx.memory.track(ops=True) as mem:
            step(state, (x, y))
    measured = stats.sent()
    assert described.collectives == measured  # the step's own code, byte for byte
    peak = max(mem.peak_by_kind("device", rank=r)["activation"] for r in range(mesh.size))
    if compare_activations:
        assert 0.8 <= described.bytes["activations"] / peak <= 1.25, (described.bytes["activations"], peak)
    assert "collectives over" in str(described)
