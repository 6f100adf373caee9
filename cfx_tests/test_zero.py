"""ZeRO stages 0-3 equal the single-device run: DP and DP x TP meshes, accumulation, unused
params, global-norm clipping, fp16 loss scaling (inf found on one rank skips everywhere), bf16."""
import dataclasses

import pytest
import torch

import cfx
from cfx import P
from cfx import zero
from cfx.parallel import MEGATRON_RULES, tensor_parallel

STEPS, B, T, V = 10, 8, 16, 256
MESHES = [{"data": 4}, {"data": 2, "model": 2}]


def gpt2():
    return cfx.models.gpt2("tiny", n_layer=2, vocab_size=V, n_embd=64, n_head=4, n_positions=T)


def data(steps=STEPS):
    return cfx.random.randint(cfx.random.key(7), (steps, B, T + 1), 0, V)


def cast(tree, dtype):
    return cfx.tree.map(lambda x: x.to(dtype), tree)


def gathered_model(model, axis="data"):
    return zero.gathered(model.map_blocks(lambda b: zero.gathered(b, axis=axis)), axis=axis)


def single_device(model, tx, batches, *, micro=1, dtype=torch.float32):
    """The reference: fp32 master params; with fp16/bf16, the model runs on a cast copy."""
    master = cast(cast(model.init(cfx.random.key(0)), dtype), torch.float32)
    state, losses = tx.init(master), []
    for t in batches:
        grads, loss = None, 0.0
        for mb in t.chunk(micro):
            def f(p):
                l = model.loss(p, mb[:, :-1], mb[:, 1:])
                s = cfx.optim.scale_loss(l, state) if dtype == torch.float16 else l
                return s / micro, l
            (_, l), g = cfx.value_and_grad(f, has_aux=True)(cast(master, dtype))
            grads = g if grads is None else cfx.tree.map(torch.add, grads, g)
            loss = loss + l / micro
        u, state = tx.update(cast(grads, torch.float32), state, master)
        master = cfx.optim.apply_updates(master, u)
        losses.append(loss)
    return torch.stack(losses), master


def zero_run(model, tx, batches, mesh, stage, *, micro=1, dtype=torch.float32, bucket_numel=20000,
             tell_specs=True):
    """The same training inside one shard_map: ZeRO along data, Megatron TP along model
    (``tell_specs=False``: without telling ZeRO the params' specs)."""
    tp = "model" in mesh.shape
    rules = cfx.Rules({**MEGATRON_RULES} if tp else {})
    pspecs = rules.specs(model.axes(), mesh=mesh)
    net = tensor_parallel(model, "model") if tp else model
    net = gathered_model(net) if stage == 3 else net
    ztx = zero(tx, stage=stage, axis="data", param_specs=pspecs if tell_specs else None,
               bucket_numel=bucket_numel)

    def body(params, batches):
        p = zero.shard_params(params, axis="data") if stage == 3 else params
        state, losses = ztx.init(p), []
        for t in batches:
            grads, loss = None, 0.0
            for mb in t.chunk(micro):
                def f(p):
                    l = net.loss(p, mb[:, :-1], mb[:, 1:])
                    s = cfx.optim.scale_loss(l, state) if dtype == torch.float16 else l
                    return s / micro, l
                (_, l), g = ztx.value_and_grad(f, has_aux=True)(p)
                grads = g if grads is None else cfx.tree.map(torch.add, grads, g)
                loss = loss + l / micro
            u, state = ztx.update(grads, state, p)
            p = cfx.optim.apply_updates(p, u)
            losses.append(cfx.lax.pmean(loss, "data"))
        if stage == 3:
            p = zero.gather_params(p, axis="data")
        return torch.stack(losses), p

    params = cast(model.init(cfx.random.key(0)), dtype)
    return cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=(pspecs, P(None, "data")),
                         out_specs=(P(), pspecs))(params, batches))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shape", MESHES, ids=["dp4", "dp2xtp2"])
def test_stages_equal_single_device_fp32(shape):
    # SGD with momentum is linear in the gradients, so the strict tolerance holds. (Adam turns
    # float noise in gradients that are zero in exact arithmetic into lr-sized steps: see below.)
    model, tx, batches = gpt2(), cfx.optim.sgd(0.3, momentum=0.9, weight_decay=1e-4), data()
    ref_losses, ref_params = single_device(model, tx, batches)
    with cfx.Mesh(shape) as mesh:
        for stage in (0, 1, 2, 3):
            losses, params = zero_run(model, tx, batches, mesh, stage)
            torch.testing.assert_close(losses, ref_losses)
            cfx.tree.assert_tree_close(params, ref_params)


