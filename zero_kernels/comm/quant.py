"""Quantized collectives (ZeRO++'s qwZ and qgZ): int8 or int4 blockwise bytes on the wire.

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
Params of one dimension (norms' gains and biases) are never quantized: with ``quantize_weights``
they are kept whole on every rank (the persistent unit, as ``persist_below`` keeps small params;
`unit_assignment`'s ``whole_vectors``), refreshed exact after each step. A gain near 1.0 in a
block whose largest value is ~1 moves in steps of 1/127 (int8) while AdamW moves it by ~lr a
step, so its forward sees no change for many steps and then a jump; measured on the demo's GPT
("small", 4 emulated ranks, 300 steps, every chunk quantized as with hpZ, 3 seeds,
bench/bench_int4_grads.py): int8 weights with the vectors quantized end +6.4% in final loss
over exact training (+3.7% to +8.1%), with them kept whole within the noise of a 1e-3
perturbation. Their memory is small (a few d-element vectors per block against d^2 matrices).
DeepSpeed keeps such params whole too (its persistence threshold, 1e5 elements by default).
With stage 3's secondary shard (``own_exact=False``) the own chunk is dequantized too, so every
rank gathers the same values: a backward gathered from the node's secondary shards (which hold
slices of other ranks' gathered values) then sees what its forward saw ([Note: secondary shard]
in `zero_kernels.partition.secondary`).

[Note: quantized reduce-scatter]
``quantize_grads`` (ZeRO++'s qgZ, one hop here): a rank quantizes the chunk of its gradient bucket
meant for each other rank, all-to-all exchanges them (gloo's ``all_to_all_single``), and sums
what it received dequantized, in fp32, with its own chunk, which never leaves it and is exact;
then averages. Inf/NaN survive the round trip (a block holding one dequantizes non-finite), so
``nonfinite=`` and the loss scaler still see them. The error is per step (no error feedback),
at most half a step of each block per rank's contribution. A flat group that spans hosts of
several ranks each reduces in two hops instead, exact inside each node and quantized across
([Note: two-hop quantized reduce-scatter] in hier_quant.py); with a hierarchical
``shard_group`` only the hop across the replica groups is quantized ([Note: quantized two-hop]
in hier.py).

Blocks: int8 gradients use one scale per 256 elements, int4 gradients one per 32 (0.625 bytes
per element instead of 0.516). Measured (bench/bench_int4_grads.py, the exact one-process
emulation, which reproduces the real 4-rank stage-3 run's final loss to 4 digits): under stage
3's layout (a bucket per unit, cut in one chunk per rank) int4 in blocks of 256 ends 300 steps
of the demo GPT +17.6% above exact training and blocks of 32 -0.6% (seed 0; see
docs/benchmarks.md, "Which part costs accuracy" for the seeds); with 16 levels a block's largest
gradient sets a step that rounds most of the others to zero, and smaller blocks hold fewer
outliers. The params of one dimension are laid out in buckets of their own and reduced exact
(`exact_buckets` of the reducer): their small gradients lost 14-55% to blocks shared with
larger ones.

What stays exact in the weights' case, and why: every gather made to hand params out rather
than to compute with them: the model's ``state_dict()``, ``gathered_params``, ``close()``, the
refresh after a checkpoint load, and the small params kept whole between steps
(``persist_below``), so no quantization enters a
checkpoint or a value the user reads.
"""

from __future__ import annotations

import torch

from .base import CommLog, Watch, _nbytes, rank, world_size
from .collectives import all_gather

__all__ = ["GRAD_BLOCK", "QUANTIZED", "all_gather_quantized", "reduce_scatter_quantized"]

QUANTIZED = {"int8": 8, "int4": 4}  # the values of ``quantize_weights`` and their bits
# elements per scale of ``quantize_grads``, by bits: int4 gradients use blocks of 32 ([Note:
# quantized reduce-scatter]); weights use `zero_kernels.ops.quant.DEFAULT_BLOCK` (256)
GRAD_BLOCK = {8: 256, 4: 32}


