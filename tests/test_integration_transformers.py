"""ZeroTrainer (zero_kernels.integrations.transformers, issue 24) at 2 ranks against Trainer's own
DDP run: per-step losses and weights at stages 1-3 with clipping and accumulation 2 (a GPT-2; a
Llama and a Mixtral at stage 3; PEFT's LoRA over a Llama with shard_frozen=True, its adapter
file from save_model), evaluations between steps at stage 3, resumes from
checkpoint-N (fp32, bf16 params, another stage), save_model at stage 3 read by from_pretrained,
a plain torch optimizer handed in, refusals. One spawned group (tests/transformers_checks.py)."""

import os
import shutil
import tempfile

import pytest

pytest.importorskip("transformers")

import transformers_checks  # noqa: E402
from dist_utils import SharedRun  # noqa: E402

RUN = SharedRun(transformers_checks.worker, timeout=600)


@pytest.fixture(scope="module", autouse=True)
def _tmp_dir():
    d = tempfile.mkdtemp(prefix="zk-hf-")
    os.environ["ZK_TEST_HF_DIR"] = d  # read by the spawned ranks at import
    yield
    os.environ.pop("ZK_TEST_HF_DIR", None)
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.distributed
@pytest.mark.parametrize("check", [c.__name__ for c in transformers_checks.CHECKS])
def test_zero_trainer(check):
    RUN.check(2, check)


def test_figures():
    """The measured gaps, for the issue's note (printed with -s)."""
    for c in transformers_checks.CHECKS:
        print(c.__name__, RUN.check(2, c.__name__)[0])
