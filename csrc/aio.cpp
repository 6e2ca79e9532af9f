// The asynchronous I/O engine (aio.h): a pread/pwrite thread pool, and io_uring through raw
// syscalls (no liburing) where the kernel has it.
#include "aio.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#if defined(__linux__) && __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#if defined(__NR_io_uring_setup) && defined(__NR_io_uring_enter)
#define ZK_AIO_URING 1
#endif
#endif

namespace zk {

// ---------------------------------------------------------------------------------------------
// AioRequest

AioRequest::AioRequest(uint64_t nbytes, int chunks) : nbytes_(nbytes), pending_(chunks) {}

bool AioRequest::done() const {
  std::lock_guard<std::mutex> l(mu_);
  return pending_ == 0;
}

void AioRequest::wait() const {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return pending_ == 0; });
}

int AioRequest::error() const {
  std::lock_guard<std::mutex> l(mu_);
  return err_;
}

uint64_t AioRequest::bytes_done() const {
  std::lock_guard<std::mutex> l(mu_);
  return bytes_;
}

void AioRequest::complete_chunk(int err, uint64_t bytes) {
  std::lock_guard<std::mutex> l(mu_);
  if (err_ == 0) err_ = err;
  bytes_ += bytes;
  if (--pending_ == 0) cv_.notify_all();
}

// ---------------------------------------------------------------------------------------------
// Backends

struct AioChunk {
  std::shared_ptr<AioRequest> req;
  AioOp op = AioOp::kRead;
  char* buf = nullptr;
  size_t n = 0;
  uint64_t off = 0;
  size_t done = 0;  // bytes moved so far (a partial transfer continues from here)
};

class AioBackend {
 public:
  virtual ~AioBackend() = default;
  virtual void enqueue(AioChunk c) = 0;
  virtual void drain_and_stop() = 0;  // every chunk enqueued completes, then threads end
  virtual const char* name() const = 0;

  std::atomic<uint64_t> read{0};
  std::atomic<uint64_t> written{0};

 protected:
  // Counters first, so that a waiter that returns sees them.
  void finish(AioChunk& c, int err) {
    (c.op == AioOp::kRead ? read : written).fetch_add(c.done, std::memory_order_relaxed);
    c.req->complete_chunk(err, c.done);
    c.req.reset();
  }
};

namespace {

class ThreadPoolBackend final : public AioBackend {
 public:
  ThreadPoolBackend(int fd, int threads) : fd_(fd) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { run(); });
  }
  ~ThreadPoolBackend() override { drain_and_stop(); }

  void enqueue(AioChunk c) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      q_.push_back(std::move(c));
    }
    cv_.notify_one();
  }

  void drain_and_stop() override {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : workers_) {
      if (t.joinable()) t.join();
    }
  }

  const char* name() const override { return "threads"; }

 private:
  void run() {
    for (;;) {
      AioChunk c;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return stop_ || !q_.empty(); });
        if (q_.empty()) return;  // stopped and drained
        c = std::move(q_.front());
        q_.pop_front();
      }
      int err = 0;
      while (c.done < c.n) {
        char* p = c.buf + c.done;
        size_t left = c.n - c.done;
        off_t at = static_cast<off_t>(c.off + c.done);
        ssize_t k = c.op == AioOp::kRead ? ::pread(fd_, p, left, at) : ::pwrite(fd_, p, left, at);
        if (k < 0) {
          if (errno == EINTR) continue;
          err = errno;
          break;
        }
        if (k == 0) break;  // end of file: a short transfer
        c.done += static_cast<size_t>(k);
      }
      finish(c, err);
    }
  }

  int fd_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<AioChunk> q_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

#ifdef ZK_AIO_URING

int uring_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}

int uring_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(
      syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, size_t{0}));
}

std::string errno_text(const char* what, int e) {
  return std::string(what) + " failed: " + std::strerror(e) + " (errno " + std::to_string(e) + ")";
}

