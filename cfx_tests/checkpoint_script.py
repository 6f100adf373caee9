"""Run by test_checkpoint_sharded under torchrun (2 processes, the dist backend): save a state on
{"data": 2}, each process writing its own blocks, then load it back on {"model": 2} with other
specs; each rank writes what it holds to ``<out_dir>/rank<r>.pt``."""
import os
import sys

import torch

import cfx
from cfx import P


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
    torch.save({"blocks": blocks, "meta": meta, "written": written}, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
