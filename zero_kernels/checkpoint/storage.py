"""Tensor files: a streaming safetensors writer that hashes as it writes, and range readers.

[Note: streaming safetensors]
``safetensors.torch.save_file`` copies every tensor into one bytes object before writing (twice
the memory of what is saved). The format is simple enough to write directly: 8 bytes of header
length (little-endian u64), a JSON header ``{name: {dtype, shape, data_offsets}, "__metadata__":
{str: str}}`` padded with spaces to a multiple of 8, then each tensor's raw bytes back to back in
the order of their offsets. `write_safetensors` writes the header from the entries' dtypes and
shapes, then each tensor from its own memory (zero-copy for contiguous tensors) or from chunks a
callable yields (`zero_kernels.checkpoint.export` streams a consolidated model that way), and
computes the file's sha256 in the same pass (in a thread, overlapping the write of the same
chunk). Extra memory: one chunk. Files are read back with
the ``safetensors`` package (`Reader`: ``safe_open`` and ``get_slice``, which reads only the
requested range of a tensor), so what this writer produces is checked by the reference reader.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .format import CheckpointError

__all__ = ["Entry", "Reader", "file_sha256", "write_safetensors"]

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_CHUNK_BYTES = 16 << 20


@dataclass
class Entry:
    """One tensor of a file: a tensor, or its dtype and shape and a callable yielding its
    elements in order as tensors of that dtype (any shapes, flattened)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[torch.Tensor]]

    @staticmethod
    def of(name: str, t: torch.Tensor) -> Entry:
        t = t.detach()
        return Entry(name, t.dtype, tuple(t.shape), lambda: (t,))

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def _raw(t: torch.Tensor):
    """The bytes of ``t`` (CPU, flattened, contiguous) as a buffer, without a copy when it can."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return b""
    return t.view(torch.uint8).numpy()


def write_safetensors(path: str, entries: list[Entry], metadata: dict[str, str]) -> dict:
    """Write ``entries`` to ``path`` (fsync'ed); returns ``{"bytes", "sha256"}`` of the file."""
    header: dict = {"__metadata__": dict(metadata)}
    pos = 0
    for e in entries:
        if e.dtype not in _DTYPES:
            raise TypeError(f"{path}: tensor {e.name!r} has dtype {e.dtype}, not storable")
        if e.name in header:
            raise ValueError(f"{path}: tensor name {e.name!r} appears twice")
        header[e.name] = {
            "dtype": _DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [pos, pos + e.nbytes],
        }
        pos += e.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    h = hashlib.sha256()
    total = 0
    # sha256 of one chunk runs in a thread while the chunk is written (both release the GIL)
    pool = ThreadPoolExecutor(1)
    pending = None
    with open(path, "wb", buffering=0) as f:

        def put(buf) -> None:
            nonlocal total, pending
            mv = memoryview(buf).cast("B")
            if pending is not None:
                pending.result()
            pending = pool.submit(h.update, mv)
            n = 0
            while n < len(mv):
                n += f.write(mv[n:])
            total += len(mv)

        try:
            put(struct.pack("<Q", len(head)) + head)
            for e in entries:
                start = total
                for c in e.chunks():
                    if c.dtype != e.dtype:
                        raise AssertionError(f"{e.name}: chunk dtype {c.dtype} != {e.dtype}")
                    flat = c.reshape(-1)
                    step = max(1, _CHUNK_BYTES // max(1, c.element_size()))
                    for lo in range(0, flat.numel(), step):
                        put(_raw(flat[lo : lo + step]))
                if total - start != e.nbytes:
                    raise AssertionError(
                        f"{e.name}: wrote {total - start} bytes, expected {e.nbytes}"
                    )
            if pending is not None:
                pending.result()
        finally:
            pool.shutdown(wait=True)
        os.fsync(f.fileno())
    return {"bytes": total, "sha256": h.hexdigest()}


def file_sha256(path: str, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        mv = memoryview(buf)
        while True:
            n = f.readinto(mv)
            if not n:
                break
            h.update(mv[:n])
    return h.hexdigest()


def verify_file(path: str, want: dict) -> str | None:
    """None if ``path`` has the size and sha256 of ``want``, else what is wrong."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return "missing"
    if size != want["bytes"]:
        return f"partial or altered: {size} bytes, {want['bytes']} expected"
    if file_sha256(path) != want["sha256"]:
        return "checksum mismatch (sha256): the file was altered after it was written"
    return None


class Reader:
    """Open safetensors files of one checkpoint directory, read by name and element range."""

    def __init__(self, directory: str):
        self.directory = directory
        self._open: dict[str, object] = {}
        self._keys: dict[str, set[str]] = {}

    def _file(self, name: str):
        if name not in self._open:
            from safetensors import safe_open

            path = os.path.join(self.directory, name)
            if not os.path.exists(path):
                raise CheckpointError(path, "missing")
            try:
                f = safe_open(path, framework="pt", device="cpu")
            except Exception as e:  # SafetensorError: a header the reader refuses
                raise CheckpointError(path, f"not a readable safetensors file ({e})") from None
            self._open[name] = f
            self._keys[name] = set(f.keys())
        return self._open[name]

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def has(self, file: str, key: str) -> bool:
        self._file(file)
        return key in self._keys[file]

    def _need(self, file: str, key: str):
        f = self._file(file)
        if key not in self._keys[file]:
            raise CheckpointError(self.path(file), f"missing tensor {key!r}")
        return f

    def tensor(self, file: str, key: str) -> torch.Tensor:
        return self._need(file, key).get_tensor(key)

    def range(self, file: str, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the 1-D tensor ``key`` (only those bytes are read)."""
        sl = self._need(file, key).get_slice(key)
        n = sl.get_shape()
        if len(n) != 1 or not 0 <= lo <= hi <= n[0]:
            raise CheckpointError(
                self.path(file), f"tensor {key!r} has shape {n}, elements [{lo}, {hi}) requested"
            )
        return sl[lo:hi]

    def rows(self, file: str, key: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` (first dimension) of tensor ``key``."""
        return self._need(file, key).get_slice(key)[lo:hi]

    def shape(self, file: str, key: str) -> list[int]:
        return list(self._need(file, key).get_slice(key).get_shape())

    def metadata(self, file: str) -> dict[str, str]:
        return self._file(file).metadata() or {}

    def close(self) -> None:
        self._open.clear()
        self._keys.clear()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
