"""Plans over the user's own code: a pure loss function with its params (data, ZeRO 1-3, offload,
remat of the whole function, a model axis through the user's specs and collectives), and a model of
the user's own implementing the parts protocol (pipe stages), each equal to one device's AdamW steps."""
import dataclasses

import pytest
import torch

import cfx
from cfx import P

D, H = 8, 16


def loss_fn(p, x, y):  # a 2-layer MLP's mean squared error: a mean over the batch rows
    h = torch.relu(x @ p["w1"] + p["b1"])
    return ((h @ p["w2"] - y) ** 2).mean()


def tp_loss_fn(p, x, y):  # the same, each model rank with its columns of w1 and rows of w2 (Megatron's MLP)
    h = torch.relu(x @ p["w1"] + p["b1"])
    return ((cfx.lax.psum(h @ p["w2"], "model") - y) ** 2).mean()


TP_SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}


def mlp_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(D, H, generator=g) * 0.3, "b1": torch.randn(H, generator=g) * 0.1,
            "w2": torch.randn(H, 1, generator=g) * 0.3}


def batch(seed=1, rows=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, D, generator=g), torch.randn(rows, 1, generator=g)


def one_device(loss, params, batches, tx):
    state = tx.init(params)
    for b in batches:
        _, grads = cfx.value_and_grad(loss)(params, *b)
        updates, state = tx.update(grads, state, params)
        params = cfx.optim.apply_updates(params, updates)
    return params


def run_plan(text, loss, batches, tx, **function):
    plan = cfx.parallel.Plan.parse(text)
    with plan.make_mesh() as mesh:
        step = plan.step(loss, tx, mesh=mesh, **function)
        state = step.init(cfx.random.key(0))
        for b in batches:
            state, _ = step(state, b)
        return step.params(state)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("text", ["data=2", "data=2 zero=1", "data=2 zero=3 offload=host", "data=2 zero=2 remat=blocks",
                                  "data=4 zero=3 remat=dots"])
def test_a_loss_function_trains_under_a_plan_as_on_one_device(text):
    params, tx = mlp_params(), cfx.optim.adamw(1e-2, weight_decay=0.1)
    batches = [batch(s) for s in (1, 2, 3)]
    got = run_plan(text, loss_fn, batches, tx, params=params)
    cfx.tree.assert_close(got, one_device(loss_fn, params, batches, tx))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("text", ["data=2,model=2", "data=2,model=2 zero=3"])
def test_specs_lay_a_loss_function_over_the_model_axis(text):
    params, tx = mlp_params(), cfx.optim.adamw(1e-2)
    batches = [batch(s) for s in (1, 2)]
    got = run_plan(text, tp_loss_fn, batches, tx, params=params, specs=TP_SPECS)
    cfx.tree.assert_close(got, one_device(loss_fn, params, batches, tx))


def test_an_init_instead_of_params_and_describe_on_shapes():
    tx = cfx.optim.adamw(1e-2)
    plan = cfx.parallel.Plan.parse("data=2 zero=3")
    text = str(plan.describe(loss_fn, tx, init=lambda key: mlp_params()))
    assert "gathered block" in text and "optimizer" in text
    got = run_plan("data=2 zero=3", loss_fn, [batch()], tx, init=lambda key: mlp_params())
    cfx.tree.assert_close(got, one_device(loss_fn, mlp_params(), [batch()], tx))


@pytest.mark.parametrize("text,match", [
    ("pipe=2,data=1", r"the pipe axis cuts a model into stages of blocks; the loss function 'loss_fn' has none"),
    ("data=1,model=2", r"no spec of 'loss_fn' names the model axis"),
    ("data=2 remat=auto:1MiB", r"remat=auto schedules a chain of blocks; the loss function 'loss_fn' has none"),
])
def test_what_a_loss_function_cannot_take_is_one_line_naming_the_axis(text, match):
    with pytest.raises(ValueError, match=match):
        cfx.parallel.Plan.parse(text).check(loss_fn, params=mlp_params())


