"""Run a script as rank 0 of a world of ``world`` ranks on torch's fake process group, in a
subprocess (the pytest process keeps no process group): its collectives do nothing, so what it
tests is what a rank does and counts, never the values the others would send."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

PRELUDE = """
import json, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
torch.set_num_threads(1)
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size={world})
"""


def run_fake(code: str, world: int = 8, timeout: float = 300.0):
    """Run ``code`` after the prelude; it prints one JSON line last, which is returned."""
    src = PRELUDE.format(world=world) + textwrap.dedent(code)
    r = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


_MANY = """
import contextlib, io
_base = dict(json=json, torch=torch, dist=dist)
_results = []
for _code in _CODES:
    _buf = io.StringIO()
    with contextlib.redirect_stdout(_buf):
        exec(compile(_code, "<case>", "exec"), {**_base, "__name__": "__case__"})
    _results.append(json.loads(_buf.getvalue().strip().splitlines()[-1]))
print(json.dumps(_results))
"""


def run_fake_many(codes: list[str], world: int = 8, timeout: float = 600.0) -> list:
    """Each of ``codes`` (as `run_fake` takes them) in turn in one process, each in a namespace
    of its own after one prelude: one start of torch for a file's cases instead of one each
    (about 3 s here). The cases share the process, so a case that patches a module must come
    after those it would disturb. Returns each case's JSON line."""
    src = (
        PRELUDE.format(world=world) + f"_CODES = {[textwrap.dedent(c) for c in codes]!r}\n" + _MANY
    )
    r = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
