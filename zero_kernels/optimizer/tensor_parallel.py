"""ZeRO over tensor parallelism: a model's DTensor params sharded over dp by their local tensors.

[Note: tensor parallelism]
``parallelize_module(model, mesh["tp"], plan)`` replaces a layer's params by DTensors on the 1-D
``tp`` mesh: ``Shard(d)`` (Colwise/Rowwise weights: each tp rank holds a slice) or
``Replicate()`` (a Rowwise bias, SequenceParallel's norms: every tp rank holds the whole). Its
forward and backward run the tp collectives inside autograd; the gradient autograd accumulates
into a DTensor param is a DTensor whose local tensor is this tp rank's slice, already reduced
over tp. What is left to ZeRO is the dp dimension, and there each tp rank's local tensors are
ordinary tensors that the dp replicas of that tp rank share: ZeRO shards them over dp exactly as
it shards a plain model (memory per rank: the stage's formula over (params / tp) / dp).

So the optimizer is built over the *local* tensors (``p.to_local()``'s storage): they are what
the layout lays out, what the store makes views of (``local.data = view``: the DTensor keeps its
local tensor object, so the model sees every update and, at stage 3, every gather and free),
what the inner optimizer steps and what checkpoints hold. The DTensor stays what autograd knows:
the reducer's hooks sit on it, and each hook takes the local tensor of its gradient (a gradient
of another placement than its param's, e.g. ``Partial`` under SequenceParallel, is first
redistributed to the param's placements: a tp collective of the model's own).

What the tp dimension changes:

- norms: a ``Shard``-placed param's elements are split over tp, a ``Replicate`` one's are on
  every tp rank; so each tp rank counts the sharded params' pieces and tp rank 0 alone the
  replicated ones, and one more all-reduce over tp (sum, max for the inf-norm) gives the norm of
  the whole model, each element once (`norm_inputs`, `reduce`);
- the non-finite verdict: a NaN in one tp rank's slice must skip the step on every rank, so it
  is all-reduced over tp too;
- whole tensors: `whole` gathers a local tensor over tp (``full_param``, ``full_state``);
  ``consolidated_state_dict`` makes each element-wise entry of its dict whole the same way
  (`whole_state`), and ``load_state_dict`` of such a dict keeps each rank's part
  (`local_state`); checkpoints at another tp size are cut from the saved columns by the
  loader ([Note: redistributing across tp sizes] in zero_kernels/checkpoint/redistribution.py);
- ``p.grad`` of the DTensor param, for torch's tools: the local `ShardedGrad` wrapped as a
  DTensor of the param's placements (`publish_grads`); torch's ``clip_grad_norm_`` over such
  grads reduces over dp inside each local norm and over tp in DTensor's own norm of the stack.

The dp group: ``process_group=`` a ProcessGroup (``mesh["dp"].get_group()``) or the mesh itself,
1-D, or 2-D with a dim named ``"tp"`` (dp: the other dim). Unsupported combinations raise
naming them (`check_policy`).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import comm
from ..partition.state import elementwise

__all__ = ["TPParam", "TensorParallel", "dp_group_of", "find", "is_dtensor"]


def is_dtensor(t) -> bool:
    return any(c.__name__ == "DTensor" for c in type(t).__mro__)


def _is_mesh(x) -> bool:
    return type(x).__name__ == "DeviceMesh"


def dp_group_of(process_group):
    """The data-parallel ProcessGroup that ``process_group=`` names: itself, or the dp dim of a
    DeviceMesh (1-D: its only dim; 2-D: the dim not named ``"tp"``)."""
    if not _is_mesh(process_group):
        return process_group
    mesh = process_group
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.ndim == 2 and "tp" in names:
        dp = next(n for n in names if n != "tp")
        return mesh[dp].get_group()
    raise NotImplementedError(
        f"process_group= a DeviceMesh of shape {tuple(mesh.shape)} and dims {names}: "
        "ZeroOptimizer takes a 1-D mesh or a 2-D one with a dim named 'tp' (dp: the other); "
        "pass the dp group itself (mesh['dp'].get_group())"
    )


@dataclasses.dataclass(frozen=True, eq=False)
class TPParam:
    """One DTensor param: the autograd leaf the model uses, and its local tensor ZeRO shards."""

    param: torch.Tensor  # the DTensor (nn.Parameter): hooks, ``.grad`` for torch's tools
    local: torch.Tensor  # its local tensor: laid out, stored, stepped, checkpointed
    placements: tuple  # over the tp mesh
    sharded: bool  # some Shard placement: the elements differ across tp ranks


class TensorParallel:
    """The DTensor params of one optimizer (by index once `bind` has run), the tp group."""

    def __init__(self, by_param: dict[int, TPParam], mesh, dp_group):
        self.by_id = by_param  # id(DTensor param) -> TPParam
        self.mesh = mesh  # the 1-D tp DeviceMesh every DTensor param lives on
        self.group = mesh.get_group()
        self.size = comm.world_size(self.group)
        self.rank = comm.rank(self.group)
        self.by_index: dict[int, TPParam] = {}
        self.dp_group = dp_group

    # ------------------------------------------------------------------ construction
    def local_of(self, p: torch.Tensor) -> torch.Tensor:
        tp = self.by_id.get(id(p))
        return tp.local if tp is not None else p

    def bind(self, index_of_local: dict[int, int]) -> None:
        """Index the DTensor params by their optimizer index (``id(local) -> index``)."""
        self.by_index = {index_of_local[id(t.local)]: t for t in self.by_id.values()}

    def leaves(self, params: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Index -> the tensor autograd accumulates into (the DTensor for a tp param)."""
        return {i: (self.by_index[i].param if i in self.by_index else p) for i, p in params.items()}

    def leaf_ids(self) -> set[int]:
        return set(self.by_id)

    def placements(self, names: dict[int, str]) -> dict[str, list[str]]:
        """Name -> the tp placements (checkpoints record them)."""
        return {names[i]: [repr(x) for x in t.placements] for i, t in self.by_index.items()}

    # ------------------------------------------------------------------ whole tensors
    def whole(self, index: int, t: torch.Tensor) -> torch.Tensor:
        """``t``, a tensor of param ``index``'s local shape (gathered over dp), made whole over
        tp (a plain tensor of the DTensor's shape; collective over tp). A plain param's
        passes."""
        tpp = self.by_index.get(index)
        if tpp is None:
            return t
        from torch.distributed.tensor import DTensor

        spec = tpp.param._spec
        return DTensor(t.contiguous(), spec, requires_grad=False).full_tensor()

    def local_part(self, index: int, value: torch.Tensor) -> torch.Tensor:
        """This tp rank's part of ``value``, a whole tensor of param ``index``'s shape (the
        same on every rank); a plain param's passes."""
        tpp = self.by_index.get(index)
        if tpp is None:
            return value
        from torch.distributed.tensor import DTensor, Replicate

        mesh = tpp.param.device_mesh
        rep = DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return rep.redistribute(mesh, tpp.placements).to_local()

    def wrap_local(self, local: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``value`` (of ``local``'s shape) as a DTensor of the param whose local tensor is
        ``local``; a plain param's passes."""
        for t in self.by_id.values():
            if t.local is local:
                from torch.distributed.tensor import DTensor

                return DTensor(value.contiguous(), t.param._spec, requires_grad=False)
        return value

    def as_grad(self, index: int, local: torch.Tensor) -> torch.Tensor:
        """``local`` (param ``index``'s local shape) as a gradient of the DTensor param: a
        DTensor of its spec; a plain param's passes."""
        tpp = self.by_index.get(index)
        if tpp is None:
            return local
        from torch.distributed.tensor import DTensor

        return DTensor(local.contiguous(), tpp.param._spec, requires_grad=False)

    def whole_state(self, sd: dict | None) -> dict | None:
        """``sd``, a consolidated state dict of the local tensors (torch's format) on the ranks
        that hold it (None elsewhere), with each DTensor param's element-wise entries (moments,
        fp32 masters) made whole over tp, on the host. Collective over tp: every rank calls it;
        the ranks of a tp group hold ``sd`` all or none (they have one dp rank)."""
        held = comm.all_gather_object(sd is not None, group=self.group)
        if len(set(held)) > 1:
            raise ValueError(
                f"consolidated_state_dict: the ranks of tp group {comm.group_ranks(self.group)} "
                f"have different dp ranks (holding the state: {held}): the dp group "
                "(process_group=) and the tp mesh must come from one DeviceMesh"
            )
        if sd is None:
            return None
        keys = {
            i: sorted(
                k
                for k, v in sd["state"].get(i, {}).items()
                if elementwise(k, v, tuple(t.local.shape))
            )
            for i, t in sorted(self.by_index.items())
        }
        every = comm.all_gather_object(keys, group=self.group)
        bad = [i for i in keys if any(e[i] != keys[i] for e in every)]
        if bad:
            raise ValueError(
                f"consolidated_state_dict: the tp ranks' state entries of param #{bad[0]} "
                f"differ ({[e[bad[0]] for e in every]}): a param stepped on some tp ranks only"
            )
        dev = self.by_index[next(iter(keys))].local.device if keys else None
        for i, ks in keys.items():
            for k in ks:
                v = sd["state"][i][k]
                sd["state"][i][k] = self.whole(i, v.to(dev)).to(v.device)
        return sd

    def local_state(self, state: dict) -> dict:
        """``state`` (torch's per-param format, by index) of whole tensors, the same on every
        rank (``consolidated_state_dict``'s) with each DTensor param's element-wise entries cut
        to this tp rank's part: no communication (Replicate to Shard is a local cut). An entry
        of the local shape, not the whole one, raises naming it."""
        out = dict(state)
        for i, t in self.by_index.items():
            st = state.get(i)
            if not st:
                continue
            whole, local = tuple(t.param.shape), tuple(t.local.shape)
            new = {}
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and elementwise(k, v, whole):
                    v = self.local_part(i, v.to(t.local.device))
                elif isinstance(v, torch.Tensor) and whole != local and tuple(v.shape) == local:
                    raise ValueError(
                        f"load_state_dict: state entry {k!r} of param #{i} (placements "
                        f"{t.placements}) has this tp rank's local shape {local}: give whole "
                        f"tensors of shape {whole} (opt.consolidated_state_dict()'s)"
                    )
                new[k] = v
            out[i] = new
        return out

    # ------------------------------------------------------------------ gradients
    def local_grad(self, index: int, g: torch.Tensor) -> torch.Tensor:
        """The local tensor of DTensor gradient ``g`` of param ``index`` in its param's
        placements (a plain tensor passes)."""
        if not is_dtensor(g):
            return g
        t = self.by_index.get(index)
        if t is not None and tuple(g.placements) != t.placements:
            g = g.redistribute(t.param.device_mesh, t.placements)
        return g.to_local()

    def publish_grads(self) -> None:
        """``p.grad`` of each DTensor param: its local ``.grad`` (a ShardedGrad) as a DTensor
        of the param's placements; None where the local one has none."""
        from torch.distributed.tensor import DTensor

        for t in self.by_index.values():
            g = t.local.grad
            if g is None:
                t.param.grad = None
                continue
            cur = t.param.grad
            if cur is not None and is_dtensor(cur) and cur._local_tensor is g:
                continue
            # not DTensor.from_local: its view_as is an op a ShardedGrad refuses; FSDP2 builds
            # its own DTensors the same way, over the param's spec (mesh, placements, shape)
            t.param.grad = DTensor(g, t.param._spec, requires_grad=False)

    def take_user_grads(self) -> None:
        """What the user did to ``p.grad`` of a DTensor param (``model.zero_grad()``: None; a
        DTensor of their own) into its local ``.grad``, where the optimizer reads it."""
        for t in self.by_index.values():
            g = t.param.grad
            if g is None:
                if t.local.grad is not None:
                    t.local.grad = None
            elif is_dtensor(g):
                lg = g._local_tensor
                if lg is not t.local.grad:
                    t.local.grad = self.local_grad(self._index(t), g).detach()
            else:
                raise TypeError(
                    f"the .grad of a DTensor param (placements {t.placements}) was set to a "
                    f"plain {type(g).__name__} of shape {tuple(g.shape)}: give a DTensor of the "
                    "param's placements (or None)"
                )

    def _index(self, t: TPParam) -> int:
        return next(i for i, u in self.by_index.items() if u is t)

    def drop_grads(self) -> None:
        for t in self.by_index.values():
            t.param.grad = None

    # ------------------------------------------------------------------ norms, verdicts
    def norm_inputs(self, layout, rank: int, grads) -> list[torch.Tensor] | None:
        """What this rank counts toward a norm of the whole model: every gradient shard on tp
        rank 0; elsewhere only the pieces of Shard-placed params (the replicated ones are
        counted by tp rank 0). None: all of the shards."""
        if self.rank == 0:
            return None
        from ..layout import pieces

        out = []
        for bi, mine in enumerate(pieces(layout, rank)):
            buf = layout.buffers[bi]
            for pc in mine:
                t = self.by_index.get(pc.index)
                if pc.numel == 0 or (t is not None and not t.sharded) or t is None:
                    # plain params are replicated over tp (the model's non-TP layers)
                    continue
                bk = buf.buckets[pc.bucket]
                sh = grads.shard(bi, pc.bucket)
                lo = pc.start - bk.shard_start(rank)
                out.append(sh[lo : lo + pc.numel])
        return out

    def reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """``t`` all-reduced over tp in place (sum or max)."""
        if self.size > 1:
            comm.all_reduce(t, op, group=self.group)
        return t

    def reduce_norm(self, t: torch.Tensor, norm_type: float) -> torch.Tensor:
        """A norm part ``t`` (pow-sum, or max with a NaN flag beside it) combined over tp."""
        if self.size == 1:
            return t
        if not math.isinf(norm_type):
            return self.reduce(t, "sum")
        nan = t.isnan()
        both = torch.cat([t.masked_fill(nan, -math.inf), nan.to(t.dtype)])
        self.reduce(both, "max")
        n = t.numel()
        return both[:n].masked_fill(both[n:] > 0, math.nan)


_SUPPORTED = ("Shard", "Replicate")


def find(every: dict[int, torch.Tensor], names: dict[int, str], module, dp_group):
    """The DTensor params among ``every`` (id -> param) as a `TensorParallel`, or None where
    there is none. Raises naming what is not supported: a placement other than Shard/Replicate
    (FSDP2's sharded params, Partial params), a mesh of more than one dim, params on different
    meshes, a tp mesh that shares ranks with the dp group, DTensor buffers."""
    dts = {i: p for i, p in every.items() if is_dtensor(p)}
    if not dts:
        return None
    if module is not None and any(type(m).__name__.startswith("FSDP") for m in module.modules()):
        return None  # FSDP2's fully_shard: its DTensors are refused by `validate.check_params`
    mesh = None
    found = {}
    for i, p in dts.items():
        name = names.get(i) or f"of shape {tuple(p.shape)}"
        m = p.device_mesh
        kinds = [type(x).__name__ for x in p.placements]
        if m.ndim != 1 or any(k not in _SUPPORTED for k in kinds):
            raise NotImplementedError(
                f"param {name} is a DTensor with placements {tuple(p.placements)} on a mesh of "
                f"shape {tuple(m.shape)}: ZeroOptimizer takes tensor-parallel params "
                "(parallelize_module over a 1-D tp mesh: Shard or Replicate placements), not "
                "FSDP2's fully_shard or other DTensor layouts; use FSDP2 alone for those"
            )
        if mesh is None:
            mesh = m
        elif m != mesh:
            raise NotImplementedError(
                f"param {name} is a DTensor on mesh {m}, another param on {mesh}: ZeroOptimizer "
                "takes one tp mesh for the whole model"
            )
        local = p._local_tensor
        found[i] = TPParam(p, local, tuple(p.placements), "Shard" in kinds)
    tp_ranks = set(comm.group_ranks(mesh.get_group()))
    dp_ranks = set(comm.group_ranks(dp_group))
    if len(tp_ranks & dp_ranks) != 1:
        i, p = next(iter(dts.items()))
        raise TypeError(
            f"param {names.get(i) or tuple(p.shape)} is a DTensor (placements "
            f"{tuple(p.placements)}) of tensor parallelism over ranks {sorted(tp_ranks)}, and "
            f"process_group= spans ranks {sorted(dp_ranks)}: the dp group must cross the tp "
            "mesh (one rank in common); pass process_group=mesh['dp'].get_group() or the 2-D "
            "mesh"
        )
    if module is not None:
        for n, b in module.named_buffers():
            if is_dtensor(b):
                raise NotImplementedError(
                    f"buffer {n} is a DTensor (placements {tuple(b.placements)}): DTensor "
                    "buffers under ZeroOptimizer are not supported yet"
                )
    return TensorParallel(found, mesh, dp_group)


def check_policy(policy) -> None:
    """The options that do not combine with tensor parallelism yet: a NotImplementedError
    naming each."""
    cp, off = policy.comm, policy.offload
    bad = []
    if cp.shard_group != "world":
        bad.append(f"shard_group={cp.shard_group!r} (hierarchical sharding)")
    if cp.quantize_weights is not None:
        bad.append(f"quantize_weights={cp.quantize_weights!r}")
    if cp.quantize_grads is not None:
        bad.append(f"quantize_grads={cp.quantize_grads!r}")
    if off.offload_optimizer is not None:
        bad.append(f"offload_optimizer={off.offload_optimizer!r}")
    if off.offload_params is not None:
        bad.append(f"offload_params={off.offload_params!r}")
    if policy.gather.secondary_shard is not None:
        bad.append(f"secondary_shard={policy.gather.secondary_shard!r}")
    if policy.gather.shard_frozen:
        bad.append("shard_frozen=True")
    if bad:
        raise NotImplementedError(
            "ZeroOptimizer over a tensor-parallel model (DTensor params) with "
            + ", ".join(bad)
            + ": not built yet for tensor parallelism; drop the option(s) or train without tp"
        )
