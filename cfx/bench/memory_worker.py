"""The per-process side of ``python -m cfx.bench memory``: one training strategy's memory and wire
traffic, measured where it runs (a torchrun process, or every rank thread of a local mesh).

    torchrun --nproc-per-node 4 -m cfx.bench.memory_worker state zero3|dp|all OUT_DIR [--quick | --smoke]
    torchrun --nproc-per-node 4 -m cfx.bench.memory_worker traffic all OUT_DIR [--quick | --smoke]

``state``: params and AdamW state as ShardedArrays across a few donated steps, under a
``cfx.memory`` tracker: the peak of the bytes it books (params, grads, optimizer state, gathered
layers), the process's peak RSS growth (VmHWM, reset before the state is built), and the
activations one step saves for backward (``cfx.activation_stats``).

``traffic``: bytes each process writes to its sockets (``/proc/self/io`` wchar: gloo's TCP
transport writes every byte it sends) during a few steps, against the same collectives replayed
alone -- the ops, groups and sizes ``cfx.comm_stats`` recorded for those steps, nothing else.
Their difference is the traffic outside the counted collectives. A control run adds what the old ``dist`` backend did after each
step (``all_gather_object`` of the outputs) to show the measurement sees it. Each rank writes
``OUT_DIR/<strategy>-<rank>.json``.
"""
from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist

import cfx
from cfx import P
from cfx._src.lax import comm, groups
from cfx._src.mesh import context as ctx_lib
from cfx.parallel import Plan, TrainState
from cfx import zero
from cfx.bench.common import size_of

N = 4
CONFIGS = {
    "smoke": dict(model=dict(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=8), batch=4, steps=2),
    "quick": dict(model=dict(n_layer=2, n_embd=256, n_head=4, vocab_size=1024, n_positions=64), batch=8, steps=3),
    "full": dict(model=dict(n_layer=6, n_embd=512, n_head=8, vocab_size=4096, n_positions=128), batch=8, steps=4),
}


def config(quick: bool, *, smoke: bool = False) -> dict:
    return CONFIGS[size_of(quick=quick, smoke=smoke)]


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def written_bytes() -> int:
    """Bytes this process has written so far (``/proc/self/io`` wchar): every socket write of
    gloo's TCP transport, for all the ranks it drives -- and any file write, so none happen
    inside a measured window."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def _gathered(model):
    return zero.gathered(model.map_blocks(lambda b: zero.gathered(b, axis="data")), axis="data")


class Strategy:
    """A train step over a mesh with its state as ShardedArrays (params, optimizer state).

    ``dp`` and ``tp`` are a ``cfx.parallel.Plan``'s step (the CLI's: data parallel over ``data``,
    plus Megatron over ``model``); ``zero3`` is stage 3 over ``data`` with gathered layers."""

    def __init__(self, name: str, mesh, model, tokens):
        self.name, self.mesh, self.model, self.tokens = name, mesh, model, tokens
        tx = cfx.optim.adamw(1e-3)
        key = cfx.random.key(0)
        shapes = cfx.eval_shape(model.init, key)
        self.psi = cfx.tree.size(shapes)
        if name == "zero3":
            ztx = zero(tx, stage=3, axis="data")
            net = _gathered(model)
            pspecs = zero.param_specs(None, shapes, axis="data", mesh=mesh)
            sspecs = ztx.state_specs(shapes, mesh=mesh)
            self.params = zero.init_params(model.init, key, mesh=mesh, axis="data")
            self.state = cfx.shard_map(ztx.init, mesh=mesh, in_specs=(pspecs,), out_specs=sspecs)(self.params)

            def step(p, s, t):
                loss, g = ztx.value_and_grad(lambda p: net.loss(p, t[:, :-1], t[:, 1:]))(p)
                u, s = ztx.update(g, s, p)
                return cfx.optim.apply_updates(p, u), s, cfx.lax.pmean(loss, "data")
            self.step = cfx.shard_map(step, mesh=mesh, in_specs=(pspecs, sspecs, P("data")),
                                      out_specs=(pspecs, sspecs, P()), donate_argnums=(0, 1))
            self.loss_of = lambda p, t: net.loss(p, t[:, :-1], t[:, 1:])
            self.pspecs, self.sspecs, self.batch = pspecs, sspecs, P("data")
        else:
            train = Plan(mesh=tuple(mesh.shape.items())).step(model, tx, mesh=mesh, grad_clip=1.0)
            state = train.init(key)
            self.params, self.state = state.params, state.opt_state

            def step(p, s, t):
                new, metrics = train(TrainState(p, s), (t[:, :-1], t[:, 1:]))
                return new.params, new.opt_state, metrics["loss"]
            self.step = step
            self.loss_of = lambda p, t: train.eval_model.loss(p, t[:, :-1], t[:, 1:])
            self.pspecs, self.batch = train.layout.specs, train.layout.batch_spec

    def run(self, i: int) -> float:
        self.params, self.state, loss = self.step(self.params, self.state, self.tokens[i])
        return float(loss)

    def activation_bytes(self) -> int:
        """Bytes a forward leaves alive for its backward (every op output still held after the
        loss), on this process's first rank."""
        def body(p, t):
            rank = cfx.lax.axis_index(tuple(self.mesh.axis_names))
            with cfx.memory.track() as mem, mem.track_ops("device"), torch.enable_grad():
                loss = self.loss_of(cfx.tree.map(lambda x: x.detach().requires_grad_(), p), t)
                held = mem.live("device", rank=rank, kind="activation")
            del loss
            return torch.tensor([float(held)])
        out = cfx.shard_map(body, mesh=self.mesh, in_specs=(self.pspecs, self.batch),
                            out_specs=P(tuple(self.mesh.axis_names)))(self.params, self.tokens[0])
        return int(next(iter(out.blocks.values()))[0])


