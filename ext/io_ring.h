// IoRing: one io_uring instance, driven by raw system calls (no liburing), and the aligned
// buffers its reads land in; for reads that a thread submits and waits for itself, so a
// batch of reads costs one system call and the only wake-ups are the kernel's.
//
// What it guarantees:
// - create() returns null where the kernel offers no usable io_uring: not Linux, built
//   without <linux/io_uring.h> (or one older than 5.11), io_uring_setup failing (ENOSYS;
//   EPERM from seccomp or /proc/sys/kernel/io_uring_disabled), or a kernel without
//   IORING_FEAT_EXT_ARG (before 5.11; a bounded wait needs it). Callers then read
//   another way.
// - The kernel writes only into the ring's own buffers (buffer(i): buffer_bytes each,
//   4096-aligned, huge-page backed where the kernel allows, registered as fixed buffers
//   where it allows that), never into memory the caller names.
// - An operation that was submitted may complete, and write its buffer, at any time until
//   its completion has been popped. A ring with such operations outstanding that its
//   owner no longer waits for must be handed to retire(): it is then kept, buffers and
//   all, until the process ends, so that a read still in the kernel (a hung disk) never
//   writes freed or reused memory.
// - Not thread-safe: one thread uses a ring at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace es {

class AlignedBuffer;

class IoRing {
 public:
  // A ring of `buffers` read buffers of `buffer_bytes` each (rounded up to 4096), room for
  // 16 operations per buffer in flight (32768 in all at most); null where io_uring is
  // unavailable (see above).
  static std::unique_ptr<IoRing> create(unsigned buffers, size_t buffer_bytes);
  // The bytes of the one buffer region create(buffers, buffer_bytes) allocates.
  static size_t region_bytes(unsigned buffers, size_t buffer_bytes);
  // Keeps `ring` alive until the process ends (see above).
  static void retire(std::unique_ptr<IoRing> ring);
  ~IoRing();
  IoRing(const IoRing&) = delete;
  IoRing& operator=(const IoRing&) = delete;

  unsigned buffers() const { return buffers_; }
  size_t buffer_bytes() const { return buffer_bytes_; }
  uint8_t* buffer(unsigned i) const { return base_ + static_cast<size_t>(i) * buffer_bytes_; }

  // Queue one operation each (sent by the next enter()); `tag` comes back with its
  // completion. read: `len` bytes of `fd` at `offset` into buffer(buf) + at.
  // delay: completes (-ETIME) after `ms`. cancel: asks the kernel to cancel the operation
  // tagged `target` (its own completion: 0, -ENOENT or -EALREADY).
  void read(unsigned buf, size_t at, int fd, size_t len, int64_t offset, uint64_t tag);
  void delay(int ms, uint64_t tag);
  void cancel(uint64_t target, uint64_t tag);

  // Sends the queued operations, then waits until a completion is ready or `wait_ms` has
  // passed (0: no wait; < 0: no limit). Returns 0, or an errno: EINTR, ETIME, EAGAIN or
  // EBUSY (nothing lost: call again) or another (the ring is unusable).
  int enter(int wait_ms);
  // Pops the next completion: its tag and result (bytes, or -errno). False when none.
  bool pop(uint64_t* tag, int32_t* res);

 private:
  IoRing() = default;
  struct Sqe;
  Sqe* next_sqe();

  int fd_ = -1;
  unsigned buffers_ = 0;
  size_t buffer_bytes_ = 0;
  std::unique_ptr<AlignedBuffer> region_;  // the buffers, one after another
  uint8_t* base_ = nullptr;                // region_'s data
  size_t base_bytes_ = 0;
  bool fixed_ = false;  // base_ is registered: reads use IORING_OP_READ_FIXED
  void* sq_map_ = nullptr;
  size_t sq_map_bytes_ = 0;
  void* cq_map_ = nullptr;  // == sq_map_ with IORING_FEAT_SINGLE_MMAP
  size_t cq_map_bytes_ = 0;
  void* sqes_ = nullptr;
  size_t sqes_bytes_ = 0;
  unsigned* sq_head_ = nullptr;
  unsigned* sq_tail_ = nullptr;
  unsigned sq_mask_ = 0;
  unsigned sq_entries_ = 0;
  unsigned* cq_head_ = nullptr;
  unsigned* cq_tail_ = nullptr;
  unsigned cq_mask_ = 0;
  void* cqes_ = nullptr;
  unsigned queued_ = 0;  // operations not yet sent
  // Where delay() keeps each timespec until the kernel reads it (on submission).
  std::unique_ptr<int64_t[]> timespecs_;
  unsigned next_timespec_ = 0;
};

}  // namespace es
