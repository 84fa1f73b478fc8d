// LayerScratch: the over-capacity path where the pools are device memory (CUDA), a
// collaborator that ExpertCache owns (as it owns its real and side regions) and that
// reads with the cache's files, reader threads and writers.
//
// There a scratch row written from the host is a runtime copy, and a copy per chunk of
// scratch_slots experts means a host wait per chunk. Instead one set of rows wide enough
// for every expert of a layer (a ScratchBank) is shared by the MoE layers of one segment
// layout, beside the same number of records of page-locked host staging: an
// over-capacity call's misses land in the staging (read ahead while the previous layer
// computed, or read now), then one copy per segment moves them into the rows while the
// device is idle (the caller synchronised on the ids), and the layer computes its misses
// in one pass. Layer L's rows can be rewritten by layer L + 1's call because that call's
// ids depend on layer L's output: every kernel that read them has run.
//
// Staging is segment-major: segment s of staging row r is at host + rows * offset_s +
// r * nbytes_s, so consecutive rows of a segment are one contiguous copy.
//
// A long prompt's calls (load_whole) use two banks per layout in turn, each holding a
// whole layer, every expert in the row of its id, so that no ids are read on the host:
// see engine/streamed_layer.py.
//
// What stays with the cache: which experts have a real slot (it passes the resident
// ones' pool rows in, and leaves them and the host tier's out of read-aheads), the real
// slots the loaded experts fill (Load::fill) and the counters (Load's tallies, and the
// records of a read-ahead given up through the `unused` callback).
// Threads: the generation thread calls it (through the cache) and its reads run on the
// reader threads; the banks and read-aheads are guarded by its own mutex, which it never
// holds while it calls the cache back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "blob_file.h"
#include "layer_spec.h"
#include "mlx/array.h"
#include "pool_writer.h"
#include "read_batch.h"
#include "read_clock.h"
#include "reader_pool.h"

namespace es {

namespace mx = mlx::core;

class StagedCopies;

// Bytes of adjacent records read in one read at most (BlobFile::read_run): the whole-layer
// and read-ahead reads are mostly runs of adjacent experts, and records far under a
// megabyte are read at the disk's latency one by one, at its rate in runs.
inline constexpr size_t kReadRunBytes = size_t{1} << 20;

// One bank: `rows` device rows per segment and as many records of host staging.
struct ScratchBank {
  // `arrays`: per segment, (rows, *shape) of device memory allocated as the pools are,
  // the segments at `offsets` with `nbytes` bytes in a record of record_bytes. Allocates
  // the staging and page-locks it with `writer` where that writes CUDA memory. Throws
  // std::bad_alloc when the staging cannot be allocated.
  ScratchBank(std::vector<mx::array> arrays, std::vector<int64_t> offsets,
              std::vector<int64_t> nbytes, int64_t record_bytes, int rows,
              const PoolWriter& writer);
  ~ScratchBank();
  ScratchBank(const ScratchBank&) = delete;
  ScratchBank& operator=(const ScratchBank&) = delete;

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

class LayerScratch {
 public:
  // What the layer scratch reads and writes with: the owning ExpertCache's, which
  // outlives it and stops the reader threads before it is destroyed.
  struct Io {
    const std::vector<LayerSpec>& layers;                 // [li]
    const std::vector<std::unique_ptr<BlobFile>>& files;  // [li]
    ReaderPool& readers;
    ReadClock& clock;
    const PoolWriter& writer;       // the banks' device memory
    const PoolWriter& host_writer;  // host memory: the reader threads' buffers
    int num_experts;
    int reader_threads;
    bool verify_checksums;
    int read_timeout_ms;  // without any read finishing (0: no limit)
  };
  // Called (without the scratch's lock) with the records a read-ahead given up had
  // landed for MoE layer li: read, if never used.
  using Unused = std::function<void(int li, uint64_t records)>;

  LayerScratch(Io io, Unused unused);
  LayerScratch(const LayerScratch&) = delete;
  LayerScratch& operator=(const LayerScratch&) = delete;

  // The host tier (ext/staged_copies.h) that serves records and keeps those read: set
  // once, before any read-ahead or load.
  void set_tier(std::shared_ptr<StagedCopies> tier) { tier_ = std::move(tier); }

  // The arrays of bank `bank` of MoE layer li's layout, allocated on first use and shared
  // by the layers of its layout (see ExpertCache::layer_scratch).
  std::vector<mx::array> arrays(int li, int bank);

