"""On the testbed: node argv[1] exits with code 3 at once, the others wait (for the testbed's
kill). Imports no torch: quick to start."""

import os
import sys
import time

if int(os.environ["ZK_TESTBED_NODE"]) == int(sys.argv[1]):
    print("node failing on purpose", flush=True)
    sys.exit(3)
time.sleep(600)
