// Writes into expert pool memory, wherever the pools live.
//
// MLX's CUDA backend allocates arrays in CUDA managed memory. A host memcpy into a pool
// row the GPU has read migrates the row's pages to the host one fault at a time, and the
// GPU's next read faults them back, which makes both the write and the next kernel that
// reads the rows several times slower. There the writer copies with cudaMemcpyAsync on a
// non-blocking stream of its own and waits for that stream only: the bytes land where
// the pages are, and the kernel is not slowed.
// libcudart is looked up in the process (MLX CUDA has loaded it), never linked, so one
// build serves the CPU backend, CUDA and Metal (unified memory: plain memcpy).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace es {

// One span to copy: `bytes` bytes from `src` (host or pool memory) to `dst` (pool memory).
// `segment`: the index, in its layer's records, of the segment whose row it copies (-1:
// none). Each segment's rows are an array of their own, and two arrays may lie end to end
// in memory, where one device copy may not run from one into the other: copy() merges
// only spans of one segment.
struct Span {
  uint8_t* dst;
  const uint8_t* src;
  size_t bytes;
  int segment = -1;
};

// `spans` with their destinations as sources (destinations unset): rows to copy from.
inline std::vector<Span> as_sources(std::vector<Span> spans) {
  for (auto& s : spans) s = {nullptr, s.dst, s.bytes, s.segment};
  return spans;
}
// Appends the copies from `from`'s sources into `to`'s destinations, span by span (one
// row's segments into another's).
inline void add_copies(std::vector<Span>& copies, const std::vector<Span>& to,
                       const std::vector<Span>& from) {
  for (size_t s = 0; s < to.size(); ++s)
    copies.push_back({to[s].dst, from[s].src, to[s].bytes, to[s].segment});
}

class PoolWriter {
 public:
  // Chooses how to write memory allocated like `probe` (any pool pointer): through the
  // CUDA runtime when `probe` is CUDA managed or device memory, else memcpy.
  explicit PoolWriter(const void* probe);

  // Copies every span (on a device, a run of spans of one segment that continue one
  // another as one copy) and returns once the bytes are visible to every device that
  // reads the pools. Spans must not overlap, and none may read what another writes (they
  // run in any order). Throws std::runtime_error naming the CUDA error when a device copy
  // fails.
  void copy(const std::vector<Span>& spans) const;

  // Sets `bytes` bytes at `dst` to zero, like copy().
  void zero(uint8_t* dst, size_t bytes) const;

  // Page-locks `bytes` of host memory at `p` that copy() will read from, so that a
  // device copy from it is one DMA rather than one staged through the runtime's own
  // buffers. Returns false, doing nothing, on the
  // memcpy path or when the runtime refuses; a true one must be undone with unpin(p)
  // before the memory is freed.
  bool pin(void* p, size_t bytes) const;
  static void unpin(void* p);

  // Page-locks `bytes` of host memory at `p` and maps it for the pools' device: returns
  // the address at which a kernel reads and writes it, or 0, doing nothing, on the memcpy
  // path or when the runtime refuses. Undo a mapping with unpin(p).
  uintptr_t map(void* p, size_t bytes) const;

  // "cuda" or "memcpy": the path copy() takes.
  const char* kind() const { return device_ < 0 ? "memcpy" : "cuda"; }

 private:
  friend class CopyStream;
  int device_ = -1;  // the CUDA device of the pools; -1: host memcpy
};

// Copies a host thread queues on a CUDA stream of their own and never waits for: the
// device's copy engines make them beside the kernels of every other stream, in the order
// queued. Each queue() is a batch, marked by a CUDA event recorded after its copies;
// poll() returns the batches whose marks have passed (cudaEventQuery). Nothing here waits
// for the device but the destructor, so a thread that a spinning kernel waits for may
// queue and poll (the mailbox's: mailbox.h); such a thread's stream captures are made
// relaxed (cudaThreadExchangeStreamCaptureMode), so that a graph another thread
// captures in the global mode does not refuse its calls.
// Where the writer copies with memcpy (host memory: the CPU backend, tests), poll() makes
// the copies of the oldest batch once it has been polled kHostPolls times: it lands a
// while after the call that queued it, as on a device.
class CopyStream {
 public:
  // At most `depth` batches in flight. Throws std::invalid_argument for depth < 1,
  // std::runtime_error naming the CUDA error when the stream or its events cannot be made.
  CopyStream(const PoolWriter& writer, int depth);
  // Waits for the copies queued (they read and write memory that may be freed next).
  ~CopyStream();
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;

  bool full() const { return in_flight_ == static_cast<int>(marks_.size()); }
  int in_flight() const { return in_flight_; }

  // Queues `copies` (host or pool addresses, as for PoolWriter::copy; runs of one
  // segment merged) as the next batch. Throws std::logic_error when full(), or
  // std::runtime_error naming the CUDA error, after which the batch is in flight all the
  // same: it lands, failed, once the copies queued before the failure have run.
  void queue(const std::vector<Span>& copies);
  // The batches landed since the last call, oldest first: for each, empty where every
  // copy ran, else the CUDA error. A batch whose mark could not be recorded lands with
  // the next batch whose mark passes, or once the stream is idle (cudaStreamQuery).
  std::vector<std::string> poll();

 private:
  void release();

  int device_ = -1;
  void* stream_ = nullptr;
  std::vector<void*> marks_;             // a CUDA event per batch in flight, a ring
  std::vector<uint8_t> unmarked_;        // per slot: its mark was not recorded
  std::vector<std::string> errors_;      // per slot: what failed (empty: nothing)
  size_t first_ = 0;                     // the oldest batch's slot
  int in_flight_ = 0;
  std::vector<std::vector<Span>> held_;  // the memcpy path's batches, oldest first
  static constexpr int kHostPolls = 512;
  int polls_ = 0;                        // the memcpy path's polls of the oldest batch
};

// Page-aligned host memory that kernels of the pools' device read and write: mapped for
// that device (PoolWriter::map) where the writer copies through CUDA, else used at its
// host address. Unmapped and freed with it, unless abandoned.
class MappedHost {
 public:
  // `bytes` rounded up to whole pages. Throws std::bad_alloc, or std::runtime_error "the
  // CUDA runtime refused to map <bytes> bytes of host memory for <what>".
  MappedHost(const PoolWriter& writer, size_t bytes, const std::string& what);
  ~MappedHost();
  MappedHost(const MappedHost&) = delete;
  MappedHost& operator=(const MappedHost&) = delete;

  uint8_t* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  uintptr_t device_address() const { return device_address_; }
  bool mapped() const { return mapped_; }
  // Keeps the memory mapped for the rest of the process: a kernel may still use it.
  void abandon() { data_ = nullptr; }

 private:
  uint8_t* data_ = nullptr;
  size_t bytes_ = 0;
  uintptr_t device_address_ = 0;
  bool mapped_ = false;
};

}  // namespace es
