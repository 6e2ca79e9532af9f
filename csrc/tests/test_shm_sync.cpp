// C++ unit test of the shared-memory synchronisation (csrc/shm_sync.h) across two processes:
// a forked child posts 2000 items (data, then metadata and the number) that the parent waits for
// and checks; then a bounded wait that times out, a poisoned wait, a wake without a change, the
// atomic add, the wrap-safe comparison, and a writer that dies (its lock released, the wait on it
// ended). Exits non-zero on failure.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>

#include "shm_sync.h"

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
  if (!ok && ++failures <= 10) std::printf("FAIL %s\n", what);
}

struct Shared {
  int32_t posted[4];  // [0] number, [1..3] metadata
  int32_t acked;
  int32_t poison;
  int32_t counter;
  int64_t data[64];
};

}  // namespace

int main() {
  if (!zk::shm_supported()) {
    std::printf("shm synchronisation not supported here: nothing to test\n");
    return 0;
  }
  void* mem =
      mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return 2;
  auto* s = new (mem) Shared{};
  const int kItems = 2000;
  pid_t child = fork();
  if (child == 0) {
    for (int i = 1; i <= kItems; ++i) {
      // the parent acknowledged the previous item: the data may be overwritten
      if (zk::shm_wait_ge(&s->acked, i - 1, nullptr, 10.0) != zk::kShmReached) _exit(3);
      for (int j = 0; j < 64; ++j) s->data[j] = int64_t(i) * 1000 + j;
      const int32_t meta[3] = {i * 3, -i, 7};
      zk::shm_post_with(s->posted, meta, 3, i);
    }
    zk::shm_fetch_add(&s->counter, 5);
    _exit(0);
  }
  bool data_ok = true, meta_ok = true;
  for (int i = 1; i <= kItems; ++i) {
    if (zk::shm_wait_ge(&s->posted[0], i, &s->poison, 10.0) != zk::kShmReached) {
      expect(false, "a posted item was not seen within 10 s");
      break;
    }
    for (int j = 0; j < 64; ++j) data_ok &= s->data[j] == int64_t(i) * 1000 + j;
    meta_ok &= s->posted[1] == i * 3 && s->posted[2] == -i && s->posted[3] == 7;
    zk::shm_post(&s->acked, i);
  }
  expect(data_ok, "data written before a post is seen after the wait");
  expect(meta_ok, "metadata posted with the number is seen with it");
  int status = 0;
  waitpid(child, &status, 0);
  expect(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the posting child exited cleanly");
  expect(zk::shm_load(&s->counter) == 5, "an atomic add in the child is seen by the parent");
  expect(zk::shm_fetch_add(&s->counter, 2) == 5 && s->counter == 7,
         "fetch_add returns the old value");

  auto t0 = std::chrono::steady_clock::now();
  expect(zk::shm_wait_ge(&s->posted[0], kItems + 1, &s->poison, 0.2) == zk::kShmTimedOut,
         "a wait for a number never posted times out");
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  expect(took >= 0.19 && took < 2.0, "the timeout is about what was asked");

  s->poison = 1;
  t0 = std::chrono::steady_clock::now();
  expect(zk::shm_wait_ge(&s->posted[0], kItems + 1, &s->poison, 5.0) == zk::kShmPoisoned,
         "a poisoned channel ends the wait");
  took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  expect(took < 1.0, "the poison is seen at once");
  s->poison = 0;
  zk::shm_wake(&s->posted[0]);  // no waiter: harmless
  expect(zk::shm_wait_ge(&s->posted[0], kItems, nullptr, 0.0) == zk::kShmReached,
         "a number already reached returns at once, even with a zero timeout");

  int32_t w = INT32_MAX;  // wrap-safe: INT32_MAX + 1 wraps to INT32_MIN and is "later"
  zk::shm_post(&w, INT32_MIN);
  expect(zk::shm_wait_ge(&w, INT32_MAX, nullptr, 0.0) == zk::kShmReached,
         "a number that wrapped past 2^31 counts as reached");
  // a writer that dies: its lock goes with it, and a wait on it ends (not at the timeout)
  char path[] = "/tmp/zk_shm_sync_XXXXXX";
  const int fd = mkstemp(path);
  expect(fd >= 0, "a lock file");
  unlink(path);
  s->acked = 0;
  const int32_t before = s->posted[0];
  pid_t writer = fork();
  if (writer == 0) {
    if (!zk::shm_hold(fd, 1)) _exit(4);
    zk::shm_post(&s->acked, 1);
    usleep(300000);
    _exit(0);  // without posting what the parent waits for
  }
  expect(zk::shm_wait_ge(&s->acked, 1, nullptr, 10.0) == zk::kShmReached, "the writer locked");
  expect(zk::shm_held(fd, 1), "the writer's lock is seen from another process");
  expect(!zk::shm_held(fd, 2), "a byte nobody locked is free");
  t0 = std::chrono::steady_clock::now();
  expect(zk::shm_wait_ge(&s->posted[0], before + 1, &s->poison, 30.0, fd, 1) == zk::kShmPeerGone,
         "a wait on a writer that exited ends with kShmPeerGone");
  took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  expect(took < 5.0, "a dead writer is seen within a few slices, not at the timeout");
  waitpid(writer, &status, 0);
  expect(!zk::shm_held(fd, 1), "the lock is gone with its process");
  close(fd);
  std::printf("shm sync: %d failures\n", failures);
  munmap(mem, sizeof(Shared));
  return failures == 0 ? 0 : 1;
}
