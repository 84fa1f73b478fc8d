// AcquireMailbox: a GPU kernel's acquire answered by a host thread, with no MLX
// cross-stream event in between.
//
// On a GPU the router's ids exist only on the device. Created on MLX's CPU stream, an
// acquire makes the GPU signal an event that a CPU-stream thread waits for, and the GPU
// then waits for that thread's own signal: two graph commits and two thread wake-ups per
// MoE layer, hit or miss. Here the acquire is a kernel on the GPU's own stream
// (engine/device_acquire.py) that writes the layer's ids, and optionally the hidden state
// of each row's last token (a decode step of a batch has a row per reply), into this
// mailbox in mapped host memory and spins until the mailbox's thread has written the rows
// back; that thread polls the mailbox, runs
// ExpertCache::acquire (hits, side hits, demand reads: the same calls acquire_op makes)
// and answers, then ranks and queues the prefetch predicted from the hidden states.
//
// Ordering is the CPU stream's: a request is posted only when every kernel it depends on
// has run, so every earlier use of the layer's pool has run too (its rows can be
// evicted), and the thread answers requests one at a time in the order they are posted,
// a layer's prefetch before the next request. Requests are posted by kernels ordered by
// the forward's data dependencies, one at a time per mailbox: a kernel first waits until
// the previous request was answered.
//
// Layout (32-bit words from the mapped address; kernel and host agree on it through the
// constants below, which engine/device_acquire.py reads from the bindings):
//   [kRequest]  sequence number of the latest request, written by the device
//   [kReply]    sequence number of the latest request answered, written by the host
//   [kLayer]    the request's MoE layer
//   [kCount]    its number of ids (0: a prefetch-only request, answered at once)
//   [kXRows]    rows of hidden state the request carries (0: none, at most x_rows)
//   [kRowCopies], [kRecordCopies], [kChunks]  the answer's delivery of staged pool
//               writes (staged_copies.h): counts of row and record copies, and of the
//               record copies' chunks
//   [kFast]     1 when the kernel took its rows from the hit table and does not wait
//   [kIds, kIds + kMaxIds)     ids (int32)
//   [kRows, kRows + kMaxIds)   rows (int32), written by the host
//   [kHidden, kHidden + x_rows * hidden) hidden states, row-major (float32)
// and, from copies_address(), the delivery's StagedCopy entries: row copies, then records.
//
// Hits without the host: the kernel first looks the ids up in the cache's hit table
// (ExpertCache::hit_table_address, mapped host memory). When every id has an entry, it
// writes those rows out, posts the request marked kFast and goes on without waiting: the
// thread answers it later (counts, policy, prefetch) but delivers nothing, and a later
// request's kernel waits for that answer before it posts. The table's rules make the rows
// right: an entry is set only for a slot whose copies were delivered, and unset before a
// copy into its slot is staged, which only a later answer that is waited for delivers.
//
// Fills beside the compute: a prefetch fill (a record the host tier holds, or one a
// reader thread read) need not wait for the next answer's copy kernel, which runs on the
// compute stream ahead of the experts that use it. With the fill stream on
// (set_fill_stream), after each request the thread queues, as fill batch b, the staged
// records into published side rows of every layer but the request's that no copy of the
// latest answer reads or writes (ExpertCache::deliver_fills) on a CUDA stream of its own
// (CopyStream: the device's copy engines copy them while the compute stream runs). Their
// rows are in flight from then until the thread sees the batch's event pass and calls
// ExpertCache::fills_landed (which frees them instead where a copy failed): no answer
// hands them out and no prefetch reuses them. That is safe because when the thread reads
// request k, every kernel queued before k's kernel has run (k's own copies may still run
// beside the batch), and a row whose copy is still staged was never handed out (the
// answer that hands a row out delivers its copies). No kernel waits for the copy stream:
// a stream can share a hardware queue with the compute stream, behind a kernel that
// spins for an answer, and a kernel that waited for a batch could then wait for itself.
// The thread's CUDA calls are ones that never wait for the device (cudaMemcpyAsync from
// page-locked memory, cudaEventRecord, cudaEventQuery, cudaStreamQuery), on a stream no
// kernel uses.
//
// Pool writes: while the mailbox is in use the cache stages them (ExpertCache::
// set_staging), so that neither this thread nor a reader thread makes a CUDA call that
// waits while a kernel spins; every answer to an acquire delivers what is staged, and
// its kernels copy it into the pools before the rows are read.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "expert_cache.h"
#include "router.h"

