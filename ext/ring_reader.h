// RingReader: demand reads of records through io_uring (ext/io_ring.h) on the caller's own
// thread: every read of a call is submitted with one system call and waited for in the
// kernel, with no hand-off to a reader thread (two cross-thread wake-ups per call, about
// as long as a 61 KB read itself on the machine this was measured on).
//
// What it guarantees:
// - The rules of BlobFile::read_record, through the pieces BlobFile shares for them: per
//   record at most two attempts (one retry after a failed read, a short read or a
//   checksum mismatch), injected faults taken per attempt where its reads are issued
//   (kEIO fails without a read, kShortRead asks half of the first span, kCorrupt flips
//   the first byte after the read, kDelay completes only once a timer of delay_ms has
//   also completed), every span of a record (BlobFile::spans: one in a blob, one per
//   segment in place) in flight together, -EINTR and -EAGAIN resubmitted, short reads
//   continued (at 4096-aligned counts under O_DIRECT), the same error texts.
// - Bytes reach the caller only through land(i, bytes), called on the caller's thread,
//   before read() returns, for a record whose read and checksum succeeded; never later.
//   An exception from land fails that record with it (no retry).
// - When no record of a call settles for timeout_ms, every unsettled record of the call
//   is given up: its operations are cancelled, its buffer is never handed out again, and
//   the ring is retired (IoRing::retire) for a new one if they have not completed by the
//   next call. A call never waits longer than that for the kernel.
// - Thread-safe: one call uses the ring at a time; a call that finds it in use, or
//   records larger than its buffers, returns false at once and reads nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "blob_file.h"
#include "read_clock.h"
#include "io_ring.h"
#include "pool_writer.h"

namespace es {

class RingReader {
 public:
  // A reader with `depth` reads in flight at most, of records up to `buffer_bytes`;
  // null where io_uring is unavailable (IoRing::create). Each ring's buffers are pinned
  // for `writer` (PoolWriter::pin: land's copies out of them are then one DMA each on
  // CUDA), and unpinned when a ring is freed; `writer` must outlive the reader.
  static std::unique_ptr<RingReader> create(unsigned depth, size_t buffer_bytes,
                                            const PoolWriter* writer = nullptr);
  // Retires the ring where a given-up read may still be in the kernel.
  ~RingReader();

  // Reads records `experts` of `file` (each in range: BlobFile::check_expert), `depth` at
  // a time; returns false without reading when the ring is in use or the records do not
  // fit its buffers. Otherwise, per record i: landed[i] = 1 once land(i, bytes) was called
  // (stride bytes, valid during the call); else errors[i], its last attempt's ReadError or
  // ChecksumError; else neither: given up after timeout_ms (0: no limit) without any
  // record of the call settling. `clock` (may be null) counts the call's reads from their
  // submission, land's copies made while no other read of the call is in flight aside.
  bool read(const BlobFile& file, const std::vector<int>& experts, bool verify, int timeout_ms,
            const std::function<void(size_t, const uint8_t*)>& land,
            std::vector<uint8_t>& landed, std::vector<std::exception_ptr>& errors,
            ReadClock* clock = nullptr);

 private:
  class Call;
  RingReader(unsigned depth, size_t buffer_bytes, const PoolWriter* writer)
      : depth_(depth), buffer_bytes_(buffer_bytes), writer_(writer) {}
  // Makes ring_ (pinned for writer_); false where io_uring is unavailable.
  bool open_locked();
  // Frees ring_, or keeps it for the process (IoRing::retire, still pinned) when a read
  // may still be in the kernel.
  void close_locked(bool retire);
  // A ring with no operation of an earlier call outstanding (retiring one that has some,
  // making a new one where needed); false where none can be made.
  bool ready_locked();

  std::mutex mu_;
  std::unique_ptr<IoRing> ring_;
  unsigned depth_;
  size_t buffer_bytes_;
  const PoolWriter* writer_;
  bool pinned_ = false;   // ring_'s buffers are page-locked for writer_
  uint32_t calls_ = 0;    // tags each call's completions
  uint64_t orphans_ = 0;  // operations of given-up reads not yet completed
  bool broken_ = false;   // io_uring_enter failed: the ring's state is unknown
};

}  // namespace es
