"""Offline tools over a saved checkpoint (one process, no process group): inspect, verify, export.

[Note: streaming export]
`export_model` writes one safetensors file with the model's own names and shapes (what
``safetensors.torch.load_file`` and ``transformers`` read): the params at full precision (or cast
to ``dtype``) followed by the buffers and frozen params. The header is known from ``meta.json``
before any tensor is read, so the file is written front to back: each parameter is copied from
the saved pieces that hold it, in element order, ``_CHUNK`` elements at a time (read a range,
cast, write, hash). Peak memory is one chunk, whatever the model size.
"""

from __future__ import annotations

import os

import torch

from ..layout import Layout, pieces
from .format import (
    MODEL_FILE,
    CheckpointError,
    decode,
    rank_file,
    read_meta,
    resolve,
    tp_columns,
)
from .redistribution import param_map, read_piece, saved_split
from .storage import Entry, Reader, verify_file, write_safetensors

__all__ = ["export_model", "inspect_checkpoint", "verify_checkpoint"]

_CHUNK = 1 << 22  # elements per read while exporting (16 MiB of fp32)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sources(meta: dict) -> dict[int, list[tuple[int, int, int]]]:
    layout = Layout.from_dict(meta["layout"])
    out: dict[int, list[tuple[int, int, int]]] = {}
    for r in range(layout.world_size):
        for buf in pieces(layout, r):
            for pc in buf:
                out.setdefault(pc.index, []).append((r, pc.offset, pc.numel))
    for v in out.values():
        v.sort(key=lambda x: x[1])
    return out


def inspect_checkpoint(path: str | os.PathLike) -> dict:
    """What a checkpoint holds: world size, stage, step, params, state, files and sizes."""
    d = resolve(path)
    meta = read_meta(d)
    params = meta["params"]
    numel = {p["name"]: _numel(p["shape"]) for p in params}
    state_keys = sorted(
        {
            k
            for p in params
            if p.get("state")
            for part in ("elem", "tensor", "value")
            for k in p["state"][part]
        }
    )
    files = meta["files"]
    per_rank = [0] * meta["world_size"]
    for r in range(meta["world_size"]):
        for buf in pieces(Layout.from_dict(meta["layout"]), r):
            per_rank[r] += sum(pc.numel for pc in buf)
    return {
        "path": d,
        "name": meta["name"],
        "format_version": meta["format_version"],
        "zero_kernels_version": meta["zero_kernels_version"],
        "torch_version": meta["torch_version"],
        "world_size": meta["world_size"],
        "stage": meta["stage"],
        "mode": meta["mode"],
        "optimizer_class": meta["optimizer_class"],
        "steps": meta["steps"],
        "extra": decode(meta["extra"]),
        "params": len(params),
        "param_numel": sum(numel.values()),
        "param_dtypes": sorted({p["dtype"] for p in params}),
        "params_with_state": sum(1 for p in params if p.get("state")),
        "state_keys": state_keys,
        "param_groups": len(meta["param_groups"]),
        "scheduler": meta["scheduler"] is not None,
        "scaler": meta["scaler"],
        "model_tensors": len(meta["model"]["tensors"]),
        "numel_per_rank": per_rank,
        "files": {n: f["bytes"] for n, f in files.items()},
        "bytes": sum(f["bytes"] for f in files.values()),
        "largest_params": sorted(numel.items(), key=lambda kv: -kv[1])[:5],
    }


def verify_checkpoint(path: str | os.PathLike) -> list[str]:
    """Every problem found (empty: the checkpoint is complete and unaltered): meta.json's own
    checksum, every file's size and sha256, every tensor the layout says a file holds."""
    try:
        d = resolve(path)
        meta = read_meta(d)
    except CheckpointError as e:
        return [str(e)]
    problems = []
    for n, want in sorted(meta["files"].items()):
        p = verify_file(os.path.join(d, n), want)
        if p is not None:
            problems.append(f"{os.path.join(d, n)}: {p}")
    if problems:
        return problems
    src = _sources(meta)
    with Reader(d) as rd:
        try:
            for p in meta["params"]:
                s = p["index"]
                st = p.get("state") or {"elem": {}, "tensor": {}}
                for r, so, _ in src.get(s, ()):
                    keys = [f"p/{s}/{so}"] + [f"s/{s}/{so}/{k}" for k in st["elem"]]
                    if st.get("lowbit"):  # int8 moments: their block scales too
                        keys += [f"k/{s}/{so}/{k}_scale" for k in ("exp_avg", "exp_avg_sq")]
                    for key in keys:
                        if not rd.has(rank_file(r), key):
                            problems.append(f"{rd.path(rank_file(r))}: missing tensor {key!r}")
                    if so == 0:
                        for k in st["tensor"]:
                            if not rd.has(rank_file(r), f"o/{s}/{k}"):
                                problems.append(
                                    f"{rd.path(rank_file(r))}: missing tensor o/{s}/{k}"
                                )
            for n in meta["model"]["tensors"]:
                if not rd.has(MODEL_FILE, n):
                    problems.append(f"{rd.path(MODEL_FILE)}: missing tensor {n!r}")
        except CheckpointError as e:
            problems.append(str(e))
    return problems


