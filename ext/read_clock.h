// ReadClock: the wall time during which at least one record read of a cache is in flight,
// over all of its threads (demand reads, prefetch fills, scratch streams; io_uring and the
// reader pool). Bytes read over this time is the rate "while reading" that a disk's own
// figure (dd) compares with: overlapping reads count once, idle gaps not at all.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>

namespace es {

class ReadClock {
 public:
  // Marks one read in flight for its lifetime (a record read through the reader pool,
  // or one io_uring batch from its submission to its last completion).
  class Span {
   public:
    explicit Span(ReadClock& clock) : clock_(clock) { clock_.begin(); }
    ~Span() { clock_.end(); }
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;

   private:
    ReadClock& clock_;
  };

  // Microseconds with at least one read in flight, the running stretch included.
  uint64_t micros() const {
    std::lock_guard<std::mutex> lk(mu_);
    return micros_ + (inflight_ ? elapsed_locked() : 0);
  }

 private:
  using Clock = std::chrono::steady_clock;

  void begin() {
    std::lock_guard<std::mutex> lk(mu_);
    if (inflight_++ == 0) since_ = Clock::now();
  }
  void end() {
    std::lock_guard<std::mutex> lk(mu_);
    if (--inflight_ == 0) micros_ += elapsed_locked();
  }
  uint64_t elapsed_locked() const {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - since_).count());
  }

  mutable std::mutex mu_;
  int inflight_ = 0;
  Clock::time_point since_{};
  uint64_t micros_ = 0;
};

}  // namespace es
