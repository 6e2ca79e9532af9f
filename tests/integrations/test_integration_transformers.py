"""ZeroTrainer (zero_kernels.integrations.transformers, issue 24) at 2 ranks against Trainer's own
DDP run: per-step losses and weights at stages 1-3 with clipping and accumulation 2 (a GPT-2; a
Llama and a Mixtral at stage 3; PEFT's LoRA over a Llama with shard_frozen=True, its adapter
file from save_model), evaluations between steps at stage 3, resumes from
checkpoint-N (fp32, bf16 params, another stage), save_model at stage 3 read by from_pretrained,
a plain torch optimizer handed in, refusals. One spawned group
(tests/integrations/transformers_checks.py)."""

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


# ---------------------------------------------------------------------------- no process group
def test_release_check_warns_once_for_an_untested_release(monkeypatch):
    """A newer minor release than the tested ones runs with one warning per process; a tested
    one and the opt-out run quietly (transformers' own Trainer passes the method check)."""
    import warnings

    import zero_kernels.integrations.transformers as zt

    monkeypatch.setattr(zt, "_warned", set())
    monkeypatch.delenv("ZERO_KERNELS_UNTESTED_TRANSFORMERS", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in zt.TESTED:
            zt.check_version(version=f"{t}.3")
    with pytest.warns(UserWarning, match=r"this is 5\.99\.0.*UNTESTED_TRANSFORMERS=1"):
        zt.check_version(version="5.99.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zt.check_version(version="5.99.0")  # once per process
        monkeypatch.setenv("ZERO_KERNELS_UNTESTED_TRANSFORMERS", "1")
        zt.check_version(version="5.98.0")


def test_release_check_refuses_a_trainer_without_the_overridden_methods():
    """A release whose Trainer lacks a method ZeroTrainer overrides (transformers before 5.3 has
    no _clip_grad_norm) or takes other parameters (5.2's create_optimizer(self)) is refused,
    naming the method, even with the opt-out set."""
    import transformers

    import zero_kernels.integrations.transformers as zt

    class NoClip(transformers.Trainer):
        _clip_grad_norm = None

    class OldCreate(transformers.Trainer):
        def create_optimizer(self):
            return None

    with pytest.raises(RuntimeError, match=r"5\.2\.0's Trainer has no _clip_grad_norm\(\)"):
        zt.check_version(NoClip, "5.2.0")
    with pytest.raises(RuntimeError, match=r"Trainer\.create_optimizer takes \(\)"):
        zt.check_version(OldCreate, "5.2.0")


def test_test_extra_pins_the_newest_tested_release():
    """setup.py's transformers range ends at the newest release in TESTED and starts at 5.3,
    the first whose Trainer has every method ZeroTrainer overrides."""
    import re

    import zero_kernels.integrations.transformers as zt

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(repo, "setup.py")) as f:
        lo, hi = re.search(r'"transformers>=([\d.]+),<=([\d.]+)"', f.read()).groups()
    newest = max(zt.TESTED, key=lambda v: tuple(map(int, v.split("."))))
    assert hi.rsplit(".", 1)[0] == newest and lo == "5.3", (lo, hi, zt.TESTED)
