"""Asynchronous file I/O for the NVMe tier: `AioFile` reads and writes tensors at offsets.

[Note: aio engine]
- A file is opened with ``O_DIRECT`` when ``direct`` (the default): the bytes go to the device
  without a copy in the page cache. Buffered, the kernel keeps every offloaded byte in the cache
  (until memory pressure), memory the run uses without counting it, and the point of the NVMe
  tier is lost. ``O_DIRECT`` needs the buffer address, the offset and the length to be multiples
  of the logical block size: `ALIGN` (4096) covers every device; `aligned_empty` makes such
  buffers. A filesystem that refuses ``O_DIRECT`` (tmpfs before Linux 6.6, some FUSE mounts)
  gets a buffered file instead; ``AioFile.direct`` and ``AioFile.direct_reason`` say so.
- A request larger than ``chunk_bytes`` (4 MiB) is split into chunks issued in parallel, up to
  ``threads`` (4) at once: the queue depth. Set by measurement (docs/benchmarks.md, "Offload I/O
  engine"): on this machine's disk 4 MiB chunks at depth 4 moved 1.25x (write) and 1.4x (read)
  the bytes of 1 MiB chunks at depth 4; 256 KiB chunks were slower still, and depth 8 or 16 MiB
  chunks added little.
- Backends: ``native`` is `zero_kernels._C.AioEngine` (csrc/aio.cpp: io_uring through raw
  syscalls where the kernel allows it, else a pool of threads doing pread/pwrite); ``python`` is
  a ThreadPoolExecutor doing ``os.preadv``/``os.pwritev`` on the tensor's memory (both release the
  GIL). ``auto`` takes the native one when the extension has it, else the Python one with one
  logged line saying why.
- The file is removed on `AioFile.close` (by default), on garbage collection and at exit: a run
  that died must not leave files a resume could take for its own. A forked child's close (or
  exit) only closes its descriptor: the file and the engine's threads are the parent's.
"""

from __future__ import annotations

import atexit
import ctypes
import errno as _errno
import logging
import os
import secrets
import socket
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from zero_kernels import native

log = logging.getLogger("zero_kernels")

ALIGN = 4096
CHUNK_BYTES = 4 << 20  # requests above this are split (docs/benchmarks.md, "Offload I/O engine")
THREADS = 4  # queue depth per file (the same place)

_BACKENDS = ("auto", "native", "python")


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def aligned_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor whose data_ptr and storage size are multiples of `ALIGN`.

    Its storage is an anonymous mapping of ``numel * itemsize`` bytes rounded up to `ALIGN`
    (page-aligned by construction), so a caller may write or read the padded length with
    ``O_DIRECT``: ``t.untyped_storage()`` is that many bytes from ``t.data_ptr()``.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel=}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = max(round_up(numel * itemsize), ALIGN)
    import mmap

    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # keeps buf alive; unmapped with the tensor
    assert raw.data_ptr() % ALIGN == 0
    return raw.view(dtype)[:numel]


def native_engine_class():
    """`_C.AioEngine`, or None and the reason."""
    m = native.load()
    if m is None:
        return None, f"zero_kernels._C did not load ({native.error()})"
    cls = getattr(m, "AioEngine", None)
    if cls is None:
        return None, "zero_kernels._C has no AioEngine (an extension built before csrc/aio.cpp)"
    return cls, ""


_fallback_logged = False


def resolve_aio_backend(backend: str) -> str:
    global _fallback_logged
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend=}")
    if backend == "python":
        return backend
    cls, why = native_engine_class()
    if cls is not None:
        return "native"
    if backend == "native":
        raise RuntimeError(f"backend='native' requested but unavailable: {why}") from (
            native.error()
        )
    if not _fallback_logged:
        _fallback_logged = True
        log.info("zero_kernels.offload.aio: python I/O backend (%s)", why)
    return "python"


