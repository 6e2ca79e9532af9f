"""Backend choice for the kernels: native (cpu, cuda), triton, reference.

``auto`` picks the fastest backend that loads for the tensors' device and logs one line saying why
when it has to fall back; a backend asked for by name that cannot run raises with the reason.
`adam_step` and `adam_step_multi` call the custom ops ``zero_kernels::adam_step_`` and
``zero_kernels::adam_step_multi_`` (`zero_kernels.ops.library`), which torch.compile keeps whole;
`quantize_blockwise` and `dequantize_blockwise` (`zero_kernels.ops.quant`) the blockwise
int8/int4 quantization of the communication layer; `stochastic_round_bf16_` (`zero_kernels.ops.sr`)
the rounding of bf16 params stepped without a master.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import library, reference  # noqa: F401  (library registers the ops)
from .backends import BACKENDS, resolve_backend
from .hyper import AdamHyper
from .quant import DEFAULT_BLOCK, dequantize_blockwise, quantize_blockwise, quantized_sizes
from .sr import sr_key, stochastic_round_bf16_

__all__ = [
    "DEFAULT_BLOCK",
    "AdamHyper",
    "BACKENDS",
    "adam_step",
    "adam_step_multi",
    "dequantize_blockwise",
    "quantize_blockwise",
    "quantized_sizes",
    "resolve_backend",
    "sr_key",
    "stochastic_round_bf16_",
]


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: AdamHyper,
    *,
    max_exp_avg_sq: torch.Tensor | None = None,
    out_lowp: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    check_finite: bool = False,
    backend: str = "auto",
) -> torch.Tensor | None:
    """One fused Adam/AdamW step over contiguous tensors, in place: ``zero_kernels::adam_step_``.

    ``param``/``exp_avg``/``exp_avg_sq``/``max_exp_avg_sq`` share one dtype (fp32, bf16 or fp16);
    ``grad`` is fp32 or that dtype; ``out_lowp`` (bf16/fp16) receives the new params rounded.
    ``found_inf`` (fp32, one element) is read (non-zero: skip) and, with ``check_finite``, set to
    1 when a grad is non-finite. Returns ``found_inf`` (created when ``check_finite`` and None).
    """
    if check_finite and found_inf is None:
        found_inf = torch.zeros(1, dtype=torch.float32, device=param.device)
    vmax = max_exp_avg_sq if hyper.amsgrad else None
    library.adam_step(
        param, grad, exp_avg, exp_avg_sq, vmax, out_lowp, found_inf, hyper, check_finite, backend
    )
    return found_inf


def adam_step_multi(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    hyper: AdamHyper,
    *,
    max_exp_avg_sqs: Sequence[torch.Tensor] | None = None,
    found_inf: torch.Tensor | None = None,
    check_finite: bool = False,
    backend: str = "auto",
) -> torch.Tensor | None:
    """`adam_step` over lists of tensors of one device, dtype (``zero_kernels::adam_step_multi_``).

    The native backends take the whole list in one call (on CUDA one multi-tensor launch; on the
    CPU each tensor is split over the threads); Triton and the reference step tensor by tensor.
    With ``check_finite`` all grads are scanned before any tensor is written, so an overflow
    anywhere leaves every tensor untouched.
    """
    n = len(params)
    if hyper.amsgrad and (max_exp_avg_sqs is None or len(max_exp_avg_sqs) != n):
        raise ValueError("adam_step_multi: amsgrad=True needs one max_exp_avg_sq per param")
    if n == 0:
        return found_inf
    if check_finite and found_inf is None:
        found_inf = torch.zeros(1, dtype=torch.float32, device=params[0].device)
    vmaxes = list(max_exp_avg_sqs) if hyper.amsgrad else []
    library.adam_step_multi(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        vmaxes,
        found_inf,
        hyper,
        check_finite,
        backend,
    )
    return found_inf
