// C++ unit test of the host block cache (csrc/block_cache.h): reuse by exact page-rounded size,
// alignment, the cap, eviction on a miss (live + cached never above the most live), trim,
// foreign pointers, threads, and a forked child that allocates. Exits non-zero on failure.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "block_cache.h"

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
  if (!ok && ++failures <= 20) std::printf("FAIL %s\n", what);
}

constexpr size_t MiB = size_t{1} << 20;

}  // namespace

int main() {
  if (!zk::block_cache_supported()) {
    std::printf("block cache not supported here: nothing to test\n");
    return 0;
  }
  zk::block_cache_configure(1 * MiB, 64 * MiB);
  expect(!zk::block_cache_wants(MiB - 1), "below min_bytes is not for the cache");
  expect(zk::block_cache_wants(MiB), "min_bytes is for the cache");

  // reuse: the same rounded size gets the same block back, without a new mapping
  void* a = zk::block_cache_alloc(3 * MiB + 5);
  expect(a != nullptr, "alloc 3 MiB");
  expect(reinterpret_cast<uintptr_t>(a) % (2 * MiB) == 0, "2 MiB-aligned from 2 MiB");
  std::memset(a, 7, 3 * MiB + 5);  // the whole block is writable
  expect(zk::block_cache_owns(a), "owns a live block");
  expect(zk::block_cache_free(a), "free a live block");
  expect(!zk::block_cache_owns(a), "a cached block is not live");
  zk::BlockCacheStats s = zk::block_cache_stats();
  expect(s.cached_bytes == 3 * MiB + 4096, "cached bytes are the page-rounded size");
  void* b = zk::block_cache_alloc(3 * MiB + 100);  // the same page-rounded size
  expect(b == a, "same rounded size: the cached block is reused");
  s = zk::block_cache_stats();
  expect(s.hits == 1 && s.misses == 1, "one hit, one miss");
  expect(s.cached_bytes == 0, "nothing cached while it is live");
  void* small = zk::block_cache_alloc(MiB);  // not 2 MiB-aligned, page-aligned
  expect(reinterpret_cast<uintptr_t>(small) % 4096 == 0, "page-aligned below 2 MiB");
  expect(zk::block_cache_free(small) && zk::block_cache_free(b), "free both");

  // a miss unmaps as many cached bytes as it maps: live + cached stays at the most live
  zk::block_cache_trim();
  zk::block_cache_reset_stats();
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(zk::block_cache_alloc(4 * MiB));
  for (void* p : blocks) zk::block_cache_free(p);
  s = zk::block_cache_stats();
  expect(s.cached_bytes == 16 * MiB && s.live_bytes == 0, "four 4 MiB blocks cached");
  void* big = zk::block_cache_alloc(8 * MiB);  // another size: two cached blocks go
  s = zk::block_cache_stats();
  expect(s.cached_bytes == 8 * MiB, "a miss of 8 MiB unmapped 8 MiB of cached blocks");
  expect(s.live_bytes + s.cached_bytes <= s.peak_live_bytes, "live + cached <= most live");
  expect(s.unmapped == 2, "two blocks unmapped");
  void* again = zk::block_cache_alloc(4 * MiB);  // one of the two newest is still there
  expect(zk::block_cache_stats().hits == 1, "the newest cached blocks were kept");
  zk::block_cache_free(again);
  zk::block_cache_free(big);

  // the cap: freeing beyond it unmaps the oldest; a block above the cap is never cached
  zk::block_cache_configure(1 * MiB, 8 * MiB);
  expect(zk::block_cache_stats().cached_bytes <= 8 * MiB, "lowering the cap evicts at once");
  void* huge = zk::block_cache_alloc(16 * MiB);
  zk::block_cache_free(huge);
  expect(zk::block_cache_stats().cached_bytes <= 8 * MiB, "a block above the cap is unmapped");

  // trim, foreign pointers
  expect(zk::block_cache_trim() > 0 || zk::block_cache_stats().cached_bytes == 0, "trim");
  expect(zk::block_cache_stats().cached_bytes == 0, "nothing cached after trim");
  int local = 0;
  expect(!zk::block_cache_free(&local), "a pointer the cache never gave is refused");
  expect(!zk::block_cache_owns(&local), "and not owned");

  // threads: allocate, write, check, free concurrently
  zk::block_cache_configure(1 * MiB, 32 * MiB);
  std::vector<std::thread> ts;
  std::vector<int> bad(4, 0);
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([t, &bad] {
      for (int i = 0; i < 200; ++i) {
        size_t n = (1 + (i + t) % 3) * MiB;
        auto* p = static_cast<unsigned char*>(zk::block_cache_alloc(n));
        if (p == nullptr) {
          ++bad[t];
          continue;
        }
        std::memset(p, t + 1, n);
        if (p[0] != t + 1 || p[n - 1] != t + 1) ++bad[t];
        if (!zk::block_cache_free(p)) ++bad[t];
      }
    });
  }
  for (auto& th : ts) th.join();
  for (int t = 0; t < 4; ++t) expect(bad[t] == 0, "threads: every block written, read, freed");
  s = zk::block_cache_stats();
  expect(s.live_bytes == 0, "threads: nothing live at the end");

  // fork while another thread holds blocks: the child allocates and frees
  std::thread holder([] {
    for (int i = 0; i < 2000; ++i) zk::block_cache_free(zk::block_cache_alloc(2 * MiB));
  });
  pid_t pid = fork();
  if (pid == 0) {
    void* c = zk::block_cache_alloc(5 * MiB);
    bool ok = c != nullptr && zk::block_cache_free(c);
    _exit(ok ? 0 : 1);
  }
  holder.join();
  int status = 0;
  waitpid(pid, &status, 0);
  expect(WIFEXITED(status) && WEXITSTATUS(status) == 0, "a forked child allocates and frees");

  if (failures) {
    std::printf("%d failure(s)\n", failures);
    return 1;
  }
  std::printf("block cache: all checks passed\n");
  return 0;
}
