// ExpertCache: all expert-streaming state of one loaded store (no globals).
//
// Per MoE layer it owns the pool: one MLX array per segment key, shaped
// (rows, *segment_shape) with rows = slots + 2 * side + scratch_slots, slots and side the
// layer's own real slots and side rows per bank (config.layer_slots, layer_side_slots: a
// layer no prefetch fills has no side rows, its rows real):
//   [0, slots)                    real region (demand-loaded, LFU/LRU, pinning)
//   [slots + g*side, slots+(g+1)*side) side region bank g (prefetch): the legacy double
//                                  buffer fills one bank while it reads the other; the
//                                  persistent LFU mode keeps one ledger over both banks'
//                                  2*side rows. The mode switches at a forward boundary
//                                  by rebuilding the ledgers, not the pool
//   [slots + 2*side, rows)        scratch rows that stream an over-capacity call's
//                                  misses chunk by chunk, evicting nothing from the real
//                                  region (they only fill its empty slots, by row copies)
// Threads: one caller (the generation thread) runs acquire/load_scratch, and a
// ScratchStream's thread load_scratch on the layer it streams; prefetch fills run on the
// reader pool or inline (SYNC); snapshots may be taken from any thread.
// Reads: every record is read into a buffer of the reader's own (a reader thread's, or
// the io_uring's of demand reads, see config.io_uring) and copied into a pool row only
// after the read and its checksum succeeded, and only if nobody gave up on it: a read
// abandoned on timeout (demand reads and drains wait at most `read_timeout_s` without
// progress) can never write a row, however late it returns.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "blob_file.h"
#include "layer_scratch.h"
#include "layer_spec.h"
#include "pool_writer.h"
#include "prefetch_throttle.h"
#include "mlx/array.h"
#include "reader_pool.h"
#include "read_clock.h"
#include "real_region.h"
#include "ring_reader.h"
#include "side_region.h"
#include "staged_copies.h"

