"""``python -m cfx.bench large_batch``: LAMB and LARS against AdamW and SGD from batch 64 to 64x larger.

The task: scikit-learn's ``load_digits`` (1797 8x8 grey images, 10 classes; shipped inside the
package, nothing downloaded), one fixed split of 1347 training and 450 test images. The model: an
MLP 64 -> 256 -> 256 -> 10 (ReLU), written as a cfx model (``DigitsMLP``: ``init`` / ``apply`` /
``loss`` / ``axes``).

The large-batch problem: every run trains for the same number of epochs, so a batch 64x larger takes
64x fewer steps. An epoch is 1347 examples; the batches are cut from a stream of reshuffled passes
over the training set, so every run sees each example equally often. Batch 4096 on a 1347-image set
therefore holds each image about three times: its gradient is (a weighted) full-batch gradient, and
what is left of the large-batch problem is the step count and the missing gradient noise (150
epochs: 3157 steps at batch 64, 49 at 4096). Batch 4096 is reached by gradient accumulation
(``cfx.optim.accumulate``) over 4 micro-batches of 1024, the largest batch this bench lets through
one forward (``MICRO``); the test file checks that this is batch 4096's step.

The papers' recipes, tuned at batch 64 only (``tune``: base learning rates from a 3-point grid on 300
images held out of the training set, never the test set; ``RECIPES``), then scaled:

* LAMB (You et al., 2019) and AdamW (weight decay 0.01, not on biases): learning rate times
  ``sqrt(B / 64)``, LAMB's square-root rule;
* LARS (You et al., 2017: trust coefficient 1e-3, momentum 0.9, weight decay 5e-4) and SGD with
  momentum 0.9: times ``B / 64``, Goyal et al. (2017)'s linear rule;
* every one: LAMB's schedule -- linear warm-up from 0 over a fraction of the run that grows with the
  batch (1/320 at batch 64 to 1/5 at 4096, LAMB's table: the same 10 steps at every batch size),
  then linear decay to 0.

The rows: each optimizer's final test accuracy at each batch size (the mean over the seeds; the
standard deviation in the unit), and ``<optimizer>_largest_vs_small_baseline``: its accuracy at the
largest batch minus its own at batch 64, in points (LAMB's target: >= -1); ``lamb_largest_vs_best_small``
measures LAMB at the largest batch against the best batch-64 mean of any optimizer; the training and
test losses at batch 64 and the largest batch say whether a gap is under-training (train loss up) or
worse generalisation (train loss ~0, test loss up). Times on 2
shared CPU cores: ``--smoke`` (6 epochs, one seed, batches 64 and 4096) ~2 s, ``--quick`` (150
epochs, one seed) ~30 s, the default (150 epochs, three seeds) ~90 s.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable

import torch

import cfx
from cfx._src.core.text import format_table
from cfx.bench.common import Row, report, size_of

MICRO = 1024        # the largest batch one forward takes here; larger batches accumulate micro-batches
SMALL = 64          # the small-batch baseline's batch size
TEST = 450          # test images (the other 1347 of the 1797 train)


# ---- data and model ----------------------------------------------------------------------------

def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train (1347, 8, 8), y_train, x_test (450, 8, 8), y_test)``: load_digits split by a fixed
    permutation, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits  # ships the data: no download
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32) / 16.0  # (1797, 8, 8), pixel values 0..16
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    test, train = perm[:TEST], perm[TEST:]
    return x[train], y[train], x[test], y[test]


@dataclasses.dataclass(frozen=True)
class DigitsMLP:
    """``in_features -> hidden (x depth, ReLU) -> classes``, each layer a ``cfx.nn.Linear``."""

    in_features: int = 64
    hidden: int = 256
    depth: int = 2
    classes: int = 10

    def layers(self) -> list[cfx.nn.Linear]:
        widths = [self.in_features] + [self.hidden] * self.depth + [self.classes]
        return [cfx.nn.Linear(a, b, axes_names=("embed" if i else "pixels", "mlp" if i < self.depth else "classes"))
                for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))]

    def init(self, key: torch.Tensor) -> dict:
        layers = self.layers()
        return {f"fc{i}": l.init(k) for i, (l, k) in enumerate(zip(layers, cfx.random.split(key, len(layers))))}

    def apply(self, params: dict, images: torch.Tensor) -> torch.Tensor:
        # (B, 8, 8) pixels in [0, 1] -> (B, classes) logits
        x = (images.flatten(1) - 0.3) / 0.4  # (B, 64), about zero mean and unit deviation
        layers = self.layers()
        for i, l in enumerate(layers):
            x = l.apply(params[f"fc{i}"], x)
            x = torch.relu(x) if i < len(layers) - 1 else x
        return x

    def loss(self, params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the batch rows."""
        return torch.nn.functional.cross_entropy(self.apply(params, x), y)

    def axes(self) -> dict:
        return {f"fc{i}": l.axes() for i, l in enumerate(self.layers())}


