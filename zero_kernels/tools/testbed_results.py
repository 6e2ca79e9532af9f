"""What a run of the two-node testbed (`zero_kernels.tools.testbed`) returns: each node's bytes
over its
link from tc's counters (`LinkBytes`), its exit and log (`NodeResult`), and the run's marks and
totals (`TestbedResult`). Plain data, re-exported by `zero_kernels.tools.testbed`."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LinkBytes", "NodeResult", "TestbedResult"]


@dataclass(frozen=True)
class LinkBytes:
    """Bytes one node put on its link (``sent``) and the link delivered to it (``received``),
    from tc's counters (headers and acknowledgements included: [Note: the testbed])."""

    sent: int
    received: int

    def __sub__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(self.sent - other.sent, self.received - other.received)


@dataclass
class NodeResult:
    node: int
    hostname: str
    ip: str
    exit_code: int | None  # torchrun's; negative: killed by that signal; None: never started
    stopped: str | None  # why the testbed killed the node ("timeout", "node 1 failed", ...)
    bytes: LinkBytes  # over the whole run (from the node's start to its end)
    log_path: str

    @property
    def log(self) -> str:
        """The node's output (torchrun's and its ranks' stdout and stderr)."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def as_dict(self, log_tail: int = 4000) -> dict:
        return {
            "node": self.node,
            "hostname": self.hostname,
            "ip": self.ip,
            "exit_code": self.exit_code,
            "stopped": self.stopped,
            "sent_bytes": self.bytes.sent,
            "received_bytes": self.bytes.received,
            "log_path": self.log_path,
            "log_tail": self.log[-log_tail:] if log_tail else "",
        }


@dataclass
class TestbedResult:
    __test__ = False  # not a pytest class

    nodes: list[NodeResult]
    ranks_per_node: int
    rate_bps: int
    timeout_s: float
    timed_out: bool
    wall_s: float  # from the nodes' start until the last one ended
    run_dir: str
    out_dir: str  # `ENV_DIR` of the script: what it wrote there is here
    command: list[str]  # what each node ran (node 0's; the others differ in --node-rank)
    marks: list[dict] = field(default_factory=list)  # {"label", "t_s", "nodes": [LinkBytes]}
    run_id: str = ""  # the namespaces' middle part, and ZK_TESTBED_RUN in every node process

    @property
    def exit_codes(self) -> list[int | None]:
        return [n.exit_code for n in self.nodes]

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(c == 0 for c in self.exit_codes)

    def mark(self, label: str) -> dict:
        found = [m for m in self.marks if m["label"] == label]
        if not found:
            have = [m["label"] for m in self.marks]
            raise KeyError(f"no mark {label!r} in this run; marks: {have}")
        return found[-1]

    def between(self, first: str, last: str) -> list[LinkBytes]:
        """Each node's bytes from mark ``first`` to mark ``last``."""
        a, b = self.mark(first)["nodes"], self.mark(last)["nodes"]
        return [y - x for x, y in zip(a, b)]

    def as_dict(self, log_tail: int = 4000) -> dict:
        return {
            "ok": self.ok,
            "timed_out": self.timed_out,
            "exit_codes": self.exit_codes,
            "nodes": [n.as_dict(log_tail) for n in self.nodes],
            "ranks_per_node": self.ranks_per_node,
            "rate_bps": self.rate_bps,
            "timeout_s": self.timeout_s,
            "wall_s": round(self.wall_s, 3),
            "run_dir": self.run_dir,
            "out_dir": self.out_dir,
            "command": self.command,
            "run_id": self.run_id,
            "marks": [
                {
                    "label": m["label"],
                    "t_s": m["t_s"],
                    "nodes": [
                        {"sent_bytes": c.sent, "received_bytes": c.received} for c in m["nodes"]
                    ],
                }
                for m in self.marks
            ],
        }
