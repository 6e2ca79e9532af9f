"""torch.distributed.checkpoint (DCP) saves of FSDP2 runs loaded into a `ZeroOptimizer`.

[Note: DCP checkpoints]
An FSDP2 script saves ``get_state_dict(model, optimizer)`` with ``dcp.save``: a folder of
``__<rank>_<n>.distcp`` files (each item ``torch.save``d alone: a tensor chunk, or a small
Python value) and ``.metadata``, a pickle of DCP's ``Metadata``: every flattened key's shape and
chunks (``state_dict_metadata``), where each chunk's bytes are (``storage_data``) and the key's
path in the nested dict that was saved (``planner_data``, e.g. ``("optim", "state", "0.weight",
"exp_avg")``). Scripts name the top level differently (torchtitan ``model``/``optimizer``,
others ``optim``, some save one flat dict), so entries are found by the model's own names in
those paths: a path ending in a param's name is its value, ``(..., "state", name, key)`` its
optimizer state, ``(..., "param_groups", g, key)`` the hyper-parameters. `load_dcp_checkpoint`
says what it found (the prefixes, the keys) and refuses a checkpoint where a trained param has
no value, or only some params have optimizer state.

Nothing is unpickled beyond an allow-list: ``.metadata`` with a restricted unpickler that takes
DCP's metadata dataclasses, ``torch.Size``, dtypes and ``pathlib`` paths (``find_class``
refuses any other global, naming it), and every item with ``torch.load(weights_only=True)``.
DCP's own reader calls ``pickle.load`` on ``.metadata``.

Each needed tensor is assembled whole from its chunks (the chunk files are read at their
offsets only), once per rank for the params this rank holds a piece of; the pieces then go
through the same loader as our checkpoints (`_read_windows`), at any stage and world size.
`save_dcp_checkpoint` is the way back: our state as the flattened ``get_state_dict`` FSDP2
loads with ``dcp.load`` and ``set_state_dict`` (gathered to rank 0, which writes).

Not read: compressed items (``transform_descriptors``), DTensor ``Replicate`` duplicates beyond
the first chunk at each offset, the LR scheduler (``get_state_dict`` does not hold it).
"""

from __future__ import annotations

import io
import math
import os
import pickle

import torch

from ..optimizer import ZeroOptimizer
from .adapters import Adapter, adapter_for
from .control import control_for
from .format import MODEL_FILE, CheckpointError
from .load import Plan, _agree, _load_model_state, _read_windows

__all__ = ["DcpCheckpoint", "load_dcp_checkpoint", "read_dcp_checkpoint", "save_dcp_checkpoint"]

_META = ".metadata"
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetaUnpickler(pickle.Unpickler):
    def __init__(self, f, path: str):
        super().__init__(f)
        self.path = path

    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise CheckpointError(
            self.path,
            f"refused: it holds the global {module}.{name}, not one of DCP's metadata classes "
            "(loading it could run code from the file; nothing was run)",
        )


