"""cfx.memory: per-rank, per-tier accounting; watch() follows storage lifetime; op tracking."""
import gc
import threading

import pytest
import torch
from hypothesis import given, strategies as st

import cfx
import cfx.memory as cm

F32 = 4


def test_alloc_free_peak_per_tier_and_kind():
    with cm.track() as mem:
        a = cm.record_alloc(100, tier="device", kind="param")
        b = cm.record_alloc(50, tier="device", kind="grad")
        h = cm.record_alloc(70, tier="host", kind="optim")
        cm.record_free(b)
        c = cm.record_alloc(30, tier="device", kind="grad")
        assert mem.live("device") == 130 and mem.live("host") == 70 and mem.live("nvme") == 0
        assert mem.live("device", kind="grad") == 30
        assert mem.peak("device") == 150
        assert mem.peak_by_kind("device") == {"param": 100, "grad": 50}
        cm.record_free(a)
        cm.record_free(a)  # a second free is a no-op
        cm.record_free(h)
        assert mem.live("device") == 30 and mem.live("host") == 0 and mem.peak("host") == 70
        assert [v for _, v in mem.timeline("device")] == [100, 150, 100, 130, 30]
        mem.reset_peak()
        assert mem.peak("device") == 30 and mem.peak("host") == 0
        cm.record_free(c)
    assert mem.live("device") == 0 and "param" in mem.table()


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 1000)), max_size=30))
def test_peak_is_the_running_maximum(ops):
    with cm.track() as mem:
        tokens, live, peak = [], 0, 0
        for alloc, n in ops:
            if alloc or not tokens:
                tokens.append(cm.record_alloc(n, tier="host", kind="x"))
                live += n
            else:
                t = tokens.pop(n % len(tokens))
                cm.record_free(t)
                live -= t.nbytes
            peak = max(peak, live)
            assert mem.live("host") == live
        assert mem.peak("host") == peak


def test_no_tracker_is_a_no_op_and_bad_tier_is_rejected():
    assert cm.record_alloc(10, tier="device", kind="x") is None
    cm.record_free(None)
    cm.watch(torch.zeros(3), tier="host", kind="x")
    with pytest.raises(ValueError, match="unknown memory tier 'gpu'"):
        cm.record_alloc(1, tier="gpu", kind="x")


def test_nested_trackers_both_see_reports_made_while_active():
    with cm.track() as outer:
        a = cm.record_alloc(10, tier="device", kind="x")
        with cm.track() as inner:
            b = cm.record_alloc(5, tier="device", kind="x")
            cm.record_free(a)  # booked only in outer
        cm.record_free(b)
    assert outer.peak("device") == 15 and outer.live("device") == 0
    assert inner.peak("device") == 5 and inner.live("device") == 0


def test_watch_releases_when_storage_is_collected():
    with cm.track() as mem:
        x = torch.zeros(256)
        v = x[10:20]
        cm.watch(x, tier="host", kind="activation")
        cm.watch(v, tier="host", kind="activation")  # same storage: counted once
        cm.watch(x, tier="host", kind="activation")
        assert mem.live("host") == 256 * F32
        del x
        gc.collect()
        assert mem.live("host") == 256 * F32  # the view keeps the storage alive
        del v
        assert mem.live("host") == 0
        y = torch.ones(8)
        cm.watch(y, tier="device", kind="activation")
        assert mem.live("device") == 8 * F32
    del y
    assert mem.live("device") == 0 and mem.peak("device") == 8 * F32


def test_watch_freed_on_another_thread_is_booked_to_the_watching_rank():
    with cm.track() as mem:
        box = [torch.zeros(100)]
        cm.watch(box[0], tier="device", kind="x")
        th = threading.Thread(target=box.clear)
        th.start()
        th.join()
        assert mem.live("device", rank=0) == 0 and mem.peak("device", rank=0) == 100 * F32


def test_ranks_of_a_local_mesh_are_recorded_separately():
    with cm.track() as mem, cfx.Mesh({"data": 2}, backend="local") as mesh:
        def body(rank):
            keep = torch.zeros(100 * (rank + 1))
            cm.watch(keep, tier="device", kind="param")
            tok = cm.record_alloc(1000 * (rank + 1), tier="host", kind="optim")
            cm.record_free(tok)
            return keep
        kept = mesh.run(body)
    assert mem.ranks() == [0, 1]
    assert [mem.live("device", rank=r) for r in (0, 1)] == [400, 800]
    assert [mem.peak("host", rank=r) for r in (0, 1)] == [1000, 2000]
    assert mem.peak("host") == 2000 and mem.live("device") == 1200
    del kept
    gc.collect()
    assert mem.live("device") == 0


def test_track_ops_forward_no_grad_holds_two_activations_at_peak():
    B, D, k = 8, 32, 5
    x, ws = torch.randn(B, D), [torch.randn(D, D) for _ in range(k)]
    with cm.track() as mem, mem.track_ops():
        y = x
        for w in ws:
            y = y @ w  # the new output exists while the previous one is still bound to y
        y_t = w.t()  # a view of an untracked input: not new memory
        assert mem.live("device") == B * D * F32
    assert mem.peak("device") == 2 * B * D * F32 and y_t.shape == (D, D)


def test_track_ops_counts_activations_and_backward_outputs():
    B, D, k = 8, 32, 3
    x = torch.randn(B, D)
    ws = [torch.randn(D, D, requires_grad=True) for _ in range(k)]
    with cm.track() as mem:
        with mem.track_ops():
            y = x
            for w in ws:
                y = y @ w  # autograd saves each output for the next matmul's backward
            assert mem.live("device") == k * B * D * F32 == mem.peak("device")
            loss = y.sum()  # 4 bytes
            grads = torch.autograd.grad(loss, ws)
        # After backward: the last output, the loss and the k weight gradients.
        assert mem.live("device", kind="activation") == B * D * F32 + F32 + k * D * D * F32
        # Backward peak, while the first weight's gradient is computed: y_k, the loss, the
        # seed gradient (4 bytes, expanded), all k weight gradients, and the gradient of y_1.
        assert mem.peak("device") == 2 * B * D * F32 + 2 * F32 + k * D * D * F32
        del grads, loss, y
        gc.collect()
        assert mem.live("device") == 0


def test_track_ops_needs_its_tracker_active():
    mem = cm.track()
    with pytest.raises(ValueError, match="inside `with cfx.memory.track"):
        mem.track_ops()
