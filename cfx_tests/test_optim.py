"""cfx.optim against torch.optim (sgd, adam, adamw) and against the papers' equations (lamb, lars).

Every run is 20 steps on a random nested pytree with fresh random grads per step; hypothesis
draws the shapes and the hyperparameters. Each update is also checked to leave its inputs
(grads, params, old state) untouched.
"""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import cfx
from cfx import optim

STEPS = 20

shapes = st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple), min_size=2, max_size=5)
seeds = st.integers(0, 2**31 - 1)
lrs = st.floats(1e-4, 1e-1)


def nest(xs):
    """A nested dict/list/tuple pytree over the leaves ``xs`` (at least 2)."""
    return {"embed": xs[0], "blocks": [{"w": x} for x in xs[1:-1]], "head": {"b": [xs[-1]]}}


def problem(seed, shapes_):
    g = torch.Generator().manual_seed(seed)
    params = nest([torch.randn(s, generator=g) for s in shapes_])
    grads = [nest([torch.randn(s, generator=g) for s in shapes_]) for _ in range(STEPS)]
    return params, grads


def clone(tree):
    return cfx.tree.map(lambda x: x.clone(), tree)


def assert_tree_equal(a, b):
    cfx.tree.check_same_structure("assert_tree_equal", a, b)
    for (path, x), y in zip(cfx.tree.flatten_with_path(a)[0], cfx.tree.leaves(b)):
        assert torch.equal(x, y), f"leaf {path!r} was modified"


def run_cfx(tx, params, grads_seq):
    state = tx.init(params)
    for grads in grads_seq:
        before = clone((grads, params, state))
        updates, new_state = tx.update(grads, state, params)
        assert_tree_equal((grads, params, state), before)  # pure: inputs untouched
        params, state = optim.apply_updates(params, updates), new_state
    return params


def run_torch(make_opt, params, grads_seq, lr_lambda=None):
    leaves, treedef = cfx.tree.flatten(params)
    ps = [p.clone().requires_grad_(True) for p in leaves]
    opt = make_opt(ps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda else None
    for grads in grads_seq:
        for p, g in zip(ps, cfx.tree.leaves(grads)):
            p.grad = g.clone()
        opt.step()
        if sched:
            sched.step()
    return cfx.tree.unflatten(treedef, [p.detach() for p in ps])


# ---- torch.optim equivalence ------------------------------------------------------------------

@given(seeds, shapes, lrs, st.sampled_from([0.0, 0.5, 0.9]), st.booleans(), st.floats(0.0, 0.1))
def test_sgd_matches_torch(seed, shapes_, lr, momentum, nesterov, wd):
    nesterov = nesterov and momentum > 0
    params, grads = problem(seed, shapes_)
    ours = run_cfx(optim.sgd(lr, momentum, nesterov=nesterov, weight_decay=wd), params, grads)
    ref = run_torch(lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum, nesterov=nesterov,
                                               weight_decay=wd), params, grads)
    cfx.tree.assert_tree_close(ours, ref)


@given(seeds, shapes, lrs, st.floats(0.0, 0.99), st.floats(0.5, 0.9999), st.floats(1e-8, 1e-3),
       st.sampled_from([0.0, 0.01, 0.1]))
def test_adam_matches_torch(seed, shapes_, lr, b1, b2, eps, wd):
    params, grads = problem(seed, shapes_)
    ours = run_cfx(optim.adam(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd), params, grads)
    ref = run_torch(lambda ps: torch.optim.Adam(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd),
                    params, grads)
    cfx.tree.assert_tree_close(ours, ref)


@given(seeds, shapes, lrs, st.floats(0.0, 0.99), st.floats(0.5, 0.9999), st.floats(1e-8, 1e-3),
       st.sampled_from([0.0, 0.01, 0.3]), st.sampled_from(["none", "ndim", "random"]), st.data())