def measure_state(name: str, quick: bool, backend: str, *, smoke: bool = False) -> dict:
    """Peak RSS growth over a few steps (no tracker: nothing but the strategy allocates), then the
    bytes a ``cfx.memory`` tracker books during a step (params, grads, optimizer state, gathered
    layers) up to the point where the gradients exist, and one forward's activations."""
    cfg = config(quick, smoke=smoke)
    model = cfx.models.gpt2("tiny", **cfg["model"])
    tokens = cfx.random.randint(cfx.random.key(1), (cfg["steps"], cfg["batch"], model.config.n_positions + 1), 0,
                                model.config.vocab_size)
    with cfx.Mesh({"data": N}, backend=backend) as mesh:
        # warm up on a tiny model first: one-time costs (imports, fake-tensor caches, groups) are
        # not the strategy's memory
        tiny = cfx.models.gpt2("tiny", n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=8)
        Strategy(name, mesh, tiny, cfx.random.randint(cfx.random.key(1), (1, 8, 9), 0, 64)).run(0)
        gc.collect()
        rss0 = _status("VmRSS")
        _reset_peak_rss()
        s = Strategy(name, mesh, model, tokens)
        losses = [s.run(i) for i in range(cfg["steps"])]
        rss_growth = _status("VmHWM") - rss0
        with cfx.memory.track() as mem:
            tracked = _tracked_step(s, mem)
        act = s.activation_bytes()
        shapes = cfx.eval_shape(model.init, cfx.random.key(0))
        root = {k: v for k, v in shapes.items() if k != "blocks"}
    return {"strategy": name, "backend": backend, "ranks": mesh.local_ranks, "psi": s.psi, "n": N,
            "tracked_peak": tracked, "rss_growth": rss_growth, "activations": act,
            "root_bytes": cfx.tree.nbytes(root), "block_bytes": cfx.tree.nbytes(shapes["blocks"][0]),
            "losses": losses}


def _tracked_step(s: Strategy, mem) -> dict | None:
    """ZeRO-3, per rank: ``(peak, states)`` -- the most the tracker books at once (params,
    optimizer state, gathered layers and the gradients as they arrive) from the step's start until
    its gradients exist, and the params + grads + optimizer state held then."""
    if s.name != "zero3":
        return None
    ztx = zero(cfx.optim.adamw(1e-3), stage=3, axis="data")
    net = _gathered(s.model)

    def body(p, st, t):
        rank = cfx.lax.axis_index("data")
        for x in cfx.tree.leaves(st):  # made before this tracker: book it now
            cfx.memory.watch(x, tier="device", kind="optim")
        _, grads = ztx.value_and_grad(lambda p: net.loss(p, t[:, :-1], t[:, 1:]))(p)
        states = sum(mem.live("device", rank=rank, kind=k) for k in ("param", "grad", "optim"))
        return torch.tensor([float(mem.peak("device", rank=rank)), float(states)])
    got = cfx.shard_map(body, mesh=s.mesh, in_specs=(s.pspecs, s.sspecs, P("data")),
                        out_specs=P("data"))(s.params, s.state, s.tokens[0])
    return {r: (int(b[0]), int(b[1])) for r, b in got.blocks.items()}