def _open(path: str, direct: bool) -> tuple[int, bool, str]:
    """(fd, whether O_DIRECT holds, why not) for a new or truncated file."""
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    if direct:
        o_direct = getattr(os, "O_DIRECT", 0)
        if not o_direct:
            reason = "this system has no O_DIRECT"
        else:
            try:
                fd = os.open(path, flags | o_direct, 0o600)
            except OSError as e:
                if e.errno != _errno.EINVAL:
                    raise
                reason = f"the filesystem refused O_DIRECT at open ({e.strerror})"
            else:
                # some filesystems accept the flag and fail the first I/O: try one block
                probe = aligned_empty(ALIGN, torch.uint8)
                try:
                    os.pwrite(fd, memory_view(probe.data_ptr(), ALIGN), 0)
                    return fd, True, ""
                except OSError as e:
                    os.close(fd)
                    if e.errno != _errno.EINVAL:
                        raise
                    reason = f"the filesystem refused an O_DIRECT write ({e.strerror})"
        log.info("zero_kernels.offload.aio: %s buffered: %s", path, reason)
        return os.open(path, flags, 0o600), False, reason
    return os.open(path, flags, 0o600), False, "direct=False"


def memory_view(ptr: int, n: int) -> memoryview:
    """A writable memoryview of ``n`` bytes at address ``ptr`` (no copy)."""
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")


class Handle:
    """One request in flight; `wait` returns once every chunk of it is done."""

    def __init__(self, file: AioFile, op: str, tensor: torch.Tensor, offset: int, nbytes: int):
        self._file_path = file.path
        self._op = op
        self._tensor = tensor  # alive until done: the engine writes into / reads from it
        self.offset = offset
        self.nbytes = nbytes
        self._futures: list[Future] = []
        self.native = None

    def done(self) -> bool:
        if self.native is not None:
            return self.native.done()
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        """Blocks until the request is done; OSError naming file, offset and nbytes if it failed."""
        if self.native is not None:
            err, got = self.native.wait()
        else:
            err, got = 0, 0
            for f in self._futures:
                e, n = f.result()
                got += n
                err = err or e
        self._tensor = None
        what = f"{self._op} of {self._file_path!r} at offset={self.offset}, nbytes={self.nbytes}"
        if err:
            raise OSError(err, f"{what} failed: {os.strerror(err)}")
        if got != self.nbytes:
            raise OSError(
                _errno.EIO,
                f"{what} was short: {got} bytes transferred (end of file?)",
            )


_open_files: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for f in list(_open_files):
        f.close()


