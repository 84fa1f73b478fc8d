#include "ring_reader.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>

#include "errors.h"

namespace es {

namespace {

// A completion's tag: the call (a completion of an earlier call belongs to a given-up
// read), the record's index in the call and the operation.
enum Op : uint64_t { kRead = 0, kDelay = 1, kCancel = 2 };

uint64_t tag(uint32_t call, size_t i, Op op) {
  return (static_cast<uint64_t>(call) << 32) | (static_cast<uint64_t>(i) << 2) | op;
}

enum State { kQueued, kActive, kDone, kFailed, kGivenUp };

struct Item {
  int expert;
  State state = kQueued;
  int attempt = 0;
  Fault fault = Fault::kNone;
  unsigned buf = 0;
  size_t want = 0, got = 0;
  bool reading = false, delaying = false;  // operations in flight
  int read_errno = 0;                      // this attempt's read failed with it
  std::exception_ptr error;
};

}  // namespace

// The reads of one RingReader::read call.
class RingReader::Call {
 public:
  Call(IoRing& ring, const BlobFile& file, const std::vector<int>& experts, bool verify,
       uint32_t id, const std::function<void(size_t, const uint8_t*)>& land, ReadClock* clock)
      : ring_(ring), file_(file), verify_(verify), id_(id), land_(land), clock_(clock) {
    for (int e : experts) items_.push_back(Item{e});
    for (size_t i = 0; i < items_.size(); ++i) queue_.push_back(i);
    for (unsigned b = ring.buffers(); b-- > 0;) free_.push_back(b);
  }

  // Runs the call; returns the operations of given-up reads still outstanding, or -1
  // when io_uring_enter failed (then every unsettled record failed with that error).
  int64_t run(int timeout_ms) {
    using Clock = std::chrono::steady_clock;
    start_queued();
    size_t seen = settled_;
    auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (settled_ < items_.size()) {
      uint64_t t;
      int32_t res;
      while (ring_.pop(&t, &res)) dispatch(t, res);
      if (settled_ == items_.size()) break;
      if (settled_ != seen) {  // progress: a whole timeout again from here
        seen = settled_;
        deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
      }
      int wait_ms = -1;
      if (timeout_ms > 0) {
        const auto left =
            std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
        if (left <= 0) return give_up();
        wait_ms = static_cast<int>(left);
      }
      const int err = ring_.enter(wait_ms);
      if (err != 0 && err != EINTR && err != ETIME && err != EAGAIN && err != EBUSY) {
        for (auto& it : items_) {
          if (it.state != kQueued && it.state != kActive) continue;
          it.state = kFailed;
          it.error = std::make_exception_ptr(ReadError(
              file_.where(it.expert) + ": read failed: io_uring_enter: " + std::strerror(err)));
        }
        return -1;
      }
    }
    return orphans_;
  }

  const std::vector<Item>& items() const { return items_; }

 private:
  void start_queued() {
    while (!free_.empty() && !queue_.empty()) {
      Item& it = items_[queue_.front()];
      it.buf = free_.back();
      it.state = kActive;
      free_.pop_back();
      const size_t i = queue_.front();
      queue_.pop_front();
      begin(i);
    }
  }

  void begin(size_t i) {
    Item& it = items_[i];
    int delay_ms = 0;
    it.fault = file_.take_fault(it.expert, &delay_ms);
    it.got = 0;
    it.read_errno = 0;
    it.want = static_cast<size_t>(file_.stride());
    if (it.fault == Fault::kShortRead) it.want /= 2;
    if (it.fault == Fault::kEIO) {
      failed(i, std::make_exception_ptr(file_.read_failed(it.expert, EIO)));
      return;
    }
    submit_read(i);
    if (it.fault == Fault::kDelay) {
      it.delaying = true;
      ring_.delay(delay_ms, tag(id_, i, kDelay));
    }
  }

  void submit_read(size_t i) {
    Item& it = items_[i];
    it.reading = true;
    ring_.read(it.buf, it.got, file_.fd(), it.want - it.got,
               file_.offset(it.expert) + static_cast<int64_t>(it.got), tag(id_, i, kRead));
  }

  void dispatch(uint64_t t, int32_t res) {
    const size_t i = static_cast<size_t>((t & 0xFFFFFFFFu) >> 2);
    if (t >> 32 != id_ || i >= items_.size() || items_[i].state == kGivenUp) {
      --orphans_;  // an operation of a given-up read, or its cancellation
      return;
    }
    Item& it = items_[i];
    if ((t & 3) == kDelay) {
      it.delaying = false;
      if (!it.reading) finish(i);
      return;
    }
    it.reading = false;
    if (res == -EINTR || res == -EAGAIN) {
      submit_read(i);
      return;
    }
    if (res < 0) {
      it.read_errno = -res;
    } else if (res > 0) {
      it.got += static_cast<size_t>(res);
      // O_DIRECT continues only at aligned offsets; a misaligned short read is an error.
      if (it.got < it.want && !(file_.direct() && it.got % 4096 != 0)) {
        submit_read(i);
        return;
      }
    }  // 0: end of file, never read zeros past it
    if (!it.delaying) finish(i);
  }

