"""close() and the with-block never hang a rank (issue 21)."""

import close_checks
import pytest
from dist_utils import run_workers


@pytest.mark.distributed
def test_close_never_hangs():
    reps = run_workers(close_checks.check_close, 2, timeout=120)
    assert reps[1]["raising rank leaves at once"] == "ok"
    assert reps[0]["other rank gets an error"] == "ok"
    reps = run_workers(close_checks.check_close_one_rank, 2, timeout=120)
    assert all(r["close on one rank raises"] == "ok" for r in reps)
