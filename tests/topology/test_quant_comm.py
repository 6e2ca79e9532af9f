"""Quantized all-gather of params (issue 22, ``quantize_weights``;
tests/topology/quant_comm_checks.py):
one spawned group of 3 ranks, each concern its own test."""

import pytest
import quant_comm_checks
from dist_utils import SharedRun

RUN = SharedRun(quant_comm_checks.worker, timeout=400)


@pytest.mark.distributed
@pytest.mark.parametrize("check", [c.__name__ for c in quant_comm_checks.CHECKS])
def test_quant_comm(check):
    RUN.check(3, check)