# -- traffic ------------------------------------------------------------------------------------

def _window(mesh, fn) -> int:
    """Bytes this process writes during ``fn()`` (between barriers, so no other rank's step
    overlaps)."""
    _barrier(mesh)
    before = written_bytes()
    fn()
    after = written_bytes()
    _barrier(mesh)
    return after - before


def _barrier(mesh) -> None:
    if mesh.backend.name == "dist":
        dist.barrier()


def _replay(mesh, records: dict[int, list]) -> None:
    """The recorded collectives again, alone: same ops, groups, sizes and dtypes, per rank."""
    def body(_):
        rank = ctx_lib.current("replay").rank  # (axis_index over every axis would connect a new group)
        for r in records[rank]:
            ax = groups.Axes(r.axes, "replay")
            dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[r.nbytes // max(r.numel, 1)]
            x = torch.ones(r.numel, dtype=dtype)
            if r.op == "all_reduce":
                comm.all_reduce(x, ax)
            elif r.op == "all_gather":
                comm.all_gather_blocks(x, ax)
            elif r.op == "reduce_scatter":
                comm.reduce_scatter_blocks(list(x.chunk(ax.size)), ax)
            elif r.op == "all_to_all":
                comm.all_to_all_blocks(list(x.chunk(ax.size)), ax)
            else:
                raise ValueError(f"replay: {r.op} is not replayed")
        return torch.zeros(1)
    cfx.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(tuple(mesh.axis_names)))(torch.zeros(1))


def measure_traffic(name: str, quick: bool, backend: str, *, control: bool = False, smoke: bool = False) -> dict:
    cfg = config(quick, smoke=smoke)
    model = cfx.models.gpt2("tiny", **cfg["model"])
    steps = cfg["steps"]
    tokens = cfx.random.randint(cfx.random.key(1), (steps + 1, cfg["batch"], model.config.n_positions + 1), 0,
                                model.config.vocab_size)
    shape = {"data": 2, "model": 2} if name == "tp" else {"data": N}
    with cfx.Mesh(shape, backend=backend) as mesh:
        s = Strategy(name, mesh, model, tokens)
        s.run(0)  # warm-up: groups connected, buffers allocated
        stats = cfx.comm_stats()

        def train():
            with stats:
                for i in range(1, steps + 1):
                    s.run(i)
                    if control:  # what the old dist backend did with a step's outputs
                        _ship_outputs(mesh, s.params)
        step_bytes = _window(mesh, train)
        records = {r: [x for x in stats.records if x.rank == r] for r in mesh.local_ranks}
        replays = [_window(mesh, lambda: _replay(mesh, records)) for _ in range(2)]
        counted = sum(x.nbytes for x in stats.records)
    return {"strategy": name + ("+control" if control else ""), "backend": backend, "steps": steps,
            "psi": s.psi, "written_step_bytes": step_bytes, "written_replay_bytes": replays,
            "counted_payload_bytes": counted, "ranks": mesh.local_ranks,
            "records": [(x.op, x.axes, x.numel, x.nbytes) for x in records[mesh.local_ranks[0]]]}


def _ship_outputs(mesh, tree) -> None:
    if mesh.backend.name != "dist":
        return
    blocks = [{r: b for r, b in x.blocks.items()} for x in cfx.tree.leaves(tree)]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, blocks)


def main(argv: list[str]) -> int:
    kind, strategy, out_dir = argv[:3]
    quick, smoke = "--quick" in argv, "--smoke" in argv
    backend = "local" if "--local" in argv else "dist"
    torch.set_num_threads(1)
    if backend == "dist":  # one world for the meshes made one after another in this process
        dist.init_process_group("gloo")
    if kind == "state":  # freed blocks go back to the OS (MALLOC_MMAP_THRESHOLD_), so runs can follow
        results = [measure_state(n, quick, backend, smoke=smoke)
                   for n in (["zero3", "dp"] if strategy == "all" else [strategy])]
    else:
        names = ["dp", "tp", "zero3"] if strategy == "all" else [strategy]
        results = [measure_traffic(n, quick, backend, smoke=smoke) for n in names]
        if backend == "dist":
            results.append(measure_traffic("dp", quick, backend, control=True, smoke=smoke))
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{kind}-{strategy}-{backend}-{rank}.json"), "w") as f:
        json.dump(results, f)
    if backend == "dist":
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