namespace es {

namespace mx = mlx::core;

// The settings of one cache, named as engine.config.StreamConfig names them; the
// ExpertCache constructor checks them (std::invalid_argument).
struct CacheConfig {
  int expert_slots = 1;  // real-region slots per layer
  std::vector<int> layer_slots;  // per MoE layer, overriding expert_slots when not empty
  int side_slots = 0;    // side-region rows per bank (the widest layer's)
  std::vector<int> layer_side_slots;  // per MoE layer, overriding side_slots when not empty
  int scratch_slots = 1;  // over-capacity chunk rows
  Policy policy = Policy::kPredictive;
  int top_k = 0;          // experts per token: calls of at most top_k ids are one token (0: all)
  int decay_every = 256;  // acquire calls per layer between LFU halvings (0: never)
  bool side_lfu = true;
  bool sync = false;
  bool verify_checksums = true;  // crc32 every record read
  bool uncached_io = true;       // O_DIRECT / F_NOCACHE
  int reader_threads = 2;
  // Longest wait without a read finishing, in [0, kMaxReadTimeoutS] seconds (0: no limit).
  double read_timeout_s = 30.0;
  // Demand reads through io_uring on the calling thread (ext/ring_reader.h), io_uring_depth
  // in flight (0: es::io_uring_depth's; at most kMaxIoUringDepth), where the kernel has
  // it; else (and when the ring is busy with another thread's call) on the reader pool.
  // Prefetch fills always use the pool.
  bool io_uring = true;
  int io_uring_depth = 0;
  // Each layer's prefetch degree (how many of a prediction's experts are filled) decided
  // at run time, up to its side rows (prefetch_throttle.h); false: every prediction fills
  // its side_slots experts.
  bool adaptive_prefetch = true;
};
inline constexpr double kMaxReadTimeoutS = 86400;
inline constexpr int kMaxIoUringDepth = 4096;
// Bytes of read buffers the ring may hold in all where io_uring_depth raises its depth
// past reader_threads + 1 (a bound on the total, not on what is added).
inline constexpr int64_t kIoUringExtraBytes = int64_t{64} << 20;

// Demand reads in flight through io_uring, one buffer of `stride` bytes (a record) each:
// reader_threads + 1, raised to max(top_k, 8) while those buffers stay within
// kIoUringExtraBytes. A token's misses of a layer then go in one submission, and small
// records get the queue depth the disk needs: random O_DIRECT reads of records of tens of
// kB still gain bandwidth from depth 4 to 8, so reader_threads + 1 reads in flight would
// leave the disk idle part of the time. A record of tens of MB keeps the disk's queue busy
// on its own, and 8 buffers of it would cost hundreds of MB: it keeps reader_threads + 1.
int io_uring_depth(int reader_threads, int top_k, int64_t stride);

// The bytes an ExpertCache allocates for MoE layers of rows[i] pool rows of
// record_bytes[i] bytes each (and an expert table of num_experts ids each), with a read
// buffer of `stride` bytes per reader thread and, where io_uring_depth > 0, the io_uring
// region of that many buffers: what a caller checks against the memory available before
// opening one. std::invalid_argument when rows and record_bytes differ in length.
size_t planned_bytes(const std::vector<int>& rows, const std::vector<int64_t>& record_bytes,
                     int num_experts, int reader_threads, int64_t stride, int io_uring_depth);

// Counters of one layer. Lookups count distinct experts per acquire call.
struct LayerStats {
  uint64_t hits = 0, misses = 0, loads = 0, bytes_read = 0, side_hits = 0;
  uint64_t prefetch_issued = 0, prefetch_used = 0, prefetch_wasted = 0, prefetch_cancelled = 0;
  uint64_t evictions = 0, overcap_calls = 0, read_seconds_us = 0;
  uint64_t read_errors = 0;  // reads failed or given up on (demand and prefetch)
  uint64_t acquire_seconds_us = 0;  // wall time in acquire and load_scratch, reads included
  uint64_t pins_dropped = 0;  // pins the real region dropped because they cost hits
  // Side hits copied into the real region (no read), and side hits not copied because no
  // slot was free of this call's experts and pins or the policy kept every occupant.
  uint64_t promotions = 0, promotions_declined = 0;
  // Misses whose prefetch fill was already reading: waited for (a side hit when it
  // landed) instead of reading the record a second time.
  uint64_t prefetch_late = 0;
  // Records demand-read through io_uring (counted among loads).
  uint64_t io_uring_reads = 0;
  // Records (demand loads and prefetch fills) copied from the host tier instead of read
  // (counted among loads, not in bytes_read), and their bytes.
  uint64_t host_hits = 0, host_bytes = 0;
  // Wall time of the layer scratch's loads in copies into a bank (from the host tier,
  // staged records, resident rows), within acquire_seconds.
  uint64_t copy_seconds_us = 0;
};

// The counters of LayerStats by name, in the order snapshots report them (the one list:
// engine._ext.STAT_KEYS). A counter kept in microseconds is reported in seconds.
struct StatField {
  const char* name;
  uint64_t LayerStats::*value;
  bool micros;
};
inline constexpr StatField kStatFields[] = {
    {"hits", &LayerStats::hits, false},
    {"misses", &LayerStats::misses, false},
    {"loads", &LayerStats::loads, false},
    {"bytes_read", &LayerStats::bytes_read, false},
    {"side_hits", &LayerStats::side_hits, false},
    {"prefetch_issued", &LayerStats::prefetch_issued, false},
    {"prefetch_used", &LayerStats::prefetch_used, false},
    {"prefetch_wasted", &LayerStats::prefetch_wasted, false},
    {"prefetch_cancelled", &LayerStats::prefetch_cancelled, false},
    {"evictions", &LayerStats::evictions, false},
    {"overcap_calls", &LayerStats::overcap_calls, false},
    {"read_seconds", &LayerStats::read_seconds_us, true},
    {"read_errors", &LayerStats::read_errors, false},
    {"acquire_seconds", &LayerStats::acquire_seconds_us, true},
    {"pins_dropped", &LayerStats::pins_dropped, false},
    {"promotions", &LayerStats::promotions, false},
    {"promotions_declined", &LayerStats::promotions_declined, false},
    {"prefetch_late", &LayerStats::prefetch_late, false},
    {"io_uring_reads", &LayerStats::io_uring_reads, false},
    {"host_hits", &LayerStats::host_hits, false},
    {"host_bytes", &LayerStats::host_bytes, false},
    {"copy_seconds", &LayerStats::copy_seconds_us, true},
};

struct LayerSnapshot {
  std::vector<int32_t> slot_expert;   // slots(li) (-1 empty)
  std::vector<uint8_t> slot_state;    // slots(li): SlotState codes (slot_state.h)
  std::vector<int32_t> side_expert;   // 2*side_slots(li) (-1 free)
  std::vector<uint8_t> side_state;    // 2*side_slots(li): RowState codes (side_region.h)
  std::vector<float> freq;            // num_experts: real-region LFU frequency
  LayerStats stats;
  int prefetch_degree = 0;            // experts a prediction fills now (prefetch_throttle.h)
};

class ExpertCache {
 public:
  ExpertCache(std::vector<LayerSpec> layers, int num_experts, CacheConfig config);
  ~ExpertCache();

