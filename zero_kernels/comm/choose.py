"""Which reduce-scatter / all-gather algorithm a collective uses, and the launch of each.

[Note: choosing the algorithm]
NCCL, any tensor off the CPU and any backend but gloo always use native; world size 1 copies. On
gloo the choice is made per (group, operation, size class of the full buffer): < 64 KiB, then
powers of 4 from 64 KiB ([64K, 256K), [256K, 1M), [1M, 4M), [4M, 16M)), and >= 16 MiB.
Precedence: `set_algorithm` (for the group, then for every group), then
``ZERO_KERNELS_COMM_ALGO=native|pairwise|ring|shm`` (``auto`` or unset: probe), then, on a
group whose ranks are on several hosts, the bytes on the host links ([Note: link-aware
choice]), then the probe.

The probe runs lazily, inside the first collective of a class, which every rank calls in the same
order. On one fp32 buffer of the class's probe size (32 KiB, 128 KiB, 512 KiB, 2 MiB, 8 MiB, 32
MiB) it runs native, pairwise, (N > 2; a ring of 2 is the pairwise exchange) ring and, where every
rank of the group shares ``/dev/shm`` with the others, proven by a file one rank wrote and the
others read ([Note: hosts are proven] in hosts.py; [Note: shared-memory collectives]), shm, 5 to
1 times each (fewer for larger sizes; buffers touched beforehand), interleaved, each run after a
barrier.
It takes each rank's fastest run (warm-up and preemption only add time) and all-reduces them with
MAX, so every rank sees the same numbers and picks the same algorithm (ranks that chose differently
would hang). Any other algorithm must be at least 10% faster than native to be chosen. Each choice
is logged once (logger ``zero_kernels``, INFO); `probe_results` returns what was measured. The top
class is probed at 32 MiB because gloo's own collectives slow down per byte above ~32 MB (likely
fresh, page-faulting temporaries: 32 MiB is glibc's largest mmap threshold): its all-gather ties
with pairwise at 4 MiB, is ~1.4x slower at 16 MiB and 2.6x slower at 76 MB, so a smaller probe
chooses wrong for large buckets; there one run each decides (3-5x apart). Probing every class of
both operations costs ~0.5 s per group (2 ranks, this 2-core machine); a run probes only the
classes it uses (25 MB buckets: the top one, ~0.25 s, and perhaps one for the last bucket).

[Note: link-aware choice]
Where a group's ranks are on several hosts (`comm.host_groups`, proven), the link between the
hosts decides a step's time, and a probe on the machine at hand does not see it (ranks
oversubscribing a machine time the cores, not the link; at 2 x 8 ranks on 2 cores it chose the
pairwise exchange, 4.2x the ring's bytes across). So the candidates (native, pairwise, ring; shm
only runs on one host) are first priced by what the most loaded host sends to the others
(`links.host_bytes`: for a group of n ranks, L per host, node-major, as a fraction of the full
buffer: the ring (n-1)/n, gloo's native reduce-scatter 2 (n-1)/n (an all-reduce, cut), its
native all-gather (n-1)/n (a ring), the pairwise exchange L (n-L)/n); those within
`LINK_MARGIN` of the fewest stay, and the probe picks among them where more than one does.
`probe_results` holds each choice (``links``: the bytes that decided), and the optimizer's
`comm_stats["choices"]` each choice of its collectives and why (`CommLog.choices`).
"""

from __future__ import annotations

import bisect
import logging
import os
import time

import torch
import torch.distributed as dist

from . import hosts as _hosts
from . import links, shm
from .base import (
    Handle,
    _all_gather,
    _avg_ok,
    _nbytes,
    _reduce_scatter,
    avg_supported,
    backend_for,
    launch_native,
    world_size,
)
from .p2p import (
    _ag_pairwise,
    _ag_ring,
    _check_p2p,
    _group_key,
    _rs_pairwise,
    _rs_ring,
    _scratch,
    _tags,
    free_scratch,
    next_tag,
)

ALGORITHMS = ("native", "pairwise", "ring", "shm")
ENV_ALGO = "ZERO_KERNELS_COMM_ALGO"
_OPS = ("reduce_scatter", "all_gather")
_logger = logging.getLogger("zero_kernels")


