// Asynchronous file I/O for the NVMe tier (zero_kernels.offload.aio, [Note: aio engine]).
// Torch-free.
//
// An engine works on one open file descriptor: a request (read or write of ``nbytes`` at
// ``offset`` to or from a caller's buffer) is split into chunks of ``chunk_bytes`` that run in
// parallel, at most ``queue_depth`` at once, on one of two backends:
//
//   io_uring  the kernel's ring (raw syscalls, no liburing): chunks are queued on the submission
//             ring by the submitting thread, one reaper thread takes completions, resubmits the
//             rest of a partial transfer and feeds waiting chunks as slots free up;
//   threads   ``queue_depth`` worker threads doing pread/pwrite, each until its chunk is done.
//
// "auto" takes io_uring when io_uring_setup works (Linux >= 5.6; containers often refuse it with
// ENOSYS or EPERM) and the thread pool otherwise, or when ZERO_KERNELS_IO_URING=0 is set;
// fallback_reason() says why. With ``direct``
// (an O_DIRECT descriptor) the buffer address, the offset and the length must be multiples of
// kAioAlign, checked at submit. A request completes with the first errno of its chunks (0 if
// none) and the bytes moved: fewer than asked with no errno is a short transfer (end of file).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace zk {

constexpr size_t kAioAlign = 4096;

enum class AioOp { kRead, kWrite };

// The completion of one request, shared by its chunks and the caller.
class AioRequest {
 public:
  AioRequest(uint64_t nbytes, int chunks);
  bool done() const;
  void wait() const;            // blocks until every chunk has completed
  int error() const;            // first errno of a failed chunk, 0 if none (after wait)
  uint64_t bytes_done() const;  // bytes moved (after wait)
  uint64_t nbytes() const { return nbytes_; }

  void complete_chunk(int err, uint64_t bytes);  // engine side

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  const uint64_t nbytes_;
  int pending_;
  int err_ = 0;
  uint64_t bytes_ = 0;
};

// Whether io_uring_setup works here; if not, ``why`` (when given) says what failed.
bool aio_uring_supported(std::string* why);

class AioBackend;

class AioEngine {
 public:
  // ``fd`` stays the caller's (closed by it after close()). backend: "auto", "io_uring",
  // "threads"; an explicit "io_uring" that cannot start throws std::runtime_error.
  AioEngine(int fd, int queue_depth, size_t chunk_bytes, bool direct, const std::string& backend);
  ~AioEngine();
  AioEngine(const AioEngine&) = delete;
  AioEngine& operator=(const AioEngine&) = delete;

  // Starts a request; std::invalid_argument naming the value for a bad one (misaligned with
  // ``direct``, null buffer), std::logic_error after close(). The buffer must stay valid until
  // the request is done.
  std::shared_ptr<AioRequest> submit(AioOp op, void* buf, size_t nbytes, uint64_t offset);

  // Waits for every request in flight, then stops the backend's threads. Idempotent. In a
  // forked child (whose copy has no threads) it only marks the engine closed and leaks the
  // backend: joining the parent's threads there would never return.
  void close();

  const char* backend() const;                                    // "io_uring" or "threads"
  const std::string& fallback_reason() const { return reason_; }  // why not io_uring ("" if it)
  uint64_t bytes_read() const;
  uint64_t bytes_written() const;

 private:
  std::mutex mu_;  // close() against submit()
  int fd_;
  int pid_;  // the process that made the engine (fork: see close)
  size_t chunk_;
  bool direct_;
  bool closed_ = false;
  std::string reason_;
  std::unique_ptr<AioBackend> impl_;
};

}  // namespace zk
