#include "io_ring.h"

#include <algorithm>
#include <mutex>
#include <vector>

#include "blob_file.h"

#if defined(__linux__) && defined(__has_include)
#if __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#if defined(IORING_ENTER_EXT_ARG) && defined(IORING_FEAT_EXT_ARG)
#define ES_IO_URING 1
#endif
#endif
#endif

#if defined(ES_IO_URING)
#include <linux/time_types.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#endif

namespace es {

namespace {

// A buffer's bytes: whole 4 KiB pages (O_DIRECT).
size_t rounded_buffer(size_t buffer_bytes) { return (buffer_bytes + 4095) / 4096 * 4096; }

// The region asked for: every buffer, and at least 2 MiB, so that it is huge-page backed
// (uncached reads into 4 KiB pages pin every page, and run far slower).
size_t region_request(unsigned buffers, size_t buffer_bytes) {
  return std::max(rounded_buffer(buffer_bytes) * buffers, size_t{2} << 20);
}

}  // namespace

size_t IoRing::region_bytes(unsigned buffers, size_t buffer_bytes) {
  return AlignedBuffer::allocated_bytes(region_request(buffers, buffer_bytes));
}

void IoRing::retire(std::unique_ptr<IoRing> ring) {
  // Never destroyed, not even at exit: reachable, so no leak checker reports it either.
  static auto* retired = new std::vector<std::unique_ptr<IoRing>>;
  static std::mutex mu;
  std::lock_guard<std::mutex> lk(mu);
  retired->push_back(std::move(ring));
}

#if defined(ES_IO_URING)

struct IoRing::Sqe : io_uring_sqe {};

namespace {

int sys_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(::syscall(__NR_io_uring_setup, entries, p));
}

int sys_enter(int fd, unsigned submit, unsigned min_complete, unsigned flags, void* arg,
              size_t argsz) {
  return static_cast<int>(::syscall(__NR_io_uring_enter, fd, submit, min_complete, flags, arg,
                                    argsz));
}

void* map(int fd, size_t bytes, off_t what) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, what);
  return p == MAP_FAILED ? nullptr : p;
}

template <class T>
T* at(void* base, unsigned offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

}  // namespace

std::unique_ptr<IoRing> IoRing::create(unsigned buffers, size_t buffer_bytes) {
  if (buffers == 0 || buffer_bytes == 0) return nullptr;
  std::unique_ptr<IoRing> r(new IoRing());
  io_uring_params p{};
  // A record's reads (one per segment in place), a fault's delay and their cancels per
  // buffer mostly fit without a flush (next_sqe sends the queue when it is full).
  r->fd_ = sys_setup(std::min(16 * buffers, 32768u), &p);
  if (r->fd_ < 0) return nullptr;  // ENOSYS, EPERM (seccomp, io_uring_disabled), ...
  if (!(p.features & IORING_FEAT_EXT_ARG)) return nullptr;
  r->sq_map_bytes_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
  r->cq_map_bytes_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
  const bool single = p.features & IORING_FEAT_SINGLE_MMAP;
  if (single) r->sq_map_bytes_ = r->cq_map_bytes_ = std::max(r->sq_map_bytes_, r->cq_map_bytes_);
  r->sq_map_ = map(r->fd_, r->sq_map_bytes_, IORING_OFF_SQ_RING);
  if (!r->sq_map_) return nullptr;
  r->cq_map_ = single ? r->sq_map_ : map(r->fd_, r->cq_map_bytes_, IORING_OFF_CQ_RING);
  if (!r->cq_map_) return nullptr;
  r->sqes_bytes_ = p.sq_entries * sizeof(io_uring_sqe);
  r->sqes_ = map(r->fd_, r->sqes_bytes_, IORING_OFF_SQES);
  if (!r->sqes_) return nullptr;
  r->sq_head_ = at<unsigned>(r->sq_map_, p.sq_off.head);
  r->sq_tail_ = at<unsigned>(r->sq_map_, p.sq_off.tail);
  r->sq_mask_ = *at<unsigned>(r->sq_map_, p.sq_off.ring_mask);
  r->sq_entries_ = p.sq_entries;
  unsigned* array = at<unsigned>(r->sq_map_, p.sq_off.array);
  for (unsigned i = 0; i < p.sq_entries; ++i) array[i] = i;  // slot i holds sqe i
  r->cq_head_ = at<unsigned>(r->cq_map_, p.cq_off.head);
  r->cq_tail_ = at<unsigned>(r->cq_map_, p.cq_off.tail);
  r->cq_mask_ = *at<unsigned>(r->cq_map_, p.cq_off.ring_mask);
  r->cqes_ = at<void>(r->cq_map_, p.cq_off.cqes);
  r->timespecs_.reset(new int64_t[2 * static_cast<size_t>(p.sq_entries)]());

  // One allocation for all buffers (region_request).
  r->buffers_ = buffers;
  r->buffer_bytes_ = rounded_buffer(buffer_bytes);
  r->base_bytes_ = region_request(buffers, buffer_bytes);
  r->region_ = std::make_unique<AlignedBuffer>(r->base_bytes_);
  r->base_ = r->region_->data();
  // Registered buffers spare each read the pinning of its pages; refused (RLIMIT_MEMLOCK
  // on kernels before 5.12, or a region over 1 GiB), reads pass the address instead.
  iovec iov{r->base_, r->base_bytes_};
  r->fixed_ = ::syscall(__NR_io_uring_register, r->fd_, IORING_REGISTER_BUFFERS, &iov, 1) == 0;
  return r;
}

