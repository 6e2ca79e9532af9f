"""The timing of CUDA waits in `CommLog` ([Note: held timing events] in zero_kernels/comm/base.py):
the events held stay bounded over a long run, completed ones are folded into the totals and
their step's ledger entry without synchronising, and waits past the bound are counted.

CPU only: ``torch.cuda.Event`` and ``torch.cuda.current_stream`` are replaced by a fake GPU
whose events complete when the test says, so a wait takes `Handle.wait`'s CUDA path.
"""

import pytest
import torch

from zero_kernels import comm
from zero_kernels.comm import base


class FakeGPU:
    """Events in record order; the first ``done`` of them have completed; every span between
    two consecutive events lasts 1 ms."""

    def __init__(self):
        self.recorded = 0
        self.done = 0
        self.syncs = 0
        self.queries = 0

    def event_class(gpu):
        class Event:
            def __init__(self, enable_timing=False):
                self.seq = None

            def record(self, stream=None):
                gpu.recorded += 1
                self.seq = gpu.recorded

            def query(self):
                gpu.queries += 1
                return self.seq is not None and self.seq <= gpu.done

            def synchronize(self):
                gpu.syncs += 1
                gpu.done = max(gpu.done, self.seq)

            def elapsed_time(self, end):
                assert self.query() and end.query(), "elapsed_time on an event not completed"
                return float(end.seq - self.seq)  # ms

        return Event

    def catch_up(self):
        self.done = self.recorded


class FakeStream:
    def wait_event(self, event):
        pass


@pytest.fixture
def gpu(monkeypatch):
    g = FakeGPU()
    monkeypatch.setattr(torch.cuda, "Event", g.event_class())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    return g


def _wait(log, gpu):
    """One collective's handle (its end event on the fake GPU) waited for under ``log``."""
    end = torch.cuda.Event()
    end.record()
    comm.Handle(None, (torch.zeros(1),), log=log, event=end).wait()


def test_events_fold_as_they_complete_and_stay_bounded(gpu):
    """A GPU that keeps up: 10,000 waits over 100 steps hold at most a few events, never
    synchronise, and the totals and the ledger add up to 1 ms per wait."""
    log = comm.CommLog()
    most = 0
    for step in range(100):
        for _ in range(100):
            _wait(log, gpu)
            gpu.catch_up()  # the GPU passes everything queued so far
            most = max(most, log.held_timing_events)
        log.mark_step(step)
    assert most <= 2, most
    assert gpu.syncs == 0
    stats = log.as_dict()
    assert stats["exposed_comm_s"] == pytest.approx(10_000 * 1e-3)
    assert stats["untimed_waits"] == 0
    ledger = log.read_ledger()
    assert len(ledger) == 100
    assert all(e["exposed_comm_s"] == pytest.approx(0.1) for e in ledger), ledger[:3]


def test_a_gpu_far_behind_holds_at_most_the_bound(gpu):
    """A GPU that completes nothing for 10,000 waits: the held events stop at the bound, the
    waits past it are counted as untimed, and reading folds the rest (synchronising)."""
    log = comm.CommLog()
    for step in range(10):
        for _ in range(1000):
            _wait(log, gpu)
            assert log.held_timing_events <= 2 * base.TIMING_EVENTS_HELD
        log.mark_step(step)
    assert log.held_timing_events == 2 * base.TIMING_EVENTS_HELD
    assert gpu.syncs == 0  # nothing read yet: the waits themselves never synchronise
    stats = log.as_dict()
    timed = base.TIMING_EVENTS_HELD
    assert stats["untimed_waits"] == 10_000 - timed
    assert stats["exposed_comm_s"] == pytest.approx(timed * 1e-3)
    assert log.held_timing_events == 0
    ledger = log.read_ledger()
    assert sum(e["untimed_waits"] for e in ledger) == 10_000 - timed
    assert sum(e["exposed_comm_s"] for e in ledger) == pytest.approx(timed * 1e-3)
    # the GPU caught up: timing resumes, folded without a synchronisation
    syncs = gpu.syncs
    _wait(log, gpu)
    gpu.catch_up()
    _wait(log, gpu)
    assert log.held_timing_events == 2 and gpu.syncs == syncs
    assert log.as_dict()["untimed_waits"] == 10_000 - timed


def test_reset_drops_held_events(gpu):
    log = comm.CommLog()
    for _ in range(10):
        _wait(log, gpu)
    assert log.held_timing_events == 20
    log.reset()
    assert log.held_timing_events == 0 and log.as_dict()["exposed_comm_s"] == 0.0
