"""Stage 3 (issue 7): parity with DDP in the hard cases, memory and collectives per unit, meta
construction, ranks that disagree (spawned gloo ranks), and bad input (in-process)."""

import contextlib
import copy
import warnings

import pytest
import stage3_checks
import torch
import zero_checks
from dist_utils import SharedRun, run_checks, run_workers
from numerics import rel_err
from torch import nn
from zero_opt import zero_opt

from zero_kernels import ZeroOptimizer


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_stage3(world):
    rep = run_workers(stage3_checks.stage3_all, world, timeout=600)[0]
    assert rep["plain"] == rep["meta stage=3"] == "ok", rep
    if world <= 3:
        assert rep["check_order first"] == "ok", rep


def _parity3(rank, world):
    return zero_checks.check_parity(rank, world, stages=(3,))


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_stage3_every_optimizer(world):
    rep = run_workers(_parity3, world, timeout=600)[0]
    modes = {k.split()[0]: v[2] for k, v in rep.items()}
    assert modes["Adafactor"] == modes["Muon"] == "whole" and modes["AdamW"] == "flat"


def test_stage3_bad_input():
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="stage=3 needs the model"):
        ZeroOptimizer(m.parameters(), torch.optim.SGD, stage=3, lr=0.1)
    with pytest.raises(ValueError, match="units= is a stage-3 option"):
        ZeroOptimizer(m, torch.optim.SGD, stage=2, units=[nn.Linear], lr=0.1)
    with pytest.raises(ValueError, match="prefetch"):
        zero_opt(m, torch.optim.SGD, stage=3, prefetch=-1, lr=0.1)
    with pytest.raises(ValueError, match="matched no submodule"):
        ZeroOptimizer(m, torch.optim.SGD, stage=3, units=[nn.Conv2d], lr=0.1)
    nested = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="overlap"):
        ZeroOptimizer(nested, torch.optim.SGD, stage=3, units=[nested[0], nested[0][0]], lr=0.1)
    with pytest.raises(ValueError, match="not the model"):
        ZeroOptimizer(m, torch.optim.SGD, stage=3, units=[m], lr=0.1)
    with pytest.raises(TypeError, match="units must be"):
        ZeroOptimizer(m, torch.optim.SGD, stage=3, units="blocks", lr=0.1)
    with pytest.raises(ValueError, match="check_order='always'"):
        zero_opt(m, torch.optim.SGD, stage=3, check_order="always", lr=0.1)
    with pytest.raises(ValueError, match="check_order= is a stage-3 option"):
        zero_opt(m, torch.optim.SGD, stage=2, check_order="every", lr=0.1)
    # param groups first and module= (accepted at every stage)
    zo = ZeroOptimizer([{"params": m.parameters()}], torch.optim.SGD, stage=3, module=m, lr=0.1)
    zo.close()


def test_stage3_params_between_uses_read_as_nan():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ref = [p.detach().clone() for p in m.parameters()]
    zo = ZeroOptimizer(m, torch.optim.SGD, stage=3, units=[nn.Linear], lr=0.1)
    assert all(torch.isnan(p).all() for p in m.parameters())  # never plausible values
    with zo.gathered_params():
        assert all(torch.equal(p, r) for p, r in zip(m.parameters(), ref))
    with zo.gathered_params(m[0], modifier_rank=0):
        with torch.no_grad():
            m[0].weight.fill_(2.0)
    assert torch.equal(zo.full_param(m[0].weight), torch.full((4, 4), 2.0))
    out = m(torch.ones(1, 4))  # a forward gathers and frees
    assert not torch.isnan(out).any()
    zo.close()
    assert torch.equal(m[0].weight, torch.full((4, 4), 2.0))  # whole plain tensors again


