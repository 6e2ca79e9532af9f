"""Plot the link-rate sweep of bench/bench_testbed.py: step time per candidate against the
link rate, from the JSONs of one run per rate.

    for r in 500mbit 1gbit 5gbit 10gbit; do
        python bench/bench_testbed.py --rate $r --rounds 1 --cands \
            ddp_fused,ours_stage2,ours_stage3,ours_stage3_node,ours_stage3_q8g8,fsdp2_hsdp \
            --out bench/results/testbed_2x2_sweep_$r.json
    done
    python bench/plot_testbed_sweep.py bench/results/testbed_2x2_sweep_*.json \
        --out bench/results/testbed_2x2_sweep.png
"""

from __future__ import annotations

import argparse
import json

LABELS = {
    "ddp_fused": "DDP + fused AdamW",
    "ours_stage2": "ours stage 2",
    "ours_stage3": "ours stage 3",
    "ours_stage3_node": 'ours stage 3, shard_group="node"',
    "ours_stage3_q8g8": "ours stage 3, int8 weights + grads",
    "fsdp2_hsdp": "FSDP2 HSDP",
}


def load(paths: list[str]) -> dict[str, list[tuple[float, float]]]:
    """candidate -> [(rate in Gbit/s, seconds per step)], sorted by rate."""
    out: dict[str, list[tuple[float, float]]] = {}
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        rate = d["rate_bps"] / 1e9
        for row in d["summary"]:
            out.setdefault(row["cand"], []).append((rate, row["median_step_s"]))
    return {k: sorted(v) for k, v in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jsons", nargs="+")
    ap.add_argument("--out", required=True, help="the PNG to write")
    args = ap.parse_args(argv)
    series = load(args.jsons)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for cand, pts in series.items():
        ax.plot([r for r, _ in pts], [s for _, s in pts], marker="o", label=LABELS.get(cand, cand))
    ax.set_xscale("log")
    ax.set_xlabel("link rate between the nodes (Gbit/s)")
    ax.set_ylabel("seconds per step (slowest rank, median)")
    ax.set_title("2 nodes x 2 ranks, 7.52M-param GPT, fp32 AdamW, gloo on 2 CPU cores")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    for cand, pts in series.items():
        print(f"{cand:<20}" + "  ".join(f"{r:g} Gbit/s {s:.3f} s" for r, s in pts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
