// What the store says of one MoE layer (its blob file and the segments of each record),
// and memory laid out by it: rows of records, one MLX array per segment (the pools and
// the layer scratch are made so).
#pragma once

#include <cstdint>
#include <new>
#include <string>
#include <vector>

#include "mlx/array.h"

namespace es {

namespace mx = mlx::core;

struct Segment {
  std::string key;
  mx::Dtype dtype = mx::uint8;
  mx::Shape shape;  // per expert
  int64_t offset;   // in the record, bytes
  int64_t nbytes;
};

struct LayerSpec {
  int layer;  // decoder layer index, for messages
  std::string path;
  int64_t stride;
  int64_t record_bytes;
  std::vector<Segment> segments;
  std::vector<uint32_t> checksums;
};

// A failed allocation, with what was asked for and why (Python: MemoryError). MLX's
// allocator returns a null buffer instead of throwing, so every allocation is checked
// rather than written through.
struct PoolAllocError : std::bad_alloc {
  explicit PoolAllocError(std::string m) : msg(std::move(m)) {}
  const char* what() const noexcept override { return msg.c_str(); }
  std::string msg;
};

// An uninitialised array of `rows` records' segment `seg` of layer L, (rows, *seg.shape)
// of seg.dtype. Throws PoolAllocError "cannot allocate <bytes> bytes for <path> segment
// <key> (<what>)", std::invalid_argument when the shape and dtype disagree with nbytes.
mx::array segment_rows(const LayerSpec& L, const Segment& seg, int rows,
                       const std::string& what);

// An uninitialised int32 array of `n` values: PoolAllocError naming `what` as above.
mx::array int32_values(int n, const std::string& what);

}  // namespace es