// One ring per engine. Submitters fill SQEs under mu_ and enter them; the reaper thread waits
// for completions, finishes chunks or resubmits the rest of a partial transfer, and moves
// waiting chunks onto the ring as slots free up. At most depth_ chunks are on the ring, and the
// completion ring has twice the submission ring's entries, so it cannot overflow.
class UringBackend final : public AioBackend {
 public:
  UringBackend(int fd, unsigned depth) : fd_(fd), depth_(depth) {
    io_uring_params p;
    std::memset(&p, 0, sizeof(p));
    ring_fd_ = uring_setup(depth, &p);
    if (ring_fd_ < 0) throw std::runtime_error(errno_text("io_uring_setup", errno));
    if (!(p.features & IORING_FEAT_RW_CUR_POS)) {  // came with IORING_OP_READ/WRITE (5.6)
      ::close(ring_fd_);
      throw std::runtime_error("io_uring without IORING_OP_READ/WRITE (Linux < 5.6)");
    }
    sq_sz_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_sz_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    single_ = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single_) sq_sz_ = cq_sz_ = std::max(sq_sz_, cq_sz_);
    sqes_sz_ = p.sq_entries * sizeof(io_uring_sqe);
    sq_ = map(sq_sz_, IORING_OFF_SQ_RING);
    cq_ = single_ ? sq_ : map(cq_sz_, IORING_OFF_CQ_RING);
    sqes_ = static_cast<io_uring_sqe*>(map(sqes_sz_, IORING_OFF_SQES));
    if (sq_ == nullptr || cq_ == nullptr || sqes_ == nullptr) {
      int e = errno;
      unmap();
      throw std::runtime_error(errno_text("mmap of the io_uring rings", e));
    }
    char* sq = static_cast<char*>(sq_);
    char* cq = static_cast<char*>(cq_);
    sq_tail_ = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
    sq_mask_ = *reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
    sq_array_ = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
    cq_head_ = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
    cq_tail_ = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
    cq_mask_ = *reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
    reaper_ = std::thread([this] { reap(); });
  }

  ~UringBackend() override {
    drain_and_stop();
    unmap();
  }

  void enqueue(AioChunk c) override {
    std::vector<std::pair<AioChunk*, int>> failed;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (inflight_ < depth_) {
        push_sqe(new AioChunk(std::move(c)));
        submit_locked(&failed);
      } else {
        waiting_.push_back(std::move(c));
      }
    }
    cv_.notify_one();
    finish_all(failed);
  }

  void drain_and_stop() override {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (reaper_.joinable()) reaper_.join();
  }

  const char* name() const override { return "io_uring"; }

 private:
  void* map(size_t n, uint64_t what) {
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring_fd_,
                   static_cast<off_t>(what));
    return p == MAP_FAILED ? nullptr : p;
  }

  void unmap() {
    if (sqes_ != nullptr) munmap(sqes_, sqes_sz_);
    if (cq_ != nullptr && !single_) munmap(cq_, cq_sz_);
    if (sq_ != nullptr) munmap(sq_, sq_sz_);
    sqes_ = nullptr;
    sq_ = cq_ = nullptr;
    if (ring_fd_ >= 0) ::close(ring_fd_);
    ring_fd_ = -1;
  }

  // mu_ held. The ring has room: inflight_ < depth_ <= sq_entries, and the kernel consumes every
  // entered SQE at once (no SQ polling).
  void push_sqe(AioChunk* c) {
    unsigned tail = *sq_tail_;  // only we write it
    unsigned idx = tail & sq_mask_;
    io_uring_sqe* s = &sqes_[idx];
    std::memset(s, 0, sizeof(*s));
    s->opcode = c->op == AioOp::kRead ? IORING_OP_READ : IORING_OP_WRITE;
    s->fd = fd_;
    s->off = c->off + c->done;
    s->addr = reinterpret_cast<uint64_t>(c->buf + c->done);
    s->len = static_cast<unsigned>(c->n - c->done);
    s->user_data = reinterpret_cast<uint64_t>(c);
    sq_array_[idx] = idx;
    __atomic_store_n(sq_tail_, tail + 1, __ATOMIC_RELEASE);
    ++inflight_;
    ++unsubmitted_;
  }

  // mu_ held. Enters the SQEs not yet entered. Should io_uring_enter fail for another reason
  // than a transient one, the SQEs it did not take are taken back from the ring (the kernel
  // reads them only inside io_uring_enter) and their chunks go to ``failed`` with its errno.
  void submit_locked(std::vector<std::pair<AioChunk*, int>>* failed) {
    while (unsubmitted_ > 0) {
      int r = uring_enter(ring_fd_, unsubmitted_, 0, 0);
      if (r >= 0) {
        unsubmitted_ -= static_cast<unsigned>(r);
        continue;
      }
      const int e = errno;
      if (e == EINTR || e == EAGAIN || e == EBUSY) {
        std::this_thread::yield();
        continue;
      }
      unsigned tail = *sq_tail_;
      for (unsigned k = unsubmitted_; k > 0; --k) {
        const io_uring_sqe& q = sqes_[(tail - k) & sq_mask_];
        failed->emplace_back(reinterpret_cast<AioChunk*>(q.user_data), e);
      }
      __atomic_store_n(sq_tail_, tail - unsubmitted_, __ATOMIC_RELEASE);
      inflight_ -= unsubmitted_;
      unsubmitted_ = 0;
    }
  }

  void finish_all(std::vector<std::pair<AioChunk*, int>>& chunks) {
    for (auto& [c, err] : chunks) {  // outside mu_: waiters wake at once
      finish(*c, err);
      delete c;
    }
    chunks.clear();
  }

  void reap() {
    std::vector<std::pair<AioChunk*, int>> got;
    std::vector<std::pair<AioChunk*, int>> done;
    for (;;) {
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return stop_ || inflight_ > 0; });
        if (inflight_ == 0) return;  // stopped, nothing on the ring (waiting_ is then empty)
      }
      int r = uring_enter(ring_fd_, 0, 1, IORING_ENTER_GETEVENTS);
      if (r < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));  // unexpected: poll
      }
      got.clear();
      unsigned head = *cq_head_;
      unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
      for (; head != tail; ++head) {
        const io_uring_cqe& e = cqes_[head & cq_mask_];
        got.emplace_back(reinterpret_cast<AioChunk*>(e.user_data), e.res);
      }
      __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
      if (got.empty()) continue;
      {
        std::lock_guard<std::mutex> l(mu_);
        for (auto& [c, res] : got) {
          --inflight_;
          if (res == -EINTR || res == -EAGAIN) {
            push_sqe(c);  // again, as it was
          } else if (res > 0 && c->done + static_cast<size_t>(res) < c->n) {
            c->done += static_cast<size_t>(res);
            push_sqe(c);  // the rest of a partial transfer
          } else {
            if (res > 0) c->done += static_cast<size_t>(res);
            done.emplace_back(c, res < 0 ? -res : 0);  // res == 0: end of file, short
          }
        }
        // refill; a failed submit lowers inflight_ again: go on until waiting_ is empty or the
        // ring full (so that waiting_ is empty whenever inflight_ < depth_)
        do {
          while (inflight_ < depth_ && !waiting_.empty()) {
            push_sqe(new AioChunk(std::move(waiting_.front())));
            waiting_.pop_front();
          }
          submit_locked(&done);
        } while (inflight_ < depth_ && !waiting_.empty());
      }
      finish_all(done);
    }
  }

  int fd_;
  unsigned depth_;
  int ring_fd_ = -1;
  bool single_ = false;
  void* sq_ = nullptr;
  void* cq_ = nullptr;
  io_uring_sqe* sqes_ = nullptr;
  size_t sq_sz_ = 0, cq_sz_ = 0, sqes_sz_ = 0;
  unsigned* sq_tail_ = nullptr;
  unsigned* sq_array_ = nullptr;
  unsigned sq_mask_ = 0;
  unsigned* cq_head_ = nullptr;
  unsigned* cq_tail_ = nullptr;
  unsigned cq_mask_ = 0;
  io_uring_cqe* cqes_ = nullptr;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<AioChunk> waiting_;
  unsigned inflight_ = 0;
  unsigned unsubmitted_ = 0;
  bool stop_ = false;
  std::thread reaper_;
};