  // Gives bank `bank`'s earlier read-ahead up and starts reading `experts` (distinct,
  // none with a real slot or in the host tier) of layer li into its staging on the reader
  // threads, behind demand reads: in order or (by_id) each in the row of its id. Returns
  // how many (ExpertCache::read_ahead and read_layer).
  int read_ahead(int li, int bank, const std::vector<int>& experts, bool by_id);

  // Experts, each with its row's segments as copy sources (destinations unset).
  using Sources = std::vector<std::pair<int, std::vector<Span>>>;
  // What one load did, for the cache to finish: on success the experts that fill empty
  // real slots (from their bank rows, in the order the slots take them), and the
  // counters' shares.
  struct Load {
    std::vector<int> rows;  // load_layer: the row of each expert, `missing` first
    Sources fill;           // empty after a failure
    std::exception_ptr error;  // the first failed read: nothing of the call is used
    uint64_t loads = 0, read_errors = 0;
    uint64_t records_read = 0;  // read from the blob (read-ahead included, used or not)
    uint64_t host_hits = 0;     // copied from the host tier
    uint64_t read_micros = 0;   // waiting for reads
    uint64_t copy_micros = 0;   // in copies into the bank: the host tier's, staged, resident
  };
  // ExpertCache::load_layer on bank 0: `missing` from records read ahead, the host tier
  // or read now; `resident` copied from their pool rows. Throws as stage_reads does (a
  // failed submission); std::logic_error when the experts outnumber the rows.
  Load load_layer(int li, const std::vector<int>& missing, const Sources& resident);
  // ExpertCache::load_whole: every expert of layer li in row e of bank `bank`, the
  // `resident` ones copied from their pool rows.
  Load load_whole(int li, int bank, const Sources& resident);

  // Gives every read-ahead up (ExpertCache::reset, before the host tier is emptied: a
  // read that is copying keeps its record there first).
  void reset();

 private:
  // The read-ahead not yet taken of one bank: its layer, experts (staging row i holds
  // experts[i], or row e expert e for by_id) and reads. Each of load_layer and load_whole
  // takes only its own kind, for its layer.
  struct ReadAhead {
    int layer = -1;
    std::vector<int> experts;
    std::shared_ptr<ReadBatch> batch;
    bool by_id = false;
  };

  // Index into banks_ and read_ahead_ of li's layout's bank `bank`; throws
  // std::out_of_range for a bank other than 0 and 1.
  size_t index(int li, int bank) const;
  // Under mu_: bank `bank` of li's layout, allocated now if it is not yet.
  std::shared_ptr<ScratchBank> bank_locked(int li, int bank);
  // The bank and its read-ahead (taken: left empty), allocating the bank first.
  std::pair<std::shared_ptr<ScratchBank>, ReadAhead> take(int li, int bank);
  // Reads experts[i] of layer li into staging row rows[i] of `bank` on the reader threads
  // (prefetch lane when `ahead`, else demand), adjacent records in runs, one per task:
  // as many runs as reader threads where the records allow, of up to kReadRunBytes each;
  // returns the batch to wait on.
  std::shared_ptr<ReadBatch> stage_reads(int li, const std::shared_ptr<ScratchBank>& bank,
                                         const std::vector<int>& experts,
                                         const std::vector<int>& rows, bool ahead);
  // Puts experts[i] of layer li into row rows[i] of `bank` now: copied from the host tier
  // where it holds the record, else read into the staging and waited for (staged[rows[i]]
  // set where it landed). Adds to out's host_hits, records_read, read_micros, copy_micros and
  // read_errors, and sets out.error to the first failed read (or timeout) unless one is
  // set. Returns, per expert, whether its row now holds it.
  std::vector<uint8_t> fetch(int li, const std::shared_ptr<ScratchBank>& bank,
                             const std::vector<int>& experts, const std::vector<int>& rows,
                             std::vector<uint8_t>& staged, Load& out);
  // Makes the copies into (and within) layer li's bank, adding their time to out's
  // copy_micros; returns their failure as a ReadError naming the layer's file, or null.
  std::exception_ptr copy(int li, const std::vector<Span>& copies, Load& out) const;
  // Gives `ra` up and reports the records it landed (unused_); leaves it empty.
  void retire(ReadAhead& ra);

  Io io_;
  Unused unused_;
  std::shared_ptr<StagedCopies> tier_;
  std::vector<int> layout_;  // [li]: its layout's index
  std::mutex mu_;            // guards banks_ and read_ahead_
  std::vector<std::shared_ptr<ScratchBank>> banks_;  // [2 * layout + bank], made on first use
  std::vector<ReadAhead> read_ahead_;                 // [2 * layout + bank]
};

}  // namespace es
