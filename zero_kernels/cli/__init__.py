"""The `zero-kernels` command line (see `zero_kernels.cli.main`)."""