class DcpCheckpoint:
    """A DCP folder's metadata, and its items read on demand (whole tensors, cached)."""

    def __init__(self, folder: str):
        self.folder = os.fspath(folder)
        path = os.path.join(self.folder, _META)
        if not os.path.isfile(path):
            raise CheckpointError(path, "missing: not a torch.distributed.checkpoint folder")
        try:
            with open(path, "rb") as f:
                md = _MetaUnpickler(f, path).load()
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a truncated or corrupt file
            raise CheckpointError(path, f"truncated or corrupt ({type(e).__name__}: {e})") from None
        self.meta_file = path
        try:
            self.keys = dict(md.state_dict_metadata)
            self.paths = {k: tuple(v) for k, v in (md.planner_data or {}).items()}
            self.storage = dict(md.storage_data)
        except (AttributeError, TypeError) as e:
            raise CheckpointError(path, f"not DCP metadata ({e})") from None
        for k in self.keys:
            self.paths.setdefault(k, (k,))
        self._cache: dict[str, object] = {}

    def _item(self, info) -> object:
        f = os.path.join(self.folder, info.relative_path)
        if getattr(info, "transform_descriptors", None):
            raise NotImplementedError(f"{f}: compressed or transformed items are not read here")
        try:
            with open(f, "rb") as fh:
                fh.seek(info.offset)
                raw = fh.read(info.length)
        except OSError as e:
            raise CheckpointError(f, f"unreadable ({e})") from None
        if len(raw) != info.length:
            raise CheckpointError(f, "truncated: an item ends past the end of the file")
        try:
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise CheckpointError(f, f"item refused or corrupt ({first})") from None

    def get(self, key: str):
        """The whole value of flattened ``key``: a tensor assembled from its chunks, or the
        Python value saved."""
        if key in self._cache:
            return self._cache[key]
        md = self.keys[key]
        items = [(idx, info) for idx, info in self.storage.items() if idx.fqn == key]
        if not hasattr(md, "chunks"):  # bytes: one item
            if not items:
                raise CheckpointError(self.meta_file, f"no data for {key}")
            out = self._item(items[0][1])
        else:
            dtype = md.properties.dtype
            out = torch.empty(tuple(md.size), dtype=dtype)
            covered, seen = 0, set()
            for idx, info in items:
                off = tuple(int(x) for x in idx.offset)
                if off in seen:
                    continue
                seen.add(off)
                t = self._item(info)
                if not torch.is_tensor(t):
                    raise CheckpointError(self.meta_file, f"{key}: a chunk is not a tensor")
                sl = tuple(slice(o, o + n) for o, n in zip(off, t.shape))
                out[sl].copy_(t)
                covered += t.numel()
            if covered != math.prod(md.size):
                raise CheckpointError(
                    self.meta_file, f"{key}: chunks cover {covered} of {math.prod(md.size)}"
                )
        self._cache[key] = out
        return out


def read_dcp_checkpoint(path) -> DcpCheckpoint:
    """The metadata of DCP folder ``path`` (nothing else read)."""
    return DcpCheckpoint(path)


def _find(ck: DcpCheckpoint, names: set[str]) -> dict:
    """Which keys hold each param's value and state, by the model's names (see the Note)."""
    values, state, groups, prefixes = {}, {}, {}, {"model": set(), "optimizer": set()}
    for key, p in ck.paths.items():
        strs = [str(x) for x in p]
        if len(strs) >= 3 and strs[-2] in names and strs[-3] == "state":
            state.setdefault(strs[-2], {})[strs[-1]] = key
            prefixes["optimizer"].add(".".join(strs[:-3]))
        elif len(strs) >= 3 and strs[-3] == "param_groups":
            groups.setdefault(int(strs[-2]), {})[strs[-1]] = key
        elif strs[-1] in names or ".".join(strs) in names:
            n = strs[-1] if strs[-1] in names else ".".join(strs)
            if n in values:  # the same name twice (model and something else)
                raise CheckpointError(ck.meta_file, f"{n} found twice: {values[n]}, {key}")
            values[n] = key
            prefixes["model"].add(".".join(strs[:-1]))
        else:  # a flat key: the longest model name it ends with
            for n in names:
                if key.endswith("." + n) and ".state." not in key:
                    values.setdefault(n, key)
    return {"values": values, "state": state, "groups": groups, "prefixes": prefixes}


class _DcpPlan(Plan):
    def where(self) -> str:
        return self.directory


