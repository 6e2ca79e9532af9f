"""Host work per step: what the step reads back from the device and copies to it.

- Loss scaling, nonfinite="skip"/"raise" and torch's GradScaler decide on the host whether to
  step: one host read per step, not one per shard or piece ([Note: no host sync] in
  zero_kernels/partition/syncfree.py), counted with the device-side forms switched on for CPU
  tensors at world size 8 on torch's fake group (bench/gpu_check.sh runs clip + step under
  ``torch.cuda.set_sync_debug_mode`` with CUDA tensors).
- The int8 state's block tables are made once, not rebuilt or re-checked every step.
- ``consolidated_state_dict`` hands the object collective host tensors only."""

import functools
import pathlib

import pytest
from fake_group import run_fake_many

TESTS = str(pathlib.Path(__file__).parent)
READ_CASES = [("fp16", 1), ("fp16", 3), ("skip", 2), ("raise", 1), ("scaler", 1), ("scaler", 2)]

READS = """
import sys
sys.path.insert(0, {tests!r})
from syncfree_checks import host_reads, _step_counters
from torch import nn
from zero_kernels import ZeroOptimizer, ZeroPolicy

torch.manual_seed(0)
mode = {mode!r}
m = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
kw = dict(stage={stage}, bucket_size_mb=0.0005)
if mode == "fp16":
    m = m.half()
    kw["loss_scale"] = "dynamic"
elif mode in ("skip", "raise"):
    kw["nonfinite"] = mode
units = [nn.Linear] if {stage} == 3 else None
pol = ZeroPolicy.resolve(**kw)
zo = ZeroOptimizer(m, torch.optim.AdamW, policy=pol, units=units, lr=1e-2)
zo.parts.core.sync_free = True  # the device-side forms, as on a GPU
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if mode == "scaler" else None
per_step = []
for step in range(4):
    zo.zero_grad()
    x = torch.randn(4, 16, dtype=next(m.parameters()).dtype)
    loss = m(x).float().pow(2).mean()
    if scaler is not None:
        scaler.scale(loss).backward()
    else:
        zo.scale_loss(loss).backward()
    with host_reads(_step_counters(zo)) as seen:
        if scaler is not None:
            scaler.unscale_(zo)
            zo.clip_grad_norm_(1.0)
            scaler.step(zo)
            scaler.update()
        else:
            zo.clip_grad_norm_(1.0)
            zo.step()
    if step >= 1:
        per_step.append(seen)
print(json.dumps(dict(reads=per_step, shards=len(zo.parts.core.grads.shard_tensors()))))
"""


@pytest.mark.parametrize("mode,stage", READ_CASES)
def test_one_host_read_per_step(mode, stage):
    r = _cases()[("reads", mode, stage)]
    assert r["shards"] > 1 or stage > 1, r  # several shards: a read per shard would show
    for seen in r["reads"]:
        assert len(seen) <= 1, r["reads"]


INT8 = """
import sys
sys.path.insert(0, {tests!r})
from syncfree_checks import host_reads, _step_counters
from torch import nn
from zero_kernels import ZeroOptimizer, ZeroPolicy
from zero_kernels.ops import lowbit

torch.manual_seed(0)
m = nn.Sequential(*[nn.Linear(40, 40) for _ in range(4)])
pol = ZeroPolicy.resolve(stage={stage}, state_dtype="int8", state_block=64, bucket_size_mb=0.004)
zo = ZeroOptimizer(m, torch.optim.AdamW, policy=pol, lr=1e-2)
zo.parts.core.sync_free = True
tables = []
kernel = lowbit.adam_step_lowbit

def spy(*a, block_starts=None, **k):
    tables[-1].append(block_starts)
    return kernel(*a, block_starts=block_starts, **k)

lowbit.adam_step_lowbit = spy
diffs = []
per_step = []
for step in range(3):
    zo.zero_grad()
    m(torch.randn(4, 40)).pow(2).mean().backward()
    tables.append([])
    with host_reads(_step_counters(zo)) as seen:
        zo.step()
    per_step.append(seen)
ids = [[id(t) for t in ts] for ts in tables]
print(json.dumps(dict(ids=ids, reads=per_step[1:], tables=len(tables[0]),
                      cpu=all(t.device.type == "cpu" for ts in tables for t in ts))))
"""


@pytest.mark.parametrize("stage", [1, 2])
def test_int8_state_block_tables_made_and_checked_once(stage):
    """The block tables the int8 step passes are the same tensors every step, made and
    checked once: later steps build nothing and read nothing on the host (on a GPU they are
    pinned, so the binding's copy to the device is queued, not waited for)."""
    r = _cases()[("int8", stage)]
    assert r["tables"] >= 2 and r["cpu"], r
    assert r["ids"][0] == r["ids"][1] == r["ids"][2], r["ids"]
    assert r["reads"] == [[], []], r["reads"]


PAYLOAD = """
from torch import nn
from zero_kernels import CommPolicy, ZeroOptimizer, comm
from zero_kernels.partition import state

torch.manual_seed(0)
m = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)).to(torch.bfloat16)
zo = ZeroOptimizer(m, torch.optim.AdamW, stage=2, lr=1e-2, comm=CommPolicy(bucket_size_mb=0.0005))
m(torch.randn(4, 16, dtype=torch.bfloat16)).float().pow(2).mean().backward()
zo.step()
moved, sent = set(), []
to_host = state.to_host

def spy(v):
    out = to_host(v)
    moved.add(id(out))
    return out

state.to_host = spy
gather = comm.gather_object

def record(obj, dst, **kw):
    sent.append(obj)
    return gather(obj, dst, **kw)

comm.gather_object = record
sd = zo.consolidated_state_dict()

def tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from tensors(v)

ts = [t for obj in sent for t in tensors(obj)]
print(json.dumps(dict(sent=len(sent), tensors=len(ts), cpu=all(t.device.type == "cpu" for t in ts),
                      moved=all(id(t) in moved for t in ts),
                      keys=sorted(next(iter(sd["state"].values()))))))
"""


def test_consolidated_state_sends_host_tensors():
    """What ``consolidated_state_dict`` hands ``gather_object`` holds host copies only (each
    tensor made by ``to_host``): pickled CUDA tensors would be unpickled on rank 0 onto the
    devices of the ranks that sent them."""
    r = _cases()[("payload",)]
    assert r["sent"] == 1 and r["tensors"] > 0, r
    assert r["cpu"] and r["moved"], r
    assert r["keys"] == ["exp_avg", "exp_avg_sq", "fp32_master", "step"], r


@functools.cache
def _cases() -> dict:
    """Every case of this file in one process on the fake group (`run_fake_many`): the read
    counts first, then the int8 tables (their spy stays on the kernel), then the payload (its
    spies stay on comm and partition.state)."""
    keys = [("reads", m, s) for m, s in READ_CASES] + [("int8", 1), ("int8", 2), ("payload",)]
    codes = [READS.format(tests=TESTS, mode=m, stage=s) for m, s in READ_CASES]
    codes += [INT8.format(tests=TESTS, stage=s) for s in (1, 2)] + [PAYLOAD]
    return dict(zip(keys, run_fake_many(codes), strict=True))
