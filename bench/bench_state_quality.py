"""Quality of low-bit optimizer state (issue 25): loss of 8-bit / bf16 AdamW state vs fp32.

Two models, each trained ``--steps`` steps from the same init on the same batches by every
optimizer (the byte-level KJV corpus of `zero_kernels.tools.models`):

  demo   `zero_kernels.tools.models.build_gpt("small")` (the demo's model: 4 layers, 4 heads,
         n_embd 128, context 128, byte vocabulary 256, tied head; ~0.84M params), batch 8
  gpt2   transformers' ``GPT2LMHeadModel`` from a ``GPT2Config`` (GPT-2's code: tied
         embeddings, learned positions, pre-LN, gelu_new, Conv1D, GPT-2 init) scaled down to
         6 layers, 6 heads, n_embd 192, context 128, byte vocabulary 256 (~2.7M params; dropout
         0), batch 8. GPT-2's BPE vocabulary (50257) is not used: its tokenizer is not on this
         machine and its 50257 x n_embd head would dominate the CPU time.

AdamW hyper-parameters, all optimizers: peak lr 2e-3, linear warmup over the first 10% of the
steps then cosine to 10% of peak, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on every param,
grad-norm clipping at 1.0. Optimizers:

  torch fp32        torch.optim.AdamW(fused=True): the baseline
  torch fp32 seed1  the same from another init seed (same batches): the seed-to-seed spread
                    that a 1% difference is to be read against
  zk fp32 / bf16 / int8   zero_kernels.FusedAdamW(state_dtype=..., state_block=256)
  bnb int8          bitsandbytes.optim.AdamW8bit (defaults: blockwise, min_8bit_size 4096)
  torchao int8/int4 torchao.optim.AdamW8bit (block 256) / AdamW4bit (block 128); their step
                    is torch.compile'd per param shape (the first steps include compile time)
  demo only: zk int8 with state_block 128 / 1024 / 2048 (the block-size sweep)

All runs advance one step at a time in turn (A B C ... per step, as bench/harness.py's
side_by_side), so that machine drift hits every optimizer alike; step times are medians over
the steps. A peer that is not installed or fails is reported with its error and left out.

Reported per run: every step finite, final loss (mean of the last 20 steps), its relative
difference to "torch fp32", the largest per-step relative difference, optimizer state bytes
(sum over the state's tensors, tensor subclasses by their inner tensors, shared tensors once;
the peak over the run), median optimizer step ms and median train step ms.

    python bench/bench_state_quality.py [--steps 300] [--models demo,gpt2]
        [--peers bnb,torchao] [--out bench/results/state_quality.json]
        [--plot bench/results/state_quality.png] [--params bf16]

``--params bf16``: the models in bf16, and instead of the optimizers above the ways of keeping
bf16 params (``bf16_stochastic_round``, [Note: stochastic rounding] in zero_kernels/ops/sr.py):

  bf16 master       fp32 master copies stepped by zero_kernels.FusedAdamW (fp32 moments), the
                    bf16 params their round to nearest after each step (ZeroOptimizer's mixed
                    precision, and the apex/DeepSpeed recipe): the baseline of this mode
  bf16 master seed1 the same from another init seed
  zk sr fp32 / int8 zero_kernels.FusedAdamW(bf16_stochastic_round=True, state_dtype=...): no
                    master, the step on an fp32 copy rounded back stochastically
  zk nearest        zero_kernels.FusedAdamW on the bf16 params, no master, bf16 moments, round to
                    nearest (pure bf16)
  torch bf16        torch.optim.AdamW(fused=True) on the bf16 params (the same, torch's kernel)
  torchao sr        torchao.optim._AdamW(bf16_stochastic_round=True), where torchao imports
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import textwrap
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import markdown_table, run_info  # noqa: E402

LAST = 20  # final loss = mean of the last LAST steps
TARGET = 0.01  # issue 25: within 1% of the fp32 loss
BASE = "torch fp32"  # the baseline (``--params bf16``: BF16_BASE)
BF16_BASE = "bf16 master"
PARAMS = "fp32"  # --params
ONLY: set[str] = set()  # --only
HP = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CLIP = 1.0
BATCH = 8
SEED = 0
SWEEP_BLOCKS = (128, 1024, 2048)  # plus the main run's 256

MODELS = {
    "demo": dict(
        kind="demo",
        size="small",
        block_size=128,
        shape="zero_kernels.tools.models GPT 'small': 4 layers, 4 heads, n_embd 128, ctx 128, "
        "vocab 256 (bytes), tied head",
    ),
    "gpt2": dict(
        kind="gpt2",
        n_layer=6,
        n_head=6,
        n_embd=192,
        block_size=128,
        shape="transformers GPT2LMHeadModel: 6 layers, 6 heads, n_embd 192, n_positions 128, "
        "vocab 256 (bytes), tied embeddings, learned positions, pre-LN, gelu_new, dropout 0",
    ),
}


# ------------------------------------------------------------------------------ peers


def peer_status() -> dict[str, str]:
    """Import each peer library: its version, or why it is not available."""
    out = {}
    try:
        import bitsandbytes as bnb

        out["bitsandbytes"] = bnb.__version__
    except Exception as e:  # noqa: BLE001
        out["bitsandbytes"] = f"not available: {type(e).__name__}: {e}"
    try:
        import torchao
        import torchao.optim  # noqa: F401

        out["torchao"] = torchao.__version__
    except Exception as e:  # noqa: BLE001
        out["torchao"] = f"not available: {type(e).__name__}: {e}"
    return out


class MasterAdamW:
    """bf16 params with fp32 masters: FusedAdamW steps the masters, the params are their round to
    nearest (what ZeroOptimizer does for bf16 params without ``bf16_stochastic_round``)."""

    def __init__(self, params, **hp):
        import zero_kernels

        self.params = list(params)
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.inner = zero_kernels.FusedAdamW(self.masters, **hp)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def bf16_optimizers(peers: dict[str, str], use: set[str]) -> dict[str, dict]:
    """``--params bf16``: name -> {make, seed}; the baseline first."""
    import zero_kernels

    def zk(**kw):
        return lambda ps: zero_kernels.FusedAdamW(ps, **HP, **kw)

    opts = {
        BF16_BASE: dict(make=lambda ps: MasterAdamW(ps, **HP), seed=SEED),
        "bf16 master seed1": dict(make=lambda ps: MasterAdamW(ps, **HP), seed=SEED + 1),
        "zk sr fp32": dict(make=zk(bf16_stochastic_round=True), seed=SEED),
        "zk sr int8": dict(make=zk(bf16_stochastic_round=True, state_dtype="int8"), seed=SEED),
        "zk nearest": dict(make=zk(), seed=SEED),
        "torch bf16": dict(make=lambda ps: torch.optim.AdamW(ps, **HP, fused=True), seed=SEED),
    }
    if "torchao" in use and not peers["torchao"].startswith("not available"):
        from torchao.optim import _AdamW

        opts["torchao sr"] = dict(
            make=lambda ps: _AdamW(ps, **HP, bf16_stochastic_round=True), seed=SEED
        )
    return opts


def optimizers(model_name: str, peers: dict[str, str], use: set[str]) -> dict[str, dict]:
    """name -> {make(params) -> optimizer, seed, note}; peers only where they import."""
    import zero_kernels

    if PARAMS == "bf16":
        return bf16_optimizers(peers, use)

    def zk(state_dtype, block=256):
        return lambda ps: zero_kernels.FusedAdamW(
            ps, **HP, state_dtype=state_dtype, state_block=block
        )

    opts = {
        BASE: dict(make=lambda ps: torch.optim.AdamW(ps, **HP, fused=True), seed=SEED),
        "torch fp32 seed1": dict(
            make=lambda ps: torch.optim.AdamW(ps, **HP, fused=True), seed=SEED + 1
        ),
        "zk fp32": dict(make=zk("fp32"), seed=SEED),
        "zk bf16": dict(make=zk("bf16"), seed=SEED),
        "zk int8": dict(make=zk("int8"), seed=SEED),
    }
    if "bnb" in use and not peers["bitsandbytes"].startswith("not available"):
        import bitsandbytes as bnb

        opts["bnb int8"] = dict(make=lambda ps: bnb.optim.AdamW8bit(ps, **HP), seed=SEED)
    if "torchao" in use and not peers["torchao"].startswith("not available"):
        from torchao.optim import AdamW4bit, AdamW8bit

        opts["torchao int8"] = dict(make=lambda ps: AdamW8bit(ps, **HP), seed=SEED)
        opts["torchao int4"] = dict(make=lambda ps: AdamW4bit(ps, **HP), seed=SEED)
    if model_name == "demo":
        for b in SWEEP_BLOCKS:
            opts[f"zk int8 b{b}"] = dict(make=zk("int8", b), seed=SEED)
    return opts


# ------------------------------------------------------------------------------ models


def build_model(cfg: dict, seed: int) -> torch.nn.Module:
    m = _build_model(cfg, seed)
    return m.to(torch.bfloat16) if PARAMS == "bf16" else m


def _build_model(cfg: dict, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if cfg["kind"] == "demo":
        from zero_kernels.tools.models import build_gpt

        return build_gpt(cfg["size"])
    from transformers import GPT2Config, GPT2LMHeadModel

    conf = GPT2Config(
        vocab_size=256,
        n_positions=cfg["block_size"],
        n_embd=cfg["n_embd"],
        n_layer=cfg["n_layer"],
        n_head=cfg["n_head"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    return GPT2LMHeadModel(conf)


def loss_of(cfg: dict, model, x, y) -> torch.Tensor:
    if cfg["kind"] == "demo":
        return model(x, y)
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))


def lr_at(step: int, steps: int) -> float:
    """Linear warmup over 10% of the steps, then cosine from the peak to 10% of it."""
    warm = max(1, steps // 10)
    if step < warm:
        return HP["lr"] * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm - 1)
    return HP["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def set_lr(opt, lr: float) -> None:
    for g in opt.param_groups:
        if isinstance(g["lr"], torch.Tensor):  # torchao keeps lr as a tensor (fill_ it)
            g["lr"].fill_(lr)
        else:
            g["lr"] = lr


def _tensors(v):
    """The plain tensors behind a state value (tensor subclasses by their inner tensors)."""
    if isinstance(v, torch.Tensor):
        if type(v) is not torch.Tensor and hasattr(v, "__tensor_flatten__"):
            attrs, _ = v.__tensor_flatten__()
            for a in attrs:
                yield from _tensors(getattr(v, a))
        else:
            yield v
    elif isinstance(v, (list, tuple)):
        for u in v:
            yield from _tensors(u)
    elif isinstance(v, dict):
        for u in v.values():
            yield from _tensors(u)


def state_bytes(opt) -> int:
    """The optimizer's state tensors, and the fp32 masters where it keeps them (MasterAdamW)."""
    seen, total = set(), 0
    for t in getattr(opt, "masters", []):
        seen.add((t.data_ptr(), t.numel() * t.element_size()))
        total += t.numel() * t.element_size()
    for st in opt.state.values():
        for t in _tensors(st):
            nb = t.numel() * t.element_size()
            key = (t.data_ptr(), nb)
            if key in seen:
                continue
            seen.add(key)
            total += nb
    return total


