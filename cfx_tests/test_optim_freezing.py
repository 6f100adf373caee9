"""``cfx.optim``'s freezing transforms, optax's semantics: ``multi_transform`` with ``set_to_zero``
trains a tree's labelled part exactly as the optimizer trains that part alone (a loop-level
reference: the sub-tree stepped by itself) and leaves the rest bit for bit; ``masked`` passes the
unmasked updates through unchanged and keeps state for the masked leaves only; ``freeze`` zeroes."""
import pytest
import torch

import cfx
from cfx import optim

STEPS = 4


def tree(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {"embed": {"w": torch.randn(6, 4, generator=g)},
            "blocks": [{"w": torch.randn(4, 4, generator=g), "b": torch.randn(4, generator=g)} for _ in range(2)],
            "head": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}}


def grads_at(step: int):
    return tree(100 + step)


def labels(params):  # matrices train, vectors stay
    return cfx.tree.map(lambda x: "train" if x.dim() == 2 else "frozen", params)


def test_multi_transform_trains_the_labelled_part_as_the_optimizer_alone_and_freezes_the_rest():
    params = tree()
    tx = optim.multi_transform({"train": optim.adamw(1e-2, weight_decay=0.1), "frozen": optim.set_to_zero()},
                               labels)
    state = tx.init(params)
    # the reference: AdamW on the matrices alone, as a flat list of leaves
    paths = [p for p, x in cfx.tree.flatten_with_path(params)[0] if x.dim() == 2]
    sub = [x for x in cfx.tree.leaves(params) if x.dim() == 2]
    ref_tx = optim.adamw(1e-2, weight_decay=0.1)
    ref_state = ref_tx.init(sub)
    for step in range(STEPS):
        g = grads_at(step)
        updates, state = tx.update(g, state, params)
        params = optim.apply_updates(params, updates)
        ref_updates, ref_state = ref_tx.update([x for x in cfx.tree.leaves(g) if x.dim() == 2], ref_state, sub)
        sub = optim.apply_updates(sub, ref_updates)
    got = dict(cfx.tree.flatten_with_path(params)[0])
    for p, want in zip(paths, sub):
        torch.testing.assert_close(got[p], want, rtol=0, atol=0)
    start = dict(cfx.tree.flatten_with_path(tree())[0])
    for p, x in got.items():
        if x.dim() == 1:
            assert torch.equal(x, start[p]), p
    # the frozen part keeps no optimizer state: AdamW's moments cover the matrices only
    moments = [x for x in cfx.tree.leaves(state.inner_states["train"]) if x.dim() > 0]
    assert sum(x.numel() for x in moments) == 2 * sum(x.numel() for x in sub)


def test_masked_passes_the_unmasked_updates_through_unchanged():
    params, g = tree(), grads_at(0)
    mask = cfx.tree.map(lambda x: x.dim() == 2, params)
    tx = optim.masked(optim.scale(-0.5), mask)
    updates, _ = tx.update(g, tx.init(params), params)
    for (p, u), x, m in zip(cfx.tree.flatten_with_path(updates)[0], cfx.tree.leaves(g), cfx.tree.leaves(mask)):
        torch.testing.assert_close(u, -0.5 * x if m else x, rtol=0, atol=0, msg=p)


def test_freeze_zeroes_what_its_mask_picks():
    params = tree()
    tx = optim.chain(optim.freeze(lambda p: cfx.tree.map(lambda x: x.dim() == 1, p)), optim.sgd(0.1))
    state = tx.init(params)
    for step in range(STEPS):
        updates, state = tx.update(grads_at(step), state, params)
        params = optim.apply_updates(params, updates)
    for (p, x), x0 in zip(cfx.tree.flatten_with_path(params)[0], cfx.tree.leaves(tree())):
        assert torch.equal(x, x0) == (x.dim() == 1), p


def test_labels_and_masks_are_checked():
    params = tree()
    with pytest.raises(ValueError, match=r"labels \['other'\] have no transformation"):
        optim.multi_transform({"train": optim.sgd(0.1)},
                              lambda p: cfx.tree.map(lambda x: "train" if x.dim() == 2 else "other", p)).init(params)
    with pytest.raises(ValueError, match=r"no leaf is labelled \['unused'\]"):
        optim.multi_transform({"train": optim.sgd(0.1), "frozen": optim.set_to_zero(), "unused": optim.sgd(1.0)},
                              labels).init(params)
    with pytest.raises(ValueError, match="expected a bool per leaf"):
        optim.masked(optim.sgd(0.1), cfx.tree.map(lambda x: 1, params)).init(params)
