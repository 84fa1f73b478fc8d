#include "read_batch.h"

#include <chrono>
#include <cstring>
#include <memory>
#include <string>

#include "errors.h"

namespace es {

void ReadBatch::settle(int timeout_ms, bool give_up) {
  std::unique_lock<std::mutex> lk(mu);
  const size_t n = state.size();
  auto abandon_pending = [&] {
    for (size_t i = 0; i < n; ++i) {
      if (state[i] != kPending) continue;
      state[i] = kAbandoned;
      ++settled;
    }
  };
  if (give_up) abandon_pending();
  const auto timeout = std::chrono::milliseconds(timeout_ms);
  while (settled < n) {
    const size_t before = settled;
    auto progressed = [&] { return settled != before; };
    if (timeout_ms <= 0) {
      cv.wait(lk, progressed);
    } else if (!cv.wait_for(lk, timeout, progressed)) {
      abandon_pending();  // no read finished for a whole timeout; copies in progress end soon
    }
  }
}

std::exception_ptr read_timeout(const BlobFile& file, int expert, int timeout_ms) {
  const std::string limit = timeout_ms % 1000 == 0 ? std::to_string(timeout_ms / 1000) + " s"
                                                   : std::to_string(timeout_ms) + " ms";
  return std::make_exception_ptr(ReadTimeout(file.where(expert) +
                                             ": read timed out (no read finished within " +
                                             limit + "; is the storage responding?)"));
}

uint8_t* bounce_buffer(size_t bytes, const PoolWriter& writer) {
  struct Bounce {
    std::unique_ptr<AlignedBuffer> buf;
    bool pinned = false;
    std::vector<std::unique_ptr<AlignedBuffer>> retired;  // pinned, outgrown while staged
    ~Bounce() {
      if (pinned) PoolWriter::unpin(buf->data());
      for (auto& r : retired) PoolWriter::unpin(r->data());
    }
  };
  thread_local Bounce b;
  if (!b.buf || b.buf->size() < bytes) {
    const bool staged = std::strcmp(writer.kind(), "memcpy") == 0;
    if (b.pinned && staged) {
      b.retired.push_back(std::move(b.buf));
    } else if (b.pinned) {
      PoolWriter::unpin(b.buf->data());
    }
    b.buf = std::make_unique<AlignedBuffer>(bytes);
    b.pinned = writer.pin(b.buf->data(), b.buf->size());
  }
  return b.buf->data();
}

}  // namespace es