def test_stage3_root_module_outside_forward_raises():
    """A module whose params are in the root unit, called outside the model's forward, raises
    (its params would read as NaN); units gather themselves; gathered_params() allows it."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.head = nn.Linear(4, 3)

        def forward(self, x):
            h = self.emb(x)
            for b in self.blocks:
                h = b(h)
            return self.head(h)

    torch.manual_seed(0)
    m = Net()
    ref = Net()
    ref.load_state_dict(m.state_dict())
    zo = ZeroOptimizer(m, torch.optim.SGD, stage=3, lr=0.1)
    x = torch.tensor([[1, 2, 3]])
    with pytest.raises(RuntimeError, match="module 'emb' was called outside the model's forward"):
        m.emb(x)
    h = ref.emb(x)
    torch.testing.assert_close(m.blocks[1](h), ref.blocks[1](h))  # a unit gathers itself
    with pytest.raises(RuntimeError, match="module 'head' was called outside"):
        m.head(h)
    with zo.gathered_params(m.head):
        torch.testing.assert_close(m.head(h), ref.head(h))
    torch.testing.assert_close(m(x), ref(x))
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref(x))
    zo.close()
    m.head(h)  # plain params again


def test_stage3_meta_params_built_in_their_buckets(monkeypatch):
    """A meta model's unit params are initialised straight into the unit's gathered bucket (no
    whole copy of them allocated apart, which fragmented glibc's heap), and the fused Adam state
    is one tensor per buffer and name, each bucket's a view of it (per-bucket tensors, made at
    the first step among its transients, pinned holes in the heap)."""
    import zero_kernels.optimizer.build as pa

    seen = []  # per unit: (params given memory by `storage`, params of the unit allocated apart)

    def spy(named, device, seed=0, init_fn=None, storage=None):
        named = list(named)
        metas = [p for _, mod in named for p in mod.parameters(recurse=False) if p.is_meta]
        real(named, device, seed, init_fn, storage)
        if storage is not None:
            inside = [p for p in metas if p.data_ptr() == storage.get(id(p), p).data_ptr()]
            seen.append((len(inside), len(metas) - len(inside)))

    real = pa.materialize_modules_
    monkeypatch.setattr(pa, "materialize_modules_", spy)
    with torch.device("meta"):
        m = nn.Sequential(*(nn.Linear(16, 16) for _ in range(3)))
    zo = ZeroOptimizer(m, torch.optim.AdamW, stage=3, units=[nn.Linear], lr=0.1)
    assert [x for x in seen if x != (0, 0)] == [(2, 0)] * 3, seen  # the root has none
    ref = nn.Sequential(*(nn.Linear(16, 16) for _ in range(3)))
    from zero_kernels.optimizer.materialize import init_module_

    init_module_(ref, 0)
    with zo.gathered_params():
        assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters()))
    m(torch.randn(4, 16)).sum().backward()
    zo.step()
    r = zo.parts.core.runner
    assert r.fused[0] and len(r.flat_state) == len(zo.layout.buffers[0].buckets) == 3
    for name in ("exp_avg", "exp_avg_sq"):
        ptrs = {st[name].untyped_storage().data_ptr() for st in r.flat_state.values()}
        assert len(ptrs) == 1, name
        shard = zo.layout.buffers[0].shard_numel(zo.world_size)
        assert next(iter(r.flat_state.values()))[name].untyped_storage().nbytes() == 4 * shard
    zo.close()


def _persist(rank, world):
    """persist_below: small params (biases, norms) stay whole on every rank between steps and
    train exactly as the rest (DDP parity)."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = stage3_checks.Net3()
    m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
    zo = zero_opt(m1, torch.optim.AdamW, stage=3, persist_below=100, lr=1e-2)
    ddp = DDP(m2)
    to = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    for step in range(3):
        x, y = stage3_checks._batch(rank, step)
        zo.zero_grad()
        to.zero_grad()
        stage3_checks._loss(m1(x), y).backward()
        stage3_checks._loss(ddp(x), y).backward()
        zo.step()
        to.step()
        for (n, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters()):
            if a.numel() < 100:  # whole between steps, current values
                assert rel_err(a, b) <= 1e-6, n
            else:
                assert torch.isnan(a).all(), n
    stage3_checks.assert_params_close(zo, m1, m2, 1e-6, "persist_below")
    zo.close()
    return "ok"


@pytest.mark.distributed
def test_stage3_persist_below():
    assert run_workers(_persist, 2, timeout=300) == ["ok", "ok"]


