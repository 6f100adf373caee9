"""Run by test_checkpoint_sharded under torchrun (2 processes, the dist backend): save a state on
{"data": 2}, each process writing its own blocks, then load it back on {"model": 2} with other
specs; then a Plan's state, saved by "data=2 zero=3" in model coordinates and loaded by
"model=2"; each rank writes what it holds to ``<out_dir>/rank<r>.pt``."""
import os
import sys

import torch

import cfx
from cfx import P
from cfx.parallel import Plan


def main(directory: str, out_dir: str) -> None:
    g = torch.Generator().manual_seed(0)
    tree = {"w": torch.randn(8, 6, generator=g), "b": torch.randn(6, generator=g)}
    with cfx.Mesh({"data": 2}, timeout=20) as mesh:
        arrays = cfx.shard_map(lambda t: t, mesh=mesh, in_specs=({"w": P("data"), "b": P()},),
                               out_specs={"w": P("data"), "b": P()})(tree)
        cfx.checkpoint.save(directory, arrays, metadata={"step": 3})
        rank = mesh.backend.rank
        written = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    with cfx.Mesh({"model": 2}, timeout=20) as mesh:
        got, meta = cfx.checkpoint.load(directory, cfx.eval_shape(lambda: tree), mesh=mesh,
                                        specs={"w": P(None, "model"), "b": P("model")})
        blocks = {k: v.blocks[rank] for k, v in got.items()}
    plans = plan_round_trip(directory + "-plan")
    torch.save({"blocks": blocks, "meta": meta, "written": written, **plans}, os.path.join(out_dir, f"rank{rank}.pt"))


def plan_round_trip(directory: str) -> dict:
    model = cfx.models.gpt2("tiny", n_layer=2, vocab_size=64, n_embd=32, n_head=4, n_positions=16)
    data = cfx.random.randint(cfx.random.key(1), (4, 17), 0, 64)
    out = {}
    for text in ("data=2 zero=3", "model=2"):
        plan = Plan.parse(text)
        with plan.make_mesh() as mesh:
            program = plan.step(model, cfx.optim.adamw(1e-3), mesh=mesh, grad_clip=1.0)
            state = program.init(cfx.random.key(0))
            if "saved" not in out:
                state, _ = program(state, (data[:, :-1], data[:, 1:]))
                program.save(directory, state, metadata={"step": 1})
                out["saved"] = program.params(state)
            else:
                state, meta = program.load(directory, state)
                out["loaded"], out["plan_meta"] = program.params(state), meta
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
