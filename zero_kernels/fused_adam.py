"""Drop-in `torch.optim` Adam/AdamW running the one-pass fused step.

Constructor arguments, defaults, param groups and ``state_dict`` layout are torch's own
(``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``), so a state saved by
``torch.optim.AdamW`` loads here and the reverse. Only ``backend`` is new.

bf16/fp16 params keep their state in the param dtype (as torch does) and are stepped with fp32
math, like ``torch.optim.AdamW(fused=True)``. Non-contiguous params whose grads and states share
their strides are stepped in place over their storage; any other layout is stepped through
contiguous copies that are written back.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from . import ops
from .ops import AdamHyper

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _dense_flat(t: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view over ``t``'s memory when it is non-overlapping and dense, else None."""
    if t.is_contiguous():
        return t.view(-1)
    if _dense_by_strides(t):
        return t.as_strided((t.numel(),), (1,), t.storage_offset())
    return None


def _dense_by_strides(t: torch.Tensor) -> bool:
    """True when the elements fill one gap-free block of memory (any dimension order)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda s: s[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


class FusedAdam(torch.optim.Optimizer):
    """Adam (L2 penalty) with torch's arguments; ``decoupled_weight_decay=True`` makes it AdamW.

    ``backend``: "auto" | "cpu" | "cuda" | "triton" | "reference" (see `zero_kernels.ops`).
    """

    _decoupled_default = False

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool | None = None,
        backend: str = "auto",
    ) -> None:
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element, got lr.shape={tuple(lr.shape)}")
        if not 0.0 <= float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if capturable or differentiable:
            raise NotImplementedError(
                f"{type(self).__name__}: capturable={capturable} / differentiable="
                f"{differentiable} are not supported; use torch.optim for those"
            )
        if backend not in ops.BACKENDS:
            raise ValueError(f"backend must be one of {ops.BACKENDS}, got backend={backend!r}")
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self._decoupled_default
        self.backend = backend
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=False,
            differentiable=False,
            fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("decoupled_weight_decay", self._decoupled_default)
        if not hasattr(self, "backend"):
            self.backend = "auto"

    def _init_state(self, p: torch.Tensor, amsgrad: bool) -> dict:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict) -> None:
        beta1, beta2 = group["betas"]
        amsgrad = group["amsgrad"]
        # (device, dtype, grad dtype, step) -> lists; one multi-tensor call per key
        buckets: dict[tuple, list] = defaultdict(list)
        live = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients, "
                    f"got a sparse grad for a param of shape {tuple(p.shape)}"
                )
            if p.dtype not in _FLOAT_DTYPES:
                raise TypeError(
                    f"{type(self).__name__}: params must be one of {_FLOAT_DTYPES}, "
                    f"got p.dtype={p.dtype}"
                )
            if torch.is_complex(p.grad):
                raise TypeError(f"{type(self).__name__}: complex grads are not supported")
            live.append((p, self._init_state(p, amsgrad)))
        if not live:
            return
        # every step counter at once (torch keeps them as tensors, per param)
        steps = [state["step"] for _, state in live]
        torch._foreach_add_(steps, 1.0)
        for (p, state), step in zip(live, torch.stack(steps).tolist()):
            grad = p.grad if p.grad.dtype in (torch.float32, p.dtype) else p.grad.to(p.dtype)
            buckets[(p.device, p.dtype, grad.dtype, int(step))].append((p, grad, state))
        for (_, _, _, step), items in buckets.items():
            hyper = AdamHyper(
                lr=float(group["lr"]),
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                step=step,
                adamw=group["decoupled_weight_decay"],
                amsgrad=amsgrad,
                maximize=group["maximize"],
            )
            self._run(items, hyper, amsgrad)

    def _run(self, items: list, hyper: AdamHyper, amsgrad: bool) -> None:
        flat: list[list[torch.Tensor]] = [[], [], [], [], []]
        write_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p, g, state in items:
            tensors = [p, g, state["exp_avg"], state["exp_avg_sq"]]
            if amsgrad:
                tensors.append(state["max_exp_avg_sq"])
            if all(t.is_contiguous() for t in tensors):
                views = tensors  # the kernels need only numel and contiguity, not a 1-D shape
            else:
                views = [_dense_flat(t) for t in tensors]
                same = all(t.stride() == p.stride() for t in tensors)
            if views is not tensors and (not same or any(v is None for v in views)):
                # e.g. a param whose grad came with other strides: step on copies, write back
                views = [t.contiguous().view(-1) for t in tensors]
                write_back += [
                    (t, v)
                    for t, v in zip(tensors, views)
                    if t is not g and v.data_ptr() != t.data_ptr()
                ]
            for i, v in enumerate(views):
                flat[i].append(v)
        ops.adam_step_multi(
            flat[0],
            flat[1],
            flat[2],
            flat[3],
            hyper,
            max_exp_avg_sqs=flat[4] if amsgrad else None,
            backend=self.backend,
        )
        for t, v in write_back:
            t.copy_(v.view_as(t))


class FusedAdamW(FusedAdam):
    """AdamW (decoupled weight decay) with torch's arguments and defaults (weight_decay=1e-2)."""

    _decoupled_default = True

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        **kwargs,
    ) -> None:
        kwargs.setdefault("decoupled_weight_decay", True)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)
