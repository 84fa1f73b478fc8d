// StagedCopies: pool writes that a kernel on the GPU's own stream performs.
//
// With the acquire mailbox (mailbox.h) a kernel of the forward spins until a host thread
// answers it. That thread, and the reader threads whose prefetch fills it may wait for,
// must then never make a CUDA runtime call that can wait for the device (a pool write,
// which waits for its copy: copies may queue behind the spinning kernel, which waits for
// the thread; the fill stream's calls do not wait: mailbox.h). So while staging is on,
// a pool write is not made by the host: a record is copied into a slot of page-locked
// host memory mapped for the device (`stage_record`), a row-to-row copy is noted
// (`stage_rows`), and the mailbox's next answer hands every pending copy to its kernels
// (`deliver`), which copy them into the pools before any kernel reads the rows the answer
// gives. Stream order makes that safe: the kernels run after every earlier use of the
// pools, and a row the cache hands out is only ever read after the answer that handed it
// out.
//
// Ordering: row-to-row copies (side-row promotions) run first, one after the other in
// the order staged, where a copy of the same delivery writes what one of them reads or
// writes; records run after them, all at once (and the row copies with them where no
// such copy is there). So a record staged for row X
// after a promotion that reads X lands after the promotion read X's old bytes; a record
// staged for a row that a later copy targets is dropped (the later write wins); and a
// promotion that reads a row whose record is still pending reads that record's slot
// instead. A slot is free again once the kernels of the answer that delivered it have
// run, which the mailbox learns from the next request (`completed`).
//
// Host-RAM tier: with tier_slots > 0, each MoE layer also owns that many slots that keep
// the records read into them after their copies ran, evicted by the cache's eviction
// policy, LFU where that is predictive (tier_policy; a RealRegion per layer). A miss
// whose record a tier slot holds is staged from that slot (stage_cached): no read, and
// no host copy; the kernels copy it from host memory at the host-to-device rate. Without
// a free tier slot a record goes through a transient slot. The host paths, while staging
// is off, copy from the tier themselves (copy_cached) and keep what they read in it
// (keep).
//
// A layer's tier slots are segment-major: segment s of tier slot t of a layer with T tier
// slots is at layer_base + T * offset_s + t * aligned_s (aligned_s: the segment's bytes
// rounded up to 16, offset_s: the sum of the earlier ones), as the layer scratch's rows
// are. Where the tier holds every expert, expert e is kept only in slot e, so the copies
// of consecutive experts into consecutive rows are one copy per segment (PoolWriter::copy
// merges them): each device copy costs the host microseconds.
// A transient slot holds its record's segments one after another.
//
// Where the pools are host memory (the CPU backend, tests) the slots are plain host
// memory and `execute` performs a delivery on the host, as the kernels would.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <utility>
#include <vector>

#include "pool_writer.h"
#include "real_region.h"

namespace es {

// One copy a kernel performs: `bytes` bytes from `src` (device address: a staging slot,
// or pool memory) to `dst` (pool memory). `first_chunk` numbers the kernel's work: the
// record copies of one delivery are cut into kChunkBytes chunks, numbered in order.
struct StagedCopy {
  uint64_t src;
  uint64_t dst;
  uint64_t bytes;
  uint64_t first_chunk;
};
static_assert(sizeof(StagedCopy) == 32, "the kernels read StagedCopy as four uint64");

// What one delivery holds: `rows` row copies made one after another, then `records`
// copies made all at once (records, and row copies that need no order) cut into `chunks`
// chunks.
struct Delivery {
  uint32_t rows = 0;
  uint32_t records = 0;
  uint64_t chunks = 0;
};

// No staging slot was free for a record (a prefetch fill gives up; a demand read fails).
struct StagingFull : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class StagedCopies {
 public:
  static constexpr uint64_t kChunkBytes = 64 * 1024;

  // Bytes of a slot that holds a record of `record_bytes` in `segments` segments: each
  // segment starts 16-byte aligned (the kernels' widest copies), and slots are 256-byte
  // aligned. The one rule for a slot's size (host tiers are sized by it).
  static size_t slot_size(int64_t record_bytes, size_t segments) {
    return (static_cast<size_t>(record_bytes) + 16 * segments + 255) / 256 * 256;
  }

