"""ZeRO-3 prefetch (cfx/_src/zero/prefetch.py): every block's forward gather and every re-gather
but the first in backward is started ahead, and the numbers are bit for bit those of the same
step without prefetch (and of one device)."""
import pytest
import torch

import cfx
from cfx import P
from cfx._src.zero import gathered as gathered_lib
from cfx import zero
from cfx_tests.test_zero import T, V, data

N_LAYER = 3


def zero3_step(model, *, prefetch_on: bool, remat: bool):
    """Loss and grads (gathered) of one ZeRO-3 step on {"data": 2}."""
    def block(b):
        g = zero.gathered(b, axis="data", prefetch=prefetch_on)
        return cfx.remat(g) if remat else g
    net = zero.gathered(model.map_blocks(block), axis="data", prefetch=prefetch_on)
    ztx = zero(cfx.optim.adamw(1e-3), stage=3, axis="data")
    t = data(1)[0]

    def body(params, t):
        p = zero.shard_params(params, axis="data")
        loss, grads = ztx.value_and_grad(lambda p: net.loss(p, t[:, :-1], t[:, 1:]))(p)
        return cfx.lax.pmean(loss, "data"), zero.gather_params(grads, axis="data")

    with cfx.Mesh({"data": 2}) as mesh:
        return cfx.device_get(cfx.shard_map(body, mesh=mesh, in_specs=(P(), P("data")),
                                            out_specs=P())(model.init(cfx.random.key(0)), t))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("remat", [False, True])
def test_prefetched_gathers_start_ahead_and_change_no_number(monkeypatch, remat):
    seen = []
    gather = gathered_lib.ShardSource.gather

    def spy(self, *, backward):
        seen.append((backward, self._started is not None))
        return gather(self, backward=backward)

    monkeypatch.setattr(gathered_lib.ShardSource, "gather", spy)
    model = cfx.models.gpt2("tiny", n_layer=N_LAYER, vocab_size=V, n_embd=32, n_head=2, n_positions=T)
    off = zero3_step(model, prefetch_on=False, remat=remat)
    assert not any(ahead for _, ahead in seen)
    seen.clear()
    on = zero3_step(model, prefetch_on=True, remat=remat)
    torch.testing.assert_close(on, off, rtol=0, atol=0)
    ref_loss, ref_grads = cfx.value_and_grad(model.loss)(model.init(cfx.random.key(0)),
                                                          data(1)[0][:, :-1], data(1)[0][:, 1:])
    torch.testing.assert_close(on[0], ref_loss)
    cfx.tree.assert_tree_close(on[1], ref_grads)  # averaged over the 2 ranks: the single-device gradient
    forward = [ahead for bw, ahead in seen if not bw]
    backward = [ahead for bw, ahead in seen if bw]
    # forward, per rank: the root gathers first on its own, then every block's gather was started
    # ahead (remat's recompute in backward gathers again, on its own)
    assert forward.count(True) == 2 * N_LAYER, seen
    # backward, per rank: the root is re-gathered first (the head), then the last block on its
    # own, then every block before it ahead
    assert backward.count(True) == 2 * (N_LAYER - 1), seen
