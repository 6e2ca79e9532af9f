"""``zero-kernels estimate --tp N``: every stage's row is its formula over params / tp (each
rank's local tensors, sharded over the dp ranks), and the command says so."""

import subprocess
import sys

import pytest

from zero_kernels.tools import estimate as est


def test_tp_rows_are_the_formula_over_params_per_tp_rank():
    two = est.estimate(7_500_000_000, 32, tp=2)
    half = est.estimate(3_750_000_000, 32)
    assert two.tp == 2 and two.n_params == 3_750_000_000
    for a, b in zip(two.stages, half.stages, strict=True):
        assert a.total_bytes == b.total_bytes, (a.stage, a.total_bytes, b.total_bytes)
    # ZeRO paper figures at N = 64 over tp 2: stage 3 is (4 + K) * (7.5B / 2) / 64 bytes
    s3 = est.estimate(7_500_000_000, 64, tp=2).stages[3]
    assert s3.total_bytes == pytest.approx(16 * 3.75e9 / 64, rel=1e-6)
    with pytest.raises(ValueError, match="--tp"):
        est.estimate(1000, 2, tp=0)


def test_cli_names_tp():
    out = subprocess.run(
        [sys.executable, "-m", "zero_kernels", "estimate", "--params", "7.5B", "-n", "32",
         "--tp", "2"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "7.5B params" in out and "tp 2: each rank holds 3.75B" in out, out


def test_cli_nodes_with_tp_counts_every_tp_rank_of_a_node(capsys):
    """With --nodes, a node holds (dp ranks per node) x tp ranks, each in a dp group of its own:
    the bytes per node are cross_node's with tp (what bench/bench_testbed_tp.py measured), and
    only the plain stages are listed (hierarchy, hpZ, quantization are refused under tp)."""
    import json

    from zero_kernels.cli.main import main
    from zero_kernels.tools.estimate_links import cross_node

    argv = ["estimate", "--params", "866560", "-n", "2", "--tp", "2", "--nodes", "2"]
    assert main([*argv, "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "2 nodes x 2 ranks: 1 dp x tp 2, tp inside" in out, out
    assert main([*argv, "--precision", "fp32", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["cross_node"]["per_node_per_step"]
    want = {c["config"]: c["bytes"] for c in cross_node(433280, 2, 1, precision="fp32", tp=2)}
    assert [r["config"] for r in rows] == ["DDP", "stage 1", "stage 2", "stage 3"]
    for r in rows:
        assert r["bytes"] == want[r["config"]], r
    # tp 2 doubles what the same local slice costs a node with one rank per node
    plain = {c["config"]: c["bytes"] for c in cross_node(433280, 2, 1, precision="fp32")}
    assert rows[2]["bytes"] == 2 * plain["stage 2"] > 0
