"""ZeRO stages end to end (issue 3, "Measured"): step time, exposed communication and peak RSS
at world size 2 side by side, and per-rank model-state bytes at world sizes 1-4 against the
formula.

Part 1, timing (world size 2, gloo on CPU, 1 thread per rank). Candidates:

    ddp                      DDP + torch.optim.AdamW
    torch_zero_redundancy    DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
    deepspeed_stage{1,2}     deepspeed.initialize, zero_optimization stage 1/2, fp32, client
                             optimizer torch.optim.AdamW (same math and code as DDP's)
    deepspeed_stage{1,2}_cpuadam   the same with DeepSpeedCPUAdam(adamw_mode=True), DeepSpeed's
                             own fused CPU kernel (--ds-adam torch|cpu|both)
    ours_stage{1,2}          zero_kernels.ZeroOptimizer(model, AdamW, stage=1/2)

Same model (seed 0), same per-rank batches, lr, weight decay, betas, eps; gradient buckets of
--bucket-mb MiB everywhere (DDP bucket_cap_mb, DeepSpeed reduce/allgather_bucket_size in
elements, ZeroOptimizer bucket_size_mb); DeepSpeed with overlap_comm and contiguous_gradients on.

Design: every candidate runs in its own spawned process group (its own 2 processes, own TCP
store), so each process's peak RSS (ru_maxrss == VmHWM) belongs to one candidate. All groups are
started first and stay alive; the parent then runs steps round by round, one candidate group at a
time (the others block on a queue, using no CPU), rotating the order every round
(A B C .. / B C .. A / ...), so drift on the shared machine hits all candidates alike. Each step is
fenced by a barrier; its time is the slower rank's; medians over the measured rounds.

Exposed communication per step = the union of (a) the time from the last gradient produced
(post-accumulate-grad hook on every parameter) to the return of backward, i.e. DDP's and
DeepSpeed's end-of-backward bucket flush and wait, and (b) every Python-level wait on a
collective inside the step (torch's Work.wait, which sync collectives call too): ZeroOptimizer's
reduce-scatter and all-gather waits, ZeroRedundancyOptimizer's broadcasts, DeepSpeed's gloo
reductions (synchronous on CPU, so they block even inside backward).

Part 2, memory (world sizes 1-4, all groups at once: tensor counts do not depend on timing): after
one step, per-rank bytes counted from the tensors: stage 0 = DDP + AdamW (params, .grad, AdamW
state), stages 1/2 = ZeroOptimizer.memory_report(); against zero_kernels.estimate (fp32, AdamW).

    python bench/bench_stages.py [--quick] [--out DIR] [--repeats 10] [--ds-adam both]
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import socket
import statistics
import sys
import time
import traceback
from datetime import timedelta

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

from harness import machine, markdown_table, write_results  # noqa: E402

MB = 1e6


class GPT(nn.Module):
    def __init__(self, vocab, d, layers):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        for b in self.blocks:
            h = b(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for ln in f:
            if ln.startswith(key + ":"):
                return int(ln.split()[1]) * 1024
    return 0


def _init(rank: int, world: int, port: int) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
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


def _batch(args, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, args.vocab, (args.batch, args.tokens), generator=g)


def _loss(out: torch.Tensor, x: torch.Tensor, vocab: int) -> torch.Tensor:
    return nn.functional.cross_entropy(out[:, :-1].reshape(-1, vocab), x[:, 1:].reshape(-1))


# ------------------------------------------------------------------------------------ timing


class _Waits:
    """Intervals spent in Work.wait() (Python-level), recorded only while ``on``."""

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


def _union(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    total, end = 0.0, lo
    for a, b in sorted(spans):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def _build(name: str, model: nn.Module, args):
    """-> (forward, backward(loss), zero_grad, step, optimizer-or-engine)."""
    kw = dict(lr=args.lr, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)
    bucket_elems = int(args.bucket_mb * 2**20) // 4
    if name == "ddp" or name == "torch_zero_redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
        opt = (
            torch.optim.AdamW(model.parameters(), **kw)
            if name == "ddp"
            else ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **kw)
        )
        return (
            ddp,
            lambda loss: loss.backward(),
            lambda: opt.zero_grad(set_to_none=True),
            opt.step,
            opt,
        )
    if name.startswith("ours_stage"):
        from zero_kernels import ZeroOptimizer

        opt = ZeroOptimizer(
            model, torch.optim.AdamW, stage=int(name[-1]), bucket_size_mb=args.bucket_mb, **kw
        )
        return model, lambda loss: loss.backward(), opt.zero_grad, opt.step, opt
    if name.startswith("deepspeed_stage"):
        import logging

        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        stage = int(name[len("deepspeed_stage")])
        if name.endswith("_cpuadam"):
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            opt = DeepSpeedCPUAdam(model.parameters(), adamw_mode=True, **kw)
        else:
            opt = torch.optim.AdamW(model.parameters(), **kw)
        cfg = {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "fp16": {"enabled": False},
            "bf16": {"enabled": False},
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": bucket_elems,
                "allgather_bucket_size": bucket_elems,
                "overlap_comm": True,
                "contiguous_gradients": True,
                "reduce_scatter": True,
            },
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=opt, config=cfg, dist_init_required=False
        )
        return engine, engine.backward, lambda: None, engine.step, engine
    raise ValueError(f"unknown candidate {name!r}")


def timing_worker(name, rank, world, port, args, cmd_q, res_q):
    try:
        waits = _Waits()  # before any import binds torch.distributed functions
        _init(rank, world, port)
        if name.startswith("deepspeed"):  # the library's own import is not training memory
            import deepspeed  # noqa: F401
            from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401
        elif name.startswith("ours"):
            import zero_kernels  # noqa: F401
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: F401
        rss_import = _status_bytes("VmRSS")
        torch.manual_seed(0)
        model = GPT(args.vocab, args.d, args.layers)
        psi = sum(p.numel() for p in model.parameters())
        last_grad = [0.0]

        def hook(_p):
            last_grad[0] = time.perf_counter()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
        fwd, bwd, zero_grad, step, opt = _build(name, model, args)
        dist.barrier()
        res_q.put(
            (
                name,
                rank,
                "ready",
                {
                    "psi": psi,
                    "rss_after_import": rss_import,
                    "rss_after_setup": _status_bytes("VmRSS"),
                },
            )
        )
        i = 0
        while True:
            cmd = cmd_q.get()
            if cmd == "reset" and name.startswith("ours"):
                opt.reset_comm_stats()
            if cmd != "step":
                if cmd == "stop":
                    break
                continue
            x = _batch(args, rank, i)
            i += 1
            dist.barrier()
            waits.spans.clear()
            waits.on = True
            t0 = time.perf_counter()
            zero_grad()
            loss = _loss(fwd(x), x, args.vocab)
            t1 = time.perf_counter()
            last_grad[0] = t1
            bwd(loss)
            t2 = time.perf_counter()
            step()
            t3 = time.perf_counter()
            waits.on = False
            exposed = _union(waits.spans + [(last_grad[0], t2)], t0, t3)
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
                        "exposed_comm_s": exposed,
                        "loss": float(loss.detach()),
                    },
                )
            )
        ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        final = {"peak_rss": max(ru, _status_bytes("VmHWM")), "end_rss": _status_bytes("VmRSS")}
        if name.startswith("ours"):
            final["comm_stats"] = opt.comm_stats
            try:
                final["memory_report"] = opt.memory_report()
            except Exception as e:  # noqa: BLE001
                final["memory_report"] = f"{type(e).__name__}: {e}"
        res_q.put((name, rank, "final", final))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        res_q.put((name, rank, "error", traceback.format_exc()))


def run_timing(args, cands: list[str], log) -> dict:
    ctx = mp.get_context("spawn")
    res_q = ctx.Queue()
    world = 2
    procs, cmd_qs = [], {}
    for name in cands:
        port = _free_port()
        for r in range(world):
            q = ctx.Queue()
            cmd_qs[(name, r)] = q
            p = ctx.Process(
                target=timing_worker, args=(name, r, world, port, args, q, res_q), daemon=True
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
    setup = {}
    for name, rank, info in collect("ready", world * len(cands)):
        setup.setdefault(name, {})[rank] = info
    log(f"[stages] {len(cands)} candidate groups ready in {time.perf_counter() - t0:.0f}s")
    steps = {n: [] for n in cands}
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
        log(
            f"[stages] round {rnd + 1}/{n_rounds}: "
            + " ".join(
                f"{n}={max(s['step_s'] for s in steps[n][-1].values()):.2f}s"
                for n in cands
                if rnd >= args.warmup
            )
        )
    for q in cmd_qs.values():
        q.put("stop")
    finals = {}
    for name, rank, f in collect("final", world * len(cands)):
        finals.setdefault(name, {})[rank] = f
    for p in procs:
        p.join(timeout=60)
    return {"setup": setup, "steps": steps, "finals": finals}


def summarize_timing(raw: dict, cands: list[str]) -> list[dict]:
    rows = []
    steps = raw["steps"]

    def med(name, key, agg=max):
        return statistics.median(agg(s[key] for s in st.values()) for st in steps[name])

    def paired(name, other):
        """Median over rounds of this candidate's step time / ``other``'s in the same round."""
        if other not in steps:
            return ""
        return round(
            statistics.median(
                max(s["step_s"] for s in a.values()) / max(s["step_s"] for s in b.values())
                for a, b in zip(steps[name], steps[other], strict=True)
            ),
            3,
        )

    base = med("ddp", "step_s") if "ddp" in steps else None
    for name in cands:
        step = med(name, "step_s")
        fin, su = raw["finals"][name], raw["setup"][name]
        peak = max(f["peak_rss"] for f in fin.values())
        row = {
            "candidate": name,
            "median_step_s": round(step, 4),
            "vs_ddp": round(step / base, 3) if base else "",
            "vs_ddp_paired": paired(name, "ddp"),
            "min_step_s": round(
                min(max(s["step_s"] for s in st.values()) for st in steps[name]), 4
            ),
            "fwd_s": round(med(name, "fwd_s"), 4),
            "bwd_s": round(med(name, "bwd_s"), 4),
            "opt_s": round(med(name, "opt_s"), 4),
            "exposed_comm_s": round(med(name, "exposed_comm_s"), 4),
            "peak_rss_MB": round(peak / MB, 1),
            "rss_after_import_MB": round(max(s["rss_after_import"] for s in su.values()) / MB, 1),
            "peak_minus_import_MB": round(
                max(fin[r]["peak_rss"] - su[r]["rss_after_import"] for r in fin) / MB, 1
            ),
            "end_rss_MB": round(max(f["end_rss"] for f in fin.values()) / MB, 1),
            "last_loss_rank0": round(steps[name][-1][0]["loss"], 5),
            "n": len(steps[name]),
        }
        if name.startswith("ours"):
            cs = fin[0]["comm_stats"]
            row["own_exposed_comm_s"] = round(cs["exposed_comm_s"] / max(cs["steps"], 1), 4)
        rows.append(row)
    for row in rows:  # same-stage DeepSpeed ratio for ours
        if row["candidate"].startswith("ours_stage"):
            s = row["candidate"][-1]
            for ds in (f"deepspeed_stage{s}", f"deepspeed_stage{s}_cpuadam"):
                other = next((r for r in rows if r["candidate"] == ds), None)
                if other:
                    row[f"speedup_vs_{ds}"] = round(
                        other["median_step_s"] / row["median_step_s"], 3
                    )
                    row[f"speedup_vs_{ds}_paired"] = paired(ds, row["candidate"])
    return rows


# ------------------------------------------------------------------------------------ memory


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


def memory_worker(rank, world, port, args, res_q):
    try:
        _init(rank, world, port)
        from torch.nn.parallel import DistributedDataParallel as DDP

        from zero_kernels import ZeroOptimizer

        torch.manual_seed(0)
        base = GPT(args.vocab, args.d, args.layers)
        psi = sum(p.numel() for p in base.parameters())
        kw = dict(lr=args.lr, weight_decay=0.01)
        x = _batch(args, rank, 0)
        rows = []
        for stage in (0, 1, 2):
            m = copy.deepcopy(base)
            if stage == 0:
                fwd = DDP(m, bucket_cap_mb=args.bucket_mb)
                opt = torch.optim.AdamW(m.parameters(), **kw)
            else:
                fwd = m
                opt = ZeroOptimizer(
                    m, torch.optim.AdamW, stage=stage, bucket_size_mb=args.bucket_mb, **kw
                )
            opt.zero_grad()
            _loss(fwd(x), x, args.vocab).backward()
            opt.step()
            if stage == 0:
                params = list(m.parameters())  # a tied tensor once
                r = dict(
                    param_bytes=sum(_tensor_bytes(p) for p in params),
                    grad_bytes=sum(_tensor_bytes(p.grad) for p in params),
                    master_bytes=0,
                    optim_state_bytes=sum(
                        _tensor_bytes(v) for st in opt.state.values() for v in st.values()
                    ),
                )
                r["grad_peak_bytes"] = r["grad_bytes"]
            else:
                r = opt.memory_report()
            r.setdefault("grad_peak_bytes", r["grad_bytes"])
            r.setdefault("comm_buffer_bytes", 0)
            r.setdefault("comm_buffer_peak_bytes", 0)
            rows.append({"stage": stage, "world_size": world, "rank": rank, "psi": psi, **r})
            del fwd, opt, m
        res_q.put(("ok", rows))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        res_q.put(("error", traceback.format_exc()))


def run_memory(args, world_sizes: list[int]) -> list[dict]:
    from zero_kernels.estimate import estimate_stage

    ctx = mp.get_context("spawn")
    res_q = ctx.Queue()
    procs = []
    for ws in world_sizes:
        port = _free_port()
        for r in range(ws):
            p = ctx.Process(target=memory_worker, args=(r, ws, port, args, res_q), daemon=True)
            p.start()
            procs.append(p)
    per_rank = []
    for _ in procs:
        k, payload = res_q.get(timeout=900)
        if k == "error":
            for p in procs:
                p.kill()
            raise RuntimeError(payload)
        per_rank += payload
    for p in procs:
        p.join(timeout=60)
    rows = []
    for ws in world_sizes:
        for stage in (0, 1, 2):
            rs = [r for r in per_rank if r["world_size"] == ws and r["stage"] == stage]
            psi = rs[0]["psi"]
            est = estimate_stage(stage, psi, ws, precision="fp32", optimizer="adamw")

            def mx(key, rs=rs):
                return max(r[key] for r in rs)

            optim = max(r["optim_state_bytes"] + r["master_bytes"] for r in rs)
            total = max(
                r["param_bytes"] + r["grad_bytes"] + r["optim_state_bytes"] + r["master_bytes"]
                for r in rs
            )
            rows.append(
                {
                    "world_size": ws,
                    "stage": stage,
                    "params_MB": round(mx("param_bytes") / MB, 2),
                    "params_formula_MB": round(est.params_bytes / MB, 2),
                    "grads_MB": round(mx("grad_bytes") / MB, 2),
                    "grads_peak_MB": round(mx("grad_peak_bytes") / MB, 2),
                    "grads_formula_MB": round(est.grads_bytes / MB, 2),
                    "comm_buffers_MB": round(mx("comm_buffer_bytes") / MB, 2),
                    "comm_buffers_peak_MB": round(mx("comm_buffer_peak_bytes") / MB, 2),
                    "optim_state_MB": round(mx("optim_state_bytes") / MB, 2),
                    "master_MB": round(mx("master_bytes") / MB, 2),
                    "optim_total_MB": round(optim / MB, 2),
                    "optim_formula_MB": round(est.optim_bytes / MB, 2),
                    "total_MB": round(total / MB, 2),
                    "total_formula_MB": round(est.total_bytes / MB, 2),
                    "total_vs_formula": round(total / est.total_bytes, 4),
                    "total_minus_formula_B": int(total - est.total_bytes),
                    "total_minus_master_vs_formula": round(
                        (total - mx("master_bytes")) / est.total_bytes, 4
                    ),
                }
            )
    return rows


# ------------------------------------------------------------------------------------ main


def main():
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run (~1 min): tiny model, 1 warm-up + 2 rounds, memory at N=2",
    )
    ap.add_argument(
        "--out",
        default=os.path.join(HERE, "results"),
        help="folder for stages_ws2.{json,csv} and stages_memory.{json,csv}",
    )
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d", type=int, default=320)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=16, help="measured rounds")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument(
        "--ds-adam",
        choices=("torch", "cpu", "both", "none"),
        default=None,
        help="DeepSpeed's optimizer: torch AdamW, DeepSpeedCPUAdam, both or skip "
        "(default both; torch with --quick)",
    )
    ap.add_argument("--mem-world-sizes", default="1,2,3,4")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.d, args.vocab, args.tokens = 2, 64, 1024, 32
        args.warmup, args.repeats = 1, 2
        args.mem_world_sizes = "2"
    if args.ds_adam is None:
        args.ds_adam = "torch" if args.quick else "both"
    t_start = time.perf_counter()

    def log(msg):
        print(msg, flush=True)

    try:
        import deepspeed

        ds_version = deepspeed.__version__
    except Exception as e:  # noqa: BLE001
        ds_version = None
        log(f"[stages] DeepSpeed not measured: {type(e).__name__}: {e}")
    cands = ["ddp", "torch_zero_redundancy"]
    if ds_version:
        for s in (1, 2):
            if args.ds_adam in ("torch", "both"):
                cands.append(f"deepspeed_stage{s}")
            if args.ds_adam in ("cpu", "both"):
                cands.append(f"deepspeed_stage{s}_cpuadam")
    cands += ["ours_stage1", "ours_stage2"]
    info = machine()
    info["command"] = "python bench/bench_stages.py " + " ".join(sys.argv[1:])
    info["deepspeed"] = ds_version
    try:  # other work may be in progress in this tree: say whether the library was committed
        import subprocess

        info["zero_kernels_uncommitted_changes"] = subprocess.run(
            ["git", "status", "--porcelain", "--", "zero_kernels", "csrc"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=os.path.join(HERE, ".."),
        ).stdout.split("\n")[:20]
    except OSError:
        pass
    info["date"] = time.strftime("%Y-%m-%d %H:%M %Z")
    info["load_avg_at_start"] = os.getloadavg()
    config = {
        k: getattr(args, k)
        for k in (
            "layers",
            "d",
            "vocab",
            "batch",
            "tokens",
            "lr",
            "warmup",
            "repeats",
            "bucket_mb",
            "ds_adam",
        )
    }
    if not args.skip_timing:
        raw = run_timing(args, cands, log)
        info["load_avg_after_timing"] = os.getloadavg()
        rows = summarize_timing(raw, cands)
        psi = raw["setup"]["ddp"][0]["psi"]
        ours = {n: raw["finals"][n][0] for n in cands if n.startswith("ours")}
        j, c = write_results(
            args.out,
            "stages_ws2",
            {
                "machine": info,
                "config": config,
                "world_size": 2,
                "params": psi,
                "ours": ours,
                "per_step": raw["steps"],
                "setup": raw["setup"],
            },
            rows,
        )
        log(f"[stages] {psi / 1e6:.2f}M params, world size 2; wrote {j} {c}")
        log(
            markdown_table(
                rows,
                [
                    "candidate",
                    "median_step_s",
                    "vs_ddp",
                    "vs_ddp_paired",
                    "fwd_s",
                    "bwd_s",
                    "opt_s",
                    "exposed_comm_s",
                    "peak_rss_MB",
                    "peak_minus_import_MB",
                    "end_rss_MB",
                    "last_loss_rank0",
                ],
            )
        )
        for r in rows:
            extra = {k: v for k, v in r.items() if k.startswith(("speedup", "own_"))}
            if extra:
                log(f"  {r['candidate']}: {extra}")
    if not args.skip_memory:
        ws = [int(w) for w in args.mem_world_sizes.split(",")]
        mrows = run_memory(args, ws)
        j, c = write_results(
            args.out,
            "stages_memory",
            {
                "machine": info,
                "config": config,
                "formula": "zero_kernels.estimate.estimate_stage(stage, psi, N, precision='fp32', "
                "optimizer='adamw'); measured = max over ranks after one step",
            },
            mrows,
        )
        log(f"[stages] memory per rank (MB, max over ranks); wrote {j} {c}")
        log(
            markdown_table(
                mrows,
                [
                    "world_size",
                    "stage",
                    "params_MB",
                    "params_formula_MB",
                    "grads_MB",
                    "grads_peak_MB",
                    "grads_formula_MB",
                    "comm_buffers_MB",
                    "optim_state_MB",
                    "master_MB",
                    "optim_formula_MB",
                    "total_MB",
                    "total_formula_MB",
                    "total_vs_formula",
                    "total_minus_formula_B",
                ],
            )
        )
    log(f"[stages] done in {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
