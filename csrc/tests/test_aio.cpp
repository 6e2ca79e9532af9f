// C++ unit test of the asynchronous I/O engine (csrc/aio.h), on both backends (io_uring where
// io_uring_setup works here): write then read patterns of many sizes and offsets in flight at
// once, misaligned requests refused naming the value, a short read at the end of the file, an
// errno from the kernel (write on a read-only descriptor), four submitting threads, close with
// requests in flight, counters, a forked child's copy. Files go in the directory given as argv[1]
// (default: the current one, a real disk under ctest; /tmp may be tmpfs), O_DIRECT where it is
// taken. Exits non-zero on failure.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "aio.h"

namespace {

std::atomic<int> failures{0};

void expect(bool ok, const std::string& what) {
  if (!ok && ++failures <= 20) std::printf("FAIL %s\n", what.c_str());
}

constexpr size_t MiB = size_t{1} << 20;
constexpr size_t A = zk::kAioAlign;

struct Buf {
  explicit Buf(size_t n) : n(n) {
    void* q = nullptr;
    if (posix_memalign(&q, A, n == 0 ? A : n) != 0) std::abort();
    p = static_cast<unsigned char*>(q);
  }
  ~Buf() { std::free(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  unsigned char* p;
  size_t n;
};

void fill(Buf& b, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < b.n; ++i) {
    x = x * 1664525u + 1013904223u;
    b.p[i] = static_cast<unsigned char>(x >> 24);
  }
}

struct File {
  File(const std::string& path, size_t size) : path(path) {
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0600);
    direct = fd >= 0;
    if (fd < 0) fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
      std::printf("cannot create %s: %s\n", path.c_str(), std::strerror(errno));
      std::exit(1);
    }
  }
  ~File() {
    ::close(fd);
    ::unlink(path.c_str());
  }
  std::string path;
  int fd;
  bool direct;
};

// Requests of one page to 3 MiB + pages (several chunks) at offsets with gaps, all in flight.
void test_patterns(const std::string& dir, const std::string& backend) {
  const std::string tag = "[" + backend + "] ";
  std::vector<size_t> sizes, offsets;
  size_t off = 0;
  for (int i = 0; i < 24; ++i) {
    size_t n = (i % 4 == 0) ? A : (i % 4 == 1) ? MiB + 3 * A : (i % 4 == 2) ? 17 * A : 3 * MiB;
    off += static_cast<size_t>(i % 3) * A;
    sizes.push_back(n);
    offsets.push_back(off);
    off += n;
  }
  File f(dir + "/zk_test_aio_patterns.bin", off);
  zk::AioEngine e(f.fd, 3, 256 * 1024, f.direct, backend);
  expect(e.backend() == backend, tag + "backend is the one asked for");
  std::vector<std::unique_ptr<Buf>> src, dst;
  std::vector<std::shared_ptr<zk::AioRequest>> reqs;
  uint64_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    src.push_back(std::make_unique<Buf>(sizes[i]));
    fill(*src.back(), static_cast<uint32_t>(i));
    reqs.push_back(e.submit(zk::AioOp::kWrite, src.back()->p, sizes[i], offsets[i]));
    total += sizes[i];
  }
  for (auto& r : reqs) {
    r->wait();
    expect(r->done() && r->error() == 0 && r->bytes_done() == r->nbytes(), tag + "write done");
  }
  reqs.clear();
  for (size_t i = 0; i < sizes.size(); ++i) {
    dst.push_back(std::make_unique<Buf>(sizes[i]));
    std::memset(dst.back()->p, 0, sizes[i]);
    reqs.push_back(e.submit(zk::AioOp::kRead, dst.back()->p, sizes[i], offsets[i]));
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    reqs[i]->wait();
    expect(reqs[i]->error() == 0 && reqs[i]->bytes_done() == sizes[i], tag + "read done");
    expect(std::memcmp(src[i]->p, dst[i]->p, sizes[i]) == 0,
           tag + "region " + std::to_string(i) + " reads back what was written");
  }
  expect(e.bytes_written() == total && e.bytes_read() == total, tag + "counters");
  auto empty = e.submit(zk::AioOp::kRead, nullptr, 0, 0);
  expect(empty->done() && empty->bytes_done() == 0, tag + "an empty request is done at once");
}

void test_errors(const std::string& dir, const std::string& backend) {
  const std::string tag = "[" + backend + "] ";
  File f(dir + "/zk_test_aio_errors.bin", 2 * MiB);
  Buf b(2 * MiB);
  fill(b, 7);
  {
    zk::AioEngine e(f.fd, 2, MiB, /*direct=*/true, backend);
    auto refused = [&](void* p, size_t n, uint64_t off, const std::string& want) {
      try {
        e.submit(zk::AioOp::kWrite, p, n, off);
        expect(false, tag + "misaligned request accepted: " + want);
      } catch (const std::invalid_argument& ex) {
        expect(std::string(ex.what()).find(want) != std::string::npos,
               tag + "message names " + want + ": " + ex.what());
      }
    };
    refused(b.p + 1, A, 0, "buf=" + std::to_string(reinterpret_cast<uintptr_t>(b.p + 1)));
    refused(b.p, A, 512, "offset=512 is not a multiple of 4096");
    refused(b.p, 1000, 0, "nbytes=1000 is not a multiple of 4096");
    expect(e.bytes_written() == 0, tag + "nothing written by refused requests");

    // a read running past the end of the file is short, with no errno
    auto w = e.submit(zk::AioOp::kWrite, b.p, 2 * MiB, 0);
    w->wait();
    expect(ftruncate(f.fd, static_cast<off_t>(MiB + A)) == 0, "truncate");
    Buf r(2 * MiB);
    auto s = e.submit(zk::AioOp::kRead, r.p, 2 * MiB, MiB);
    s->wait();
    expect(s->error() == 0 && s->bytes_done() == A,
           tag + "short read: " + std::to_string(s->bytes_done()) + " bytes");
    expect(std::memcmp(r.p, b.p + MiB, A) == 0, tag + "the bytes before the end are read");
    e.close();
    e.close();  // idempotent
    try {
      e.submit(zk::AioOp::kRead, r.p, A, 0);
      expect(false, tag + "submit after close accepted");
    } catch (const std::logic_error&) {
    }
  }
  // an errno from the kernel: writing through a read-only descriptor
  int ro = ::open(f.path.c_str(), O_RDONLY);
  {
    zk::AioEngine e(ro, 2, MiB, false, backend);
    auto w = e.submit(zk::AioOp::kWrite, b.p, 2 * MiB, 0);
    w->wait();
    expect(w->error() == EBADF, tag + "EBADF, got " + std::to_string(w->error()));
    expect(w->bytes_done() == 0, tag + "no bytes on a failed write");
  }
  ::close(ro);
  try {
    zk::AioEngine bad(f.fd, 0, MiB, true, backend);
    expect(false, tag + "queue_depth=0 accepted");
  } catch (const std::invalid_argument& ex) {
    expect(std::string(ex.what()).find("queue_depth") != std::string::npos, tag + "names it");
  }
}

