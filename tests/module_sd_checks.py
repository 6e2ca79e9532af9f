"""``state_dict()`` and ``load_state_dict()`` of a module inside the model, at stages 1-3 (spawned
gloo ranks; [Note: module state dicts] in zero_kernels/param_access.py)."""

from __future__ import annotations

import torch
from dist_utils import run_checks
from frozen_checks import LoraNet, _batch, _loss

from zero_kernels import ZeroOptimizer

CASES = {  # name: (stage, shard_frozen, dtype)
    "stage 1 bf16": (1, False, torch.bfloat16),
    "stage 2 bf16": (2, False, torch.bfloat16),
    "stage 3 fp32": (3, False, torch.float32),
    "stage 3 bf16": (3, False, torch.bfloat16),
    "stage 3 shard_frozen": (3, True, torch.float32),
}
PARTS = ("blocks.1", "blocks.1.up", "blocks", "blocks.2", "head")  # in a unit, units, root


def _sub(model, path: str):
    m = model
    for k in path.split("."):
        m = m[int(k)] if k.isdigit() else getattr(m, k)
    return m


def check_module_state_dicts(rank: int, world: int) -> dict:
    """A module's state_dict() holds whole values (what the model's own state_dict() holds
    under its prefix; at stage 3 they read NaN before, a placeholder per sharded param), and
    its load_state_dict() reaches the params, the shards and the fp32 masters: a step with
    lr=0 after it keeps the loaded values (stage 3 raised torch's copy error into a sharded
    param before; stages 1/2 with bf16 params put the old masters back at the next step)."""
    out = {}
    for name, (stage, shard_frozen, dtype) in CASES.items():
        torch.manual_seed(0)
        m = LoraNet().to(dtype)
        kw = {"shard_frozen": True} if shard_frozen else {}
        zo = ZeroOptimizer(
            [p for p in m.parameters() if p.requires_grad],
            torch.optim.AdamW,
            stage=stage,
            module=m,
            lr=1e-2,
            weight_decay=0.0,
            **kw,
        )
        x, y = _batch(rank, 0)
        _loss(m, x, y).float().backward()
        zo.step()
        zo.zero_grad()
        whole = m.state_dict()
        for path in PARTS:
            sd = _sub(m, path).state_dict()
            want = {k[len(path) + 1 :]: v for k, v in whole.items() if k.startswith(path + ".")}
            assert sd.keys() == want.keys(), (name, path, sorted(sd), sorted(want))
            for k, v in sd.items():
                assert torch.equal(v, want[k]) and not v.isnan().any(), (name, path, k)
        g = torch.Generator().manual_seed(5)
        new = {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in whole.items()}
        block = {k[len("blocks.1.") :]: v for k, v in new.items() if k.startswith("blocks.1.")}
        _sub(m, "blocks.1").load_state_dict(block)
        for group in zo.param_groups:
            group["lr"] = 0.0
        _loss(m, x, y).float().backward()
        zo.step()
        zo.zero_grad()
        after = m.state_dict()
        for k, v in block.items():
            assert torch.equal(after["blocks.1." + k], v), (name, k)
        zo.close()
        out[name] = "ok"
    return out


def worker(rank: int, world: int) -> dict:
    return run_checks(rank, world, [check_module_state_dicts])
