"""Side-by-side timing and the machine's memory bandwidth, measured in the same run.

Candidates are timed alternately (A B C A B C ...) so that drift in the machine (frequency, other
load) hits all of them alike, and each is summarised by its median. Every figure is written with
the machine, the versions and the command that produced it.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except OSError:
        commit = ""
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "commit": commit,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }
    info.update(_lscpu())
    try:
        from zero_kernels import native

        mod = native.load()
        info["zero_kernels_cpu_isa"] = mod.cpu_isa() if mod is not None else None
        if mod is not None and hasattr(mod, "prefetch_distance"):
            info["zero_kernels_prefetch"] = mod.prefetch_distance()
    except ImportError:
        pass
    return info


def _lscpu() -> dict:
    """lscpu's model name, vendor, cores and L3 (empty where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return {}
    fields = {}
    for ln in out.splitlines():
        k, _, v = ln.partition(":")
        fields[k.strip()] = v.strip()
    want = {
        "Model name": "lscpu_model",
        "Vendor ID": "lscpu_vendor",
        "CPU(s)": "lscpu_cpus",
        "L3 cache": "lscpu_l3",
        "Hypervisor vendor": "lscpu_hypervisor",
        "CPU family": "cpu_family",
        "Model": "cpu_model",
    }
    info = {dst: fields[src] for src, dst in want.items() if src in fields}
    flags = fields.get("Flags", "").split()
    isa = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl")
    info["isa_flags"] = [f for f in isa if f in flags]
    return info


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def side_by_side(
    cands: dict[str, Callable[[], object]], repeats: int = 7, warmup: int = 2, device: str = "cpu"
) -> dict[str, dict]:
    """Median and min seconds per call of each candidate, timed alternately, in a new order each
    round (a seeded shuffle, the same in every run): the candidate that runs just before another
    decides what is left in its caches and whether the second core's thread is awake, which
    moved the same 1M-param step from 0.41 to 0.78 ms with its place in a fixed order."""
    for fn in cands.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    times: dict[str, list[float]] = {k: [] for k in cands}
    order = list(cands.items())
    rng = random.Random(0)
    for _ in range(repeats):
        rng.shuffle(order)
        for name, fn in order:
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return {
        k: {"median_s": statistics.median(v), "min_s": min(v), "n": len(v)}
        for k, v in times.items()
    }


def memory_bandwidth(n_floats: int = 50_000_000, device: str = "cpu", repeats: int = 7) -> dict:
    """Streaming bandwidth in GB/s (1e9 bytes/s), measured on this device in this run.

    - copy: b.copy_(a) with torch, 8 bytes per element (read a, write b);
    - rmw: a.add_(b) with torch, 12 bytes per element (read a and b, write a back in place);
    - step_pattern (CPU, native extension): p += g, m += g, v += g, 28 bytes per element: the
      exact memory traffic of an Adam step (4 streams read, 3 written in place) with no math.
    The largest is the floor a kernel's fraction is reported against: a kernel at 1.0 moves its
    bytes as fast as the fastest of these pure-memory loops.
    """
    a = torch.rand(n_floats, device=device)
    b = torch.rand(n_floats, device=device)
    cands = {"copy": lambda: b.copy_(a), "rmw": lambda: a.add_(b, alpha=1e-9)}
    probe = None
    if device == "cpu":
        try:
            from zero_kernels import native

            probe = native.load()
        except ImportError:
            probe = None
    if probe is not None:
        c, d = torch.rand(n_floats), torch.rand(n_floats)
        g = torch.zeros(n_floats)
        cands["step_pattern"] = lambda: probe.stream_probe(a, g, c, d)
    res = side_by_side(cands, repeats=repeats, device=device)
    out = {
        "copy_GBps": round(8 * n_floats / res["copy"]["median_s"] / 1e9, 2),
        "rmw_GBps": round(12 * n_floats / res["rmw"]["median_s"] / 1e9, 2),
    }
    if "step_pattern" in res:
        out["step_pattern_GBps"] = round(28 * n_floats / res["step_pattern"]["median_s"] / 1e9, 2)
    out["floor_GBps"] = max(out.values())
    out["n_floats"] = n_floats
    return out


# The step patterns of the probe (`_C.stream_probe_variant`): moment dtypes and bytes per param.
PROBE_PATTERNS = {"fp32": 28, "bf16": 20, "int8": 16}
PROBE_PREFETCH = (0, 256, 512, 1024, 2048)