def test_adamw_matches_torch(seed, shapes_, lr, b1, b2, eps, wd, mask_kind, data):
    params, grads = problem(seed, shapes_)
    n = len(shapes_)
    if mask_kind == "none":
        mask, flags = None, [True] * n
    elif mask_kind == "ndim":  # a callable, the usual "matrices only" rule
        mask = lambda p: cfx.tree.map(lambda x: x.dim() >= 2, p)  # noqa: E731
        flags = cfx.tree.leaves(mask(params))
    else:  # a pytree of bools
        mask = nest(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
        flags = cfx.tree.leaves(mask)  # in leaf order (dict keys are sorted)
    ours = run_cfx(optim.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd, mask=mask), params, grads)

    def make(ps):
        groups = [{"params": [p for p, f in zip(ps, flags) if f], "weight_decay": wd},
                  {"params": [p for p, f in zip(ps, flags) if not f], "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(b1, b2), eps=eps)

    cfx.tree.assert_tree_close(ours, run_torch(make, params, grads))


def warmup_cosine_ref(step, init, peak, warmup, decay, end):
    """The textbook warmup + cosine formula, in Python floats."""
    if step < warmup:
        return init + (peak - init) * step / warmup
    t = min(step - warmup, decay - warmup) / (decay - warmup)
    return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * t))


@given(seeds, shapes, st.floats(1e-3, 1e-1), st.integers(0, 8), st.integers(1, 15),
       st.sampled_from(["adamw", "sgd"]))
def test_scheduled_lr_matches_torch_lambda_lr(seed, shapes_, peak, warmup, cos_steps, which):
    params, grads = problem(seed, shapes_)
    decay = warmup + cos_steps  # shorter than 20 steps sometimes: the tail stays at end_value
    init, end = 0.1 * peak, 0.05 * peak
    sched = optim.warmup_cosine_decay_schedule(init, peak, warmup, decay, end_value=end)
    factor = lambda s: warmup_cosine_ref(s, init, peak, warmup, decay, end) / peak  # noqa: E731
    if which == "adamw":
        tx, make = optim.adamw(sched, weight_decay=0.1), \
            lambda ps: torch.optim.AdamW(ps, lr=peak, weight_decay=0.1)
    else:
        tx, make = optim.sgd(sched, 0.9, nesterov=True), \
            lambda ps: torch.optim.SGD(ps, lr=peak, momentum=0.9, nesterov=True)
    cfx.tree.assert_tree_close(run_cfx(tx, params, grads), run_torch(make, params, grads, factor))


# ---- lamb and lars against the papers' equations -----------------------------------------------

def lamb_ref(params, grads_seq, lr, b1, b2, eps, wd):
    """You et al. (2019), Algorithm 2, one leaf (= layer) at a time, plain torch."""
    leaves, treedef = cfx.tree.flatten(params)
    ps = [p.clone() for p in leaves]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    for t, grads in enumerate(grads_seq, start=1):
        for i, g in enumerate(cfx.tree.leaves(grads)):
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            m_hat = ms[i] / (1 - b1 ** t)
            v_hat = vs[i] / (1 - b2 ** t)
            r = m_hat / (v_hat.sqrt() + eps) + wd * ps[i]
            p_norm, r_norm = ps[i].norm(), r.norm()
            ratio = p_norm / r_norm if p_norm > 0 and r_norm > 0 else 1.0
            ps[i] = ps[i] - lr * ratio * r
    return cfx.tree.unflatten(treedef, ps)


def lars_ref(params, grads_seq, lr, momentum, eta, wd, nesterov, flags):
    """You et al. (2017), Algorithm 1 (momentum with the local lr inside), plain torch."""
    leaves, treedef = cfx.tree.flatten(params)
    ps = [p.clone() for p in leaves]
    vs = [torch.zeros_like(p) for p in ps]
    for grads in grads_seq:
        for i, g in enumerate(cfx.tree.leaves(grads)):
            if flags[i]:
                p_norm, g_norm = ps[i].norm(), g.norm()
                local_lr = eta * p_norm / (g_norm + wd * p_norm) if p_norm > 0 and g_norm > 0 else 1.0
                step = lr * local_lr * (g + wd * ps[i])
            else:
                step = lr * g
            vs[i] = momentum * vs[i] + step
            ps[i] = ps[i] - (step + momentum * vs[i] if nesterov else vs[i])
    return cfx.tree.unflatten(treedef, ps)


