import os
import sys

# Triton runs on the CPU only through its interpreter; set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(__file__))
