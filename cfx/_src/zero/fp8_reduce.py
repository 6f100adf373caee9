"""ZeRO-3's gradients reduce-scattered in float8 (a gathered layer's ``fp8_grads``; a Plan's
``fp8_comm=reduce_scatter``): each rank casts the gradient rows it sends to the others to e5m2, each row by its
own amax, and an all-to-all moves the casts with their scales (``S + 4`` bytes a row for bf16's ``2 S``); each
rank sums what it receives in fp32, divided back by the scales. Lossy, as Colossal-AI's FP8 communication is:
an e5m2 cast keeps 2 mantissa bits."""
from __future__ import annotations

import torch

from cfx._src.lax import comm
from cfx._src.nn.fp8 import E5M2, scale_of, to_fp8


def reduce_scatter_fp8(rows: torch.Tensor, ax) -> torch.Tensor:
    """The sum over the ranks of ``ax`` of row ``i`` of their ``rows`` ``(n, S)``, on rank ``i``: each row sent as its
    e5m2 cast and fp32 scale (one all-to-all), the received casts divided back and summed in fp32, in ``rows``'
    dtype (module doc)."""
    with torch.no_grad():
        scales = scale_of(rows, E5M2, dim=1)  # (n, 1): one per row, by its own amax
        cast = to_fp8(rows, E5M2, scales).view(torch.uint8)
        blocks = [torch.cat([c, s.view(torch.uint8)]) for c, s in zip(cast, scales)]
        got = comm.all_to_all_blocks(blocks, ax)
        total = torch.zeros(rows.shape[1], dtype=torch.float32, device=rows.device)
        for b in got:  # by sender, in rank order
            total += b[:-4].view(E5M2).float() / b[-4:].clone().view(torch.float32)  # (the scale: aligned)
        return total.to(rows.dtype)