def _reduced_in(dtype, tol, rank, world):
    """reduce_dtype=``dtype`` at stages 2 and 3: half the reduce-scatter bytes; the params stay
    within ``tol`` of fp32 reduction (DDP); fp32 reduction of the same model gives DDP's."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        base = stage3_checks.Net3()
        m1, m2, m3 = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
        kw = {"lr": 1e-2}
        z16 = zero_opt(m1, torch.optim.AdamW, stage=stage, reduce_dtype=dtype, **kw)
        z32 = zero_opt(m3, torch.optim.AdamW, stage=stage, **kw)
        ddp = DDP(m2)
        to = torch.optim.AdamW(m2.parameters(), **kw)
        for step in range(4):
            x, y = stage3_checks._batch(rank, step)
            for z, m in ((z16, m1), (z32, m3)):
                z.zero_grad()
                stage3_checks._loss(m(x), y).backward()
                z.step()
            to.zero_grad()
            stage3_checks._loss(ddp(x), y).backward()
            to.step()
        with z16.gathered_params(), z32.gathered_params():
            e16 = max(rel_err(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
            e32 = max(rel_err(a, b) for a, b in zip(m3.parameters(), m2.parameters()))
        assert e32 <= 1e-6 and e16 <= tol, (stage, e16, e32)
        b16 = z16.comm_stats["reduce_scatter_bytes"]
        b32 = z32.comm_stats["reduce_scatter_bytes"]
        assert b16 * 2 == b32, (b16, b32)
        out[stage] = e16
        z16.close()
        z32.close()
    return out


def check_reduce_bf16(rank, world):
    return _reduced_in(torch.bfloat16, 2e-2, rank, world)


def check_reduce_fp16(rank, world):
    # fp16 rounds to 2**-11 relative, bf16 to 2**-8. Measured here after 4 steps at 2 ranks:
    # fp16 1.7e-4, bf16 1.5e-3 (1-4 ranks: fp16 0.9e-4 to 2.3e-4, bf16 1.0e-3 to 8.0e-3). 1e-3
    # is 6x fp16's error and below bf16's: a reduction that rounds to bf16's precision on the
    # way fails it (checked: reduce_dtype=fp16 swapped for bf16 in the worker gives 1.5e-3)
    return _reduced_in(torch.float16, 1e-3, rank, world)


def _reduce_dtypes(rank, world):
    return run_checks(rank, world, (check_reduce_bf16, check_reduce_fp16))


REDUCE = SharedRun(_reduce_dtypes, timeout=300)


@pytest.mark.distributed
@pytest.mark.parametrize("check", ["check_reduce_bf16", "check_reduce_fp16"])
def test_reduce_dtype(check):
    rep = REDUCE.check(2, check)[0]
    assert set(rep) == {2, 3}


def test_bf16_reduction_refused_at_stage_1():
    m = nn.Linear(4, 2)
    with pytest.raises(NotImplementedError, match="reduce_dtype"):
        zero_opt(m, torch.optim.SGD, stage=1, reduce_dtype=torch.bfloat16, lr=0.1)
    with pytest.raises(ValueError, match="reduce_dtype"):
        zero_opt(m, torch.optim.SGD, stage=2, reduce_dtype=torch.int8, lr=0.1)


def test_first_difference():
    """Which launch lists of a pass cannot all be completed (`SequenceCheck` diagnosis)."""
    from zero_kernels.partition.order import first_difference

    # a rank behind (shorter, still in the pass) differs in nothing
    assert first_difference({0: (False, [1, 2, 3]), 1: (False, [1, 2])}) is None
    assert first_difference({0: (False, [1, 2]), 1: (True, [1, 2])}) is None
    # a rank that ended the pass before an entry another launched
    assert first_difference({0: (False, [1, 2, 3]), 1: (True, [1, 2])}) == (2, 0, 1)
    # entries that differ where both lists have one; the first position wins
    assert first_difference({0: (False, [1, 5, 3]), 1: (False, [1, 2, 4])}) == (1, 0, 1)
    # three ranks: the two lowest ranks that differ are named
    lists = {0: (False, [1, 2]), 1: (False, [1, 2, 7]), 2: (True, [1, 2])}
    assert first_difference(lists) == (2, 1, 2)
    assert first_difference({0: (True, []), 1: (False, [4])}) == (0, 0, 1)


@pytest.mark.parametrize("stage", [1, 3])
def test_unfrozen_after_construction_raises_naming_it(stage):
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    m[0].requires_grad_(False)
    zo = ZeroOptimizer(m, torch.optim.SGD, stage=stage, lr=0.1)
    m(torch.ones(1, 4)).sum().backward()
    zo.step()
    m[0].requires_grad_(True)
    m(torch.ones(1, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"param '0.weight' \(4, 4\) was frozen"):
        zo.step()
    zo.close()


@pytest.mark.parametrize("shard_frozen", [False, True])
def test_stage3_autocast_frozen_casts_made_again(monkeypatch, shard_frozen):
    """[Note: frozen casts]: under autocast the casts of frozen fp32 weights (a LoRA base) are
    saved as recipes too, found by comparing them bit for bit with the weight cast again; a
    saved low-precision tensor of a frozen weight's shape that is not its cast is kept as saved;
    gradients and outputs as without ZeRO, every step."""
    from zero_kernels.partition import recast

    packed, made = [], []
    pack, unpack = recast.Recast.pack, recast.Recast.unpack

    def counting_pack(self, t):
        out = pack(self, t)
        packed.append((type(out), tuple(t.shape), t.dtype))
        return out

    monkeypatch.setattr(recast.Recast, "pack", counting_pack)
    monkeypatch.setattr(
        recast.Recast, "unpack", staticmethod(lambda x: made.append(type(x)) or unpack(x))
    )

    class Lora(nn.Module):
        def __init__(self, odd=False):
            super().__init__()
            self.base = nn.Linear(8, 8)
            self.a = nn.Linear(8, 2, bias=False)
            self.b = nn.Linear(2, 8, bias=False)
            self.odd = odd
            self.base.requires_grad_(False)

        def forward(self, x):
            y = self.base(x) + self.b(self.a(x))
            if self.odd:  # bf16, no history, the base weight's shape, not its cast: kept
                w = self.base.weight.to(torch.bfloat16) * 2
                y = y + x.to(torch.bfloat16) @ w.t()
            return torch.tanh(y)

    torch.manual_seed(0)
    m = nn.Sequential(Lora(), Lora(odd=True), nn.Linear(8, 3))
    ref = nn.Sequential(Lora(), Lora(odd=True), nn.Linear(8, 3))
    ref.load_state_dict(m.state_dict())
    for mod in (m, ref):
        for blk in mod[:2]:
            blk.base.requires_grad_(False)
    zo = zero_opt(m, torch.optim.SGD, stage=3, units=[Lora], shard_frozen=shard_frozen, lr=0.1)
    ro = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    nocache = dict(device_type="cpu", dtype=torch.bfloat16, cache_enabled=False)
    x = torch.randn(4, 8, requires_grad=True)  # so that the first block's base is saved too
    for _ in range(3):
        packed.clear()
        made.clear()
        with torch.autocast(**nocache):
            out = m(x)
        with torch.autocast(**nocache):
            r = ref(x)
        assert torch.equal(out, r)
        kept = [(shape, dt) for kind, shape, dt in packed if kind is not recast.Cast]
        casts = [shape for kind, shape, _ in packed if kind is recast.Cast]
        # each block's base weight (saved as weight.t(), an (8, 8) view) is a recipe; the odd
        # block's `w` (the same shape, twice the cast) is kept as saved
        assert casts.count((8, 8)) == 2, packed
        assert [s for s, dt in kept if s == (8, 8) and dt == torch.bfloat16] == [(8, 8)], kept
        out.float().pow(2).sum().backward()
        r.float().pow(2).sum().backward()
        assert made.count(recast.Cast) == len(casts)
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            if q.requires_grad:
                torch.testing.assert_close(zo.full_grad(p), q.grad, rtol=0, atol=0, msg=name)
        zo.step()
        ro.step()
        zo.zero_grad()
        ro.zero_grad()
    zo.close()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("cast", [False, True])
def test_stage3_frozen_weight_changed_before_backward_raises(cast):
    """A frozen weight changed in place between the forward and the backward: torch raises for
    a tensor autograd saved; so do the frozen casts' recipes and the frozen params saved as they
    are ([Note: frozen casts]), instead of using the new values."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    m[1].requires_grad_(False)
    for shard in (False, True):
        if not cast and not shard:
            continue  # the frozen param saved as it is: torch's own check
        zo = zero_opt(m, torch.optim.SGD, stage=3, shard_frozen=shard, lr=0.1)
        x = torch.randn(4, 8)
        nocache = dict(device_type="cpu", dtype=torch.bfloat16, cache_enabled=False)
        with torch.autocast(**nocache) if cast else contextlib.nullcontext():
            out = m(x).float().sum()
        with zo.gathered_params(), torch.no_grad():
            m[1].weight.mul_(0.5)
        with pytest.raises(RuntimeError, match="modified in place"):
            out.backward()
        zo.close()