def _reduce_scatter_with(algo: str, output, input, group, avg: bool, log, bound=()) -> Handle:
    n = world_size(group)
    if log is not None:  # [Note: bytes by link]
        log._sent(links.pattern("reduce_scatter", algo, group, input.device), _nbytes(input), group)
    if algo == "native":
        op = dist.ReduceOp.AVG if avg and avg_supported(group, output.device) else dist.ReduceOp.SUM
        divide = float(n) if avg and op == dist.ReduceOp.SUM else 1.0

        def launch():
            return _reduce_scatter(output, input, op=op, group=group, async_op=True)

        return launch_native(launch, (output, input), divide, log)
    _check_p2p("reduce_scatter", output, input, group)
    if output.numel() == 0:
        return Handle(None, (output, input), 1.0, log)
    if algo == "shm":
        work = shm.launch("reduce_scatter", output.view(-1), input.view(-1), group, *bound)
        return Handle(work, (output, input), float(n) if avg else 1.0, log)
    tag = next_tag(group)
    launch = _rs_pairwise if algo == "pairwise" else _rs_ring
    work = launch(output.view(-1), input.view(-1), group, tag)
    return Handle(work, (output, input), float(n) if avg else 1.0, log)  # sum, then divide once


def _all_gather_with(algo: str, output, input, group, log, bound=()) -> Handle:
    if log is not None:  # [Note: bytes by link]
        log._sent(links.pattern("all_gather", algo, group, output.device), _nbytes(output), group)
    if algo == "native":

        def launch():
            return _all_gather(output, input, group=group, async_op=True)

        return launch_native(launch, (output, input), 1.0, log)
    _check_p2p("all_gather", output, input, group)
    if input.numel() == 0:
        return Handle(None, (output, input), 1.0, log)
    if algo == "shm":
        work = shm.launch("all_gather", output.view(-1), input.view(-1), group, *bound)
        return Handle(work, (output, input), 1.0, log)
    tag = next_tag(group)
    launch = _ag_pairwise if algo == "pairwise" else _ag_ring
    return Handle(launch(output.view(-1), input.view(-1), group, tag), (output, input), 1.0, log)


_CLASS_BOUNDS = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)  # class k: [b[k-1], b[k])
_PROBE_BYTES = (32 << 10, 128 << 10, 512 << 10, 2 << 20, 8 << 20, 32 << 20)  # one per class
_PROBE_REPEATS = (5, 4, 4, 3, 3, 1)  # runs per class, more where cheap (the first warms up)
_P2P_MARGIN = 0.9  # a p2p algorithm must take at most this fraction of native's time
LINK_MARGIN = 1.1  # [Note: link-aware choice]: candidates within this of the fewest host bytes
# keyed by `base.group_key` (a token per group object, never its id: [Note: group keys])
_overrides: dict = {}  # (group key or None for every group, op) -> algorithm
_choices: dict = {}  # (group key, op, size class) -> the probe's result
_twins: dict = {}  # twin group key -> its parent's (`zero_kernels.comm.twin_group`)


def _choice_key(group) -> tuple:
    """The key of ``group``'s algorithm settings and probe results: a twin group shares its
    parent's (the same ranks and transport)."""
    key = _group_key(group)
    return _twins.get(key, key)


def register_twin(twin, parent) -> None:
    """``twin`` uses ``parent``'s algorithm settings and probe results."""
    _twins[_group_key(twin)] = _choice_key(parent)


_logged: set = set()


def size_class(nbytes: int) -> int:
    return bisect.bisect_right(_CLASS_BOUNDS, nbytes)


def class_label(c: int) -> str:
    def kib(b: int) -> str:
        return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"

    if c == 0:
        return f"< {kib(_CLASS_BOUNDS[0])}"
    if c == len(_CLASS_BOUNDS):
        return f">= {kib(_CLASS_BOUNDS[-1])}"
    return f"[{kib(_CLASS_BOUNDS[c - 1])}, {kib(_CLASS_BOUNDS[c])})"


def _env_algorithm() -> str | None:
    v = os.environ.get(ENV_ALGO, "").strip().lower()
    if v in ("", "auto"):
        return None
    if v not in ALGORITHMS:
        raise ValueError(f"{ENV_ALGO} must be one of {ALGORITHMS} or 'auto'; got {v!r}")
    return v


def _p2p_capable(group, device: torch.device) -> bool:
    return device.type == "cpu" and backend_for(group, device) == "gloo"


