"""The expert axis in a Plan: Mixtral, its load-balancing loss included, trains under expert=2 and 4,
data=2,expert=2 with ZeRO-1 and ZeRO-3 (and remat), expert=2,model=2 (tensor parallelism inside the
experts) and pipe=2 (with the auxiliary losses off, or computed per group of tokens and per layer:
``router_aux_group_size``, each stage adding its own layers' terms; over the whole batch, which no
stage sees, refused) with every step's loss and gradients equal to one device's (rtol 1e-5) for five
steps, also for plans hypothesis draws (``cfx.testing.plans``); in capacity mode
with groups (``capacity_group_size``) a plan equals one device running the same groups, and without
groups a plan that splits the batch is refused. The auxiliary
loss's gradient taken inside a shard_map body -- each rank's own, then averaged, as a Plan does --
equals one device's, and the same body tracking varying axes (JAX's check_vma) agrees: the explicit
pvary is what JAX inserts implicitly. What cannot train is refused before any rank runs."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx import P
from cfx._src.parallel.expert import expert_grads
from cfx.parallel import Plan
from cfx_tests.budget import examples
from cfx_tests.test_models_mixtral import tiny

B, T, V, STEPS = 8, 8, 64, 5


def model_and_params(aux: float = 0.02, **kw):
    """A 2-layer Mixtral of 4 experts whose routers are scaled up, so that no token's top-2 is a near
    tie that a rounding difference could flip."""
    model = tiny(n_layer=2, router_aux_loss_coef=aux, router_z_loss_coef=aux / 2, **kw)
    params = model.init(cfx.random.key(0))
    for block in params["blocks"]:
        block["mlp"]["router"] = block["mlp"]["router"] * 30
    return model, params


def record() -> cfx.optim.GradientTransformation:
    """Passes the gradients on and keeps a copy of them as its state (read back with Program.whole)."""
    return cfx.optim.GradientTransformation(lambda p: cfx.tree.map(torch.zeros_like, p),
                                            lambda g, s, p=None: (g, cfx.tree.map(torch.clone, g)))


def optimizer():  # linear in the gradients (AdamW's first steps would magnify rounding into sign flips)
    return cfx.optim.chain(record(), cfx.optim.sgd(0.5, momentum=0.9))


def batches():
    d = cfx.random.randint(cfx.random.key(1), (STEPS, B, T + 1), 0, V)
    return [(x[:, :-1], x[:, 1:]) for x in d]


REFERENCE = {}


def reference(aux: float, **kw):
    """One device's loss and gradients at each of the five steps."""
    if (aux, *kw.items()) not in REFERENCE:
        model, params = model_and_params(aux, **kw)
        tx = optimizer()
        state, out = tx.init(params), []
        for x, y in batches():
            loss, g = cfx.value_and_grad(lambda p: model.loss(p, x, y))(params)
            u, state = tx.update(g, state, params)
            params = cfx.optim.apply_updates(params, u)
            out.append((loss, dict(cfx.tree.flatten_with_path(g)[0])))
        REFERENCE[(aux, *kw.items())] = out
    return REFERENCE[(aux, *kw.items())]


def assert_trains_as_one_device(text: str, aux: float = 0.02, **kw):
    plan = Plan.parse(text)
    assert Plan.parse(str(plan)) == plan
    model, params = model_and_params(aux, **kw)
    with plan.make_mesh() as mesh:
        step = plan.step(model, optimizer(), mesh=mesh)
        state = step.init_from(params)
        for i, ((want_loss, want_grads), batch) in enumerate(zip(reference(aux, **kw), batches())):
            state, metrics = step(state, batch)
            torch.testing.assert_close(cfx.device_get(metrics["loss"]), want_loss, rtol=1e-5, atol=0)
            whole = step.whole(state)
            for path, want in want_grads.items():  # atol: 1e-5 of the leaf's largest gradient, at least
                torch.testing.assert_close(whole[f"opt_state.0.{path}"], want, rtol=1e-5,  # fp32's rounding
                                           atol=max(1e-5 * float(want.abs().max()), 1e-9),
                                           msg=lambda m, path=path: f"{text}, step {i}, {path}: {m}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("text", ["expert=2", "expert=4", "data=2,expert=2 zero=1",
                                  "expert=2,data=2 zero=3 remat=blocks", "expert=2,model=2"])
def test_expert_plans_train_as_one_device(text):
    assert_trains_as_one_device(text)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("text", ["pipe=2,expert=2 microbatches=2", "pipe=2,data=2,expert=2 zero=3 microbatches=2"])
def test_expert_plans_with_a_pipe_axis_train_as_one_device_without_auxiliary_losses(text):
    assert_trains_as_one_device(text, aux=0.0)


GROUPS = dict(router_aux_group_size=T)  # the auxiliary losses per sequence (a group of T tokens) and layer


