"""Run by test_ledger under torchrun (2 processes): each rank writes the error it raised to
``<out_dir>/rank<r>.txt``.

``mismatch``: rank 1 issues pmax where rank 0 issues psum (with check_collectives=True both raise
CollectiveMismatch naming both sides). ``timeout``: rank 1 skips a psum, so rank 0's times out
with a CollectiveTimeout naming it.
"""
import os
import sys
import time

import torch

import cfx
from cfx import P


def main(case: str, out_dir: str) -> None:
    with cfx.Mesh({"data": 2}, timeout=3, check_collectives=case == "mismatch") as mesh:
        def body(x):
            x = cfx.lax.psum(x, "data")  # both ranks
            if cfx.lax.axis_index("data") == 0:
                return cfx.lax.psum(x, "data")
            if case == "mismatch":
                return cfx.lax.pmax(x, "data")
            return x  # skips it
        rank = mesh.backend.rank
        report = os.path.join(out_dir, f"rank{rank}.txt")
        try:
            cfx.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("data"))(torch.ones(4))
            with open(report, "w") as f:
                f.write(f"RANK {rank} skipped")
            time.sleep(6)  # stay up while rank 0 waits, as a rank that went on to other work would
        except Exception as e:  # noqa: BLE001 - reported to the test
            with open(report, "w") as f:
                f.write(f"RANK {rank} {type(e).__name__} {str(e).splitlines()[0]}")
        mesh.backend._closed = True  # a broken mesh: no closing barrier
    os._exit(0)  # without destroying the process group (a peer may be gone)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
