"""`save_checkpoint`: every rank writes its own pieces in parallel; rank 0 commits atomically.

[Note: atomic save]
A save never touches a complete checkpoint; it becomes visible only by renames, each made durable
before the next step::

    rank 0: mkdir root/.tmp-<name>-<nonce>          (stale .tmp-/.trash- dirs removed first)
    every rank: write rank-<r>.safetensors, fsync   (rank 0 also model.safetensors)
    every rank -> rank 0: size + sha256 of its files, or its error
    rank 0: write meta.json (with every checksum), fsync it and the temp dir
            rename .tmp-<name>-<nonce> -> <name>, fsync root
            write latest.tmp, fsync, rename -> latest, fsync root
            prune to keep_last (rename to .trash-, then delete; never the newest)
    rank 0 -> every rank: done, or the error (every rank raises the same CheckpointError)

Killed at any point, the root holds the previous complete checkpoints, ``latest`` names one of
them (or the new one, once its rename is durable), and whatever is half-written sits in a
``.tmp-`` directory that no load reads (loading it by name says it is partial) and the next save
deletes. Every rank must see the same ``path`` (a shared file system across machines).
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import time
import uuid

import torch

from .._version import __version__
from .adapters import Adapter, adapter_for
from .control import Control, control_for
from .format import (
    FORMAT,
    FORMAT_VERSION,
    LOWBIT_VERSION,
    META,
    MODEL_FILE,
    TMP_PREFIX,
    TRASH_PREFIX,
    CheckpointError,
    checkpoint_name,
    encode,
    fsync_dir,
    is_checkpoint_name,
    rank_file,
    tp_dir,
    write_latest,
    write_meta,
)
from .storage import Entry, write_safetensors

__all__ = ["save_checkpoint"]


def save_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler=None,
    extra: dict | None = None,
    keep_last: int | None = None,
) -> str:
    """Save the full training state under directory ``path`` as a new checkpoint; returns its
    directory. Collective: every rank of the optimizer's group (a plain optimizer: of the DDP
    model's group, else the world) calls it with the same arguments.

    Saved: the params at full precision (fp32 masters where they exist), the optimizer state
    (with ``step``), every param group's hyper-parameters, ``scheduler``'s state, the loss
    scaler, each rank's RNG states, the model's buffers and frozen params, and ``extra`` (JSON
    values, tuples, small tensors). The checkpoint is named ``step-<extra["step"]>`` (else the
    optimizer's step count); ``path/latest`` names the newest; ``keep_last=k`` keeps the k
    newest. See [Note: checkpoint format] and [Note: atomic save].
    """
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(f"keep_last must be None or an int >= 1, got keep_last={keep_last!r}")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
    root = os.path.abspath(os.fspath(path))
    ad = adapter_for(model, optimizer)
    root = tp_dir(root, ad.tp, saving=True)  # tensor parallelism: this tp column's
    # what every rank can check alone comes first, so a bad value fails before any collective
    extra_json = encode(extra or {}, "extra")
    sched_json = encode(scheduler.state_dict(), "scheduler state") if scheduler else None
    groups_json = encode(ad.param_groups(), "param_groups")
    step = extra.get("step") if extra else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        step = ad.steps()
    ctl = control_for(ad, root, "save")  # see [Note: checkpoint timeouts]
    ctl.step = step
    ctl.arrive(f"save_checkpoint (step {step})")
    name, tmp = _on_rank0(ctl, lambda: _prepare(root, step), "the temp directory from rank 0")
    # hierarchical sharding: the first shard group writes, the others hold copies of its state
    info = ("ok", {"files": {}, "schema": {}})
    if ad.writer:
        with ad.frozen_whole():  # shard_frozen: rank 0 writes them whole (collective)
            info = _try(lambda: _write_rank(ad, tmp))
    infos = ctl.gather(info, "every rank's files, on rank 0")
    meta = _meta(ad, name, groups_json, sched_json, extra_json) if ctl.rank == 0 else None
    return _on_rank0(
        ctl, lambda: _commit(root, name, tmp, meta, infos, keep_last), "the commit on rank 0"
    )


def _meta(ad: Adapter, name: str, groups_json, sched_json, extra_json) -> dict:
    """meta.json's fields that rank 0 knows alone (the rest comes from every rank's files)."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,  # lowered in _commit to what the files need
        "name": name,
        "created_ns": time.time_ns(),
        "zero_kernels_version": __version__,
        "torch_version": torch.__version__,
        "world_size": ad.world_size,
        "stage": ad.stage,
        "mode": ad.mode,
        "optimizer_class": _qualname(ad.optimizer_class()),
        "layout": ad.layout.to_dict(),
        "param_groups": groups_json,
        "group_params": ad.group_params(),
        "scheduler": sched_json,
        "scaler": ad.scaler(),
        "steps": ad.steps(),
        "extra": extra_json,
        # tensor parallelism: this column's tp rank and size, each DTensor param's placements
        "tensor_parallel": None
        if ad.tp is None
        else {
            "size": ad.tp["size"],
            "rank": ad.tp["rank"],
            "placements": {ad.name_of(i): p for i, p in sorted(ad.tp["placements"].items())},
        },
    }


