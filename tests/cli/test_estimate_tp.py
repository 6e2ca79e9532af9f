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