def export_model(
    path: str | os.PathLike, to: str | os.PathLike, *, dtype: str | None = None, verify=True
) -> dict:
    """Write the model of checkpoint ``path`` as one safetensors file ``to`` with the model's
    own names (params at full precision, or cast to ``dtype`` "fp32"/"bf16"/"fp16"; buffers and
    frozen params too), streaming; see [Note: streaming export]. Returns name, bytes, sha256."""
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or None, got dtype={dtype!r}")
    columns = tp_columns(os.fspath(path))
    if columns:
        return _export_tp(columns, to, dtype, verify)
    d = resolve(path)
    meta = read_meta(d)
    if verify:
        bad = verify_checkpoint(d)
        if bad:
            raise CheckpointError(bad[0].split(": ")[0], "; ".join(bad))
    src = _sources(meta)
    out_dt = _DTYPES.get(dtype) if dtype else None
    rd = Reader(d)
    entries: list[Entry] = []

    for p in meta["params"]:
        s, shape = p["index"], tuple(p["shape"])
        dt = out_dt or getattr(torch, p["dtype"])  # default: the model's own dtype

        def chunks(s=s, dt=dt):
            for r, so, sn in src.get(s, ()):
                for a in range(0, sn, _CHUNK):
                    yield rd.range(rank_file(r), f"p/{s}/{so}", a, min(sn, a + _CHUNK)).to(dt)

        entries.append(Entry(p["name"], dt, shape, chunks))
    for n, info in meta["model"]["tensors"].items():
        own = getattr(torch, info["dtype"])
        dt = (out_dt or own) if own.is_floating_point else own
        shape = tuple(info["shape"])

        def rows(n=n, dt=dt, shape=shape):
            if not shape:
                yield rd.tensor(MODEL_FILE, n).to(dt)
                return
            per_row = max(1, _numel(shape[1:]))
            step = max(1, _CHUNK // per_row)
            for a in range(0, shape[0], step):
                yield rd.rows(MODEL_FILE, n, a, min(shape[0], a + step)).to(dt)

        entries.append(Entry(n, dt, shape, rows))
    to = os.fspath(to)
    tmp = f"{to}.tmp-{os.getpid()}"
    try:
        info = write_safetensors(tmp, entries, {"format": "pt", "source": d})
        os.replace(tmp, to)
    finally:
        rd.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {"path": to, "tensors": len(entries), **info}


def _export_tp(columns: list[str], to, dtype: str | None, verify: bool) -> dict:
    """`export_model` of a tensor-parallel save ([Note: tensor parallelism] in
    zero_kernels/optimizer/tensor_parallel.py): each tp column's checkpoint holds its local
    tensors; a ``Shard(dim=k)`` param is their concatenation along k in tp-rank order (the
    slices ``torch.chunk`` cut), a ``Replicate()`` one (and every buffer or plain param) column
    0's. Streamed like the rest: each `_CHUNK` elements of the whole tensor are cut from the
    rows of the columns that hold them ([Note: redistributing across tp sizes])."""
    dirs = [resolve(c) for c in columns]
    metas = [read_meta(d) for d in dirs]
    steps = {m.get("steps") for m in metas}
    if len(steps) != 1:
        raise CheckpointError(
            os.path.dirname(columns[0]), f"the tp columns' latest checkpoints differ: steps {steps}"
        )
    if verify:
        for d in dirs:
            bad = verify_checkpoint(d)
            if bad:
                raise CheckpointError(bad[0].split(": ")[0], "; ".join(bad))
    out_dt = _DTYPES.get(dtype) if dtype else None
    readers = [Reader(d) for d in dirs]
    srcs = [_sources(m) for m in metas]
    placements = (metas[0].get("tensor_parallel") or {}).get("placements", {})
    entries: list[Entry] = []
    for p in metas[0]["params"]:
        dt = out_dt or getattr(torch, p["dtype"])
        cols = [{q["name"]: q for q in m["params"]}.get(p["name"]) for m in metas]
        if any(q is None for q in cols):
            raise CheckpointError(dirs[0], f"param {p['name']} is not in every tp column")
        shapes, index = [q["shape"] for q in cols], [q["index"] for q in cols]
        saved = saved_split(placements.get(p["name"]), shapes, f"param {p['name']}", dirs[0])
        pm = param_map(
            p["name"], placements.get(p["name"]), shapes, index, None, 1, 0, saved.shape,
            saved.shape, dirs[0],
        )  # fmt: skip
        # the stepped values: fp32 (masters of bf16/fp16 params), float64 as they are
        wide = torch.float64 if p["dtype"] == "float64" else torch.float32

        def read_flat(c: int, lo: int, n: int, pm=pm, wide=wide) -> torch.Tensor:
            s, parts = pm.index[c], []
            for r, so, sn in srcs[c].get(s, ()):
                a, b = max(lo, so), min(lo + n, so + sn)
                if b > a:
                    parts.append(readers[c].range(rank_file(r), f"p/{s}/{so}", a - so, b - so))
            return torch.cat(parts).to(wide) if parts else torch.zeros(0, dtype=wide)

        def chunks(pm=pm, dt=dt, wide=wide, read_flat=read_flat):
            total = _numel(pm.target.shape)
            for a in range(0, total, _CHUNK):
                out = torch.empty(min(_CHUNK, total - a), dtype=wide)
                read_piece(pm, read_flat, a, out.numel(), out)
                yield out.to(dt)

        entries.append(Entry(p["name"], dt, saved.shape, chunks))
    for n, info in metas[0]["model"]["tensors"].items():
        own = getattr(torch, info["dtype"])
        dt = (out_dt or own) if own.is_floating_point else own

        def whole(n=n, dt=dt):
            yield readers[0].tensor(MODEL_FILE, n).to(dt)

        entries.append(Entry(n, dt, tuple(info["shape"]), whole))
    to = os.fspath(to)
    tmp = f"{to}.tmp-{os.getpid()}"
    try:
        info = write_safetensors(tmp, entries, {"format": "pt", "source": dirs[0]})
        os.replace(tmp, to)
    finally:
        for rd in readers:
            rd.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {"path": to, "tensors": len(entries), **info}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