class _DcpReader:
    def __init__(self, ck: DcpCheckpoint, found: dict, index: dict[int, str]):
        self.ck, self.found, self.index = ck, found, index

    def range(self, file: str, name: str, a: int, b: int) -> torch.Tensor:
        kind, s, _so, *key = name.split("/")
        n = self.index[int(s)]
        k = self.found["values"][n] if kind == "p" else self.found["state"][n][key[0]]
        return self.ck.get(k).reshape(-1)[a:b]

    def tensor(self, file: str, name: str) -> torch.Tensor:
        if file == MODEL_FILE:
            return self.ck.get(self.found["values"][name])
        kind, s, key = name.split("/")
        v = self.ck.get(self.found["state"][self.index[int(s)]][key])
        return v if torch.is_tensor(v) else torch.tensor(float(v))


def _plan(ck: DcpCheckpoint, ad: Adapter) -> tuple[_DcpPlan, dict, dict]:
    where = ck.meta_file
    mine = {q["name"]: q for q in ad.table}
    entries = ad.model_entries()
    found = _find(ck, set(mine) | set(entries))
    missing = sorted(n for n in list(mine) + list(entries) if n not in found["values"])
    if missing:
        raise CheckpointError(
            where,
            f"no value for {missing[0]} ({len(missing)} missing; "
            f"keys found under {sorted(found['prefixes']['model'])})",
        )
    with_state = [n for n in mine if n in found["state"]]
    if with_state and len(with_state) != len(mine):
        lack = sorted(set(mine) - set(with_state))
        raise CheckpointError(
            where,
            f"optimizer state for {len(with_state)} of {len(mine)} params: none for {lack[0]}",
        )
    saved, sources, index = {}, {}, {}
    for s, (n, q) in enumerate(mine.items()):
        key = found["values"][n]
        shape = list(ck.keys[key].size)
        if shape != list(q["shape"]):
            raise CheckpointError(
                where,
                f"incompatible model: {n} has shape {tuple(q['shape'])}"
                f" here, {tuple(shape)} in {key}",
            )
        st = found["state"].get(n, {})
        elem = {k: "float32" for k, v in st.items() if k != "step"}
        schema = None
        if st:
            schema = {"elem": elem, "value": {}, "tensor": {"step": {}} if "step" in st else {}}
        saved[n] = {
            "index": s,
            "name": n,
            "shape": shape,
            "group": q["group"],
            "dtype": "float32",
            "state": schema,
        }
        sources[s] = [(0, 0, math.prod(shape))]
        index[s] = n
    model_tensors = {n: {"shape": list(ck.keys[found["values"][n]].size)} for n in entries}
    plan = _DcpPlan(ck.folder, {"model": {"values": {}}}, saved, sources, model_tensors)
    return plan, found, index


_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "momentum", "dampening", "nesterov")


_IMPL = ("foreach", "fused", "capturable", "differentiable", "initial_lr", "params")


def _groups(ck: DcpCheckpoint, found: dict, ad: Adapter) -> list[dict]:
    """The saved hyper-parameters of each group; another saved setting that differs from this
    optimizer's (``maximize``, ``decoupled_weight_decay``...) is refused by name."""
    out = []
    for g, here in enumerate(ad.optimizer.param_groups):
        h = {}
        for k, key in found["groups"].get(g, {}).items():
            v = ck.get(key)
            if k in _HYPER and k in here:
                h[k] = tuple(v) if k == "betas" else v
            elif k not in _IMPL and k in here and here[k] != v:
                raise CheckpointError(
                    ck.meta_file,
                    f"param group {g}: {k}={v!r} saved, {here[k]!r} here (not changed by a load)",
                )
        out.append(h)
    return out