# ---- the recipes -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Recipe:
    """An optimizer as its paper trains it: ``make(schedule)``, the base learning rate at batch
    ``SMALL``, and how the peak learning rate grows with the batch (``B / SMALL`` to the ``power``:
    0.5 square root, 1 linear)."""

    make: Callable[[Callable], cfx.optim.GradientTransformation]
    base_lr: float
    power: float

    def peak_lr(self, batch: int) -> float:
        return self.base_lr * (batch / SMALL) ** self.power


def _weights_only(params):
    return cfx.tree.map(lambda p: p.dim() >= 2, params)  # no weight decay on biases


# base learning rates: the best mean validation accuracy at batch 64 (``tune``: 150 epochs, seeds 0
# and 1, ties to the smaller) over GRIDS; the test set never chose anything
RECIPES = {
    "adamw": Recipe(lambda lr: cfx.optim.adamw(lr, weight_decay=1e-2, mask=_weights_only), 1e-3, 0.5),
    "lamb": Recipe(lambda lr: cfx.optim.lamb(lr, weight_decay=1e-2, mask=_weights_only), 1e-2, 0.5),
    "lars": Recipe(lambda lr: cfx.optim.lars(lr, momentum=0.9, weight_decay=5e-4, trust_coefficient=1e-3), 1.0, 1.0),
    "sgd": Recipe(lambda lr: cfx.optim.sgd(lr, 0.9, weight_decay=5e-4), 0.1, 1.0),
}
GRIDS = {"adamw": (1e-3, 3e-3, 1e-2), "lamb": (1e-3, 3e-3, 1e-2), "lars": (0.3, 1.0, 3.0), "sgd": (0.03, 0.1, 0.3)}

SIZES = {  # epochs, batch sizes, seeds, optimizers
    "smoke": (6, (64, 4096), (0,), tuple(RECIPES)),
    "quick": (150, (64, 256, 1024, 4096), (0,), tuple(RECIPES)),
    "full": (150, (64, 256, 1024, 4096), (0, 1, 2), tuple(RECIPES)),
}
LARGEST = 4096
WARMUP = 0.2        # warm-up: this fraction of the run at batch LARGEST (1/320 at batch 64; LAMB's table)


# ---- one run -----------------------------------------------------------------------------------

def schedule_for(recipe: Recipe, batch: int, steps: int) -> Callable:
    """The recipe's schedule at ``batch`` over ``steps`` steps: linear warm-up from 0 over
    ``WARMUP / 4096 * batch`` of the run (LAMB's linear-epoch warm-up: the same number of steps at
    every batch size), then linear decay to 0 at the last step."""
    peak = recipe.peak_lr(batch)
    warmup = max(1, round(steps * WARMUP * batch / LARGEST))
    if steps <= warmup:
        return cfx.optim.linear_schedule(0.0, peak, warmup)
    return cfx.optim.join_schedules([cfx.optim.linear_schedule(0.0, peak, warmup),
                                     cfx.optim.linear_schedule(peak, 0.0, steps - warmup)], [warmup])


def train(recipe: Recipe, batch: int, *, epochs: int, seed: int, data=None, model: DigitsMLP = DigitsMLP(),
          micro: int = MICRO) -> dict:
    """One run: ``epochs`` passes' worth of examples at ``batch``, in ``ceil(batch / micro)``
    micro-batches per step. Returns the final params, their test accuracy (%), their mean losses on the
    training and the test set, the steps and the seconds."""
    x_tr, y_tr, x_te, y_te = digits() if data is None else data
    n = len(x_tr)
    k = math.ceil(batch / micro)  # micro-batches per step
    if batch % k:
        raise ValueError(f"large_batch: batch {batch} does not split into {k} equal micro-batches of at most {micro}.")
    mb = batch // k
    steps = max(1, round(epochs * n / batch))
    tx = recipe.make(schedule_for(recipe, batch, steps))
    tx = cfx.optim.accumulate(tx, k) if k > 1 else tx
    g = torch.Generator().manual_seed(seed)
    passes = math.ceil(steps * batch / n)
    order = torch.cat([torch.randperm(n, generator=g) for _ in range(passes)])  # reshuffled passes, one stream
    params = model.init(cfx.random.key(seed))
    state = tx.init(params)
    t0 = time.perf_counter()
    for i in range(steps * k):
        rows = order[i * mb:(i + 1) * mb]
        _, grads = cfx.value_and_grad(model.loss)(params, x_tr[rows], y_tr[rows])
        updates, state = tx.update(grads, state, params)
        params = cfx.optim.apply_updates(params, updates)
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        acc = 100.0 * float((model.apply(params, x_te).argmax(-1) == y_te).float().mean())
        train_loss, test_loss = float(model.loss(params, x_tr, y_tr)), float(model.loss(params, x_te, y_te))
    return {"params": params, "accuracy": acc, "train_loss": train_loss, "test_loss": test_loss, "steps": steps,
            "seconds": seconds}