def set_algorithm(op: str, algo: str | None, group=None) -> None:
    """Use ``algo`` ("native", "pairwise", "ring", "shm"; None: back to env/probe) for ``op``.

    ``op`` is "reduce_scatter", "all_gather" or "all"; ``group=None`` sets it for every group (a
    group's own setting wins). Overrides ``ZERO_KERNELS_COMM_ALGO`` and the probe on gloo; NCCL
    always uses native. Every rank must make the same call: ranks on different algorithms hang.
    """
    if op != "all" and op not in _OPS:
        raise ValueError(f"op must be one of {_OPS} or 'all'; got {op=!r}")
    if algo is not None and algo not in ALGORITHMS:
        raise ValueError(f"algo must be one of {ALGORITHMS} or None; got {algo=!r}")
    key = None if group is None else _choice_key(group)
    for o in _OPS if op == "all" else (op,):
        if algo is None:
            _overrides.pop((key, o), None)
        else:
            _overrides[(key, o)] = algo


def link_bytes(op: str, host_of) -> dict[str, float]:
    """What the most loaded host sends to the others with each gloo algorithm for ``op``
    (native, pairwise and, over more than 2 ranks, ring), as a fraction of the full buffer,
    on a group whose rank g is on host ``host_of[g]`` (pure; `links.host_bytes`)."""
    if op not in _OPS:
        raise ValueError(f"op must be one of {_OPS}; got {op=!r}")
    cands = ["native", "pairwise"] + (["ring"] if len(host_of) > 2 else [])
    kinds = {"native": "ring_all_reduce" if op == "reduce_scatter" else "ring"}
    return {a: links.host_bytes(kinds.get(a, a), host_of) for a in cands}


def link_candidates(op: str, host_of) -> tuple[list[str], str]:
    """The gloo algorithms for ``op`` whose bytes across hosts are within `LINK_MARGIN` of the
    fewest, on a group whose rank g is on host ``host_of[g]``, and why (pure; [Note: link-aware
    choice]). All of native, pairwise and ring (in that order) on one host."""
    cost = link_bytes(op, host_of)
    cands = list(cost)
    if len(set(host_of)) <= 1:
        return cands, "one host"
    best = min(cost.values())
    keep = [a for a in cands if cost[a] <= LINK_MARGIN * best + 1e-12]
    hosts = len(set(host_of))
    why = f"bytes across {hosts} hosts, per host, x the buffer: " + ", ".join(
        f"{a} {cost[a]:.3g}" for a in cands
    )
    return keep, why


def choose_algorithm(op: str, nbytes: int, *, group=None, device="cpu") -> str:
    """The algorithm ``op`` uses on ``group`` for a full buffer of ``nbytes`` bytes.

    "copy" at world size 1, else one of `ALGORITHMS`. Collective when the size class has not been
    probed on ``group`` yet: call it on every rank alike, like the collective itself.
    """
    return choose_with_reason(op, nbytes, group=group, device=device)[0]


def choose_with_reason(op: str, nbytes: int, *, group=None, device="cpu") -> tuple[str, str]:
    """`choose_algorithm`'s answer and why (what set it, or what the bytes across hosts and
    the probe found: [Note: link-aware choice])."""
    if op not in _OPS:
        raise ValueError(f"op must be one of {_OPS}; got {op=!r}")
    if world_size(group) == 1:
        return "copy", "world size 1"
    if not _p2p_capable(group, torch.device(device)):
        return "native", "not gloo on the CPU"
    key, c = _choice_key(group), size_class(nbytes)
    algo = _overrides.get((key, op)) or _overrides.get((None, op))
    why = "set_algorithm"
    if algo is None:
        algo, why = _env_algorithm(), ENV_ALGO
    if algo is None:
        if (key, op, c) not in _choices:
            _choices[(key, op, c)] = _decide(op, group, c)
        res = _choices[(key, op, c)]
        algo = res["algorithm"]
        why = res.get("links", "")
        if "times_ms" in res:
            why += ("; " if why else "") + (
                "probe, ms (max over ranks of the fastest run): "
                + ", ".join(f"{a} {t:.3g}" for a, t in res["times_ms"].items())
            )
    if (key, op, c, algo, why[:5]) not in _logged:
        _logged.add((key, op, c, algo, why[:5]))
        _logger.info(
            "comm: %s on %d gloo ranks, buffers %s: %s (%s)",
            op,
            world_size(group),
            class_label(c),
            algo,
            why,
        )
    return algo, why


