"""Several "nodes" on one Linux machine, joined by a rate-limited link, for multi-node runs.

[Note: the testbed]
A node is a network namespace of its own, with its own hostname (a UTS namespace), its own
/dev/shm (a tmpfs in a mount namespace of its own) and its own process tree (a PID namespace).
Every node has one veth pair into a hub namespace, where a bridge joins them:

    node 0 (10.0.0.1)                hub                  node 1 (10.0.0.2)
    zkv0 [tbf] ---------- [tbf] zkh0 ==bridge== zkh1 [tbf] ---------- [tbf] zkv1
          sent by node 0 --->        <--- received by node 0

A tbf qdisc on each end of each pair holds the link to the rate, in both directions (a switch
with one port per node): node k's bytes *sent* are the counter of the tbf on its own end
(`zkv<k>`), its bytes *received* the counter of the tbf on the hub's end (`zkh<k>`), both read
from tc (`tc -s qdisc show`), never from the program that runs. They count what the kernel put
on the link: the payload plus Ethernet, IP and TCP headers (about 4.5% at an MTU of 1500) and
TCP's acknowledgements of what came the other way. Traffic between the ranks of one node goes
over the node's loopback and is not counted.

On every node one `torchrun --nnodes N --node-rank k --nproc-per-node R --master-addr 10.0.0.1`
agent runs the script, with `GLOO_SOCKET_IFNAME` set to the node's veth. The namespaces' names
carry the controlling process's pid and a random tag (`zkt-<pid>-<tag>-n<k>`, `...-hub`), so runs
in parallel never collide and `cleanup_stale` can tell the leftovers of a dead controller.

Nothing outlives a run however it ends: each node runs under `unshare --pid --kill-child`, so
killing that one process kills the node's whole tree (torchrun puts its workers in sessions of
their own, a process group would miss them), and it dies with the controller (a parent-death
signal); the mounts belong to the node's mount namespace and go with its last process; deleting
the namespaces deletes the veths and the bridge. A run is bounded by its timeout; SIGTERM and
SIGHUP are turned into an exception while a testbed is up (SIGINT already is one), so the
cleanup runs. Only a SIGKILL of the controller leaves namespaces behind (their processes still
die): `cleanup_stale()`, or `zero-kernels testbed --cleanup`, removes them.

Marks: a script calls `mark(label)` on every rank at a point of its choice (say, before and after
the timed steps); the ranks meet in a barrier, rank 0 asks the controller to read the counters
and waits for its answer, and the ranks meet again, so the counters are read while no collective
is in flight. `TestbedResult.between(a, b)` gives each node's bytes between two marks.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

__all__ = [
    "ENV_DIR",
    "ENV_NODE",
    "EXIT_UNAVAILABLE",
    "Interrupted",
    "LinkBytes",
    "NodeResult",
    "Testbed",
    "TestbedResult",
    "TestbedUnavailable",
    "cleanup_stale",
    "mark",
    "out_dir",
    "parse_rate",
    "run",
    "unavailable",
]

PREFIX = "zkt"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-([0-9a-f]{{6}})-(hub|n\d+)$")
SUBNET = "10.0.0"  # node k is 10.0.0.(k + 1)/24; every run has network stacks of its own
MAX_NODES = 200
MASTER_PORT = 29500  # on node 0; a fresh port per run of one testbed (sockets in TIME_WAIT)
ENV_DIR = "ZK_TESTBED_DIR"  # a folder every node sees (the host's file system): results
ENV_NODE = "ZK_TESTBED_NODE"  # this node's index
ENV_NODES = "ZK_TESTBED_NODES"
ENV_RUN = "ZK_TESTBED_RUN"  # the run's id (its namespaces' middle part)
ENV_MARKS = "ZK_TESTBED_MARKS"  # where `mark` asks the controller to read the counters
EXIT_UNAVAILABLE = 77  # the command's exit code where no testbed can be made (automake's "skip")
_CMD_TIMEOUT_S = 15.0  # each ip / tc / unshare call of the setup and the cleanup
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}  # tc's (SI)
_TOOLS = {
    "ip": "iproute2",
    "tc": "iproute2",
    "unshare": "util-linux",
    "mount": "util-linux",
    "hostname": "hostname",
    "sh": "a POSIX shell",
}
# inside a node's fresh namespaces: its own /dev/shm and /etc/hosts, its hostname, then the agent
_NODE_INIT = (
    "set -e; mount -t tmpfs -o mode=1777 zk-testbed-shm /dev/shm; "
    'if [ -f /etc/hosts ]; then mount --bind "$1" /etc/hosts; fi; '
    'hostname "$2"; shift 2; exec "$@"'
)


class TestbedUnavailable(RuntimeError):
    """No testbed can be made on this machine; ``why`` says exactly why."""

    __test__ = False  # not a pytest class

    def __init__(self, why: str):
        super().__init__(f"the testbed cannot run here: {why}")
        self.why = why


class Interrupted(BaseException):  # noqa: N818 (like KeyboardInterrupt: not an error)
    """SIGTERM or SIGHUP reached the controller while a testbed was up (after its cleanup)."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def parse_rate(text, name: str = "rate (--rate)") -> int:
    """A link rate as tc writes it (``1gbit``, ``500mbit``, ``100kbit``, ``2.5gbit``: SI units of
    bits per second) in bits per second; a ValueError naming ``name`` otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", str(text).lower())
    bps = float(m.group(1)) * _UNITS[m.group(2)] if m and m.group(2) in _UNITS else 0.0
    if not 1000 <= bps <= 10**12:
        raise ValueError(
            f"{name} must be a link rate from 1kbit to 1tbit written as tc does (a number and "
            f"one of {', '.join(_UNITS)}: 1gbit, 500mbit, 2.5gbit); got {text!r}"
        )
    return int(bps)


def format_rate(bps: int) -> str:
    for unit, f in (("Tbit/s", 10**12), ("Gbit/s", 10**9), ("Mbit/s", 10**6), ("kbit/s", 10**3)):
        if bps >= f:
            return f"{bps / f:g} {unit}"
    return f"{bps} bit/s"


# -- running the tools


def _cmd(args: list[str], timeout_s: float = _CMD_TIMEOUT_S, check: bool = True) -> str:
    """Run one setup or cleanup command; its stdout. A failure raises naming the command."""
    try:
        res = subprocess.run(
            args, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`{' '.join(args)}` took more than {timeout_s:g} s") from None
    except OSError as e:
        raise RuntimeError(f"cannot run `{' '.join(args)}`: {e}") from None
    if check and res.returncode != 0:
        err = (res.stderr or res.stdout).strip().splitlines()
        raise RuntimeError(
            f"`{' '.join(args)}` failed (exit {res.returncode}): {err[-1] if err else 'no output'}"
        )
    return res.stdout


_why_cache: list = []  # [answer] once computed (the trial makes and deletes a namespace)


def unavailable() -> str | None:
    """None where a testbed can be made here, else exactly why not (not Linux, not root, a tool
    missing, or the kernel refusing a network namespace, a veth pair, a tbf qdisc or the node's
    namespaces and mounts: the command that failed and its error). Tried once per process."""
    if _why_cache:
        return _why_cache[0]
    why = why_not()
    _why_cache.append(why)
    return why


def why_not() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux; this is {sys.platform}"
    for tool, pkg in _TOOLS.items():
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH (install {pkg})"
    if os.geteuid() != 0:
        return (
            "making network namespaces, veth pairs, tc qdiscs and mounts needs root; this "
            f"process runs as uid {os.geteuid()}"
        )
    name = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-n0"
    steps = [
        ["ip", "netns", "add", name],
        ["ip", "link", "add", "zkv0", "netns", name, "type", "veth"]
        + ["peer", "name", "zkh0", "netns", name],
        ["tc", "-n", name, "qdisc", "add", "dev", "zkv0", "root", "tbf"]
        + ["rate", "1gbit", "burst", "256kb", "latency", "100ms"],
        ["ip", "netns", "exec", name, "unshare", "--mount", "--uts", "--pid", "--kill-child"]
        + ["--mount-proc", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm && hostname zk-trial"],
    ]
    try:
        for args in steps:
            try:
                _cmd(args)
            except RuntimeError as e:
                return f"the kernel or a tool refused a step of the trial: {e}"
    finally:
        _cmd(["ip", "netns", "del", name], check=False)
    return None


# -- counters and results: zero_kernels/tools/testbed_results.py

from .testbed_results import LinkBytes, NodeResult, TestbedResult  # noqa: E402

# -- signals and the parent-death signal


_libc = None


def _die_with_parent() -> None:  # in the child between fork and exec
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the node dies with its controller
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def _signals_raise():
    """While inside: SIGTERM and SIGHUP raise `Interrupted` (main thread only; elsewhere as is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _shielded():
    """While inside (the cleanup): SIGINT, SIGTERM and SIGHUP are held off; the cleanup ends
    first, then the exception already on its way continues (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, signal.SIG_IGN) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# -- the testbed


_live: set = set()  # testbeds up in this process (taken down at exit)


class Testbed:
    """``nodes`` namespaces joined through a hub at ``rate``: `up` makes them, `run` runs a
    script on all of them under torchrun, `down` removes everything (a context manager does
    both). One testbed runs one script at a time; its namespaces are reused between runs."""

    __test__ = False  # not a pytest class

    def __init__(self, nodes: int = 2, *, rate="1gbit", workdir: str | None = None):
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 2 <= nodes <= MAX_NODES:
            raise ValueError(
                f"nodes (--nodes) must be an integer from 2 to {MAX_NODES}; got {nodes!r}"
            )
        self.n = nodes
        self.rate_bps = parse_rate(rate)
        self.run_id = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.hub = f"{PREFIX}-{self.run_id}-hub"
        self.ns = [f"{PREFIX}-{self.run_id}-n{k}" for k in range(nodes)]
        self.veth = [f"zkv{k}" for k in range(nodes)]  # in node k's namespace
        self.port = [f"zkh{k}" for k in range(nodes)]  # in the hub's
        self.ips = [f"{SUBNET}.{k + 1}" for k in range(nodes)]
        self.hostnames = [f"node{k}" for k in range(nodes)]
        self.workdir = workdir  # None: a new temporary folder at `up` (kept: the logs)
        self._made: list[str] = []
        self._procs: list = []
        self._runs = 0
        self.is_up = False

    def __enter__(self) -> Testbed:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    # -- setup and cleanup

    def up(self) -> None:
        """Make the namespaces, the veths, the bridge and the qdiscs (a TestbedUnavailable where
        that cannot be done here, a RuntimeError naming the failing command otherwise; nothing is
        left behind either way)."""
        why = unavailable()
        if why is not None:
            raise TestbedUnavailable(why)
        if self.workdir is None:
            self.workdir = tempfile.mkdtemp(prefix="zk-testbed-")
        os.makedirs(self.workdir, exist_ok=True)
        with open(os.path.join(self.workdir, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n")
            f.writelines(f"{ip} {h}\n" for ip, h in zip(self.ips, self.hostnames))
        _live.add(self)
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        self.is_up = True

    def _build(self) -> None:
        rate = f"{self.rate_bps}bit"
        # tbf: a burst of at least 256 KiB (veths pass 64 KiB GSO packets whole; tbf splits any
        # packet above its burst) or 1 ms at the rate; up to 100 ms queued before drops
        burst = max(256 << 10, self.rate_bps // 8 // 1000)
        tbf = ["root", "tbf", "rate", rate, "burst", str(burst), "latency", "100ms"]
        self._add_ns(self.hub)
        _cmd(["ip", "-n", self.hub, "link", "add", "zkbr", "type", "bridge"])
        _cmd(["ip", "-n", self.hub, "link", "set", "zkbr", "up"])
        for k in range(self.n):
            ns, v, p = self.ns[k], self.veth[k], self.port[k]
            self._add_ns(ns)
            _cmd(
                ["ip", "link", "add", v, "netns", ns, "type", "veth"]
                + ["peer", "name", p, "netns", self.hub]
            )
            for where, dev in ((ns, v), (self.hub, p)):  # no IPv6 chatter on the counters
                _cmd(["ip", "-n", where, "link", "set", dev, "addrgenmode", "none"], check=False)
            _cmd(["ip", "-n", ns, "addr", "add", f"{self.ips[k]}/24", "dev", v])
            _cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
            _cmd(["ip", "-n", ns, "link", "set", v, "up"])
            _cmd(["ip", "-n", self.hub, "link", "set", p, "master", "zkbr"])
            _cmd(["ip", "-n", self.hub, "link", "set", p, "up"])
            _cmd(["tc", "-n", ns, "qdisc", "add", "dev", v] + tbf)
            _cmd(["tc", "-n", self.hub, "qdisc", "add", "dev", p] + tbf)

    def _add_ns(self, name: str) -> None:
        self._made.append(name)  # first: a command that timed out may still have made it
        _cmd(["ip", "netns", "add", name])

    def down(self) -> None:
        """Kill whatever still runs on the nodes and delete the namespaces (with them the veths,
        the bridge and the qdiscs); idempotent. A RuntimeError if a namespace would not go."""
        with _shielded():
            self._kill_all()
            left = []
            for name in reversed(self._made):
                _remove_ns(name)
                if name in netns_names():
                    left.append(name)
            self._made = left
            self.is_up = False
            if not left:
                _live.discard(self)
        if left:
            raise RuntimeError(f"testbed: namespaces {left} could not be deleted (ip netns del)")

    def _kill_all(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)  # unshare: --kill-child takes its tree along
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        self._procs = []

    # -- counters

    def counters(self) -> list[LinkBytes]:
        """Each node's bytes on its link since the testbed was made (tc's counters)."""
        hub = _tbf_bytes(self.hub)
        return [
            LinkBytes(_tbf_bytes(ns)[v], hub[p]) for ns, v, p in zip(self.ns, self.veth, self.port)
        ]

    # -- runs

    def run(
        self,
        script: str,
        args=(),
        *,
        ranks_per_node: int = 1,
        timeout: float = 300.0,
        module: bool = False,
        env: dict | None = None,
        grace_s: float | None = 5.0,
        python: str = sys.executable,
    ) -> TestbedResult:
        """Run ``script`` (a file, or with ``module`` a module's name) with ``args`` on every
        node under torchrun, ``ranks_per_node`` ranks each; bounded by ``timeout`` seconds (then
        every node is killed and ``timed_out`` set). Once a node failed, the others get
        ``grace_s`` seconds to end (None: until the timeout). ``env`` adds to the environment."""
        if not self.is_up:
            raise RuntimeError("Testbed.run: the testbed is not up (use it as a context manager)")
        _check_run(script, ranks_per_node, timeout, module)
        self._runs += 1
        run_dir = os.path.join(self.workdir, f"run-{self._runs}")
        out = os.path.join(run_dir, "out")
        marks_dir = os.path.join(run_dir, "marks")
        os.makedirs(out)
        os.makedirs(marks_dir)
        port = MASTER_PORT + self._runs - 1
        agent = [python, "-m", "torch.distributed.run", "--nnodes", str(self.n)]
        common = [
            "--nproc-per-node",
            str(ranks_per_node),
            "--master-addr",
            self.ips[0],
            "--master-port",
            str(port),
            "--max-restarts",
            "0",
            "--monitor-interval",
            "0.2",
        ]
        target = (["-m", script] if module else [os.path.abspath(script)]) + [str(a) for a in args]
        commands = [agent + ["--node-rank", str(k)] + common + target for k in range(self.n)]
        with _signals_raise():
            return self._run(
                commands, run_dir, out, marks_dir, ranks_per_node, timeout, env, grace_s
            )

    def _run(self, commands, run_dir, out, marks_dir, rpn, timeout, env, grace_s) -> TestbedResult:
        t0 = time.monotonic()
        deadline = t0 + timeout
        base = self.counters()
        logs = [os.path.join(run_dir, f"node{k}.log") for k in range(self.n)]
        stopped: list[str | None] = [None] * self.n
        marks: list[dict] = []
        timed_out = False
        started = t0
        try:
            for k in range(self.n):
                e = dict(os.environ, **(env or {}))
                e.update(
                    {
                        "GLOO_SOCKET_IFNAME": self.veth[k],
                        ENV_DIR: out,
                        ENV_NODE: str(k),
                        ENV_NODES: str(self.n),
                        ENV_RUN: self.run_id,
                        ENV_MARKS: marks_dir,
                    }
                )
                node = ["ip", "netns", "exec", self.ns[k], "unshare", "--mount", "--uts", "--pid"]
                node += ["--kill-child", "--mount-proc", "sh", "-c", _NODE_INIT, "zk-node"]
                node += [os.path.join(self.workdir, "hosts"), self.hostnames[k]] + commands[k]
                with open(logs[k], "wb") as log:
                    self._procs.append(
                        subprocess.Popen(
                            node,
                            stdin=subprocess.DEVNULL,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            env=e,
                            start_new_session=True,
                            preexec_fn=_die_with_parent,
                        )
                    )
            started = time.monotonic()
            failed_at = None
            while True:
                codes = [p.poll() for p in self._procs]
                self._serve_marks(marks_dir, marks, base, started)
                if all(c is not None for c in codes):
                    break
                now = time.monotonic()
                if now >= deadline:
                    timed_out = True
                    self._stop(codes, stopped, "timeout")
                    break
                bad = [k for k, c in enumerate(codes) if c not in (None, 0)]
                if bad and grace_s is not None:
                    failed_at = now if failed_at is None else failed_at
                    if now - failed_at >= grace_s:
                        self._stop(codes, stopped, f"node {bad[0]} failed")
                        break
                time.sleep(0.02)
            self._kill_all_left()
        except BaseException as e:
            reason = "interrupted" if isinstance(e, (KeyboardInterrupt, Interrupted)) else "error"
            self._stop([p.poll() for p in self._procs], stopped, reason)
            self._kill_all()
            raise
        wall = time.monotonic() - started
        end = self.counters()
        codes = [p.returncode for p in self._procs]
        self._procs = []
        nodes = [
            NodeResult(
                k, self.hostnames[k], self.ips[k], codes[k], stopped[k], end[k] - base[k], logs[k]
            )
            for k in range(self.n)
        ]
        return TestbedResult(
            nodes,
            rpn,
            self.rate_bps,
            float(timeout),
            timed_out,
            wall,
            run_dir,
            out,
            commands[0],
            marks,
            self.run_id,
        )

    def _stop(self, codes, stopped, reason: str) -> None:
        for k, c in enumerate(codes):
            if c is None and k < len(self._procs):
                stopped[k] = reason
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._procs[k].pid, signal.SIGKILL)

    def _kill_all_left(self) -> None:
        """Wait for the killed nodes; then no process may be left in a node's namespace."""
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        for ns in self.ns:
            _kill_pids(ns)

    def _serve_marks(self, marks_dir: str, marks: list, base, started: float) -> None:
        try:
            reqs = sorted(f for f in os.listdir(marks_dir) if f.startswith("req-"))
        except OSError:
            return
        for f in reqs:
            seq = f[4:]
            path = os.path.join(marks_dir, f)
            try:
                with open(path) as fh:
                    label = fh.read()
            except OSError:
                continue
            now = self.counters()
            marks.append(
                {
                    "label": label,
                    "t_s": round(time.monotonic() - started, 4),
                    "nodes": [c - b for c, b in zip(now, base)],
                }
            )
            os.unlink(path)
            tmp = os.path.join(marks_dir, f".ack-{seq}")
            with open(tmp, "w") as fh:
                fh.write("ok")
            os.rename(tmp, os.path.join(marks_dir, f"ack-{seq}"))


def _check_run(script, ranks_per_node, timeout, module: bool) -> None:
    if (
        isinstance(ranks_per_node, bool)
        or not isinstance(ranks_per_node, int)
        or ranks_per_node < 1
    ):
        raise ValueError(
            f"ranks_per_node (--ranks-per-node) must be an integer >= 1; got {ranks_per_node!r}"
        )
    if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout (--timeout) must be a number of seconds > 0; got {timeout!r}")
    if not isinstance(script, str) or not script:
        raise ValueError(f"script (SCRIPT) must be a file name or a module name; got {script!r}")
    if not module and not os.path.isfile(script):
        raise ValueError(f"script (SCRIPT) must be a file; got {script!r} (no such file)")


def _tbf_bytes(ns: str) -> dict:
    """{device: bytes} of the root tbf qdiscs in namespace ``ns`` (tc's counters)."""
    rows = json.loads(_cmd(["tc", "-n", ns, "-s", "-j", "qdisc", "show"]) or "[]")
    return {r["dev"]: int(r["bytes"]) for r in rows if r.get("kind") == "tbf" and "dev" in r}


def netns_names() -> list[str]:
    out = _cmd(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_pids(ns: str) -> None:
    out = _cmd(["ip", "netns", "pids", ns], check=False)
    for tok in out.split():
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.kill(int(tok), signal.SIGKILL)


def _remove_ns(name: str) -> None:
    _kill_pids(name)
    _cmd(["ip", "netns", "del", name], check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete the namespaces of testbeds whose controlling process is gone (killed with SIGKILL)
    and kill what still runs in them; the names it deleted. Namespaces of live controllers, and
    any not named by a testbed, are left alone."""
    if shutil.which("ip") is None:
        raise TestbedUnavailable("`ip` is not on PATH (install iproute2)")
    if os.geteuid() != 0:
        raise TestbedUnavailable(f"deleting network namespaces needs root; uid {os.geteuid()}")
    gone = []
    for name in netns_names():
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))):
            _remove_ns(name)
            gone.append(name)
    return gone


def _down_live() -> None:
    for tb in list(_live):
        with contextlib.suppress(Exception):
            tb.down()


atexit.register(_down_live)


def run(
    script: str,
    args=(),
    *,
    nodes: int = 2,
    ranks_per_node: int = 1,
    rate="1gbit",
    timeout: float = 300.0,
    module: bool = False,
    env: dict | None = None,
    workdir: str | None = None,
    grace_s: float | None = 5.0,
) -> TestbedResult:
    """Make a testbed of ``nodes`` nodes at ``rate``, run ``script`` on it (`Testbed.run`) and
    remove it. The run gets what the setup left of ``timeout`` (each setup command is bounded
    by its own 15 s)."""
    t0 = time.monotonic()
    _check_run(script, ranks_per_node, timeout, module)
    with _signals_raise(), Testbed(nodes, rate=rate, workdir=workdir) as tb:
        left = max(0.1, timeout - (time.monotonic() - t0))
        res = tb.run(
            script,
            args,
            ranks_per_node=ranks_per_node,
            timeout=left,
            module=module,
            env=env,
            grace_s=grace_s,
        )
    res.timeout_s = float(timeout)
    return res


# -- inside a script


def out_dir() -> str | None:
    """The folder a script on the testbed writes its results into (every node sees it), or None
    outside a testbed."""
    return os.environ.get(ENV_DIR)


_mark_seq = [0]


def mark(label: str, *, timeout_s: float = 60.0) -> None:
    """Have the testbed read every node's link counters now (collective: call it on every rank;
    the ranks meet before and after the reading). Does nothing outside a testbed."""
    d = os.environ.get(ENV_MARKS)
    if not d:
        return
    if not isinstance(label, str) or not label:
        raise ValueError(f"label must be a non-empty str; got {label!r}")
    from .. import comm

    dist = comm.is_initialized()
    if dist:
        comm.barrier()
    if not dist or comm.rank() == 0:
        _mark_seq[0] += 1
        seq = f"{os.getpid()}-{_mark_seq[0]:06d}"
        tmp = os.path.join(d, f".req-{seq}")
        with open(tmp, "w") as f:
            f.write(label)
        os.rename(tmp, os.path.join(d, f"req-{seq}"))
        ack = os.path.join(d, f"ack-{seq}")
        end = time.monotonic() + timeout_s
        while not os.path.exists(ack):
            if time.monotonic() > end:
                raise RuntimeError(f"testbed mark {label!r}: no answer within {timeout_s:g} s")
            time.sleep(0.002)
    if dist:
        comm.barrier()
