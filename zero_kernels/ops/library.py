"""The kernels as `torch.library` custom ops, so torch.compile sees them as single graph nodes.

Two ops in the ``zero_kernels`` namespace (schemas below, `ADAM_STEP_SCHEMA` and
`ADAM_STEP_MULTI_SCHEMA`): tensors first, the step's hyper-parameters as keyword-only named
arguments. Each op has one implementation for every device, which picks the backend
(`zero_kernels.ops.resolve_backend`: native cpu/cuda, triton, reference) and calls it, and a fake
(meta) implementation that checks the arguments and returns nothing, so a compiled graph holds the
op as one opaque node (auto-functionalized, then re-inplaced by inductor). Nothing is compiled at
import: the native extension is the one ``pip install`` built, loaded on first use.

[Note: eager fast path]
Calling a mutating `torch.library.custom_op` from Python costs 120-200 us per call on this machine
(its ADInplaceOrView kernel rebuilds the argument list of the 19-argument schema per call), as
much as a whole 1M-param step. `adam_step` and `adam_step_multi` below therefore run the
implementation directly when nothing can observe the difference: not under torch.compile, no
torch dispatch or function mode active, and only plain tensors (or Parameters). They bump the
mutated tensors' version counters as the op would. Anything else (dynamo tracing, fake and
functional tensors, make_fx, tensor subclasses) goes through the op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import native
from . import reference
from .backends import resolve_backend
from .hyper import AdamHyper

__all__ = [
    "ADAM_STEP_MULTI_SCHEMA",
    "ADAM_STEP_SCHEMA",
    "adam_step",
    "adam_step_",
    "adam_step_multi",
    "adam_step_multi_",
]

_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOWP_DTYPES = (torch.bfloat16, torch.float16)

# the step's scalars: keyword-only, named as in `AdamHyper` (+ check_finite, backend)
_HYPER_SCHEMA = (
    "float lr, float beta1, float beta2, float eps, float weight_decay, SymInt step, bool adamw, "
    "bool amsgrad=False, bool maximize=False, float grad_scale=1., bool check_finite=False, "
    'str backend="auto"'
)
ADAM_STEP_SCHEMA = (
    "(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
    "Tensor(d!)? max_exp_avg_sq=None, Tensor(e!)? out_lowp=None, Tensor(f!)? found_inf=None, *, "
    f"{_HYPER_SCHEMA}) -> ()"
)
ADAM_STEP_MULTI_SCHEMA = (
    "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
    "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)? found_inf=None, *, "
    f"{_HYPER_SCHEMA}) -> ()"
)


def _hyper(lr, beta1, beta2, eps, weight_decay, step, adamw, amsgrad, maximize, grad_scale):
    return AdamHyper(
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        adamw=adamw,
        amsgrad=amsgrad,
        maximize=maximize,
        grad_scale=grad_scale,
    )


def hyper_kwargs(h: AdamHyper, check_finite: bool, backend: str) -> dict:
    """The keyword arguments of the ops for one `AdamHyper`."""
    return dict(
        lr=h.lr,
        beta1=h.beta1,
        beta2=h.beta2,
        eps=h.eps,
        weight_decay=h.weight_decay,
        step=h.step,
        adamw=h.adamw,
        amsgrad=h.amsgrad,
        maximize=h.maximize,
        grad_scale=h.grad_scale,
        check_finite=check_finite,
        backend=backend,
    )


def _native_scalars(h: AdamHyper) -> tuple:
    """The positional scalars the native binding (csrc/bindings.cpp) takes, in its order."""
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


def _resolve(backend: str, device: torch.device) -> str:
    return resolve_backend(backend, device)


# ---- argument checks: shared by the implementations and the fake (meta) implementations ----


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


def _check_found_inf(found_inf: torch.Tensor | None, device: torch.device, check_finite: bool):
    if found_inf is None:
        if check_finite:
            raise ValueError("adam_step: check_finite=True needs found_inf, got None")
        return
    if (
        not isinstance(found_inf, torch.Tensor)
        or found_inf.dtype != torch.float32
        or found_inf.numel() != 1
        or found_inf.device != device
    ):
        raise ValueError(
            f"adam_step: found_inf must be one fp32 element on {device}, got "
            f"shape={tuple(found_inf.shape)} dtype={found_inf.dtype} device={found_inf.device}"
        )


def _check_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, out_lowp, amsgrad) -> None:
    _check("param", param, param, _STATE_DTYPES)
    _check("grad", grad, param, (torch.float32, param.dtype))
    _check("exp_avg", exp_avg, param, (param.dtype,))
    _check("exp_avg_sq", exp_avg_sq, param, (param.dtype,))
    if amsgrad:
        if max_exp_avg_sq is None:
            raise ValueError("adam_step: amsgrad=True needs max_exp_avg_sq, got None")
        _check("max_exp_avg_sq", max_exp_avg_sq, param, (param.dtype,))
    if out_lowp is not None:
        _check("out_lowp", out_lowp, param, _LOWP_DTYPES)


def _check_lists(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, amsgrad) -> None:
    n = len(params)
    for name, seq in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        if len(seq) != n:
            raise ValueError(f"adam_step_multi: len({name})={len(seq)} != len(params)={n}")
    if amsgrad and len(max_exp_avg_sqs) != n:
        raise ValueError(
            f"adam_step_multi: amsgrad=True needs one max_exp_avg_sq per param, got "
            f"len(max_exp_avg_sqs)={len(max_exp_avg_sqs)} for len(params)={n}"
        )


# ---- implementations (real tensors) ----


def _adam_step_impl(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: torch.Tensor | None = None,
    out_lowp: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    adamw: bool,
    amsgrad: bool = False,
    maximize: bool = False,
    grad_scale: float = 1.0,
    check_finite: bool = False,
    backend: str = "auto",
) -> None:
    h = _hyper(lr, beta1, beta2, eps, weight_decay, step, adamw, amsgrad, maximize, grad_scale)
    args = (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, out_lowp, found_inf)
    _adam_step(*args, h, check_finite, backend)


def _adam_step(
    param, grad, exp_avg, exp_avg_sq, vmax, out_lowp, found_inf, h, check_finite, backend
):
    _check_step(param, grad, exp_avg, exp_avg_sq, vmax, out_lowp, h.amsgrad)
    _check_found_inf(found_inf, param.device, check_finite)
    name = _resolve(backend, param.device)
    vmax = vmax if h.amsgrad else None
    _run_one(name, param, grad, exp_avg, exp_avg_sq, h, vmax, out_lowp, found_inf, check_finite)


def _run_one(name, param, grad, exp_avg, exp_avg_sq, h, vmax, out_lowp, found_inf, check_finite):
    if param.numel() == 0:
        return
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
            h,
            max_exp_avg_sq=vmax,
            out_lowp=out_lowp,
            found_inf=found_inf,
            check_finite=check_finite,
        )
    else:
        native.load().adam_step(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            vmax,
            out_lowp,
            found_inf,
            check_finite,
            *_native_scalars(h),
        )


def _adam_step_multi_impl(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    found_inf: torch.Tensor | None = None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    adamw: bool,
    amsgrad: bool = False,
    maximize: bool = False,
    grad_scale: float = 1.0,
    check_finite: bool = False,
    backend: str = "auto",
) -> None:
    h = _hyper(lr, beta1, beta2, eps, weight_decay, step, adamw, amsgrad, maximize, grad_scale)
    lists = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
    _adam_step_multi(*lists, found_inf, h, check_finite, backend)


def _adam_step_multi(
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, found_inf, h, check_finite, backend
):
    amsgrad, grad_scale = h.amsgrad, h.grad_scale
    n = len(params)
    if n == 0:
        _check_lists(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, amsgrad)
        return
    device = params[0].device
    name = _resolve(backend, device)
    if name in ("cuda", "cpu"):
        # one native call: every tensor checked in C++ before any is written, all grads scanned
        # before any update; the Python checks run only on a failure, for their messages
        args = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [])
        try:
            native.load().adam_step_multi(*args, found_inf, check_finite, *_native_scalars(h))
        except (RuntimeError, TypeError, ValueError):
            _check_lists(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, amsgrad)
            _check_found_inf(found_inf, device, check_finite)
            for p, g, m, v, vm in zip(params, grads, exp_avgs, exp_avg_sqs, args[4] or [None] * n):
                _check_step(p, g, m, v, vm, None, amsgrad)
            raise
        return
    _check_lists(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, amsgrad)
    _check_found_inf(found_inf, device, check_finite)
    vmaxes = list(max_exp_avg_sqs) if amsgrad else [None] * n
    for p, g, m, v, vm in zip(params, grads, exp_avgs, exp_avg_sqs, vmaxes):
        _check_step(p, g, m, v, vm, None, amsgrad)
        if p.device != device:
            raise ValueError(f"adam_step_multi: params on {p.device} and {device}; group them")
    if check_finite:
        for g in grads:
            _scan_finite(name, g, grad_scale, found_inf)
    for p, g, m, v, vm in zip(params, grads, exp_avgs, exp_avg_sqs, vmaxes):
        _run_one(name, p, g, m, v, h, vm, None, found_inf, False)


def _scan_finite(name: str, g: torch.Tensor, scale: float, found_inf: torch.Tensor) -> None:
    """Set found_inf when ``g * scale`` has a non-finite element, without a host sync on GPUs."""
    if name == "cpu":
        if not native.load().all_finite(g, scale):
            found_inf.fill_(1.0)
    else:
        bad = (~torch.isfinite(g.float() * scale)).any().float()
        torch.maximum(found_inf, bad.view(1), out=found_inf)


# ---- the ops ----

adam_step_ = torch.library.custom_op(
    "zero_kernels::adam_step_",
    mutates_args=("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "out_lowp", "found_inf"),
    schema=ADAM_STEP_SCHEMA,
)(_adam_step_impl)

adam_step_multi_ = torch.library.custom_op(
    "zero_kernels::adam_step_multi_",
    mutates_args=("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "found_inf"),
    schema=ADAM_STEP_MULTI_SCHEMA,
)(_adam_step_multi_impl)


@adam_step_.register_fake
def _adam_step_fake(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    max_exp_avg_sq=None,
    out_lowp=None,
    found_inf=None,
    *,
    amsgrad=False,
    check_finite=False,
    **hyper,
) -> None:
    _check_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, out_lowp, amsgrad)
    _check_found_inf(found_inf, param.device, check_finite)


@adam_step_multi_.register_fake
def _adam_step_multi_fake(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    max_exp_avg_sqs,
    found_inf=None,
    *,
    amsgrad=False,
    check_finite=False,
    **hyper,
) -> None:
    _check_lists(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, amsgrad)
    vmaxes = max_exp_avg_sqs if amsgrad else [None] * len(params)
    for p, g, m, v, vm in zip(params, grads, exp_avgs, exp_avg_sqs, vmaxes):
        _check_step(p, g, m, v, vm, None, amsgrad)
    if params:
        _check_found_inf(found_inf, params[0].device, check_finite)


# ---- what `zero_kernels.ops` calls: the op, or its implementation directly [Note: eager fast path]


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_increment_version = getattr(torch.autograd.graph, "increment_version", None)


def _takes_lists() -> bool:
    """Whether this torch's increment_version takes a list (newer releases; 2.4 takes one)."""
    try:
        _increment_version([torch.empty(0)])
        return True
    except (TypeError, RuntimeError):
        return False