@given(seeds, shapes, lrs, st.floats(0.0, 0.99), st.floats(0.5, 0.9999), st.floats(1e-8, 1e-3),
       st.sampled_from([0.0, 0.01, 0.1]))
def test_lamb_matches_paper(seed, shapes_, lr, b1, b2, eps, wd):
    params, grads = problem(seed, shapes_)
    params["blocks"].append({"w": torch.zeros(3)})  # ||p|| = 0: ratio 1
    grads = [{**g, "blocks": g["blocks"] + [{"w": torch.randn(3)}]} for g in grads]
    ours = run_cfx(optim.lamb(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd), params, grads)
    cfx.tree.assert_tree_close(ours, lamb_ref(params, grads, lr, b1, b2, eps, wd))


@given(seeds, shapes, st.floats(0.01, 1.0), st.sampled_from([0.0, 0.9]), st.floats(1e-3, 0.1),
       st.sampled_from([0.0, 1e-4, 0.1]), st.booleans(), st.data())
def test_lars_matches_paper(seed, shapes_, lr, momentum, eta, wd, nesterov, data):
    nesterov = nesterov and momentum > 0
    params, grads = problem(seed, shapes_)
    n = len(shapes_)
    flags = data.draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=n, max_size=n)))
    mask = None if flags is None else nest(flags)
    tx = optim.lars(lr, momentum=momentum, weight_decay=wd, trust_coefficient=eta,
                    nesterov=nesterov, mask=mask)
    flags = [True] * n if mask is None else cfx.tree.leaves(mask)  # leaf order
    ref = lars_ref(params, grads, lr, momentum, eta, wd, nesterov, flags)
    cfx.tree.assert_tree_close(run_cfx(tx, params, grads), ref)


# ---- norms and clipping -----------------------------------------------------------------------

@given(seeds, shapes, st.floats(0.01, 10.0))
def test_clip_by_global_norm_matches_torch(seed, shapes_, max_norm):
    _, grads = problem(seed, shapes_)
    tx = optim.clip_by_global_norm(max_norm)
    state = tx.init(grads[0])
    for g in grads[:3]:
        g = cfx.tree.map(lambda x: x * 3.0, g)
        ours, _ = tx.update(g, state)
        ps = [torch.zeros_like(x, requires_grad=True) for x in cfx.tree.leaves(g)]
        for p, x in zip(ps, cfx.tree.leaves(g)):
            p.grad = x.clone()
        total = torch.nn.utils.clip_grad_norm_(ps, max_norm)
        torch.testing.assert_close(optim.global_norm(g), total)
        torch.testing.assert_close(cfx.tree.leaves(ours), [p.grad for p in ps])


def test_global_norm_matches_textbook():
    g = torch.Generator().manual_seed(0)
    tree = {"a": torch.randn(7, 3, generator=g), "b": [torch.randn(5, generator=g).double(),
                                                       torch.randn(4, 4, generator=g).bfloat16()],
            "c": None}
    ref = math.sqrt(sum(float(x.double().pow(2).sum()) for x in cfx.tree.leaves(tree)))
    out = optim.global_norm(tree)
    assert out.dtype == torch.float32 and out.shape == ()
    torch.testing.assert_close(out, torch.tensor(ref, dtype=torch.float32))
    assert float(optim.global_norm({})) == 0.0


def test_trust_ratio_is_one_for_zero_norms():
    params = {"zero": torch.zeros(3), "p": torch.ones(4)}
    grads = {"zero": torch.ones(3), "p": torch.zeros(4)}
    tx = optim.scale_by_trust_ratio()
    out, _ = tx.update(grads, tx.init(params), params)
    assert_tree_equal(out, grads)
    out, _ = tx.update({"zero": torch.ones(3), "p": torch.full((4,), 2.0)}, tx.init(params), params)
    torch.testing.assert_close(out["p"], torch.full((4,), 1.0))  # 2 * ||p|| / ||u|| = 2 * 2 / 4


# ---- structure, state and errors --------------------------------------------------------------

def test_apply_updates_casts_to_param_dtype():
    params = {"w": torch.ones(3, dtype=torch.bfloat16)}
    out = optim.apply_updates(params, {"w": torch.full((3,), 0.5)})
    assert out["w"].dtype == torch.bfloat16
    torch.testing.assert_close(out["w"], torch.full((3,), 1.5, dtype=torch.bfloat16))