# ---------------------------------------------------------------------------- collective frame
def _try(fn):
    """``("ok", fn())`` or ``("err", message)``: errors travel to the other ranks as values."""
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        return ("err", e if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}")


def _on_rank0(ctl: Control, fn, what: str):
    """Run ``fn`` on rank 0 and give its result to every rank, or raise its error everywhere."""
    res = _try(fn) if ctl.rank == 0 else None
    res = ctl.broadcast(res, what)
    if res[0] == "err":
        e = res[1]
        raise e if isinstance(e, CheckpointError) else CheckpointError("(rank 0)", str(e))
    return res[1]


# ---------------------------------------------------------------------------- rank 0: prepare
def _prepare(root: str, step: int) -> tuple[str, str]:
    os.makedirs(root, exist_ok=True)
    taken = set()
    for n in os.listdir(root):
        full = os.path.join(root, n)
        if n.startswith((TMP_PREFIX, TRASH_PREFIX)):  # a save or prune that was interrupted
            if os.path.isdir(full):
                shutil.rmtree(full, ignore_errors=True)
            else:
                os.unlink(full)
        elif is_checkpoint_name(n):
            taken.add(n)
    name = checkpoint_name(step, taken)
    tmp = os.path.join(root, f"{TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    return name, tmp


# ---------------------------------------------------------------------------- every rank: write
def _write_rank(ad: Adapter, tmp: str) -> dict:
    """This rank's file (and rank 0's model file); their sizes, checksums and the state schema
    of the params whose first element this rank holds. The pieces stream window by window
    (see [Note: streamed checkpoints])."""
    stream = _Streamed(ad)
    try:
        return _write_files(ad, tmp, stream)
    finally:
        stream.close()


def _piece_tensors(pd) -> list[tuple[str, torch.Tensor]]:
    """The rank file's tensors of one piece: its values, element-wise state, low-bit scales
    and (at the param's first element) its other state tensors."""
    out = [(f"p/{pd.index}/{pd.offset}", pd.values)]
    out += [(f"s/{pd.index}/{pd.offset}/{k}", v) for k, v in pd.elem.items()]
    out += [(f"k/{pd.index}/{pd.offset}/{k}", v) for k, v in pd.scales.items()]
    if pd.offset == 0:
        out += [(f"o/{pd.index}/{k}", v) for k, v in pd.other.items() if torch.is_tensor(v)]
    return out


class _Streamed:
    """[Note: streamed checkpoints]
    Offloaded state (``offload_optimizer`` / ``offload_params``) is on disk because it does not
    fit in RAM, so a save must not read all of it in. The adapter's `windows` split this rank's
    pieces by bucket; the rank file is written in two passes over them:

    1. the header: each window entered with nothing read (its moments zeros; only the names,
       dtypes and shapes of its pieces' tensors, and their non-tensor state, are taken);
    2. the data: `write_safetensors` asks each entry for its elements in the header's order,
       and the first entry of a window enters it (the bucket's shards, masters and moments read
       in, nothing written back: a save changes nothing) and leaves the one before.

    So RAM holds one bucket's offloaded state at a time (`ShardRunner.window_peak_bytes` counts
    it), read once; int8 moments as their codes and scales, never decoded (what the file
    holds; [Note: int8 shard state]). Without offload there is one window of every piece,
    entered once for both passes."""

    def __init__(self, ad: Adapter):
        self.ad = ad
        self.windows = ad.windows(read=True, write=False)
        self.blank = ad.windows(read=False, write=False) if len(self.windows) > 1 else None
        self.open_at: int | None = None
        self._ctx = None
        self.tensors: dict[str, torch.Tensor] = {}

    def describe(self):
        """Pass 1: ``(window, PieceData)`` of every piece, in windows' order."""
        for w, (which, _) in enumerate(self.windows):
            if self.blank is None:  # one window: entered once, for both passes
                self._enter(w)
                for pd in self.ad.my_pieces(which):
                    yield w, pd
                continue
            with self.blank[w][1]():
                for pd in self.ad.my_pieces(which):
                    yield w, pd

    def tensor(self, w: int, name: str) -> torch.Tensor:
        """Pass 2: tensor ``name`` of window ``w`` (entering it, leaving the one before)."""
        if self.open_at != w:
            self._enter(w)
        return self.tensors[name]

    def _enter(self, w: int) -> None:
        self.close()
        which, ctx = self.windows[w]
        self._ctx = ctx()
        self._ctx.__enter__()
        self.open_at = w
        self.tensors = {
            n: t.detach() for pd in self.ad.my_pieces(which) for n, t in _piece_tensors(pd)
        }

    def close(self) -> None:
        ctx, self._ctx, self.open_at, self.tensors = self._ctx, None, None, {}
        if ctx is not None:
            ctx.__exit__(None, None, None)


def _write_files(ad: Adapter, tmp: str, stream: _Streamed) -> dict:
    entries: list[Entry] = []
    schema: dict[int, dict] = {}
    version = 1  # the oldest format that holds what this rank saves
    for w, pd in stream.describe():
        for n, t in _piece_tensors(pd):
            entries.append(
                Entry(n, t.dtype, tuple(t.shape), lambda w=w, n=n: (stream.tensor(w, n),))
            )
        if pd.scales:  # low-bit moments: the piece's block scales
            version = max(version, LOWBIT_VERSION)
        if pd.offset != 0 or not (pd.elem or pd.other):
            continue
        sc = {
            "elem": {k: _dt(v.dtype) for k, v in pd.elem.items()},
            "tensor": {},
            "value": {},
        }
        if pd.lowbit is not None:
            sc["lowbit"] = dict(pd.lowbit)
        for k, v in pd.other.items():
            if isinstance(v, torch.Tensor):
                sc["tensor"][k] = {"dtype": _dt(v.dtype), "shape": list(v.shape)}
            else:
                sc["value"][k] = encode(
                    v, f"optimizer state of param {ad.name_of(pd.index)}[{k!r}]"
                )
        schema[pd.index] = sc
    rng_entries, rng_meta = _rng_state()
    entries += rng_entries
    files = {}
    name = rank_file(ad.rank)
    files[name] = {
        "rank": ad.rank,
        **write_safetensors(
            os.path.join(tmp, name),
            entries,
            {
                "format": FORMAT,
                "format_version": str(version),
                "rank": str(ad.rank),
                "world_size": str(ad.world_size),
                "rng": rng_meta,
            },
        ),
    }
    out = {"files": files, "schema": schema, "version": version}
    if ad.rank == 0:
        tensors, values = _model_state(ad)
        files[MODEL_FILE] = {
            "rank": 0,
            **write_safetensors(
                os.path.join(tmp, MODEL_FILE),
                [Entry.of(n, t) for n, t in tensors.items()],
                {"format": FORMAT, "format_version": "1"},
            ),
        }
        out["model"] = {
            "tensors": {
                n: {"dtype": _dt(t.dtype), "shape": list(t.shape)} for n, t in tensors.items()
            },
            "values": values,
        }
        out["params"] = ad.table
    return out


def _model_state(ad: Adapter) -> tuple[dict[str, torch.Tensor], dict]:
    """The model's state that is not in the rank files: buffers, frozen params (tensors) and
    modules' extra state (JSON-encoded)."""
    tensors = {n: t.detach() for n, t in ad.model_entries().items()}
    values = {
        n: encode(m.get_extra_state(), f"model state {n!r}") for n, m in ad.model_values().items()
    }
    return tensors, values


def _rng_state() -> tuple[list[Entry], str]:
    import json

    entries = [Entry.of("rng/torch", torch.get_rng_state())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for d, s in enumerate(torch.cuda.get_rng_state_all()):
            entries.append(Entry.of(f"rng/cuda/{d}", s))
    meta = {"python": encode(random.getstate())}
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        entries.append(Entry.of("rng/numpy", torch.from_numpy(keys.astype("int64"))))
        meta["numpy"] = [kind, int(pos), int(has_gauss), float(cached)]
    return entries, json.dumps(meta)


# ---------------------------------------------------------------------------- rank 0: commit
def _commit(root, name, tmp, meta, infos, keep_last) -> str:
    errors = [f"rank {r}: {x[1]}" for r, x in enumerate(infos) if x[0] == "err"]
    if errors:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(tmp, "save failed; " + "; ".join(errors[:4]))
    files, schema = {}, {}
    for _, x in infos:
        files.update(x["files"])
        schema.update(x["schema"])
    # a checkpoint says the oldest format version that reads it (older readers load it then)
    meta["format_version"] = max(x.get("version", 1) for _, x in infos)
    rank0 = infos[0][1]
    meta["params"] = [{**p, "state": schema.get(p["index"])} for p in rank0["params"]]
    meta["model"] = rank0["model"]
    meta["files"] = dict(sorted(files.items()))
    write_meta(tmp, meta)
    fsync_dir(tmp)
    final = os.path.join(root, name)
    os.replace(tmp, final)
    fsync_dir(root)
    write_latest(root, name)
    if keep_last is not None:
        _prune(root, name, keep_last)
    return final


def _prune(root: str, newest: str, keep_last: int) -> None:
    import json

    found = []
    for n in os.listdir(root):
        if not is_checkpoint_name(n) or n == newest:
            continue
        full = os.path.join(root, n)
        try:
            with open(os.path.join(full, META), "rb") as f:
                created = int(
                    json.loads(f.read().split(b',\n "meta_sha256"')[0] + b"\n}")["created_ns"]
                )
        except (OSError, ValueError, KeyError):
            created = int(os.path.getmtime(full) * 1e9)
        found.append((created, n))
    found.sort()
    for _, n in found[: max(0, len(found) - (keep_last - 1))]:
        trash = os.path.join(root, f"{TRASH_PREFIX}{n}-{uuid.uuid4().hex[:8]}")
        os.replace(os.path.join(root, n), trash)
        shutil.rmtree(trash, ignore_errors=True)
    fsync_dir(root)


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