def probe_buffers(n: int, pattern: str) -> tuple[torch.Tensor, ...]:
    """(p, g, m, v) of ``n`` elements for the probe's ``pattern`` (64-byte aligned: torch's CPU
    allocator)."""
    p, g = torch.rand(n), torch.zeros(n)
    if pattern == "fp32":
        return p, g, torch.rand(n), torch.rand(n)
    if pattern == "bf16":
        return p, g, torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    if pattern == "int8":
        return p, g, torch.zeros(n, dtype=torch.int8), torch.zeros(n, dtype=torch.uint8)
    raise ValueError(f"pattern must be one of {tuple(PROBE_PATTERNS)}, got {pattern!r}")


def variant_name(pattern: str, prefetch: int, nt: bool, threads: int) -> str:
    return f"probe {pattern} pf{prefetch} {'nt' if nt else 'st'} t{threads}"


def stream_floor(n: int, repeats: int = 7, threads: tuple[int, ...] | None = None) -> dict:
    """The true streaming floor of each step pattern at ``n`` elements, measured now.

    Every variant of `_C.stream_probe_variant` (software prefetch distance x plain or
    non-temporal stores x thread count) is timed side by side; the floor of a pattern is its
    fastest variant. Returns {"variants": [{pattern, prefetch, nt, threads, median_ms, GBps}],
    "best": {pattern: that row}}; {} without the native extension.
    """
    try:
        from zero_kernels import native

        mod = native.load()
    except ImportError:
        mod = None
    if mod is None or not hasattr(mod, "stream_probe_variant"):
        return {}
    if threads is None:
        threads = tuple(sorted({1, torch.get_num_threads()}))
    bufs = {pat: probe_buffers(n, pat) for pat in PROBE_PATTERNS}
    cands, meta = {}, {}
    for pat, (p, g, m, v) in bufs.items():
        for pf in PROBE_PREFETCH:
            for nt in (False, True):
                for t in threads:
                    name = variant_name(pat, pf, nt, t)
                    cands[name] = lambda p=p, g=g, m=m, v=v, pf=pf, nt=nt, t=t: (
                        mod.stream_probe_variant(p, g, m, v, pf, nt, t)
                    )
                    meta[name] = {"pattern": pat, "prefetch": pf, "nt": nt, "threads": t}
    res = side_by_side(cands, repeats=repeats)
    rows = []
    for name, r in res.items():
        b = PROBE_PATTERNS[meta[name]["pattern"]]
        rows.append(
            {
                **meta[name],
                "median_ms": round(1e3 * r["median_s"], 4),
                "GBps": round(b * n / r["median_s"] / 1e9, 2),
            }
        )
    best = {}
    for row in rows:
        cur = best.get(row["pattern"])
        if cur is None or row["median_ms"] < cur["median_ms"]:
            best[row["pattern"]] = row
    return {"variants": rows, "best": best}


def best_probe(n: int, best_row: dict):
    """A callable running the probe variant ``best_row`` (from `stream_floor`) over fresh
    buffers of ``n`` elements: the floor re-timed next to the kernels."""
    from zero_kernels import native

    mod = native.load()
    p, g, m, v = probe_buffers(n, best_row["pattern"])
    pf, nt, t = best_row["prefetch"], best_row["nt"], best_row["threads"]
    return lambda: mod.stream_probe_variant(p, g, m, v, pf, nt, t)