  int num_layers() const { return static_cast<int>(layers_.size()); }
  // How records reach the pools: "memcpy", or "cuda" for MLX CUDA's managed memory.
  const char* pool_writes() const { return writer_.kind(); }
  const PoolWriter& writer() const { return writer_; }
  // Creates the staging of pool writes (staged_copies.h: `slots` transient slots of the
  // widest record, `reserve` of them for demand reads, and `tier_slots` host-tier slots
  // per MoE layer), off until set_staging(true). Once only (std::logic_error after);
  // throws as StagedCopies' constructor does.
  std::shared_ptr<StagedCopies> enable_staging(int slots, int reserve, int tier_slots);
  std::shared_ptr<StagedCopies> staging() const { return staged_; }
  // Bytes of one staging (and host-tier) slot: StagedCopies::slot_size of the widest record.
  size_t staging_slot_bytes() const;
  // Staging on: from now on demand loads, promotions and prefetch fills are staged for
  // the acquire kernels (after the fills in flight landed: drain). Off: they write the
  // pools directly again, and what was staged is written now; only when no kernel of a
  // forward is queued (the caller synchronised), since the staged copies are then
  // written by the host. std::logic_error for `true` without enable_staging.
  // Before anything else, off waits for the answers the acquire kernels did not wait for
  // (set_answer_wait).
  void set_staging(bool on);
  bool staging_on() const { return staging_on_.load(std::memory_order_acquire); }

  // The hit table: (num_layers, num_experts) int32 in host memory mapped for the device
  // (staging's), at hit_table_address(): entry [li][e] is the real slot of expert e of
  // MoE layer li where an acquire kernel may use it without asking the host, else -1.
  // Made by enable_staging, all -1 while staging is off. An entry is set only by
  // deliver(), under the lock, for slots whose copies that delivery or an earlier one
  // holds; it is unset when its slot is emptied, before any copy into the slot is
  // staged. So a row the table gives holds its expert until a later delivery's copies,
  // which run after every kernel that read the table before that delivery's answer.
  uintptr_t hit_table_address() const;
  // Layer li's num_experts entries as the host sees them (the stand-in for the device in
  // AcquireMailbox::post). std::out_of_range for li, std::logic_error before enable_staging.
  const int32_t* hit_entries(int li) const;
  // Every copy staged so far into out[0, capacity) (StagedCopies::deliver), then the hit
  // table of each layer whose real region changed since the last delivery. Throws as
  // StagedCopies::deliver does (nothing delivered, the table unchanged).
  Delivery deliver(StagedCopy* out, size_t capacity);
  // A fill batch for the mailbox's copy stream (AcquireMailbox), numbered `batch`: the
  // staged records into published side rows of every MoE layer but `layer`
  // (StagedCopies::deliver_batch), whose rows an answer may have handed to kernels still
  // running. Real slots are left to the answers: a kernel may read a real slot from the
  // hit table at any time. The hit table is not touched. Each batched row is withdrawn
  // (in flight: no acquire hands it out, no prefetch reuses it) until fills_landed.
  std::vector<Span> deliver_fills(int layer, uint32_t batch);
  // Fill batch `batch` has landed (batches land in order): its rows are published again
  // where every copy ran (`ok`), else freed; its staging slots are freed.
  void fills_landed(uint32_t batch, bool ok);
  // What set_staging(false) and reset() call first (AcquireMailbox: waits until its
  // thread has answered every request posted): an answer of an earlier forward then
  // never runs after them. Empty: none.
  void set_answer_wait(std::function<void()> wait);
  int num_experts() const { return num_experts_; }
  const CacheConfig& config() const { return config_; }
  // Whether demand reads go through io_uring: config.io_uring and the kernel has it.
  bool io_uring() const { return ring_ != nullptr; }
  // Real-region slots of MoE layer li (config.layer_slots, else config.expert_slots).
  int slots(int li) const { return slots_.at(li); }
  const std::vector<int>& layer_slots() const { return slots_; }
  // Side-region rows per bank of MoE layer li (config.layer_side_slots, else
  // config.side_slots).
  int side_slots(int li) const { return side_slots_.at(li); }
  const std::vector<int>& layer_side_slots() const { return side_slots_; }
  int rows(int li) const {
    return slots_.at(li) + 2 * side_slots_.at(li) + config_.scratch_slots;
  }
  std::vector<mx::array> pool(int li) const { return pools_.at(li); }
  // How the next call of MoE layer li with n expert ids (top_k per token) gets its rows:
  //   kPlanTable  the layer is complete (every expert has a real slot, which it keeps
  //               until reset: a complete layer never misses, so never evicts): rows =
  //               table(li)[ids] on the device, no host work, for any number of ids.
  //               A one-token call's top_k lookups are counted as hits here (a token's
  //               top-k ids are distinct), a longer call's not at all; LFU frequencies
  //               are not touched (nothing can be evicted).
  //   kPlanStream n <= slots - pinned: the call cannot be over capacity (each distinct
  //               miss finds a slot no other id of the call holds), so acquire_op may map
  //               it in stream order.
  //   kPlanSync   otherwise (prefill): read the ids on the host, acquire, stream the
  //               over-capacity misses through the scratch rows.
  enum Plan : int { kPlanTable = 0, kPlanStream = 1, kPlanSync = 2 };
  // Raises the pending stream error (see below) first, so a forward built after a failed
  // one fails at its first MoE layer.
  Plan plan(int li, int64_t n, int top_k);
  // An acquire that failed on the stream's thread (acquire_op) cannot raise there with its
  // type intact (MLX's scheduler keeps only a message, and a host read of the result does
  // not look at it), so it stores the error here and the host raises it: the first error
  // is kept until raise_stream_error() throws it and clears it.
  void set_stream_error(std::exception_ptr e);
  void raise_stream_error();
  // Whether plan() found MoE layer li complete (it then stays so until reset()).
  bool is_complete(int li) const;
  // (num_experts,) int32 expert -> real slot of MoE layer li; -1 until the layer is
  // complete (see plan), then a fixed permutation until reset().
  mx::array table(int li) const { return tables_.at(li); }