class _Unpack:
    """A collective of packed quantized chunks; ``wait`` finishes it, then `_unpack` writes the
    output (once)."""

    __slots__ = ("inner", "output", "recv", "bits", "block", "me", "n", "done")

    def __init__(self, inner, output, recv, bits, block, me, n):
        self.inner, self.output, self.recv = inner, output, recv
        self.bits, self.block, self.me, self.n, self.done = bits, block, me, n, False

    def is_completed(self) -> bool:
        return self.done or self.inner.is_completed()

    def wait(self, timeout_s: float | None = None, what: str = "", watch: Watch | None = None):
        if not self.done:
            self.inner.wait(timeout_s, what, watch)
            self._unpack()
            self.done, self.recv = True, None
        return self.output

    def _chunks(self, c: int):
        """``(k, values, scales)`` of every other rank's chunk received."""
        qb, nq, per = packed_sizes(c, self.bits, self.block)
        for k in range(self.n):
            if k != self.me:
                chunk = self.recv[k * per : (k + 1) * per]
                yield k, chunk[:qb], chunk[nq:per].view(torch.float32)


class _Dequantize(_Unpack):
    """The all-gather of the packed chunks; the others' dequantized into the output."""

    __slots__ = ("input", "send")

    def __init__(self, inner, output, input, recv, bits, block, me, n, send=None):
        super().__init__(inner, output, recv, bits, block, me, n)
        self.input, self.send = input, send  # ``send``: the own chunk dequantized as well

    def _unpack(self) -> None:
        from ..ops.quant import dequantize_blockwise

        c = self.input.numel()
        out = self.output.view(-1)
        own = out[self.me * c : (self.me + 1) * c]
        if self.send is not None:
            qb, nq, _ = packed_sizes(c, self.bits, self.block)
            q, scales = self.send[:qb], self.send[nq:].view(torch.float32)
            dequantize_blockwise(q, scales, self.bits, self.block, c, out=own)
            self.send = None
        elif own.data_ptr() != self.input.data_ptr():
            own.copy_(self.input.view(-1))
        for k, q, scales in self._chunks(c):
            dst = out[k * c : (k + 1) * c]
            dequantize_blockwise(q, scales, self.bits, self.block, c, out=dst)


def all_gather_quantized(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    bits: int,
    block: int,
    group=None,
    log: CommLog | None = None,
    own_exact: bool = True,
    errors: dict | None = None,
    kind: str | None = "all_gather",
    **bound,
):
    """Start ``output = cat(input of every rank)`` with the other ranks' chunks sent quantized
    ([Note: quantized all-gather]); returns a handle whose ``wait`` dequantizes. ``errors``:
    error feedback on this rank's chunk (the two-hop gradient form's second half, [Note: error
    feedback]; never for params), its buffer under ``"all_gather"``. ``input`` may
    be this rank's own chunk of ``output`` (not with ``own_exact=False``, which dequantizes the
    own chunk too, so that every rank's output is the same)."""
    from ..ops.quant import quantize_blockwise

    n = world_size(group)
    c = input.numel()
    if c * n != output.numel():
        raise ValueError(
            f"all_gather_quantized: input.numel() * world_size must equal output.numel(); got "
            f"{c} * {n} != {output.numel()}"
        )
    if n == 1 and own_exact:
        return all_gather(output, input, group=group, log=log, kind=kind, **bound)
    qb, nq, per = packed_sizes(c, bits, block)
    send = torch.empty(per, dtype=torch.uint8, device=input.device)
    src = input.view(-1)
    if not src.is_contiguous():
        src = src.contiguous()
    err = feedback_buffer(errors, "all_gather", c, input.device)
    quantize_blockwise(src, bits, block, error=err, out=(send[:qb], send[nq:].view(torch.float32)))
    recv = torch.empty(per * n, dtype=torch.uint8, device=input.device)
    inner = all_gather(recv, send, group=group, log=log, kind=kind, **bound)
    own = None if own_exact else send
    return _Dequantize(inner, output, input, recv, bits, block, rank(group), n, own)


class _QuantReduce(_Unpack):
    """The all-to-all of the quantized chunks; summed (fp32) with the own chunk into the output."""

    __slots__ = ("own", "avg")

    def __init__(self, inner, output, own, recv, bits, block, me, n, avg):
        super().__init__(inner, output, recv, bits, block, me, n)
        self.own, self.avg = own, avg

    def _unpack(self) -> None:
        from ..ops.quant import dequantize_blockwise

        acc, c = self.own, self.own.numel()  # this rank's own contribution, exact, fp32
        for _, q, scales in self._chunks(c):
            dequantize_blockwise(q, scales, self.bits, self.block, c, out=acc, accumulate=True)
        if self.avg:
            acc.div_(self.n)
        self.output.view(-1).copy_(acc)
        self.own = None