def test_apply_updates_names_mismatched_paths():
    params = {"blocks": [{"w": torch.ones(2)}, {"w": torch.ones(2)}], "head": torch.ones(2)}
    updates = {"blocks": [{"w": torch.ones(2)}, {"v": torch.ones(2)}], "head": torch.ones(2)}
    with pytest.raises(ValueError, match=r"blocks\.1\.w") as e:
        optim.apply_updates(params, updates)
    assert "blocks.1.v" in str(e.value)
    tx = optim.adamw(1e-3)
    with pytest.raises(ValueError, match=r"blocks\.1\.w"):
        tx.update(updates, tx.init(params), params)


def test_mask_with_wrong_structure_names_path():
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    tx = optim.adamw(1e-3, mask={"w": True})
    with pytest.raises(ValueError, match=r"'b'"):
        tx.update(params, tx.init(params), params)
    tx = optim.adamw(1e-3, mask={"w": True, "b": 1})
    with pytest.raises(ValueError, match="Python bools"):
        tx.update(params, tx.init(params), params)


@pytest.mark.parametrize("make", [
    lambda: optim.sgd(0.1, 0.9), lambda: optim.adam(1e-3), lambda: optim.adamw(1e-3),
    lambda: optim.lamb(1e-3), lambda: optim.lars(0.1),
    lambda: optim.adamw(optim.cosine_decay_schedule(1e-3, 10)),
    lambda: optim.dynamic_loss_scale(optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))),
])
def test_state_is_a_tree_of_tensors(make):
    params = {"w": torch.randn(3, 2), "b": [torch.randn(2)]}
    tx = make()
    state = tx.init(params)
    for _ in range(2):
        _, state = tx.update(cfx.tree.map(torch.ones_like, params), state, params)
        leaves = cfx.tree.leaves(state)
        assert leaves and all(isinstance(x, torch.Tensor) for x in leaves)
        assert cfx.tree.structure(state) == cfx.tree.structure(tx.init(params))


def test_empty_tree():
    for tx in [optim.sgd(0.1, 0.9), optim.adamw(1e-3), optim.lamb(1e-3), optim.lars(0.1),
               optim.clip_by_global_norm(1.0)]:
        updates, _ = tx.update({}, tx.init({}), {})
        assert updates == {}
    assert optim.apply_updates({}, {}) == {}


def test_scale_by_schedule_counts_from_zero():
    seen = []
    tx = optim.scale_by_schedule(lambda c: seen.append(c) or 2.0 * (c + 1))
    params = {"w": torch.ones(2)}
    state = tx.init(params)
    for k in range(3):
        u, state = tx.update(params, state)
        torch.testing.assert_close(u["w"], torch.full((2,), 2.0 * (k + 1)))
    assert [int(c) for c in seen] == [0, 1, 2]
    assert all(c.dtype == torch.int32 and c.shape == () for c in seen)


@pytest.mark.parametrize("make, match", [
    (lambda: optim.sgd(-0.1), "learning_rate=-0.1"),
    (lambda: optim.sgd(0.1, -0.9), "momentum"),
    (lambda: optim.sgd(0.1, nesterov=True), "nesterov"),
    (lambda: optim.sgd(0.1, weight_decay=-1.0), "weight_decay"),
    (lambda: optim.adam(1e-3, b1=1.0), r"b1=1.0 must be in \[0, 1\)"),
    (lambda: optim.adamw(1e-3, b2=-0.1), "b2"),
    (lambda: optim.adamw(1e-3, eps=-1e-8), "eps"),
    (lambda: optim.adamw("fast"), "learning_rate"),
    (lambda: optim.lars(0.1, trust_coefficient=0.0), "trust_coefficient"),
    (lambda: optim.clip_by_global_norm(0.0), "max_norm"),
    (lambda: optim.chain(optim.sgd(0.1), "adam"), "argument 1"),
    (lambda: optim.scale_by_schedule(0.1), "callable"),
])
def test_bad_hyperparameters_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_weight_decay_needs_params():
    tx = optim.adamw(1e-3)
    params = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match="needs the params"):
        tx.update(params, tx.init(params))