def test_stage3_hooks_leave_autograd_stack_under_users_hooks():
    """A user's saved-tensor hooks entered in a forward pre-hook of the model and left in its
    forward hook, both registered after the optimizer's: the root unit's hooks, under theirs at
    the forward's end, are taken off all the same (they stayed, one more per forward, and
    torch.func refused to run under them)."""

    class Root(nn.Module):  # a param of the root unit itself, cast under autocast
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))
            self.lin = nn.Linear(8, 2)

        def forward(self, x):
            return self.lin(x @ self.w)

    torch.manual_seed(0)
    m = Root()
    zo = ZeroOptimizer(m, torch.optim.SGD, stage=3, units=[nn.Linear], lr=0.1)
    ctx = {}

    def pre(mod, args):
        ctx["c"] = torch.autograd.graph.save_on_cpu()
        ctx["c"].__enter__()

    def post(mod, args, out):
        ctx.pop("c").__exit__(None, None, None)

    m.register_forward_pre_hook(pre)
    m.register_forward_hook(post)
    top = torch._C._autograd._top_saved_tensors_default_hooks
    nocache = dict(device_type="cpu", dtype=torch.bfloat16, cache_enabled=False)
    for _ in range(3):
        with torch.autocast(**nocache):
            out = m(torch.randn(4, 8))
        assert top(False) is None
        out.float().sum().backward()
        zo.step()
        zo.zero_grad()
    torch.func.grad(lambda t: (t * t).sum())(torch.ones(3))
    zo.close()