# ------------------------------------------------------------------------------ runs


def run_model(name: str, cfg: dict, steps: int, peers: dict[str, str], use: set[str], log):
    from zero_kernels.tools.models import get_batch, load_corpus

    data = load_corpus()
    runs: dict[str, dict] = {}
    for oname, spec in optimizers(name, peers, use).items():
        if ONLY and oname != BASE and oname not in ONLY:
            continue
        model = build_model(cfg, spec["seed"])
        params = [p for p in model.parameters() if p.requires_grad]  # tied: counted once
        rec = dict(
            losses=[],
            opt_ms=[],
            step_ms=[],
            finite=True,
            error=None,
            state_bytes=0,
            seed=spec["seed"],
        )
        try:
            opt = spec["make"](params)
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"
            log(f"[{name}] {oname}: construction failed: {rec['error']}")
            opt = None
        rec.update(model=model, opt=opt, params=params)
        runs[oname] = rec
    n_params = sum(p.numel() for p in runs[BASE]["params"])
    log(f"[{name}] {cfg['shape']}; {n_params / 1e6:.2f}M params; {len(runs)} optimizers")

    t_start = time.perf_counter()
    for step in range(steps):
        x, y = get_batch(data, BATCH, cfg["block_size"], seed=SEED, step=step, rank=0)
        lr = lr_at(step, steps)
        for oname, r in runs.items():
            if r["opt"] is None or r["error"] is not None or not r["finite"]:
                continue
            try:
                t0 = time.perf_counter()
                loss = loss_of(cfg, r["model"], x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(r["params"], CLIP)
                set_lr(r["opt"], lr)
                t1 = time.perf_counter()
                r["opt"].step()
                r["opt"].zero_grad(set_to_none=True)
                t2 = time.perf_counter()
            except Exception as e:  # noqa: BLE001
                r["error"] = f"step {step}: {type(e).__name__}: {e}"
                log(f"[{name}] {oname}: failed: {r['error']}")
                traceback.print_exc()
                continue
            lv = loss.item()
            r["losses"].append(lv)
            r["opt_ms"].append((t2 - t1) * 1e3)
            r["step_ms"].append((t2 - t0) * 1e3)
            r["state_bytes"] = max(r["state_bytes"], state_bytes(r["opt"]))
            if not math.isfinite(lv) or not all(torch.isfinite(p).all() for p in r["params"]):
                r["finite"] = False
                log(f"[{name}] {oname}: non-finite loss/params at step {step} (loss {lv})")
        if step == 0 or (step + 1) % 50 == 0 or step + 1 == steps:
            el = time.perf_counter() - t_start
            log(
                f"[{name}] step {step + 1}/{steps} ({el:.0f}s): "
                + ", ".join(f"{k} {r['losses'][-1]:.4f}" for k, r in runs.items() if r["losses"])
            )

    base = runs[BASE]["losses"]
    base_final = statistics.fmean(base[-LAST:]) if len(base) == steps else float("nan")
    out = {}
    for oname, r in runs.items():
        ls = r["losses"]
        done = len(ls) == steps and r["error"] is None
        final = statistics.fmean(ls[-LAST:]) if done else float("nan")
        rel = (final - base_final) / base_final if done else float("nan")
        per_step = (
            max(abs(a - b) / b for a, b in zip(ls, base, strict=True)) if done else float("nan")
        )
        out[oname] = dict(
            steps_done=len(ls),
            all_finite=bool(r["finite"] and done),
            error=r["error"],
            seed=r["seed"],
            final_loss=final,
            rel_diff_final=rel,
            max_rel_diff_per_step=per_step,
            within_1pct=bool(done and abs(rel) <= TARGET),
            state_bytes=r["state_bytes"],
            state_bytes_per_param=r["state_bytes"] / n_params,
            opt_step_ms_median=statistics.median(r["opt_ms"]) if r["opt_ms"] else float("nan"),
            train_step_ms_median=statistics.median(r["step_ms"]) if r["step_ms"] else float("nan"),
            first_step_ms=r["step_ms"][0] if r["step_ms"] else float("nan"),
            losses=ls,
        )
        if oname.startswith("zk int8"):
            opt = r["opt"]
            low = [p for p in r["params"] if p.numel() >= opt.min_lowbit_numel]
            out[oname]["lowbit_params"] = sum(p.numel() for p in low)
            out[oname]["fp32_state_params"] = n_params - out[oname]["lowbit_params"]
    return dict(shape=cfg["shape"], params=n_params, batch=BATCH, runs=out)


def table_rows(results: dict, names=None) -> list[dict]:
    rows = []
    for mname, m in results.items():
        for oname, r in m["runs"].items():
            if names is not None and oname not in names(mname):
                continue
            rows.append(
                {
                    "model": mname,
                    "optimizer": oname,
                    "all finite": "yes" if r["all_finite"] else f"NO ({r['error'] or 'nan'})",
                    "final loss": f"{r['final_loss']:.4f}",
                    f"vs {BASE}": f"{100 * r['rel_diff_final']:+.2f}%",
                    "max per-step": f"{100 * r['max_rel_diff_per_step']:.2f}%",
                    "state MB": f"{r['state_bytes'] / 1e6:.2f}",
                    "state B/param": f"{r['state_bytes_per_param']:.2f}",
                    "opt step ms": f"{r['opt_step_ms_median']:.2f}",
                    "train step ms": f"{r['train_step_ms_median']:.1f}",
                }
            )
    return rows


def plot(results: dict, path: str, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = list(results)
    fig, axes = plt.subplots(2, len(ms), figsize=(7 * len(ms), 9), squeeze=False)
    k = LAST

    def smooth(v):
        return [statistics.fmean(v[max(0, i - k + 1) : i + 1]) for i in range(len(v))]

    for j, mname in enumerate(ms):
        runs = results[mname]["runs"]
        base = runs[BASE]["losses"]
        ax, axd = axes[0][j], axes[1][j]
        for oname, r in runs.items():
            ls = r["losses"]
            if not ls:
                continue
            style = dict(lw=1.0)
            if oname.startswith("zk int8 b"):
                style.update(ls=":")
            elif oname in ("torch fp32 seed1", "bf16 master seed1"):
                style.update(ls="--", color="gray")
            elif oname == BASE:
                style.update(color="black", lw=1.5)
            ax.plot(range(1, len(ls) + 1), smooth(ls), label=oname, **style)
            if len(ls) == len(base) and oname != BASE:
                sb = smooth(base)
                axd.plot(
                    range(1, len(ls) + 1),
                    [100 * (a - b) / b for a, b in zip(smooth(ls), sb, strict=True)],
                    label=oname,
                    **style,
                )
        ax.set_title(
            f"{mname}: training loss ({k}-step running mean)\n"
            + textwrap.fill(results[mname]["shape"], 80),
            fontsize=8,
        )
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        lo = min(min(r["losses"][steps // 3 :] or [math.inf]) for r in runs.values())
        hi = max(max(r["losses"][steps // 3 :] or [-math.inf]) for r in runs.values())
        if math.isfinite(lo) and math.isfinite(hi) and steps >= 30:
            ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.3 * (hi - lo))
        ax.legend(fontsize=7)
        axd.axhline(0, color="black", lw=0.8)
        for s in (-1, 1):
            axd.axhline(100 * TARGET * s, color="red", lw=0.8, ls="--")
        axd.set_title(f"{mname}: loss vs {BASE}, % ({k}-step running means)", fontsize=9)
        axd.set_xlabel("step")
        axd.set_ylabel("relative difference %")
        axd.set_ylim(-5, 5)
        axd.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--models", default="demo,gpt2", help=f"comma list of {sorted(MODELS)}")
    ap.add_argument("--peers", default="bnb,torchao", help="peers to run ('' for none)")
    ap.add_argument("--out", default="bench/results/state_quality.json")
    ap.add_argument("--plot", default="bench/results/state_quality.png")
    ap.add_argument("--params", default="fp32", choices=("fp32", "bf16"), help="model dtype")
    ap.add_argument("--only", default="", help="comma list: run these optimizers only (+ base)")
    args = ap.parse_args()
    global BASE, PARAMS
    PARAMS = args.params
    if PARAMS == "bf16":
        BASE = BF16_BASE
    names = [m for m in args.models.split(",") if m]
    for m in names:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {sorted(MODELS)}")
    if args.steps < 2 * LAST:
        print(f"note: --steps {args.steps} < {2 * LAST}: a smoke run, the numbers mean nothing")

    def log(msg):
        print(msg, flush=True)

    info = run_info("bench_state_quality.py")
    peers = peer_status()
    use = {p for p in args.peers.split(",") if p}
    info["peers"] = peers
    log(
        f"machine: {info['cpu']}, {info['cores']} cores, {info['torch_threads']} torch threads; "
        f"torch {info['torch']}; zero_kernels {info['commit']} "
        f"(cpu isa {info.get('zero_kernels_cpu_isa')})"
    )
    log(f"command: {info['command']}")
    log("peers: " + "; ".join(f"{k} {v}" for k, v in peers.items()))

    t0 = time.perf_counter()
    global ONLY
    ONLY = {o for o in args.only.split(",") if o}
    results = {m: run_model(m, MODELS[m], args.steps, peers, use, log) for m in names}
    info["wall_s"] = round(time.perf_counter() - t0, 1)

    def main_names(m):
        return [o for o in results[m]["runs"] if not o.startswith("zk int8 b")]

    def sweep_names(m):
        return ["zk int8 b128", "zk int8", "zk int8 b1024", "zk int8 b2048"] if m == "demo" else []

    rows = table_rows(results, main_names)
    sweep = table_rows(results, sweep_names)
    for r in sweep:
        if r["optimizer"] == "zk int8":
            r["optimizer"] = "zk int8 b256"
    keys = list(rows[0]) if rows else []
    print()
    print(
        f"## {args.steps} steps; final loss = mean of the last {LAST} steps; "
        f"target |vs {BASE}| <= {100 * TARGET:.0f}%"
    )
    print()
    print(markdown_table(rows, keys))
    if sweep:
        print()
        print("## int8 state block-size sweep (demo GPT)")
        print()
        print(markdown_table(sweep, keys))
    print()
    print(f"wall {info['wall_s']} s")

    payload = dict(
        info=info,
        config=dict(
            steps=args.steps,
            hyper=dict(HP, betas=list(HP["betas"])),
            schedule="linear warmup over 10% of the steps, cosine to 10% of peak",
            clip_grad_norm=CLIP,
            batch=BATCH,
            seed=SEED,
            last=LAST,
            target=TARGET,
        ),
        models=results,
        table=rows,
        sweep=sweep,
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {args.out}")
    if args.plot:
        plot(results, args.plot, args.steps)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