# ---- the fused Adam sweep -----------------------------------------------------------------------

@given(seeds, shapes, st.sampled_from(["adam", "adamw"]), st.sampled_from([0.0, 0.1]), st.booleans())
def test_fused_adam_aliases_equal_their_chains(seed, shapes_, which, wd, scheduled):
    params, grads = problem(seed, shapes_)
    lr = optim.linear_schedule(1e-2, 1e-3, 10) if scheduled else 1e-2
    mask = lambda p: cfx.tree.map(lambda x: x.dim() >= 1, p)  # noqa: E731
    if which == "adam":
        fused = optim.adam(lr, b2=0.95, weight_decay=wd)
        chained = optim.chain(optim.add_decayed_weights(wd), optim.scale_by_adam(b2=0.95),
                              optim.scale_by_learning_rate(lr))
    else:
        fused = optim.adamw(lr, b2=0.95, weight_decay=wd, mask=mask)
        chained = optim.chain(optim.scale_by_adam(b2=0.95), optim.add_decayed_weights(wd, mask=mask),
                              optim.scale_by_learning_rate(lr))
    s1, s2 = fused.init(params), chained.init(params)
    for grads_k in grads[:5]:
        u1, s1 = fused.update(grads_k, s1, params)
        u2, s2 = chained.update(grads_k, s2, params)
        cfx.tree.assert_tree_close(u1, u2)
        cfx.tree.assert_tree_close(s1, s2)  # same structure, so checkpoints interchange
        params = optim.apply_updates(params, u1)


def test_adamw_stays_differentiable_for_params_that_require_grad():
    params = {"w": torch.randn(3, requires_grad=True)}
    tx = optim.adamw(1e-2)
    updates, _ = tx.update({"w": torch.ones(3)}, tx.init(params), params)
    new = optim.apply_updates(params, updates)
    (d,) = torch.autograd.grad(new["w"].sum(), params["w"])
    torch.testing.assert_close(d, torch.full((3,), 1.0 - 1e-2 * 1e-2))


def test_donated_adam_writes_in_place_and_gives_the_same_numbers():
    from cfx._src.core import donation
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(5, 3, generator=g), "b": torch.randn(3, generator=g)}
    grads = {"w": torch.randn(5, 3, generator=g), "b": torch.randn(3, generator=g)}
    for tx, decoupled in ((cfx.optim.adamw(1e-2, weight_decay=0.1), True), (cfx.optim.adam(1e-2, weight_decay=0.1), False)):
        state = tx.update(grads, tx.init(params), params)[1]  # a non-zero state
        want_u, want_s = tx.update(grads, state, params)
        want_p = cfx.optim.apply_updates(params, want_u)
        p, s, gr = (cfx.tree.map(torch.clone, t) for t in (params, state, grads))
        ptrs = [x.data_ptr() for x in cfx.tree.leaves((p, s, gr)) if x.dim()]
        with donation.donated(cfx.tree.leaves((p, s, gr))):
            u, s2 = tx.update(gr, s, p)
            p2 = cfx.optim.apply_updates(p, u)
        for a, b in zip(cfx.tree.leaves((p2, s2)), cfx.tree.leaves((want_p, want_s))):
            assert torch.equal(a, b)
        kept = {x.data_ptr() for x in cfx.tree.leaves((p2, s2, u if decoupled else {})) if x.dim()}
        assert kept <= set(ptrs)  # params, moments (and adamw's updates) live in the donated buffers


def run_applied(tx, params, grads_seq, *, donate):
    """``apply_gradients`` step after step: with ``donate``, params, state and grads donated (the
    fused sweep writes into the params' buffers); else the inputs must stay untouched."""
    from cfx._src.core import donation
    params, state = clone(params), tx.init(params)
    for grads in grads_seq:
        grads = clone(grads)
        before = clone((grads, params, state))
        ptrs = [x.data_ptr() for x in cfx.tree.leaves(params) if x.numel()]
        with donation.donated(cfx.tree.leaves((params, state, grads)) if donate else []):
            new, state = optim.apply_gradients(tx, grads, state, params)
        if donate:
            assert [x.data_ptr() for x in cfx.tree.leaves(new) if x.numel()] == ptrs  # in place
        else:
            assert_tree_equal((grads, params, before[2]), before)
        params = new
    return params