def probe_ahead(sizes, *, group=None, device="cpu") -> None:
    """Probe now the size classes of ``sizes`` (``(op, nbytes)`` pairs) not probed on ``group``
    yet, in one order on every rank (collective: call it on every rank with the same sizes).

    `ZeroOptimizer` calls it with its buckets before it allocates its buffers: a probe's buffers
    (up to 32 MiB of input, its shard and the receive buffers) then come and go while the rank
    holds the least, instead of in the first step on top of the gradients and the new
    optimizer state (+1.0 byte/param of the first step's peak at stage 2, 4 ranks, measured)."""
    seen = set()
    for op, nbytes in sorted(sizes):  # choose_algorithm checks ``op``
        c = size_class(nbytes)
        if (op, c) not in seen:
            seen.add((op, c))
            choose_algorithm(op, nbytes, group=group, device=device)


def probe_results(group=None) -> dict:
    """What the probe measured on ``group``: {(op, size class label): result}."""
    key = _choice_key(group)
    return {(op, class_label(c)): dict(v) for (k, op, c), v in _choices.items() if k == key}


def _decide(op: str, group, c: int) -> dict:
    """[Note: link-aware choice]: the candidates by their bytes across hosts, then the probe
    among those left (collective: the host proof, the probe)."""
    host_of = [0] * world_size(group)
    for h, ranks in enumerate(_hosts.host_groups(group)):
        for r in ranks:
            host_of[r] = h
    keep, why = link_candidates(op, host_of)
    if len(set(host_of)) > 1 and len(keep) == 1:
        return {"algorithm": keep[0], "links": why}
    res = _probe(op, group, c, keep if len(set(host_of)) > 1 else None)
    if len(set(host_of)) > 1:
        res["links"] = why + f" (kept {', '.join(keep)})"
    return res


def _probe(op: str, group, c: int, only: list[str] | None = None) -> dict:
    """Time every candidate (or those of ``only``) on one fp32 buffer of class ``c``; the same
    answer on every rank."""
    t_start = time.perf_counter()
    n = world_size(group)
    numel = max(n, _PROBE_BYTES[c] // 4 // n * n)
    full, shard = torch.ones(numel), torch.zeros(numel // n)  # touched: no first-use faults
    warm = [_scratch.take(numel // n, shard) for _ in range(n - 1)]  # the p2p receive buffers
    for b in warm:
        b.zero_()
    _scratch.give(warm)
    cands = ["native", "pairwise"] + (["ring"] if n > 2 else [])  # a ring of 2 is pairwise
    if only is not None:  # several hosts: shm cannot run ([Note: link-aware choice])
        cands = list(only)
    elif shm.capable(group) is None:  # collective, once per group: every rank answers the same
        cands.append("shm")

    def once(algo: str) -> None:
        if op == "reduce_scatter":
            _reduce_scatter_with(algo, shard, full, group, False, None).wait()
        else:
            _all_gather_with(algo, full, shard, group, None).wait()

    reps = _PROBE_REPEATS[c]
    times = torch.zeros(len(cands), reps, dtype=torch.float64)
    for i in range(reps):
        for j, a in enumerate(cands):  # interleaved: drift hits every candidate alike
            dist.barrier(group=group)  # all start together: no rank times another's lateness
            t0 = time.perf_counter()
            once(a)
            times[j, i] = time.perf_counter() - t0
    best_t = times.min(dim=1).values  # warm-up and preemption only ever add time
    dist.all_reduce(best_t, op=dist.ReduceOp.MAX, group=group)  # agreed: all ranks pick the same
    sec = best_t.tolist()
    free_scratch()  # the probe's receive buffers are not the caller's
    if cands[0] == "native" and len(cands) > 1:
        best = min(range(1, len(cands)), key=lambda j: sec[j])
        algo = cands[best] if sec[best] < _P2P_MARGIN * sec[0] else "native"
    else:  # native priced out by the links
        algo = cands[min(range(len(cands)), key=lambda j: sec[j])]
    return {
        "algorithm": algo,
        "times_ms": {a: round(t * 1e3, 3) for a, t in zip(cands, sec)},
        "probe_bytes": numel * 4,
        "seconds": round(time.perf_counter() - t_start, 4),  # this rank's wall time
    }


def _reset_choices() -> None:
    """Forget per-group state (the group objects die with the process group)."""
    for d in (_choices, _tags, _avg_ok, _twins):
        d.clear()
    free_scratch()
    shm.close_all()
    _logged.clear()
    for k in [k for k in _overrides if k[0] is not None]:
        del _overrides[k]
