#include "checksum.h"

#include <pthread.h>
#include <zlib.h>
#ifndef ES_LIBDEFLATE
#define ES_LIBDEFLATE 0  // set by ext/CMakeLists.txt where libdeflate is found
#endif
#if ES_LIBDEFLATE
#include <libdeflate.h>
#endif

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace es {

namespace {

uint32_t crc32_of(const uint8_t* buf, size_t n) {
#if ES_LIBDEFLATE
  return libdeflate_crc32(0, buf, n);
#else
  return static_cast<uint32_t>(::crc32_z(0L, buf, static_cast<z_size_t>(n)));
#endif
}

// One split buffer. Chunks are claimed with `next`, so each runs exactly once, on
// whichever thread claims it; `buf` is read only by a claimed chunk, and the caller
// returns only once every claimed chunk is done, so a helper that takes the job later
// claims nothing and never touches the buffer.
struct Job {
  Job(const uint8_t* b, size_t bytes)
      : buf(b), n(bytes), chunks((bytes + kChunkBytes - 1) / kChunkBytes), crcs(chunks) {}

  void work() {
    for (size_t i; (i = next.fetch_add(1)) < chunks;) {
      const size_t at = i * kChunkBytes;
      crcs[i] = crc32_of(buf + at, std::min(kChunkBytes, n - at));
      std::lock_guard<std::mutex> lk(mu);
      if (++done == chunks) cv.notify_all();
    }
  }

  const uint8_t* buf;
  size_t n;
  size_t chunks;
  std::vector<uint32_t> crcs;  // [i] written by the chunk's thread, read after `done`
  std::atomic<size_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  size_t done = 0;  // guarded by mu
};

// Set in a child forked after the helpers started: fork() copies only the forking
// thread, so the child has no helpers, and a parent thread may have held the pool's lock
// at that instant (a child that took it would wait forever). Such a child checks alone.
std::atomic<bool> forked_child{false};

class Helpers {
 public:
  // Never destroyed: its threads wait for work for the life of the process.
  static Helpers& get() {
    static Helpers* helpers = new Helpers;
    return *helpers;
  }

  size_t count() const { return threads_; }

  // Offers `job` to up to `copies` helpers.
  void post(const std::shared_ptr<Job>& job, size_t copies) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (size_t i = 0; i < copies; ++i) queue_.push_back(job);
    }
    for (size_t i = 0; i < copies; ++i) cv_.notify_one();
  }

 private:
  Helpers() {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    threads_ = std::min<size_t>(cores - 1, 7);
    pthread_atfork(nullptr, nullptr, [] { forked_child = true; });
    for (size_t i = 0; i < threads_; ++i) {
      try {
        std::thread([this] { run(); }).detach();
      } catch (const std::system_error&) {  // no more threads (RLIMIT_NPROC): fewer helpers
        threads_ = i;
        break;
      }
    }
  }

  void run() {
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return !queue_.empty(); });
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      job->work();
    }
  }

  size_t threads_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
};

}  // namespace

const char* crc32_implementation() { return ES_LIBDEFLATE ? "libdeflate" : "zlib"; }

uint32_t record_crc32(const uint8_t* buf, size_t n) {
  if (n < kSplitBytes) return crc32_of(buf, n);
  auto& helpers = Helpers::get();
  if (helpers.count() == 0) return crc32_of(buf, n);
  auto job = std::make_shared<Job>(buf, n);
  if (!forked_child) helpers.post(job, std::min(helpers.count(), job->chunks - 1));
  job->work();
  {
    std::unique_lock<std::mutex> lk(job->mu);
    job->cv.wait(lk, [&] { return job->done == job->chunks; });
  }
  uLong crc = job->crcs[0];
  for (size_t i = 1; i < job->chunks; ++i) {
    const size_t len = std::min(kChunkBytes, n - i * kChunkBytes);
    crc = ::crc32_combine(crc, job->crcs[i], static_cast<z_off_t>(len));
  }
  return static_cast<uint32_t>(crc);
}

}  // namespace es