@pytest.mark.timeout(300)
@pytest.mark.parametrize("text", ["pipe=2 microbatches=2", "pipe=2,expert=2 microbatches=2",
                                  "pipe=2,data=2 microbatches=2 schedule=zb-h1"])
def test_pipe_plans_with_auxiliary_groups_train_as_one_device_running_the_same_groups(text):
    assert_trains_as_one_device(text, **GROUPS)


def test_auxiliary_groups_are_a_rule_of_their_own():
    (whole, params), grouped = model_and_params(), model_and_params(**GROUPS)[0]
    x, y = batches()[0]
    assert abs(float(whole.loss(params, x, y)) - float(grouped.loss(params, x, y))) > 1e-3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", [cfx.pipeline.one_f_one_b, cfx.pipeline.zb_h1])
def test_every_stage_backpropagates_its_own_auxiliary_terms_under_a_loss_scale(schedule):
    model, params = model_and_params(**GROUPS)
    x, y = batches()[0]
    want_loss, want = cfx.value_and_grad(lambda p: model.loss(p, x, y))(params)
    step = cfx.pipeline(model, schedule(2, 4))
    with cfx.Mesh({"pipe": 2}) as mesh:
        loss, grads = cfx.device_get(cfx.shard_map(lambda p, x, y: step(p, x, y, scale=8.0), mesh=mesh,
                                                   in_specs=(P(), P(), P()), out_specs=(P(), P()))(params, x, y))
        evaluated = cfx.device_get(cfx.shard_map(step.loss, mesh=mesh, in_specs=(P(), P(), P()),
                                                 out_specs=P())(params, x, y))
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(evaluated, want_loss, rtol=1e-6, atol=0)
    for path, g in cfx.tree.flatten_with_path(want)[0]:
        got = dict(cfx.tree.flatten_with_path(grads)[0])[path]
        torch.testing.assert_close(got, 8 * g, rtol=1e-5, atol=1e-5 * float(8 * g.abs().max()), msg=path)


@pytest.mark.timeout(300)
@examples(ci=2)
@given(groups=st.booleans(), data=st.data())
def test_drawn_expert_plans_train_as_one_device(groups, data):
    kw = GROUPS if groups else {}  # with groups, plans with a pipe axis too
    plan = data.draw(cfx.testing.plans(model_and_params(**kw)[0], axes=("pipe", "data", "expert", "model"),
                                       max_ranks=4, batch=B, length=T, remat=("none", "blocks"), offload=("none",)),
                     label="plan")
    assert_trains_as_one_device(str(plan), **kw)


CAPACITY = dict(capacity_factor=0.5, capacity_group_size=2 * T)  # groups of 2 rows: 4 to a batch of 8


@pytest.mark.timeout(300)
@pytest.mark.parametrize("text", ["expert=2", "data=2,expert=2 zero=1", "pipe=2,expert=2 microbatches=2"])
def test_capacity_mode_trains_as_one_device_running_the_same_groups(text):
    model, params = model_and_params(**CAPACITY)  # the groups decide: one capacity over the batch drops others
    x = batches()[0][0]
    dropped = [float(s.dropped) for s in model.router_stats(params, x)[1]]
    ungrouped = model_and_params(capacity_factor=0.5)[0]
    assert min(dropped) > 0 and dropped != [float(s.dropped) for s in ungrouped.router_stats(params, x)[1]]
    assert_trains_as_one_device(text, aux=0.0 if "pipe" in text else 0.02, **CAPACITY)


def in_body_grads(check_vma: bool):
    """Loss and gradients of an expert-parallel Mixtral taken inside the shard_map body on each rank and
    then averaged over the ranks (the Plan's way), with and without tracking varying axes."""
    model, params = model_and_params()
    x, y = batches()[0]
    ep = cfx.parallel.expert_parallel(model)
    with cfx.Mesh({"expert": 2}) as mesh:
        specs = cfx.Rules(cfx.parallel.EXPERT_RULES).specs(model.axes(), mesh=mesh)

        def body(p, x, y):
            loss, g = cfx.value_and_grad(lambda p: ep.loss(p, x, y))(p)
            if check_vma:  # JAX's typing: replicated params' gradients come out summed over the ranks
                return cfx.lax.pmean(loss, "expert"), cfx.tree.map(lambda t: t / 2, g)
            return cfx.lax.pmean(loss, "expert"), expert_grads(g, specs, "expert")
        run = cfx.shard_map(body, mesh=mesh, in_specs=(specs, P("expert"), P("expert")), out_specs=(P(), specs),
                            check_vma=check_vma)
        loss, grads = run(params, x, y)
    return cfx.device_get(loss), cfx.device_get(grads), cfx.value_and_grad(lambda p: model.loss(p, x, y))(params)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check_vma", [False, True])
def test_the_auxiliary_losses_gradient_taken_on_each_rank_equals_one_device(check_vma):
    loss, grads, (want_loss, want_grads) = in_body_grads(check_vma)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    for path, want in cfx.tree.flatten_with_path(want_grads)[0]:
        got = dict(cfx.tree.flatten_with_path(grads)[0])[path]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()), msg=path)


