// Cross-process synchronisation on 32-bit words in shared memory (Linux futexes), for the
// shared-memory collectives of zero_kernels.comm.shm. Torch-free.
//
// A word holds a sequence number that only grows (modulo 2^32): a writer publishes with
// shm_post (a release store, then a wake), a reader waits until the word has reached a target
// with shm_wait_ge (an acquire load, then a futex wait), so what the writer stored before the
// post is visible to the reader after the wait. Comparisons are wrap-safe (signed difference).
// Elsewhere than Linux shm_supported() is false and the other functions must not be called.
#pragma once

#include <cstdint>

namespace zk {

// Result of shm_wait_ge.
enum ShmWait : int { kShmReached = 0, kShmTimedOut = 1, kShmPoisoned = 2, kShmPeerGone = 3 };

// Whether this build has the futex-based implementation (Linux).
bool shm_supported();

// Store ``value`` into ``word`` with release order and wake every process waiting on it.
void shm_post(int32_t* word, int32_t value);

// ``words[1..count-1]`` stored (relaxed), then ``words[0] = value`` posted as by shm_post: the
// metadata of a posted item becomes visible with it.
void shm_post_with(int32_t* words, const int32_t* meta, int count_meta, int32_t value);

// Wait until ``*word - target >= 0`` (signed 32-bit difference) or ``*poison != 0`` or
// ``timeout_s`` seconds have passed (negative: no bound). Spins briefly, then sleeps on the
// futex in slices so a poison set without a wake is still seen. With ``fd >= 0``, after each
// slice also checks that the writer still holds its lock on byte ``peer_byte`` of ``fd``'s file
// (shm_hold): a writer that died released it (kShmPeerGone).
ShmWait shm_wait_ge(const int32_t* word, int32_t target, const int32_t* poison, double timeout_s,
                    int fd = -1, int64_t peer_byte = -1);

// Take a POSIX record lock on byte ``byte`` of ``fd``'s file for this process's life (the kernel
// drops it when the process ends, however it ends, or closes any descriptor of that file).
bool shm_hold(int fd, int64_t byte);

// Whether another process holds a lock on byte ``byte`` of ``fd``'s file.
bool shm_held(int fd, int64_t byte);

// Wake every process waiting on ``word`` (its value unchanged).
void shm_wake(int32_t* word);

// Atomically add ``delta`` to ``word``; the value before.
int32_t shm_fetch_add(int32_t* word, int32_t delta);

// An acquire load of ``word``.
int32_t shm_load(const int32_t* word);

}  // namespace zk