  void finish(size_t i) {
    Item& it = items_[i];
    if (it.read_errno) {
      failed(i, std::make_exception_ptr(file_.read_failed(it.expert, it.read_errno)));
      return;
    }
    uint8_t* bytes = ring_.buffer(it.buf);
    try {
      file_.finish_record(it.expert, bytes, it.got, it.fault, verify_);
    } catch (const ReadError&) {
      failed(i, std::current_exception());
      return;
    }
    try {
      const bool alone = std::none_of(items_.begin(), items_.end(),
                                      [](const Item& o) { return o.reading || o.delaying; });
      ReadClock::Pause copying(clock_, alone);
      land_(i, bytes);
    } catch (...) {  // the copy into the pool failed (a device copy): not a read to retry
      it.error = std::current_exception();
      settle(i, kFailed);
      return;
    }
    settle(i, kDone);
  }

  void failed(size_t i, std::exception_ptr e) {
    Item& it = items_[i];
    if (it.attempt++ == 0) {
      begin(i);  // one retry, as BlobFile::read_record
      return;
    }
    it.error = std::move(e);
    settle(i, kFailed);
  }

  void settle(size_t i, State s) {
    items_[i].state = s;
    free_.push_back(items_[i].buf);
    ++settled_;
    start_queued();
  }

  // No record settled for a whole timeout: gives up every unsettled one, asks the kernel
  // to cancel their operations, and counts what is still outstanding.
  int64_t give_up() {
    for (size_t i = 0; i < items_.size(); ++i) {
      Item& it = items_[i];
      if (it.state != kQueued && it.state != kActive) continue;
      it.state = kGivenUp;
      for (auto [busy, op] : {std::pair{it.reading, kRead}, std::pair{it.delaying, kDelay}}) {
        if (!busy) continue;
        ring_.cancel(tag(id_, i, op), tag(id_, i, kCancel));
        orphans_ += 2;  // the operation and its cancellation each complete once
      }
    }
    ring_.enter(0);
    uint64_t t;
    int32_t res;
    while (ring_.pop(&t, &res)) dispatch(t, res);
    return orphans_;
  }

  IoRing& ring_;
  const BlobFile& file_;
  bool verify_;
  uint32_t id_;
  const std::function<void(size_t, const uint8_t*)>& land_;
  ReadClock* clock_;
  std::vector<Item> items_;
  std::deque<size_t> queue_;
  std::vector<unsigned> free_;
  size_t settled_ = 0;
  int64_t orphans_ = 0;
};

std::unique_ptr<RingReader> RingReader::create(unsigned depth, size_t buffer_bytes,
                                               const PoolWriter* writer) {
  std::unique_ptr<RingReader> r(new RingReader(depth, buffer_bytes, writer));
  std::lock_guard<std::mutex> lk(r->mu_);
  if (!r->open_locked()) return nullptr;
  return r;
}

RingReader::~RingReader() {
  std::lock_guard<std::mutex> lk(mu_);
  close_locked(orphans_ > 0 || broken_);
}

bool RingReader::open_locked() {
  ring_ = IoRing::create(depth_, buffer_bytes_);
  if (!ring_) return false;
  pinned_ = writer_ && writer_->pin(ring_->buffer(0), ring_->buffers() * ring_->buffer_bytes());
  return true;
}

void RingReader::close_locked(bool retire) {
  if (!ring_) return;
  if (retire) {
    IoRing::retire(std::move(ring_));  // its buffers stay pinned: they are never freed
  } else {
    if (pinned_) PoolWriter::unpin(ring_->buffer(0));
    ring_.reset();
  }
  pinned_ = false;
}

bool RingReader::ready_locked() {
  if (ring_ && orphans_ > 0 && !broken_) {
    ring_->enter(0);  // lets the kernel post what has completed
    uint64_t t;
    int32_t res;
    while (orphans_ > 0 && ring_->pop(&t, &res)) --orphans_;
  }
  if (orphans_ > 0 || broken_) close_locked(true);
  orphans_ = 0;
  broken_ = false;
  return ring_ || open_locked();
}

bool RingReader::read(const BlobFile& file, const std::vector<int>& experts, bool verify,
                      int timeout_ms, const std::function<void(size_t, const uint8_t*)>& land,
                      std::vector<uint8_t>& landed, std::vector<std::exception_ptr>& errors,
                      ReadClock* clock) {
  std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
  if (!lk.owns_lock() || static_cast<size_t>(file.stride()) > buffer_bytes_ || !ready_locked())
    return false;
  Call call(*ring_, file, experts, verify, ++calls_, land, clock);
  int64_t outstanding;
  {
    ReadClock::Span reading(clock);
    outstanding = call.run(timeout_ms);
  }
  if (outstanding < 0) {
    broken_ = true;
  } else {
    orphans_ = static_cast<uint64_t>(outstanding);
  }
  landed.assign(experts.size(), 0);
  errors.assign(experts.size(), nullptr);
  for (size_t i = 0; i < experts.size(); ++i) {
    landed[i] = call.items()[i].state == kDone;
    errors[i] = call.items()[i].error;
  }
  return true;
}

}  // namespace es
