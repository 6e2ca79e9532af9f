"""`zero_kernels.integrations.accelerate` against accelerate's DDP on 2 gloo ranks (one spawned
group, tests/integrations/accelerate_checks.py): per-step losses at stages 1-3 with clipping and
accumulation,
resume from a mid-run save_state (fp32 and bf16 params), bf16 autocast, and the errors."""

import pytest

pytest.importorskip("accelerate")

import accelerate_checks  # noqa: E402
from dist_utils import SharedRun  # noqa: E402

RUN = SharedRun(accelerate_checks.run, timeout=300)

pytestmark = pytest.mark.distributed


def test_errors_and_passthrough():
    RUN.check(2, "check_errors_and_passthrough")


def test_losses_equal_ddp_stages_1_to_3():
    RUN.check(2, "check_parity_vs_ddp")


def test_resume_from_save_state_repeats_the_run():
    RUN.check(2, "check_resume")


def test_bf16_autocast_equals_ddp():
    RUN.check(2, "check_bf16_autocast_vs_ddp")


def test_save_model_writes_every_tensor():
    RUN.check(2, "check_save_model")


def test_clip_value_at_sync_and_mid_window_refused():
    RUN.check(2, "check_clipping")
