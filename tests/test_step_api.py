"""``ZeroOptimizer.step(closure=None, **kwargs)`` (issue 21): keywords reach the inner optimizer's
step and the keys it adds to its param groups reach ``opt.param_groups``, flat and whole mode,
against the same optimizer unsharded under DDP; an unknown keyword is a TypeError naming it."""

import pytest
import step_api_checks
from dist_utils import run_workers


@pytest.mark.distributed
def test_step_kwargs():
    rep = run_workers(step_api_checks.check_step_kwargs, 2, timeout=400)
    assert rep[0] == {
        "ScaledMomentum stage 2": "ok",
        "ScaledMomentum stage 3": "ok",
        "ScaledNormalized stage 1": "ok",
        "ScaledNormalized stage 3": "ok",
        "AdamW fused=True": "ok",
        "AdamW fused=False": "ok",
    }, rep
