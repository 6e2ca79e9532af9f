"""ZeroOptimizer under torch.compile. With compiled autograd (issue 10): stages 1 and 2 match
DDP with clipping, stage 3 raises (ours at the first forward with the config flag on; autograd's
own error when compiled autograd is on around backward only). Without it: every stage matches
DDP, with stage 3's and overlap_param_gather's forward hooks kept out of the graphs."""

import compiled_checks
import pytest
from dist_utils import run_workers


@pytest.mark.distributed
def test_compiled_autograd():
    rep = run_workers(compiled_checks.check_compiled_autograd, 2, timeout=500)
    assert rep[0]["stage 1"] == rep[0]["stage 2"] == "ok", rep
    assert rep[0]["stage 3"] in ("refused", "autograd error"), rep


@pytest.mark.distributed
def test_compiled_forward_hooks():
    rep = run_workers(compiled_checks.check_compiled_forward_hooks, 2, timeout=500)[0]
    assert set(rep.values()) == {"ok"} and len(rep) == 9, rep
