"""``ReadBuffers``: a buffer goes back to the pool only when no tensor can reach its memory any more,
comes out again already touched and page-aligned, and the pool keeps no more idle bytes than asked."""
import gc
import threading

import torch

from cfx._src.gemini.read_buffers import ReadBuffers


def test_a_buffer_returns_only_after_its_last_view_is_gone_and_is_then_reused():
    pool = ReadBuffers(max_idle=1 << 20)
    x = pool.empty(2048, torch.float32)
    assert x.shape == (2048,) and x.dtype == torch.float32 and x.data_ptr() % 4096 == 0
    x.fill_(7.0)
    view, ptr = x[10:20].reshape(2, 5), x.data_ptr()
    del x
    gc.collect()
    assert pool.idle_bytes == 0  # a view still reads it: not back yet
    other = pool.empty(2048, torch.float32)
    assert other.data_ptr() != ptr and torch.equal(view, torch.full((2, 5), 7.0))  # not handed out twice
    del view
    assert pool.idle_bytes == 8192
    again = pool.empty(2048, torch.float32)
    assert again.data_ptr() == ptr and pool.idle_bytes == 0 and (pool.made, pool.reused) == (2, 1)
    del other, again


def test_buffers_of_other_sizes_and_dtypes_share_by_bytes():
    pool = ReadBuffers(max_idle=1 << 20)
    a = pool.empty(1024, torch.float32)
    ptr = a.data_ptr()
    del a
    b = pool.empty(2048, torch.bfloat16)  # the same 4096 bytes
    assert b.data_ptr() == ptr and b.dtype == torch.bfloat16 and b.numel() == 2048
    c = pool.empty(1100, torch.float32)  # other bytes: a buffer of its own
    assert c.data_ptr() != ptr and pool.made == 2
    assert pool.empty(0, torch.float32).numel() == 0 and pool.made == 2


def test_idle_bytes_are_bounded_the_oldest_pushed_out_and_trim_drops_them():
    pool = ReadBuffers(max_idle=3 * 4096)
    held = [pool.empty(1024, torch.float32) for _ in range(5)]
    del held
    assert pool.idle_bytes == 3 * 4096  # two of the five were dropped
    big = pool.empty(2048, torch.float32)
    del big  # two pages: pushes out the two pages returned longest ago
    assert pool.idle_bytes == 3 * 4096
    held = pool.empty(2048, torch.float32), pool.empty(1024, torch.float32)
    assert pool.reused == 2 and pool.idle_bytes == 0
    held += (pool.empty(1024, torch.float32),)  # the other page-sized ones went to make room
    assert pool.made == 7
    del held
    assert pool.idle_bytes == 3 * 4096
    pool.trim()
    assert pool.idle_bytes == 0
    huge = pool.empty(4096, torch.float32)
    del huge  # more than max_idle: never kept
    assert pool.idle_bytes == 0 and pool.empty(3, torch.float32).numel() == 3 and pool.made == 8  # under a page: plain


def test_buffers_given_back_from_other_threads():
    pool = ReadBuffers(max_idle=64 << 20)
    bufs = [pool.empty(4096, torch.float32) for _ in range(32)]

    def drop(mine):
        for _ in range(len(mine)):
            mine.pop()
    threads = [threading.Thread(target=drop, args=(bufs[i::4],)) for i in range(4)]
    del bufs
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.idle_bytes == 32 * 4096 * 4
    got = {pool.empty(4096, torch.float32).data_ptr() for _ in range(1)}
    assert len(got) == 1 and pool.reused == 1