  // Maps ids[i] (expert ids of MoE layer li) to pool rows in local[i]: real hit, side hit
  // (read generation), or a demand load into the real region. A call whose misses exceed
  // the evictable slots loads nothing: those entries get -1 and the distinct missing
  // experts are returned, to be streamed through load_scratch(). The caller must have
  // evaluated every earlier use of this layer's pool (it synchronised on ids), which is
  // also how a new forward is detected (li not above the previous call's). Called on the
  // generation thread (synchronous path) or, through acquire_op, on the thread of the MLX
  // stream that evaluates the graph; the two never overlap for one model, since a
  // synchronous call first evaluates everything its ids depend on.
  std::vector<int> acquire(int li, const int32_t* ids, int32_t* local, size_t n);

  // The router probabilities (softmax over the experts, num_experts values per token) of
  // the tokens the next acquire of MoE layer li routes: evidence for the predictive
  // policy (which unchosen experts were close), used by that acquire only and only when
  // it routes one token (n == num_experts).
  void hint(int li, const float* probs, size_t n);

  // Reads every expert of MoE layer li that has no real slot into a free one, when its
  // real region holds every expert (else std::invalid_argument): the layer is then
  // complete, and decode takes the table path from its first token instead of missing
  // once per expert first (resident mlx-lm reads every weight at load, too). Counts the
  // loads, bytes and read time, not misses: nothing asked for these experts yet. Same
  // thread rule as acquire. Returns the number of experts read.
  int fill(int li);

  // Reads `experts` into the scratch rows from scratch row `first` on (at most
  // `scratch_slots` rows in all); returns their rows. Each one read is also copied into an empty real slot
  // while there is one (acquire lists the missing experts most-routed first), so a cold
  // cache keeps the prompt's busiest experts. Thread-safe against the generation thread's
  // calls on other layers (ScratchStream reads a layer's chunks on a thread of its own).
  std::vector<int> load_scratch(int li, const std::vector<int>& experts, int first = 0);

