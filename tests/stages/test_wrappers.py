"""DDP over a ZeroOptimizer's params raises on every rank ([Note: wrappers]); so do FSDP's and
tensor parallelism's params (DTensors) given to one."""

import pytest
import wrapper_checks
from dist_utils import run_workers


@pytest.mark.distributed
def test_ddp_over_zero_params_raises_on_every_rank():
    reps = run_workers(wrapper_checks.check_orders, 2, timeout=300)
    assert len(reps) == 2
    for rep in reps:  # every rank raised in every case
        assert len(rep) == 18 and set(rep.values()) == {"raised"}, rep


@pytest.mark.distributed
def test_fsdp_and_dtensor_params_refused():
    reps = run_workers(wrapper_checks.check_fsdp_and_dtensor, 2, timeout=300)
    for rep in reps:  # 3 stages x (FSDP, fully_shard, tensor parallel, buffer) + 2 flat-param
        # + FSDP and fully_shard applied after the optimizer
        assert len(rep) == 16 and set(rep.values()) == {"raised"}, rep
