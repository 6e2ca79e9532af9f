"""DeepSpeed's ZeRO checkpoints read safely: loaded into any `ZeroOptimizer`, or converted.

[Note: DeepSpeed checkpoints]
``engine.save_checkpoint(dir, tag)`` writes ``dir/<tag>/`` (``dir/latest`` names the tag) with,
for data parallelism alone (``mp_rank_00``), one optimizer file per rank R of the W that saved:

    stages 1, 2   mp_rank_00_model_states.pt           the module's state (params in the model's
                                                       dtype, buffers), ``param_shapes`` (one
                                                       ordered {name: shape} per param group),
                                                       ``lr_scheduler``, ``global_steps``, ...
                  [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt
                                                       ``single_partition_of_fp32_groups[g]``:
                                                       rank R's slice [R*P, (R+1)*P) of group g's
                                                       params flattened end to end (padded to W*P);
                                                       ``base_optimizer_state``: Adam's ``step``,
                                                       ``exp_avg``, ``exp_avg_sq`` per group on
                                                       the same slice, and ``param_groups``
    stage 3       zero_pp_rank_R_mp_rank_00_model_states.pt   as above, params empty
                  [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt
                                                       ``fp32_flat_groups[g]``: each param of the
                                                       group cut in W chunks of ceil(n/W) (the last
                                                       padded), rank R's chunks end to end; Adam's
                                                       state on the same layout

So the element range of each param in each rank's file is known from the shapes alone: these
are the saved *pieces* of [Note: resharding at load] (in `.load`), and a DeepSpeed checkpoint is
read by the same loader as ours (`_read_windows`): each rank reads only the ranges of its own
pieces. The files are pickles: they are opened with ``torch.load(weights_only=True, mmap=True)``
(only the ranges read are paged in) and an allow-list of the three classes DeepSpeed 0.19 writes
(found by listing the globals of real checkpoints of stages 1-3, fp32 and bf16): its loss scaler
(``LossScaler``, ``DynamicLossScaler``), ``ZeroStageEnum`` and ``fragment_address``, each
rebuilt as a plain stand-in defined here (DeepSpeed need not be installed). Anything else in a
file (a ``__reduce__`` that would run code), a truncated or corrupt file: `CheckpointError`
naming the file; nothing is executed.

What is restored: each param's fp32 master, ``exp_avg``, ``exp_avg_sq`` and ``step``, the param
groups' hyper-parameters (lr, betas, eps, weight_decay), the optimizer's step counter
(``global_steps``), the loss scale, the buffers, and the LR scheduler's position (DeepSpeed's
``last_batch_iteration`` i becomes torch's ``last_epoch`` i + 1, the lr the one saved). Not
there: RNG states (DeepSpeed saves none). Not read: tensor or pipeline parallel checkpoints
(``mp_rank_01``...), stage-3 frozen params, MoE experts.

DeepSpeed's universal layout (``ds_to_universal``'s ``<tag>_universal/``: each param's fp32
master and moments whole in ``zero/<name>/<key>.pt``) is read the same way, each param one
saved piece.
"""

from __future__ import annotations

import enum
import math
import os
import re
from dataclasses import dataclass, field

import torch

from .adapters import Adapter, adapter_for
from .control import control_for
from .format import MODEL_FILE, CheckpointError
from .load import Plan, _agree, _load_model_state, _read_windows

__all__ = [
    "DeepSpeedCheckpoint",
    "inspect_deepspeed_checkpoint",
    "is_deepspeed_checkpoint",
    "load_deepspeed_checkpoint",
    "read_deepspeed_checkpoint",
    "safe_load",
]


# ---------------------------------------------------------------------------- safe loading
class _LossScaler:
    """Stand-in for DeepSpeed's loss scalers: the unpickler sets its ``__dict__`` (cur_scale,
    dynamic, cur_iter, last_overflow_iter, scale_window, ...)."""


class _ZeroStageEnum(enum.IntEnum):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum``."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class _FragmentAddress:
    """Stand-in for DeepSpeed's ``fragment_address`` dataclass (``numel``, ``start``)."""


