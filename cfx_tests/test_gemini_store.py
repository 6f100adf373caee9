"""Gemini tier stores: bit-exact round trips, NVMe integrity checks, memory accounting."""
import errno
import gc
import os

import pytest
import torch
from hypothesis import given, strategies as st

import cfx.memory as cm
from cfx.gemini import ChecksumMismatch, Chunk, DeviceStore, HostStore, NvmeStore, make_stores

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_bits(n, dtype, seed):
    """Arbitrary bit patterns (NaNs, infs, subnormals, -0.0 included) as ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    width = dtype.itemsize * 8
    raw = torch.randint(-(2 ** (width - 1)), 2 ** (width - 1), (n,), generator=g,
                        dtype=torch.int32 if width == 32 else torch.int16)
    return raw.view(dtype)


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    ints = torch.int32 if a.dtype.itemsize == 4 else torch.int16
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


@given(st.sampled_from(DTYPES), st.integers(0, 200), st.integers(0, 2 ** 16))
def test_chunk_round_trips_device_host_nvme_device_bit_exact(tmp_path_factory, dtype, n, seed):
    stores = make_stores(nvme_dir=tmp_path_factory.mktemp("nvme"))
    shard = random_bits(2 * n + 2, dtype, seed)
    chunk = Chunk([], size=shard.numel() * 2, dtype=dtype, stores=stores, key="blocks/0",
                  n_shards=2, shard_index=1, shard=shard)
    for tier in ["host", "nvme", "device", "nvme", "host", "device"]:
        chunk.move_to(tier)
        assert chunk.tier == tier and [len(s) for s in stores.values()] == [t == tier for t in stores]
        if tier != "nvme":
            assert same_bits(chunk.shard, shard)
    assert same_bits(chunk.shard, shard)


@pytest.mark.parametrize("dtype", DTYPES + [torch.int64, torch.bool])
def test_every_store_keeps_shapes_and_bits(tmp_path, dtype):
    x = random_bits(24, torch.float16, 3).view(torch.int16).reshape(2, 3, 4)
    x = (x > 0) if dtype == torch.bool else x.to(dtype)
    for store in [DeviceStore("cpu"), HostStore(), NvmeStore(tmp_path)]:
        store.put("k", x[:, 1])  # a non-contiguous view
        got = store.get("k")
        assert got.shape == (2, 4) and got.dtype == dtype
        assert torch.equal(got.view(torch.uint8), x[:, 1].contiguous().view(torch.uint8))
        assert store.nbytes == 8 * dtype.itemsize and "k" in store
        store.delete("k")
        assert store.nbytes == 0 and len(store) == 0
        with pytest.raises(KeyError, match="holds no entry 'k'"):
            store.get("k")


def test_memory_stores_copy_on_put_and_share_on_get():
    store, x = HostStore(), torch.zeros(3)
    kept = store.put("a", x)
    x.fill_(1.0)
    assert torch.equal(store.get("a"), torch.zeros(3))
    store.get("a").add_(2.0)
    assert torch.equal(kept, torch.full((3,), 2.0))


def test_nvme_detects_corruption_and_truncation(tmp_path):
    store = NvmeStore(tmp_path / "chunks")
    store.put("c/1", torch.arange(64, dtype=torch.float32))
    (path,) = [p for p in (tmp_path / "chunks").iterdir()]
    data = bytearray(path.read_bytes())
    data[17] ^= 0x04
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match="'c/1' is corrupted"):
        store.get("c/1")
    path.write_bytes(bytes(data[:-4]))
    with pytest.raises(ChecksumMismatch, match="wrong size"):
        store.get("c/1")
    store.put("c/1", torch.ones(2))  # a rewrite heals it
    assert torch.equal(store.get("c/1"), torch.ones(2))
    assert [p.name for p in (tmp_path / "chunks").iterdir()] == [path.name]  # no temp files left


def test_unwritable_nvme_directory_is_rejected_up_front(tmp_path):
    if os.geteuid() == 0:  # root ignores permission bits: use a path that nobody can create
        (tmp_path / "file").write_text("")
        bad = tmp_path / "file" / "sub"
    else:
        bad = tmp_path / "ro"
        bad.mkdir()
        bad.chmod(0o500)
    try:
        with pytest.raises(ValueError, match=f"{bad}.*not writable.*fix its permissions"):
            NvmeStore(bad)
    finally:
        if bad.exists():
            bad.chmod(0o700)
    assert not bad.exists() or list(bad.iterdir()) == []


def test_pinned_host_store_without_an_accelerator_says_so():
    if torch.cuda.is_available():
        assert HostStore(pin_memory=True).put("a", torch.ones(2)).is_pinned()
    else:
        with pytest.raises(ValueError, match="use pin_memory=False"):
            HostStore(pin_memory=True)


def test_stores_report_bytes_per_tier(tmp_path):
    with cm.track() as mem:
        stores = make_stores(nvme_dir=tmp_path)
        a = Chunk([], size=100, dtype=torch.float32, stores=stores, key="a")
        b = Chunk([], size=50, dtype=torch.float16, stores=stores, key="b")
        assert mem.live("device", kind="chunk") == 400 + 100
        a.move_to("nvme")
        b.move_to("host")
        assert (mem.live("device"), mem.live("host"), mem.live("nvme")) == (0, 100, 400)
        a.move_to("device")
        stores["host"].put("opt", torch.zeros(10), kind="optim")
        assert mem.live("host", kind="optim") == 40 and mem.peak("device") == 500
        assert mem.peak("nvme") == 400 and mem.live("nvme") == 0
        assert [stores[t].nbytes for t in ("device", "host", "nvme")] == [400, 140, 0]


def test_nvme_store_removes_its_files_on_close_and_when_collected(tmp_path):
    store = NvmeStore(tmp_path / "a")
    for k in range(3):
        store.put(("param", k), torch.ones(8))
    assert len(os.listdir(tmp_path / "a")) == 3
    store.close()
    assert not (tmp_path / "a").exists() and len(store) == 0  # the directory it made, too
    dropped = NvmeStore(tmp_path / "b")
    dropped.put("x", torch.ones(8))
    del dropped
    gc.collect()
    assert not (tmp_path / "b").exists()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "mine").write_text("")  # a directory the store did not make is left in place
    shared = NvmeStore(tmp_path / "c")
    shared.put("x", torch.ones(8))
    shared.close()
    assert os.listdir(tmp_path / "c") == ["mine"]


def test_nvme_store_keep_leaves_the_files(tmp_path):
    store = NvmeStore(tmp_path / "kept", keep=True)
    store.put("x", torch.arange(4.0))
    store.close()
    del store
    gc.collect()
    assert len(os.listdir(tmp_path / "kept")) == 1


def test_nvme_write_that_fails_leaves_no_temporary_file(tmp_path, monkeypatch):
    store = NvmeStore(tmp_path)
    store.put("x", torch.zeros(4))

    def full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        store.put("x", torch.ones(4))
    monkeypatch.undo()
    assert len(os.listdir(tmp_path)) == 1 and torch.equal(store.get("x"), torch.zeros(4))  # the old bytes


def test_nvme_overwrite_in_place_rewrites_the_same_file_and_detects_a_torn_write(tmp_path, monkeypatch):
    store = NvmeStore(tmp_path, overwrite=True)
    store.put("x", torch.zeros(4))
    inode = os.stat(store._path("x")).st_ino
    store.put("x", torch.ones(4))  # same size: in place
    assert os.stat(store._path("x")).st_ino == inode and torch.equal(store.get("x"), torch.ones(4))
    store.put("x", torch.ones(8))  # another size: a new file
    assert torch.equal(store.get("x"), torch.ones(8))

    def full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        store.put("x", torch.full((8,), 2.0))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == [os.path.basename(store._path("x"))]
    with pytest.raises(ChecksumMismatch, match="corrupted"):
        store.get("x")


def test_memory_stores_adopt_without_a_copy_where_they_can():
    for store in [DeviceStore("cpu"), HostStore()]:
        x = torch.arange(6.0)
        assert store.adopt("a", x) is x and store.nbytes == 24  # its own now: no second buffer
        strided = torch.arange(12.0)[::2]
        kept = store.adopt("b", strided)
        assert kept is not strided and torch.equal(kept, strided) and kept.is_contiguous()  # a copy
        store.adopt("a", torch.zeros(2))
        assert store.nbytes == 8 + 24


@given(st.integers(1, 5000), st.integers(0, 3), st.booleans(), st.integers(0, 2 ** 16))
def test_nvme_direct_io_round_trips_any_size_alignment_and_staging(tmp_path_factory, n, skew, out_aligned, seed):
    """``O_DIRECT`` writes and reads: from and into memory that starts on a page or not, lengths with a
    partial last block, payloads larger than the staging buffer (shrunk here to two pages)."""
    from cfx._src.gemini.payload_io import PayloadIo
    from cfx._src.gemini.read_buffers import ReadBuffers
    directory = tmp_path_factory.mktemp("direct")
    store = NvmeStore(directory, overwrite=True)
    store.payload_io = PayloadIo(staging_bytes=8192)  # a staging buffer of two pages
    pool = ReadBuffers(max_idle=0)
    x = random_bits(n + skew, torch.float32, seed)[skew:]  # skew * 4 bytes past an allocation's start
    for _ in range(2):  # a new file, then in place
        store.put("k", x)
        assert os.path.getsize(store._path("k")) == 4 * n
    out = pool.empty(n, torch.float32) if out_aligned else torch.empty(n + 1)[1:]
    assert same_bits(store.get("k", out=out), x) and same_bits(store.get("k"), x)
    assert store.payload_io.direct == takes_o_direct(directory)  # the direct paths ran wherever they can
    store.close()


def takes_o_direct(directory) -> bool:
    probe = os.path.join(directory, "probe")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except (OSError, AttributeError):
        return False
    finally:
        if os.path.exists(probe):
            os.remove(probe)
    return True


def test_nvme_store_falls_back_to_buffered_io_where_o_direct_is_refused(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)
    monkeypatch.setattr(os, "open", no_direct)
    store = NvmeStore(tmp_path)
    x = torch.arange(1001, dtype=torch.float32)
    store.put("k", x)
    assert not store.payload_io.direct and torch.equal(store.get("k"), x)
    store.close()
