"""`zero-kernels testbed`: run a script under torchrun on several namespace "nodes" of this machine
joined by a rate-limited link, and report each node's bytes on the link (tc's counters), exit
code and log ([Note: the testbed] in `zero_kernels/tools/testbed.py`)."""

from __future__ import annotations

import argparse
import json
import sys

EPILOG = """\
examples:
  zero-kernels testbed --nodes 2 --ranks-per-node 2 --rate 1gbit my_script.py --steps 5
  zero-kernels testbed --json -m zero_kernels demo --stage 3 --steps 5 --no-baseline
  zero-kernels testbed --check        (can a testbed be made here? exit 0, or 77 and why not)
  zero-kernels testbed --cleanup      (remove namespaces left by a testbed killed with SIGKILL)

Each node is a network namespace with its own hostname (nodeK), /dev/shm, process tree and
address 10.0.0.(K+1); one veth per node into a hub bridge, a tbf qdisc on each end at --rate.
Inside the script: zero_kernels.tools.testbed.out_dir() is a folder every node sees, and
zero_kernels.tools.testbed.mark(label), called on every rank, records the link counters there.
Needs root, iproute2 (ip, tc) and util-linux (unshare, mount).

exit codes: 0 every node exited 0; 1 a node failed; 124 the timeout was reached;
77 no testbed can be made here (the reason on stderr); 2 bad arguments; 128+N signal N.
"""


def add_parser(sub, parser_class) -> None:
    t = sub.add_parser(
        "testbed",
        help="run a script on several namespace nodes over a rate-limited link",
        description="Run SCRIPT under torchrun on NODES network-namespace nodes of this "
        "machine (RANKS ranks each) joined by a link of RATE; report each node's bytes sent and "
        "received over the link (from tc's counters), its exit code and its log.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("--nodes", type=int, default=2, help="nodes, at least 2 (default 2)")
    t.add_argument(
        "--ranks-per-node", type=int, default=1, help="torchrun ranks on each node (default 1)"
    )
    t.add_argument(
        "--rate", default="1gbit", help="link rate as tc writes it: 1gbit, 500mbit (default 1gbit)"
    )
    t.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds for the run (what the setup leaves of them); then every node is killed "
        "(default 300)",
    )
    t.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds the other nodes get once one failed, before they are killed (default 5)",
    )
    t.add_argument("--workdir", default=None, help="folder for the logs (default: a new temp one)")
    t.add_argument("--json", action="store_true", help="print the result as JSON")
    t.add_argument("-m", dest="module", action="store_true", help="SCRIPT is a module's name")
    t.add_argument("--check", action="store_true", help="say whether a testbed can run here")
    t.add_argument(
        "--cleanup",
        action="store_true",
        help="remove namespaces of testbeds whose controlling process is gone, and exit",
    )
    t.add_argument("script", nargs="?", metavar="SCRIPT", help="the script (or module with -m)")
    t.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's arguments")


def run(args) -> int:
    from ..tools import testbed as tb

    if args.cleanup:
        try:
            gone = tb.cleanup_stale()
        except tb.TestbedUnavailable as e:
            print(f"zero-kernels: error: {e}", file=sys.stderr)
            return tb.EXIT_UNAVAILABLE
        print(f"removed {len(gone)} stale namespace(s)" + (": " + ", ".join(gone) if gone else ""))
        return 0
    if args.check:
        why = tb.unavailable()
        print("the testbed can run here" if why is None else f"the testbed cannot run here: {why}")
        return 0 if why is None else tb.EXIT_UNAVAILABLE
    if args.script is None:
        raise ValueError(
            "SCRIPT is required: the script (or with -m the module) to run on every node"
        )
    if args.nodes < 2:
        raise ValueError(f"--nodes must be an integer >= 2; got {args.nodes}")
    if args.ranks_per_node < 1:
        raise ValueError(f"--ranks-per-node must be an integer >= 1; got {args.ranks_per_node}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be a number of seconds > 0; got {args.timeout:g}")
    if not args.grace >= 0:
        raise ValueError(f"--grace must be a number of seconds >= 0; got {args.grace:g}")
    tb.parse_rate(args.rate, "--rate")  # before anything is made
    try:
        res = tb.run(
            args.script,
            args.args,
            nodes=args.nodes,
            ranks_per_node=args.ranks_per_node,
            rate=args.rate,
            timeout=args.timeout,
            module=args.module,
            workdir=args.workdir,
            grace_s=args.grace,
        )
    except tb.TestbedUnavailable as e:
        print(f"zero-kernels: error: {e}", file=sys.stderr)
        return tb.EXIT_UNAVAILABLE
    except tb.Interrupted as e:
        print(f"zero-kernels: testbed {e}; cleaned up", file=sys.stderr)
        return 128 + e.signum
    if args.json:
        print(json.dumps(res.as_dict(), indent=1))
    else:
        _print(res, tb)
    if res.timed_out:
        return 124
    return 0 if res.ok else 1


def _print(res, tb) -> None:
    status = (
        f"timed out after {res.timeout_s:g} s"
        if res.timed_out
        else ("every node exited 0" if res.ok else "a node failed")
    )
    print(
        f"testbed: {len(res.nodes)} nodes x {res.ranks_per_node} ranks, link "
        f"{tb.format_rate(res.rate_bps)}, {res.wall_s:.2f} s: {status}"
    )
    print(f"{'node':<6}{'host':<8}{'ip':<11}{'exit':>6}{'sent MB':>11}{'received MB':>13}  log")
    for n in res.nodes:
        code = "-" if n.exit_code is None else str(n.exit_code)
        print(
            f"{n.node:<6}{n.hostname:<8}{n.ip:<11}{code:>6}{n.bytes.sent / 1e6:>11.3f}"
            f"{n.bytes.received / 1e6:>13.3f}  {n.log_path}"
            + (f" ({n.stopped})" if n.stopped else "")
        )
    for m in res.marks:
        per = ", ".join(f"{c.sent / 1e6:.3f}/{c.received / 1e6:.3f}" for c in m["nodes"])
        print(f"mark {m['label']!r} at {m['t_s']:.3f} s: sent/received MB per node {per}")
    print(f"script output: {res.out_dir}")
    for n in res.nodes:
        if n.exit_code != 0:
            tail = n.log.strip().splitlines()[-15:]
            print(f"--- node {n.node} (exit {n.exit_code}), last lines of its log ---")
            print("\n".join(tail))