#endif  // ZK_AIO_URING

}  // namespace

bool aio_uring_supported(std::string* why) {
#ifdef ZK_AIO_URING
  try {
    UringBackend probe(-1, 1);
    return true;
  } catch (const std::runtime_error& e) {
    if (why != nullptr) *why = e.what();
    return false;
  }
#else
  if (why != nullptr) *why = "built without <linux/io_uring.h>";
  return false;
#endif
}

// ---------------------------------------------------------------------------------------------
// AioEngine

AioEngine::AioEngine(int fd, int queue_depth, size_t chunk_bytes, bool direct,
                     const std::string& backend)
    : fd_(fd), pid_(static_cast<int>(::getpid())), chunk_(chunk_bytes), direct_(direct) {
  if (fd < 0) throw std::invalid_argument("fd must be >= 0, got " + std::to_string(fd));
  if (queue_depth < 1 || queue_depth > 4096) {
    throw std::invalid_argument("queue_depth must be in [1, 4096], got " +
                                std::to_string(queue_depth));
  }
  if (chunk_bytes == 0 || chunk_bytes > (size_t{1} << 30) ||
      (direct && chunk_bytes % kAioAlign != 0)) {
    throw std::invalid_argument(
        "chunk_bytes must be in (0, 1 GiB], a multiple of 4096 with "
        "O_DIRECT, got " +
        std::to_string(chunk_bytes));
  }
  if (backend != "auto" && backend != "io_uring" && backend != "threads") {
    throw std::invalid_argument("backend must be auto, io_uring or threads, got " + backend);
  }
  const char* env = std::getenv("ZERO_KERNELS_IO_URING");
  if (backend == "threads") {
    reason_ = "backend='threads' requested";
  } else if (backend == "auto" && env != nullptr && std::string(env) == "0") {
    reason_ = "ZERO_KERNELS_IO_URING=0";
  } else {
#ifdef ZK_AIO_URING
    try {
      impl_ = std::make_unique<UringBackend>(fd, static_cast<unsigned>(queue_depth));
    } catch (const std::runtime_error& e) {
      if (backend == "io_uring") throw;
      reason_ = e.what();
    }
#else
    reason_ = "built without <linux/io_uring.h>";
    if (backend == "io_uring") throw std::runtime_error(reason_);
#endif
  }
  if (impl_ == nullptr) impl_ = std::make_unique<ThreadPoolBackend>(fd, queue_depth);
}