def write_results(out_dir: str, name: str, payload: dict, rows: list[dict]) -> tuple[str, str]:
    """Write ``name``.json (everything) and ``name``.csv (the rows); returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    jpath = os.path.join(out_dir, f"{name}.json")
    cpath = os.path.join(out_dir, f"{name}.csv")
    with open(jpath, "w") as f:
        json.dump({**payload, "rows": rows}, f, indent=2)
    if rows:
        keys = list(rows[0])
        with open(cpath, "w") as f:
            f.write(",".join(keys) + "\n")
            for r in rows:
                f.write(",".join(str(r.get(k, "")) for k in keys) + "\n")
    return jpath, cpath


def markdown_table(rows: list[dict], keys: list[str]) -> str:
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------ process groups
#
# One spawned process group per candidate (its own processes and TCP store, so a process's
# peak RSS belongs to one candidate). All groups start first and stay alive; the parent runs
# one step of one group at a time (the others block on a queue, using no CPU), in rounds whose
# order rotates (A B C .. / B C .. A / ..), so drift on a shared machine hits every candidate
# alike. A step is fenced by a barrier; its time is the slower rank's.
#
# What a benchmark supplies (module-level functions, so that spawn can pickle them), as a dict:
#   imports(name)                  the candidate's libraries (before the import RSS baseline)
#   model(name, args)              -> nn.Module, built from the same seed for everyone
#   build(name, model, args, lr)   -> (step(x, y) -> loss, optimizer or engine); step calls
#                                  mark("fwd") after the forward and mark("bwd") after backward
#   batch(args, rank, i)           -> (x, y) of step i on this rank
#   ready(name, opt)               optional: -> dict added to the candidate's "ready" record
#   fingerprint(name, model, opt, args)  optional, after the last step (every rank, so it may
#                                  be collective): -> what the final record keeps of the result

MARK: dict[str, float] = {}  # end of forward / backward of the step running now
ON_MARK: list = []  # called with the phase name at each mark (RSS trials)


def mark(what: str) -> None:
    MARK[what] = time.perf_counter()
    for f in ON_MARK:
        f(what)


def marked_step(forward_loss, opt_step, zero_grad=None, backward=None):
    """-> step(x, y) -> loss: zero_grad(), forward_loss(x, y), mark("fwd"), backward(loss)
    (default loss.backward()), mark("bwd"), opt_step()."""

    def step(x, y):
        if zero_grad is not None:
            zero_grad()
        loss = forward_loss(x, y)
        mark("fwd")
        if backward is None:
            loss.backward()
        else:
            backward(loss)
        mark("bwd")
        opt_step()
        return loss

    return step


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A TCP port free now on 127.0.0.1, below the kernel's ephemeral range where it can
    (a port from that range can be taken, between choosing it and the store binding it, by a
    client socket of another group being set up: EADDRINUSE), never one given before."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    candidates = random.sample(range(max(low - 12000, 1024), low), 200) if low > 2048 else []
    for port in candidates + [0]:
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError("no free TCP port on 127.0.0.1")


def status_bytes(key: str) -> int:
    """A byte figure of /proc/self/status (VmRSS, VmHWM, ...)."""
    with open("/proc/self/status") as f:
        for ln in f:
            if ln.startswith(key + ":"):
                return int(ln.split()[1]) * 1024
    return 0


def run_group(worker, world: int, cfg, timeout: float = 1800.0) -> list:
    """``worker(rank, world, port, cfg, q)`` on ``world`` spawned ranks of one gloo group; each
    puts ``(rank, result)`` on ``q``. The results in rank order; a rank that exits with an
    error raises."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    ps = [ctx.Process(target=worker, args=(r, world, port, cfg, q)) for r in range(world)]
    for p in ps:
        p.start()
    got = dict(q.get(timeout=timeout) for _ in ps)
    for p in ps:
        p.join(60)
        if p.exitcode not in (0, None):
            raise RuntimeError(f"a rank exited with {p.exitcode}")
    return [got[r] for r in range(world)]


def init_gloo(rank: int, world: int, port: int) -> None:
    """A gloo process group on 127.0.0.1, 1 torch thread, library warnings silenced."""
    import logging
    import warnings
    from datetime import timedelta

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=900),
    )


class Waits:
    """Intervals spent in Work.wait() (Python-level, which synchronous collectives call too),
    recorded only while ``on``. Made before any import binds torch.distributed functions."""

    def __init__(self):
        self.on = False
        self.spans: list[tuple[float, float]] = []
        work = torch._C._distributed_c10d.Work
        orig = work.wait
        me = self

        def wait(w, *a, **k):
            if not me.on:
                return orig(w, *a, **k)
            t = time.perf_counter()
            try:
                return orig(w, *a, **k)
            finally:
                me.spans.append((t, time.perf_counter()))

        work.wait = wait


