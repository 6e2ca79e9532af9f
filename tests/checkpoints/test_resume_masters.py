"""bf16 params resume from their fp32 masters through model.state_dict() + opt.state_dict()
(issue 21): bit for bit the uninterrupted run at stages 1-3; a shard that does not fit is an
error naming what differs."""

import pytest
import resume_checks
from dist_utils import run_workers


@pytest.mark.distributed
def test_bf16_resume_keeps_fp32_masters():
    reps = run_workers(resume_checks.check_bf16_resume, 2, timeout=300)
    for rep in reps:
        assert len(rep) == 10 and set(rep.values()) == {"ok"}, rep


@pytest.mark.distributed
def test_shard_mismatch_named():
    reps = run_workers(resume_checks.check_shard_mismatch, 2, timeout=300)
    for rep in reps:
        assert len(rep) == 9, rep
        assert rep["stage 3 other buckets"] == "loaded (units)", rep
        assert {v for k, v in rep.items() if k != "stage 3 other buckets"} == {"named"}, rep