AioEngine::~AioEngine() { close(); }

std::shared_ptr<AioRequest> AioEngine::submit(AioOp op, void* buf, size_t nbytes, uint64_t offset) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(buf);
  if (buf == nullptr && nbytes > 0) throw std::invalid_argument("buf is null");
  if (offset > static_cast<uint64_t>(INT64_MAX) - nbytes) {
    throw std::invalid_argument("offset=" + std::to_string(offset) +
                                " + nbytes=" + std::to_string(nbytes) + " overflows off_t");
  }
  if (direct_) {
    const char* name = nullptr;
    uint64_t v = 0;
    if (addr % kAioAlign != 0) {
      name = "buf";
      v = addr;
    } else if (offset % kAioAlign != 0) {
      name = "offset";
      v = offset;
    } else if (nbytes % kAioAlign != 0) {
      name = "nbytes";
      v = nbytes;
    }
    if (name != nullptr) {
      throw std::invalid_argument(std::string("O_DIRECT request: ") + name + "=" +
                                  std::to_string(v) + " is not a multiple of 4096");
    }
  }
  std::lock_guard<std::mutex> l(mu_);
  if (closed_) throw std::logic_error("submit on a closed AioEngine");
  const size_t chunks = (nbytes + chunk_ - 1) / chunk_;
  auto req = std::make_shared<AioRequest>(nbytes, static_cast<int>(chunks));
  for (size_t i = 0; i < chunks; ++i) {
    AioChunk c;
    c.req = req;
    c.op = op;
    c.buf = static_cast<char*>(buf) + i * chunk_;
    c.n = std::min(chunk_, nbytes - i * chunk_);
    c.off = offset + i * chunk_;
    impl_->enqueue(std::move(c));
  }
  return req;
}

void AioEngine::close() {
  std::lock_guard<std::mutex> l(mu_);
  if (closed_) return;
  closed_ = true;
  if (static_cast<int>(::getpid()) != pid_) {
    (void)impl_.release();  // a forked child: the threads are the parent's (never joined here)
    return;
  }
  impl_->drain_and_stop();
}

const char* AioEngine::backend() const { return impl_ ? impl_->name() : "closed in a child"; }
uint64_t AioEngine::bytes_read() const { return impl_ ? impl_->read.load() : 0; }
uint64_t AioEngine::bytes_written() const { return impl_ ? impl_->written.load() : 0; }

}  // namespace zk
