// ScratchStream: the misses of one over-capacity call (a prefill) streamed through the
// scratch rows with the reads of the next chunk in flight while the current one computes.
//
// The layer's scratch rows split into banks: two when there are at least two rows (the
// first ceil(scratch / 2) rows and the rest), else one. Chunk c of the misses (acquire's
// order: most-routed first) takes bank c % banks, as many experts as the bank has rows. A
// thread of the stream's own reads the chunks in order through ExpertCache::load_scratch
// (io_uring or the reader pool, checksums, timeouts, empty real slots filled, counters),
// each once its bank is released; a step whose chunk no read has started yet reads it
// itself instead of waiting for that thread to be scheduled.
//
// scratch_step_op(stream, c, rows, after) is the chunk's place in the lazy graph: when MLX
// evaluates it, `after` (chunk c - 1's output) has been computed, so the bank of chunk
// c - 1 is free: it releases chunk c + banks - 1 (which reuses that bank), waits until
// chunk c has landed and returns `rows` (the chunk's pairs' pool rows) for its compute.
// With two banks the reads of chunk c + 1 overlap chunk c's compute; the host never waits
// on a chunk (the layer's one host sync is its router ids), on any backend: the op runs on
// a CPU stream, which MLX orders with GPU work through its cross-stream events.
//
// A read error of chunk c goes to ExpertCache::set_stream_error (its type kept) for the
// host to raise; the chunk's rows are still scratch rows (valid indices). Reads start at
// the first step only, so a graph built and never evaluated reads nothing (a stream of
// one chunk reads it in its step, with no thread: nothing to read ahead); a stream
// dropped mid-way stops its thread (a read in progress finishes or times out first) and
// no read of it writes a row afterwards.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "expert_cache.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace es {

class ScratchStream {
 public:
  // `experts`: the distinct missing experts of one acquire of MoE layer `layer` (its
  // `missing`, in that order). Throws std::out_of_range for a layer or expert out of range.
  ScratchStream(std::shared_ptr<ExpertCache> cache, int layer, std::vector<int> experts);
  ~ScratchStream();
  ScratchStream(const ScratchStream&) = delete;
  ScratchStream& operator=(const ScratchStream&) = delete;

  const std::shared_ptr<ExpertCache>& cache() const { return cache_; }
  int layer() const { return layer_; }
  int banks() const { return banks_; }
  size_t chunks() const { return experts_.size(); }
  // Chunk c's experts and the pool row each one is read into.
  const std::vector<int>& experts(size_t c) const { return experts_.at(c); }
  const std::vector<int>& rows(size_t c) const { return rows_.at(c); }

  // Releases the chunks up to c + banks - 1 and waits until chunk c has landed; rethrows
  // its read error. Precondition: every computation that reads chunk c - 1's rows has run
  // (the steps run in chunk order). Called on the thread of the stream evaluating it.
  void step(size_t c);

 private:
  void run();             // the reading thread: each released, unclaimed chunk in order
  void read(size_t c);     // reads chunk c (claimed by the caller) after c - 1, marks it landed

  std::shared_ptr<ExpertCache> cache_;
  int layer_;
  int banks_;
  std::vector<std::vector<int>> experts_;
  std::vector<std::vector<int>> rows_;
  std::vector<int> first_;  // per chunk: its bank's first scratch row

  std::mutex mu_;
  std::condition_variable cv_;
  size_t released_ = 0;  // chunks [0, released_) may be read
  size_t claimed_ = 0;   // chunks [0, claimed_) are being or have been read
  std::vector<uint8_t> landed_;  // per chunk: read (or failed: errors_)
  std::vector<std::exception_ptr> errors_;
  bool stopping_ = false;
  std::thread thread_;  // started by the first step that leaves a chunk to read ahead
};

class ScratchStepPrimitive : public mx::Primitive {
 public:
  ScratchStepPrimitive(mx::Stream stream, std::shared_ptr<ScratchStream> scratch, size_t chunk)
      : mx::Primitive(stream), scratch_(std::move(scratch)), chunk_(chunk) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "ExpertScratchStep"; }

 private:
  std::shared_ptr<ScratchStream> scratch_;
  size_t chunk_;
};

// rows: int32 pool rows (any shape) of the pairs chunk `chunk` computes; returned as they
// are once the chunk's experts have landed (see ScratchStream). `after`: the output of
// chunk - 1's compute (required for chunk >= 1, so that its bank is free when the next
// chunk's read starts into it). Throws std::invalid_argument for rows not int32, or a
// missing `after`; std::out_of_range for a chunk out of range.
mx::array scratch_step_op(std::shared_ptr<ScratchStream> scratch, size_t chunk,
                          const mx::array& rows,
                          const std::optional<mx::array>& after = std::nullopt,
                          mx::StreamOrDevice s = {});

}  // namespace es
