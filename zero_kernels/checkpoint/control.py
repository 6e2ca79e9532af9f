"""The collectives of a save or a load, on a gloo group with a timeout: a lost rank is an error.

[Note: checkpoint timeouts]
A save or load exchanges only small objects between ranks (the temp directory's name, each rank's
checksums or error, the commit's result). They go through a gloo *control group* made at the
first save or load over the optimizer's process group (every rank is there then; one per process
group and timeout), whose timeout is the optimizer's
``timeout`` (`ZeroOptimizer(timeout=...)`, default 300 s; a plain torch optimizer: the
``ZERO_KERNELS_CHECKPOINT_TIMEOUT`` environment variable, default 300 s). A rank that died,
stalled (SIGSTOP) or raised before or during the save makes every other rank raise a
`CheckpointError` within that timeout, naming the step, the phase ("save" or "load") and what it
was waiting for, instead of hanging in gloo's default 30 minutes; the checkpoint being written is
left in its ``.tmp-`` directory, never loaded. The exchanges happen first of all (every rank
arrives: a monitored barrier), after the files are written, and after the commit.
"""

from __future__ import annotations

import os

from .. import comm
from .format import CheckpointError

__all__ = ["Control", "control_for", "tp_control_for"]

_ENV = "ZERO_KERNELS_CHECKPOINT_TIMEOUT"
# (id of the process group, timeout) -> (the process group, its control group): one control group
# per process group and timeout, however many optimizers save (each gloo group opens connections
# between every pair of ranks); the process group is held so that its id is not reused
_groups: dict[tuple[int, float], tuple[object, object]] = {}


def _timeout(optimizer) -> float:
    t = getattr(optimizer, "timeout", None)
    if isinstance(t, (int, float)) and t > 0:
        return float(t)
    return float(os.environ.get(_ENV, "300"))


class Control:
    """Object collectives of one save/load: every failure or timeout -> `CheckpointError`."""

    def __init__(self, group, timeout: float, rank: int, world: int, where: str, phase: str):
        self.group, self.timeout, self.rank, self.world = group, timeout, rank, world
        self.where, self.phase, self.step = where, phase, None

    def _fail(self, what: str, e: BaseException) -> CheckpointError:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        step = f" at step {self.step}" if self.step is not None else ""
        return CheckpointError(
            self.where,
            f"{self.phase}{step}: {what}: not every rank took part within {self.timeout:g} s "
            f"(a rank died, stalled or failed; {first})",
        )

    def arrive(self, what: str) -> None:
        """Every rank reaches this point within the timeout."""
        if self.group is None:
            return
        try:
            comm.check_arrival(self.group, what, self.timeout)
        except RuntimeError as e:
            raise self._fail(f"waiting for every rank to start ({what})", e) from None

    def broadcast(self, obj, what: str):
        if self.group is None:
            return obj
        try:
            return comm.broadcast_object(obj, 0, group=self.group)
        except RuntimeError as e:
            raise self._fail(what, e) from None

    def gather(self, obj, what: str):
        if self.group is None:
            return [obj]
        try:
            return comm.gather_object(obj, 0, group=self.group)
        except RuntimeError as e:
            raise self._fail(what, e) from None

    def all_gather(self, obj, what: str) -> list:
        if self.group is None:
            return [obj]
        try:
            return comm.all_gather_object(obj, group=self.group)
        except RuntimeError as e:
            raise self._fail(what, e) from None


def control_for(ad, where: str, phase: str) -> Control:
    """The control group of ``ad``'s process group and timeout (made at the first save/load
    that needs it: collective)."""
    t = _timeout(ad.optimizer)
    if ad.dp_size == 1:
        return Control(None, t, ad.dp_rank, 1, where, phase)
    return Control(_side(ad.group, t), t, ad.dp_rank, ad.dp_size, where, phase)


def _side(group, t: float):
    pg = comm.group_or_world(group)
    key = (id(pg), t)
    if key not in _groups:
        _groups[key] = (pg, comm.side_group(group, timeout_s=t))
    return _groups[key][1]


def tp_control_for(ad, where: str, phase: str) -> Control | None:
    """The control group over the tp mesh of ``ad``'s tensor-parallel params (None without tp
    or at tp size 1): a load that redistributes across tp sizes reads every column's files, so
    its ranks agree over dp (`control_for`) and then over tp (each rank of a tp group carries
    its dp group's verdict). Made at the first such load: collective over the world."""
    if ad.tp is None or ad.tp["size"] == 1:
        return None
    t = _timeout(ad.optimizer)
    mesh = next(p.device_mesh for p in ad.leaves().values() if hasattr(p, "device_mesh"))
    return Control(_side(mesh.get_group(), t), t, ad.tp["rank"], ad.tp["size"], where, phase)