@pytest.mark.timeout(120)
def test_adamw_stages_close_to_single_device():
    # AdamW divides by sqrt(v): a gradient that is 0 in exact arithmetic (the key bias's) but
    # 1e-9 in floats, summed in another order on 4 ranks, still moves by ~lr. So params get a
    # looser absolute tolerance (a few lr-sized steps' noise on such elements), losses the default.
    model, tx, batches = gpt2(), cfx.optim.adamw(1e-3), data(4)
    ref_losses, ref_params = single_device(model, tx, batches)
    with cfx.Mesh({"data": 4}) as mesh:
        for stage in (1, 2, 3):
            losses, params = zero_run(model, tx, batches, mesh, stage)
            torch.testing.assert_close(losses, ref_losses)
            cfx.tree.assert_tree_close(params, ref_params, rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(120)
def test_clip_by_global_norm_uses_the_norm_over_every_shard():
    # the gradient norm is ~1.7 here, so clipping at 0.1 scales every step; any shard-local
    # norm would give a different factor on each rank
    model, batches = gpt2(), data(4)
    tx = cfx.optim.chain(cfx.optim.clip_by_global_norm(0.1), cfx.optim.sgd(0.3, momentum=0.9))
    ref_losses, ref_params = single_device(model, tx, batches)
    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        for stage in (1, 2, 3):
            losses, params = zero_run(model, tx, batches, mesh, stage)
            torch.testing.assert_close(losses, ref_losses)
            cfx.tree.assert_tree_close(params, ref_params)


@pytest.mark.timeout(120)
def test_tensor_parallel_params_without_specs_are_refused_not_normed_wrong():
    # the newcomer's trap: TP shards counted as whole leaves made the clipped update 28% off;
    # now every rank refuses at the first update, naming a split leaf and the fix
    model, batches = gpt2(), data(1)
    tx = cfx.optim.chain(cfx.optim.clip_by_global_norm(0.1), cfx.optim.adamw(1e-3))
    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        for stage in (1, 3):
            with pytest.raises(ValueError, match=r"blocks\.0\.attn.*differs across mesh axes \['model'\].*param_specs"):
                zero_run(model, tx, batches, mesh, stage, tell_specs=False)


@pytest.mark.timeout(120)
def test_params_replicated_over_the_other_axes_need_no_specs():
    # plain data parallel on a mesh that also has a model axis: the params are whole on every
    # rank, so no specs are needed and the run equals one device
    model, batches = gpt2(), data(2)
    tx = cfx.optim.chain(cfx.optim.clip_by_global_norm(0.1), cfx.optim.sgd(0.3, momentum=0.9))
    ref_losses, ref_params = single_device(model, tx, batches)
    ztx = zero(tx, stage=2, axis="data")

    def body(params, batches):
        state = ztx.init(params)
        for t in batches:
            loss, g = ztx.value_and_grad(lambda p: model.loss(p, t[:, :-1], t[:, 1:]))(params)
            u, state = ztx.update(g, state, params)
            params = cfx.optim.apply_updates(params, u)
        return params

    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        params = cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=(P(), P(None, "data")), out_specs=P())(
            model.init(cfx.random.key(0)), batches))
    cfx.tree.assert_tree_close(params, ref_params)


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A block whose params exist but receive no gradient (it returns its input)."""

    block: object

    def init(self, key):
        return self.block.init(key)

    def axes(self):
        return self.block.axes()

    def apply(self, params, x, **kwargs):
        del params, kwargs
        return x


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_value_and_grad_gives_the_single_device_gradient(stage):
    # each rank's loss is the mean over its quarter of the batch; the single-device loss is the
    # mean over the whole batch. Stages 0-1 return this rank's own gradient (their mean over
    # data is the single-device one); stages 2-3 return this rank's slice of the mean itself.
    model, tokens = gpt2(), data(1)[0]
    params = model.init(cfx.random.key(0))
    _, ref = cfx.value_and_grad(model.loss)(params, tokens[:, :-1], tokens[:, 1:])
    net = gathered_model(model) if stage == 3 else model
    ztx = zero(cfx.optim.sgd(0.1), stage=stage, axis="data", bucket_numel=20000)

    def body(params, ref, t):
        p = zero.shard_params(params, axis="data") if stage == 3 else params
        _, g = ztx.value_and_grad(lambda p: net.loss(p, t[:, :-1], t[:, 1:]))(p)
        if stage == 3:
            return zero.gather_params(g, axis="data")
        if stage == 2:  # this rank's row of each group's (n, S) packing of the reference
            r = cfx.lax.axis_index("data")
            leaves = cfx.tree.leaves(ref)
            want = [lay.rows_from_leaves([leaves[i] for i in idx], dtype=dt)[r] for idx, lay, dt in ztx.layout(p).groups]
            for got, w in zip(g.shards, want):
                torch.testing.assert_close(got, w)
            return ref
        return cfx.tree.map(lambda x: cfx.lax.pmean(x, "data"), g)

    with cfx.Mesh({"data": 4}) as mesh:
        grads = cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")),
                                             out_specs=P())(params, ref, tokens))
    cfx.tree.assert_tree_close(grads, ref)


@pytest.mark.timeout(120)
def test_accumulation_and_params_without_gradient():
    base = gpt2()
    model = dataclasses.replace(base, blocks=(base.blocks[0], Skipped(base.blocks[1])))
    tx, batches = cfx.optim.sgd(0.3, momentum=0.9), data(4)
    ref_losses, ref_params = single_device(model, tx, batches)
    with cfx.Mesh({"data": 4}) as mesh:
        for stage in (0, 1, 2, 3):
            losses, params = zero_run(model, tx, batches, mesh, stage, micro=2)
            torch.testing.assert_close(losses, ref_losses)
            cfx.tree.assert_tree_close(params, ref_params)
    skipped = model.init(cfx.random.key(0))["blocks"][1]
    assert torch.equal(params["blocks"][1]["mlp"]["fc"]["w"], skipped["mlp"]["fc"]["w"])  # no gradient: kept


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_mixed_precision_losses_within_1e3(dtype):
    # ZeRO's mixed precision: fp16/bf16 params and grads, fp32 master shards in the state
    model, batches = gpt2(), data(6)
    tx = cfx.optim.adamw(1e-3)
    if dtype == torch.float16:
        tx = cfx.optim.dynamic_loss_scale(tx, init_scale=2.0 ** 14)
    ref_losses, _ = single_device(model, tx, batches, dtype=dtype)
    with cfx.Mesh({"data": 4}) as mesh:
        for stage in (0, 1, 2, 3):
            losses, params = zero_run(model, tx, batches, mesh, stage, dtype=dtype)
            torch.testing.assert_close(losses, ref_losses, rtol=1e-3, atol=0.0)
            assert all(x.dtype == dtype for x in cfx.tree.leaves(params))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_inf_on_one_rank_skips_the_step_on_every_rank(stage):
    # rank 0 alone has an inf, in the part of the gradient that rank 0's shard owns: only the
    # found-inf reduction across the axis can tell the other ranks to skip
    params = {"a": torch.arange(8.0), "b": torch.ones(3, 5)}
    tx = cfx.optim.dynamic_loss_scale(cfx.optim.sgd(0.1), init_scale=8.0)
    ztx = zero(tx, stage=stage, axis="data")

    def body(params):
        p = zero.shard_params(params, axis="data") if stage == 3 else params
        state = ztx.init(p)
        g = cfx.tree.map(torch.ones_like, p)
        leaves, td = cfx.tree.flatten(g)
        if cfx.lax.axis_index("data") == 0:
            leaves[0] = leaves[0].clone()
            leaves[0].view(-1)[0] = float("inf")
        g = cfx.tree.unflatten(td, leaves)
        if stage == 2:  # as the stage-2 backward would deliver them: averaged shards
            plan = ztx.layout(p)
            g = zero.ShardGrads(tuple(cfx.lax.psum_scatter(lay.rows_from_leaves([cfx.tree.leaves(g)[i] for i in idx],
                                                                                 dtype=dt), "data", tiled=False) / 4
                                      for idx, lay, dt in plan.groups))
        u, state = ztx.update(g, state, p)
        new = cfx.optim.apply_updates(p, u)
        if stage == 3:
            new = zero.gather_params(new, axis="data")
        kept = all(torch.equal(a, b) for a, b in zip(cfx.tree.leaves(new), cfx.tree.leaves(params)))
        return torch.tensor([float(kept)]), state.inner.scale.reshape(1)

    with cfx.Mesh({"data": 4}) as mesh:
        kept, scales = cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=P(), out_specs=(P("data"), P("data")))(params))
    assert kept.tolist() == [1.0] * 4  # the step was skipped on every rank
    assert scales.tolist() == [4.0] * 4  # and every rank backed the scale off


@pytest.mark.timeout(60)
def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="stage=4"):
        zero(cfx.optim.sgd(0.1), stage=4, axis="data")
    with pytest.raises(ValueError, match="not a GradientTransformation"):
        zero(0.1, stage=1, axis="data")
    with pytest.raises(ValueError, match="not a layer"):
        zero.gathered(object(), axis="data")
    params = {"w": torch.ones(4)}
    with cfx.Mesh({"data": 2}) as mesh:
        with pytest.raises(ValueError, match="batch"):
            cfx.device_get(cfx.shard_map(lambda p: zero(cfx.optim.sgd(0.1), stage=1, axis="batch").init(p),
                          mesh=mesh, in_specs=P(), out_specs=P())(params))
        with pytest.raises(ValueError, match="must be ZeroParams"):
            cfx.device_get(cfx.shard_map(lambda p: zero(cfx.optim.sgd(0.1), stage=3, axis="data").init(p),
                          mesh=mesh, in_specs=P(), out_specs=P())(params))
    with cfx.Mesh({"data": 4}) as mesh4:
        zp = cfx.device_get(cfx.shard_map(lambda p: zero.shard_params(p, axis="data"), mesh=mesh4, in_specs=P(),
                           out_specs=P())(params))
    with cfx.Mesh({"data": 2}) as mesh:
        with pytest.raises(ValueError, match="sharded over 4 ranks"):
            cfx.device_get(cfx.shard_map(lambda p: zero(cfx.optim.sgd(0.1), stage=3, axis="data").init(p),
                          mesh=mesh, in_specs=P(), out_specs=P())(zp))


@pytest.mark.timeout(120)
def test_state_specs_let_each_step_be_its_own_shard_map():
    # the CLI's shape: params and ZeRO state stay ShardedArrays between steps
    model, batches = gpt2(), data(3)
    tx = cfx.optim.chain(cfx.optim.clip_by_global_norm(0.1), cfx.optim.sgd(0.3, momentum=0.9))
    ref_losses, ref_params = single_device(model, tx, batches)
    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        pspecs = cfx.Rules(MEGATRON_RULES).specs(model.axes(), mesh=mesh)
        tp = tensor_parallel(model, "model")
        for stage in (1, 3):
            net = gathered_model(tp) if stage == 3 else tp
            ztx = zero(tx, stage=stage, axis="data", param_specs=pspecs, bucket_numel=20000)
            params = model.init(cfx.random.key(0))
            sspecs = ztx.state_specs(params, mesh=mesh)
            zspecs = pspecs
            if stage == 3:
                zspecs = zero.param_specs(pspecs, params, axis="data", mesh=mesh)
                params = cfx.shard_map(lambda p: zero.shard_params(p, axis="data"), mesh=mesh,
                                       in_specs=pspecs, out_specs=zspecs)(params)
            state = cfx.shard_map(ztx.init, mesh=mesh, in_specs=(zspecs,), out_specs=sspecs)(params)

            def step(p, state, t):
                loss, g = ztx.value_and_grad(lambda p: net.loss(p, t[:, :-1], t[:, 1:]))(p)
                u, state = ztx.update(g, state, p)
                return cfx.optim.apply_updates(p, u), state, cfx.lax.pmean(loss, "data")
            train_step = cfx.shard_map(step, mesh=mesh, in_specs=(zspecs, sspecs, P("data")),
                                       out_specs=(zspecs, sspecs, P()))
            losses = []
            for t in batches:
                params, state, loss = train_step(params, state, t)
                losses.append(cfx.device_get(loss))
            if stage == 3:
                params = cfx.shard_map(lambda p: zero.gather_params(p, axis="data"), mesh=mesh,
                                       in_specs=(zspecs,), out_specs=pspecs)(params)
            params = cfx.device_get(params)
            torch.testing.assert_close(torch.stack(losses), ref_losses)
            cfx.tree.assert_tree_close(params, ref_params)


@pytest.mark.timeout(60)
def test_gathered_inside_remat():
    # remat's hooks get every saved tensor the gathered layer does not own; recomputing the
    # forward gathers again, so a remat'd block is gathered twice in backward
    model, batches = gpt2(), data(3)
    tx = cfx.optim.sgd(0.3, momentum=0.9)
    ref_losses, ref_params = single_device(model, tx, batches)
    net = zero.gathered(model.map_blocks(lambda b: cfx.remat(zero.gathered(b, axis="data"))), axis="data")
    ztx = zero(tx, stage=3, axis="data")

    def body(params, batches):
        p = zero.shard_params(params, axis="data")
        state, losses = ztx.init(p), []
        for t in batches:
            with cfx.comm_stats() as stats:
                loss, g = ztx.value_and_grad(lambda p: net.loss(p, t[:, :-1], t[:, 1:]))(p)
            u, state = ztx.update(g, state, p)
            p = cfx.optim.apply_updates(p, u)
            losses.append(cfx.lax.pmean(loss, "data"))
        return torch.stack(losses), zero.gather_params(p, axis="data"), stats.count(op="all_gather", backward=True)

    with cfx.Mesh({"data": 2}) as mesh:
        losses, params, regathers = cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=(P(), P(None, "data")),
                                                  out_specs=(P(), P(), P()))(model.init(cfx.random.key(0)), batches))
    torch.testing.assert_close(losses, ref_losses)
    cfx.tree.assert_tree_close(params, ref_params)
    # the root never (it keeps what its backward reads); each block for the recomputation and its saved weights
    assert regathers == 2 * 2
