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
// read), the record's index in the call, the span of the record (ReadSpan) and the
// operation.
enum Op : uint64_t { kRead = 0, kDelay = 1, kCancel = 2 };
constexpr size_t kMaxSpans = 256;

uint64_t tag(uint32_t call, size_t i, size_t span, Op op) {
  return (static_cast<uint64_t>(call) << 32) | (static_cast<uint64_t>(i) << 10) |
         (static_cast<uint64_t>(span) << 2) | op;
}

enum State { kQueued, kActive, kDone, kFailed, kGivenUp };

struct Item {
  int expert;
  State state = kQueued;
  int attempt = 0;
  Fault fault = Fault::kNone;
  unsigned buf = 0;
  std::vector<ReadSpan> spans;
  std::vector<size_t> asked, got;  // per span: bytes this attempt asks, bytes arrived
  std::vector<uint8_t> reading;    // per span: its read is in flight
  int reads = 0;                   // span reads in flight
  bool delaying = false;           // the fault's delay is in flight
  int read_errno = 0;              // this attempt's read of span errno_span failed with it
  int errno_span = -1;
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
    it.read_errno = 0;
    it.errno_span = -1;
    if (it.fault == Fault::kEIO) {
      failed(i, std::make_exception_ptr(file_.read_failed(it.expert, EIO, 0)));
      return;
    }
    file_.spans(it.expert, &it.spans);
    const size_t n = it.spans.size();
    it.asked.assign(n, 0);
    it.got.assign(n, 0);
    it.reading.assign(n, 0);
    if (it.fault == Fault::kDelay) {
      it.delaying = true;
      ring_.delay(delay_ms, tag(id_, i, 0, kDelay));
    }
    for (size_t j = 0; j < n; ++j) {
      it.asked[j] = BlobFile::asked(it.spans[j], j, it.fault);
      if (it.asked[j] > 0) submit_read(i, j);
    }
    if (it.reads == 0 && !it.delaying) finish(i);  // nothing asked (a short read of one span)
  }

  // The bytes of span j that must arrive (less where the attempt asks for less).
  size_t need(const Item& it, size_t j) const {
    return std::min(it.asked[j], it.spans[j].need());
  }

  void submit_read(size_t i, size_t j) {
    Item& it = items_[i];
    const ReadSpan& sp = it.spans[j];
    it.reading[j] = 1;
    ++it.reads;
    ring_.read(it.buf, sp.at + it.got[j], file_.fd(sp.file), it.asked[j] - it.got[j],
               sp.offset + static_cast<int64_t>(it.got[j]), tag(id_, i, j, kRead));
  }

  void dispatch(uint64_t t, int32_t res) {
    const size_t i = static_cast<size_t>((t & 0xFFFFFFFFu) >> 10);
    const size_t j = static_cast<size_t>((t >> 2) & (kMaxSpans - 1));
    if (t >> 32 != id_ || i >= items_.size() || items_[i].state == kGivenUp) {
      --orphans_;  // an operation of a given-up read, or its cancellation
      return;
    }
    Item& it = items_[i];
    if ((t & 3) == kDelay) {
      it.delaying = false;
      if (it.reads == 0) finish(i);
      return;
    }
    it.reading[j] = 0;
    --it.reads;
    if (res == -EINTR || res == -EAGAIN) {
      submit_read(i, j);
      return;
    }
    if (res < 0) {
      if (!it.read_errno) {
        it.read_errno = -res;
        it.errno_span = static_cast<int>(j);
      }
    } else if (res > 0) {
      it.got[j] += static_cast<size_t>(res);
      // O_DIRECT continues only at aligned offsets; a misaligned short read is an error.
      if (it.got[j] < need(it, j) && !(file_.direct(it.spans[j].file) && it.got[j] % 4096 != 0)) {
        submit_read(i, j);
        return;
      }
    }  // 0: end of file, never read zeros past it
    if (it.reads == 0 && !it.delaying) finish(i);
  }

  void finish(size_t i) {
    Item& it = items_[i];
    if (it.read_errno) {
      failed(i, std::make_exception_ptr(
                    file_.read_failed(it.expert, it.read_errno, it.errno_span)));
      return;
    }
    uint8_t* bytes = ring_.buffer(it.buf);
    size_t arrived = 0;
    for (size_t j = 0; j < it.spans.size(); ++j) arrived += std::min(it.got[j], need(it, j));
    try {
      file_.finish_record(it.expert, bytes, arrived, it.fault, verify_);
    } catch (const ReadError&) {
      failed(i, std::current_exception());
      return;
    }
    try {
      const bool alone = std::none_of(items_.begin(), items_.end(),
                                      [](const Item& o) { return o.reads > 0 || o.delaying; });
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
      // each operation and its cancellation complete once
      for (size_t j = 0; j < it.reading.size(); ++j) {
        if (!it.reading[j]) continue;
        ring_.cancel(tag(id_, i, j, kRead), tag(id_, i, j, kCancel));
        orphans_ += 2;
      }
      if (it.delaying) {
        ring_.cancel(tag(id_, i, 0, kDelay), tag(id_, i, 0, kCancel));
        orphans_ += 2;
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
