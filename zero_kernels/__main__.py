"""`python -m zero_kernels ...` runs the `zero-kernels` command."""

import sys

from zero_kernels.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
