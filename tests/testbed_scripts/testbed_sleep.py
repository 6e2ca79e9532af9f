"""On the testbed: each rank says it started (a file in the out folder), then sleeps. Imports no
torch: quick to start."""

import os
import time

node, rank = os.environ["ZK_TESTBED_NODE"], os.environ.get("LOCAL_RANK", "0")
with open(os.path.join(os.environ["ZK_TESTBED_DIR"], f"started-{node}-{rank}"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)
