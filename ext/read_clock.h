// ReadClock: the wall time during which at least one record read of a cache is in flight,
// over all of its threads (demand reads, prefetch fills, scratch streams; io_uring and the
// reader pool). Bytes read over this time is the rate "while reading" that a disk's own
// figure (dd) compares with: overlapping reads count once, idle gaps not at all.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>

namespace es {

// Microseconds of wall time from t0 to now.
inline uint64_t micros_since(std::chrono::steady_clock::time_point t0) {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                   std::chrono::steady_clock::now() - t0)
                                   .count());
}

class ReadClock {
 public:
  // One read (or batch of reads) in flight from begin() to its end(); calls pair up.
  void begin() {
    std::lock_guard<std::mutex> lk(mu_);
    if (inflight_++ == 0) since_ = Clock::now();
  }
  void end() {
    std::lock_guard<std::mutex> lk(mu_);
    if (--inflight_ == 0) total_ += Clock::now() - since_;
  }

  // begin() for its lifetime (nothing for a null clock): a record read through the
  // reader pool, or an io_uring batch from its submission to its last completion.
  class Span {
   public:
    explicit Span(ReadClock* clock) : clock_(clock) {
      if (clock_) clock_->begin();
    }
    ~Span() {
      if (clock_) clock_->end();
    }
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;

   private:
    ReadClock* clock_;
  };

  // Inside a Span, the reverse for its lifetime when `on`: a batch's copy of one record
  // into the pool while none of its other reads is in flight is not reading.
  class Pause {
   public:
    Pause(ReadClock* clock, bool on) : clock_(on ? clock : nullptr) {
      if (clock_) clock_->end();
    }
    ~Pause() {
      if (clock_) clock_->begin();
    }
    Pause(const Pause&) = delete;
    Pause& operator=(const Pause&) = delete;

   private:
    ReadClock* clock_;
  };

  // Microseconds with at least one read in flight, the running stretch included.
  uint64_t micros() const {
    std::lock_guard<std::mutex> lk(mu_);
    auto total = total_;
    if (inflight_) total += Clock::now() - since_;
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(total).count());
  }

 private:
  using Clock = std::chrono::steady_clock;

  mutable std::mutex mu_;
  int inflight_ = 0;
  Clock::time_point since_{};
  Clock::duration total_{0};
};

}  // namespace es
