"""Which ranks of a process group share a host, proven by a file in /dev/shm.

[Note: hosts are proven]
Ranks are on one host, for the shared-memory collectives ([Note: shared-memory collectives] in
shm.py) and later for a node-local shard group, only when they *see the same files in /dev/shm*,
and that is proven, not assumed: containers on one machine usually have a private /dev/shm each
(Docker's default), and ranks of several machines (or network-namespace nodes with their own
tmpfs, `zero_kernels.tools.testbed`) may well have the same hostname, the same paths and the same
LOCAL_WORLD_SIZE. Opening a file by name is no proof either: ``torch.from_file(..., shared=True)``
creates an empty file where there is none, so a rank of another host "maps" a file of its own
and then waits forever on words nobody else writes.

The proof, collective over the group: every rank writes a random token into a new file of its
own in /dev/shm (``O_EXCL``) and the ranks exchange (file name, token) pairs; every rank opens
every other rank's file in its own /dev/shm *without creating it* and checks the token; the
ranks exchange what each saw and every rank turns the same matrix into the same groups: rank a
and b are together when each read the other's token, and a group holds only ranks that all see
one another (taken in rank order, each rank joining the first group whose every member it sees
both ways). The files are removed once every rank has looked. Where /dev/shm cannot be written
a rank proves nothing and is a host of its own.
"""

from __future__ import annotations

import os
import secrets

from .groups import group_key, rank, world_size
from .objects import all_gather_object

__all__ = ["SHM_DIR", "host_groups"]

# The shared-memory folder the ranks prove hosts with and map the shm algorithm's files in
# (`zero_kernels.comm.shm`); read at each use: tests point ranks at different folders.
SHM_DIR = "/dev/shm"

PROVEN: dict = {}  # group_key -> tuple of tuples of group ranks


def host_groups(group=None) -> list[list[int]]:
    """The ranks of ``group`` (group ranks, each list sorted, lists ordered by their first rank)
    that share one /dev/shm, proven by a file one rank wrote and the others read ([Note: hosts
    are proven]); the same answer on every rank. Collective on its first call for a group (call
    it on every rank), cached for the group after that. ``[[0]]`` at world size 1."""
    key = group_key(group)
    got = PROVEN.get(key)
    if got is None:
        got = PROVEN[key] = _prove(group)
    return [list(g) for g in got]


def _shm_dir() -> str:
    return SHM_DIR  # read at call time: tests point ranks at different folders


def _prove(group) -> tuple:
    n, r = world_size(group), rank(group)
    if n == 1:
        return ((0,),)
    token = secrets.token_hex(16)
    shm_dir = _shm_dir()
    name = f"zero_kernels-host-{secrets.token_hex(8)}"
    path = os.path.join(shm_dir, name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.write(fd, token.encode())
        finally:
            os.close(fd)
    except OSError:  # nothing to prove with: this rank is a host of its own
        name = path = None
    try:  # by name: each rank looks in its own /dev/shm (the same path on every host)
        proofs = all_gather_object((name, token), group=group)
        sees = [q == r or _reads(shm_dir, f, t) for q, (f, t) in enumerate(proofs)]
        matrix = all_gather_object(sees, group=group)
    finally:
        if path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass
    return mutual_groups(matrix)


def _reads(shm_dir: str, name: str | None, token: str) -> bool:
    """Whether file ``name`` exists in this rank's ``shm_dir`` (opened, never created) and holds
    ``token``."""
    if name is None:
        return False
    try:
        fd = os.open(
            os.path.join(shm_dir, name), os.O_RDONLY
        )  # no O_CREAT: a file of another host is not found
    except OSError:
        return False
    try:
        return os.read(fd, len(token) + 1) == token.encode()
    except OSError:
        return False
    finally:
        os.close(fd)


def mutual_groups(matrix: list[list[bool]]) -> tuple:
    """Groups of ranks that all see one another both ways, in rank order (a pure function of
    the matrix every rank has)."""
    groups: list[list[int]] = []
    for a in range(len(matrix)):
        for g in groups:
            if all(matrix[a][b] and matrix[b][a] for b in g):
                g.append(a)
                break
        else:
            groups.append([a])
    return tuple(tuple(g) for g in groups)


def forget() -> None:
    PROVEN.clear()
