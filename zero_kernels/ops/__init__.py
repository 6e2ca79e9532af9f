"""Backend choice for the kernels: native (cpu, cuda), triton, reference.

``auto`` picks the fastest backend that loads for the tensors' device and logs one line saying why
when it has to fall back; a backend asked for by name that cannot run raises with the reason.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from .. import _native
from . import reference
from .hyper import AdamHyper

__all__ = ["AdamHyper", "BACKENDS", "adam_step", "adam_step_multi", "resolve_backend"]

log = logging.getLogger("zero_kernels")

BACKENDS = ("auto", "cpu", "cuda", "triton", "reference")
_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOWP_DTYPES = (torch.bfloat16, torch.float16)
_said: set[str] = set()


def _say_once(msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        log.warning(msg)


def _triton_error() -> BaseException | None:
    try:
        from . import triton_adam  # noqa: F401
    except Exception as e:  # ImportError, or triton present but broken
        return e
    return None


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that will run for tensors on ``device``: one of cpu, cuda, triton, reference."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got backend={backend!r}")
    dev = torch.device(device).type
    if backend == "auto":
        if dev == "cpu":
            if _native.load() is not None:
                return "cpu"
            _say_once(
                f"zero_kernels: native extension not loaded ({_native.error()}); "
                "using the pure-torch reference kernels"
            )
            return "reference"
        if dev == "cuda":
            if _native.has_cuda_kernels():
                return "cuda"
            if _triton_error() is None:
                _say_once("zero_kernels: extension has no CUDA kernels; using the Triton kernels")
                return "triton"
            _say_once("zero_kernels: no CUDA kernels and no Triton; using the reference kernels")
            return "reference"
        return "reference"
    if backend == "cpu":
        if dev != "cpu":
            raise ValueError(f"backend='cpu' needs CPU tensors, got device={dev!r}")
        if _native.load() is None:
            raise RuntimeError(
                f"backend='cpu': native extension failed to load: {_native.error()!r}"
            )
    elif backend == "cuda":
        if dev != "cuda":
            raise ValueError(f"backend='cuda' needs CUDA tensors, got device={dev!r}")
        if not _native.has_cuda_kernels():
            why = _native.error() or "the extension was built without CUDA kernels"
            raise RuntimeError(f"backend='cuda' cannot run: {why!r}")
    elif backend == "triton":
        if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "backend='triton' got CPU tensors: Triton runs on CPU tensors only under its "
                "interpreter (set TRITON_INTERPRET=1 before importing triton), or use "
                f"backend='cpu' or 'auto'; got device={dev!r}, "
                f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}"
            )
        err = _triton_error()
        if err is not None:
            raise RuntimeError(f"backend='triton' cannot run: {err!r}")
    return backend


def _check(name: str, t: torch.Tensor, ref: torch.Tensor, dtypes: Sequence[torch.dtype]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"adam_step: {name} must be a Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"adam_step: {name}.dtype must be one of {tuple(dtypes)}, got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"adam_step: {name} is on {t.device}, param is on {ref.device}")
    if t.numel() != ref.numel():
        raise ValueError(
            f"adam_step: {name}.numel()={t.numel()} differs from param.numel()={ref.numel()}"
        )
    if not t.is_contiguous():
        raise ValueError(f"adam_step: {name} must be contiguous, got {name}.stride()={t.stride()}")


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
    """One fused Adam/AdamW step over contiguous tensors, in place.

    ``param``/``exp_avg``/``exp_avg_sq``/``max_exp_avg_sq`` share one dtype (fp32, bf16 or fp16);
    ``grad`` is fp32 or that dtype; ``out_lowp`` (bf16/fp16) receives the new params rounded.
    ``found_inf`` (fp32, one element) is read (non-zero: skip) and, with ``check_finite``, set to
    1 when a grad is non-finite. Returns ``found_inf`` (created when ``check_finite`` and None).
    """
    _check("param", param, param, _STATE_DTYPES)
    _check("grad", grad, param, (torch.float32, param.dtype))
    _check("exp_avg", exp_avg, param, (param.dtype,))
    _check("exp_avg_sq", exp_avg_sq, param, (param.dtype,))
    if hyper.amsgrad:
        if max_exp_avg_sq is None:
            raise ValueError("adam_step: amsgrad=True needs max_exp_avg_sq, got None")
        _check("max_exp_avg_sq", max_exp_avg_sq, param, (param.dtype,))
    else:
        max_exp_avg_sq = None
    if out_lowp is not None:
        _check("out_lowp", out_lowp, param, _LOWP_DTYPES)
    if check_finite and found_inf is None:
        found_inf = torch.zeros(1, dtype=torch.float32, device=param.device)
    if found_inf is not None:
        _check("found_inf", found_inf.view(-1), found_inf.view(-1), (torch.float32,))
        if found_inf.numel() != 1 or found_inf.device != param.device:
            raise ValueError(
                f"adam_step: found_inf must be one fp32 element on {param.device}, "
                f"got shape={tuple(found_inf.shape)} device={found_inf.device}"
            )
    name = resolve_backend(backend, param.device)
    if param.numel() == 0:
        return found_inf
    if name in ("reference", "triton"):
        if name == "triton":
            from . import triton_adam as impl
        else:
            impl = reference
        impl.adam_step(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            hyper,
            max_exp_avg_sq=max_exp_avg_sq,
            out_lowp=out_lowp,
            found_inf=found_inf,
            check_finite=check_finite,
        )
    else:
        _native.load().adam_step(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            max_exp_avg_sq,
            out_lowp,
            found_inf,
            check_finite,
            *_scalars(hyper),
        )
    return found_inf


def _scalars(h: AdamHyper) -> tuple:
    """The positional scalars the native binding takes, in its order."""
    return (
        h.lr,
        h.beta1,
        h.beta2,
        h.eps,
        h.weight_decay,
        h.step_size,
        h.bias_correction2_sqrt,
        h.grad_scale,
        h.adamw,
        h.amsgrad,
        h.maximize,
    )


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
    """`adam_step` over lists of separate tensors of one device and dtype.

    The native backends take the whole list in one call (on CUDA one multi-tensor launch; on the
    CPU each tensor is split over the threads); Triton and the reference step tensor by tensor.
    With ``check_finite`` all grads are scanned before any tensor is written, so an overflow
    anywhere leaves every tensor untouched.
    """
    n = len(params)
    for name, seq in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        if len(seq) != n:
            raise ValueError(f"adam_step_multi: len({name})={len(seq)} != len(params)={n}")
    if hyper.amsgrad and (max_exp_avg_sqs is None or len(max_exp_avg_sqs) != n):
        raise ValueError("adam_step_multi: amsgrad=True needs one max_exp_avg_sq per param")
    if n == 0:
        return found_inf
    device = params[0].device
    if check_finite and found_inf is None:
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    name = resolve_backend(backend, device)
    vmaxes = list(max_exp_avg_sqs) if hyper.amsgrad else [None] * n
    if name in ("cuda", "cpu") and n > 1:
        # one native call: tensors checked in C++, all grads scanned before any update
        mod = _native.load()
        mod.adam_step_multi(
            list(params),
            list(grads),
            list(exp_avgs),
            list(exp_avg_sqs),
            vmaxes if hyper.amsgrad else [],
            found_inf,
            check_finite,
            *_scalars(hyper),
        )
        return found_inf
    if check_finite:
        for g in grads:
            _scan_finite(name, g, hyper.grad_scale, found_inf)
    for p, g, m, v, vm in zip(params, grads, exp_avgs, exp_avg_sqs, vmaxes):
        adam_step(
            p,
            g,
            m,
            v,
            hyper,
            max_exp_avg_sq=vm,
            found_inf=found_inf,
            check_finite=False,
            backend=name,
        )
    return found_inf


def _scan_finite(name: str, g: torch.Tensor, scale: float, found_inf: torch.Tensor) -> None:
    """Set found_inf when ``g * scale`` has a non-finite element, without a host sync on GPUs."""
    if name == "cpu":
        if not _native.load().all_finite(g, scale):
            found_inf.fill_(1.0)
    else:
        bad = (~torch.isfinite(g.float() * scale)).any().float()
        torch.maximum(found_inf, bad.view(1), out=found_inf)
