"""Why int4 gradients lose accuracy, and which quantizer keeps it (issue 22, ``quantize_grads``).

One process emulates the one-hop quantized reduce-scatter of ``--world`` ranks exactly: each
step every rank's gradient of the demo's GPT (size "small", AdamW lr 1e-3, weight decay 0.01, 8
sequences per rank, the batches `zero_kernels.tools.models.get_batch` gives rank r) is computed in
turn; the flat gradient is cut into ``world`` equal chunks; chunk k's sum is rank k's own values
(exact) plus every other rank's, quantized blockwise with `zero_kernels.ops.quantize_blockwise`
(blocks starting at the chunk's start) and dequantized in fp32; then averaged, and one AdamW step
updates the single model. No process group: the arithmetic of the collective without its
timing, so quantizers are compared on the same batches, steps and init.

Quantizers (--cands):

    exact        no quantization (the reference)
    int4_bB      round-to-nearest int4, blocks of B elements (B = 256 is `quantize_grads="int4"`)
    int8_bB      the same, int8
    jitter       exact, each element times (1 + 1e-3 N(0, 1)): how far a tiny perturbation moves
                 the final loss (the noise floor of the comparison)
    anoiseE      exact plus Gaussian noise of std E% of the averaged gradient's RMS (per bucket
                 with --layout units): an unbiased error of relative L2 size E% that, unlike a
                 quantizer's, has no structure; how large an error the final loss tolerates
    int4sr_bB    stochastic rounding: q = floor(y / scale + u), u ~ U[0, 1) (unbiased: E[deq] = y)
    hint4_bB     (any gradient quantizer with an h in front) the two-hop form: each chunk summed
                 exact inside its owner's node (2 ranks), every other node's sum quantized once
    int4sq_bB    square-law levels (the int8 state's map, `zero_kernels.ops.lowbit`):
                 x = q |q| A / 49, q = sign(x) rne(sqrt(|x| 49 / A)), A the block's max |x|
    qw8+G        gradients as G, and each step's forward and backward on int8-quantized weights
                 (blocks of 256, every chunk: `quantize_weights="int8"` with hpZ's
                 ``own_exact=False``); the masters stay exact; qw8bB+G: weight blocks of B;
                 qw8pP+G: params of fewer than P elements never quantized (stage 3's
                 ``persist_below=P``: norms and biases kept whole)

Per step it records the loss (mean over the emulated ranks) and, every --probe steps, the error
of the averaged gradient against the exact average (relative L2 and cosine). Reported per
quantizer: the final loss (mean of the last 20 steps) relative to exact's, the mean relative
gradient error, and the wire bytes per element (data plus 4-byte scales).

    python bench/bench_int4_grads.py [--steps 300] [--world 4] [--cands ...] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time

import torch

from zero_kernels.ops import dequantize_blockwise, quantize_blockwise
from zero_kernels.tools.models import build_gpt, get_batch, load_corpus

LAST = 20
DEFAULT_CANDS = "exact,int4_b256,int4_b64,int4_b32,int4sr_b256,int8_b256"


def _parse(name: str) -> tuple:
    """(name, bits, block, stochastic, int8 weights' block or 0, params below this many elements
    kept exact) of a candidate name."""
    wblock, persist, grads = 0, 0, name
    if name.startswith("qw8"):  # qw8[bB][pP]+G
        head, _, grads = name.partition("+")
        m = re.fullmatch(r"qw8(?:b(\d+))?(?:p(\d+))?", head)
        if not grads or m is None:
            raise SystemExit(f"--cands: unknown weight quantizer in {name!r}")
        wblock, persist = int(m.group(1) or 256), int(m.group(2) or 0)
    if grads == "exact":
        return name, 0, 0, False, wblock, persist, False
    if grads == "jitter":
        return name, -1, 0, False, wblock, persist, False
    if re.fullmatch(r"anoise\d+(\.\d+)?", grads):  # additive noise, std in % of the RMS
        return name, -2, float(grads[6:]), False, wblock, persist, False
    hier = grads.startswith("h")
    kind, _, blk = grads.removeprefix("h").partition("_b")
    if kind not in ("int4", "int8", "int4sr", "int8sr", "int4sq", "int8sq") or not blk.isdigit():
        raise SystemExit(f"--cands: unknown quantizer {name!r}")
    how = "sq" if kind.endswith("sq") else kind.endswith("sr")
    return name, int(kind[3]), int(blk), how, wblock, persist, hier


def _round_trip(x: torch.Tensor, bits: int, block: int, stochastic: bool, gen) -> torch.Tensor:
    """``x`` (fp32, flat) quantized and dequantized."""
    if stochastic == "sq":  # square-law levels, rounded in the root's domain
        qmax = 127 if bits == 8 else 7
        n = x.numel()
        y = torch.nn.functional.pad(x, (0, -n % block)).view(-1, block)
        s = y.abs().amax(dim=1, keepdim=True) / qmax**2
        inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
        q = torch.round(torch.sqrt(y.abs() * inv)).clamp_(max=qmax)
        return (torch.sign(y) * q * q * s).view(-1)[:n]
    if not stochastic:
        q, s = quantize_blockwise(x, bits, block)
        return dequantize_blockwise(q, s, bits, block, x.numel())
    qmax = 127 if bits == 8 else 7
    n = x.numel()
    pad = -n % block
    y = torch.nn.functional.pad(x, (0, pad)).view(-1, block)
    scale = y.abs().amax(dim=1, keepdim=True) / qmax
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    u = torch.rand(y.shape, generator=gen)
    q = torch.floor(y * inv + u).clamp_(-qmax, qmax)
    return (q * scale).view(-1)[:n]


def _reduce(grads: list[torch.Tensor], cand, gen, node: int = 2) -> torch.Tensor:
    """The averaged gradient the quantized reduce-scatter of ``grads`` (one flat per rank) gives.
    A hierarchical candidate (``h`` prefix) sums each chunk exactly inside its owner's node (the
    ranks ``node`` at a time) and adds every other node's sum quantized once (the two-hop form)."""
    _, bits, block, sr = cand[:4]
    n = len(grads)
    if bits == 0:
        return torch.stack(grads).mean(0)
    if bits == -1:  # exact, each element times (1 + 1e-3 N(0, 1)): the trajectory's sensitivity
        g = torch.stack(grads).mean(0)
        return g * (1 + 1e-3 * torch.randn(g.shape, generator=gen))
    if bits == -2:  # exact + N(0, (block% of the exact average's RMS)^2): rel. L2 error block%
        g = torch.stack(grads).mean(0)
        rms = g.pow(2).mean().sqrt()
        return g + (block / 100) * rms * torch.randn(g.shape, generator=gen)
    per = node if cand[6] else 1  # the ranks summed exactly before the quantized hop
    srcs = grads if per == 1 else [sum(grads[h * per : (h + 1) * per]) for h in range(n // per)]
    c = -(-grads[0].numel() // n)
    out = torch.empty_like(grads[0])
    for k in range(n):
        lo, hi = k * c, min((k + 1) * c, grads[0].numel())
        acc = srcs[k // per][lo:hi].clone()  # the chunk's owner (its node's sum): exact
        for r in range(len(srcs)):
            if r != k // per:
                acc += _round_trip(srcs[r][lo:hi].contiguous(), bits, block, sr, gen)
        out[lo:hi] = acc / n
    return out


def _unit_groups(model, params) -> list[tuple[bool, list[tuple[int, int]]]]:
    """--layout units: stage 3's buckets as the layout cuts them (one per block, one for the
    root's matrices, every param of one dimension in one exact bucket), each a list of
    ``(start, end)`` ranges of the flat gradient in the bucket's order (its params reversed)."""
    pos, where = 0, {}
    for p in params:
        where[id(p)] = (pos, pos + p.numel())
        pos += p.numel()
    blocks = {id(p): f"blocks.{n.split('.')[1]}" for n, p in model.named_parameters()
              if n.startswith("blocks.")}  # fmt: skip
    groups: dict[str, list] = {}
    for p in params:
        key = "vectors" if p.dim() <= 1 else blocks.get(id(p), "root")
        groups.setdefault(key, []).append(where[id(p)])
    return [(k == "vectors", list(reversed(r))) for k, r in groups.items()]


def _reduce_units(grads, cand, gen, groups) -> torch.Tensor:
    out = torch.empty_like(grads[0])
    for exact, ranges in groups:
        parts = [torch.cat([g[lo:hi] for lo, hi in ranges]) for g in grads]
        red = torch.stack(parts).mean(0) if exact else _reduce(parts, cand, gen)
        at = 0
        for lo, hi in ranges:
            out[lo:hi] = red[at : at + hi - lo]
            at += hi - lo
    return out


def run(cand, steps: int, world: int, probe: int, data, seed: int = 0, layout: str = "flat"):
    torch.manual_seed(seed)
    model = build_gpt("small")
    params = [p for p in model.parameters() if p.requires_grad]
    groups = _unit_groups(model, params) if layout == "units" else None
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1234 + seed)
    losses, errs, coss = [], [], []
    t0 = time.perf_counter()
    for step in range(steps):
        flats, ls = [], []
        if cand[4]:  # the forward and backward use int8-gathered weights (hpZ: own chunk too)
            exact_w = [p.detach().clone() for p in params]
            gathered = [p for p in params if p.numel() >= cand[5]]  # the rest kept whole
            with torch.no_grad():
                flat = torch.cat([p.reshape(-1) for p in gathered])
                c = -(-flat.numel() // world)
                for k in range(world):
                    lo, hi = k * c, min((k + 1) * c, flat.numel())
                    flat[lo:hi] = _round_trip(flat[lo:hi].contiguous(), 8, cand[4], False, gen)
                pos = 0
                for p in gathered:
                    p.copy_(flat[pos : pos + p.numel()].view_as(p))
                    pos += p.numel()
        for r in range(world):
            x, y = get_batch(data, 8, model.cfg.block_size, seed=seed, step=step, rank=r)
            model.zero_grad(set_to_none=True)
            loss = model(x, y)
            loss.backward()
            ls.append(loss.item())
            flats.append(torch.cat([p.grad.reshape(-1) for p in params]))
        if cand[4]:
            with torch.no_grad():
                for p, w in zip(params, exact_w):
                    p.copy_(w)
        g = _reduce(flats, cand, gen) if groups is None else _reduce_units(flats, cand, gen, groups)
        if step % probe == 0:
            exact = torch.stack(flats).mean(0)
            errs.append(((g - exact).norm() / exact.norm()).item())
            coss.append(torch.nn.functional.cosine_similarity(g, exact, dim=0).item())
        pos = 0
        for p in params:
            k = p.numel()
            p.grad = g[pos : pos + k].view_as(p).clone()
            pos += k
        opt.step()
        losses.append(sum(ls) / world)
        if not all(map(lambda v: v == v, ls)):
            raise FloatingPointError(f"{cand[0]}: non-finite loss at step {step}")
    _, bits, block = cand[:3]
    tail = losses[-LAST:]
    return {
        "losses": losses,
        "final_loss": sum(tail) / len(tail),
        "grad_rel_err_mean": sum(errs) / len(errs),
        "grad_cos_mean": sum(coss) / len(coss),
        "wire_bytes_per_element": 4.0 if bits <= 0 else bits / 8 + 4 / block,
        "seconds": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--probe", type=int, default=10, help="gradient error every N steps")
    ap.add_argument("--cands", default=DEFAULT_CANDS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seeds", default="0", help="init and batch seeds, e.g. 0,1,2")
    ap.add_argument(
        "--layout",
        choices=("flat", "units"),
        default="flat",
        help="flat: the whole gradient cut in world chunks; units: stage 3's buckets (one per "
        "block, one for the root's matrices, the vectors in one exact bucket)",
    )
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cands = [_parse(c) for c in args.cands.split(",")]
    data = load_corpus()
    seeds = [int(x) for x in args.seeds.split(",")]
    res = {}
    for seed in seeds:  # seed-major: each seed's candidates back to back
        for c in cands:
            r = run(c, args.steps, args.world, args.probe, data, seed, args.layout)
            res.setdefault(c[0], {"seeds": {}})["seeds"][seed] = r
            print(
                f"{c[0]:>14} seed {seed}: final loss {r['final_loss']:.4f}, grad rel err "
                f"{r['grad_rel_err_mean']:.3f}, cos {r['grad_cos_mean']:.4f}, "
                f"{r['seconds']:.0f} s",
                flush=True,
            )
    for e in res.values():
        runs = list(e["seeds"].values())
        e["final_loss_mean"] = sum(r["final_loss"] for r in runs) / len(runs)
        e["grad_rel_err_mean"] = sum(r["grad_rel_err_mean"] for r in runs) / len(runs)
        e["wire_bytes_per_element"] = runs[0]["wire_bytes_per_element"]
        if "exact" in res:
            ex = res["exact"]["seeds"]
            per = [r["final_loss"] / ex[s]["final_loss"] - 1 for s, r in e["seeds"].items()]
            e["final_rel_diff_per_seed"] = per
            e["final_rel_diff_mean"] = sum(per) / len(per)
    out = {
        "bench": "int4_grads",
        "command": "python " + " ".join(sys.argv),
        "steps": args.steps,
        "seeds": seeds,
        "layout": args.layout,
        "world_emulated": args.world,
        "threads": args.threads,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        },
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "runs": res,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"int4_grads{args.tag}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    for name, e in res.items():
        per = e.get("final_rel_diff_per_seed")
        txt = ""
        if per is not None:
            each = ", ".join(f"{100 * d:+.2f}%" for d in per)
            txt = f"final loss vs exact {100 * e['final_rel_diff_mean']:+.2f}% ({each}); "
        print(
            f"{name:>14}: {txt}grad rel err {e['grad_rel_err_mean']:.3f}; "
            f"{e['wire_bytes_per_element']:.3f} B/elem"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