def test_bad_function_arguments_are_named():
    plan = cfx.parallel.Plan.parse("data=2")
    with plan.make_mesh() as mesh:
        with pytest.raises(ValueError, match="params=.*or a function making them.*exactly one"):
            plan.step(loss_fn, cfx.optim.sgd(0.1), mesh=mesh)
        step = plan.step(loss_fn, cfx.optim.sgd(0.1), mesh=mesh, params=mlp_params())
        state = step.init(cfx.random.key(0))
        with pytest.raises(ValueError, match=r"must share their first dim.*\(16, 8\), \(8, 1\)"):
            step(state, (torch.zeros(16, D), torch.zeros(8, 1)))


# -- your own model, speaking the parts protocol: a pipe axis cuts it into stages ------------------------------
@dataclasses.dataclass(frozen=True)
class Residual:  # a block: init / apply / axes; apply takes mask= and key= (unused here)
    width: int

    def init(self, key):
        return {"w": cfx.random.normal(key, (self.width, self.width)) * 0.1}

    def apply(self, p, h, *, mask=None, key=None):
        return h + torch.tanh(h @ p["w"])  # (b, C) -> (b, C)

    def axes(self):
        return {"w": ("embed", "mlp")}


@dataclasses.dataclass(frozen=True)
class DeepMLP:  # an input projection | a chain of residual blocks | a head and its loss
    d_in: int
    width: int
    n_blocks: int
    blocks: tuple = None
    batch_axes = ("batch",)  # a batch is (x, y): rows split over data

    def __post_init__(self):
        if self.blocks is None:
            object.__setattr__(self, "blocks", (Residual(self.width),) * self.n_blocks)

    def init(self, key):
        k = cfx.random.split(key, self.n_blocks + 2)
        return {"inp": {"w": cfx.random.normal(k[0], (self.d_in, self.width)) * 0.3},
                "blocks": [b.init(kb) for b, kb in zip(self.blocks, k[1:-1])],
                "head": {"w": cfx.random.normal(k[-1], (self.width, 1)) * 0.3}}

    def axes(self):
        return {"inp": {"w": (None, "embed")}, "blocks": [b.axes() for b in self.blocks], "head": {"w": ("embed", None)}}

    def map_blocks(self, f):
        return dataclasses.replace(self, blocks=tuple(f(b) for b in self.blocks))

    def embed(self, p, x):
        return x @ p["inp"]["w"]  # (b, D) -> (b, C)

    def head_loss(self, p, h, y):
        return ((h @ p["head"]["w"] - y) ** 2).mean()

    def features(self, p, x):
        h = self.embed(p, x)
        for block, bp in zip(self.blocks, p["blocks"]):
            h = block.apply(bp, h)
        return h  # (b, C)

    def apply(self, p, x, *, key=None):
        return self.features(p, x) @ p["head"]["w"]  # predictions (b, 1)

    def loss(self, p, x, y, *, key=None):
        return self.head_loss(p, self.features(p, x), y)

    def check_train_batch(self, batch, where):
        if len(batch) != 2 or batch[0].shape[0] != batch[1].shape[0]:
            raise ValueError(f"{where}: a batch is (x, y) with the same rows")

    def parts(self):
        return cfx.models.ModelParts(first=("inp",), last=("head",), embed=self.embed, head_loss=self.head_loss,
                                     check=lambda x, y: None, width=self.width,
                                     act_shape=lambda shape: (shape[0], self.width))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("text", ["pipe=2,data=2 microbatches=2", "pipe=2,data=2 zero=1 microbatches=4 schedule=gpipe",
                                  "data=2 zero=3 remat=blocks"])
def test_your_own_model_with_the_parts_protocol_trains_on_pipe_stages(text):
    model, tx = DeepMLP(D, 12, 4), cfx.optim.adamw(1e-2)
    params = model.init(cfx.random.key(0))
    batches = [batch(s) for s in (1, 2)]
    want = one_device(model.loss, params, batches, tx)
    plan = cfx.parallel.Plan.parse(text)
    with plan.make_mesh() as mesh:
        step = plan.step(model, tx, mesh=mesh)
        state = step.init(cfx.random.key(0))
        for b in batches:
            state, _ = step(state, b)
        cfx.tree.assert_close(step.params(state), want)


