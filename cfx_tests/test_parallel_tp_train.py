"""Five training steps of GPT-2 and ViT with data parallelism, ZeRO 1 / 2 / 3 over ``data`` and 2D / 2.5D / 3D
tensor parallelism over the rest of the mesh: the loss history and the final params equal one
device's (fp32, SGD with momentum: linear in the gradients, so the default tolerance holds)."""
import pytest
import torch

import cfx
from cfx import P, zero
from cfx.parallel import grid_specs, tensor_parallel_grid

STEPS, B, T = 5, 8, 8


def gpt2():
    model = cfx.models.gpt2("tiny", vocab_size=64, n_layer=2, n_embd=32, n_head=4, n_positions=T)
    tokens = cfx.random.randint(cfx.random.key(7), (STEPS, B, T + 1), 0, 64)
    return model, (tokens[:, :, :-1], tokens[:, :, 1:])


def vit():
    model = cfx.models.vit("tiny", image_size=8, patch_size=4, n_layer=2, n_head=4, hidden_size=32,
                           intermediate_size=64, num_labels=10)
    images = cfx.random.normal(cfx.random.key(2), (STEPS, B, 3, 8, 8))
    return model, (images, cfx.random.randint(cfx.random.key(3), (STEPS, B), 0, 10))


def single_device(model, tx, batches):
    params = model.init(cfx.random.key(0))
    state, losses = tx.init(params), []
    for x, y in zip(*batches):
        loss, grads = cfx.value_and_grad(lambda p: model.loss(p, x, y))(params)
        updates, state = tx.update(grads, state, params)
        params = cfx.optim.apply_updates(params, updates)
        losses.append(loss)
    return torch.stack(losses), params


def grid_training(model, tx, batches, mesh, mode, stage):
    """All five steps in one shard_map: batches split over data, params over the grid, ZeRO over data."""
    tp = tensor_parallel_grid(model, mode)
    specs = grid_specs(tp, mesh=mesh)
    ztx = cfx.zero(tx, stage=stage, axis="data", param_specs=specs)
    if stage == 3:  # each grid block gathered over data just before use (ZeRO-3's layer transform)
        tp = zero.gathered(tp.map_blocks(lambda b: zero.gathered(b, axis="data")), axis="data")

    def body(params, batches):
        params = zero.shard_params(params, axis="data") if stage == 3 else params
        state, losses = ztx.init(params), []
        for x, y in zip(*batches):
            loss, grads = ztx.value_and_grad(lambda p: tp.loss(p, x, y))(params)
            updates, state = ztx.update(grads, state, params)
            params = cfx.optim.apply_updates(params, updates)
            losses.append(cfx.lax.pmean(loss, "data"))
        return torch.stack(losses), zero.gather_params(params, axis="data") if stage == 3 else params

    return cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=(specs, P(None, "data")),
                                        out_specs=(P(), specs))(model.init(cfx.random.key(0)), batches))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode,shape,stage", [
    ("2d", {"data": 2, "row": 2, "col": 2}, 3),
    ("2.5d", {"data": 1, "row": 2, "col": 2, "dep": 2}, 1),
    ("3d", {"data": 2, "row": 2, "col": 2, "dep": 2}, 2),
], ids=["2d-dp2-zero3", "2.5d-zero1", "3d-dp2-zero2"])
@pytest.mark.parametrize("name", ["gpt2", "vit"])
def test_five_steps_equal_one_device(name, mode, shape, stage):
    model, batches = {"gpt2": gpt2, "vit": vit}[name]()
    tx = cfx.optim.sgd(0.3, momentum=0.9, weight_decay=1e-4)
    ref_losses, ref_params = single_device(model, tx, batches)
    with cfx.Mesh(shape) as mesh:
        losses, params = grid_training(model, tx, batches, mesh, mode, stage)
    torch.testing.assert_close(losses, ref_losses)
    cfx.tree.assert_tree_close(params, ref_params)