_ALLOWED = [
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def safe_load(path: str) -> dict:
    """``torch.load`` of DeepSpeed file ``path`` with ``weights_only=True`` (memory-mapped) and
    only `_ALLOWED`'s classes; anything else: `CheckpointError` naming the file."""
    out = _safe_any(path)
    if not isinstance(out, dict):
        raise CheckpointError(path, f"not a DeepSpeed checkpoint file (a {type(out).__name__})")
    return out


def _safe_any(path: str):
    if not os.path.isfile(path):
        raise CheckpointError(path, "missing")
    try:
        with torch.serialization.safe_globals(_ALLOWED):
            out = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - every failure to read is the file's problem
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if "Unsupported global" in str(e) or "Weights only load failed" in str(e):
            m = re.search(r"(?:unsupported|Unsupported global:) GLOBAL (\S+)", str(e))
            what = f"the global {m.group(1)}" if m else "a global outside the allow-list"
            raise CheckpointError(
                path,
                f"refused: it holds {what}, not one of the classes DeepSpeed writes (loading it "
                "would run code from the file; nothing was run)",
            ) from None
        raise CheckpointError(path, f"truncated or corrupt ({type(e).__name__}: {first})") from None
    return out


# ---------------------------------------------------------------------------- the folder
_OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def _resolve(path: str) -> str:
    """The tag folder: ``path`` itself, or the one ``path/latest`` names."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(path, "missing: no such directory")
    if any(_OPTIM_RE.match(n) for n in os.listdir(path)) or _is_universal(path):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            tag = f.read().strip()
        full = os.path.join(path, tag)
        if not tag or os.sep in tag or not os.path.isdir(full):
            raise CheckpointError(latest, f"names {tag!r}, which is not a folder here")
        return full
    raise CheckpointError(path, "not a DeepSpeed checkpoint (no *_optim_states.pt, no latest)")


def _is_universal(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "zero", "optimizer_state.pt"))


def is_deepspeed_checkpoint(path) -> bool:
    """Whether ``path`` is a DeepSpeed checkpoint folder (a tag, or a folder with ``latest``)."""
    try:
        _resolve(path)
        return True
    except CheckpointError:
        return False


@dataclass
class _Param:
    name: str
    shape: tuple[int, ...]
    group: int
    # (saved rank, first element in the param, elements, position in that rank's flat group)
    sources: list[tuple[int, int, int, int]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class DeepSpeedCheckpoint:
    """A DeepSpeed checkpoint folder read for its layout (file data is paged in on use)."""

    folder: str
    stage: int
    world_size: int
    params: list[_Param]
    param_groups: list[dict]  # hyper-parameters, as saved
    steps: int  # the engine's global_steps
    adam_step: int | None
    scaler: dict  # ours: {"loss_scale", "growth_tracker", "dynamic"}
    lr_scheduler: dict | None
    ds_config: dict | None
    ds_version: str | None
    model_dtype: torch.dtype | None
    optim_files: list[str]
    model_file: str
    universal: bool = False  # ds_to_universal's layout: one file per param and key
    _optim: dict = field(default_factory=dict, repr=False)
    _whole: dict = field(default_factory=dict, repr=False)
    _module: dict | None = field(default=None, repr=False)

    def optim(self, r: int) -> dict:
        """Rank ``r``'s optimizer file (loaded once, memory-mapped)."""
        if r not in self._optim:
            o = safe_load(self.optim_files[r]).get("optimizer_state_dict")
            if not isinstance(o, dict):
                raise CheckpointError(self.optim_files[r], "no optimizer_state_dict in it")
            self._optim[r] = o
        return self._optim[r]

    def flat(self, r: int, g: int, key: str) -> torch.Tensor:
        """Rank ``r``'s flat tensor of group ``g``: "fp32" (masters), "exp_avg", "exp_avg_sq"."""
        o = self.optim(r)
        f = self.optim_files[r]
        try:
            if key == "fp32":
                t = o["fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"][
                    g
                ]
            else:
                base = o["optimizer_state_dict"] if self.stage == 3 else o["base_optimizer_state"]
                t = base["state"][g][key]
        except (KeyError, IndexError, TypeError):
            raise CheckpointError(f, f"corrupt: no {key} for param group {g}") from None
        if not torch.is_tensor(t) or t.dim() != 1:
            raise CheckpointError(f, f"corrupt: {key} of param group {g} is not a 1-D tensor")
        return t

    def holder(self, r: int, p: _Param, key: str) -> torch.Tensor:
        """The 1-D tensor holding saved rank ``r``'s piece of ``p`` (at its ``pos``): rank
        ``r``'s flat group, or (universal layout) the param's own file."""
        if not self.universal:
            return self.flat(r, p.group, key)
        k = (p.name, key)
        if k not in self._whole:
            f = os.path.join(self.folder, "zero", p.name, f"{key}.pt")
            d = _safe_any(f)  # {"param": tensor, "cat_dim": 0}, or (from stage 3) the tensor
            t = d.get("param") if isinstance(d, dict) else d
            if not torch.is_tensor(t) or t.numel() != p.numel:
                raise CheckpointError(f, f"corrupt: no 'param' tensor of {p.numel} elements")
            self._whole[k] = t.reshape(-1)
        return self._whole[k]

    def read(self, p: _Param, key: str, lo: int, n: int, buf=None) -> torch.Tensor:
        """Elements [lo, lo + n) of param ``p``'s flattened ``key`` (fp32), in the first ``n``
        elements of ``buf`` where given."""
        out = torch.empty(n, dtype=torch.float32) if buf is None else buf[:n]
        covered = 0
        for r, so, sn, pos in p.sources:
            a, b = max(lo, so), min(lo + n, so + sn)
            if b > a:
                out[a - lo : b - lo].copy_(self.holder(r, p, key)[pos + a - so : pos + b - so])
                covered += b - a
        if covered != n:
            raise CheckpointError(self.folder, f"corrupt: {p.name} covered {covered} of {n}")
        return out

    def module_tensor(self, name: str) -> torch.Tensor:
        """A tensor of the saved module's state (buffers; stages 1/2 also params)."""
        if self._module is None:
            self._module = safe_load(self.model_file).get("module") or {}
        t = self._module.get(name)
        if not torch.is_tensor(t):
            raise CheckpointError(self.model_file, f"no tensor {name!r} in its module state")
        return t

    def module_names(self) -> list[str]:
        if self._module is None:
            self._module = safe_load(self.model_file).get("module") or {}
        return list(self._module)


def read_deepspeed_checkpoint(path) -> DeepSpeedCheckpoint:
    """The layout of DeepSpeed checkpoint ``path`` (a tag folder such as ``global_step100``, or
    the folder holding ``latest``); no process group needed. Every file's pickled part is read,
    no tensor data. See [Note: DeepSpeed checkpoints]."""
    folder = _resolve(path)
    if _is_universal(folder):
        return _read_universal(folder)
    found: dict[int, str] = {}
    for n in sorted(os.listdir(folder)):
        m = _OPTIM_RE.match(n)
        if m is None:
            continue
        if m.group(3) != "00":
            raise NotImplementedError(
                f"{os.path.join(folder, n)}: tensor or pipeline parallel checkpoints "
                f"(mp_rank_{m.group(3)}) are not read here"
            )
        found[int(m.group(2))] = os.path.join(folder, n)
    world = len(found)
    if sorted(found) != list(range(world)):
        raise CheckpointError(folder, f"missing optimizer files: ranks {sorted(found)} found")
    files = [found[r] for r in range(world)]
    o0 = safe_load(files[0])
    osd = o0.get("optimizer_state_dict")
    if not isinstance(osd, dict) or "zero_stage" not in osd:
        raise CheckpointError(files[0], "not a ZeRO optimizer file (no zero_stage)")
    stage = int(osd["zero_stage"])
    if stage not in (1, 2, 3):
        raise CheckpointError(files[0], f"zero_stage={stage}: stages 1, 2 and 3 are read here")
    model_file = os.path.join(
        folder,
        "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt",
    )
    ms = safe_load(model_file)
    shapes = ms.get("param_shapes")
    if not isinstance(shapes, list) or not all(isinstance(d, dict) for d in shapes):
        raise CheckpointError(model_file, "corrupt: no param_shapes (a list of dicts)")
    if ms.get("frozen_param_shapes") and stage == 3:
        raise NotImplementedError(f"{model_file}: stage-3 frozen params are not read here")
    if ms.get("dp_world_size") not in (None, world):
        raise CheckpointError(
            model_file, f"dp_world_size={ms['dp_world_size']} but {world} optimizer files"
        )
    params = [
        _Param(str(n), tuple(int(x) for x in s), g)
        for g, d in enumerate(shapes)
        for n, s in d.items()
    ]
    ck = DeepSpeedCheckpoint(
        folder=folder,
        stage=stage,
        world_size=world,
        params=params,
        param_groups=[],
        steps=int(ms.get("global_steps") or 0),
        adam_step=None,
        scaler={},
        lr_scheduler=ms.get("lr_scheduler"),
        ds_config=ms.get("ds_config"),
        ds_version=ms.get("ds_version"),
        model_dtype=None,
        optim_files=files,
        model_file=model_file,
    )
    ck._optim[0] = osd
    for r in range(1, world):  # every file's pickled part (not its data): a bad one fails here
        o = ck.optim(r)
        if not isinstance(o, dict) or int(o.get("zero_stage", -1)) != stage:
            raise CheckpointError(files[r], f"not a ZeRO stage-{stage} optimizer file as rank 0's")
    _layout(ck, shapes)
    base = osd["optimizer_state_dict"] if stage == 3 else osd.get("base_optimizer_state")
    if not isinstance(base, dict) or "param_groups" not in base:
        raise CheckpointError(files[0], "corrupt: no optimizer state (param_groups)")
    ck.param_groups = [{k: v for k, v in g.items() if k != "params"} for g in base["param_groups"]]
    steps = {int(s["step"]) for s in base.get("state", {}).values() if "step" in s}
    ck.adam_step = max(steps) if steps else None
    ck.scaler = _scaler(osd.get("loss_scaler"))
    mod = ms.get("module") or {}
    dts = {t.dtype for n, t in mod.items() if torch.is_tensor(t) and n in {p.name for p in params}}
    ck.model_dtype = dts.pop() if len(dts) == 1 else None
    ck._module = mod
    return ck


def _read_universal(folder: str) -> DeepSpeedCheckpoint:
    """ds_to_universal's folder: ``mp_rank_00_model_states.pt``, ``zero/optimizer_state.pt``
    (param groups, loss scaler) and ``zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt`` (``{"param":
    the whole tensor, "cat_dim": 0}``), ``step.pt`` (an int): each param one piece."""
    model_file = os.path.join(folder, "mp_rank_00_model_states.pt")
    if not os.path.isfile(model_file):  # from stage 3: the model states of each rank, kept
        model_file = os.path.join(folder, "zero_pp_rank_0_mp_rank_00_model_states.pt")
    ms = safe_load(model_file)
    shapes = ms.get("param_shapes")
    if not isinstance(shapes, list) or not all(isinstance(d, dict) for d in shapes):
        raise CheckpointError(model_file, "corrupt: no param_shapes (a list of dicts)")
    of = os.path.join(folder, "zero", "optimizer_state.pt")
    osd = safe_load(of)
    params = [
        _Param(str(n), tuple(int(x) for x in sh), g, [(0, 0, math.prod(sh), 0)])
        for g, d in enumerate(shapes)
        for n, sh in d.items()
    ]
    step = None
    if params:
        sf = os.path.join(folder, "zero", params[0].name, "step.pt")
        if os.path.isfile(sf):
            step = _safe_any(sf)
            if isinstance(step, bool) or not isinstance(step, (int, float)):
                raise CheckpointError(sf, f"corrupt: step {step!r} is not a number")
    if step is None:  # from stage 3: Adam's step in the rank-0 optimizer state kept there
        inner = osd.get("optimizer_state_dict") or osd.get("base_optimizer_state") or {}
        steps = [st.get("step") for st in (inner.get("state") or {}).values()]
        steps = [int(x) for x in steps if isinstance(x, (int, float)) and not isinstance(x, bool)]
        step = max(steps) if steps else None
    groups = osd.get("param_groups")
    if not isinstance(groups, list):
        raise CheckpointError(of, "corrupt: no param_groups")
    mod = ms.get("module") or {}
    names = {p.name for p in params}
    dts = {t.dtype for n, t in mod.items() if torch.is_tensor(t) and n in names}
    return DeepSpeedCheckpoint(
        folder=folder,
        stage=int(osd.get("zero_stage", 0)),
        world_size=1,
        params=params,
        param_groups=[{k: v for k, v in g.items() if k != "params"} for g in groups],
        steps=int(ms.get("global_steps") or 0),
        adam_step=None if step is None else int(step),
        scaler=_scaler(osd.get("loss_scaler")),
        lr_scheduler=ms.get("lr_scheduler"),
        ds_config=ms.get("ds_config"),
        ds_version=ms.get("ds_version"),
        model_dtype=dts.pop() if len(dts) == 1 else None,
        optim_files=[of],
        model_file=model_file,
        universal=True,
        _module=mod,
    )


def _layout(ck: DeepSpeedCheckpoint, shapes: list[dict]) -> None:
    """Each param's saved pieces (see [Note: DeepSpeed checkpoints])."""
    W = ck.world_size
    for g in range(len(shapes)):
        ps = [p for p in ck.params if p.group == g]
        if ck.stage == 3:
            pos = 0
            for p in ps:
                chunk = -(-p.numel // W)
                for r in range(W):
                    a, b = min(r * chunk, p.numel), min((r + 1) * chunk, p.numel)
                    if b > a:
                        p.sources.append((r, a, b - a, pos))
                pos += chunk
            lens = {ck.flat(r, g, "fp32").numel() for r in range(W)}
            if any(n < pos for n in lens):
                raise CheckpointError(
                    ck.folder,
                    f"corrupt: group {g}'s flat is shorter than "
                    f"its params ({sorted(lens)} < {pos})",
                )
            continue
        o = ck.optim(0)
        pads = (o.get("param_alignment_paddings") or [[]] * (g + 1))[g]
        if any(int(x) for x in pads):
            raise NotImplementedError(
                f"{ck.optim_files[0]}: param_alignment_paddings {list(pads)} of group {g}: "
                "aligned params are not read here"
            )
        sizes = {ck.flat(r, g, "fp32").numel() for r in range(W)}
        if len(sizes) != 1:
            raise CheckpointError(
                ck.folder, f"corrupt: partitions of group {g} differ in size ({sorted(sizes)})"
            )
        size = sizes.pop()
        total = sum(p.numel for p in ps)
        if size * W < total:
            raise CheckpointError(
                ck.optim_files[0],
                f"corrupt: {W} partitions of {size} elements hold less than group {g}'s {total}",
            )
        start = 0
        for p in ps:
            for r in range(W):
                a, b = max(start, r * size), min(start + p.numel, (r + 1) * size)
                if b > a:
                    p.sources.append((r, a - start, b - a, a - r * size))
            start += p.numel
        _check_fragments(ck, g, ps, size)


def _check_fragments(ck: DeepSpeedCheckpoint, g: int, ps: list[_Param], size: int) -> None:
    """DeepSpeed's own map of rank 0's partition, where saved, agrees with the shapes'."""
    maps = ck.optim(0).get("param_slice_mappings")
    if not maps or len(maps) <= g:
        return
    mine = {p.name: (sn, pos) for p in ps for r, so, sn, pos in p.sources if r == 0}
    for name, frag in maps[g].items():
        got = (int(getattr(frag, "numel", -1)), int(getattr(frag, "start", -1)))
        if mine.get(name) != got:
            raise CheckpointError(
                ck.optim_files[0],
                f"unexpected layout: {name} at {tuple(frag)}, the shapes say {mine.get(name)}",
            )


def _scaler(s) -> dict:
    if not isinstance(s, _LossScaler):
        return {}
    d = vars(s)
    dynamic = bool(d.get("dynamic", False))
    out = {"loss_scale": float(d.get("cur_scale", 1.0)), "dynamic": dynamic, "growth_tracker": 0}
    if dynamic and "cur_iter" in d:
        since = int(d["cur_iter"]) - int(d.get("last_overflow_iter", -1)) - 1
        out["growth_tracker"] = max(0, since) % max(1, int(d.get("scale_window", 1000)))
    return out


# ---------------------------------------------------------------------------- loading
class _DSPlan(Plan):
    def where(self) -> str:
        return self.directory


class _DSReader:
    """What `_read_windows` reads (``rank-R`` names of the saved ranks' pieces) from a
    `DeepSpeedCheckpoint`: ``p`` the fp32 masters, ``s/<key>`` Adam's moments."""

    def __init__(self, ck: DeepSpeedCheckpoint):
        self.ck = ck
        self.pos = {(r, s, so): pos for s, p in enumerate(ck.params) for r, so, _, pos in p.sources}

    def range(self, file: str, name: str, a: int, b: int) -> torch.Tensor:
        r = int(file.removeprefix("rank-").removesuffix(".safetensors"))
        kind, s, so, *key = name.split("/")
        s, so = int(s), int(so)
        k = "fp32" if kind == "p" else key[0]
        pos = self.pos[(r, s, so)]
        return self.ck.holder(r, self.ck.params[s], k)[pos + a : pos + b]

    def tensor(self, file: str, name: str) -> torch.Tensor:
        if file == MODEL_FILE:
            return self.ck.module_tensor(name)
        if name.endswith("/step"):
            return torch.tensor(float(self.ck.adam_step or 0), dtype=torch.float32)
        raise KeyError(name)


_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad")


def _plan(ck: DeepSpeedCheckpoint, ad: Adapter) -> _DSPlan:
    where = ck.model_file
    saved = {}
    for s, p in enumerate(ck.params):
        schema = None
        if ck.adam_step is not None:
            schema = {
                "elem": {"exp_avg": "float32", "exp_avg_sq": "float32"},
                "tensor": {"step": {"dtype": "float32", "shape": []}},
                "value": {},
            }
        saved[p.name] = {
            "index": s,
            "name": p.name,
            "shape": list(p.shape),
            "group": p.group,
            "dtype": "float32",
            "state": schema,
        }
    mine = {q["name"]: q for q in ad.table}
    for name, q in mine.items():
        sp = saved.get(name)
        if sp is None:
            raise CheckpointError(where, f"incompatible model: param {name} is not in it")
        if sp["shape"] != list(q["shape"]):
            raise CheckpointError(
                where,
                f"incompatible model: param {name} has shape "
                f"{tuple(q['shape'])} here, {tuple(sp['shape'])} there",
            )
        if sp["group"] != q["group"]:
            raise CheckpointError(
                where,
                f"incompatible optimizer: param {name} is in param "
                f"group {q['group']} here, {sp['group']} there",
            )
    extra = sorted(set(saved) - set(mine))
    if extra:
        raise CheckpointError(
            where, f"incompatible model: it has no param {extra[0]} ({len(extra)} missing)"
        )
    if len(ck.param_groups) != len(ad.optimizer.param_groups):
        raise CheckpointError(
            where,
            f"incompatible optimizer: {len(ck.param_groups)} param "
            f"groups saved, {len(ad.optimizer.param_groups)} here",
        )
    names = set(ck.module_names())
    model_tensors = {}
    for name in ad.model_entries():
        if name not in saved and name not in names:
            raise CheckpointError(where, f"incompatible model: {name} is not in the checkpoint")
        if name in names:
            model_tensors[name] = {"shape": list(ck.module_tensor(name).shape)}
    for g in ck.param_groups:
        if g.get("bias_correction", True) is not True:
            raise NotImplementedError(f"{where}: bias_correction=False (torch's Adam corrects)")
    sources = {
        s: sorted((r, so, sn) for r, so, sn, _ in p.sources) for s, p in enumerate(ck.params)
    }
    meta = {"model": {"values": {}}, "steps": ck.steps, "world_size": ck.world_size}
    return _DSPlan(ck.folder, meta, saved, sources, model_tensors)


def load_deepspeed_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler=None,
) -> dict:
    """Load DeepSpeed checkpoint ``path`` (``global_stepN/`` or the folder with its ``latest``)
    into ``model`` and ``optimizer`` (a `ZeroOptimizer` of any stage and world size, or a plain
    torch Adam/AdamW) and the position of torch LR ``scheduler``. Collective. Returns what else
    the checkpoint says: ``{"global_steps", "ds_config", "ds_version", "stage",
    "world_size"}``. Raises `CheckpointError` (on every rank) naming the file. See [Note:
    DeepSpeed checkpoints]."""
    ad = adapter_for(model, optimizer)
    ctl = control_for(ad, os.fspath(path), "load")
    ctl.arrive("load_deepspeed_checkpoint")

    def plan():
        ck = read_deepspeed_checkpoint(path)
        return ck, _plan(ck, ad)

    ck, pl = _agree(ctl, plan, "reading the DeepSpeed checkpoint")
    rd = _DSReader(ck)
    _agree(ctl, lambda: _read_windows(pl, ad, rd), "reading the pieces")
    groups = []
    for here, g in zip(ad.optimizer.param_groups, ck.param_groups):
        h = {k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k in _HYPER}
        groups.append({k: v for k, v in h.items() if k in here})
    ad.finish_install(groups, {"steps": ck.steps, "scaler": ck.scaler})
    with ad.frozen_whole(write=True):
        _load_model_state(pl, ad, rd)
    if scheduler is not None and ck.lr_scheduler:
        _set_scheduler(scheduler, ck, ad.optimizer)
    return {
        "global_steps": ck.steps,
        "ds_config": ck.ds_config,
        "ds_version": ck.ds_version,
        "stage": ck.stage,
        "world_size": ck.world_size,
    }


def _set_scheduler(scheduler, ck: DeepSpeedCheckpoint, optimizer) -> None:
    it = ck.lr_scheduler.get("last_batch_iteration")
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(
            f"scheduler must be a torch LRScheduler, got {type(scheduler).__name__} (DeepSpeed's "
            "position is set as its last_epoch)"
        )
    if not isinstance(it, int):
        raise CheckpointError(ck.model_file, f"lr_scheduler={ck.lr_scheduler!r}: no iteration")
    scheduler.last_epoch = it + 1
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]  # noqa: SLF001 - torch's


def inspect_deepspeed_checkpoint(path) -> dict:
    """What ``zero-kernels checkpoint inspect`` shows of a DeepSpeed checkpoint (no data read)."""
    ck = read_deepspeed_checkpoint(path)
    files = {n: os.path.getsize(os.path.join(ck.folder, n)) for n in sorted(os.listdir(ck.folder))}
    return {
        "format": "deepspeed",
        "path": ck.folder,
        "ds_version": ck.ds_version,
        "stage": ck.stage,
        "world_size": ck.world_size,
        "global_steps": ck.steps,
        "adam_step": ck.adam_step,
        "params": len(ck.params),
        "param_numel": sum(p.numel for p in ck.params),
        "model_dtype": str(ck.model_dtype).removeprefix("torch."),
        "param_groups": ck.param_groups,
        "loss_scaler": ck.scaler,
        "lr_scheduler": ck.lr_scheduler,
        "buffers": [n for n in ck.module_names() if n not in {p.name for p in ck.params}],
        "files": files,
        "bytes": sum(files.values()),
    }