def test_is_cast_of_compares_every_bit():
    """[Note: frozen casts]'s test of a saved tensor: equal to the param cast again, bit for bit,
    at odd sizes and both half dtypes; one element off (the last, or -0.0 saved as +0.0), or a
    NaN's payload changed, is not a cast."""
    from zero_kernels.partition.recast import CHUNK, is_cast_of

    g = torch.Generator().manual_seed(0)
    for shape in [(1,), (7, 13), (3, 5, 7), (2 * CHUNK + 3,), (CHUNK + 4,)]:
        p = torch.randn(shape, generator=g)
        p.view(-1)[0] = -0.0
        for dt in (torch.bfloat16, torch.float16):
            b = p.to(dt)
            assert is_cast_of(b, p), (shape, dt)
            assert not is_cast_of(b.t() if b.dim() == 2 else b[..., :0], p)
            for k, v in ((-1, 2.0), (0, 0.0)):
                c = b.clone()
                c.view(-1)[k] = c.view(-1)[k] * 2 + 1 if v == 2.0 else v
                assert not is_cast_of(c, p), (shape, dt, k)
    p = torch.tensor([1.0, float("nan"), 2.0])
    b = p.to(torch.bfloat16)
    assert is_cast_of(b, p)
    c = b.clone()
    c.view(torch.int16)[1] ^= 1  # another NaN
    assert not is_cast_of(c, p)


@contextlib.contextmanager
def _no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_stage3_autocast_casts_made_again_in_backward(monkeypatch):
    """fp32 params under autocast: the casts autograd saves are recipes, made again in the
    backward ([Note: autocast]); values as without ZeRO; the hooks are off after the forward,
    also after a unit's forward that raised."""
    from zero_kernels.partition import recast

    made = []
    unpack = recast.Recast.unpack
    monkeypatch.setattr(
        recast.Recast, "unpack", staticmethod(lambda x: made.append(type(x)) or unpack(x))
    )
    top = torch._C._autograd._top_saved_tensors_default_hooks

    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.boom = False

        def forward(self, x):
            if self.boom:
                raise KeyError("boom")
            return torch.tanh(self.lin(x))

    torch.manual_seed(0)
    m = nn.Sequential(Boom(), Boom(), nn.Linear(8, 8))
    ref = nn.Sequential(Boom(), Boom(), nn.Linear(8, 8))
    ref.load_state_dict(m.state_dict())
    zo = ZeroOptimizer(m, torch.optim.SGD, stage=3, units=[Boom], lr=0.1)
    x = torch.randn(4, 8, requires_grad=True)  # so that the first unit's weight is saved too
    nocache = dict(device_type="cpu", dtype=torch.bfloat16, cache_enabled=False)
    for step in range(3):
        if step == 1:  # a unit's forward raises: its hooks must not outlive the error
            m[1].boom = True
            with pytest.raises(KeyError), torch.autocast(**nocache):
                m(x)
            m[1].boom = False
        made.clear()
        cache = step == 2  # autocast's cache on: a warning, once, that it keeps the copies
        warn = pytest.warns(UserWarning, match="cache_enabled=False") if cache else _no_warning()
        with warn, torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
            out = m(x)
            assert top(False) is None  # the hooks are off after the forward
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
            r = ref(x)
        torch.testing.assert_close(out, r)
        out.float().pow(2).sum().backward()
        r.float().pow(2).sum().backward()
        # each unit's weight and the root's last Linear (the root unit's own), made again once
        assert made.count(recast.Cast) == 3, made
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(zo.full_grad(p), q.grad)
        zo.zero_grad()
        ref.zero_grad()
    zo.close()