def test_plan_text_has_an_expert_axis():
    plan = Plan.parse("data=2,expert=2 zero=3")
    assert plan.mesh == (("data", 2), ("expert", 2)) and plan.batch_axes == ("data", "expert")
    assert str(plan) == "data=2,expert=2 zero=3" and Plan.parse("expert=4").batch_axes == ("expert",)


@pytest.mark.parametrize("text, match", [
    ("expert=2", "GPT2 has none"),
    ("expert=8", "4 experts do not split over expert=8"),
    ("expert=2 zero=1", "zero=1 shards over the data axis"),
    ("data=2,seq=2", "sequence parallelism .* do not carry the routers' statistics"),
    ("expert=2,model=2 sp=megatron", "sp=megatron"),
    ("expert=2 remat=auto:1GiB", "remat=auto"),
    ("pipe=2,expert=2", r"Plan 'pipe=2,expert=2'.*a pipeline cannot compute the auxiliary losses over the whole "
                        r"batch.*set router_aux_group_size=S"),
])
def test_what_cannot_train_is_refused_before_any_rank_runs(text, match):
    model = cfx.models.gpt2("tiny", n_layer=2) if match == "GPT2 has none" else model_and_params()[0]
    with pytest.raises(ValueError, match=match):
        Plan.parse(text).check(model)


@pytest.mark.parametrize("text, split", [("data=2", r"expert_parallel over \('data',\)"),
                                         ("expert=2", r"expert_parallel over \('expert',\)"),
                                         ("pipe=2 microbatches=2", "microbatches=2")])
def test_capacity_without_groups_is_refused_where_the_batch_is_split(text, split):
    model = model_and_params(aux=0.0, capacity_factor=1.0)[0]
    with pytest.raises(ValueError, match=f"Plan '{text}': Mixtral: block 0's MoE\\(capacity_factor=1.0\\) has no "
                                         f"group_size, and {split} splits the batch's rows.*capacity_group_size=S"):
        Plan.parse(text).check(model)
    Plan.parse("pipe=2").check(model)  # one microbatch: nothing split


@pytest.mark.timeout(60)
def test_a_pipeline_microbatch_of_no_whole_groups_is_refused_before_any_rank_runs():
    model, params = model_and_params(router_aux_group_size=4 * T)  # a batch of 8 rows: groups of 4 rows
    plan = Plan.parse("pipe=2 microbatches=4")  # microbatches of 2 rows
    with plan.make_mesh() as mesh:
        step = plan.step(model, optimizer(), mesh=mesh)
        with pytest.raises(ValueError, match=r"a pipeline microbatch\): its 16 tokens \(shape \(2, 8\)\) do not "
                                             "form whole groups of router_aux_group_size=32"):
            step(step.init_from(params), batches()[0])


def test_a_batch_must_split_over_data_and_expert():
    with pytest.raises(ValueError, match="6 rows does not split over data=2 x expert=2; use a multiple of 4"):
        Plan.parse("data=2,expert=2").check_batch(6)


@pytest.mark.timeout(120)
def test_the_training_command_takes_an_expert_axis(tmp_path, capsys):
    from cfx.train import main
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 100)
    assert main(["--model", "mixtral", "--mesh", "data=2,expert=2", "--steps", "2", "--batch", "4", "--seq", "16",
                 "--data", str(corpus), "--eval-every", "0", "--sample-bytes", "8", "--no-progress"]) == 0
    assert "mesh data=2,expert=2" in capsys.readouterr().out
    assert main(["--model", "mixtral", "--preset", "tiny,router_aux_group_size=16", "--mesh", "pipe=2",
                 "--microbatches", "2", "--steps", "2", "--batch", "4", "--seq", "16", "--data", str(corpus),
                 "--eval-every", "0", "--sample-bytes", "8", "--no-progress"]) == 0
    assert "mesh pipe=2" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_a_checkpoint_moves_between_expert_plans(tmp_path):
    model, params = model_and_params()
    tx = cfx.optim.adamw(1e-3)
    saved = Plan.parse("data=2,expert=2 zero=1")
    with saved.make_mesh() as mesh:
        step = saved.step(model, tx, mesh=mesh)
        state, _ = step(step.init_from(params), batches()[0])
        step.save(str(tmp_path), state)
        want = step.params(state)
    for text in ("expert=2,model=2", "expert=4 zero=0"):
        plan = Plan.parse(text)
        with plan.make_mesh() as mesh:
            step = plan.step(model, tx, mesh=mesh)
            state, _ = step.load(str(tmp_path), step.init(cfx.random.key(1)))
            cfx.tree.assert_tree_close(step.params(state), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="routing sizes its expert batches from the data"):
        saved.describe(model, tx, batch=(B, T))