  // `slots` transient staging slots of `slot_bytes` bytes each (slot_size of the widest
  // record), of which the last `reserve` go only to demand reads (a
  // request's misses must always find one; prefetch fills give up instead), and
  // `tier_slots` host-tier slots for each of `layers` MoE layers of `num_experts` experts,
  // evicted by `policy`. Maps them for the device where `writer` writes CUDA memory.
  // Throws std::invalid_argument for slots <= reserve, reserve < 1 or tier_slots < 0,
  // std::bad_alloc, std::runtime_error when the CUDA runtime refuses to map them.
  StagedCopies(const PoolWriter& writer, size_t slot_bytes, int slots, int reserve,
               int layers = 0, int tier_slots = 0, int num_experts = 0,
               Policy policy = Policy::kLRU);
  StagedCopies(const StagedCopies&) = delete;
  StagedCopies& operator=(const StagedCopies&) = delete;

  int slots() const { return static_cast<int>(refs_.size()); }
  int tier_slots() const { return tier_slots_; }
  // Bytes of host memory the slots take (transient and tier).
  size_t bytes() const { return memory_->bytes(); }
  int reserve() const { return reserve_; }
  size_t slot_bytes() const { return slot_bytes_; }
  bool mapped() const { return memory_->mapped(); }
  // The most copies one delivery can hold, for the mailbox's copy region: every slot's
  // spans and `row_copies` row copies.
  size_t capacity(size_t spans_per_record, size_t row_copies) const;

  // Stages one record, expert `expert` of MoE layer `layer`: `spans` with host sources
  // (its segments in order, at most slot_bytes in all) are copied into a tier slot of the
  // layer (which then keeps it), else into a free transient slot. demand: the reserve
  // may be used. Returns false, staging nothing, when no slot is free.
  bool stage_record(const std::vector<Span>& spans, bool demand, int layer, int expert);
  // Stages the copies of expert `expert` of MoE layer `layer` from the tier slot that
  // holds it into `spans`' destinations (their sources are ignored; sizes as for
  // stage_record), counting a use for the tier's policy. False when no tier slot holds
  // it (or one is still being filled).
  bool stage_cached(int layer, int expert, const std::vector<Span>& spans);
  // Host paths (staging off): copies each of `experts` of `layer` that a tier slot holds
  // into the destinations of its `spans` (as for stage_cached) with `writer` now, counting
  // a use each, in one write: one wait for all of them, not one per expert. Returns, per
  // expert, whether it was copied; none is where the write failed (the caller then reads
  // those records). Throws std::invalid_argument when the two lists differ in length.
  std::vector<uint8_t> copy_cached(int layer, const std::vector<int>& experts,
                                   const std::vector<std::vector<Span>>& spans,
                                   const PoolWriter& writer);
  // Whether a tier slot of `layer` holds expert `expert` now (filled, not filling).
  bool holds(int layer, int expert) const;
  // Host paths: keeps a record written directly (`spans` with host sources, as for
  // stage_record) in a tier slot of its layer when one is free of copies; no copy is
  // staged. Nothing happens without a tier or a slot, or when the tier holds it already.
  void keep(const std::vector<Span>& spans, int layer, int expert);
  // Stages row copies (`spans` with pool sources).
  void stage_rows(const std::vector<Span>& spans);