namespace es {

class AcquireMailbox {
 public:
  static constexpr int kRequest = 0;  // own 128-byte line: device-written
  static constexpr int kReply = 32;   // own line: host-written
  static constexpr int kLayer = 64;
  static constexpr int kCount = 65;
  static constexpr int kXRows = 66;
  static constexpr int kRowCopies = 67;
  static constexpr int kRecordCopies = 68;
  static constexpr int kChunks = 69;
  static constexpr int kFast = 70;
  static constexpr int kMaxIds = 256;
  static constexpr int kIds = 160;
  static constexpr int kRows = kIds + kMaxIds;
  static constexpr int kHidden = kRows + kMaxIds;

  // hidden: the hidden size (floats of one row's hidden state); max_ids: the most ids
  // of one request (at most kMaxIds), which is also how many staging slots are kept for
  // a request's demand reads; fill_slots: staging slots for prefetch fills; tier_slots:
  // host-tier slots per MoE layer (staged_copies.h; 0: no tier); x_rows: the most rows of
  // hidden state a request carries (a batch's replies). Allocates the mailbox and the
  // staging (ExpertCache::enable_staging) in host memory mapped for the pools' CUDA device
  // (plain host memory where the pools are not CUDA memory: for tests of the host side,
  // `post`) and starts its thread. Throws std::invalid_argument for hidden < 1, max_ids
  // outside [1, kMaxIds], fill_slots < 1 or x_rows < 1, std::logic_error when the cache
  // already stages its writes, std::runtime_error when the CUDA runtime refuses to map
  // the memory.
  AcquireMailbox(std::shared_ptr<ExpertCache> cache, int hidden, int max_ids, int fill_slots,
                 int tier_slots = 0, int x_rows = 1);
  // Waits for the answer to a request no kernel waits for (kFast, or a prefetch's),
  // answers a request still waited for (rows 0, an error for the host), stops the thread,
  // then waits for the fill batches in flight. Memory a kernel may still read (a request
  // waited for) is kept.
  // Kernels of a forward still queued must not run after this (the cache's pools have
  // the same rule).
  ~AcquireMailbox();
  AcquireMailbox(const AcquireMailbox&) = delete;
  AcquireMailbox& operator=(const AcquireMailbox&) = delete;

  // The address kernels write to: the device pointer of the mapped memory.
  uintptr_t device_address() const { return memory_->device_address(); }
  int hidden() const { return hidden_; }
  int max_ids() const { return max_ids_; }
  int x_rows() const { return x_rows_; }
  // The device address of the delivery's StagedCopy entries.
  uintptr_t copies_address() const { return memory_->device_address() + copies_offset_; }
  // The device address of the cache's hit table (ExpertCache::hit_table_address).
  uintptr_t hit_table_address() const { return cache_->hit_table_address(); }
  // Whether the memory is mapped for a CUDA device (false: plain host memory).
  bool mapped() const { return memory_->mapped(); }

  // What the thread prefetches after answering a request of MoE layer `source` that
  // carries hidden states: for each target, `router` ranks the experts for each row and
  // ExpertCache::prefetch takes the top `budget` of every row, rank by rank (each row's
  // best first, then each row's second, ...: Router::top_rows), an expert once. Replaces
  // the layer's earlier plan; empty: none.
  // Throws std::out_of_range for a layer the cache does not have, std::invalid_argument
  // for mismatched lengths, a router of another hidden size or expert count, or a budget
  // outside [1, experts].
  void set_prefetch(int source, const std::vector<int>& targets,
                    const std::vector<std::shared_ptr<const Router>>& routers, int budget);

  // Does on the host what the kernels do (waits for the previous answer; rows from the hit
  // table where it has every id, posted kFast; else posts, waits for this answer and
  // performs the delivered copies) and returns the rows: the tests' stand-in for the
  // device, on any build (pools in host memory). n ids (at most max_ids; 0: prefetch
  // only), x: x_rows * hidden floats (row-major; x_rows at most x_rows()) or null.
  std::vector<int32_t> post(int layer, const int32_t* ids, int n, const float* x,
                            int x_rows = 1);