def test_stage3_step_after_a_forward_without_backward():
    """A forward with gradients on whose backward has not run (an evaluation outside no_grad,
    between backward and step) left its units gathered: the step frees them, so the next
    forward reads the stepped values (plain torch's, 3 steps); a backward through that
    forward's graph after the step raises torch's in-place error, as in plain torch (before,
    the step raised that the params' data had been replaced). A step inside gathered_params()
    raises."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = copy.deepcopy(m)
    zo = ZeroOptimizer(m, torch.optim.SGD, stage=3, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    for model, opt in ((m, zo), (ref, ref_opt)):
        evals = []
        for _ in range(3):
            model(x).pow(2).sum().backward()
            evals.append(model(x).pow(2).mean())  # gradients on, never backwarded
            opt.step()
            opt.zero_grad()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            evals[-1].backward()
        opt.zero_grad()
    with zo.gathered_params():
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    m(x).pow(2).sum().backward()
    with zo.gathered_params(), pytest.raises(RuntimeError, match="inside gathered_params"):
        zo.step()
    zo.close()


def test_stage3_units_public_view():
    """opt.units(): which modules became units and which params sit in the root unit, their
    gathered size and their state, through the public view (FSDP2's "which modules are
    FSDPModules"); [] at stages 1/2; the kept-whole params under persist_below; frozen ones."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Linear(4, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            x = self.emb(x)
            for b in self.blocks:
                x = torch.tanh(b(x))
            return self.head(x)

    torch.manual_seed(0)
    m = Net()
    every = [n for n, _ in m.named_parameters()]
    zo = ZeroOptimizer(m, torch.optim.AdamW, stage=3, units=list(m.blocks), lr=1e-3)
    infos = zo.units()
    assert [(u.name, u.kind) for u in infos] == [
        ("", "root"),
        ("blocks.0", "unit"),
        ("blocks.1", "unit"),
        ("blocks.2", "unit"),
    ], infos
    assert infos[0].module is m and infos[2].module is m.blocks[1]
    assert infos[0].params == ("emb.weight", "emb.bias", "head.weight", "head.bias")
    assert infos[1].params == ("blocks.0.weight", "blocks.0.bias")
    assert sorted(n for u in infos for n in u.params) == sorted(every)  # each param once
    assert sum(u.numel for u in infos) == sum(p.numel() for p in m.parameters())
    for u in infos:
        assert u.state == "sharded" and u.buckets >= 1 and u.gathered_bytes >= 4 * u.numel
    with zo.gathered_params(m.blocks[1]):
        assert [u.state for u in zo.units()] == ["sharded", "sharded", "gathered", "sharded"]
    assert {u.state for u in zo.units()} == {"sharded"}
    zo.close()
    # params under persist_below are kept whole, in a unit of their own
    m = Net()
    zo = zero_opt(m, torch.optim.AdamW, stage=3, units=list(m.blocks), persist_below=9)
    kept = [u for u in zo.units() if u.kind == "kept"]
    assert len(kept) == 1 and kept[0].module is None and kept[0].state == "gathered", kept
    assert set(kept[0].params) == {n for n in every if n.endswith("bias")}, kept
    zo.close()
    # frozen params sharded with their unit (shard_frozen)
    m = Net()
    m.blocks[0].requires_grad_(False)
    trainable = [p for p in m.parameters() if p.requires_grad]
    zo = zero_opt(
        trainable, torch.optim.AdamW, stage=3, module=m, units=list(m.blocks), shard_frozen=True
    )
    assert next(u for u in zo.units() if u.name == "blocks.0").params == (
        "blocks.0.weight",
        "blocks.0.bias",
    )
    zo.close()
    m = Net()
    zo = ZeroOptimizer(m, torch.optim.AdamW, stage=2, lr=1e-3)
    assert zo.units() == []
    zo.close()
