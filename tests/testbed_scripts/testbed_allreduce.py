"""On the testbed: one all-reduce of ``MB`` (argv[1], default 10) MB of fp32 between two marks;
each rank writes what it measured and saw into the testbed's out folder."""

import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from zero_kernels.tools import testbed

mb = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
dist.init_process_group("gloo")
r, n = dist.get_rank(), dist.get_world_size()
node = int(os.environ[testbed.ENV_NODE])
x = torch.ones(int(mb * 1e6) // 4)
# each node's /dev/shm is its own: a file made on node k is not seen on the others
open(f"/dev/shm/zk-testbed-check-{node}-{r}", "w").close()
dist.barrier()
shm_files = sorted(f for f in os.listdir("/dev/shm") if f.startswith("zk-testbed-check-"))
testbed.mark("before")
t0 = time.perf_counter()
dist.all_reduce(x)
seconds = time.perf_counter() - t0
testbed.mark("after")
result = {
    "rank": r,
    "node": node,
    "hostname": socket.gethostname(),
    "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    "seconds": seconds,
    "value_ok": bool((x == n).all()),
    "shm_files": shm_files,
}
with open(os.path.join(testbed.out_dir(), f"rank{r}.json"), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