@given(seeds, shapes, lrs, st.floats(0.0, 0.99), st.floats(0.5, 0.9999), st.floats(1e-8, 1e-3),
       st.sampled_from([0.0, 0.01, 0.3]), st.sampled_from(["adamw", "adam", "clip+adamw", "masked adamw", "sgd"]),
       st.booleans())
def test_apply_gradients_matches_torch_donated_or_not(seed, shapes_, lr, b1, b2, eps, wd, which, donate):
    params, grads = problem(seed, shapes_)
    if which == "sgd":  # no fused apply: update, then apply_updates
        tx = optim.sgd(lr, momentum=b1, weight_decay=wd)
        make = lambda ps: torch.optim.SGD(ps, lr=lr, momentum=b1, weight_decay=wd)  # noqa: E731
    elif which == "adam":
        tx = optim.adam(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
        make = lambda ps: torch.optim.Adam(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)  # noqa: E731
    else:
        tx = optim.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
        make = lambda ps: torch.optim.AdamW(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)  # noqa: E731
        if which == "clip+adamw":  # a chain whose last member fuses: the clip runs first
            tx = optim.chain(optim.clip_by_global_norm(1e9), tx)
        if which == "masked adamw":  # only matrices decay: two param groups in torch
            tx = optim.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd,
                             mask=lambda p: cfx.tree.map(lambda x: x.dim() >= 2, p))
            make = lambda ps: torch.optim.AdamW(  # noqa: E731
                [g for g in ({"params": [p for p in ps if p.dim() >= 2]},
                             {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}) if g["params"]],
                lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    assert (tx.apply is None) == (which == "sgd")
    ours = run_applied(tx, params, grads, donate=donate)
    cfx.tree.assert_tree_close(ours, run_torch(make, params, grads))


def test_apply_gradients_sweeps_straight_into_donated_params():
    from torch.utils._python_dispatch import TorchDispatchMode

    from cfx._src.core import donation

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    params, grads = problem(0, [(4, 3), (3,), (2,)])
    tx = optim.adamw(1e-2, weight_decay=0.1)
    for donate in (True, False):
        p, g, s = clone(params), clone(grads[0]), tx.init(params)
        with donation.donated(cfx.tree.leaves((p, s, g)) if donate else []), Ops() as ops:
            optim.apply_gradients(tx, g, s, p)
        if donate:  # one pass per leaf in place (torch's fused AdamW kernel): no intermediate, no updates tree
            assert "_fused_adamw_" in ops.names and not {"_foreach_sqrt", "_foreach_add"} & set(ops.names)
        else:  # the foreach sweep, then its updates tree added to fresh params
            assert "_fused_adamw_" not in ops.names and "_foreach_add" in ops.names


@pytest.mark.parametrize("masked", [False, True], ids=["all decay", "masked"])
def test_donated_adamw_launches_what_torch_fused_adamw_launches(masked):
    # one _fused_adamw_ over every leaf, as torch.optim.AdamW(fused=True) steps one param group (two
    # groups, two calls, where a mask splits the leaves); besides it only the step count's increment
    # and cast (torch increments its per-param counts in one _foreach_add_)
    from torch.utils._python_dispatch import TorchDispatchMode

    from cfx._src.core import donation

    class Kernels(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.overloadpacket.__name__.startswith("_record_function"):  # torch.optim's profiler marks
                self.calls.append((func.overloadpacket.__name__, len(args[0]) if isinstance(args[0], list) else 1))
            return func(*args, **(kwargs or {}))

    params, grads = problem(0, [(4, 3), (3,), (2,), (5, 2)])
    mask = (lambda p: cfx.tree.map(lambda x: x.dim() >= 2, p)) if masked else None
    tx = optim.adamw(1e-2, weight_decay=0.1, mask=mask)
    p, g, s = clone(params), clone(grads[0]), tx.init(params)
    with donation.donated(cfx.tree.leaves((p, s, g))), Kernels() as ours:
        optim.apply_gradients(tx, g, s, p)
    ps = [torch.nn.Parameter(x.clone()) for x in cfx.tree.leaves(params)]
    groups = ([{"params": [x for x in ps if x.dim() >= 2]},
               {"params": [x for x in ps if x.dim() < 2], "weight_decay": 0.0}] if masked else [{"params": ps}])
    opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, fused=True)
    for x, gr in zip(ps, cfx.tree.leaves(grads[0])):
        x.grad = gr.clone()
    with Kernels() as theirs:
        opt.step()
    fused = lambda calls: [n for name, n in calls if name == "_fused_adamw_"]  # noqa: E731
    assert sorted(fused(ours.calls)) == sorted(fused(theirs.calls)) == ([2, 2] if masked else [4])
    assert len(ours.calls) - len(fused(ours.calls)) <= 2, ours.calls  # the count: + 1, to float
    for a, b in zip(cfx.tree.leaves(p), ps):  # stepped in place, to torch's numbers
        torch.testing.assert_close(a, b.detach())


@pytest.mark.parametrize("make", [lambda: optim.adamw(1e-3), lambda: optim.adam(1e-3), lambda: optim.lamb(1e-3),
                                  lambda: optim.sgd(0.1, momentum=0.9), lambda: optim.lars(0.1)])
def test_integer_params_are_refused_at_init_naming_the_leaf(make):
    params = {"w": torch.ones(3), "blocks": [{"steps": torch.zeros(2, dtype=torch.int64)}]}
    with pytest.raises(ValueError, match=r"param 'blocks\.0\.steps' is torch\.int64.*floating dtype.*x\.float\(\)"):
        make().init(params)


def test_a_donated_adam_count_steps_in_place_and_an_undonated_one_is_left_alone():
    """Where its caller donated the state, AdamW increments the step count in its own buffer (an
    in-place step then returns every buffer as itself); otherwise the old count keeps its value."""
    from cfx._src.core import donation

    params, grads = problem(0, [(4, 3), (3,)])
    tx = optim.adamw(1e-2, weight_decay=0.1)
    p, g, s = clone(params), clone(grads[0]), tx.init(params)
    count = s[0].count
    _, s1 = optim.apply_gradients(tx, g, s, p)
    assert s1[0].count is not count and int(count) == 0 and int(s1[0].count) == 1
    with donation.donated(cfx.tree.leaves((p, s1, g))):
        _, s2 = optim.apply_gradients(tx, g, s1, p)
    assert s2[0].count is s1[0].count and int(s2[0].count) == 2


def test_adam_reads_through_the_last_structure_but_rebuilds_each_calls_own():
    """A fused Adam reads the leaves of a call shaped like the last one through its structure; a tree
    it rebuilds (updates, moments) has the call's own node kinds, an OrderedDict after a dict."""
    import collections

    tx = optim.adam(1e-2)
    for kind in (dict, collections.OrderedDict, dict):
        params = kind(b=torch.ones(3), a=torch.ones(2))
        grads = kind(b=torch.full((3,), 0.5), a=torch.full((2,), -1.0))
        updates, state = tx.update(grads, tx.init(params), params)
        ref, _ = optim.chain(optim.scale_by_adam(), optim.scale_by_learning_rate(1e-2)).update(
            grads, optim.chain(optim.scale_by_adam(), optim.scale_by_learning_rate(1e-2)).init(params), params)
        assert type(updates) is kind and type(state[1].mu) is kind and list(updates) == ["b", "a"]
        cfx.tree.assert_tree_close(updates, ref)


def test_a_refused_donated_adamw_step_leaves_its_count_as_it_was():
    """The count steps in place only after every check: a step refused for a bad mask can be
    retried with the same state."""
    from cfx._src.core import donation

    params, grads = problem(0, [(4, 3), (3,)])
    bad = optim.adamw(1e-2, weight_decay=0.1, mask=[True])  # not shaped like the params
    p, g, s = clone(params), clone(grads[0]), bad.init(params)
    with donation.donated(cfx.tree.leaves((p, s, g))), pytest.raises(ValueError):
        optim.apply_gradients(bad, g, s, p)
    assert int(s[0].count) == 0