def packed_sizes(c: int, bits: int, block: int) -> tuple[int, int, int]:
    """(bytes of the values, their padded size, bytes per chunk with the fp32 scales)."""
    from ..ops.quant import quantized_sizes

    qb, ns = quantized_sizes(c, bits, block)
    nq = -(-qb // 4) * 4  # the scales start 4-aligned (a float32 view of the bytes)
    return qb, nq, nq + 4 * ns


def feedback_buffer(errors: dict | None, key: str, numel: int, device) -> torch.Tensor | None:
    """[Note: error feedback]
    ``grad_error_feedback=True``: each quantization of a gradient bucket for another rank (or,
    in the two-hop form, for another replica group) adds the error buffer to what it quantizes
    and leaves there what the bytes miss of the sum (`quantize_blockwise`'s ``error``). What
    one step drops is sent the next, so the quantization error of the sum of the gradients over
    steps stays that of one step instead of growing with their number
    (tests/topology/test_quant_comm.py).
    The buffers are fp32, one per bucket and hop, of the size of what that hop quantizes (the
    whole bucket for the one-hop reduce-scatter: as much memory as the bucket's gradient; the
    padded shard and its chunk in the two-hop form), made at the bucket's first reduction and
    kept for the run (``memory_report()["comm_error_feedback_bytes"]``). A non-finite gradient
    makes its buffer non-finite: the step it skips (``nonfinite="skip"``) zeroes them.

    The buffer under ``errors[key]`` (zeros, ``numel`` fp32 elements: made here the first
    time); None without feedback."""
    if errors is None:
        return None
    buf = errors.get(key)
    if buf is None or buf.numel() != numel:
        buf = errors[key] = torch.zeros(numel, dtype=torch.float32, device=device)
    return buf


def reduce_scatter_quantized(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    bits: int,
    block: int,
    group=None,
    avg: bool = True,
    log: CommLog | None = None,
    timeout_s: float | None = None,
    what: str = "",
    watch: Watch | None = None,
    errors: dict | None = None,
    kind: str | None = "reduce_scatter",
):
    """Start ``output = reduce(input)[my chunk]`` with the chunks for the other ranks sent
    quantized ([Note: quantized reduce-scatter]); returns a handle whose ``wait`` sums them in
    fp32 with this rank's own chunk (exact) and averages when ``avg``. ``output`` may be this
    rank's own chunk of ``input``. ``errors`` (a dict kept by the caller per bucket): error
    feedback ([Note: error feedback]), its buffer under ``"reduce_scatter"``."""
    import torch.distributed as dist

    from ..ops.quant import quantize_blockwise
    from .base import Handle

    n, c = world_size(group), output.numel()
    if c * n != input.numel():
        raise ValueError(
            f"reduce_scatter_quantized: output.numel() * world_size must equal input.numel(); "
            f"got {c} * {n} != {input.numel()}"
        )
    src = input.reshape(-1)
    me = rank(group)
    own = src[me * c : (me + 1) * c].to(torch.float32, copy=True)  # before the input is reused
    if n == 1:
        output.view(-1).copy_(own)
        return Handle(None, (output,), 1.0, log)
    qb, nq, per = packed_sizes(c, bits, block)
    send = torch.zeros(per * n, dtype=torch.uint8, device=input.device)
    err = feedback_buffer(errors, "reduce_scatter", src.numel(), input.device)
    for k in range(n):
        if k != me:  # this rank's own chunk goes nowhere (its slot is sent as zeros)
            dst = send[k * per : (k + 1) * per]
            piece = src[k * c : (k + 1) * c]
            e = None if err is None else err[k * c : (k + 1) * c]
            quantize_blockwise(
                piece, bits, block, error=e, out=(dst[:qb], dst[nq:].view(torch.float32))
            )
    recv = torch.empty(per * n, dtype=torch.uint8, device=input.device)
    if log is not None:
        if kind is not None:
            log._add(kind, send)
        log._sent("all_to_all", _nbytes(send), group)  # [Note: bytes by link]
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    return _QuantReduce(Handle(work, (recv, send)), output, own, recv, bits, block, me, n, avg)
