"""The checkpoint format: directory names, ``meta.json``, the ``latest`` pointer, JSON values.

[Note: checkpoint format]
A checkpoint *root* (the ``path`` given to `save_checkpoint`) holds one directory per save and a
pointer to the newest complete one::

    root/
      latest                      "step-00000120 <sha256 of that name>": written last, atomically
      step-00000100/              a complete checkpoint (kept while within keep_last)
      step-00000120/
        meta.json                 everything but tensors (below); written after every rank file
        rank-00000.safetensors    rank 0's pieces: params at full precision, element-wise state
        rank-00001.safetensors    ... one file per rank of the world that saved
        model.safetensors         the model's other tensors: buffers, frozen params (rank 0)
      .tmp-step-00000140-<nonce>/ a save in progress or interrupted: never loaded, removed by the
                                  next save

Tensors are in safetensors files (a JSON header and raw little-endian bytes: loading executes no
pickled code); everything else is JSON. A rank file holds, for each *piece* of the saved layout
on that rank (see `zero_kernels.layout.Piece`: the part of one parameter inside one rank's shard),
1-D tensors keyed by the parameter's index in ``meta.json["params"]`` and the piece's first
element inside the (flattened) parameter:

    p/<index>/<offset>            the values the optimizer steps: the fp32 master for bf16/fp16
                                  params, else the param itself (its own dtype)
    s/<index>/<offset>/<key>      element-wise optimizer state (exp_avg, momentum_buffer, ...);
                                  int8 moments: their codes (int8 exp_avg, uint8 exp_avg_sq)
    k/<index>/<offset>/<key>      int8 moments: the fp32 scale of each block of the piece
                                  (exp_avg_scale, exp_avg_sq_scale; version 2)
    o/<index>/<key>               per-tensor optimizer state tensors (step, Adafactor's row_var),
                                  once per parameter, in the file of the piece at offset 0
    rng/torch, rng/cuda/<d>,      that rank's random number generator states
    rng/numpy

A plain torch optimizer (stage 0, a model replicated by DDP) is saved the same way, through a
layout built for it (flat, one piece per parameter and rank), so every rank writes 1/N of the
model and one loader serves every stage. Which pieces a rank file holds is not listed anywhere:
it is ``pieces(layout, rank)`` of the saved `Layout`, kept in ``meta.json``.

``meta.json``: ``format_version``, the versions that wrote it, ``world_size``, ``stage``,
``mode``, the saved ``layout``, ``params`` (index, name, shape, dtype, group, and per parameter
the names and dtypes of its optimizer state: element-wise, per-tensor tensors, and small
non-tensor values inline), ``param_groups`` (every hyper-parameter), ``group_params``,
``scheduler``, ``scaler`` (loss scale, growth tracker), ``steps``, ``extra`` (the user's dict),
``rng`` (each rank's Python ``random`` state) and ``files``: name, size and sha256 of every other
file. Its own sha256 is its last member and covers every byte before it (`write_meta`), so one
flipped byte anywhere in any file of a checkpoint is found at load.

Non-tensor values (hyper-parameters, scheduler state, ``extra``) go through a small tagged JSON
codec (`encode`/`decode`) that keeps tuples, non-string dict keys, non-finite floats, dtypes and
small tensors, so they come back as they were.

Low-bit moments (``state_dtype="int8"``, [Note: low-bit state]) are saved as they are kept: the
codes (2 bytes per element for both moments, not the 8 of fp32) and their blocks' scales; a
param's schema in ``meta.json`` then has ``"lowbit": {"dtype": "int8", "block": B, "origin":
O}``: blocks of B elements counted from each piece's own first element (``"piece"``: a
`ZeroOptimizer`'s, [Note: int8 shard state]) or from the param's (``"param"``: `FusedAdamW`'s),
a piece's scales covering the blocks that hold its elements. A loader on the same blocks takes
codes and scales as saved (a resume continues bit for bit); any other decodes the saved blocks it
overlaps into fp32 (and encodes them again in its own format). bf16 moments are saved as bf16
element-wise state.

Version history: 1; 2 adds the ``k/`` entries and the ``lowbit`` schema. A save writes the
oldest version that holds what it saved (1 unless it has int8 moments), so an older reader loads
every checkpoint it can. A reader of version v loads every version <= v; a file written by
version 1 is kept in ``tests/data`` and loaded by the tests.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re

import torch

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "LATEST",
    "META",
    "MODEL_FILE",
    "CheckpointError",
    "CheckpointsBelow",
    "checkpoint_name",
    "checkpoints_below",
    "decode",
    "encode",
    "rank_file",
    "read_latest",
    "tp_columns",
    "tp_dir",
    "read_meta",
    "write_latest",
    "write_meta",
]

FORMAT = "zero_kernels.checkpoint"
FORMAT_VERSION = 2  # the newest this code reads and writes
LOWBIT_VERSION = 2  # the first with int8 moments (codes and block scales)
META = "meta.json"
LATEST = "latest"
MODEL_FILE = "model.safetensors"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
_NAME_RE = re.compile(r"^step-\d{8,}(-\d+)?$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the file and the problem
    (missing, partial, checksum mismatch, incompatible model)."""

    def __init__(self, file: str | os.PathLike, problem: str):
        self.file = os.fspath(file)
        self.problem = problem
        super().__init__(f"{self.file}: {problem}")

    def __reduce__(self):  # travels between ranks as (file, problem)
        return (type(self), (self.file, self.problem))


