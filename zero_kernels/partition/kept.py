"""Units kept whole: the one gather/wait mechanism of params that are never resharded.

[Note: kept whole]
At stages 1 and 2 every param stays whole between uses; at stage 3 the small params below
``persist_below`` do. Both are units (`zero_kernels.partition.units.Unit`, ``persistent=True``)
with their own transition table, `_KEPT_MOVES`:

    GATHERED --a step updated the shards: launched()--> GATHERING --wait()--> GATHERED

A step all-gathers the new values in place into the whole buffer (the runner launches the
gathers as it steps the buckets, stage 3's scheduler those of its persistent unit); `launched`
hands each all-gather to its unit. Where the next forward may overlap them
(``overlap_param_gather``, stages 1/2) each module's forward pre-hook waits for the units
holding its own params and everything that reads whole params first (``model.state_dict()``,
``gathered_params``, the next ``step``, ``close``) waits for all; otherwise the step waits for
all before it returns. Stage 3's units that reshard wait the same way (`Unit.finish`), so a
gather is started, held and finished by one mechanism whatever the stage.

At stages 1/2 a unit is one bucket of the layout (the granularity of the step's all-gathers);
at stage 3 the persistent unit is also one of the unit scheduler's units (its forward reads it
as any other), sharing the state held here.
"""

from __future__ import annotations

from .units import Unit, UnitState

__all__ = ["KeptWhole"]


class KeptWhole:
    """The units kept whole (see [Note: kept whole]); ``noun`` names one in a timeout's message
    ("bucket" at stages 1/2, "unit" at stage 3)."""

    def __init__(self, units: list[Unit], noun: str, timeout_s: float | None, describe):
        for u in units:
            if not u.persistent:
                raise AssertionError(f"unit {u.name} is resharded: not a unit kept whole")
        self.units, self.noun = units, noun
        self.timeout_s, self.describe = timeout_s, describe
        self.of_bucket = {k: u for u in units for k in u.buckets}
        self.gathering: dict[int, Unit] = {}  # index -> unit with all-gathers in flight

    def launched(self, handles) -> None:
        """All-gathers of kept buckets started, ``[((buffer, bucket), handle)]``: each unit
        holding one is GATHERING until `wait`."""
        for key, h in handles:
            u = self.of_bucket[key]
            if u.state is not UnitState.GATHERING:
                u.move(UnitState.GATHERING)
                self.gathering[u.index] = u
            u.handles.append(h)

    def wait(self, indices) -> None:
        """Finish the all-gathers of units ``indices`` still in flight."""
        for k in indices:
            u = self.gathering.pop(k, None)
            if u is not None and u.state is UnitState.GATHERING:  # (else finished by its user)
                u.finish(self.timeout_s, f"{self.describe()}: all-gather of {self.noun} {u.name}")

    def wait_all(self) -> None:
        if self.gathering:
            self.wait(list(self.gathering))

    @property
    def in_flight(self) -> int:
        """Units with all-gathers in flight."""
        return len(self.gathering)