  // The over-capacity path where the pools are device memory (ext/layer_scratch.h).
  // The arrays (per segment, (num_experts, *shape)) of bank `bank` (0 or 1) of the layer
  // scratch that MoE layer li's calls use, allocated on first use and shared by the
  // layers of its segment layout. Throws std::bad_alloc (naming the bytes) when it cannot
  // be allocated, std::out_of_range for another bank.
  std::vector<mx::array> layer_scratch(int li, int bank = 0);
  // Starts reading `experts` of MoE layer li into its layer scratch's staging on the
  // reader threads (behind demand reads), those with a real slot or in the host tier
  // left out: the misses a coming over-capacity call of li is predicted to have. An
  // earlier read-ahead of the same layout not yet taken is given up (its reads finish
  // into their own buffers and are dropped). Returns how many reads it started.
  int read_ahead(int li, const std::vector<int>& experts);
  // A long prompt's calls, whose ids are never read on the host: read_layer starts
  // reading every expert of MoE layer li without a real slot or a host-tier slot into
  // bank `bank`'s staging, row = expert id, on the reader threads (behind demand reads;
  // an earlier read-ahead of that bank not yet taken is given up), and returns how many;
  // load_whole then puts every expert of li in the row of its id of that bank (waiting
  // for the reads, reading what did not land), the resident ones copied from their
  // slots, and fills empty real slots in id order. Counts loads, bytes and read time (not
  // lookups: the routing is not seen). Precondition: every use of the bank before has
  // been evaluated (the caller waits for it); the device may be computing on the other.
  // Throws as load_layer does.
  int read_layer(int li, int bank);
  void load_whole(int li, int bank);

  // Puts every expert of an over-capacity call of MoE layer li into rows of li's layer
  // scratch, so that the call computes from it alone: `missing` (acquire's) from records
  // read ahead (waited for as demand reads are), the host tier, or read now, the staging
  // copied to the device in one copy per segment; `resident` from their pool rows
  // `resident_rows` (acquire's rows of the call's hits) by device copies. Returns the
  // row of each, `missing` first. Like load_scratch, each miss also fills an empty real
  // slot while there is one, and the counters count misses, loads, bytes and read time.
  // Precondition as acquire's: every earlier use of the scratch has been evaluated.
  // Throws as acquire's demand reads do (a failed or timed-out read: nothing of this
  // call's rows is used), std::out_of_range for an id or row, std::invalid_argument for
  // more experts than rows.
  std::vector<int> load_layer(int li, const std::vector<int>& missing,
                              const std::vector<int>& resident,
                              const std::vector<int>& resident_rows);

  // Reserves side rows for the predicted experts of layer li and fills them (background,
  // or inline in SYNC mode). Called by the prefetch primitive.
  void prefetch(int li, const int32_t* ids, size_t n);

  // Cancels queued fills and waits for started ones. A fill still reading after
  // read_timeout_s without any fill finishing is given up on: its row is freed (the late
  // read never writes it) and the expert is left to a later demand read.
  void drain();

  void pin(int li, int expert);
  void unpin(int li, int expert);
  void set_policy(Policy p);
  // Applied at the next forward boundary (after a drain).
  void set_side_lfu(bool on);
  void set_sync(bool on);
  bool side_lfu() const;
  bool sync() const;

  // Empties the real regions (pins and frequencies too), side ledgers and host tier, after
  // the answers not waited for (set_answer_wait) and a drain; what the prefetch throttle
  // measured stays.
  void reset();

  LayerSnapshot snapshot(int li) const;
  uint64_t forward() const;
  int inflight() const;
  // The usefulness a fill must reach to be made in the forward under way, and the one
  // the throttle settled on (prefetch_throttle.h).
  double prefetch_threshold() const;
  double kept_prefetch_threshold() const;
  // Wall time with at least one record read in flight, all layers (ReadClock), seconds.
  double reading_seconds() const { return static_cast<double>(read_clock_.micros()) / 1e6; }
  // Empty string when every real region and side ledger is consistent.
  std::string check() const;

  void inject_fault(int li, Fault fault, int expert, int count, int delay_ms);

 private:
  struct FillTicket;  // who settles one prefetch fill: its reader or a timed-out drain