class CheckpointsBelow(CheckpointError):
    """A directory with no checkpoint of its own but checkpoints one level down (``found``:
    their paths), e.g. ``zero-kernels demo --checkpoint-dir DIR``'s DIR (one per run, DIR/stage0
    and DIR/stage2): which one is meant is the caller's to say."""

    def __init__(self, file: str | os.PathLike, found: list[str]):
        self.found = list(found)
        super().__init__(
            file,
            f"no checkpoint of its own; {len(self.found)} checkpoint(s) one level down: "
            f"{', '.join(self.found)}: name one of them",
        )

    def __reduce__(self):
        return (type(self), (self.file, self.found))


def checkpoint_name(step: int, taken: set[str]) -> str:
    """``step-00000120``, or ``step-00000120-2``... when that name is already taken."""
    base = f"step-{int(step):08d}"
    if base not in taken:
        return base
    k = 2
    while f"{base}-{k}" in taken:
        k += 1
    return f"{base}-{k}"


def is_checkpoint_name(name: str) -> bool:
    return bool(_NAME_RE.match(name))


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------- fsync helpers
def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new file inside ``path`` durable (POSIX: fsync the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync'ed, renamed into place."""
    d, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(d, f"{TMP_PREFIX}{base}-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(d)


# ---------------------------------------------------------------------------- meta.json
_TAIL = re.compile(rb',\n "meta_sha256": "([0-9a-f]{64})"\n}\n\Z')


def dump_meta(meta: dict) -> bytes:
    """``meta`` as JSON whose last member is the sha256 of every byte before it (+ ``\\n}``)."""
    body = json.dumps(meta, indent=1, sort_keys=True, allow_nan=False).encode()
    assert body.endswith(b"\n}")
    digest = sha256_hex(body)
    return body[:-2] + f',\n "meta_sha256": "{digest}"\n}}\n'.encode()


def write_meta(directory: str, meta: dict) -> None:
    with open(os.path.join(directory, META), "wb") as f:
        f.write(dump_meta(meta))
        f.flush()
        os.fsync(f.fileno())


def read_meta(directory: str) -> dict:
    """The verified ``meta.json`` of checkpoint ``directory`` (CheckpointError if it is missing,
    truncated, altered, or of a newer format)."""
    path = os.path.join(directory, META)
    if not os.path.isdir(directory):
        raise CheckpointError(directory, "missing: no such checkpoint directory")
    if os.path.basename(os.path.normpath(directory)).startswith(TMP_PREFIX):
        raise CheckpointError(
            directory, "partial: a save that was interrupted before its commit (never loaded)"
        )
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointError(
            path, "missing: the checkpoint is partial (its save did not complete)"
        ) from None
    m = _TAIL.search(raw)
    if m is None:
        raise CheckpointError(path, "corrupt or truncated: no meta_sha256 at its end")
    body = raw[: m.start()] + b"\n}"
    if sha256_hex(body) != m.group(1).decode():
        raise CheckpointError(path, "checksum mismatch: the file was altered after it was written")
    try:
        meta = json.loads(body)
    except ValueError as e:
        raise CheckpointError(path, f"corrupt JSON ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(path, f"not a {FORMAT} file (format={meta.get('format')!r})")
    v = meta.get("format_version")
    if not isinstance(v, int) or not 1 <= v <= FORMAT_VERSION:
        raise CheckpointError(
            path,
            f"format_version={v!r}: this zero_kernels reads versions 1 to {FORMAT_VERSION} "
            "(upgrade zero_kernels to load it)",
        )
    return meta


# ---------------------------------------------------------------------------- latest pointer
def write_latest(root: str, name: str) -> None:
    write_file_atomic(os.path.join(root, LATEST), f"{name} {sha256_hex(name.encode())}\n".encode())


def read_latest(root: str) -> str:
    """The checkpoint name ``root/latest`` points to (verified)."""
    path = os.path.join(root, LATEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointError(
            path, "missing: no complete checkpoint was saved under this directory"
        ) from None
    parts = raw.decode("utf-8", "replace").split()
    if (
        len(parts) != 2
        or not raw.endswith(b"\n")
        or sha256_hex(parts[0].encode()) != parts[1]
        or not is_checkpoint_name(parts[0])
    ):
        raise CheckpointError(path, "corrupt: its checksum does not match the name it holds")
    return parts[0]


_TP_DIR = re.compile(r"^tp(\d+)-of-(\d+)$")


def tp_dir(root: str, tp: dict | None, saving: bool) -> str:
    """Where the checkpoints of this rank's tp column live under ``root`` ([Note: tensor
    parallelism] in zero_kernels/optimizer/tensor_parallel.py): ``root/tp<r>-of-<n>``, each
    column a checkpoint of its local tensors sharded over dp (loadable at another dp size and
    stage); ``root`` itself without tp. A load at another tp size or placements, or with and
    without tp, does not come here: it reads every column ([Note: redistributing across tp
    sizes] in redistribution.py); what is left raises naming both sides."""
    if tp is not None:
        mine = os.path.join(root, f"tp{tp['rank']}-of-{tp['size']}")
        if saving or os.path.isdir(mine):
            return mine
    if saving or not os.path.isdir(root):
        return root
    sizes = sorted({int(m.group(2)) for n in os.listdir(root) if (m := _TP_DIR.match(n))})
    if tp is None and sizes:
        raise CheckpointError(
            root,
            f"saved with tensor parallelism (tp size {sizes}), loaded into a model without "
            "DTensor params: read it through load_checkpoint (it redistributes the columns)",
        )
    if tp is not None and sizes:
        raise CheckpointError(
            root,
            f"saved at tp size {sizes}, loaded at tp size {tp['size']}: read it through "
            "load_checkpoint (it redistributes the columns)",
        )
    return root


def tp_columns(root: str) -> list[str]:
    """The tp columns' directories under ``root`` (``tp<r>-of-<n>``, by r), all of one size
    n; [] where ``root`` holds none."""
    if not os.path.isdir(root):
        return []
    found = {}
    for n in os.listdir(root):
        m = _TP_DIR.match(n)
        if m:
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = os.path.join(root, n)
    if not found:
        return []
    if len(found) > 1:
        raise CheckpointError(root, f"tp columns of several tp sizes: {sorted(found)}")
    ((size, cols),) = found.items()
    if sorted(cols) != list(range(size)):
        raise CheckpointError(root, f"tp columns {sorted(cols)} of {size}: some are missing")
    return [cols[r] for r in range(size)]


def resolve(path: str | os.PathLike) -> str:
    """The checkpoint directory ``path`` names: itself if it is one (has ``meta.json`` or a
    checkpoint's name), else the one ``path/latest`` points to; without a ``latest`` (a first
    save killed between its rename and the pointer), the newest complete checkpoint there.
    A directory with none of these but checkpoints one level down raises `CheckpointsBelow`
    naming them."""
    path = os.fspath(path)
    base = os.path.basename(os.path.normpath(path))
    if os.path.isfile(os.path.join(path, META)) or is_checkpoint_name(base):
        return path  # read_meta says what is wrong with it, if anything
    if base.startswith(TMP_PREFIX):
        return path
    if not os.path.isdir(path):
        raise CheckpointError(path, "missing: no such directory")
    if not os.path.exists(os.path.join(path, LATEST)):
        found = []
        for n in os.listdir(path):
            if is_checkpoint_name(n):
                try:
                    found.append((read_meta(os.path.join(path, n))["created_ns"], n))
                except CheckpointError:
                    continue
        if found:
            return os.path.join(path, max(found)[1])
        below = checkpoints_below(path)
        if below:
            raise CheckpointsBelow(path, below)
    name = read_latest(path)
    full = os.path.join(path, name)
    if not os.path.isdir(full):
        raise CheckpointError(full, f"missing: {LATEST} names it but it does not exist")
    return full


def checkpoints_below(path: str | os.PathLike) -> list[str]:
    """The sub-directories of ``path`` (one level down, sorted by name) that hold a checkpoint
    of their own: a ``latest``, a ``meta.json``, or a complete checkpoint directory. Names only
    (nothing is verified here); saves in progress and checkpoint directories of ``path``
    itself are not counted."""
    path = os.fspath(path)
    out = []
    for n in sorted(os.listdir(path)):
        full = os.path.join(path, n)
        if n.startswith(".") or is_checkpoint_name(n) or not os.path.isdir(full):
            continue
        if os.path.isfile(os.path.join(full, LATEST)) or os.path.isfile(os.path.join(full, META)):
            out.append(full)
        elif any(
            is_checkpoint_name(m) and os.path.isfile(os.path.join(full, m, META))
            for m in os.listdir(full)
        ):
            out.append(full)
    return out


# ---------------------------------------------------------------------------- JSON values
_MAX_INLINE = 1 << 16  # elements of a tensor kept inline in JSON


def encode(v, where: str = "value"):
    """``v`` as plain JSON (tuples, non-str keys, nan/inf, dtypes, small tensors tagged)."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"__float__": repr(v)}
    if isinstance(v, torch.dtype):
        return {"__dtype__": str(v).removeprefix("torch.")}
    if isinstance(v, torch.Tensor):
        if v.numel() > _MAX_INLINE or v.is_complex():
            raise TypeError(
                f"{where}: a tensor of shape {tuple(v.shape)} and dtype {v.dtype} is too large "
                f"to keep inline (at most {_MAX_INLINE} real elements)"
            )
        t = v.detach().cpu()
        data = t.reshape(-1).double().tolist() if t.is_floating_point() else t.reshape(-1).tolist()
        return {
            "__tensor__": {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "data": [encode(x, where) for x in data],
            }
        }
    if isinstance(v, tuple):
        return {"__tuple__": [encode(x, f"{where}[{i}]") for i, x in enumerate(v)]}
    if isinstance(v, list):
        return [encode(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in v):
            return {k: encode(x, f"{where}[{k!r}]") for k, x in v.items()}
        return {
            "__dict__": [
                [encode(k, f"{where} key"), encode(x, f"{where}[{k!r}]")] for k, x in v.items()
            ]
        }
    if hasattr(v, "item") and type(v).__module__ == "numpy":  # numpy scalars
        return encode(v.item(), where)
    raise TypeError(
        f"{where}: a {type(v).__name__} cannot be stored in a checkpoint (JSON values, tuples, "
        "dicts, dtypes and small tensors can)"
    )


def decode(v):
    """The inverse of `encode`."""
    if isinstance(v, list):
        return [decode(x) for x in v]
    if not isinstance(v, dict):
        return v
    if len(v) == 1:
        ((k, x),) = v.items()
        if k == "__float__":
            return float(x)
        if k == "__dtype__":
            return getattr(torch, x)
        if k == "__tuple__":
            return tuple(decode(y) for y in x)
        if k == "__dict__":
            return {_hashable(decode(a)): decode(b) for a, b in x}
        if k == "__tensor__":
            dt = getattr(torch, x["dtype"])
            data = [decode(y) for y in x["data"]]
            return (
                torch.tensor(data, dtype=torch.float64 if dt.is_floating_point else dt)
                .to(dt)
                .reshape(x["shape"])
            )
    return {k: decode(x) for k, x in v.items()}


def _hashable(k):
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k
