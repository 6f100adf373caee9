"""Sharded checkpoints, measured: what a save writes and what a load holds.

GPT-2 params (the ``small`` widths, the vocabulary padded to 50304; under ``--quick`` 2 layers and a
vocabulary of 8192; toy widths under ``--smoke``),
fp32, saved from ``{"data": 4}`` with every matrix split by rows, loaded onto ``{"model": 4}`` by
Megatron's rules (column- and row-parallel blocks, the vocabulary split): most stored blocks
overlap several loaded ones, so the load reads slices. ``cfx.memory`` books the load's buffers
(each rank's blocks and every slice read) in this process, which addresses all four ranks under
``local``:

* ``load_peak_bytes_vs_own_blocks``: the load's peak over the blocks it returns (target: at
  most 1.1 plus one slice -- the largest stored block, an upper bound on one read);
* ``save_bytes_vs_primary_blocks``: shard bytes written over the primary blocks' bytes (the
  replicas written once; target 1.00 up to safetensors' headers, under 1%);
* save and load wall time;
* a Plan's state (params and AdamW moments) saved in model coordinates from ``data=4 zero=3``
  and resumed by ``pipe=2,data=2``: ``plan_save_bytes_vs_model_state`` (shard bytes over the
  single-device state's; 1.00: every element once, ZeRO's padding left out) and
  ``plan_load_extra_bytes_vs_own_state`` (what the load holds beyond the state it reads into,
  over that state; target: one region read at a time, at most twice the largest block); the
  same state written as a ``torch.distributed.checkpoint`` directory (``to_dcp``) and read back
  into ``pipe=2,data=2`` (``from_dcp``): its bytes over the model state's, and both times;
* ``async_save_blocking_vs_sync``: the same loop of train steps on ``data=2 zero=3`` with a save
  every 2 steps, once with synchronous saves and once with ``async_=True``: the time the loop is
  held by its saves (the copy to host memory, and any wait for the save before), over the
  synchronous saves' time (target <= 0.2); the last save's background write is waited for after
  the loop, as a run's end does, and reported beside it.
"""
from __future__ import annotations

import os
import tempfile
import time

import cfx
from cfx import P
from cfx.bench.common import Row, report, size_of
from cfx.parallel import Plan


def _model(size: str, n_layer: int):
    if size == "smoke":  # every dimension the meshes split still divisible by 4
        return cfx.models.gpt2("tiny", n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    if size == "quick":  # the small widths, 2 layers, a vocabulary of 8192 (the table then weighs as 8 blocks)
        return cfx.models.gpt2("small", n_layer=2, vocab_size=8192)
    return cfx.models.gpt2("small", n_layer=n_layer, vocab_size=50304)  # vocab split 4 ways


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    size = size_of(quick=quick, smoke=smoke)
    model = _model(size, 12)
    params = model.init(cfx.random.key(0))
    total = sum(x.numel() * x.element_size() for x in cfx.tree.leaves(params))
    with tempfile.TemporaryDirectory() as directory:
        rows_split = cfx.tree.map(lambda x: P("data") if x.shape[0] % 4 == 0 else P(), params)
        with cfx.Mesh({"data": 4}) as mesh:
            arrays = cfx.shard_map(lambda t: t, mesh=mesh, in_specs=(rows_split,), out_specs=rows_split)(params)
            t0 = time.perf_counter()
            cfx.checkpoint.save(directory, arrays)
            save_s = time.perf_counter() - t0
        written = sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)
                      if n.endswith(".safetensors"))
        largest_stored = max(_numel(a.block_shape) * 4 for a in cfx.tree.leaves(arrays))
        del arrays
        with cfx.Mesh({"model": 4}) as mesh:
            specs = cfx.Rules(cfx.parallel.MEGATRON_RULES).specs(model.axes(), mesh=mesh)
            with cfx.memory.track() as mem:
                t0 = time.perf_counter()
                loaded, _ = cfx.checkpoint.load(directory, cfx.eval_shape(lambda: params), mesh=mesh, specs=specs)
                load_s = time.perf_counter() - t0
                own = sum(b.numel() * b.element_size() for a in cfx.tree.leaves(loaded) for b in a.blocks.values())
                peak = mem.peak("host")
    ok = peak <= 1.1 * own + largest_stored
    plan_rows = _plan_resume(_model(size, 4))
    async_rows = _async_vs_sync(_model(size, 12))
    return report("checkpoint", [
        Row(f"load_peak_bytes_vs_own_blocks (GPT-2 {model.config.n_layer} layers, data=4 -> model=4)", peak / own,
            "x", f"<= 1.1 + {largest_stored / own:.3f} (one slice)", ok),
        Row("  load peak / own blocks", peak / 2**20, "MiB"),
        Row("  own blocks (4 ranks of this process)", own / 2**20, "MiB"),
        Row("save_bytes_vs_primary_blocks", written / total, "x", "1.00 (+headers < 1%)",
            1.0 <= written / total < 1.01),
        Row("  save time", save_s, "s"),
        Row("  load time", load_s, "s"),
        *plan_rows,
        *async_rows,
    ], json_path)


