import os
import sys

# Triton runs on the CPU only through its interpreter; set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(__file__))

# the `testbed` fixture (several namespace nodes over a rate-limited link): tests/testbed_fixture.py
pytest_plugins = ["testbed_fixture"]
