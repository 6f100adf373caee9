"""A Plan's state saved in model coordinates (``plan.coords``, ``plan.saving``): a flat range of a
rectangle is the rectangles ``flat_boxes`` cuts; every plan's regions tile each leaf of the
single-device state exactly once; a checkpoint saved on {"data": 4} with ZeRO-3 is the
single-device state (params and AdamW moments), loads bitwise onto other meshes, ZeRO stages and
pipe axes and continues the run there (bitwise on its own plan); another model is a clear error.
The CLI's --resume across plans is in test_train; under torchrun in test_checkpoint_sharded."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import cfx
from cfx._src.plan.coords import flat_boxes
from cfx.parallel import Plan

B, T, V = 8, 16, 64
CLIP = 1.0


def gpt2(n_layer=4, n_embd=32):
    return cfx.models.gpt2("tiny", n_layer=n_layer, vocab_size=V, n_embd=n_embd, n_head=4, n_positions=T)


def tx():
    return cfx.optim.adamw(1e-3, weight_decay=0.1)


def batches(n):
    d = cfx.random.randint(cfx.random.key(1), (n, B, T + 1), 0, V)
    return [(x[:, :-1], x[:, 1:]) for x in d]


# -- flat ranges as rectangles --------------------------------------------------------------------
@given(shape=st.lists(st.integers(1, 5), min_size=0, max_size=4), data=st.data())
def test_flat_boxes_are_the_range_in_order(shape, data):
    numel = math.prod(shape)
    a = data.draw(st.integers(0, numel))
    b = data.draw(st.integers(a, numel))
    t = torch.arange(numel).view(shape)
    boxes = flat_boxes(tuple(shape), a, b)
    assert len(boxes) <= max(2 * len(shape) - 1, 1)
    got, at = [], a
    for off, size, start in boxes:
        assert start == at  # contiguous, in order
        box = t[tuple(slice(o, o + s) for o, s in zip(off, size))]
        assert tuple(box.shape) == tuple(size) and box.numel() > 0
        got.append(box.reshape(-1))
        at += box.numel()
    assert torch.equal(torch.cat(got) if got else torch.zeros(0, dtype=torch.long), torch.arange(a, b))


# -- every plan's regions tile the single-device state ----------------------------------------------
PLANS = ["data=4 zero=3", "data=2,model=2 zero=1", "pipe=2,data=2 zero=2", "pipe=2,model=2",
         "pipe=2,data=2 zero=3", "seq=2,data=2", "data=3 zero=3"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("text", PLANS)
def test_each_plans_regions_tile_every_leaf_once(text):
    plan = Plan.parse(text)
    model = gpt2(n_embd=36 if "data=3" in text else 32)  # 36: pieces with padding
    with plan.make_mesh() as mesh:
        program = plan.step(model, tx(), mesh=mesh, grad_clip=CLIP)
        state = program.init(cfx.random.key(0))
        files = program._files
        r = mesh.local_ranks[0]
        blocks = lambda tree: cfx.tree.map(lambda a: a.blocks[r], tree)  # noqa: E731
        owners = files.coords.owners(blocks(state.params), blocks(state.opt_state))
        for rank in mesh.local_ranks:  # each tensor a rank holds is its region's elements
            r_blocks = lambda tree: cfx.tree.map(lambda a: a.blocks[rank], tree)  # noqa: E731
            for region, t in files.coords.entries(rank, r_blocks(state.params), r_blocks(state.opt_state)):
                assert tuple(t.shape) == (region.size if region.flat is None else (region.numel,)), region
    hits = {p: torch.zeros(shape, dtype=torch.int32) for p, (shape, _) in files.leaves.items()}
    for region in owners:
        for off, size, _ in region.boxes():
            hits[region.path][tuple(slice(o, o + s) for o, s in zip(off, size))] += 1
    for path, h in hits.items():
        assert torch.all(h == 1), f"{path}: elements held by {sorted(set(h.reshape(-1).tolist()))} writers"
    assert any(p.startswith("opt_state.") and p.endswith("mu.blocks.3.attn.q.w") for p in hits)


# -- save on ZeRO-3, load anywhere ------------------------------------------------------------------
def run(text, steps, *, model=None, save=None, load=None):
    """``(losses, global params, the program's state as whole canonical tensors)`` after ``steps``
    steps of plan ``text`` from ``load`` (or init); ``save``: write the state there after."""
    plan, model = Plan.parse(text), model or gpt2()
    with plan.make_mesh() as mesh:
        program = plan.step(model, tx(), mesh=mesh, grad_clip=CLIP)
        state = program.init(cfx.random.key(0))
        if load is not None:
            state, meta = program.load(load, state)
            assert meta["plan"] and meta.get("step") == 2
        losses = []
        for batch in batches(2 + steps)[2 if load is not None else 0:][:steps]:
            state, m = program(state, batch)
            losses.append(float(m["loss"]))
        if save is not None:
            program.save(save, state, metadata={"step": steps})
        return losses, program.params(state)


def canonical(directory, model=None):
    params = cfx.eval_shape((model or gpt2()).init, cfx.random.key(0))
    like = {"params": params, "opt_state": cfx.eval_shape(tx().init, params)}
    return cfx.checkpoint.load(directory, like)[0]


def single_device(steps):
    model, opt = gpt2(), cfx.optim.chain(cfx.optim.clip_by_global_norm(CLIP), tx())
    params = model.init(cfx.random.key(0))
    state = opt.init(params)
    for x, y in batches(steps):
        _, g = cfx.value_and_grad(lambda p: model.loss(p, x, y))(params)
        u, state = opt.update(g, state, params)
        params = cfx.optim.apply_updates(params, u)
    return {"params": params, "opt_state": state[1]}


@pytest.mark.timeout(600)
def test_a_zero3_checkpoint_is_the_single_device_state_and_resumes_on_any_plan(tmp_path):
    saved = tmp_path / "zero3"
    _, params = run("data=4 zero=3", 2, save=saved)
    whole = canonical(saved)
    cfx.tree.assert_tree_close(whole["params"], params, rtol=0, atol=0)  # the gather's values, bitwise
    cfx.tree.assert_tree_close(whole, single_device(2), rtol=1e-4, atol=1e-5)  # moments where they belong
    full, _ = run("data=4 zero=3", 4)
    for text in ["data=4 zero=3", "data=2,model=2", "pipe=2,data=2", "data=1", "pipe=2,data=2 zero=1"]:
        again = tmp_path / text.replace(" ", "_").replace(",", "_").replace("=", "")
        _, loaded = run(text, 0, load=saved, save=again)  # loaded, then saved from this plan's layout
        cfx.tree.assert_tree_close(loaded, params, rtol=0, atol=0)
        cfx.tree.assert_tree_close(canonical(again), whole, rtol=0, atol=0)  # optimizer state too
        losses, _ = run(text, 2, load=saved)
        if text == "data=4 zero=3":
            assert losses == full[2:]  # the same plan continues bitwise
        else:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(full[2:]))


def test_another_models_checkpoint_is_refused_naming_the_difference(tmp_path):
    run("data=2", 0, save=tmp_path / "a")
    with pytest.raises(ValueError, match="is not this program's state: the checkpoint has 4 blocks, the model 2.*"
                                         "saved by plan 'data=2'"):
        run("data=2", 0, model=gpt2(n_layer=2), load=tmp_path / "a")
    with pytest.raises(ValueError, match="'params.blocks.0.attn.k.b' is float32 \\(32,\\) in the checkpoint, float32 "
                                         "\\(48,\\) in the model"):
        run("data=2", 0, model=gpt2(n_embd=48), load=tmp_path / "a")
    with Plan.parse("data=2").make_mesh() as mesh:  # another optimizer: its state's tensors
        program = Plan.parse("data=2").step(gpt2(), cfx.optim.sgd(0.1, momentum=0.9), mesh=mesh)
        with pytest.raises(ValueError, match="the checkpoint's optimizer state has 137 tensors "
                                             "\\('opt_state.0.count'.* where the optimizer's has 68 "
                                             "\\('opt_state.1.trace"):
            program.load(tmp_path / "a", program.init(cfx.random.key(0)))


@pytest.mark.timeout(300)
def test_a_plans_single_file_is_the_single_device_state_and_loads_on_any_plan(tmp_path):
    """``save`` to a ``.safetensors`` path: the regions put together into whole tensors (padding cut),
    the same as the directory holds; ``load`` reads a file -- a plan's or one device's -- as it reads
    a directory."""
    _, params = run("data=4 zero=3", 2, save=tmp_path / "z.safetensors")
    run("data=4 zero=3", 2, save=tmp_path / "z")
    cfx.tree.assert_tree_close(canonical(tmp_path / "z.safetensors"), canonical(tmp_path / "z"), rtol=0, atol=0)
    cfx.checkpoint.save(tmp_path / "one.safetensors", single_device(2), metadata={"step": 2, "plan": "one device"})
    for text in ["pipe=2,data=2 zero=1", "data=2,model=2"]:
        for source in ("z.safetensors", "one.safetensors"):
            _, loaded = run(text, 0, load=tmp_path / source, save=tmp_path / "again")
            cfx.tree.assert_tree_close(canonical(tmp_path / "again"), canonical(tmp_path / source), rtol=0, atol=0)


@pytest.mark.timeout(120)
def test_a_load_reads_into_the_template_holding_one_slice_more(tmp_path):
    run("data=4 zero=3", 0, save=tmp_path / "a")
    plan = Plan.parse("data=2,model=2")
    with plan.make_mesh() as mesh:
        program = plan.step(gpt2(), tx(), mesh=mesh, grad_clip=CLIP)
        like = program.init(cfx.random.key(1))
        with cfx.memory.track() as mem:
            state, _ = program.load(tmp_path / "a", like)
        largest = max(b.numel() * b.element_size() for a in cfx.tree.leaves(like) for b in a.blocks.values())
        assert 0 < mem.peak("host") <= 2 * largest, (mem.peak("host"), largest)  # a region and its slice, no copy
        assert all(a.blocks[r] is b.blocks[r] for a, b in zip(cfx.tree.leaves(state), cfx.tree.leaves(like))
                   for r in a.blocks)
        params = program.params(state)
    cfx.tree.assert_tree_close(params, canonical(tmp_path / "a")["params"], rtol=0, atol=0)