  // The sequence numbers of the latest request and of the latest answer (equal when no
  // request waits).
  std::pair<uint32_t, uint32_t> sequence() const;

  // Waits until the thread has answered every request posted so far and every fill batch
  // queued has landed (registered with the cache as its answer wait:
  // ExpertCache::set_answer_wait).
  void wait() const;

  // Whether prefetch fills are queued on the fill stream after each request (off: they go
  // with the next answer that is waited for). Off, the batches in flight still land.
  bool fill_stream() const { return fill_stream_on_.load(std::memory_order_relaxed); }
  // The stream and its events are made when first set on (std::runtime_error naming the
  // CUDA error where they cannot be).
  void set_fill_stream(bool on);
  // Fill batches queued since creation, and their copies (spans, before merging).
  std::pair<uint64_t, uint64_t> fill_batches() const {
    return {batches_.load(std::memory_order_relaxed),
            batch_records_.load(std::memory_order_relaxed)};
  }

  // Requests answered since creation, and of them those posted kFast (rows from the hit
  // table, not waited for).
  uint64_t answered() const { return answered_.load(std::memory_order_relaxed); }
  uint64_t fast_answers() const { return fast_.load(std::memory_order_relaxed); }
  // Copies delivered since creation: row copies made one after another, and copies made
  // all at once (Delivery).
  std::pair<uint64_t, uint64_t> delivered() const {
    return {ordered_.load(std::memory_order_relaxed), at_once_.load(std::memory_order_relaxed)};
  }

  // Seconds this thread spent answering requests since creation, from reading a request
  // to publishing its reply (the time a posting kernel waits beyond the hand-offs; the
  // prefetch that follows a reply is not counted).
  double answer_seconds() const {
    return static_cast<double>(answer_ns_.load(std::memory_order_relaxed)) * 1e-9;
  }

 private:
  struct Target {
    int layer;
    std::shared_ptr<const Router> router;
  };
  volatile int32_t* word(int i) const {
    return reinterpret_cast<volatile int32_t*>(memory_->data()) + i;
  }
  StagedCopy* copies() const {
    return reinterpret_cast<StagedCopy*>(memory_->data() + copies_offset_);
  }
  void run();
  void answer(uint32_t seq);
  // Thread: after an answer to a request of MoE layer li with `rows` rows of hidden state
  // (x_), the fills its plan predicts (set_prefetch).
  void prefetch(int li, int rows);
  // Thread: queues the fills staged for side rows of layers other than `layer` (the
  // latest request's) as the next batch, when the fill stream is on and not full.
  void publish_fills(int layer);
  // Thread: hands each batch landed to ExpertCache::fills_landed (its rows published, or
  // freed where a copy failed, the error then the forward's).
  void land();

  std::shared_ptr<ExpertCache> cache_;
  int hidden_;
  int max_ids_;
  int x_rows_;
  std::shared_ptr<StagedCopies> staged_;
  size_t copies_offset_ = 0;  // bytes from the mailbox's start
  size_t capacity_ = 0;       // StagedCopy entries there
  std::unique_ptr<MappedHost> memory_;
  std::unique_ptr<CopyStream> fill_stream_;  // made by set_fill_stream, under plan_mu_
  std::atomic<CopyStream*> stream_{nullptr};  // it, for the thread (and ~AcquireMailbox)
  CopyStream* streaming() const { return stream_.load(std::memory_order_acquire); }
  std::deque<uint32_t> flying_;               // the batches in flight, oldest first
  std::atomic<bool> fill_stream_on_{false};

  std::mutex plan_mu_;
  std::vector<std::vector<Target>> plan_;  // [source layer]
  std::vector<int> budget_;                // [source layer]
  std::vector<int32_t> ids_, rows_;        // the request being answered
  std::vector<float> x_;                   // [row * hidden + i]

  std::atomic<int32_t> handled_{0};      // the latest request answered, prefetch and all
  std::atomic<uint32_t> published_{0};  // the latest fill batch queued
  std::atomic<uint32_t> landed_{0};     // the latest fill batch landed
  std::atomic<uint64_t> batches_{0}, batch_records_{0};

  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> answered_{0};
  std::atomic<uint64_t> fast_{0};
  std::atomic<uint64_t> ordered_{0}, at_once_{0};
  std::atomic<uint64_t> answer_ns_{0};
  std::thread thread_;
};

}  // namespace es