def _async_vs_sync(model, *, saves: int = 2, every: int = 2, batch: int = 2, seq: int = 16) -> list[Row]:
    """The loop's time held by its saves, synchronous and asynchronous (module doc)."""
    plan = Plan.parse("data=2 zero=3")
    data = cfx.random.randint(cfx.random.key(1), (saves * every, batch, seq + 1), 0, model.config.vocab_size)
    held, write_s = {}, 0.0
    with tempfile.TemporaryDirectory() as directory, plan.make_mesh() as mesh:
        program = plan.step(model, cfx.optim.adamw(1e-3), mesh=mesh)
        state = program.init(cfx.random.key(0))
        state, m = program(state, (data[0, :, :-1], data[0, :, 1:]))  # warm-up: the first step's setup
        for mode in ("sync", "async"):
            held[mode], path = 0.0, os.path.join(directory, mode)
            for i, x in enumerate(data):
                state, m = program(state, (x[:, :-1], x[:, 1:]))
                float(m["loss"])
                if (i + 1) % every == 0:
                    t0 = time.perf_counter()
                    pending = program.save(path, state, async_=mode == "async")
                    held[mode] += time.perf_counter() - t0
            if pending is not None:
                t0 = time.perf_counter()
                pending.wait()
                write_s = time.perf_counter() - t0
    ratio = held["async"] / held["sync"]
    return [
        Row(f"async_save_blocking_vs_sync (GPT-2 {model.config.n_layer} layers, data=2 zero=3, "
            f"{saves} saves)", ratio, "x", "<= 0.2", ratio <= 0.2),
        Row("  loop held by synchronous saves", held["sync"], "s"),
        Row("  loop held by asynchronous saves", held["async"], "s"),
        Row("  the last background write, waited for after the loop", write_s, "s"),
    ]


def _plan_resume(model) -> list[Row]:
    tx = cfx.optim.adamw(1e-3)
    with tempfile.TemporaryDirectory() as directory:
        plan = Plan.parse("data=4 zero=3")
        with plan.make_mesh() as mesh:
            program = plan.step(model, tx, mesh=mesh)
            state = program.init(cfx.random.key(0))
            t0 = time.perf_counter()
            program.save(directory, state)
            save_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            cfx.checkpoint.to_dcp(os.path.join(directory, "dcp"), program, state)
            dcp_save_s = time.perf_counter() - t0
            del state
        dcp_bytes = sum(os.path.getsize(os.path.join(directory, "dcp", n)) for n in os.listdir(os.path.join(directory, "dcp")))
        written = sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)
                      if n.endswith(".safetensors"))
        shapes = cfx.eval_shape(model.init, cfx.random.key(0))
        model_state = sum(_numel(x.shape) * 4 for x in cfx.tree.leaves((shapes, cfx.eval_shape(tx.init, shapes))))
        plan = Plan.parse("pipe=2,data=2")
        with plan.make_mesh() as mesh:
            program = plan.step(model, tx, mesh=mesh)
            like = program.init(cfx.random.key(1))
            blocks = [b.numel() * b.element_size() for a in cfx.tree.leaves(like) for b in a.blocks.values()]
            with cfx.memory.track() as mem:
                t0 = time.perf_counter()
                program.load(directory, like)
                load_s = time.perf_counter() - t0
                extra = mem.peak("host")
            t0 = time.perf_counter()
            program.load(cfx.checkpoint.from_dcp(os.path.join(directory, "dcp"), model, tx), like)
            dcp_load_s = time.perf_counter() - t0
    own, largest = sum(blocks), max(blocks)
    head = _numel(shapes["wte"]["w"].shape) * 4  # HF's lm_head.weight, tied to wte but a key of its own
    return [
        Row(f"plan_save_bytes_vs_model_state (GPT-2 {model.config.n_layer} layers, data=4 zero=3)",
            written / model_state, "x", "1.00 (+headers < 1%)", 1.0 <= written / model_state < 1.01),
        Row("plan_load_extra_bytes_vs_own_state (-> pipe=2,data=2)", extra / own, "x",
            f"<= {2 * largest / own:.3f} (twice the largest block)", extra <= 2 * largest),
        Row("  own state (4 ranks of this process)", own / 2**20, "MiB"),
        Row("  plan save time", save_s, "s"),
        Row("  plan load time", load_s, "s"),
        Row("dcp_bytes_vs_model_state (to_dcp: HF names, the tied lm_head written too)", dcp_bytes / model_state, "x",
            f"<= {1 + head / model_state:.3f} (+ the head, + 1 MiB of DCP metadata)",
            dcp_bytes <= 1.01 * (model_state + head) + 2**20),
        Row("  to_dcp time (process 0 writes)", dcp_save_s, "s"),
        Row("  from_dcp + load time (-> pipe=2,data=2)", dcp_load_s, "s"),
    ]


def _numel(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out
