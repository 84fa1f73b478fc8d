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
#include <vector>

namespace es {

// One span to copy: `bytes` bytes from `src` (host or pool memory) to `dst` (pool memory).
struct Span {
  uint8_t* dst;
  const uint8_t* src;
  size_t bytes;
};

class PoolWriter {
 public:
  // Chooses how to write memory allocated like `probe` (any pool pointer): through the
  // CUDA runtime when `probe` is CUDA managed or device memory, else memcpy.
  explicit PoolWriter(const void* probe);

  // Copies every span and returns once the bytes are visible to every device that reads
  // the pools. Spans must not overlap. Throws std::runtime_error naming the CUDA error
  // when a device copy fails.
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
  int device_ = -1;  // the CUDA device of the pools; -1: host memcpy
};

}  // namespace es
