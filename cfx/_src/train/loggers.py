"""Where ``python -m cfx.train`` writes its numbers as it goes (process 0 only): ``--metrics FILE``, a
JSON line per record, and ``--log tensorboard:DIR``, the same numbers as TensorBoard scalars (torch's
``SummaryWriter``: ``loss/train``, ``loss/eval``, ``tokens_per_s``; an MoE model's ``moe/max_load`` and
``moe/dropped`` at the end, ``moe_stats``). Both are flushed as they are written,
so a killed run keeps what it logged, and both forget what a killed run logged past the step a resumed
run starts from, so each step appears once."""
from __future__ import annotations

import json
import os
LOG_KINDS = ("tensorboard",)
SCALARS = {"loss": "loss/train", "eval": "loss/eval", "tok_s": "tokens_per_s",  # record field -> tag
           "router_max_load": "moe/max_load", "router_dropped": "moe/dropped"}


def parse_log(spec: str | None) -> tuple[str, str] | None:
    """``--log KIND:PATH`` as ``(kind, path)``; ValueError naming the forms it takes."""
    if spec is None:
        return None
    kind, sep, path = spec.partition(":")
    if not sep or kind not in LOG_KINDS or not path:
        raise ValueError(f"--log {spec!r}: expected one of {', '.join(k + ':DIR' for k in LOG_KINDS)} "
                         "(e.g. --log tensorboard:runs/tb; --metrics FILE writes JSON lines).")
    return kind, path


def check_log(spec: str | None) -> None:
    """ValueError before step 0 if ``--log`` is malformed or its writer cannot be imported."""
    if parse_log(spec) is not None:
        _summary_writer()


def _summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ValueError(f"--log tensorboard needs the tensorboard package ({e}): "
                         "pip install 'cfx[tensorboard]'.") from None
    return SummaryWriter


class RunLog:
    """``log(step=, **fields)`` writing to every destination asked for (module doc); ``close()`` at the end."""

    def __init__(self, *, metrics: str | None, log: str | None, start: int, is_main: bool):
        self.path, self.writer = (metrics if is_main else None), None
        if self.path and start > 0 and os.path.exists(self.path):
            _drop_lines_after(self.path, start)
        if is_main and parse_log(log) is not None:
            # purge_step: what a killed run wrote after ``start`` (the resumed checkpoint's step) is dropped
            # when TensorBoard reads the logs; its train loss at ``start`` stays (this run does not compute it)
            self.writer = _summary_writer()(log_dir=parse_log(log)[1], purge_step=start + 1 if start > 0 else None)

    def __call__(self, step: int, **fields) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **fields}) + "\n")
        if self.writer is not None:
            for name, value in fields.items():
                if name in SCALARS and value is not None:
                    self.writer.add_scalar(SCALARS[name], value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _drop_lines_after(path: str, start: int) -> None:
    """A resumed run rewrites the steps after its checkpoint's ``start``: drop the lines a killed run wrote
    for them (and its evaluation at ``start``, which this run logs again), so each step appears once."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    kept = [r for r in records if r.get("step", 0) < start or (r.get("step") == start and "eval" not in r)]
    if len(kept) < len(records):
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(path + ".tmp", path)
