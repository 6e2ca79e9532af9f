"""The nvme tiers with params off the CPU are refused at construction, naming the option, the
device and what to use instead (`zero_kernels.optimizer.build.check_offload_device`): before,
``offload_optimizer="nvme"`` with CUDA params failed at the first step (host moments handed
to the CUDA kernel with device masters and gradients). The decision is a pure function of the
options and the device, tested here for any device; the construction itself on CUDA runs where
there is a GPU (bench/gpu_check.sh runs this file)."""

import pytest
import torch
from torch import nn
from zero_opt import zero_opt

from zero_kernels.optimizer.build import check_offload_device


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "xpu:0"])
def test_nvme_optimizer_state_off_the_cpu_is_refused_naming_what_works(device):
    with pytest.raises(NotImplementedError) as e:
        check_offload_device("nvme", None, torch.device(device))
    msg = str(e.value)
    for part in ("offload_optimizer='nvme'", device, "offload_optimizer='cpu'"):
        assert part in msg, (part, msg)


def test_nvme_params_off_the_cpu_are_refused_naming_what_works():
    with pytest.raises(NotImplementedError) as e:
        check_offload_device(None, "nvme", torch.device("cuda", 0))
    for part in ("offload_params='nvme'", "cuda:0", "offload_params='cpu'"):
        assert part in str(e.value), (part, str(e.value))


@pytest.mark.parametrize(
    "opt, params", [("nvme", None), ("nvme", "nvme"), ("cpu", "cpu"), ("cpu", None), (None, None)]
)
def test_every_tier_is_allowed_on_the_cpu(opt, params):
    check_offload_device(opt, params, torch.device("cpu"))


@pytest.mark.parametrize("opt, params", [("cpu", None), ("cpu", "cpu"), (None, None)])
def test_the_host_tier_and_no_offload_are_allowed_on_cuda(opt, params):
    check_offload_device(opt, params, torch.device("cuda", 0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nvme_optimizer_state_with_cuda_params_is_refused_at_construction(tmp_path):
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)).cuda()
    with pytest.raises(NotImplementedError, match="offload_optimizer='cpu'"):
        zero_opt(
            model,
            torch.optim.AdamW,
            stage=2,
            lr=1e-3,
            offload_optimizer="nvme",
            offload_dir=str(tmp_path),
        )
    # nothing left behind: the same params build an optimizer with the host tier
    opt = zero_opt(model, torch.optim.AdamW, stage=2, lr=1e-3, offload_optimizer="cpu")
    model(torch.randn(8, 16, device="cuda")).sum().backward()
    opt.step()
    opt.close()
