"""state_dict() / load_state_dict() of a module inside the model at stages 1-3 (a block, a layer
inside a unit, several units, the root's head; bf16 params; frozen shards): whole values, and
loads that reach the shards and the fp32 masters. One spawned group
(tests/stage3/module_sd_checks.py)."""

import module_sd_checks
import pytest
from dist_utils import run_workers


@pytest.mark.distributed
def test_module_state_dicts():
    rep = run_workers(module_sd_checks.worker, 2, timeout=300)[0]
    assert rep["check_module_state_dicts"] == {k: "ok" for k in module_sd_checks.CASES}, rep
    assert rep["check_after_a_raise"] == {f"stage {s}": "ok" for s in (1, 2, 3)}, rep
