// See block_cache.h.
#include "block_cache.h"

#include <algorithm>
#include <atomic>
#include <list>
#include <unordered_map>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>
#define ZK_HAVE_MMAP 1
#else
#define ZK_HAVE_MMAP 0
#endif

namespace zk {

#if ZK_HAVE_MMAP
namespace {

constexpr size_t kHuge = size_t{2} << 20;

struct Block {
  void* p;
  size_t len;
};

struct State {
  pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
  size_t page = 4096;
  std::atomic<size_t> min_bytes{size_t{1} << 62};  // nothing is for the cache until configured
  size_t cap_bytes = 0;
  std::unordered_map<void*, size_t> live;  // block -> length
  std::list<Block> lru;                    // cached, newest first
  std::unordered_map<size_t, std::vector<std::list<Block>::iterator>> by_len;
  BlockCacheStats st{};
};

void at_prepare();
void at_parent();
void at_child();

State& state() {
  static State* s = [] {
    auto* x = new State();  // never destroyed: blocks may be returned during exit
    long pg = sysconf(_SC_PAGESIZE);
    if (pg > 0) x->page = static_cast<size_t>(pg);
    pthread_atfork(at_prepare, at_parent, at_child);
    return x;
  }();
  return *s;
}

void at_prepare() { pthread_mutex_lock(&state().mu); }
void at_parent() { pthread_mutex_unlock(&state().mu); }
void at_child() { pthread_mutex_unlock(&state().mu); }

struct Lock {
  explicit Lock(State& s) : s_(s) { pthread_mutex_lock(&s_.mu); }
  ~Lock() { pthread_mutex_unlock(&s_.mu); }
  State& s_;
};

size_t round_len(const State& s, size_t n) {
  if (n == 0) n = 1;
  return (n + s.page - 1) / s.page * s.page;
}

void* map_block(size_t len) {
  if (len < kHuge) {
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
  }
  // 2 MiB-aligned start: map the slack too, then unmap what lies outside [start, start + len)
  void* raw =
      mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  auto base = reinterpret_cast<uintptr_t>(raw);
  uintptr_t start = (base + kHuge - 1) / kHuge * kHuge;
  if (start > base) munmap(raw, start - base);
  uintptr_t end = start + len, raw_end = base + len + kHuge;
  if (raw_end > end) munmap(reinterpret_cast<void*>(end), raw_end - end);
#ifdef MADV_HUGEPAGE
  madvise(reinterpret_cast<void*>(start), len, MADV_HUGEPAGE);
#endif
  return reinterpret_cast<void*>(start);
}

// Removes the oldest cached blocks until at most ``cap`` bytes are cached; the caller unmaps
// them after unlocking.
void evict_to(State& s, size_t cap, std::vector<Block>& out) {
  while (s.st.cached_bytes > cap && !s.lru.empty()) {
    auto it = std::prev(s.lru.end());
    auto& v = s.by_len[it->len];
    v.erase(std::find(v.begin(), v.end(), it));
    if (v.empty()) s.by_len.erase(it->len);
    s.st.cached_bytes -= it->len;
    out.push_back(*it);
    s.lru.erase(it);
  }
}

void unmap_all(State& s, const std::vector<Block>& blocks) {
  for (const Block& b : blocks) munmap(b.p, b.len);
  if (!blocks.empty()) {
    Lock g(s);
    s.st.unmapped += blocks.size();
  }
}

}  // namespace

bool block_cache_supported() { return true; }

void block_cache_configure(size_t min_bytes, size_t cap_bytes) {
  State& s = state();
  std::vector<Block> out;
  {
    Lock g(s);
    s.min_bytes.store(std::max<size_t>(min_bytes, 1));
    s.cap_bytes = cap_bytes;
    s.st.min_bytes = s.min_bytes.load();
    s.st.cap_bytes = cap_bytes;
    evict_to(s, cap_bytes, out);
  }
  unmap_all(s, out);
}

bool block_cache_wants(size_t n) {
  return n >= state().min_bytes.load(std::memory_order_relaxed);  // every CPU allocation asks
}

void* block_cache_alloc(size_t n) {
  State& s = state();
  size_t len = round_len(s, n);
  std::vector<Block> out;
  {
    Lock g(s);
    auto f = s.by_len.find(len);
    if (f != s.by_len.end()) {
      auto it = f->second.back();  // the most recently returned: its pages are the warmest
      f->second.pop_back();
      if (f->second.empty()) s.by_len.erase(f);
      void* p = it->p;
      s.lru.erase(it);
      s.st.cached_bytes -= len;
      s.live.emplace(p, len);
      s.st.live_bytes += len;
      s.st.peak_live_bytes = std::max(s.st.peak_live_bytes, s.st.live_bytes);
      ++s.st.hits;
      return p;
    }
    // a miss: first unmap as many cached bytes (oldest first) as the new block takes, so that
    // what the cache holds never adds to a peak (live + cached stays at most the peak of live)
    evict_to(s, s.st.cached_bytes > len ? s.st.cached_bytes - len : 0, out);
  }
  unmap_all(s, out);
  void* p = map_block(len);
  if (p == nullptr) {  // no memory: give back what is cached and try once more
    block_cache_trim();
    p = map_block(len);
    if (p == nullptr) return nullptr;
  }
  Lock g(s);
  s.live.emplace(p, len);
  s.st.live_bytes += len;
  s.st.peak_live_bytes = std::max(s.st.peak_live_bytes, s.st.live_bytes);
  ++s.st.misses;
  return p;
}

bool block_cache_free(void* p) {
  State& s = state();
  std::vector<Block> out;
  {
    Lock g(s);
    auto f = s.live.find(p);
    if (f == s.live.end()) return false;
    size_t len = f->second;
    s.live.erase(f);
    s.st.live_bytes -= len;
    if (len > s.cap_bytes) {
      out.push_back(Block{p, len});
    } else {
      s.lru.push_front(Block{p, len});
      s.by_len[len].push_back(s.lru.begin());
      s.st.cached_bytes += len;
      evict_to(s, s.cap_bytes, out);  // may evict older blocks, never the one just returned
      s.st.peak_cached_bytes = std::max(s.st.peak_cached_bytes, s.st.cached_bytes);
    }
  }
  unmap_all(s, out);
  return true;
}

bool block_cache_owns(const void* p) {
  State& s = state();
  Lock g(s);
  return s.live.count(const_cast<void*>(p)) != 0;
}

size_t block_cache_size(const void* p) {
  State& s = state();
  Lock g(s);
  auto f = s.live.find(const_cast<void*>(p));
  return f == s.live.end() ? 0 : f->second;
}

uint64_t block_cache_trim() {
  State& s = state();
  std::vector<Block> out;
  {
    Lock g(s);
    evict_to(s, 0, out);
  }
  uint64_t bytes = 0;
  for (const Block& b : out) bytes += b.len;
  unmap_all(s, out);
  return bytes;
}

BlockCacheStats block_cache_stats() {
  State& s = state();
  Lock g(s);
  return s.st;
}

void block_cache_reset_stats() {
  State& s = state();
  Lock g(s);
  s.st.peak_live_bytes = s.st.live_bytes;
  s.st.peak_cached_bytes = s.st.cached_bytes;
  s.st.hits = s.st.misses = s.st.unmapped = 0;
}

#else  // no mmap: nothing is ever for the cache

bool block_cache_supported() { return false; }
void block_cache_configure(size_t, size_t) {}
bool block_cache_wants(size_t) { return false; }
void* block_cache_alloc(size_t) { return nullptr; }
bool block_cache_free(void*) { return false; }
bool block_cache_owns(const void*) { return false; }
size_t block_cache_size(const void*) { return 0; }
uint64_t block_cache_trim() { return 0; }
BlockCacheStats block_cache_stats() { return BlockCacheStats{}; }
void block_cache_reset_stats() {}

#endif

}  // namespace zk