def union(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``spans`` clipped to [lo, hi]."""
    total, end = 0.0, lo
    for a, b in sorted(spans):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def timing_worker(bench: dict, name, rank, world, port, args, cmd_q, res_q):
    """One rank of one candidate: build, report "ready", then one step per "step" command.

    Exposed communication per step = the union of every Work.wait inside the step and, where a
    post-accumulate-grad hook fires, the time from the last gradient produced to the end of
    backward (DDP's and DeepSpeed's end-of-backward flush)."""
    import resource
    import traceback

    import torch.distributed as dist

    try:
        waits = Waits()
        init_gloo(rank, world, port)
        bench["imports"](name)
        rss_import = status_bytes("VmRSS")
        torch.manual_seed(0)
        model = bench["model"](name, args)
        psi = sum(p.numel() for p in model.parameters())
        last_grad = [None]

        def hook(_p):
            last_grad[0] = time.perf_counter()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
        step, opt = bench["build"](name, model, args, args.lr)
        ready = {"psi": psi, "rss_after_import": rss_import}
        if "ready" in bench:
            ready.update(bench["ready"](name, opt))
        dist.barrier()
        ready["rss_after_setup"] = status_bytes("VmRSS")
        res_q.put((name, rank, "ready", ready))
        i = 0
        while True:
            cmd = cmd_q.get()
            if cmd == "reset" and hasattr(opt, "reset_comm_stats"):
                opt.reset_comm_stats()
            if cmd != "step":
                if cmd == "stop":
                    break
                continue
            dist.barrier()
            for _ in range(getattr(args, "steps_per_turn", 1) - 1):  # untimed, back to back
                step(*bench["batch"](args, rank, i))
                i += 1
            x, y = bench["batch"](args, rank, i)
            i += 1
            waits.spans.clear()
            last_grad[0] = None
            waits.on = True
            t0 = time.perf_counter()
            loss = step(x, y)
            t3 = time.perf_counter()
            waits.on = False
            t1, t2 = MARK["fwd"], MARK["bwd"]
            spans = list(waits.spans)
            if last_grad[0] is not None:  # end-of-backward flush after the last gradient
                spans.append((last_grad[0], t2))
            res_q.put(
                (
                    name,
                    rank,
                    "step",
                    {
                        "step_s": t3 - t0,
                        "fwd_s": t1 - t0,
                        "bwd_s": t2 - t1,
                        "opt_s": t3 - t2,
                        "exposed_comm_s": union(spans, t0, t3),
                        "fwd_wait_s": union(list(waits.spans), t0, t1),
                        "bwd_wait_s": union(spans, t1, t2),
                        "opt_wait_s": union(list(waits.spans), t2, t3),
                        "loss": float(loss.detach()),
                    },
                )
            )
        ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        final = {"peak_rss": max(ru, status_bytes("VmHWM")), "end_rss": status_bytes("VmRSS")}
        if "fingerprint" in bench:  # after the peak is read: its own memory is not counted
            final["fingerprint"] = bench["fingerprint"](name, model, opt, args)
        if hasattr(opt, "comm_stats") and hasattr(opt, "memory_report"):  # ZeroOptimizer
            final["comm_stats"] = opt.comm_stats
            try:
                final["memory_report"] = opt.memory_report()
            except Exception as e:  # noqa: BLE001
                final["memory_report"] = f"{type(e).__name__}: {e}"
        res_q.put((name, rank, "final", final))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        res_q.put((name, rank, "error", traceback.format_exc()))


def run_timing(bench: dict, args, cands: list[str], log, tag: str = "[timing]", world: int = 2):
    """Start a group per candidate, run ``args.warmup + args.repeats`` rotated rounds.

    ``args.steps_per_turn`` (default 1): steps a candidate's ranks run in one turn, back to
    back after one barrier, only the last timed. With 1, what a step leaves in flight (an
    all-gather waited for by the next forward) completes off the clock, during the barrier and the
    other candidates' turns; with 2 the timed step starts right after its predecessor and pays for
    what that one left.

    -> {"setup": {name: {rank: ready}}, "steps": {name: [{rank: step}, ...]} (measured rounds),
    "finals": {name: {rank: final}}}."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    res_q = ctx.Queue()
    procs, cmd_qs = [], {}
    for name in cands:
        port = free_port()
        for r in range(world):
            q = ctx.Queue()
            cmd_qs[(name, r)] = q
            p = ctx.Process(
                target=timing_worker,
                args=(bench, name, r, world, port, args, q, res_q),
                daemon=True,
            )
            p.start()
            procs.append(p)

    def collect(kind: str, n: int) -> list[tuple]:
        out = []
        while len(out) < n:
            name, rank, k, payload = res_q.get(timeout=900)
            if k == "error":
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{name} rank {rank} failed:\n{payload}")
            assert k == kind, (name, rank, k, kind)
            out.append((name, rank, payload))
        return out

    t0 = time.perf_counter()
    setup: dict = {}
    for name, rank, info in collect("ready", world * len(cands)):
        setup.setdefault(name, {})[rank] = info
    log(f"{tag} {len(cands)} candidate groups ready in {time.perf_counter() - t0:.0f}s")
    steps: dict = {n: [] for n in cands}
    n_rounds = args.warmup + args.repeats
    for rnd in range(n_rounds):
        if rnd == args.warmup:
            for q in cmd_qs.values():
                q.put("reset")
        k = rnd % len(cands)
        for name in cands[k:] + cands[:k]:
            for r in range(world):
                cmd_qs[(name, r)].put("step")
            got = {rank: s for _, rank, s in collect("step", world)}
            if rnd >= args.warmup:
                steps[name].append(got)
        if rnd >= args.warmup:
            log(
                f"{tag} round {rnd + 1}/{n_rounds}: "
                + " ".join(
                    f"{n}={max(s['step_s'] for s in steps[n][-1].values()):.3f}s" for n in cands
                )
            )
    for q in cmd_qs.values():
        q.put("stop")
    finals: dict = {}
    for name, rank, f in collect("final", world * len(cands)):
        finals.setdefault(name, {})[rank] = f
    for p in procs:
        p.join(timeout=60)
    return {"setup": setup, "steps": steps, "finals": finals}


def per_round(steps: dict, name: str, key: str = "step_s") -> list[float]:
    """``key`` of each measured round of ``name``, the slower rank's."""
    return [max(s[key] for s in st.values()) for st in steps[name]]


def paired(steps: dict, name: str, other: str | None) -> float | str:
    """Median over rounds of ``name``'s step time / ``other``'s in the same round ("" when
    ``other`` was not run)."""
    if other not in steps:
        return ""
    ratios = [a / b for a, b in zip(per_round(steps, name), per_round(steps, other), strict=True)]
    return round(statistics.median(ratios), 3)


def run_info(script: str) -> dict:
    """machine() plus the command of ``script`` (bench/<script>), DeepSpeed's version (or why it
    is not available), uncommitted changes of the library, the date and the load average."""
    info = machine()
    info["command"] = f"python bench/{script} " + " ".join(sys.argv[1:])
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except Exception as e:  # noqa: BLE001
        info["deepspeed"] = f"not available: {type(e).__name__}: {e}"
    # other work may be in progress in this tree: say whether the library was committed
    here = os.path.dirname(os.path.abspath(__file__))
    info["zero_kernels_uncommitted_changes"] = git_status(
        os.path.join(here, ".."), "zero_kernels", "csrc"
    )
    info["date"] = time.strftime("%Y-%m-%d %H:%M %Z")
    info["load_avg_at_start"] = os.getloadavg()
    return info


def git_status(path: str, *what: str) -> list[str]:
    """``git status --porcelain`` of ``what`` under ``path`` (uncommitted library changes)."""
    try:
        return subprocess.run(
            ["git", "status", "--porcelain", "--", *what],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=path,
        ).stdout.split("\n")[:20]
    except OSError:
        return []


def strip_host_cache(name: str) -> str:
    """A candidate named ``<name>_nocache`` (e.g. ``ours_reshard_nocache``): ZeroOptimizer does
    not install the host block cache in this process (``ZERO_KERNELS_HOST_CACHE=0``, see
    zero_kernels.hostmem); ``<name>_hostcache`` (e.g. ``ddp_hostcache``): the cache is installed
    here before the candidate is built, as a script of any kind can. Returns ``<name>``; other
    names are returned as they are."""
    if name.endswith("_nocache"):
        os.environ["ZERO_KERNELS_HOST_CACHE"] = "0"
        return name[: -len("_nocache")]
    if name.endswith("_hostcache"):
        from zero_kernels import hostmem

        if not hostmem.install():
            raise RuntimeError(f"{name}: the host block cache is unavailable here")
        return name[: -len("_hostcache")]
    return name


def strip_read_guard(name: str) -> str:
    """A candidate named ``<name>_noguard`` (e.g. ``ours_reshard_noguard``): stage 3's read guard
    ([Note: external params] in zero_kernels/partition/external.py) is left off in this process,
    as it is where dynamo runs the forward, to measure what it costs. Returns ``<name>``."""
    if not name.endswith("_noguard"):
        return name
    from zero_kernels.partition import units

    units.under_dynamo = lambda: True
    return name[: -len("_noguard")]


def strip_mmap_threshold(name: str) -> str:
    """A candidate named ``<name>_mmap<KiB>`` (e.g. ``ddp_mmap4096``): fix glibc's mmap threshold
    at that many KiB in this process (``mallopt(M_MMAP_THRESHOLD)``, as ``MALLOC_MMAP_THRESHOLD_``
    does at start) and return ``<name>``; other names are returned as they are."""
    if "_mmap" not in name:
        return name
    import ctypes

    name, kib = name.rsplit("_mmap", 1)
    if not ctypes.CDLL("libc.so.6").mallopt(-3, int(kib) * 1024):  # -3: M_MMAP_THRESHOLD
        raise RuntimeError(f"mallopt(M_MMAP_THRESHOLD, {kib} KiB) failed")
    return name
