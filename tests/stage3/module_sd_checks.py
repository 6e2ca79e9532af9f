"""``state_dict()`` and ``load_state_dict()`` of a module inside the model, at stages 1-3 (spawned
gloo ranks; [Note: module state dicts] in zero_kernels/optimizer/param_access.py)."""

from __future__ import annotations

import torch
from dist_utils import run_checks
from frozen_checks import LoraNet, _batch, _loss
from torch import nn
from zero_opt import zero_opt

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
        zo = zero_opt(
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


class _Raising(nn.Module):
    """Extra state whose save or load raises while ``boom`` is set."""

    def __init__(self):
        super().__init__()
        self.boom = False

    def get_extra_state(self):
        if self.boom:
            raise RuntimeError("boom in get_extra_state")
        return {"v": 1}

    def set_extra_state(self, state):
        if self.boom:
            raise RuntimeError("boom in set_extra_state")


def check_after_a_raise(rank: int, world: int) -> dict:
    """A module's state_dict() / load_state_dict() that raised midway leaves nothing behind: the
    next call on a module inside it does its own work (it was taken for a call nested in the
    one that raised: its state dict read NaN at stage 3, its load was lost at the next step).
    Also: load_state_dict(assign=True) is refused at the load, and keep_vars=True at stages 1/2
    gives the Parameters, as torch does."""
    out = {}
    for stage, dtype in ((1, torch.bfloat16), (2, torch.bfloat16), (3, torch.float32)):
        torch.manual_seed(0)
        m = LoraNet().to(dtype)
        m.blocks[1].probe = _Raising()
        zo = ZeroOptimizer(
            [p for p in m.parameters() if p.requires_grad],
            torch.optim.AdamW,
            stage=stage,
            module=m,
            lr=0.0,
            weight_decay=0.0,
        )
        x, y = _batch(rank, 0)
        _loss(m, x, y).float().backward()
        zo.step()
        zo.zero_grad()
        saved = m.blocks.state_dict()
        m.blocks[1].probe.boom = True
        for call in (m.blocks.state_dict, m.blocks.load_state_dict):
            try:
                call(saved) if call == m.blocks.load_state_dict else call()
                raise AssertionError("the call did not raise")
            except RuntimeError as e:
                assert "boom" in str(e), e
        m.blocks[1].probe.boom = False
        sd = m.blocks[1].up.state_dict()
        assert not any(v.isnan().any() for v in sd.values()), (stage, "NaN after a raise")
        new = {k: torch.full_like(v, 0.5) for k, v in sd.items()}
        m.blocks[1].up.load_state_dict(new)
        _loss(m, x, y).float().backward()
        zo.step()
        zo.zero_grad()
        got = m.blocks[1].up.state_dict()
        assert all(torch.equal(got[k], v) for k, v in new.items()), (stage, "load lost")
        try:
            m.head.load_state_dict(m.head.state_dict(), assign=True)
            raise AssertionError("assign=True was accepted")
        except RuntimeError as e:
            assert "assign=True" in str(e), e
        if stage != 3:
            kv = m.blocks[1].up.state_dict(keep_vars=True)
            assert kv["A.weight"] is m.blocks[1].up.A.weight, stage
        zo.close()
        out[f"stage {stage}"] = "ok"
    return out


def worker(rank: int, world: int) -> dict:
    return run_checks(rank, world, [check_module_state_dicts, check_after_a_raise])