def load_dcp_checkpoint(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict:
    """Load a DCP save of ``get_state_dict(model, optimizer)`` (FSDP2 or any other run of the
    same model) into ``model`` and ``optimizer`` (a `ZeroOptimizer` of any stage and world
    size); collective. Returns what was found: the top-level prefixes of the model's values
    and of the optimizer's state, how many params had state, the param groups read, and what
    the checkpoint holds that was not used. See [Note: DCP checkpoints]."""
    ad = adapter_for(model, optimizer)
    ctl = control_for(ad, os.fspath(path), "load")
    ctl.arrive("load_dcp_checkpoint")

    def plan():
        ck = read_dcp_checkpoint(path)
        return (ck, *_plan(ck, ad))

    ck, pl, found, index = _agree(ctl, plan, "reading the DCP metadata")
    rd = _DcpReader(ck, found, index)
    _agree(ctl, lambda: _read_windows(pl, ad, rd), "reading the pieces")
    groups = _agree(ctl, lambda: _groups(ck, found, ad), "reading the param groups")
    steps = {
        float(rd.tensor("", f"o/{s}/step"))
        for s, n in index.items()
        if "step" in found["state"].get(n, {})
    }
    meta = {"steps": int(max(steps)) if steps else ad.steps(), "scaler": ad.scaler()}
    ad.finish_install(groups, meta)
    with ad.frozen_whole(write=True):
        _load_model_state(pl, ad, rd)
    used = set(found["values"].values()) | {k for d in found["state"].values() for k in d.values()}
    used |= {k for d in found["groups"].values() for n, k in d.items() if n in _HYPER}
    return {
        "model_prefix": sorted(found["prefixes"]["model"]),
        "optimizer_prefix": sorted(found["prefixes"]["optimizer"]),
        "params_with_state": sum(1 for n in index.values() if n in found["state"]),
        "params": len(index),
        "param_groups": groups,
        "steps": meta["steps"],
        "unused_keys": sorted(set(ck.keys) - used),
    }


# ---------------------------------------------------------------------------- the way back
def save_dcp_checkpoint(
    path: str | os.PathLike, model: torch.nn.Module, optimizer, *, keys=("model", "optim")
) -> str:
    """Save ``model`` and `ZeroOptimizer` ``optimizer`` as a DCP checkpoint that FSDP2 loads
    with ``dcp.load({"model": msd, "optim": osd}, ...)`` and ``set_state_dict`` (``msd, osd =
    get_state_dict(model, opt)`` of its own run; ``keys``: the two top-level names its script
    uses): ``model.<name>`` each param at full precision (the fp32 master of bf16/fp16 params)
    and buffer, ``optim.state.<name>.<key>`` the Adam state, ``optim.param_groups`` the
    groups with their params' names. Collective: every param is gathered whole (one at a time)
    and rank 0 writes, so rank 0 holds the model's state once (a DCP save of ours, sharded,
    is not built). Returns ``path``."""
    import torch.distributed.checkpoint as dcp

    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(f"optimizer must be a ZeroOptimizer, got {type(optimizer).__name__}")
    ad = adapter_for(model, optimizer)
    ctl = control_for(ad, os.fspath(path), "save")
    ctl.arrive("save_dcp_checkpoint")
    rank0 = ad.dp_rank == 0
    msd, state = {}, {}
    names = {}
    for name, p in ad.model.named_parameters():
        names[id(p)] = name
        if not p.requires_grad:
            msd[name] = p.detach().clone() if rank0 else None
            continue
        st = optimizer.full_state(p)  # collective
        full = optimizer.full_param(p)  # the fp32 master of bf16/fp16 params
        if rank0:
            msd[name] = full.detach().float() if full.is_floating_point() else full
            if st:
                state[name] = {
                    k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in st.items()
                }
    for name, b in ad.model.named_buffers():
        if rank0:
            msd[name] = b.detach().clone()
    res = ("ok", None)
    if rank0:
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [names[id(p)] for p in g["params"] if id(p) in names],
            }
            for g in optimizer.param_groups
        ]
        try:
            sd = {keys[0]: msd, keys[1]: {"state": state, "param_groups": groups}}
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(os.fspath(path)), no_dist=True)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            res = ("err", f"{type(e).__name__}: {e}")
    res = ctl.broadcast(res, "the DCP save on rank 0")
    if res[0] == "err":
        raise CheckpointError(os.fspath(path), f"save failed on rank 0: {res[1]}")
    return os.fspath(path)
