"""Large CPU blocks from a cache of mappings instead of glibc's heap (the host block cache).

[Note: host block cache]
On the CPU torch takes its memory from glibc's malloc. glibc serves a block above its mmap
threshold with a mapping of its own, but it raises that threshold to the size of every such
block freed (up to 32 MiB), so from the first freed gradient on, gradient-sized blocks come
from its heap. A freed block there is soon split by small requests, the next block of the same
size no longer fits in it, and the heap grows by another: autograd's gradient of a 2896 x 2896
weight, copied out and dropped by a post-accumulate hook (what every ZeRO stage and DDP do),
left 2-3 such blocks free and resident after a backward (plain torch, measured with
``mallinfo2``). That is most of why peak RSS was 1.12-1.38x the formula with glibc's defaults.
Fixing glibc's threshold (``MALLOC_MMAP_THRESHOLD_``) maps every large block anew and faults
its pages in every time: 1.17-1.25x step time on an MLP with 9 MB gradients.

So, where a `ZeroOptimizer` keeps its params on the CPU, it installs this cache as torch's CPU
allocator (`install`), unless ``host_cache=False`` or ``ZERO_KERNELS_HOST_CACHE=0``:

- A request of at least ``min_bytes`` (default 1 MiB) gets a block of its own: an anonymous
  mapping, page-rounded, 2 MiB-aligned and advised as huge pages from 2 MiB. Smaller requests go
  to the allocator it replaced (glibc), whose threshold then never rises above ``min_bytes``.
- A freed block is kept for the next request of the same rounded size (no new page faults: a
  layer's gradient reuses the last layer's block). A request that finds none first unmaps as
  many cached bytes as it takes, oldest first (their pages leave RSS at once), so live + cached
  bytes never exceed the most live bytes there were: the cache does not add to a peak. Its
  size is therefore not bounded by default (``cap_bytes``: beyond it the oldest are unmapped);
  between steps it holds what the step freed, as glibc's heap would. A bound of 64 MiB, tried
  first, cost a GPT with ~1 MB activations 1.07-1.13x step time (they were faulted in anew).
- Process-wide, as any allocator is: every CPU tensor of ``min_bytes`` or more made after
  `install` (the user's too) comes from it. Tensors made before keep their allocator. It is never
  removed (storages remember their allocator); `disable` sends new requests to glibc again.
  `stats` counts live and cached bytes, hits and misses; `trim` unmaps what is cached.
- Reported to torch's profiler (``profile_memory=True``) as glibc's blocks are.

Measured (docs/benchmarks.md, "The host block cache"; 4 ranks, 67M-param MLP, peak RSS against the
estimate with its scratch): stages 1 / 2 / 3 at 1.01x / 1.04x / 1.02x with the cache, 1.12x /
1.25x / 1.38x without it in the same code; DDP with it 1.01x, without 1.16-1.25x. Step time with
it against without: 0.86-0.91x on an MLP with 9 MB gradients (stages 1, 2, DDP), 0.95-1.02x on a
GPT with ~1 MB activations. Capacity at 1 GiB per rank: stage 3 from 62-63 to 65 GPT layers (71
to 75 with checkpointing). Blocks are separate mappings: a process has at most
``vm.max_map_count`` (65530 by default; adjacent mappings merge); a failed mapping falls back to
glibc.

Torch-free core: csrc/block_cache.cpp (C++ unit test csrc/tests/test_block_cache.cpp); the
torch allocator: csrc/bindings_host.cpp. Tested: tests/offload/test_hostmem.py; every
multi-process test runs with it (ZeroOptimizer installs it).
"""

from __future__ import annotations

import os

import torch

from . import native

__all__ = [
    "install",
    "ensure",
    "installed",
    "disable",
    "stats",
    "reset_stats",
    "trim",
    "owns",
    "available",
]

DEFAULT_MIN_BYTES = 1 << 20
DEFAULT_CAP_BYTES = 1 << 62  # no bound: the cache never adds to a peak (see the Note)
ENV = "ZERO_KERNELS_HOST_CACHE"
_user_disabled = False  # disable() was called (and install() not since)


def available() -> str | None:
    """None when the cache can be installed here, else why not."""
    lib = native.load()
    if lib is None or not hasattr(lib, "host_cache_install"):
        return "the native extension zero_kernels._C is not built (or predates the host cache)"
    return None


def _size(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low} (bytes), got {name}={value!r}")
    return value


def install(min_bytes: int | None = None, cap_bytes: int | None = None) -> bool:
    """Make the host block cache torch's CPU allocator for requests of at least ``min_bytes``,
    keeping at most ``cap_bytes`` of freed blocks; again: new limits. Returns whether it is now
    in use (False: the extension is missing, or another library's CPU allocator of higher
    priority is in place)."""
    min_bytes = _size("min_bytes", DEFAULT_MIN_BYTES if min_bytes is None else min_bytes, 1)
    cap_bytes = _size("cap_bytes", DEFAULT_CAP_BYTES if cap_bytes is None else cap_bytes, 0)
    if available() is not None:
        return False
    global _user_disabled
    _user_disabled = False
    return bool(native.load().host_cache_install(min_bytes, cap_bytes))


def from_env(setting) -> bool:
    """`ZeroOptimizer`'s ``host_cache`` (None, True, False) and ``ZERO_KERNELS_HOST_CACHE``:
    whether to install. The environment's "0" wins over None only."""
    if setting is not None and not isinstance(setting, bool):
        raise TypeError(f"host_cache must be None, True or False, got host_cache={setting!r}")
    env = os.environ.get(ENV, "").strip().lower()
    if env not in ("", "0", "1", "off", "on"):
        raise ValueError(f"{ENV} must be 0/off or 1/on, got {ENV}={env!r}")
    if setting is None:
        return env not in ("0", "off")
    return setting


def ensure(setting) -> bool:
    """`ZeroOptimizer`'s ``host_cache``: True installs the cache unless it is in use (limits set
    by an earlier `install` stay); None does too unless ``ZERO_KERNELS_HOST_CACHE=0`` or `disable`
    was called; False leaves things as they are. Returns whether the cache is in use now."""
    want = from_env(setting)
    if setting is None and _user_disabled:
        want = False
    if want and not installed():
        install()
    return installed()


def installed() -> bool:
    """Whether new CPU requests of ``min_bytes`` or more go to the cache."""
    return available() is None and bool(native.load().host_cache_stats()["enabled"])


def disable() -> None:
    """New CPU requests go to glibc again (blocks already out come back to the cache), and a
    `ZeroOptimizer` made later with the default ``host_cache=None`` does not install it again."""
    global _user_disabled
    _user_disabled = True
    if available() is None:
        native.load().host_cache_enable(False)


def stats() -> dict:
    """live_bytes, cached_bytes, their peaks, hits, misses, unmapped, min_bytes, cap_bytes,
    enabled (all 0 / False when the extension is missing)."""
    if available() is not None:
        keys = ("live_bytes", "cached_bytes", "peak_live_bytes", "peak_cached_bytes", "hits")
        out = dict.fromkeys(keys + ("misses", "unmapped", "min_bytes", "cap_bytes"), 0)
        out["enabled"] = False
        return out
    return dict(native.load().host_cache_stats())


def reset_stats() -> None:
    """Peaks to the current values, counters to zero."""
    if available() is None:
        native.load().host_cache_reset_stats()


def trim() -> int:
    """Unmap every cached block (blocks in use are untouched); the bytes given back."""
    return int(native.load().host_cache_trim()) if available() is None else 0


def owns(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage is a block of the cache."""
    return available() is None and bool(native.load().host_cache_owns(t))