// Four threads submit 40 requests each to disjoint regions; close() with requests in flight
// waits for them.
void test_concurrency(const std::string& dir, const std::string& backend) {
  const std::string tag = "[" + backend + "] ";
  constexpr int kThreads = 4, kPer = 40;
  constexpr size_t kN = 64 * 1024;
  File f(dir + "/zk_test_aio_threads.bin", kThreads * kPer * kN);
  Buf src(kThreads * kPer * kN), dst(kThreads * kPer * kN);
  fill(src, 11);
  std::memset(dst.p, 0, dst.n);
  zk::AioEngine e(f.fd, 4, 16 * 1024, f.direct, backend);
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      for (int i = 0; i < kPer; ++i) {
        size_t at = (static_cast<size_t>(t) * kPer + i) * kN;
        auto w = e.submit(zk::AioOp::kWrite, src.p + at, kN, at);
        w->wait();
        auto r = e.submit(zk::AioOp::kRead, dst.p + at, kN, at);
        r->wait();
        if (r->error() != 0 || r->bytes_done() != kN) failures++;
      }
    });
  }
  for (auto& t : ts) t.join();
  expect(std::memcmp(src.p, dst.p, src.n) == 0, tag + "threads read back what they wrote");
  std::vector<std::shared_ptr<zk::AioRequest>> inflight;
  for (int i = 0; i < 8; ++i) {
    inflight.push_back(e.submit(zk::AioOp::kWrite, src.p, src.n, 0));
  }
  e.close();
  bool all = true;
  for (auto& r : inflight) all = all && r->done() && r->bytes_done() == src.n;
  expect(all, tag + "close waits for the requests in flight");
  expect(e.bytes_written() == 9 * src.n, tag + "written counter");
}

// A forked child that destroys its copy of an engine must not hang (its copy has no threads)
// nor touch the parent's requests; the parent's engine goes on working.
void test_fork(const std::string& dir, const std::string& backend) {
  const std::string tag = "[" + backend + "] ";
  File f(dir + "/zk_test_aio_fork.bin", MiB);
  Buf b(MiB);
  fill(b, 5);
  auto e = std::make_unique<zk::AioEngine>(f.fd, 2, 256 * 1024, f.direct, backend);
  e->submit(zk::AioOp::kWrite, b.p, MiB, 0)->wait();
  pid_t pid = fork();
  if (pid == 0) {
    alarm(10);  // a hang fails the test instead of blocking ctest
    e.reset();
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  expect(WIFEXITED(status) && WEXITSTATUS(status) == 0, tag + "child destroys its engine copy");
  Buf r(MiB);
  e->submit(zk::AioOp::kRead, r.p, MiB, 0)->wait();
  expect(std::memcmp(r.p, b.p, MiB) == 0, tag + "the parent's engine works after the fork");
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : ".";
  std::vector<std::string> backends = {"threads"};
  std::string why;
  if (zk::aio_uring_supported(&why)) {
    backends.push_back("io_uring");
  } else {
    std::printf("io_uring not available here (%s): thread pool only\n", why.c_str());
  }
  {
    zk::AioEngine probe(0, 1, A, false, "auto");
    std::printf("auto picks %s%s%s\n", probe.backend(), probe.fallback_reason().empty() ? "" : ": ",
                probe.fallback_reason().c_str());
    expect(std::string(probe.backend()) == backends.back(), "auto picks io_uring when it works");
  }
  {  // the fallback path of auto, forced: the thread pool, saying why
    setenv("ZERO_KERNELS_IO_URING", "0", 1);
    zk::AioEngine forced(0, 1, A, false, "auto");
    unsetenv("ZERO_KERNELS_IO_URING");
    expect(std::string(forced.backend()) == "threads", "ZERO_KERNELS_IO_URING=0: threads");
    expect(forced.fallback_reason() == "ZERO_KERNELS_IO_URING=0", "the reason is the variable");
    try {
      zk::AioEngine bad(0, 1, A, false, "aio");
      expect(false, "backend='aio' accepted");
    } catch (const std::invalid_argument&) {
    }
  }
  for (const std::string& b : backends) {
    test_patterns(dir, b);
    test_errors(dir, b);
    test_concurrency(dir, b);
    test_fork(dir, b);
  }
  if (failures != 0) {
    std::printf("%d failure(s)\n", failures.load());
    return 1;
  }
  std::printf("aio: all passed (%zu backend(s))\n", backends.size());
  return 0;
}
