"""`load_checkpoint`: any saved world size, stage, bucket size and mode into any other.

[Note: resharding at load]
The saved `Layout` says which elements of which parameter each saved rank file holds
(``pieces(saved_layout, r)``); the loading optimizer says which elements this rank needs (its own
pieces; a plain optimizer: every parameter whole). For each needed piece the loader intersects its
element range with the saved pieces of the same parameter (matched by name) and reads just those
ranges (``safe_open(...).get_slice(key)[lo:hi]``) straight into the optimizer's own tensors: the
fp32 master (or the param shard) for values, a new tensor per element-wise state entry. No rank
builds the whole model; the extra memory is the state of one piece. Per-tensor state (``step``)
is read from the file of the parameter's first element. Then the inner optimizer takes the
state, the hyper-parameters are restored and the params are all-gathered from the masters.

Steps, each agreed by every rank (an all-gather of errors) before the next, so a bad checkpoint
raises the same `CheckpointError` on every rank and never leaves ranks in different collectives:

1. resolve ``latest``, read and check ``meta.json``, match the model (names, shapes, groups);
2. verify size and sha256 of every file, file j on rank j mod N (each file read once in all);
3. read this rank's pieces;
4. install: optimizer state, hyper-parameters, loss scale, params (collective for ZeRO), the
   model's buffers and frozen params, the scheduler, the RNG states (rank r gets saved rank r's,
   where the saved world had a rank r).

With tensor parallelism each tp column is such a checkpoint of its local tensors, loaded by the
ranks of the same tp rank; at another tp size or placements (5.) every step reads every column:
file j is verified on rank j mod (dp x tp) of the grid, a piece is cut from the columns that hold
its rows, the ranks agree over dp and then over tp, and the RNG states are those of the column
of the same tp rank (mod the saved tp size).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import sys
from dataclasses import dataclass

import torch

from ..layout import Layout, pieces
from .adapters import Adapter, adapter_for
from .control import Control, control_for, tp_control_for
from .format import (
    META,
    MODEL_FILE,
    CheckpointError,
    decode,
    rank_file,
    read_meta,
    resolve,
    tp_dir,
)
from .redistribution import ParamMap, columns_to_redistribute, param_map, read_piece
from .storage import Reader, verify_file

__all__ = ["load_checkpoint", "Plan", "plan_load", "read_decoded", "read_range"]

log = logging.getLogger("zero_kernels")


@dataclass
class Plan:
    directory: str
    meta: dict
    saved: dict[str, dict]  # name -> meta["params"] entry
    sources: dict[int, list[tuple[int, int, int]]]  # saved index -> (rank, offset, numel)
    model_tensors: dict[str, dict]  # name -> {dtype, shape} in model.safetensors

    def where(self) -> str:
        return f"{self.directory}/{META}"


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler=None,
) -> dict:
    """Load the latest complete checkpoint under ``path`` (or the checkpoint ``path`` names)
    into ``model``, ``optimizer`` (a `ZeroOptimizer` of any stage, world size, bucket size and
    mode, or a plain torch optimizer) and ``scheduler``; returns the ``extra`` dict it was
    saved with. Collective. Raises `CheckpointError` (on every rank) naming the file and the
    problem. See [Note: resharding at load]. A tensor-parallel model loads a save of another
    tp size or placements, or one without tp (and a plain model a tp one): each rank cuts its
    pieces from the saved tp columns ([Note: redistributing across tp sizes] in
    redistribution.py); every rank of the dp x tp grid calls it then."""
    ad = adapter_for(model, optimizer)
    ctl = control_for(ad, os.fspath(path), "load")  # see [Note: checkpoint timeouts]
    ctl.arrive("load_checkpoint")
    tctl = tp_control_for(ad, os.fspath(path), "load")
    if tctl is not None:  # tensor parallelism: a load may read every tp column's files
        tctl.arrive("load_checkpoint")
    ctls = (ctl,) if tctl is None else (ctl, tctl)
    columns = _agree_all(
        ctls,
        lambda: _columns(os.fspath(path), ad),
        "reading meta.json",
        same=lambda cols: cols is None,
    )
    if columns is not None:  # another tp size or placements: [Note: redistributing ...]
        return _load_redistributed(columns, ad, ctls, scheduler)
    plan = _agree(ctl, lambda: _plan(os.fspath(path), ad), "reading meta.json")
    ctl.step = plan.meta.get("steps")
    names = sorted(plan.meta["files"])
    mine = [n for j, n in enumerate(names) if j % ad.world_size == ad.rank]
    _agree(ctl, lambda: _verify(plan, mine), "verifying the files")
    with Reader(plan.directory) as rd:
        # offloaded state streams in bucket by bucket ([Note: streamed checkpoints] in save.py)
        _agree(ctl, lambda: _read_windows(plan, ad, rd), "reading the pieces")
        ad.finish_install(decode(plan.meta["param_groups"]), plan.meta)
        with ad.frozen_whole(write=True):  # shard_frozen: written whole, then re-sharded
            _load_model_state(plan, ad, rd)
        if scheduler is not None and plan.meta.get("scheduler") is not None:
            scheduler.load_state_dict(decode(plan.meta["scheduler"]))
        if ad.rank < plan.meta["world_size"]:
            _set_rng(rd, ad.rank)
    return decode(plan.meta["extra"])


def _plan(path: str, ad: Adapter):
    """`plan_load` of the checkpoint under ``path`` that this rank loads: with tensor
    parallelism its tp column's (`tp_dir`; the saved tp size and placements are this model's,
    else `_columns` redistributes)."""
    return plan_load(tp_dir(path, ad.tp, saving=False), ad)


def _agree(ctl: Control, fn, what: str):
    """``fn()`` on every rank; if it failed anywhere, every rank raises the first failure."""
    return _agree_all((ctl,), fn, what)


def _agree_all(ctls, fn, what: str, same=None):
    """`_agree` over each control group in turn (dp, then tp: each rank of a tp group carries
    its dp group's verdict, so every rank of the dp x tp grid raises the same failure).
    ``same``: a function of the result whose value must be the same on every rank (the ranks
    take the same path after)."""
    try:
        out, err = fn(), None
    except CheckpointError as e:
        out, err = None, e
    except Exception as e:  # noqa: BLE001 - an I/O error, a bug: still raised on every rank
        out, err = None, CheckpointError("(load)", f"{type(e).__name__}: {e}")
    key = same(out) if same is not None and err is None else None
    for ctl in ctls:
        got = ctl.all_gather((err, key), what)
        for r, (e, _) in enumerate(got):
            if e is not None:
                if ctl.world > 1 and e is not err:
                    err = CheckpointError(e.file, f"{e.problem} (found by rank {r})")
                else:
                    err = e
                break
        keys = {k for e, k in got if e is None}
        if err is None and len(keys) > 1:
            err = CheckpointError(ctl.where, f"{what}: the ranks found different checkpoints")
    if err is not None:
        raise err
    return out


# ---------------------------------------------------------------------------- 1. plan
def plan_load(path, ad: Adapter) -> Plan:
    d = resolve(path)
    meta = read_meta(d)
    where = f"{d}/{META}"
    saved = {p["name"]: p for p in meta["params"]}
    model_tensors = meta["model"]["tensors"]
    groups = meta["param_groups"]
    if len(groups) != len(ad.optimizer.param_groups):
        raise CheckpointError(
            where,
            f"incompatible optimizer: {len(groups)} param groups saved, "
            f"{len(ad.optimizer.param_groups)} here",
        )
    cls = ad.optimizer_class()
    if meta["optimizer_class"] != f"{cls.__module__}.{cls.__qualname__}":
        log.warning(
            "load_checkpoint: the state was saved by %s, it is loaded into %s",
            meta["optimizer_class"],
            cls.__qualname__,
        )
    mine = {p["name"]: p for p in ad.table}
    for name, p in mine.items():
        s = saved.get(name)
        if s is None:
            if name not in model_tensors:
                raise CheckpointError(where, f"incompatible model: param {name} is not in it")
            if model_tensors[name]["shape"] != p["shape"]:
                raise CheckpointError(
                    where,
                    f"incompatible model: param {name} has shape {tuple(p['shape'])} here, "
                    f"{tuple(model_tensors[name]['shape'])} in the checkpoint",
                )
            continue
        if s["shape"] != p["shape"]:
            raise CheckpointError(
                where,
                f"incompatible model: param {name} has shape {tuple(p['shape'])} here, "
                f"{tuple(s['shape'])} in the checkpoint",
            )
        if s["group"] != p["group"]:
            raise CheckpointError(
                where,
                f"incompatible optimizer: param {name} is in param group {p['group']} here, "
                f"{s['group']} in the checkpoint",
            )
    here = set(mine) | set(ad.model_entries())
    for name in saved:
        if name not in here:
            raise CheckpointError(where, f"incompatible model: it has no param {name}")
    for name, t in ad.model_entries().items():
        if name in saved:
            shape = saved[name]["shape"]
        elif name in model_tensors:
            shape = model_tensors[name]["shape"]
        else:
            raise CheckpointError(where, f"incompatible model: {name} is not in the checkpoint")
        if list(t.shape) != list(shape):
            raise CheckpointError(
                where,
                f"incompatible model: {name} has shape {tuple(t.shape)} here, "
                f"{tuple(shape)} in the checkpoint",
            )
    return saved_plan(d, meta)


def saved_plan(d: str, meta: dict) -> Plan:
    """The `Plan` of checkpoint directory ``d`` (its verified ``meta``): which saved rank file
    holds which elements of each param, from the saved layout."""
    layout = Layout.from_dict(meta["layout"])
    if layout.world_size != meta["world_size"]:
        raise CheckpointError(f"{d}/{META}", "corrupt: layout world size differs from world_size")
    sources: dict[int, list[tuple[int, int, int]]] = {}
    for r in range(layout.world_size):
        for buf in pieces(layout, r):
            for pc in buf:
                sources.setdefault(pc.index, []).append((r, pc.offset, pc.numel))
    for v in sources.values():
        v.sort(key=lambda x: x[1])
    saved = {p["name"]: p for p in meta["params"]}
    return Plan(d, meta, saved, sources, meta["model"]["tensors"])


# ---------------------------------------------------------------------------- 2. verify
def _verify(plan: Plan, names: list[str]) -> None:
    for n in names:
        problem = verify_file(os.path.join(plan.directory, n), plan.meta["files"][n])
        if problem is not None:
            raise CheckpointError(os.path.join(plan.directory, n), problem)


# ---------------------------------------------------------------------------- 3. read
def read_range(
    rd: Reader, plan: Plan, s: int, key: str, lo: int, n: int, out: torch.Tensor
) -> None:
    """Elements ``[lo, lo + n)`` of saved param ``s``'s tensor ``key`` ("p" for values, "s/<k>"
    for state entry k) into 1-D ``out``, from every saved piece that overlaps them."""
    covered = 0
    for r, so, sn in plan.sources.get(s, ()):
        a, b = max(lo, so), min(lo + n, so + sn)
        if b <= a:
            continue
        kind, _, sub = key.partition("/")
        name = f"{kind}/{s}/{so}" + (f"/{sub}" if sub else "")
        x = rd.range(rank_file(r), name, a - so, b - so)
        out[a - lo : b - lo].copy_(x)
        covered += b - a
    if covered != n:
        raise CheckpointError(
            plan.where(), f"corrupt: saved pieces of param #{s} cover {covered} of {n} elements"
        )


def _first_file(plan: Plan, s: int) -> str:
    for r, so, _ in plan.sources.get(s, ()):
        if so == 0:
            return rank_file(r)
    raise CheckpointError(plan.where(), f"corrupt: no saved piece holds param #{s}'s start")


def _read_windows(plan: Plan, ad: Adapter, rd: Reader) -> None:
    """Every target read and installed, window by window of the adapter (each holds its part
    of the offloaded state in RAM, written back after). The number of windows differs between
    ranks: nothing collective happens in here."""
    targets, others = ad.targets(), {}
    for which, ctx in ad.windows(read=True, write=True):
        js = range(len(targets)) if which is None else which
        with ctx():
            ad.install_pieces(which, _read_targets(plan, ad, rd, targets, js, others))


def _read_targets(plan: Plan, ad: Adapter, rd: Reader, targets, js, others) -> list:
    """The loaded state of targets ``js`` (see `Adapter.install`); ``others``: the non-element
    state read so far, by saved param."""
    states: list[dict | None] = []
    with torch.no_grad():
        for j in js:
            t = targets[j]
            name = ad.name_of(t.index)
            sp = plan.saved.get(name)
            if sp is None:  # trainable here, not in the saved optimizer: its values only
                full = rd.tensor(MODEL_FILE, name).reshape(-1)
                t.values.copy_(full[t.offset : t.offset + t.numel])
                states.append(None)
                continue
            s = sp["index"]
            read_range(rd, plan, s, "p", t.offset, t.numel, t.values)
            sc = sp.get("state")
            if not sc:
                states.append(None)
                continue
            elem = {}
            low = sc.get("lowbit")
            codes = _read_lowbit(plan, ad, rd, j, t, s, low, elem) if low else None
            for k, dt in sc["elem"].items():
                if k in elem:  # low-bit moments: read above
                    continue
                dtype = getattr(torch, dt)
                if dtype.is_floating_point:
                    dtype = ad.float_state_dtype(j, t.values.dtype)
                elem[k] = ad.state_buffer(j, k, dtype)
                read_range(rd, plan, s, f"s/{k}", t.offset, t.numel, elem[k])
            if s not in others:
                o = {k: decode(v) for k, v in sc["value"].items()}
                for k in sc["tensor"]:
                    o[k] = rd.tensor(_first_file(plan, s), f"o/{s}/{k}")
                others[s] = o
            other = {}
            for k, v in others[s].items():
                if isinstance(v, torch.Tensor):
                    v = v.clone()
                    if k != "step" and v.is_floating_point():
                        v = v.to(ad.float_state_dtype(j, t.values.dtype))
                other[k] = v
            states.append({"elem": elem, "other": other})
            if codes is not None:
                states[-1].update(codes=codes, block=low["block"])
    return states


# ---------------------------------------------------------------------------- 3b. int8 moments
_MOMENTS = ("exp_avg", "exp_avg_sq")
_CODE_DTYPES = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}


def _read_lowbit(plan: Plan, ad: Adapter, rd: Reader, j: int, t, s: int, low: dict, elem: dict):
    """Target ``j``'s int8 moments (saved as codes and block scales, see [Note: checkpoint
    format]) decoded to fp32 into ``elem`` (the adapter's state buffers); where the target
    keeps the same format on the same blocks, the codes and scales as saved are returned too
    (the state takes them as they are; ``elem`` is their decode), else None."""
    if low.get("dtype") != "int8" or low.get("origin") not in ("piece", "param"):
        raise CheckpointError(plan.where(), f"unknown low-bit state format {low!r}")
    block = int(low["block"])
    for k in _MOMENTS:
        elem[k] = ad.state_buffer(j, k, t.values.dtype)
    codes = None
    if ad.lowbit_target(j) == {"dtype": "int8", "block": block, "origin": low["origin"]}:
        codes = _same_blocks(plan, rd, t, s, low["origin"], block)
    if codes is None:  # other blocks: only the saved ones that overlap, decoded
        read_decoded(rd, plan, s, block, low["origin"], t.offset, t.numel, elem)
        return None
    from ..ops import lowbit

    m, v = lowbit.decode_state(codes, "int8", block)  # the target's grid is the saved one
    elem["exp_avg"].copy_(m)
    elem["exp_avg_sq"].copy_(v)
    return codes


def _same_blocks(plan: Plan, rd: Reader, t, s: int, origin: str, block: int) -> dict | None:
    """Target ``t``'s codes and scales as saved, where its blocks are the saved ones: the saved
    piece of the same range (``origin="piece"``), or a whole param (``"param"``); else None."""
    src = plan.sources.get(s, ())
    if origin == "piece":  # a ZeroOptimizer piece: the same range, the same blocks
        same = [r for r, so, sn in src if so == t.offset and sn == t.numel]
        if not same:
            return None
        f = rank_file(same[0])
        codes = {k: rd.tensor(f, f"s/{s}/{t.offset}/{k}") for k in _MOMENTS}
        for k in _MOMENTS:
            codes[f"{k}_scale"] = rd.tensor(f, f"k/{s}/{t.offset}/{k}_scale")
        return codes
    if t.offset != 0 or t.numel != sum(sn for _, _, sn in src):
        return None  # "param" blocks: only a whole param has them all
    codes = {}
    nb = (t.numel + block - 1) // block
    for k in _MOMENTS:
        codes[k] = torch.empty(t.numel, dtype=_CODE_DTYPES[k])
        read_range(rd, plan, s, f"s/{k}", 0, t.numel, codes[k])
        sc = codes[f"{k}_scale"] = torch.empty(nb, dtype=torch.float32)
        for r, so, sn in src:  # each piece's blocks (one shared with a neighbour: equal)
            sc[so // block : (so + sn - 1) // block + 1] = rd.tensor(
                rank_file(r), f"k/{s}/{so}/{k}_scale"
            )
    return codes


def read_decoded(
    rd: Reader, plan: Plan, s: int, block: int, origin: str, lo: int, n: int, out: dict
) -> None:
    """Elements ``[lo, lo + n)`` of saved param ``s``'s int8 moments decoded to fp32 into
    ``out["exp_avg"]``/``out["exp_avg_sq"]`` (1-D), from every saved piece that overlaps them:
    only the blocks that hold those elements are read."""
    from ..ops import lowbit

    covered = 0
    for r, so, sn in plan.sources.get(s, ()):
        a, b = max(lo, so), min(lo + n, so + sn)
        if b <= a:
            continue
        o = so if origin == "piece" else 0  # where the piece's block grid starts
        k0, k1 = (a - o) // block, (b - 1 - o) // block + 1  # its blocks holding [a, b)
        e0, e1 = max(so, o + k0 * block), min(so + sn, o + k1 * block)
        pk = (so - o) // block  # the piece's first block
        f = rank_file(r)
        st = {k: rd.range(f, f"s/{s}/{so}/{k}", e0 - so, e1 - so) for k in _MOMENTS}
        for k in _MOMENTS:
            st[f"{k}_scale"] = rd.range(f, f"k/{s}/{so}/{k}_scale", k0 - pk, k1 - pk)
        bounds = [e0, *(o + k * block for k in range(k0 + 1, k1)), e1]
        starts = torch.tensor(bounds, dtype=torch.int64) - e0
        m, v = lowbit.decode_state(st, "int8", block, starts)
        out["exp_avg"][a - lo : b - lo].copy_(m[a - e0 : b - e0])
        out["exp_avg_sq"][a - lo : b - lo].copy_(v[a - e0 : b - e0])
        covered += b - a
    if covered != n:
        raise CheckpointError(
            plan.where(), f"corrupt: saved pieces of param #{s} cover {covered} of {n} elements"
        )


# ---------------------------------------------------------------------------- 4. the rest
@torch.no_grad()
def _load_model_state(plan: Plan, ad: Adapter, rd: Reader) -> None:
    for name, t in ad.model_entries().items():
        sp = plan.saved.get(name)
        if sp is not None:  # trained then, frozen (or outside the optimizer) now
            dt = torch.float64 if sp["dtype"] == "float64" else torch.float32
            buf = torch.empty(t.numel(), dtype=dt)
            read_range(rd, plan, sp["index"], "p", 0, t.numel(), buf)
            t.copy_(buf.view(t.shape))
        else:
            t.copy_(rd.tensor(MODEL_FILE, name))
    # modules' extra state, set directly: model.load_state_dict would run the optimizer's load
    # hooks (which take the masters from the low-precision params)
    modules = ad.model_values()
    for n, v in (plan.meta["model"].get("values") or {}).items():
        if n in modules:
            modules[n].set_extra_state(decode(v))


def _set_rng(rd: Reader, rank: int) -> None:
    f = rank_file(rank)
    meta = json.loads(rd.metadata(f).get("rng", "{}"))
    torch.set_rng_state(rd.tensor(f, "rng/torch"))
    if torch.cuda.is_available():
        states = []
        d = 0
        while rd.has(f, f"rng/cuda/{d}") and d < torch.cuda.device_count():
            states.append(rd.tensor(f, f"rng/cuda/{d}"))
            d += 1
        if states:
            torch.cuda.set_rng_state_all(states)
    if "python" in meta:
        random.setstate(decode(meta["python"]))
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in meta and rd.has(f, "rng/numpy"):
        kind, pos, has_gauss, cached = meta["numpy"]
        keys = rd.tensor(f, "rng/numpy").numpy().astype("uint32")
        np.random.set_state((kind, keys, pos, has_gauss, cached))


# ---------------------------------------------------------------------------- 5. another tp size
def _columns(path: str, ad: Adapter) -> list[str] | None:
    """The saved tp columns to redistribute from ([Note: redistributing across tp sizes]), or
    None: the ordinary load (of this rank's own column, where there is tp)."""
    placements = {ad.name_of(i): p for i, p in (ad.tp or {}).get("placements", {}).items()}
    return columns_to_redistribute(path, ad.tp, placements)


@dataclass
class _Redistribution:
    """What a load across tp sizes reads: each saved column's `Plan`, and where each param of
    the loading model is in them (`ParamMap`): ``maps`` for the optimizer's params,
    ``model_maps`` for model tensors (frozen now) that were trained when saved."""

    plans: list[Plan]
    maps: dict[str, ParamMap]
    model_maps: dict[str, ParamMap]
    tp_rank: int
    tp_size: int


def _plan_redistributed(columns: list[str], ad: Adapter) -> _Redistribution:
    """Read and check every column's meta.json; map every param of the loading model onto
    them (raising, naming the param and both sides, where that cannot be done)."""
    plans = [saved_plan(d, read_meta(d)) for d in (resolve(c) for c in columns)]
    n, first = len(plans), plans[0]
    where = first.where()
    steps = [p.meta.get("steps") for p in plans]
    if len(set(steps)) != 1:
        raise CheckpointError(
            os.path.dirname(columns[0]),
            f"the tp columns' latest checkpoints differ: steps {steps} (a save interrupted "
            "between columns): load one of them by name",
        )
    for c, p in enumerate(plans):
        tpm = p.meta.get("tensor_parallel")
        if (tpm is None and n > 1) or (tpm is not None and (tpm["size"], tpm["rank"]) != (n, c)):
            raise CheckpointError(p.where(), f"corrupt: tp column {c} of {n} records {tpm}")
    saved_pl = [(p.meta.get("tensor_parallel") or {}).get("placements", {}) for p in plans]
    groups = first.meta["param_groups"]
    if len(groups) != len(ad.optimizer.param_groups):
        raise CheckpointError(
            where,
            f"incompatible optimizer: {len(groups)} param groups saved, "
            f"{len(ad.optimizer.param_groups)} here",
        )
    tp = ad.tp or {"size": 1, "rank": 0, "placements": {}}
    leaves = ad.leaves()
    maps: dict[str, ParamMap] = {}
    for p in ad.table:
        name, i = p["name"], p["index"]
        leaf = leaves[i]
        if ad.tp is None and hasattr(leaf, "device_mesh"):
            raise CheckpointError(
                where,
                f"param {name} is a DTensor under a plain torch optimizer: load a "
                "tensor-parallel model through its ZeroOptimizer",
            )
        here = (tp["placements"].get(i), tp["size"], tp["rank"], tuple(leaf.shape))
        entries = [pl.saved.get(name) for pl in plans]
        if entries[0] is None:  # trained here, not in the saved optimizer: column 0's model file
            mt = first.model_tensors.get(name)
            if mt is None:
                raise CheckpointError(where, f"incompatible model: param {name} is not in it")
            maps[name] = param_map(name, None, [mt["shape"]], [-1], *here, p["shape"], where)
            continue
        if any(e is None for e in entries):
            raise CheckpointError(where, f"corrupt: param {name} is not in every tp column")
        if entries[0]["group"] != p["group"]:
            raise CheckpointError(
                where,
                f"incompatible optimizer: param {name} is in param group {p['group']} here, "
                f"{entries[0]['group']} in the checkpoint",
            )
        if any(x.get(name) != saved_pl[0].get(name) for x in saved_pl):
            raise CheckpointError(where, f"corrupt: the tp columns' placements of {name} differ")
        pm = param_map(
            name,
            saved_pl[0].get(name),
            [e["shape"] for e in entries],
            [e["index"] for e in entries],
            *here,
            p["shape"],
            where,
        )
        _check_state(pm, [e.get("state") for e in entries], where)
        maps[name] = pm
    model_maps = {}
    for name, t in ad.model_entries().items():
        if hasattr(t, "device_mesh"):
            raise CheckpointError(where, f"{name} is a DTensor buffer or frozen DTensor param")
        entries = [pl.saved.get(name) for pl in plans]
        if entries[0] is not None:  # trained then, frozen (or outside the optimizer) now
            sp = saved_pl[0].get(name)
            shapes, idx = [e["shape"] for e in entries], [e["index"] for e in entries]
            shape = tuple(t.shape)
            model_maps[name] = param_map(name, sp, shapes, idx, None, 1, 0, shape, shape, where)
        elif list(first.model_tensors.get(name, {}).get("shape", [-1])) != list(t.shape):
            raise CheckpointError(
                where, f"incompatible model: {name} of shape {tuple(t.shape)} is not in it"
            )
    known = set(maps) | set(ad.model_entries())
    for name in first.saved:
        if name not in known:
            raise CheckpointError(where, f"incompatible model: it has no param {name}")
    return _Redistribution(plans, maps, model_maps, tp["rank"], tp["size"])


def _check_state(pm: ParamMap, schemas: list, where: str) -> None:
    """The saved optimizer state of ``pm`` can be redistributed: the same entries in every
    column; per-tensor tensors only where they are scalars or the param is cut alike."""
    if any((s or {}).get("elem") != (schemas[0] or {}).get("elem") for s in schemas):
        raise CheckpointError(where, f"corrupt: the tp columns' state entries of {pm.name} differ")
    for k, info in ((schemas[0] or {}).get("tensor") or {}).items():
        if math.prod(info["shape"]) > 1 and not pm.same_cut:
            raise CheckpointError(
                where,
                f"param {pm.name}: its optimizer state {k!r} of shape {tuple(info['shape'])} "
                f"is kept per tensor, not per element; it cannot be redistributed "
                f"({pm.describe})",
            )


def _load_redistributed(columns: list[str], ad: Adapter, ctls, scheduler) -> dict:
    """`load_checkpoint` from tp columns of another size or placements (or a save without
    tp into a tp model, or the converse): the steps of the ordinary load, each rank reading
    its pieces from every column that holds part of them."""
    rd_plan = _agree_all(ctls, lambda: _plan_redistributed(columns, ad), "reading meta.json")
    meta = rd_plan.plans[0].meta
    for c in ctls:
        c.step = meta.get("steps")
    # every column's files, each verified once on the dp x tp grid
    files = [(c, f) for c, p in enumerate(rd_plan.plans) for f in sorted(p.meta["files"])]
    me = rd_plan.tp_rank * ad.dp_size + ad.dp_rank
    grid = rd_plan.tp_size * ad.dp_size

    def verify():
        for j, (c, f) in enumerate(files):
            if j % grid == me:
                _verify(rd_plan.plans[c], [f])

    _agree_all(ctls, verify, "verifying the files")
    readers = [Reader(p.directory) for p in rd_plan.plans]
    try:
        _agree_all(ctls, lambda: _read_redistributed(rd_plan, ad, readers), "reading the pieces")
        ad.finish_install(decode(meta["param_groups"]), meta)
        with ad.frozen_whole(write=True):
            _load_model_redistributed(rd_plan, ad, readers)
        if scheduler is not None and meta.get("scheduler") is not None:
            scheduler.load_state_dict(decode(meta["scheduler"]))
        c = rd_plan.tp_rank % len(readers)  # the RNG states of the same tp rank's column
        if ad.rank < rd_plan.plans[c].meta["world_size"]:
            _set_rng(readers[c], ad.rank)
    finally:
        for rd in readers:
            rd.close()
    return decode(meta["extra"])


def _flat(rdp: _Redistribution, readers: list[Reader], pm: ParamMap, key: str, dtype):
    """``read_flat(c, lo, n)`` of `read_piece`: saved tensor ``key`` of ``pm`` in column c,
    elements ``[lo, lo + n)`` of its flattened local tensor, as ``dtype``."""
    whole = {}

    def read_flat(c: int, lo: int, n: int) -> torch.Tensor:
        plan, s = rdp.plans[c], pm.index[c]
        if s < 0:  # a model tensor of column 0 (frozen when saved): read whole, once
            if "t" not in whole:
                whole["t"] = readers[0].tensor(MODEL_FILE, pm.name).reshape(-1)
            return whole["t"][lo : lo + n].to(dtype)
        out = torch.empty(n, dtype=dtype)
        kind, _, k = key.partition("/")
        low = (plan.saved[pm.name].get("state") or {}).get("lowbit")
        if kind == "s" and low and k in _MOMENTS:  # int8 moments: their blocks decoded
            both = {m: torch.empty(n, dtype=dtype) for m in _MOMENTS}
            read_decoded(readers[c], plan, s, int(low["block"]), low["origin"], lo, n, both)
            return both[k]
        read_range(readers[c], plan, s, key, lo, n, out)
        return out

    return read_flat


def _read_redistributed(rdp: _Redistribution, ad: Adapter, readers: list[Reader]) -> None:
    """`_read_windows` from the columns: each target piece's values and element-wise state
    cut from the saved columns' (`read_piece`), per-tensor state from one column."""
    targets, others = ad.targets(), {}
    for which, ctx in ad.windows(read=True, write=True):
        js = range(len(targets)) if which is None else which
        with ctx(), torch.no_grad():
            states = [_read_target(rdp, ad, readers, j, targets[j], others) for j in js]
            ad.install_pieces(which, states)


def _read_target(rdp: _Redistribution, ad: Adapter, readers, j: int, t, others: dict):
    pm = rdp.maps[ad.name_of(t.index)]
    read_piece(pm, _flat(rdp, readers, pm, "p", t.values.dtype), t.offset, t.numel, t.values)
    sp = rdp.plans[0].saved.get(pm.name)
    sc = sp.get("state") if sp else None
    if not sc:
        return None
    elem = {}
    for k, dt in sc["elem"].items():
        dtype = getattr(torch, dt)
        if sc.get("lowbit") and k in _MOMENTS:  # decoded to the values' dtype, encoded again
            dtype = t.values.dtype
        elif dtype.is_floating_point:
            dtype = ad.float_state_dtype(j, t.values.dtype)
        elem[k] = ad.state_buffer(j, k, dtype)
        read_piece(pm, _flat(rdp, readers, pm, f"s/{k}", dtype), t.offset, t.numel, elem[k])
    if pm.name not in others:
        o = {k: decode(v) for k, v in sc["value"].items()}
        for k, info in sc["tensor"].items():  # scalars: column 0's; else the same cut's own
            c = pm.rank if math.prod(info["shape"]) > 1 and pm.saved.dim is not None else 0
            o[k] = readers[c].tensor(_first_file(rdp.plans[c], pm.index[c]), f"o/{pm.index[c]}/{k}")
        others[pm.name] = o
    other = {}
    for k, v in others[pm.name].items():
        if isinstance(v, torch.Tensor):
            v = v.clone()
            if k != "step" and v.is_floating_point():
                v = v.to(ad.float_state_dtype(j, t.values.dtype))
        other[k] = v
    return {"elem": elem, "other": other}


@torch.no_grad()
def _load_model_redistributed(rdp: _Redistribution, ad: Adapter, readers) -> None:
    """`_load_model_state` from column 0 (buffers and frozen params are whole in every
    column); a tensor trained when saved is cut from the columns like a param."""
    for name, t in ad.model_entries().items():
        pm = rdp.model_maps.get(name)
        if pm is None:
            t.copy_(readers[0].tensor(MODEL_FILE, name))
            continue
        dt = torch.float64 if t.dtype == torch.float64 else torch.float32
        buf = torch.empty(t.numel(), dtype=dt)
        read_piece(pm, _flat(rdp, readers, pm, "p", dt), 0, t.numel(), buf)
        t.copy_(buf.view(t.shape))
    modules = ad.model_values()
    for n, v in (rdp.plans[0].meta["model"].get("values") or {}).items():
        if n in modules:
            modules[n].set_extra_state(decode(v))