  // Writes every pending copy into out[0, capacity) (the row copies that need an order
  // first) and returns their counts; their slots stay taken until completed(). Throws
  // std::length_error when more are pending than `capacity` (then nothing is delivered).
  Delivery deliver(StagedCopy* out, size_t capacity);
  // A fill batch for the mailbox's copy stream (mailbox.h): the pending records whose
  // destination `take` accepts and that no pending row copy, nor any copy of a delivery
  // not yet completed, reads or writes, as copies from their host slots, numbered
  // `batch`; the rest stay pending in their order. Their slots stay taken until
  // completed_batches(batch).
  std::vector<Span> deliver_batch(const std::function<bool(const uint8_t*)>& take,
                                  uint32_t batch);
  // Every delivery made so far has been performed: frees its slots.
  void completed();
  // The fill batches numbered up to `done` (and no later one) have been copied: frees
  // their slots. Batches are numbered 1, 2, ... in the order delivered (uint32, wrapping).
  void completed_batches(uint32_t done);
  // Performs every pending copy with `writer` now (host paths: the device is idle, every
  // batch copied), after completed() and completed_batches(). Throws std::runtime_error
  // as PoolWriter::copy does.
  void flush(const PoolWriter& writer);
  // Performs `d` (written by deliver into `copies`) on the host, as the kernels do: what
  // tests and host-memory pools use instead of a device.
  static void execute(const StagedCopy* copies, const Delivery& d);

  size_t pending() const;
  // Whether a pending copy writes into [lo, hi) of one of `ranges`.
  bool pending_into(const std::vector<std::pair<const uint8_t*, const uint8_t*>>& ranges) const;
  // Forgets what the tier holds (ExpertCache::reset); slots still read by copies keep
  // their bytes until those ran.
  void clear_tier();
  // Slots in use (pending or delivered and not yet completed).
  int busy() const;
  // Experts the host tier holds now.
  int tier_held() const;

 private:
  struct Pending {
    uint8_t* dst;
    const uint8_t* src;  // host address (a slot or pool memory)
    size_t bytes;
    int slot;            // -1: a row copy
    bool live;
    int segment;         // Span::segment: flush() merges copies of one segment
  };
  uint64_t device(const uint8_t* p) const;
  uint8_t* slot_memory(int slot) const {
    return memory_->data() + static_cast<size_t>(slot) * slot_bytes_;
  }
  // Where `slot` keeps each of a record's segments, whose sizes `spans` gives (see the
  // layout above).
  std::vector<uint8_t*> segments(int slot, const std::vector<Span>& spans) const;
  // Adds the copies of `spans` from `slot`'s segments (a reference each).
  void add_copies(int slot, const std::vector<Span>& spans);
  void release(int slot);
  void drop_target(uint8_t* dst);
  // Under mu_: a tier slot of `layer` for `expert` (assigned, filling, held once), or -1
  // (no tier, the tier holds it already, or every slot has copies reading it).
  int take_tier_slot(int layer, int expert);
  // Copies `spans`' sources into `slot`, each 16-byte aligned (the slot is held).
  void fill_slot(int slot, const std::vector<Span>& spans);
  // The tier's eviction policy for the cache's `policy`: LFU for predictive.
  static Policy tier_policy(Policy policy);
  // Under mu_: a use of `expert` for the tier's policy (none where the tier holds every
  // expert: it never evicts).
  void count_use(RealRegion& R, int expert);

  PoolWriter writer_;
  size_t slot_bytes_;
  int reserve_;
  std::unique_ptr<MappedHost> memory_;

  mutable std::mutex mu_;
  std::vector<int> refs_;        // per slot: pending or delivered copies reading it
  std::vector<int> free_;        // free transient slots
  // The host tier: slots [0, layers * tier_slots_), layer li's from li * tier_slots_.
  int tier_slots_ = 0;
  int num_experts_ = 0;
  Policy policy_ = Policy::kLRU;  // the tier's (tier_policy)
  std::vector<RealRegion> tier_;     // per layer
  std::vector<uint8_t> filling_;     // per tier slot: its bytes are being copied in
  uint64_t tick_ = 0;
  std::vector<Pending> pending_;  // in the order staged
  std::vector<int> delivered_;   // slots of deliveries not yet completed (one entry per ref)
  std::vector<std::pair<uint32_t, int>> batched_;  // (batch, slot) of batches not yet copied
  // Pool bytes the copies of deliveries not yet completed read or write: a batch, copied
  // beside them, holds a record that overlaps one.
  std::vector<std::pair<const uint8_t*, const uint8_t*>> delivered_spans_;
};

}  // namespace es