_BUMP_LISTS = _increment_version is not None and _takes_lists()


def _direct(*seqs: Sequence[torch.Tensor | None]) -> bool:
    """True when the implementation may run without the op: see [Note: eager fast path]."""
    if torch.compiler.is_compiling():
        return False
    if torch._C._len_torch_dispatch_stack() > 0 or torch._C._is_torch_function_mode_enabled():
        return False
    for seq in seqs:
        for t in seq:
            if t is not None and type(t) not in _PLAIN:
                return False
    return True


def _bump(*seqs: Sequence[torch.Tensor | None]) -> None:
    """What the op's ADInplaceOrView kernel does: mark the mutated tensors as written."""
    if _BUMP_LISTS:
        _increment_version([t for seq in seqs for t in seq if t is not None])
    elif _increment_version is not None:
        for seq in seqs:
            for t in seq:
                if t is not None:
                    _increment_version(t)


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: torch.Tensor | None,
    out_lowp: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    hyper: AdamHyper,
    check_finite: bool,
    backend: str,
) -> None:
    """``zero_kernels::adam_step_`` with the hyper-parameters of ``hyper``."""
    args = (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, out_lowp, found_inf)
    if _direct(args):
        _adam_step(*args, hyper, check_finite, backend)
        _bump((param, exp_avg, exp_avg_sq, max_exp_avg_sq, out_lowp, found_inf))
    else:
        adam_step_(*args, **hyper_kwargs(hyper, check_finite, backend))


def adam_step_multi(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    found_inf: torch.Tensor | None,
    hyper: AdamHyper,
    check_finite: bool,
    backend: str,
) -> None:
    """``zero_kernels::adam_step_multi_`` with the hyper-parameters of ``hyper``."""
    lists = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
    if _direct([found_inf], *lists):
        _adam_step_multi(*lists, found_inf, hyper, check_finite, backend)
        _bump(params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, [found_inf])
    else:
        adam_step_multi_(*lists, found_inf, **hyper_kwargs(hyper, check_finite, backend))
