"""The `zero-kernels` command line (see `zero_kernels.cli.main`)."""


def stop_processes(procs, *, terminate: bool = True, grace_s: float = 10.0) -> None:
    """End spawned rank processes: SIGTERM to those still alive (unless ``terminate`` is
    False), then join each for ``grace_s`` and kill what is left."""
    if terminate:
        for p in procs:
            if p.is_alive():
                p.terminate()
    for p in procs:
        p.join(grace_s)
        if p.is_alive():
            p.kill()
            p.join()
