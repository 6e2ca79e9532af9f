"""`convert_deepspeed_checkpoint`: a DeepSpeed checkpoint folder written as ours, param by param
(bounded memory: [Note: DeepSpeed checkpoints] in `zero_kernels.checkpoint.deepspeed`, which
reads the folder)."""

from __future__ import annotations

import os

import torch

from ..layout import ParamSpec, build_layout, pieces
from .deepspeed import _HYPER, DeepSpeedCheckpoint, read_deepspeed_checkpoint
from .format import FORMAT, MODEL_FILE, encode, rank_file
from .save import _commit, _prepare
from .storage import Entry, write_safetensors

__all__ = ["convert_deepspeed_checkpoint"]


# ---------------------------------------------------------------------------- converting
def convert_deepspeed_checkpoint(src, dst) -> str:
    """Write DeepSpeed checkpoint ``src`` as a checkpoint of ours under root ``dst`` (named
    for its global step; one rank file, world size 1: it loads at any world size and stage),
    streamed param by param: beyond the file pages the OS maps in, the memory held is one
    param's master or moment at a time. Returns the checkpoint's directory. No process group."""
    ck = read_deepspeed_checkpoint(src)
    root = os.path.abspath(os.fspath(dst))
    name, tmp = _prepare(root, ck.steps)
    try:
        return _commit(root, name, tmp, _converted_meta(ck, name), [("ok", _write(ck, tmp))], None)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write(ck: DeepSpeedCheckpoint, tmp: str) -> dict:
    layout = build_layout(_specs(ck), 1, bucket_numel=1 << 22, mode="flat")
    entries: list[Entry] = []
    schema = {}
    mine = [pc for buf in pieces(layout, 0) for pc in buf]
    # Two buffers of the largest piece, taken in turn: an entry is read into one while the
    # writer may still hash the last chunk of the one before (held in the other). The memory
    # is bounded by design, not by how the allocator returns freed blocks.
    most = max((pc.numel for pc in mine), default=0)
    bufs, turn = [torch.empty(most), torch.empty(most)], [0]

    def into(p, key, pc):
        turn[0] ^= 1
        return (ck.read(p, key, pc.offset, pc.numel, bufs[turn[0]]),)

    for pc in mine:
        p = ck.params[pc.index]

        def lazy(key, p=p, pc=pc):
            return lambda: into(p, key, pc)

        entries.append(Entry(f"p/{pc.index}/{pc.offset}", torch.float32, (pc.numel,), lazy("fp32")))
        if ck.adam_step is None:
            continue
        for k in ("exp_avg", "exp_avg_sq"):
            entries.append(
                Entry(f"s/{pc.index}/{pc.offset}/{k}", torch.float32, (pc.numel,), lazy(k))
            )
        if pc.offset == 0:
            entries.append(Entry.of(f"o/{pc.index}/step", torch.tensor(float(ck.adam_step))))
            schema[pc.index] = {
                "elem": {"exp_avg": "float32", "exp_avg_sq": "float32"},
                "tensor": {"step": {"dtype": "float32", "shape": []}},
                "value": {},
            }
    # DeepSpeed saves no RNG states: a new generator's, so that a load has one to set
    entries.append(Entry.of("rng/torch", torch.Generator().get_state()))
    files = {}
    f0 = rank_file(0)
    meta = {"format": FORMAT, "format_version": "1", "rank": "0", "world_size": "1", "rng": "{}"}
    files[f0] = {"rank": 0, **write_safetensors(os.path.join(tmp, f0), entries, meta)}
    names = {p.name for p in ck.params}
    model = {n: ck.module_tensor(n) for n in ck.module_names() if n not in names}
    files[MODEL_FILE] = {
        "rank": 0,
        **write_safetensors(
            os.path.join(tmp, MODEL_FILE),
            [Entry.of(n, t) for n, t in model.items()],
            {"format": FORMAT, "format_version": "1"},
        ),
    }
    table = [
        {
            "index": s,
            "name": p.name,
            "shape": list(p.shape),
            "dtype": str(ck.model_dtype or torch.float32).removeprefix("torch."),
            "group": p.group,
        }
        for s, p in enumerate(ck.params)
    ]
    model_meta = {
        "tensors": {
            n: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
            for n, t in model.items()
        },
        "values": {},
    }
    return {"files": files, "schema": schema, "version": 1, "model": model_meta, "params": table}


def _specs(ck: DeepSpeedCheckpoint) -> list[ParamSpec]:
    dt = str(ck.model_dtype or torch.float32)
    return [ParamSpec(s, p.group, dt, p.shape, p.name, True) for s, p in enumerate(ck.params)]


def _converted_meta(ck: DeepSpeedCheckpoint, name: str) -> dict:
    import time

    from .._version import __version__

    layout = build_layout(_specs(ck), 1, bucket_numel=1 << 22, mode="flat")
    groups = [
        {k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k in _HYPER}
        for g in ck.param_groups
    ]
    sched = None
    if ck.lr_scheduler and isinstance(ck.lr_scheduler.get("last_batch_iteration"), int):
        it = ck.lr_scheduler["last_batch_iteration"]
        sched = {  # what torch's LRScheduler.load_state_dict takes (see _set_scheduler)
            "last_epoch": it + 1,
            "_step_count": it + 2,
            "_last_lr": [g.get("lr") for g in ck.param_groups],
            "lr_lambdas": [None] * len(ck.param_groups),
        }
    opt = (ck.ds_config or {}).get("optimizer") or {}
    adam = str(opt.get("type", "AdamW")).lower() == "adam" and not (opt.get("params") or {}).get(
        "adam_w_mode", True
    )
    return {
        "format": FORMAT,
        "format_version": 1,
        "name": name,
        "created_ns": time.time_ns(),
        "zero_kernels_version": __version__,
        "torch_version": torch.__version__,
        "world_size": 1,
        "stage": 0,
        "mode": "flat",
        "optimizer_class": "torch.optim.adam.Adam" if adam else "torch.optim.adamw.AdamW",
        "layout": layout.to_dict(),
        "param_groups": encode(groups, "param_groups"),
        "group_params": [
            [s for s, p in enumerate(ck.params) if p.group == g] for g in range(len(groups))
        ],
        "scheduler": encode(sched, "scheduler state") if sched else None,
        "scaler": ck.scaler,
        "steps": ck.steps,
        "extra": encode(
            {"converted_from": ck.folder, "ds_version": ck.ds_version, "step": ck.steps}, "extra"
        ),
    }
