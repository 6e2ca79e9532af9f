"""The NVMe tier's I/O engine (zero_kernels.offload.aio): both backends, O_DIRECT and buffered.

O_DIRECT needs a real filesystem (tmp_path may be tmpfs): the `disk_dir` fixture makes a
directory under the repository's build/ (or /var/tmp) and checks that it takes an O_DIRECT write.
"""

import ctypes
import errno
import gc
import mmap
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from zero_kernels.offload import aio
from zero_kernels.offload.aio import ALIGN, AioFile, aligned_empty, probe_disk

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20

native_cls, native_why = aio.native_engine_class()
uring_ok, uring_why = (False, "no native engine")
if native_cls is not None:
    uring_ok, uring_why = aio.native.load().aio_uring_supported()
no_native = pytest.mark.skipif(native_cls is None, reason=f"no native engine: {native_why}")
BACKENDS = [
    "python",
    pytest.param("native-threads", marks=no_native),
    pytest.param(
        "native-io_uring",
        marks=[no_native, pytest.mark.skipif(not uring_ok, reason=f"no io_uring: {uring_why}")],
    ),
]


def kw(backend: str) -> dict:
    """AioFile's keywords for a backend of BACKENDS."""
    if backend == "python":
        return {"backend": "python"}
    return {"backend": "native", "engine": backend.split("-")[1]}


