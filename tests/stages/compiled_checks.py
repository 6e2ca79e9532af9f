"""Checks run in spawned gloo ranks by tests/stages/test_compiled_autograd.py."""

from __future__ import annotations

import copy

from numerics import rel_err
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zero_opt import zero_opt

from zero_kernels import ZeroOptimizer


def check_compiled_autograd(rank: int, world: int) -> dict:
    """torch.compile'd model + compiled autograd: stages 1/2 give DDP's result (the gradient
    hooks run eagerly at graph breaks), stage 3 refuses with a clear error."""
    import torch._dynamo
    import torch._dynamo.compiled_autograd as ca
    from torch._dynamo.utils import counters

    enable = getattr(ca, "_enable", None) or ca.enable
    out = {}
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))

    def train(stage: int):
        m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
        zo = zero_opt(m1, torch.optim.AdamW, stage=stage, lr=1e-2, bucket_size_mb=0.0005)
        ddp = DDP(m2)
        ref = torch.optim.AdamW(m2.parameters(), lr=1e-2)
        c1 = torch.compile(m1, backend="aot_eager")
        try:
            for step in range(3):
                x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 10 + rank))
                with enable(torch.compile(backend="aot_eager")):
                    c1(x).pow(2).mean().backward()
                zo.clip_grad_norm_(0.05)
                zo.step()
                zo.zero_grad()
                ddp(x).pow(2).mean().backward()
                torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.05)
                ref.step()
                ref.zero_grad()
            return max(rel_err(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
        finally:
            zo.close()

    for stage in (1, 2):
        torch._dynamo.reset()
        counters.clear()
        err = train(stage)
        assert counters["compiled_autograd"], "compiled autograd did not run"
        assert err <= 1e-6, (stage, err)
        out[f"stage {stage}"] = "ok"
    # stage 3: refused at the first forward when the config flag is on; with compiled autograd
    # switched on around backward only, autograd's own error (never a silent wrong result)
    torch._dynamo.reset()
    m = copy.deepcopy(base)
    zo = ZeroOptimizer(m, torch.optim.AdamW, stage=3, lr=1e-2)
    try:
        with torch._dynamo.config.patch(compiled_autograd=True):
            m(torch.randn(8, 16))
        raise AssertionError("stage 3 ran a forward with compiled autograd on")
    except RuntimeError as e:
        assert "compiled autograd" in str(e) and "stage 1 or 2" in str(e), str(e)
    zo.close()
    try:
        train(3)
        raise AssertionError("stage 3 under compiled autograd gave no error")
    except RuntimeError as e:
        out["stage 3"] = "refused" if "stage 1 or 2" in str(e) else "autograd error"
    return out


def check_compiled_forward_hooks(rank: int, world: int) -> dict:
    """torch.compile (compiled autograd off) with the forward hooks of stage 3 and of
    ``overlap_param_gather``: the whole model or each unit compiled, resharding on and off,
    activation checkpointing; DDP's result, and the hooks stay out of the graphs ([Note:
    torch.compile] in zero_kernels/partition/units.py): each compiled frame is traced once,
    whatever the step, and breaks only at the hooks."""
    import torch
    import torch._dynamo
    from stage3_checks import Net3, _batch, _loss, _Null, assert_params_close
    from torch._dynamo.utils import counters

    out = {}
    s3 = {"stage": 3}
    cases = {  # name: (optimizer kwargs, what is compiled, checkpointing, backend, tolerance)
        "stage 3 model": (s3, "model", None, "aot_eager", 1e-6),
        "stage 3 model no reshard": (
            {**s3, "reshard_after_forward": False},
            "model",
            None,
            "aot_eager",
            1e-6,
        ),
        "stage 3 units": (s3, "units", None, "aot_eager", 1e-6),
        "stage 3 units checkpoint": (s3, "units", "plain", "aot_eager", 1e-6),
        "stage 3 model inductor": (s3, "model", None, "inductor", 1e-5),
        "stage 3 units autocast": (s3, "units", None, "aot_eager", 1e-6),
        "stage 1 model": ({"stage": 1}, "model", None, "aot_eager", 1e-6),
        "stage 1 model autocast": ({"stage": 1}, "model", None, "aot_eager", 1e-6),
        "stage 2 overlap_param_gather": (
            {"stage": 2, "overlap_param_gather": True, "bucket_size_mb": 0.001},
            "model",
            None,
            "aot_eager",
            1e-6,
        ),
    }
    for name, (zkw, what, ck, backend, tol) in cases.items():
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        base = Net3()
        base.ckpt = ck
        m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
        kw = {"lr": 1e-2, "weight_decay": 0.1}
        zo = zero_opt(m1, torch.optim.AdamW, **zkw, **kw)
        ddp = DDP(m2, find_unused_parameters=True)
        ref = torch.optim.AdamW(m2.parameters(), **kw)
        if what == "model":
            run = torch.compile(m1, backend=backend)
        else:
            for b in m1.blocks:
                b.compile(backend=backend)
            run = m1
        graphs = []
        cast = torch.autocast("cpu", dtype=torch.bfloat16) if "autocast" in name else _Null()
        for step in range(4):
            x, y = _batch(rank, step)
            with cast:
                loss = _loss(run(x), y)
            loss.backward()
            zo.step()
            zo.zero_grad()
            with cast:
                loss = _loss(ddp(x), y)
            loss.backward()
            ref.step()
            ref.zero_grad()
            graphs.append(counters["stats"]["unique_graphs"])
        if zkw["stage"] == 3:
            assert_params_close(zo, m1, m2, tol, name)
        else:
            zo.wait_params()
            for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
                assert rel_err(a, b) <= tol, f"{name}: {n} {rel_err(a, b):.3g}"
        assert graphs[0] >= 1, f"{name}: nothing was compiled ({dict(counters['stats'])})"
        assert graphs[-1] == graphs[0], f"{name}: recompiled after the first step: {graphs}"
        assert not counters["recompiles"], f"{name}: {dict(counters['recompiles'])}"
        for reason in counters["graph_break"]:
            assert "torch.compiler.disable" in reason, f"{name}: graph break: {reason}"
        zo.close()
        out[name] = "ok"
    return out
