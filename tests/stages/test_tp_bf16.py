"""ZeroOptimizer stages 1-3 over a tensor-parallel GPT (dp 2 x tp 2, gloo) against FSDP2 over
the same TP model: 10 AdamW steps, gradient accumulation 2, clipping, fp32 params and bf16
params with fp32 masters (the reference and tolerances: tests/stages/tp_bf16_checks.py, one
spawned group of 4 ranks)."""

import pytest
import tp_bf16_checks
from dist_utils import SharedRun

RUN = SharedRun(tp_bf16_checks.tp_bf16_all, timeout=240)


@pytest.mark.distributed
@pytest.mark.parametrize("check", tp_bf16_checks.CHECKS)
def test_tp_against_fsdp2(check):
    RUN.check(4, check)