def test_grad_clip_in_front_of_loss_scaling_is_refused_with_the_fix():
    tx = cfx.optim.dynamic_loss_scale(cfx.optim.adamw(1e-3))
    plan = cfx.parallel.Plan.parse("data=2")
    with plan.make_mesh() as mesh, pytest.raises(ValueError, match=r"would clip the loss-scaled gradients.*clip inside"):
        plan.step(loss_fn, tx, mesh=mesh, params=mlp_params(), grad_clip=1.0)


V = 12
EMB_SPECS = {"emb": P(), **TP_SPECS}  # the embedding the same on every model rank, upstream of the split w1


def emb_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(V, D, generator=g) * 0.5, **mlp_params(seed)}


def emb_loss_fn(p, tokens, y, reduce=lambda o: o):  # one device's function (reduce: the model axis's, on a mesh)
    h = torch.relu(p["emb"][tokens] @ p["w1"] + p["b1"])
    return ((reduce(h @ p["w2"]) - y) ** 2).mean()


def emb_tp_loss_fn(p, tokens, y):  # as JAX writes it: no pvary on the replicated emb, one psum where w2's rows end
    return emb_loss_fn(p, tokens, y, reduce=lambda o: cfx.lax.psum(o, "model"))


def token_batch(seed=1, rows=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (rows,), generator=g), torch.randn(rows, 1, generator=g)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("text", ["data=1,model=2", "data=2,model=2", "data=2,model=2 zero=1", "data=2,model=2 zero=3"])
def test_a_replicated_param_upstream_of_a_split_gets_jax_implicit_pvary(text):
    """The first week's stopper: a param the same on every model rank meeting the column-split w1 needs
    no cfx.lax.pvary of the user's -- its gradient is summed over model as JAX's check_vma=True does."""
    params, tx = emb_params(), cfx.optim.adamw(1e-2)
    batches = [token_batch(s) for s in (1, 2)]
    got = run_plan(text, emb_tp_loss_fn, batches, tx, params=params, specs=EMB_SPECS)
    cfx.tree.assert_close(got, one_device(emb_loss_fn, params, batches, tx))
    explicit = lambda p, t, y: emb_tp_loss_fn({**p, "emb": cfx.lax.pvary(p["emb"], "model")}, t, y)  # noqa: E731
    cfx.tree.assert_close(run_plan(text, explicit, batches, tx, params=params, specs=EMB_SPECS), got)  # the old fix


def test_a_forgotten_psum_is_refused_naming_the_function_and_the_fix():
    # one device's function as it is, under the model axis: each rank's partial sum reaches the loss
    with pytest.raises(ValueError, match=r"'emb_loss_fn': its loss varies over 'model': a value computed from params "
                                         r"split over 'model' \(specs=\) reaches the loss without being summed.*"
                                         r"cfx.lax.psum"):
        run_plan("data=2,model=2", emb_loss_fn, [token_batch()], cfx.optim.adamw(1e-2), params=emb_params(),
                 specs=EMB_SPECS)


def test_pmean_for_psum_trains_another_function_which_one_device_shows():
    """Typed alike (both reductions make the value invariant), a pmean where the psum belongs is a
    different function: only a comparison with one device -- cfx's property tests -- tells."""
    wrong = lambda p, t, y: emb_loss_fn(p, t, y, reduce=lambda o: cfx.lax.pmean(o, "model"))  # noqa: E731
    params, tx, batches = emb_params(), cfx.optim.adamw(1e-2), [token_batch()]
    got = run_plan("data=2,model=2", wrong, batches, tx, params=params, specs=EMB_SPECS)
    with pytest.raises(AssertionError):
        cfx.tree.assert_close(got, one_device(emb_loss_fn, params, batches, tx))