  void begin_forward_locked(std::unique_lock<std::mutex>& lk);
  void drain_locked(std::unique_lock<std::mutex>& lk);
  // Drain timed out: frees the row of every fill still Pending (reading or queued).
  void abandon_stuck_fills_locked();
  int read_gen() const;
  int fill_gen() const;
  // The side-region ledgers of MoE layer li in the LFU (true) or legacy (false) mode.
  std::vector<SideLedger> side_ledgers(int li, bool lfu) const;
  // Who a pool write is for, which decides whether it may be staged (set_staging):
  // demand loads may use the staging reserve, prefetch fills give up when no slot is
  // free, and the over-capacity path's scratch rows are always written directly (their
  // kernels come through the CPU stream, not the acquire kernels).
  enum class Write { kDemand, kFill, kDirect };
  void copy_record(int li, int expert, const uint8_t* buf, int row, Write how);
  // Expert `expert` of layer li from the host tier, when it holds it: staged into pool
  // row `row` (staging on), or copied now into `to` (a pool row's spans). False: not
  // held, the caller reads it.
  bool stage_from_tier(int li, int expert, int row);
  bool copy_from_tier(int li, int expert, const std::vector<Span>& to);
  // The spans of `row`'s segments in layer li's pool (sources unset).
  std::vector<Span> row_spans(int li, int row) const;
  void copy_row(int li, int from, int to, Write how);
  // The writer reader threads page-lock their read buffers with: none while writes are
  // staged (the runtime call could wait for a spinning kernel; the buffers are only
  // copied into staging slots by the host). A buffer outgrown then is retired, not
  // unpinned (bounce_buffer).
  const PoolWriter& bounce_writer() const { return staging_on() ? host_writer_ : writer_; }
  // What demand_read adds to a layer's counters.
  struct ReadTally {
    uint64_t micros = 0;          // wall time
    uint64_t io_uring_reads = 0;  // records landed through io_uring
  };
  // Reads each (expert, row) of layer li into its row (through io_uring where it is used
  // and free, else on the reader threads) and waits. landed[i] tells whether load i's row
  // now holds its expert. Returns the first error (in load order) once every read has
  // landed, failed or been given up, else null; adds to *tally when given.
  std::exception_ptr demand_read(int li, const std::vector<std::pair<int, int>>& loads,
                                 std::vector<uint8_t>& landed, ReadTally* tally, Write how);
  // The two ways of demand_read: each fills landed[i] and, for a failed read, errors[i]
  // (neither: given up on timeout). ring_read returns false (nothing read) when the ring
  // is in use by another thread; pool_read returns a failed submission's error.
  bool ring_read(int li, const std::vector<std::pair<int, int>>& loads,
                 std::vector<uint8_t>& landed, std::vector<std::exception_ptr>& errors,
                 Write how);
  std::exception_ptr pool_read(int li, const std::vector<std::pair<int, int>>& loads,
                               std::vector<uint8_t>& landed,
                               std::vector<std::exception_ptr>& errors, Write how);
  // Demand loads into real slots: marks `loads` ((expert, slot) pairs) loading, reads them
  // with `lk` (on mu_) released, then under it again clears the marks, assigns each slot
  // whose record landed (a failed one stays empty: no wrong bytes mapped) and counts
  // loads, bytes, read time and errors. Returns the first read error.
  std::exception_ptr load_slots(int li, const std::vector<std::pair<int, int>>& loads,
                                std::unique_lock<std::mutex>& lk);
  // A prefetch fill of `expert` into side row `row` of bank `gen`: from the host tier where
  // it holds the record, else read. tier_only (the caller must not wait for a read): a
  // fill the tier no longer holds goes to a reader thread instead.
  void fill_task(int li, int gen, int expert, int row, const std::shared_ptr<FillTicket>& t,
                 bool cancelled, bool tier_only = false);

  std::vector<LayerSpec> layers_;
  int num_experts_;
  CacheConfig config_;
  std::vector<int> slots_;       // [li] real-region slots
  std::vector<int> side_slots_;  // [li] side-region rows per bank
  int read_timeout_ms_;  // config.read_timeout_s in milliseconds (0: no limit)
  std::vector<std::vector<mx::array>> pools_;
  std::vector<std::vector<uint8_t*>> pool_ptrs_;
  // [li]: each segment's pool memory, [first, end), for pending_into.
  std::vector<std::vector<std::pair<const uint8_t*, const uint8_t*>>> pool_ranges_;
  // Each layer's side rows, per segment: (first byte, end, MoE layer), sorted by address.
  struct SideRange {
    const uint8_t* lo;
    const uint8_t* hi;
    int layer;
    size_t row_bytes;  // the segment's bytes per row
  };
  // A side row whose fill is in a batch on the copy stream (deliver_fills), until it lands.
  struct BatchedRow {
    uint32_t batch;
    int layer, gen, expert, row;
  };
  std::vector<BatchedRow> batched_rows_;  // under mu_, oldest batch first
  // Under mu_: whether row `row` of MoE layer li's ledger `gen` is in a batch not landed.
  bool in_batch(int li, int gen, int row) const;
  std::vector<SideRange> side_ranges_;
  std::vector<std::unique_ptr<BlobFile>> files_;

