// LayerScratch: the over-capacity path where the pools are device memory (CUDA).
//
// There a scratch row written from the host is a runtime copy, and a copy per chunk of
// scratch_slots experts means a host wait per chunk. Instead one set of rows wide enough
// for every expert of a layer is shared by the MoE layers of one segment layout, beside
// the same number of records of page-locked host staging: an over-capacity call's misses
// land in the staging (read ahead while the previous layer computed, or read now), then
// one copy per segment moves them into the rows while the device is idle (the caller
// synchronised on the ids), and the layer computes its misses in one pass. Layer L's
// rows can be rewritten by layer L + 1's call because that call's ids depend on layer
// L's output: every kernel that read them has run.
//
// Staging is segment-major: segment s of staging row r is at host + rows * offset_s +
// r * nbytes_s, so consecutive rows of a segment are one contiguous copy.
//
// A long prompt's calls (ExpertCache::load_whole) use two of them per layout in turn, each
// holding a whole layer, every expert in the row of its id, so that no ids are read on
// the host: see engine/streamed_layer.py.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "blob_file.h"
#include "mlx/array.h"
#include "pool_writer.h"

namespace es {

namespace mx = mlx::core;

struct LayerScratch {
  // `arrays`: per segment, (rows, *shape) of device memory allocated as the pools are
  // (ExpertCache makes them), the segments at `offsets` with `nbytes` bytes in a record
  // of record_bytes. Allocates the staging and page-locks it with `writer` where that
  // writes CUDA memory. Throws std::bad_alloc when the staging cannot be allocated.
  LayerScratch(std::vector<mx::array> arrays, std::vector<int64_t> offsets,
               std::vector<int64_t> nbytes, int64_t record_bytes, int rows,
               const PoolWriter& writer);
  ~LayerScratch();
  LayerScratch(const LayerScratch&) = delete;
  LayerScratch& operator=(const LayerScratch&) = delete;

  // Staging row r's segments as copies from a record at `record` (host bytes in the
  // blob's layout) into the staging.
  void stage(int r, const uint8_t* record) const;
  // The copies of the staging rows r with staged[r] into the same device rows: per run
  // of consecutive such rows, one span per segment.
  std::vector<Span> upload(const std::vector<uint8_t>& staged) const;
  // Device row r's segments as destinations (sources unset).
  std::vector<Span> row(int r) const;
  // Staging row r's segments as host sources (destinations unset).
  std::vector<Span> staged(int r) const;
  // Bytes of device memory and of host staging (each rows * record_bytes).
  size_t bytes() const { return static_cast<size_t>(rows) * static_cast<size_t>(record_bytes); }

  std::vector<int64_t> offsets, nbytes;  // per segment, in the record
  int64_t record_bytes;
  int rows;
  std::vector<mx::array> arrays;  // per segment: (rows, *shape)
  std::vector<uint8_t*> device;   // their data
  std::unique_ptr<AlignedBuffer> host;
  bool pinned = false;
};

}  // namespace es