class AioFile:
    """A file of ``nbytes`` (rounded up to `ALIGN`) that tensors are written to and read from.

    Requests are asynchronous (`write_async`, `read_async` return a `Handle`); with ``O_DIRECT``
    the tensor's data_ptr, the offset and the byte count must be multiples of `ALIGN`. The file
    is created (or truncated) here and removed by `close` (also at garbage collection and exit).
    ``threads`` is the queue depth, ``chunk_bytes`` the size requests are split at; ``engine``
    picks the native engine's backend ("auto": io_uring where it works, else "threads"), which
    ``self.engine`` and ``self.engine_reason`` report.
    """

    def __init__(
        self,
        path: str,
        nbytes: int,
        *,
        direct: bool = True,
        threads: int = THREADS,
        backend: str = "auto",
        chunk_bytes: int = CHUNK_BYTES,
        engine: str = "auto",
    ):
        self._closed = True  # until the file exists: __del__ of a failed constructor is a no-op
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes=}")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads=}")
        if chunk_bytes < ALIGN or chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}: {chunk_bytes=}")
        if engine not in ("auto", "io_uring", "threads"):
            raise ValueError(f"engine must be 'auto', 'io_uring' or 'threads', got {engine=}")
        self.backend = resolve_aio_backend(backend)
        self.path = os.fspath(path)
        self.size = round_up(nbytes)
        self.threads = threads
        self.chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._bytes = {"read": 0, "write": 0}
        self._pending: list[Handle] = []  # requests not seen done: they keep their tensors alive
        self._fd, self.direct, self.direct_reason = _open(self.path, direct)
        try:
            os.ftruncate(self._fd, self.size)
            if self.backend == "native":
                cls, _ = native_engine_class()
                self._engine = cls(self._fd, threads, chunk_bytes, self.direct, engine)
                self.engine = self._engine.backend()  # "io_uring" or "threads"
                self.engine_reason = self._engine.fallback_reason()
            else:
                self._engine = ThreadPoolExecutor(threads, thread_name_prefix="zk-aio")
                self.engine = "python-threads"
                self.engine_reason = "python backend"
        except BaseException:
            os.close(self._fd)
            os.unlink(self.path)
            raise
        self._pid = os.getpid()
        self._closed = False
        _open_files.add(self)

    @property
    def fd(self) -> int:
        """The open file's descriptor (for measurements that read it directly)."""
        return self._fd

    # -- counters ---------------------------------------------------------------------------
    @property
    def bytes_read(self) -> int:
        if self.backend == "native" and not self._closed:
            return self._engine.bytes_read()
        return self._bytes["read"]

    @property
    def bytes_written(self) -> int:
        if self.backend == "native" and not self._closed:
            return self._engine.bytes_written()
        return self._bytes["write"]

    # -- requests ---------------------------------------------------------------------------
    def _check(self, t: torch.Tensor, offset: int, op: str) -> int:
        if self._closed:
            raise ValueError(f"{op} on a closed AioFile ({self.path!r})")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"t must be a CPU tensor, got {t.device=}")
        if not t.is_contiguous():
            raise ValueError(f"t must be contiguous, got {t.stride()=}")
        nbytes = t.numel() * t.element_size()
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset=}")
        if self.direct:
            ptr = t.data_ptr()
            for name, v in (("t.data_ptr()", ptr), ("offset", offset), ("nbytes", nbytes)):
                if v % ALIGN:
                    raise ValueError(
                        f"O_DIRECT {op} of {self.path!r}: {name}={v} is not a multiple of {ALIGN}"
                        " (use aligned_empty and pad the request)"
                    )
        if offset + nbytes > self.size:
            raise ValueError(
                f"{op} of {self.path!r}: offset={offset} + nbytes={nbytes} is beyond the file's "
                f"size={self.size}"
            )
        return nbytes

    def _submit(self, t: torch.Tensor, offset: int, op: str) -> Handle:
        nbytes = self._check(t, offset, op)
        h = Handle(self, op, t, offset, nbytes)
        if self.backend == "native":
            h.native = self._engine.submit(op == "write", t.data_ptr(), nbytes, offset)
        else:
            ptr = t.data_ptr()
            step = self.chunk_bytes
            for start in range(0, nbytes, step):
                n = min(step, nbytes - start)
                fut = self._engine.submit(self._chunk, op, ptr + start, n, offset + start)
                h._futures.append(fut)
        # a caller may drop the handle (and its last reference to t) before the I/O is done
        with self._lock:
            self._pending = [p for p in self._pending if not p.done()]
            self._pending.append(h)
        return h

    def _chunk(self, op: str, ptr: int, n: int, offset: int) -> tuple[int, int]:
        """(errno or 0, bytes moved) for one chunk, retried until done, end of file or error."""
        done = 0
        fn = os.pwritev if op == "write" else os.preadv
        try:
            while done < n:
                k = fn(self._fd, [memory_view(ptr + done, n - done)], offset + done)
                if k == 0:
                    break
                done += k
        except OSError as e:
            return e.errno or _errno.EIO, done
        finally:
            with self._lock:
                self._bytes[op] += done
        return 0, done

    def write_async(self, t: torch.Tensor, offset: int) -> Handle:
        """Starts writing t's bytes at ``offset``; keep t unchanged until the handle is done."""
        return self._submit(t, offset, "write")

    def read_async(self, t: torch.Tensor, offset: int) -> Handle:
        """Starts reading ``t.nbytes`` bytes at ``offset`` into t."""
        return self._submit(t, offset, "read")

    def write(self, t: torch.Tensor, offset: int) -> None:
        self.write_async(t, offset).wait()

    def read(self, t: torch.Tensor, offset: int) -> None:
        self.read_async(t, offset).wait()

    # -- lifecycle --------------------------------------------------------------------------
    def close(self, remove: bool = True) -> None:
        """Waits for requests in flight, closes the file, and removes it when ``remove``."""
        if self._closed:
            return
        self._closed = True
        _open_files.discard(self)
        if os.getpid() != self._pid:
            # a forked child (its copy of the engine has no threads): the file is the parent's
            os.close(self._fd)
            return
        if self.backend == "native":
            self._engine.close()
            self._bytes = {"read": self._engine.bytes_read(), "write": self._engine.bytes_written()}
        else:
            self._engine.shutdown(wait=True)
        self._pending = []
        os.close(self._fd)
        if remove:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close()

    def __enter__(self) -> AioFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"AioFile({self.path!r}, size={self.size}, direct={self.direct}, "
            f"backend={self.backend!r}, engine={self.engine!r}, threads={self.threads})"
        )