  mutable std::mutex mu_;
  std::condition_variable drained_cv_;
  std::vector<RealRegion> real_;
  std::vector<std::vector<SideLedger>> side_;  // [li][gen]: LFU one of 2*side rows, legacy two
  std::vector<std::vector<uint8_t>> loading_;  // [li][slot]
  std::vector<mx::array> tables_;               // [li]: (num_experts,) int32, see plan()
  std::vector<uint8_t> complete_;               // [li]: tables_[li] is filled
  std::vector<LayerStats> stats_;
  // Per layer: the distinct experts of its last acquire and that call's forward (the
  // predictive policy's cross-layer evidence), and the router hint for its next one.
  std::vector<std::vector<int>> last_experts_;
  std::vector<uint64_t> last_forward_;
  std::vector<std::vector<float>> router_hint_;
  std::vector<std::vector<std::shared_ptr<FillTicket>>> fill_tickets_;  // [li][gen*side+row]
  std::exception_ptr stream_error_;  // see set_stream_error
  uint64_t fills_settled_ = 0;  // fills published or released: drain's progress measure
  uint64_t forward_ = 0;
  PrefetchThrottle throttle_;
  // The forward under way: its first and latest acquire's start, and whether every call
  // was one token (the throttle compares decode forwards only).
  std::chrono::steady_clock::time_point forward_first_, forward_last_;
  bool forward_decode_ = false;
  uint64_t tick_ = 0;
  int last_li_ = -1;
  int inflight_ = 0;
  bool pending_lfu_;
  bool side_lfu_;
  bool sync_;

  // read_ahead and read_layer: starts reading `experts` of layer li (duplicates, real
  // slots and the host tier left out) into bank `bank` of its layer scratch, in order or
  // (by_id) each in the row of its id; returns how many.
  int start_read_ahead(int li, int bank, const std::vector<int>& experts, bool by_id);
  // Under mu_: finishes a load of layer li's layer scratch started at t0: fills empty
  // real slots from it, counts it, and throws its error.
  void finish_load(int li, const LayerScratch::Load& load,
                   std::chrono::steady_clock::time_point t0);
  // Under mu_: each expert of `from` (with its row's segments as sources), in order,
  // without a real slot fills an empty one of layer li by a device copy, while one is
  // left (an empty slot is mapped by no computation, so nothing reads it while it is
  // written).
  void fill_empty_slots(int li, const LayerScratch::Sources& from);

  // Calls the answer wait (set_answer_wait), if any.
  void wait_for_answers();
  // Under mu_: empties real slot `slot` of layer li (the hit table first: see above).
  void evict_locked(int li, int slot);
  // Under mu_: every hit table entry -1, every layer to be written by the next delivery.
  void unmap_hits_locked();
  // Under mu_: the same for MoE layer li's entries (the table exists).
  void unmap_layer_locked(int li);

  PoolWriter writer_{nullptr};  // set from the first pool's memory in the constructor
  PoolWriter host_writer_{nullptr};
  std::shared_ptr<StagedCopies> staged_;  // see enable_staging
  std::unique_ptr<MappedHost> hit_table_;  // see hit_table_address; with staged_
  std::vector<uint8_t> hits_stale_;        // [li]: its real region changed since deliver()
  std::mutex answer_wait_mu_;
  std::function<void()> answer_wait_;      // see set_answer_wait
  std::atomic<bool> staging_on_{false};
  ReadClock read_clock_;  // before the readers: outlives their threads
  std::unique_ptr<ReaderPool> readers_;
  std::unique_ptr<RingReader> ring_;  // null: demand reads use readers_
  std::unique_ptr<LayerScratch> scratch_;  // reads with files_, readers_ and the writers
};

}  // namespace es