def tune(name: str, *, epochs: int = 150, seeds=(0, 1)) -> dict[float, float]:
    """``{base lr: mean validation accuracy}`` at batch ``SMALL`` over ``GRIDS[name]``, on 300 images
    held out of the training set (how ``RECIPES``' base learning rates were chosen; ~2 minutes each)."""
    x, y, _, _ = digits()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    val, rest = perm[:300], perm[300:]
    data = (x[rest], y[rest], x[val], y[val])
    return {lr: statistics.fmean(train(dataclasses.replace(RECIPES[name], base_lr=lr), SMALL, epochs=epochs,
                                       seed=s, data=data)["accuracy"] for s in seeds) for lr in GRIDS[name]}


def sweep(size: str) -> dict:
    """``{(optimizer, batch): [run per seed]}`` at one of ``SIZES``."""
    epochs, batches, seeds, names = SIZES[size]
    data = digits()
    return {(name, b): [train(RECIPES[name], b, epochs=epochs, seed=s, data=data) for s in seeds]
            for name in names for b in batches}


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    size = size_of(quick=quick, smoke=smoke)
    epochs, batches, seeds, names = SIZES[size]
    t0 = time.perf_counter()
    runs = sweep(size)
    stats = {key: _mean_std([r["accuracy"] for r in rs]) for key, rs in runs.items()}
    print(f"load_digits, MLP 64-256-256-10, {epochs} epochs, {len(seeds)} seed(s); test accuracy %, mean ± std "
          f"({time.perf_counter() - t0:.0f} s)")
    cells = [(name, *(f"{stats[name, b][0]:.2f} ± {stats[name, b][1]:.2f}" for b in batches)) for name in names]
    print(format_table(cells, ["optimizer", *(f"batch {b} ({runs[names[0], b][0]['steps']} steps)" for b in batches)]))
    rows = []
    for name in names:
        for b in batches:
            m, s = stats[name, b]
            rows.append(Row(f"{name} batch {b}: test accuracy", round(m, 2),
                            f"% (± {s:.2f} over {len(seeds)} seeds; lr {RECIPES[name].peak_lr(b):.3g}, "
                            f"{runs[name, b][0]['steps']} steps)", "info"))
    big = max(batches)
    for name in names:  # each optimizer against its own small-batch run: does it keep its accuracy?
        gap = stats[name, big][0] - stats[name, SMALL][0]
        rows.append(Row(f"{name}_largest_vs_small_baseline", round(gap, 2),
                        f"points (batch {big} vs {SMALL}: {stats[name, big][0]:.2f}% vs {stats[name, SMALL][0]:.2f}%)",
                        ">= -1 point" if name == "lamb" else "info", gap >= -1.0 if name == "lamb" else True))
    for name in names:  # a gap that is overfitting (train loss ~0, test loss up) or under-training (train loss up)
        for b in (SMALL, big):
            test_loss, train_loss = (statistics.fmean(r[k] for r in runs[name, b]) for k in ("test_loss", "train_loss"))
            rows.append(Row(f"{name} batch {b}: test loss", round(test_loss, 4), f"nats (train loss {train_loss:.1e})",
                            "info"))
    best = max(names, key=lambda name: stats[name, SMALL][0])
    rows.append(Row("lamb_largest_vs_best_small", round(stats["lamb", big][0] - stats[best, SMALL][0], 2),
                    f"points (vs {best} at batch {SMALL}, the best small-batch mean)", "info"))
    rows.append(Row("sweep time", round(time.perf_counter() - t0, 1), "s", "info"))
    return report("large_batch", rows, json_path)
