"""Quantized all-gather of params (ZeRO++'s qwZ): int8 (or int4) blockwise bytes on the wire.

[Note: quantized all-gather]
Each rank quantizes its own chunk (`zero_kernels.ops.quantize_blockwise`: symmetric, one fp32
scale per block), sends the bytes and the scales in one uint8 buffer through the ordinary
all-gather (whatever algorithm the probe chose for that size), and dequantizes every other
rank's chunk into the output when the handle is waited for. Its own chunk is copied as it is:
a rank's shard, and so the values the optimizer steps, never pass through the quantizer, and
the error a gathered param carries is at most half a quantization step of its block
(|x - q*scale| <= scale / 2, scale = max|x| / 127 for int8) and does not accumulate across steps
(each use gathers again from the exact shards). Per element the wire carries 1 byte (int8) or
1/2 (int4) plus 4 / block for the scales, against 4 (fp32) or 2 (bf16).

What stays exact, and why: the gradients (a different error budget: `quantize_grads` is not
built), and every gather made to hand params out rather than to compute with them: the model's
``state_dict()``, ``gathered_params``, ``close()``, the refresh after a checkpoint load, and the
small params kept whole between steps (``persist_below``), so no quantization enters a
checkpoint or a value the user reads.
"""

from __future__ import annotations

import torch

from .base import CommLog, Watch, rank, world_size

__all__ = ["QUANTIZED", "all_gather_quantized"]

QUANTIZED = {"int8": 8, "int4": 4}  # the values of ``quantize_weights`` and their bits


class _Dequantize:
    """The all-gather of the packed chunks; ``wait`` then writes the output."""

    __slots__ = ("inner", "output", "input", "recv", "bits", "block", "me", "n", "done")

    def __init__(self, inner, output, input, recv, bits, block, me, n):
        self.inner, self.output, self.input, self.recv = inner, output, input, recv
        self.bits, self.block, self.me, self.n, self.done = bits, block, me, n, False

    def is_completed(self) -> bool:
        return self.done or self.inner.is_completed()

    def wait(self, timeout_s: float | None = None, what: str = "", watch: Watch | None = None):
        if self.done:
            return self.output
        from ..ops.quant import dequantize_blockwise, quantized_sizes

        self.inner.wait(timeout_s, what, watch)
        c = self.input.numel()
        nq, ns = quantized_sizes(c, self.bits, self.block)
        qb = nq
        nq = -(-nq // 4) * 4  # as packed by `all_gather_quantized`
        per = self.recv.numel() // self.n
        out = self.output.view(-1)
        for k in range(self.n):
            dst = out[k * c : (k + 1) * c]
            if k == self.me:
                if dst.data_ptr() != self.input.data_ptr():
                    dst.copy_(self.input.view(-1))
                continue
            chunk = self.recv[k * per : (k + 1) * per]
            scales = chunk[nq : nq + 4 * ns].view(torch.float32)
            dequantize_blockwise(chunk[:qb], scales, self.bits, self.block, c, out=dst)
        self.done = True
        self.recv = None
        return self.output


def all_gather_quantized(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    bits: int,
    block: int,
    group=None,
    log: CommLog | None = None,
    **bound,
):
    """Start ``output = cat(input of every rank)`` with the other ranks' chunks sent quantized
    ([Note: quantized all-gather]); returns a handle whose ``wait`` dequantizes. ``input`` may
    be this rank's own chunk of ``output``."""
    from ..ops.quant import quantize_blockwise, quantized_sizes
    from . import all_gather

    n = world_size(group)
    c = input.numel()
    if c * n != output.numel():
        raise ValueError(
            f"all_gather_quantized: input.numel() * world_size must equal output.numel(); got "
            f"{c} * {n} != {output.numel()}"
        )
    if n == 1:
        return all_gather(output, input, group=group, log=log, **bound)
    nq, ns = quantized_sizes(c, bits, block)
    nq = -(-nq // 4) * 4  # the scales start 4-aligned (a float32 view of the bytes)
    per = nq + 4 * ns
    send = torch.empty(per, dtype=torch.uint8, device=input.device)
    src = input.view(-1)
    if not src.is_contiguous():
        src = src.contiguous()
    qb = quantized_sizes(c, bits, block)[0]
    quantize_blockwise(src, bits, block, out=(send[:qb], send[nq:].view(torch.float32)))
    recv = torch.empty(per * n, dtype=torch.uint8, device=input.device)
    inner = all_gather(recv, send, group=group, log=log, **bound)
    return _Dequantize(inner, output, input, recv, bits, block, rank(group), n)
