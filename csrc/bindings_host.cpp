// Bindings of the host services the Python package uses beside the kernels: the shared-memory
// collectives' words (zero_kernels.comm.shm), the host block cache installed as torch's CPU
// allocator (zero_kernels/hostmem.py [Note: host block cache]) and the async I/O engine of the
// offload tiers (zero_kernels/offload/aio.py). Registered into the module bindings.cpp defines;
// like it, the only other file here that includes torch (the services themselves are torch-free:
// shm_sync.h, block_cache.h, aio.h).
#include <c10/core/CPUAllocator.h>
#include <torch/extension.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "aio.h"
#include "block_cache.h"
#include "shm_sync.h"

namespace {

// The shared-memory collectives' synchronisation (zero_kernels.comm.shm): words are addressed by
// integer (a shared tensor's data_ptr() plus an offset); values are taken modulo 2^32.
int32_t* shm_word(int64_t addr) {
  TORCH_CHECK_VALUE(addr != 0 && addr % 4 == 0,
                    "shm word address must be non-null and 4-byte "
                    "aligned, got ",
                    addr);
  return reinterpret_cast<int32_t*>(static_cast<uintptr_t>(addr));
}

int32_t as_word(int64_t v) { return static_cast<int32_t>(static_cast<uint32_t>(v)); }

void shm_post(int64_t addr, int64_t value) { zk::shm_post(shm_word(addr), as_word(value)); }

void shm_post_with(int64_t addr, std::vector<int64_t> meta, int64_t value) {
  std::vector<int32_t> words(meta.size());
  for (size_t i = 0; i < meta.size(); ++i) words[i] = as_word(meta[i]);
  zk::shm_post_with(shm_word(addr), words.data(), static_cast<int>(words.size()), as_word(value));
}

int shm_wait_ge(int64_t addr, int64_t target, int64_t poison_addr, double timeout_s, int64_t fd,
                int64_t peer_byte) {
  const int32_t* word = shm_word(addr);
  const int32_t* poison = poison_addr == 0 ? nullptr : shm_word(poison_addr);
  py::gil_scoped_release nogil;
  return static_cast<int>(
      zk::shm_wait_ge(word, as_word(target), poison, timeout_s, static_cast<int>(fd), peer_byte));
}

void shm_wake(int64_t addr) { zk::shm_wake(shm_word(addr)); }

int64_t shm_fetch_add(int64_t addr, int64_t delta) {
  return zk::shm_fetch_add(shm_word(addr), as_word(delta));
}

int64_t shm_load(int64_t addr) { return zk::shm_load(shm_word(addr)); }

// ---- host block cache ([Note: host block cache] in zero_kernels/hostmem.py)
// torch's CPU allocator while installed: requests the cache wants (at least its min_bytes, and
// while enabled) get a cached block, every other request goes to the allocator it replaced.
// Installed once per process and never removed (storages keep a pointer to the allocator that
// made them); `host_cache_enable(false)` passes every new request through.
c10::Allocator* g_prev_cpu = nullptr;
std::atomic<bool> g_cache_on{false};

// torch's profiler sees the cache's blocks as it sees the default allocator's (profile_memory)
void report_to_profiler(void* p, int64_t bytes) {
  zk::BlockCacheStats st = zk::block_cache_stats();
  c10::reportMemoryUsageToProfiler(p, bytes, st.live_bytes, st.live_bytes + st.cached_bytes,
                                   c10::Device(c10::DeviceType::CPU));
}

void host_block_delete(void* p) {
  size_t len = c10::memoryProfilingEnabled() ? zk::block_cache_size(p) : 0;
  if (!zk::block_cache_free(p)) {
    g_prev_cpu->raw_deallocate(p);
  } else if (len != 0) {
    report_to_profiler(p, -static_cast<int64_t>(len));
  }
}

class HostBlockAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (g_cache_on.load(std::memory_order_relaxed) && zk::block_cache_wants(n)) {
      void* p = zk::block_cache_alloc(n);
      if (p != nullptr) {
        if (c10::memoryProfilingEnabled()) {
          report_to_profiler(p, static_cast<int64_t>(zk::block_cache_size(p)));
        }
        return {p, p, &host_block_delete, c10::Device(c10::DeviceType::CPU)};
      }
    }
    return g_prev_cpu->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &host_block_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

// never destroyed: torch may allocate and free through it during the process's exit
HostBlockAllocator* const g_host_alloc = new HostBlockAllocator();

// Installs the allocator (once) and configures the cache; true when torch's CPU allocator is
// now this one (another library's allocator of higher priority keeps its place: false).
bool host_cache_install(int64_t min_bytes, int64_t cap_bytes) {
  TORCH_CHECK(min_bytes > 0, "min_bytes must be > 0, got ", min_bytes);
  TORCH_CHECK(cap_bytes >= 0, "cap_bytes must be >= 0, got ", cap_bytes);
  if (!zk::block_cache_supported()) return false;
  zk::block_cache_configure(static_cast<size_t>(min_bytes), static_cast<size_t>(cap_bytes));
  c10::Allocator* cur = c10::GetCPUAllocator();
  if (cur != g_host_alloc) {
    if (g_prev_cpu == nullptr) g_prev_cpu = cur;
    c10::SetCPUAllocator(g_host_alloc, /*priority=*/0);
  }
  g_cache_on.store(c10::GetCPUAllocator() == g_host_alloc);
  return g_cache_on.load();
}

void host_cache_enable(bool on) {
  g_cache_on.store(on && g_prev_cpu != nullptr && c10::GetCPUAllocator() == g_host_alloc);
}

py::dict host_cache_stats() {
  zk::BlockCacheStats s = zk::block_cache_stats();
  py::dict d;
  d["enabled"] = g_cache_on.load();
  d["live_bytes"] = s.live_bytes;
  d["cached_bytes"] = s.cached_bytes;
  d["peak_live_bytes"] = s.peak_live_bytes;
  d["peak_cached_bytes"] = s.peak_cached_bytes;
  d["hits"] = s.hits;
  d["misses"] = s.misses;
  d["unmapped"] = s.unmapped;
  d["min_bytes"] = s.min_bytes;
  d["cap_bytes"] = s.cap_bytes;
  return d;
}

bool host_cache_owns(const at::Tensor& t) {
  return t.device().is_cpu() && zk::block_cache_owns(t.storage().data_ptr().get());
}

// The I/O engine (aio.h) takes raw addresses: the caller (zero_kernels.offload.aio) checks the
// tensor and keeps it alive until the request is done. The bound types are local wrappers:
// pybind11's own types are hidden, a bound zk:: type (default visibility) would warn.
struct AioRequestRef {
  std::shared_ptr<zk::AioRequest> r;
  bool done() const { return r->done(); }
  py::tuple wait() const {
    {
      py::gil_scoped_release release;
      r->wait();
    }
    return py::make_tuple(r->error(), r->bytes_done());
  }
};

struct AioEngineRef {
  AioEngineRef(int fd, int queue_depth, int64_t chunk_bytes, bool direct,
               const std::string& backend) {
    TORCH_CHECK_VALUE(chunk_bytes > 0, "chunk_bytes must be > 0, got ", chunk_bytes);
    e = std::make_unique<zk::AioEngine>(fd, queue_depth, static_cast<size_t>(chunk_bytes), direct,
                                        backend);
  }
  AioRequestRef submit(bool write, uint64_t ptr, int64_t nbytes, int64_t offset) {
    TORCH_CHECK_VALUE(nbytes >= 0, "nbytes must be >= 0, got ", nbytes);
    TORCH_CHECK_VALUE(offset >= 0, "offset must be >= 0, got ", offset);
    return {e->submit(write ? zk::AioOp::kWrite : zk::AioOp::kRead, reinterpret_cast<void*>(ptr),
                      static_cast<size_t>(nbytes), static_cast<uint64_t>(offset))};
  }
  void close() {
    py::gil_scoped_release release;
    e->close();
  }
  std::string backend() const { return e->backend(); }
  std::string fallback_reason() const { return e->fallback_reason(); }
  uint64_t bytes_read() const { return e->bytes_read(); }
  uint64_t bytes_written() const { return e->bytes_written(); }
  std::unique_ptr<zk::AioEngine> e;
};

py::tuple aio_uring_supported() {
  std::string why;
  bool ok = zk::aio_uring_supported(&why);
  return py::make_tuple(ok, why);
}

}  // namespace