def _takes_o_direct(directory: str) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(directory, ".o_direct_check")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        buf = aligned_empty(ALIGN, torch.uint8)
        os.pwrite(fd, aio.memory_view(buf.data_ptr(), ALIGN), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.fixture(scope="module")
def disk_root():
    for base in (os.path.join(REPO, "build"), "/var/tmp"):
        try:
            os.makedirs(base, exist_ok=True)
            d = tempfile.mkdtemp(prefix="zk-aio-test-", dir=base)
        except OSError:
            continue
        if _takes_o_direct(d):
            yield d
            os.rmdir(d)
            return
        os.rmdir(d)
    pytest.skip("no directory here takes O_DIRECT (build/, /var/tmp)")


@pytest.fixture
def disk_dir(disk_root, request):
    d = os.path.join(disk_root, request.node.name.replace("/", "_"))
    os.makedirs(d)
    yield d
    left = os.listdir(d)
    for name in left:
        os.unlink(os.path.join(d, name))
    os.rmdir(d)
    assert not left, f"files left behind: {left}"


def _rand_bytes(n: int, seed: int) -> torch.Tensor:
    t = aligned_empty(n, torch.uint8)
    g = torch.Generator().manual_seed(seed)
    t.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
    return t


def test_aligned_empty():
    for dtype, numel in ((torch.float32, 1), (torch.bfloat16, 3000), (torch.uint8, 5 * MiB + 7)):
        t = aligned_empty(numel, dtype)
        assert t.dtype == dtype and t.numel() == numel and t.is_contiguous()
        assert t.data_ptr() % ALIGN == 0
        s = t.untyped_storage()
        assert s.data_ptr() == t.data_ptr() and s.nbytes() % ALIGN == 0
        assert s.nbytes() >= numel * t.element_size()
    assert aligned_empty(0).numel() == 0
    with pytest.raises(ValueError, match="numel=-1"):
        aligned_empty(-1)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip_parallel(disk_dir, backend, direct):
    # requests of many sizes (one page to 3.5 MiB: split into 1 MiB chunks) at disjoint offsets,
    # all in flight at once, from two submitting threads; then read back the same way
    sizes = [ALIGN, 3 * ALIGN, MiB, MiB + ALIGN, 3 * MiB + 8 * ALIGN, 17 * ALIGN, 2 * MiB] * 3
    offsets, off = [], 0
    for i, n in enumerate(sizes):
        off += (i % 3) * ALIGN  # gaps between regions
        offsets.append(off)
        off += n
    path = os.path.join(disk_dir, "rt.bin")
    f = AioFile(path, off + 123, direct=direct, threads=3, chunk_bytes=MiB, **kw(backend))
    assert f.size == aio.round_up(off + 123) and os.path.getsize(path) == f.size
    assert f.direct == direct and f.backend == kw(backend)["backend"]
    if backend != "python":
        assert f.engine == kw(backend)["engine"]
    src = [_rand_bytes(n, i) for i, n in enumerate(sizes)]
    with ThreadPoolExecutor(2) as ex:
        handles = list(ex.map(lambda i: f.write_async(src[i], offsets[i]), range(len(sizes))))
    for h in handles:
        h.wait()
        assert h.done()
    dst = [aligned_empty(n, torch.uint8).zero_() for n in sizes]
    with ThreadPoolExecutor(2) as ex:
        handles = list(ex.map(lambda i: f.read_async(dst[i], offsets[i]), range(len(sizes))))
    for h in handles:
        h.wait()
    for i in range(len(sizes)):
        assert torch.equal(src[i], dst[i]), f"region {i}: {sizes[i]=} at {offsets[i]=}"
    assert f.bytes_written == sum(sizes) and f.bytes_read == sum(sizes)
    # a float tensor read into a bfloat16 one of the same bytes, at the same offset
    x = aligned_empty(MiB // 4).uniform_()
    f.write(x, 0)
    y = aligned_empty(MiB // 2, torch.bfloat16)
    f.read(y, 0)
    assert torch.equal(y.view(torch.float32), x)
    f.close()
    assert not os.path.exists(path)
    assert f.bytes_written == sum(sizes) + MiB  # counters survive close


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropped_handle_keeps_its_tensor_alive(disk_dir, backend):
    path = os.path.join(disk_dir, "d.bin")
    f = AioFile(path, 16 * MiB, chunk_bytes=MiB, **kw(backend))
    for i in range(4):  # neither the handle nor the tensor is kept by the caller
        f.write_async(aligned_empty(4 * MiB, torch.uint8).fill_(i + 1), i * 4 * MiB)
    gc.collect()
    f.close(remove=False)  # waits for them
    with open(path, "rb") as g:
        out = torch.frombuffer(bytearray(g.read()), dtype=torch.uint8)
    os.unlink(path)
    assert all(torch.all(out.view(4, -1)[i] == i + 1) for i in range(4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_o_direct_alignment_errors(disk_dir, backend):
    f = AioFile(os.path.join(disk_dir, "e.bin"), 4 * MiB, **kw(backend))
    assert f.direct
    buf = aligned_empty(2 * MiB, torch.uint8)
    bad = buf[1 : 1 + MiB]
    with pytest.raises(ValueError, match=f"t.data_ptr\\(\\)={bad.data_ptr()} is not a multiple"):
        f.write_async(bad, 0)
    with pytest.raises(ValueError, match="offset=512 is not a multiple of 4096"):
        f.read_async(buf[:MiB], 512)
    with pytest.raises(ValueError, match="nbytes=1000 is not a multiple of 4096"):
        f.write(buf[:1000], 0)
    with pytest.raises(ValueError, match="beyond the file's size=4194304"):
        f.write(buf, 3 * MiB)
    with pytest.raises(ValueError, match="offset=-4096"):
        f.read(buf, -4096)
    with pytest.raises(ValueError, match="contiguous"):
        f.write(buf.view(2, MiB).t(), 0)
    assert f.bytes_written == 0 and f.bytes_read == 0
    f.close()
    with pytest.raises(ValueError, match="closed"):
        f.write(buf, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_short_read_raises_oserror(disk_dir, backend):
    path = os.path.join(disk_dir, "s.bin")
    f = AioFile(path, 4 * MiB, **kw(backend))
    buf = _rand_bytes(4 * MiB, 0)
    f.write(buf, 0)
    os.truncate(path, MiB + ALIGN)  # another process cut the file: the read must not pass
    h = f.read_async(aligned_empty(2 * MiB, torch.uint8), MiB)
    what = re.escape(f"read of '{path}' at offset=1048576, nbytes=2097152")
    with pytest.raises(OSError, match=what) as e:
        h.wait()
    assert e.value.errno == errno.EIO and "short" in str(e.value)
    f.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_buffered_io_has_no_alignment_rule(disk_dir, backend):
    f = AioFile(os.path.join(disk_dir, "b.bin"), 10_000, direct=False, **kw(backend))
    x = torch.arange(1000, dtype=torch.float64)
    f.write(x[1:], 8)
    y = torch.zeros(999, dtype=torch.float64)
    f.read(y, 8)
    assert torch.equal(x[1:], y)
    f.close()


def test_o_direct_refused_falls_back_to_buffered(disk_dir, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(aio.os, "open", no_direct)
    f = AioFile(os.path.join(disk_dir, "fb.bin"), MiB, backend="python")
    assert not f.direct and "refused O_DIRECT" in f.direct_reason
    x = torch.ones(5)
    f.write(x, 4)  # no alignment rule once buffered
    f.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_removes_and_is_idempotent(disk_dir, backend):
    p = os.path.join(disk_dir, "c.bin")
    f = AioFile(p, MiB, **kw(backend))
    h = f.write_async(_rand_bytes(MiB, 1), 0)
    f.close()  # waits for the request in flight
    assert h.done() and not os.path.exists(p)
    h.wait()
    f.close()
    keep = os.path.join(disk_dir, "k.bin")
    g = AioFile(keep, MiB, **kw(backend))
    g.close(remove=False)
    assert os.path.getsize(keep) == MiB
    os.unlink(keep)
    gc_path = os.path.join(disk_dir, "gc.bin")
    AioFile(gc_path, MiB, **kw(backend))  # dropped at once: __del__ removes it
    assert not os.path.exists(gc_path)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forked_child_leaves_the_parents_file(disk_dir, backend):
    p = os.path.join(disk_dir, "fork.bin")
    f = AioFile(p, MiB, **kw(backend))
    f.write(aligned_empty(MiB, torch.uint8).fill_(9), 0)
    pid = os.fork()
    if pid == 0:  # the child: close (and exit) must neither remove the file nor hang
        try:
            f.close()
            f._engine = None  # the native engine's destructor runs here, in the child
            gc.collect()
            os._exit(0 if os.path.exists(p) else 3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and os.path.exists(p)
    out = aligned_empty(MiB, torch.uint8)
    f.read(out, 0)  # the parent's engine still works
    assert torch.all(out == 9)
    f.close()
    assert not os.path.exists(p)


def test_exit_removes_open_files(disk_dir):
    p = os.path.join(disk_dir, "exit.bin")
    code = (
        "from zero_kernels.offload.aio import AioFile, aligned_empty\n"
        f"f = AioFile({p!r}, 1 << 20)\n"
        "h = f.write_async(aligned_empty(1 << 18).zero_(), 0)\n"  # in flight at exit
    )
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
    assert not os.path.exists(p)


def test_failed_io_raises_oserror_with_errno(disk_dir, monkeypatch):
    def full(fd, bufs, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    path = os.path.join(disk_dir, "full.bin")
    f = AioFile(path, 8 * MiB, backend="python", chunk_bytes=MiB)
    monkeypatch.setattr(aio.os, "pwritev", full)
    h = f.write_async(aligned_empty(3 * MiB, torch.uint8), 4 * MiB)
    what = re.escape(f"write of '{path}' at offset=4194304, nbytes=3145728 failed: No space")
    with pytest.raises(OSError, match=what) as e:
        h.wait()
    assert e.value.errno == errno.ENOSPC and f.bytes_written == 0
    f.close()


@no_native
def test_native_auto_falls_back_to_threads(disk_dir, monkeypatch):
    monkeypatch.setenv("ZERO_KERNELS_IO_URING", "0")
    f = AioFile(os.path.join(disk_dir, "t.bin"), MiB, backend="native")
    assert f.engine == "threads" and f.engine_reason == "ZERO_KERNELS_IO_URING=0"
    x = aligned_empty(MiB, torch.uint8).fill_(3)
    f.write(x, 0)
    f.close()
    with pytest.raises(ValueError, match="engine='aio'"):
        AioFile(os.path.join(disk_dir, "t.bin"), MiB, engine="aio")


def test_backend_choice():
    with pytest.raises(ValueError, match="backend='fast'"):
        AioFile("/nonexistent/x", 1, backend="fast")
    if native_cls is None:
        with pytest.raises(RuntimeError, match="native"):
            AioFile("/nonexistent/x", 1, backend="native")
    assert aio.resolve_aio_backend("auto") == ("native" if native_cls is not None else "python")


def _resident_pages(path: str) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = ctypes.create_string_buffer(pages)
        assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
        libc.munmap(addr, size)
        return sum(b & 1 for b in vec.raw)
    finally:
        os.close(fd)


@pytest.mark.parametrize("backend", BACKENDS)
def test_o_direct_bytes_skip_the_page_cache(disk_dir, backend):
    n = 32 * MiB
    pages = n // mmap.PAGESIZE
    buf = _rand_bytes(n, 2)
    resident = {}
    for direct in (True, False):
        p = os.path.join(disk_dir, f"pc-{direct}.bin")
        f = AioFile(p, n, direct=direct, **kw(backend))
        f.write(buf, 0)
        f.read(buf, 0)
        resident[direct] = _resident_pages(p)
        f.close()
    assert resident[True] < pages // 100, resident  # O_DIRECT: nothing kept
    assert resident[False] > pages // 2, resident  # buffered: the cache holds the file


def test_probe_disk(disk_dir):
    r = probe_disk(disk_dir, mb=8)
    assert r["direct"] and r["bytes"] == 8 * MiB
    assert r["write_gbps"] > 0 and r["read_gbps"] > 0
    assert r["block_bytes"] == aio.CHUNK_BYTES and r["queue_depth"] == aio.THREADS
    assert os.listdir(disk_dir) == []
