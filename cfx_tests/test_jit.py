"""``cfx.jit``: a whole train step (grad + AdamW) compiles as one graph with no break, equals the
eager step over several steps, writes its outputs into the donated buffers, deletes the donated
arguments, and recompiles only when the signature changes.

Most tests use the ``aot_eager`` backend (dynamo and AOT autograd trace exactly the graph inductor
would get, without generating kernels: seconds instead of a minute); one runs inductor itself.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import pytest
from hypothesis import given
from hypothesis import strategies as st
import torch
import torch._dynamo as dynamo
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

import cfx
from cfx import optim
from cfx._src.transforms.autodiff import TRACES_GRAD_WITH_FUNC

MODELS = {
    "gpt2": lambda: cfx.models.gpt2("tiny", n_layer=1, vocab_size=64, n_embd=32, n_head=4, n_positions=16),
    "llama": lambda: cfx.models.llama("tiny", vocab_size=64, n_layer=1, hidden_size=32, n_head=4, n_kv_heads=2,
                                      intermediate_size=48, max_position_embeddings=16),
}


class State(NamedTuple):
    params: dict
    opt: tuple


def _setup(name: str):
    model = MODELS[name]()
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1))
    params = model.init(cfx.random.key(0))
    batches = [cfx.random.randint(cfx.random.key(i + 1), (2, 2, 16), 0, 64) for i in range(3)]

    def step(state, tokens, targets):
        loss, grads = cfx.value_and_grad(model.loss)(state.params, tokens, targets)
        updates, opt = tx.update(grads, state.opt, state.params)
        return State(optim.apply_updates(state.params, updates), opt), loss

    return step, State(params, tx.init(params)), batches


def _copy(tree):
    return cfx.tree.map(torch.clone, tree)


def _ptrs(tree):
    return [x.untyped_storage().data_ptr() for x in cfx.tree.leaves(tree)]


def _jitted_equals_eager(step, state, batches):
    """``cfx.jit(step)`` (aot_eager, donated) run over ``batches`` beside the eager step: equal losses
    and states, no graph break; the jitted step."""
    ref = _copy(state)
    dynamo.reset()
    counters.clear()
    jstep = cfx.jit(step, donate_argnums=0, backend="aot_eager")
    for tokens, targets in batches:
        state, loss = jstep(state, tokens, targets)
        ref, ref_loss = step(ref, tokens, targets)
        torch.testing.assert_close(loss, ref_loss)
        cfx.tree.assert_tree_close(state, ref)
    assert not counters["graph_break"], dict(counters["graph_break"])
    return jstep


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", MODELS)
def test_jitted_train_step_is_one_graph_and_equals_eager(name):
    stats = _jitted_equals_eager(*_setup(name)).stats()
    assert (stats.signatures, stats.compiles, stats.recompiles, stats.calls) == (1, 1, 0, 3)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", MODELS)
def test_on_cuda_the_jitted_step_is_one_graph_and_equals_eager(name):
    """On CUDA the kernels' ``impl="auto"`` runs the plain-PyTorch references inside the traced step
    (their Triton launch code -- a find_spec, a device query -- broke cfx.jit's one graph on the H200)."""
    step, state, batches = _setup(name)
    state, batches = cfx.tree.map(lambda x: x.cuda(), (state, batches))
    stats = _jitted_equals_eager(step, state, batches).stats()
    assert (stats.signatures, stats.compiles, stats.recompiles) == (1, 1, 0)


@pytest.mark.timeout(300)
def test_on_torch_2_11_the_gradient_is_traced_through_torch_func(monkeypatch):
    """torch 2.11's dynamo (the GPU image's) cannot trace ``requires_grad_`` in the graph, so there
    ``cfx.grad`` differentiates through ``torch.func`` (``autodiff.TRACES_GRAD_WITH_FUNC``); the same
    path, forced here on this torch, compiles the step as one graph equal to eager, and a remat
    policy inside it is a ValueError with the fix (torch.func cannot run checkpointing)."""
    from cfx._src.remat import engine
    from cfx._src.transforms import autodiff
    monkeypatch.setattr(autodiff, "TRACES_GRAD_WITH_FUNC", True)
    monkeypatch.setattr(engine, "TRACES_GRAD_WITH_FUNC", True)
    step, state, batches = _setup("gpt2")
    fresh = _copy(state)  # (the run donates state)
    graph = _jitted_equals_eager(step, state, batches).lower(fresh, *batches[0]).text()
    assert "_autograd_grad(" in graph  # torch.func's, not torch.autograd.grad
    model = MODELS["gpt2"]().map_blocks(lambda b: cfx.remat(b, policy=cfx.checkpoint_policies.nothing_saveable))
    params = model.init(cfx.random.key(0))
    with pytest.raises(ValueError, match=r"cfx.remat inside cfx.jit needs torch 2.12 or later .* compile=False"):
        cfx.jit(cfx.value_and_grad(model.loss), backend="aot_eager")(params, *batches[0])


@pytest.mark.timeout(600)
def test_inductor_step_writes_into_the_donated_buffers():
    step, state, batches = _setup("gpt2")
    ref = _copy(state)
    before = _ptrs(state)
    jstep = cfx.jit(step, donate_argnums=0)
    lowered = jstep.lower(state, *batches[0])
    assert lowered.compile_seconds > 0 and lowered.graph_count == 1
    assert "autograd_grad(" in lowered.text() or "autograd.grad(" in lowered.text()  # the backward is in the graph
    for tokens, targets in batches:
        state, loss = jstep(state, tokens, targets)
        ref, ref_loss = step(ref, tokens, targets)
    torch.testing.assert_close(loss, ref_loss)
    # inductor fuses differently (rounding-level differences); the attention key bias's gradient is
    # zero in exact arithmetic (softmax ignores a per-query constant), so Adam turns rounding into
    # steps of up to lr: compare at that scale
    cfx.tree.assert_tree_close(state, ref, rtol=1e-4, atol=1e-4)
    assert _ptrs(state) == before  # params, moments and the count live where they lived
    assert jstep.stats().recompiles == 0


def _sgd_setup():
    def step(state, x):
        loss, grads = cfx.value_and_grad(lambda p: (torch.tanh(x @ p["w"] + p["b"]) ** 2).mean())(state.params)
        return State(cfx.tree.map(lambda p, g: p - 0.1 * g, state.params, grads), state.opt), loss

    params = {"w": torch.randn(3, 4), "b": torch.zeros(4)}
    return step, State(params, (torch.zeros(()),)), torch.randn(5, 3)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_a_donated_argument_used_again_raises(compiled):
    step, state, x = _sgd_setup()
    jstep = cfx.jit(step, donate_argnums=0, backend="aot_eager", compile=compiled)
    old = state
    new, _ = jstep(state, x)
    with pytest.raises(ValueError, match=r"donated to step \(argument 0 leaf 'params\.w'\)"):
        old.params["w"] + 1
    with pytest.raises(ValueError, match="cfx.jit\\(step\\): argument 0 leaf 'params.b'.*donated"):
        jstep(State({"w": torch.ones(3, 4), "b": old.params["b"]}, new.opt), x)
    assert "DonatedTensor" in repr(old.opt[0])
    jstep(new, x)  # the returned state is alive


def test_eager_donation_updates_in_place_and_equals_the_pure_step():
    step, state, batches = _setup("llama")
    ref = _copy(state)
    before = _ptrs(state.params) + _ptrs(state.opt)
    estep = cfx.jit(step, donate_argnums=0, compile=False)
    for tokens, targets in batches:
        state, _ = estep(state, tokens, targets)
        ref, _ = step(ref, tokens, targets)
    cfx.tree.assert_tree_close(state, ref)
    assert _ptrs(state.params) + _ptrs(state.opt) == before


def test_eager_donation_reads_each_calls_own_structure():
    """The eager path reads a call's arguments through the last call's structure while they fit;
    a call of another structure (a key more, a list for a tuple, a tensor where a subtree was) is
    walked anew, and each call donates exactly its own leaves."""
    def step(state, g):
        return {k: v.add_(g) if torch.is_tensor(v) else [x.add_(g) for x in v] for k, v in state.items()}

    def ref(state, g):
        return {k: v + g if torch.is_tensor(v) else [x + g for x in v] for k, v in state.items()}

    estep = cfx.jit(step, donate_argnums=0, compile=False)
    shapes = [{"a": torch.zeros(2), "b": [torch.zeros(3)]},
              {"a": torch.zeros(2), "b": [torch.zeros(3)]},
              {"a": torch.zeros(2), "b": [torch.zeros(3)], "c": torch.zeros(1)},
              {"a": torch.zeros(2), "b": [torch.zeros(3), torch.zeros(4)]},
              {"a": torch.zeros(2), "b": torch.zeros(3)}]
    for i, state in enumerate(shapes):
        given = cfx.tree.leaves(state)
        want = ref(_copy(state), torch.tensor(float(i)))
        got = estep(state, torch.tensor(float(i)))
        cfx.tree.assert_tree_close(got, want)
        for x in given:  # every donated leaf of this call, and only those, is gone
            with pytest.raises(ValueError, match="donated"):
                x + 1


@pytest.mark.timeout(300)
def test_only_the_signature_recompiles():
    def f(x, scale, n):
        for _ in range(n):
            x = torch.tanh(x * scale["a"])
        return x

    jf = cfx.jit(f, static_argnums=2, backend="aot_eager")
    for i in range(20):  # new values each call: no recompile
        x, a = torch.randn(4, 3), torch.randn(())
        torch.testing.assert_close(jf(x, {"a": a}, 2), f(x, {"a": a}, 2))
    assert jf.stats().compiles == 1
    jf(torch.randn(5, 3), {"a": torch.randn(())}, 2)         # a new shape
    jf(torch.randn(4, 3, dtype=torch.float64), {"a": torch.randn((), dtype=torch.float64)}, 2)  # dtype
    jf(torch.randn(4, 3), {"a": torch.randn(())}, 3)         # a new static value
    jf(torch.randn(4, 3), {"a": torch.randn(()), "b": 1.0}, 2)  # a new tree structure
    stats = jf.stats()
    assert (stats.signatures, stats.compiles, stats.recompiles, stats.calls) == (5, 5, 0, 24)


@pytest.mark.timeout(300)
def test_dynamic_compiles_one_graph_for_every_batch_size():
    """``dynamic=True``: causal attention over 2 to 5 rows and 6 to 9 positions, and a loss's gradient over
    batches of 3 to 11 rows, are one compile each (the sizes are symbols), equal to eager (without it each
    new shape compiles: ``test_only_the_signature_recompiles``)."""
    attend = functools.partial(cfx.nn.attention, causal=True)
    jattend = cfx.jit(attend, backend="aot_eager", dynamic=True, verbose=False)
    for b, t in [(2, 7), (3, 6), (5, 9)]:  # (no size equal to another at the first call: dynamo would key on it)
        q, k, v = torch.randn(3, b, t, 4, 8).unbind(0)
        torch.testing.assert_close(jattend(q, k, v), attend(q, k, v))

    def loss(w, x, y):
        return torch.nn.functional.cross_entropy(torch.tanh(x @ w["a"]) @ w["b"], y)
    w = {"a": torch.randn(6, 16), "b": torch.randn(16, 5)}
    f = cfx.value_and_grad(loss)
    jf = cfx.jit(f, backend="aot_eager", dynamic=True, verbose=False)
    for rows in (3, 7, 11):
        x, y = torch.randn(rows, 6), torch.randint(0, 5, (rows,))
        (got, got_grads), (want, want_grads) = jf(w, x, y), f(w, x, y)
        torch.testing.assert_close(got, want)
        cfx.tree.assert_tree_close(got_grads, want_grads)
    for jitted, calls in [(jattend, 3), (jf, 3)]:
        stats = jitted.stats()
        assert (stats.signatures, stats.compiles, stats.recompiles, stats.calls) == (1, 1, 0, calls), stats
    with pytest.raises(ValueError, match="dynamic must be True .* or False"):
        cfx.jit(f, dynamic="batch")


def test_each_compile_says_so_on_stderr_unless_silenced(capfd):
    jf = cfx.jit(lambda x: torch.tanh(x) * 2, backend="aot_eager")
    jf(torch.randn(3))
    jf(torch.randn(3))
    jf(torch.randn(4))  # a new signature: compiles again
    err = capfd.readouterr().err
    assert err.count("compiling a new signature") == 2 and err.count("compiled in") == 2, err
    assert "argument 0 leaf '<root>' has shape (4,), was (3,) (each new shape compiles once" in err, err  # why
    quiet = cfx.jit(lambda x: torch.tanh(x) * 3, backend="aot_eager", verbose=False)
    quiet(torch.randn(3))
    assert "cfx.jit" not in capfd.readouterr().err


def test_grad_of_jit_and_jit_of_grad_equal_grad():
    model = MODELS["llama"]()
    params = model.init(cfx.random.key(0))
    x, y = cfx.random.randint(cfx.random.key(1), (2, 2, 16), 0, 64)
    ref = cfx.grad(model.loss)(params, x, y)
    outer = cfx.grad(cfx.jit(model.loss, backend="aot_eager"))(params, x, y)
    inner = cfx.jit(cfx.grad(model.loss), backend="aot_eager")(params, x, y)
    cfx.tree.assert_tree_close(outer, ref)
    cfx.tree.assert_tree_close(inner, ref)


def test_bad_arguments_raise_before_compiling():
    def f(x, y):
        return x + y

    x = torch.ones(3)
    with pytest.raises(ValueError, match="both static and donated"):
        cfx.jit(f, donate_argnums=0, static_argnums=0)
    with pytest.raises(ValueError, match="static argument 1 is a list, which is not hashable"):
        cfx.jit(f, static_argnums=1)(x, [1])
    with pytest.raises(ValueError, match=r"donate_argnums=\(2,\) but the call has 2"):
        cfx.jit(f, donate_argnums=2)(x, x)
    with pytest.raises(ValueError, match="donated argument 0 leaf '<root>' shares its buffer with argument 1"):
        cfx.jit(f, donate_argnums=0)(x, x[:2])
    with pytest.raises(ValueError, match="donated argument 0 leaf '<root>' requires grad"):
        cfx.jit(f, donate_argnums=0)(torch.ones(3, requires_grad=True), x)
    with pytest.raises(ValueError, match="argument 1 leaf 'k' is a Unhashable"):
        cfx.jit(f)(x, {"k": object.__new__(type("Unhashable", (), {"__hash__": None}))})


def test_unused_donation_warns_once():
    jf = cfx.jit(lambda x, y: (x * y).sum(), donate_argnums=0, backend="aot_eager")
    with pytest.warns(UserWarning, match="1 donated buffer"):
        jf(torch.ones(3), torch.ones(3))
    jf(torch.ones(3), torch.ones(3))  # warned already: an error here under filterwarnings=error


def test_decorator_forms():
    @cfx.jit
    def double(x):
        return 2 * x

    @functools.partial(cfx.jit, static_argnums=1, backend="aot_eager")
    def power(x, n):
        return x ** n

    x = torch.arange(3.0)
    torch.testing.assert_close(double(x), 2 * x)
    torch.testing.assert_close(power(x, 3), x ** 3)
    assert double.__name__ == "double" and "static_argnums=(1,)" in repr(power)


def _matmuls_after_aot(model, params, x, y):
    """(loss, grads) of the jitted value_and_grad, and the mm / addmm count of the graph AOT
    autograd hands the compiler (after it rematerialises what the checkpoint tags ask)."""
    graphs = []

    def capture(gm, inputs):
        graphs.append(gm)
        return gm.forward

    out = cfx.jit(cfx.value_and_grad(model.loss), backend=aot_autograd(fw_compiler=capture))(params, x, y)
    mms = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return out, sum(1 for n in graphs[-1].graph.nodes if n.target in mms)


def test_remat_policies_become_what_the_compiler_recomputes():
    model = MODELS["gpt2"]()
    params = model.init(cfx.random.key(0))
    x, y = cfx.random.randint(cfx.random.key(1), (2, 2, 16), 0, 64)
    ref = cfx.value_and_grad(model.loss)(params, x, y)
    _, plain = _matmuls_after_aot(model, params, x, y)
    if TRACES_GRAD_WITH_FUNC:  # torch 2.11: remat inside cfx.jit is refused, saying what to do instead
        remat = model.map_blocks(lambda b: cfx.remat(b, policy=cfx.checkpoint_policies.nothing_saveable))
        with pytest.raises(ValueError, match="needs torch 2.12 or later"):
            _matmuls_after_aot(remat, params, x, y)
        return
    counts = {}
    for name in ("nothing_saveable", "dots_saveable"):
        policy = getattr(cfx.checkpoint_policies, name)
        (loss, grads), counts[name] = _matmuls_after_aot(model.map_blocks(lambda b: cfx.remat(b, policy=policy)),
                                                         params, x, y)
        torch.testing.assert_close(loss, ref[0])
        cfx.tree.assert_tree_close(grads, ref[1])
    # one block: q, k, v, o, fc, proj are recomputed in backward under nothing_saveable; dots_saveable
    # keeps every matmul output (and recomputes only the cheap ops between them)
    assert counts == {"nothing_saveable": plain + 6, "dots_saveable": plain}


def test_donated_buffers_are_known_by_object_and_by_storage():
    from cfx._src.core import donation

    a, b, other = torch.zeros(4), torch.zeros(3), torch.zeros(2)
    assert not donation.all_donated([a])
    with donation.donated([a, b, torch.zeros(0)]):
        assert donation.all_donated([a, b]) and donation.all_donated([b])
        assert donation.all_donated([a[1:], b.view(3, 1)])  # views: by their storage
        assert not donation.all_donated([a, other]) and not donation.all_donated([a, 1.0])
        assert donation.is_donated(a[2:]) and not donation.is_donated(other)
        with donation.donated([other]):
            assert donation.all_donated([a, other])
        assert not donation.all_donated([other])
    assert not donation.all_donated([a])


@given(n=st.integers(0, 6), fresh=st.integers(0, 3), seed=st.integers(0, 2**16),
       drop=st.booleans(), twice=st.booleans())
def test_an_in_place_steps_outputs_keep_their_buffers_as_assign_would_decide(n, fresh, seed, drop, twice):
    """``donation.returned_once`` (the eager path's shortcut for a step returning every donated
    tensor as itself) marks exactly the outputs ``assign`` keeps in their own buffers, and declines
    (None) where a donated tensor is missing from the outputs or returned twice."""
    from cfx._src.core import donation

    bufs = [torch.zeros(k + 1) for k in range(n)]
    outs = bufs + [torch.ones(2) for _ in range(fresh)]
    if drop and bufs:
        outs.remove(bufs[0])
    if twice and bufs:
        outs.append(bufs[-1])
    outs = [outs[i] for i in torch.randperm(len(outs), generator=torch.Generator().manual_seed(seed)).tolist()]
    flags = donation.returned_once(outs, bufs)
    if any(sum(o is b for o in outs) != 1 for b in bufs):  # (one buffer dropped and returned twice is once)
        assert flags is None
        return
    taken = donation.assign(outs, bufs, lambda i, j: outs[i].shape == bufs[j].shape, distinct=True)
    assert flags == [i in taken and outs[i] is bufs[taken[i]] for i in range(len(outs))]