class RunFile:
    """Base of the offload tiers' swappers: the one file of this rank in ``directory`` (checked
    first), named by what it holds, the host, the pid and a random token, so that no later run
    can take it for its own; removed at `close`, when the owner is collected, and at exit."""

    def _open_run_file(self, directory: str, what: str, rank: int, nbytes: int) -> None:
        if not os.path.isdir(directory):
            raise ValueError(
                f"offload_dir={directory!r} is not a directory (create it on the disk to use)"
            )
        tag = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = os.path.join(directory, f"zero_kernels-{what}-r{rank}-{tag}.bin")
        self.file = AioFile(self.path, max(nbytes, ALIGN), direct=True)
        self._finalizer = weakref.finalize(self, _close_quietly, self.file)

    @property
    def bytes_read(self) -> int:
        return self.file.bytes_read

    @property
    def bytes_written(self) -> int:
        return self.file.bytes_written

    def close(self) -> None:
        self._finalizer()


def _close_quietly(f: AioFile) -> None:
    try:
        f.close(remove=True)
    except OSError:
        pass


def probe_disk(
    directory: str,
    mb: int = 256,
    *,
    direct: bool = True,
    threads: int = THREADS,
    chunk_bytes: int = CHUNK_BYTES,
    backend: str = "auto",
) -> dict:
    """Write then read bandwidth (GB/s) of ``directory``'s filesystem with an `AioFile`.

    One request of ``mb`` MiB each way, split into ``chunk_bytes`` chunks at queue depth
    ``threads``. A buffered write is timed up to its ``fsync`` and its pages are dropped before
    the read, so both modes measure the device. The file is removed afterwards.
    """
    nbytes = mb << 20
    path = os.path.join(directory, f".zk-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    buf = aligned_empty(nbytes, torch.uint8)
    buf.fill_(0x5A)  # pages faulted in before timing
    with AioFile(
        path, nbytes, direct=direct, threads=threads, backend=backend, chunk_bytes=chunk_bytes
    ) as f:
        t0 = time.perf_counter()
        f.write(buf, 0)
        os.fsync(f._fd)
        write_s = time.perf_counter() - t0
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        f.read(buf, 0)
        read_s = time.perf_counter() - t0
        return {
            "directory": directory,
            "direct": f.direct,
            "direct_reason": f.direct_reason,
            "backend": f.backend,
            "engine": f.engine,
            "bytes": nbytes,
            "write_s": write_s,
            "read_s": read_s,
            "write_gbps": nbytes / write_s / 1e9,
            "read_gbps": nbytes / read_s / 1e9,
            "block_bytes": chunk_bytes,
            "queue_depth": threads,
        }
