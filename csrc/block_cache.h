// A cache of large host memory blocks, each an anonymous mapping of its own. Torch-free.
//
// What it is for (zero_kernels.hostmem, [Note: host block cache]): glibc serves a large block
// from its heap once its dynamic mmap threshold has risen to that size, and a freed block in
// the heap is soon split by small requests, so the next block of the same size no longer fits
// there and the heap grows by another (measured: autograd's gradient of a 2896 x 2896 weight,
// freed after each layer's hook, left two to three such blocks resident and free). Here a block
// is served by exact (page-rounded) size: a freed block waits in the cache until a request of
// its size takes it again, without new page faults. The oldest cached blocks are unmapped (their
// pages go back to the system at once) when the cached bytes would exceed the cap, and when a
// request misses: as many cached bytes as the new block takes, so live + cached bytes never
// exceed the most live bytes there were (the cache does not add to a peak).
//
// Blocks of 2 MiB and more start on a 2 MiB boundary and are advised as huge pages, so a miss
// faults one page per 2 MiB instead of 512. Thread-safe; after fork() the child's cache works
// (its lock is reinitialised). Linux (and any system with mmap); supported() says.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zk {

struct BlockCacheStats {
  uint64_t live_bytes;         // blocks handed out and not yet returned
  uint64_t cached_bytes;       // returned blocks kept for reuse
  uint64_t peak_live_bytes;    // most live bytes at once since the last reset
  uint64_t peak_cached_bytes;  // most cached bytes at once since the last reset
  uint64_t hits;               // requests served from the cache
  uint64_t misses;             // requests that mapped a new block
  uint64_t unmapped;           // blocks unmapped (cap exceeded, trim, or uncacheable)
  uint64_t min_bytes;          // the limits in force
  uint64_t cap_bytes;
};

// Whether this build can map memory (POSIX mmap).
bool block_cache_supported();

// Limits: requests of at least ``min_bytes`` are for the cache (the caller serves smaller ones
// elsewhere: `block_cache_wants`); at most ``cap_bytes`` of returned blocks are kept. Lowering
// the cap unmaps the oldest cached blocks at once.
void block_cache_configure(size_t min_bytes, size_t cap_bytes);

// Whether a request of ``n`` bytes is for the cache (n >= min_bytes).
bool block_cache_wants(size_t n);

// A block of at least ``n`` bytes, page-aligned (2 MiB-aligned from 2 MiB), or nullptr if the
// system has no memory to map. Its contents are unspecified (a reused block keeps old data).
void* block_cache_alloc(size_t n);

// Returns a block from block_cache_alloc. False if ``p`` is not a live block of the cache
// (the caller then frees it its own way).
bool block_cache_free(void* p);

// Whether ``p`` is a live block of the cache.
bool block_cache_owns(const void* p);

// The length of live block ``p`` (page-rounded), 0 if ``p`` is not one.
size_t block_cache_size(const void* p);

// Unmaps every cached block (live blocks are untouched); the bytes unmapped.
uint64_t block_cache_trim();

BlockCacheStats block_cache_stats();

// Peaks and counters back to the current values / zero.
void block_cache_reset_stats();

}  // namespace zk