IoRing::~IoRing() {
  // Closing the ring first: the kernel cancels and waits for what is left before the
  // mappings and buffers go (an owner never destroys a ring with reads outstanding).
  if (fd_ >= 0) ::close(fd_);
  if (sqes_) ::munmap(sqes_, sqes_bytes_);
  if (cq_map_ && cq_map_ != sq_map_) ::munmap(cq_map_, cq_map_bytes_);
  if (sq_map_) ::munmap(sq_map_, sq_map_bytes_);
}

IoRing::Sqe* IoRing::next_sqe() {
  const unsigned head = __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE);
  unsigned tail = *sq_tail_;
  if (tail - head >= sq_entries_) {  // full: send what is queued first
    enter(0);
    tail = *sq_tail_;
  }
  auto* sqe = static_cast<Sqe*>(sqes_) + (tail & sq_mask_);
  std::memset(sqe, 0, sizeof(io_uring_sqe));
  __atomic_store_n(sq_tail_, tail + 1, __ATOMIC_RELEASE);
  ++queued_;
  return sqe;
}

void IoRing::read(unsigned buf, size_t at_byte, int fd, size_t len, int64_t offset,
                  uint64_t tag) {
  Sqe* s = next_sqe();
  s->opcode = fixed_ ? IORING_OP_READ_FIXED : IORING_OP_READ;
  s->fd = fd;
  s->addr = reinterpret_cast<uint64_t>(buffer(buf) + at_byte);
  s->len = static_cast<uint32_t>(len);
  s->off = static_cast<uint64_t>(offset);
  s->buf_index = 0;
  s->user_data = tag;
}

void IoRing::delay(int ms, uint64_t tag) {
  Sqe* s = next_sqe();
  // The kernel reads the timespec when the operation is sent: keep it in a slot of its
  // own until then (the sqe's slot is not reused before that either).
  auto* ts = reinterpret_cast<__kernel_timespec*>(&timespecs_[2 * (s - static_cast<Sqe*>(sqes_))]);
  ts->tv_sec = ms / 1000;
  ts->tv_nsec = static_cast<long long>(ms % 1000) * 1000000;
  s->opcode = IORING_OP_TIMEOUT;
  s->addr = reinterpret_cast<uint64_t>(ts);
  s->len = 1;
  s->off = 0;  // a pure timer: no completion count
  s->user_data = tag;
}

void IoRing::cancel(uint64_t target, uint64_t tag) {
  Sqe* s = next_sqe();
  s->opcode = IORING_OP_ASYNC_CANCEL;
  s->addr = target;
  s->user_data = tag;
}

int IoRing::enter(int wait_ms) {
  __kernel_timespec ts{};
  io_uring_getevents_arg arg{};
  arg.sigmask = 0;
  arg.sigmask_sz = _NSIG / 8;
  unsigned flags = 0, min_complete = 0;
  if (wait_ms != 0) {
    flags = IORING_ENTER_GETEVENTS | IORING_ENTER_EXT_ARG;
    min_complete = 1;
    if (wait_ms > 0) {
      ts.tv_sec = wait_ms / 1000;
      ts.tv_nsec = static_cast<long long>(wait_ms % 1000) * 1000000;
      arg.ts = reinterpret_cast<uint64_t>(&ts);
    }
  }
  const int n = sys_enter(fd_, queued_, min_complete, flags, wait_ms != 0 ? &arg : nullptr,
                          wait_ms != 0 ? sizeof(arg) : 0);
  if (n < 0) return errno;
  queued_ -= std::min(queued_, static_cast<unsigned>(n));
  return 0;
}

bool IoRing::pop(uint64_t* tag, int32_t* res) {
  const unsigned head = *cq_head_;
  if (head == __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE)) return false;
  const auto* cqe = static_cast<const io_uring_cqe*>(cqes_) + (head & cq_mask_);
  *tag = cqe->user_data;
  *res = cqe->res;
  __atomic_store_n(cq_head_, head + 1, __ATOMIC_RELEASE);
  return true;
}

#else  // no io_uring: create() says so, and nothing else is ever called

struct IoRing::Sqe {};
std::unique_ptr<IoRing> IoRing::create(unsigned, size_t) { return nullptr; }
IoRing::~IoRing() = default;
IoRing::Sqe* IoRing::next_sqe() { return nullptr; }
void IoRing::read(unsigned, size_t, int, size_t, int64_t, uint64_t) {}
void IoRing::delay(int, uint64_t) {}
void IoRing::cancel(uint64_t, uint64_t) {}
int IoRing::enter(int) { return 38; }  // ENOSYS
bool IoRing::pop(uint64_t*, int32_t*) { return false; }

#endif

}  // namespace es
