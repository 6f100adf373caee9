"""cfx.optim.sharded: global norms and inf/nan checks over every rank's part of a tree, against
the norm of the whole tree."""
import pytest
import torch

import cfx

@pytest.mark.timeout(60)
def test_sharded_global_norm_and_finiteness_span_every_rank():
    """``cfx.optim.sharded``: a leaf split over ``model`` counts its shards' squares once each, a
    replicated leaf once, a stage's own leaf (other pipe ranks hold others) sums over ``pipe``."""
    from cfx import P
    w = torch.arange(8.0).reshape(4, 2)  # split over model
    b = torch.tensor([3.0, 4.0])         # replicated
    stage = torch.tensor([[1.0, 2.0], [2.0, 4.0]])  # row r lives on pipe rank r
    expected = torch.sqrt((w ** 2).sum() + (b ** 2).sum() + (stage ** 2).sum())

    def body(w, b, s):
        tree = {"w": w, "b": b, "s": s}
        # per leaf in flatten order (dict keys sorted): b, s, w
        with cfx.optim.sharded([(), (), ("model",)], total_axes=[(), ("pipe",), ("model",)],
                               every=("pipe", "model"), psum=cfx.lax.psum):
            norm = cfx.optim.global_norm(tree)
            bad = {"w": w, "b": b, "s": s / 0 if cfx.lax.axis_index("pipe") == 1 else s}
            finite = cfx.optim.all_finite(bad)
        return norm, finite.float()
    with cfx.Mesh({"pipe": 2, "model": 2}) as mesh:
        norm, finite = cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=(P("model"), P(), P("pipe")),
                                                    out_specs=(P(), P()))(w, b, stage))
    torch.testing.assert_close(norm, expected)
    assert float(finite) == 0.0  # an inf on pipe rank 1 is seen everywhere
    assert float(cfx.optim.global_norm({"w": w})) == pytest.approx(float(w.norm()))  # no context: local
