"""Drop-in `torch.optim` Adam/AdamW running the one-pass fused step.

Constructor arguments, defaults, param groups and ``state_dict`` layout are torch's own
(``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``), so a state saved by
``torch.optim.AdamW`` loads here and the reverse. Only ``backend`` is new.

bf16/fp16 params keep their state in the param dtype (as torch does) and are stepped with fp32
math, like ``torch.optim.AdamW(fused=True)``. Non-contiguous params whose grads and states share
their strides are stepped in place over their storage; any other layout is stepped through
contiguous copies that are written back.

``state_dtype="bf16" | "int8"`` keeps exp_avg/exp_avg_sq of fp32 params in that format
(`zero_kernels.ops.lowbit` [Note: low-bit state]); params below ``min_lowbit_numel`` elements
and params of other dtypes keep torch's state. Such a ``state_dict`` holds the low-bit tensors
and their scales (it loads back here bit for bit); `fp32_state_dict` gives torch's format for a
plain torch optimizer, and a torch-format state loads here (encoded into ``state_dtype``).

``bf16_stochastic_round=True``: bf16 params are stepped in fp32 (their value read into a
transient fp32 copy, moments kept as fp32 params' are: fp32, or ``state_dtype``) and written back
rounded stochastically, without a master (`zero_kernels.ops.sr` [Note: stochastic rounding]):
the rounding of the k-th param (counted across groups) at step t is the same draw under
`zero_kernels.ZeroOptimizer` at any stage and world size.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from . import ops
from .ops import AdamHyper, lowbit, sr

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
        state_dtype: str = "fp32",
        state_block: int = lowbit.DEFAULT_STATE_BLOCK,
        min_lowbit_numel: int = lowbit.MIN_LOWBIT_NUMEL,
        bf16_stochastic_round: bool = False,
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
        lowbit.check_state_dtype(state_dtype, state_block, type(self).__name__)
        if state_dtype != "fp32" and amsgrad:
            raise ValueError(
                f"{type(self).__name__}: amsgrad=True keeps max_exp_avg_sq, which has no low-bit "
                f"format; use state_dtype='fp32' with amsgrad, got state_dtype={state_dtype!r}"
            )
        if not isinstance(min_lowbit_numel, int) or min_lowbit_numel < 0:
            raise ValueError(f"min_lowbit_numel must be an int >= 0, got {min_lowbit_numel!r}")
        if not isinstance(bf16_stochastic_round, bool):
            raise TypeError(f"bf16_stochastic_round must be a bool, got {bf16_stochastic_round!r}")
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self._decoupled_default
        self.backend = backend
        self.state_dtype = state_dtype
        self.state_block = state_block
        self.min_lowbit_numel = min_lowbit_numel
        self.bf16_stochastic_round = bf16_stochastic_round
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
        if not hasattr(self, "state_dtype"):
            self.state_dtype, self.state_block = "fp32", lowbit.DEFAULT_STATE_BLOCK
            self.min_lowbit_numel = lowbit.MIN_LOWBIT_NUMEL
        if not hasattr(self, "bf16_stochastic_round"):
            self.bf16_stochastic_round = False

    def _lowbit(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s moments are kept in ``state_dtype`` (fp32 masters above the size)."""
        return (
            self.state_dtype != "fp32"
            and (p.dtype == torch.float32 or self._sr(p))
            and p.numel() >= self.min_lowbit_numel
        )

    def _sr(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is stepped in fp32 and rounded back stochastically."""
        return self.bf16_stochastic_round and p.dtype == torch.bfloat16

    def _init_state(self, p: torch.Tensor, amsgrad: bool) -> dict:
        state = self.state[p]
        if len(state) == 0 and self._lowbit(p):
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state.update(lowbit.new_state(p.numel(), self.state_dtype, self.state_block, p.device))
            if self.state_dtype == "int8":
                state["state_block"] = self.state_block
        elif len(state) == 0:
            # stochastic rounding: fp32 moments of the param's shape, contiguous like the copy
            sr = self._sr(p)
            fmt = torch.contiguous_format if sr else torch.preserve_format
            dt = torch.float32 if sr else p.dtype
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=dt, memory_format=fmt)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dt, memory_format=fmt)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = None  # stochastic rounding: each param's position across the groups
        if self.bf16_stochastic_round:
            index = {
                id(p): k for k, p in enumerate(p for g in self.param_groups for p in g["params"])
            }
        for group in self.param_groups:
            self._step_group(group, index)
        return loss

    def _step_group(self, group: dict, index: dict | None = None) -> None:
        beta1, beta2 = group["betas"]
        amsgrad = group["amsgrad"]
        states = self.state
        live = []
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients, "
                    f"got a sparse grad for a param of shape {tuple(p.shape)}"
                )
            if p.dtype not in _FLOAT_DTYPES:
                raise TypeError(
                    f"{type(self).__name__}: params must be one of {_FLOAT_DTYPES}, "
                    f"got p.dtype={p.dtype}"
                )
            if grad.is_complex():
                raise TypeError(f"{type(self).__name__}: complex grads are not supported")
            state = states.get(p)
            if not state or (amsgrad and "max_exp_avg_sq" not in state):
                state = self._init_state(p, amsgrad)
            live.append((p, grad, state))
        if not live:
            return
        # every step counter at once (torch keeps them as tensors, per param)
        steps = [state["step"] for _, _, state in live]
        torch._foreach_add_(steps, 1.0)
        values = [steps[0].item()] if len(steps) == 1 else torch.stack(steps).tolist()
        # (device, dtype, grad dtype, step) -> items; one multi-tensor call per key
        buckets: dict[tuple, list] = defaultdict(list)
        for (p, grad, state), step in zip(live, values):
            if grad.dtype != torch.float32 and grad.dtype != p.dtype:
                grad = grad.to(p.dtype)
            buckets[(p.device, p.dtype, grad.dtype, int(step))].append((p, grad, state))
        plain = self.state_dtype == "fp32" and not self.bf16_stochastic_round
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
            if not plain:
                rounded = [it for it in items if self._sr(it[0])]
                if rounded:
                    self._run_sr(rounded, hyper, index)
                    items = [it for it in items if not self._sr(it[0])]
                low = [it for it in items if self._lowbit(it[0])]
                if low:
                    self._run_lowbit(low, hyper)
                    items = [it for it in items if not self._lowbit(it[0])]
            if items:
                self._run(items, hyper, amsgrad)

    def _run_sr(self, items: list, hyper: AdamHyper, index: dict) -> None:
        """bf16 params: the step on an fp32 copy, rounded back stochastically (one call each)."""
        for p, g, state in items:
            x = p.detach().reshape(-1).float()
            flat_g = g.reshape(-1)
            if self._lowbit(p):
                self._lowbit_step(x, flat_g, state, hyper)
            else:
                ops.adam_step(
                    x,
                    flat_g.float(),
                    state["exp_avg"].view(-1),
                    state["exp_avg_sq"].view(-1),
                    hyper,
                    max_exp_avg_sq=state["max_exp_avg_sq"].view(-1) if hyper.amsgrad else None,
                    backend=self.backend,
                )
            dst = p.detach().view(-1) if p.is_contiguous() else torch.empty_like(x, dtype=p.dtype)
            key = sr.sr_key(hyper.step, index[id(p)])
            sr.stochastic_round_bf16_(dst, x, key, 0, backend=self.backend)
            if not p.is_contiguous():
                p.detach().copy_(dst.view_as(p))

    def _run_lowbit(self, items: list, hyper: AdamHyper) -> None:
        for p, g, state in items:
            flat_p = p.view(-1) if p.is_contiguous() else p.detach().contiguous().view(-1)
            flat_g = g.reshape(-1) if g.is_contiguous() else g.contiguous().view(-1)
            self._lowbit_step(flat_p, flat_g, state, hyper)
            if flat_p.data_ptr() != p.data_ptr():
                p.copy_(flat_p.view_as(p))

    def _lowbit_step(self, flat_p, flat_g, state: dict, hyper: AdamHyper) -> None:
        lowbit.adam_step_lowbit(
            flat_p,
            flat_g,
            state,
            hyper,
            state_dtype=self.state_dtype,
            block=self.state_block,
            backend=self.backend,
        )

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then each low-bit param's state back in ``state_dtype``: torch casts
        every state tensor to the param's dtype (bf16 moments and int8 codes arrive fp32, exact),
        and a torch-format state (fp32 exp_avg/exp_avg_sq of the param's shape) is encoded."""
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for k, st in state_dict["state"].items():  # torch cast them to bf16: the saved values
            if isinstance(k, int) and k < len(params) and self._sr(params[k]):
                for name, t in st.items():
                    if name != "step" and torch.is_tensor(t):
                        self.state[params[k]][name] = t.to(params[k].device, copy=True)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and self._lowbit(p):
                    self._to_lowbit(p, state)
                elif state and "exp_avg_scale" in state:  # saved int8, kept fp32 here
                    state["exp_avg"] = state["exp_avg"].to(torch.int8)
                    state["exp_avg_sq"] = state["exp_avg_sq"].to(torch.uint8)
                    m, v = lowbit.decode_state(state, "int8", state.pop("state_block"))
                    for k in ("exp_avg_scale", "exp_avg_sq_scale"):
                        del state[k]
                    state["exp_avg"], state["exp_avg_sq"] = m.view_as(p), v.view_as(p)
                elif state and "exp_avg" in state and state["exp_avg"].shape != p.shape:
                    state["exp_avg"] = state["exp_avg"].view_as(p)  # saved bf16 (flat)
                    state["exp_avg_sq"] = state["exp_avg_sq"].view_as(p)

    def _to_lowbit(self, p: torch.Tensor, state: dict) -> None:
        fmt, block = self.state_dtype, self.state_block
        saved_block = state.get("state_block", block)
        if "exp_avg_scale" in state:  # saved int8: same block stays as it is, else decoded
            # torch's load casts every state tensor to the param's dtype: codes arrive as fp32
            # integers, exact, and go back to their own dtypes
            state["exp_avg"] = state["exp_avg"].to(torch.int8)
            state["exp_avg_sq"] = state["exp_avg_sq"].to(torch.uint8)
            if fmt == "int8" and saved_block == block:
                return
            m, v = lowbit.decode_state(state, "int8", saved_block)
        else:  # torch's format, or bf16 moments that torch's load cast to fp32 (exact)
            m = state["exp_avg"].reshape(-1).float()
            v = state["exp_avg_sq"].reshape(-1).float()
        for k in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale", "max_exp_avg_sq"):
            state.pop(k, None)
        want = lowbit.new_state(p.numel(), fmt, block, p.device)
        lowbit.encode_state(m.to(p.device), v.to(p.device), fmt, block, want)
        state.update(want)
        if fmt == "int8":
            state["state_block"] = block

    def fp32_state_dict(self) -> dict:
        """``state_dict()`` in torch's format: every param's exp_avg/exp_avg_sq decoded to fp32
        tensors of its shape, loadable by ``torch.optim.Adam``/``AdamW``."""
        sd = self.state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, st in sd["state"].items():
            p = params[idx]
            if "exp_avg_scale" in st or st["exp_avg"].dtype == torch.bfloat16:
                fmt = "int8" if "exp_avg_scale" in st else "bf16"
                m, v = lowbit.decode_state(st, fmt, st.get("state_block", self.state_block))
                st = {"step": st["step"], "exp_avg": m.view_as(p), "exp_avg_sq": v.view_as(p)}
                sd["state"][idx] = st
        return sd

    def _run(self, items: list, hyper: AdamHyper, amsgrad: bool) -> None:
        flat: list[list[torch.Tensor]] = [[], [], [], [], []]
        write_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p, g, state in items:
            m, v = state["exp_avg"], state["exp_avg_sq"]
            tensors = [p, g, m, v, state["max_exp_avg_sq"]] if amsgrad else [p, g, m, v]
            if (
                p.is_contiguous()
                and g.is_contiguous()
                and m.is_contiguous()
                and v.is_contiguous()
                and (not amsgrad or tensors[4].is_contiguous())
            ):
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