void register_host(py::module_& m) {
  m.def("shm_post", &shm_post, "Release-store a shared word, wake its waiters");
  m.def("shm_wait_ge", &shm_wait_ge,
        "Wait (GIL released) until a shared word reaches target: 0 reached, 1 timed out, 2 "
        "poisoned, 3 the writer (holding its lock on byte peer_byte of fd) is gone",
        py::arg("addr"), py::arg("target"), py::arg("poison_addr"), py::arg("timeout_s"),
        py::arg("fd") = -1, py::arg("peer_byte") = -1);
  m.def("shm_hold", &zk::shm_hold, "Lock byte `byte` of fd's file for this process's life");
  m.def("shm_held", &zk::shm_held, "Whether another process holds a lock on that byte");
  m.def("shm_supported", &zk::shm_supported, "Whether shm synchronisation is built (Linux)");
  m.def("shm_post_with", &shm_post_with, "Store meta in the words after addr, post value");
  m.def("shm_wake", &shm_wake, "Wake the waiters of a shared word");
  m.def("shm_fetch_add", &shm_fetch_add, "Atomic add on a shared word; the value before");
  m.def("shm_load", &shm_load, "Acquire-load a shared word");
  m.def("host_cache_install", &host_cache_install,
        "Make the host block cache torch's CPU allocator for requests of at least min_bytes");
  m.def("host_cache_enable", &host_cache_enable, "New CPU requests through the cache, or not");
  m.def("host_cache_stats", &host_cache_stats, "The host block cache's bytes and counters");
  m.def("host_cache_trim", &zk::block_cache_trim, "Unmap every cached block; the bytes");
  m.def("host_cache_reset_stats", &zk::block_cache_reset_stats, "Peaks to now, counters to 0");
  m.def("host_cache_owns", &host_cache_owns, "Whether a tensor's storage is a cached block");
  py::class_<AioRequestRef>(m, "AioRequest")
      .def("done", &AioRequestRef::done, "Whether every chunk has completed")
      .def("wait", &AioRequestRef::wait, "Wait (GIL released); (errno or 0, bytes moved)");
  py::class_<AioEngineRef>(m, "AioEngine")
      .def(py::init<int, int, int64_t, bool, const std::string&>(), py::arg("fd"),
           py::arg("queue_depth"), py::arg("chunk_bytes"), py::arg("direct"),
           py::arg("backend") = "auto")
      .def("submit", &AioEngineRef::submit,
           "Start reading/writing nbytes at offset from address ptr", py::arg("write"),
           py::arg("ptr"), py::arg("nbytes"), py::arg("offset"))
      .def("close", &AioEngineRef::close,
           "Wait for the requests in flight, stop the threads (idempotent)")
      .def("backend", &AioEngineRef::backend, "io_uring or threads")
      .def("fallback_reason", &AioEngineRef::fallback_reason, "Why not io_uring")
      .def("bytes_read", &AioEngineRef::bytes_read)
      .def("bytes_written", &AioEngineRef::bytes_written);
  m.def("aio_uring_supported", &aio_uring_supported, "(io_uring works here, why not)");
}
