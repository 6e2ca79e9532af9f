#include "shm_sync.h"

#include <chrono>
#include <climits>
#include <ctime>
#include <stdexcept>

#ifdef __linux__
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace zk {
namespace {

bool reached(int32_t now, int32_t target) {
  return static_cast<int32_t>(static_cast<uint32_t>(now) - static_cast<uint32_t>(target)) >= 0;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

#ifdef __linux__
long futex(const int32_t* word, int op, int32_t val, const timespec* ts) {
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  return syscall(SYS_futex, const_cast<int32_t*>(word), op, val, ts, nullptr, 0);
}
#else
long futex(const int32_t*, int, int32_t, const void*) {
  throw std::runtime_error("zero_kernels shm synchronisation needs Linux futexes");
}
constexpr int FUTEX_WAIT = 0;
constexpr int FUTEX_WAKE = 1;
#endif

}  // namespace

bool shm_supported() {
#ifdef __linux__
  return true;
#else
  return false;
#endif
}

void shm_wake(int32_t* word) { futex(word, FUTEX_WAKE, INT_MAX, nullptr); }

void shm_post(int32_t* word, int32_t value) {
  __atomic_store_n(word, value, __ATOMIC_RELEASE);
  shm_wake(word);
}

void shm_post_with(int32_t* words, const int32_t* meta, int count_meta, int32_t value) {
  for (int i = 0; i < count_meta; ++i) __atomic_store_n(words + 1 + i, meta[i], __ATOMIC_RELAXED);
  shm_post(words, value);
}

int32_t shm_fetch_add(int32_t* word, int32_t delta) {
  return __atomic_fetch_add(word, delta, __ATOMIC_ACQ_REL);
}

int32_t shm_load(const int32_t* word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }

#ifdef __linux__
namespace {
struct flock byte_lock(int64_t byte) {  // a write lock on one byte of the file
  struct flock fl = {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = static_cast<off_t>(byte);
  fl.l_len = 1;
  return fl;
}
}  // namespace

bool shm_hold(int fd, int64_t byte) {
  struct flock fl = byte_lock(byte);
  return fcntl(fd, F_SETLK, &fl) == 0;
}

bool shm_held(int fd, int64_t byte) {
  struct flock fl = byte_lock(byte);
  if (fcntl(fd, F_GETLK, &fl) != 0) return true;  // cannot tell: assume alive (the timeout bounds)
  return fl.l_type != F_UNLCK;
}
#else
bool shm_hold(int, int64_t) { return false; }
bool shm_held(int, int64_t) { return true; }
#endif

ShmWait shm_wait_ge(const int32_t* word, int32_t target, const int32_t* poison, double timeout_s,
                    int fd, int64_t peer_byte) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  for (int i = 0; i < 64; ++i) {  // short: the cores are shared with the peer ranks' compute
    if (reached(shm_load(word), target)) return kShmReached;
    cpu_relax();
  }
  long slices = 0;  // futex slices slept
  for (;;) {
    const int32_t now = shm_load(word);
    if (reached(now, target)) return kShmReached;
    if (poison != nullptr && shm_load(poison) != 0) return kShmPoisoned;
    if (fd >= 0 && slices > 0 && !shm_held(fd, peer_byte)) {  // not on the first pass: cheap path
      return reached(shm_load(word), target) ? kShmReached : kShmPeerGone;
    }
    ++slices;
    double slice = 0.05;  // seconds: how late a poison without a wake is seen
    if (timeout_s >= 0) {
      const double left = timeout_s - std::chrono::duration<double>(clock::now() - start).count();
      if (left <= 0) return kShmTimedOut;
      if (left < slice) slice = left;
    }
    timespec ts;
    ts.tv_sec = static_cast<time_t>(slice);
    ts.tv_nsec = static_cast<long>((slice - static_cast<double>(ts.tv_sec)) * 1e9);
    // Sleeps only while the word still holds ``now``: a post in between returns at once.
    futex(word, FUTEX_WAIT, now, &ts);
  }
}

}  // namespace zk
