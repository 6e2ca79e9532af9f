"""Stage 3's ``shard_frozen=True``: frozen params sharded with their units ([Note: frozen
shards]); spawned ranks against DDP (tests/stage3/frozen_checks.py) and bad input in-process."""

import frozen_checks
import pytest
import torch
from dist_utils import SharedRun
from torch import nn
from zero_opt import zero_opt

from zero_kernels.policy import GatherPolicy

_RUN = SharedRun(frozen_checks.frozen_all, timeout=600)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "name",
    [
        "check_parity",
        "check_sharded",
        "check_checkpoint",
        "check_quantized",
        "check_peft_llama",
        "check_meta",
        "check_two_forwards_and_double_backward",
        "check_external_read",
        "check_whole_frozen_warned",
    ],
)
def test_frozen_shards(name):
    rep = _RUN.check(3, name)[0]
    assert rep, name


def test_frozen_shards_arguments(tmp_path):
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    m[0].requires_grad_(False)
    with pytest.raises(ValueError, match="shard_frozen= is a stage-3 option"):
        zero_opt(m, torch.optim.SGD, stage=2, shard_frozen=True, lr=0.1)
    with pytest.raises(TypeError, match="shard_frozen must be a bool, got shard_frozen='yes'"):
        GatherPolicy(shard_frozen="yes")
    with pytest.raises(NotImplementedError, match="shard_frozen=True with offload_params='nvme'"):
        zero_opt(
            m,
            torch.optim.AdamW,
            stage=3,
            units=[nn.Linear],
            shard_frozen=True,
            offload_optimizer="nvme",
            offload_params="nvme",
            offload_dir=str(tmp_path),
            lr=0.1,
        )
    zo = zero_opt(m, torch.optim.SGD, stage=3, units=[nn.Linear], shard_frozen=True, lr=0.1)
    assert set(zo.parts.core.frozen.values()) == set(m[0].parameters())
    zo.close()


_RUN4 = SharedRun(frozen_checks.frozen_secondary, timeout=600)


@pytest.mark.distributed
def test_frozen_shards_secondary():
    rep = _RUN4.check(4, "check_secondary")[0]
    assert rep["secondary_all_gathers"] > 0, rep
