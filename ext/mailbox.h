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
//   [kNeedBatch] the fill batch the answer's rows may need (0: none, the numbers skip
//               it): the kernel waits until [kBatchDone] is it or later before its
//               copies and rows
//   [kBatchDone], [kWorkerUp], [kWorkerDown]  written by the fill worker: the latest
//               batch copied, and the generation that started and that ended
//   [kBatch], [kBatchRecords], [kBatchChunks]  the latest fill batch and its copies'
//               counts, [kWorkerStop] the generation to end, written by the host
//   [kIds, kIds + kMaxIds)     ids (int32)
//   [kRows, kRows + kMaxIds)   rows (int32), written by the host
//   [kHidden, kHidden + x_rows * hidden) hidden states, row-major (float32)
// and, from copies_address(), the delivery's StagedCopy entries: row copies, then records;
// from fills_address(), the latest fill batch's.
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
// compute stream ahead of the experts that use it. A fill worker, a kernel of many blocks
// on a stream of its own (engine/device_acquire.py starts one per generation), copies
// fill batches while the compute stream runs: after each request the thread hands the
// worker, as batch b, the staged records into side rows of every layer but the
// request's that no copy of the latest answer reads or writes (ExpertCache::
// deliver_fills). That is safe because when the thread reads request k, every kernel
// queued before k's kernel has run (k's own copies may still run beside the batch), and
// until the next answer that is waited for, kernels read only the rows of k's answer and
// real slots from the hit table; an answer that is waited for names the latest batch
// ([kNeedBatch]) and its kernel waits until that one, or a later one, is copied. One
// batch is outstanding at a time; the worker ends when the thread writes its generation
// to [kWorkerStop], which it does only with no batch outstanding, after kWorkerIdle
// without a request or when asked (stop_worker).
//
// Pool writes: while the mailbox is in use the cache stages them (ExpertCache::
// set_staging), so that neither this thread nor a reader thread calls the CUDA runtime
// while a kernel spins; every answer to an acquire delivers what is staged, and its
// kernels copy it into the pools before the rows are read.
#pragma once

#include <atomic>
#include <cstdint>
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
  static constexpr int kNeedBatch = 71;
  static constexpr int kBatchDone = 96;  // own line: written by the fill worker
  static constexpr int kWorkerUp = 97;
  static constexpr int kWorkerDown = 98;
  static constexpr int kBatch = 128;  // own line: written by the host
  static constexpr int kBatchRecords = 129;
  static constexpr int kBatchChunks = 130;
  static constexpr int kWorkerStop = 131;
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
  // Waits for the answer to a request no kernel waits for (kFast, or a prefetch's), ends
  // the fill worker (stop_worker), answers a request still waited for (rows 0, an error
  // for the host), then stops the thread. Memory a kernel may still read (a request
  // waited for, a worker that did not end) is kept.
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
  // The device address of the latest fill batch's StagedCopy entries (records only).
  uintptr_t fills_address() const { return memory_->device_address() + fills_offset_; }
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

  // Waits until the thread has answered every request posted so far and the fill worker
  // has copied every batch handed to it (registered with the cache as its answer wait:
  // ExpertCache::set_answer_wait).
  void wait() const;

  // The fill worker. worker_wanted(): none was started, or the latest was told to end.
  // start_worker(): the next generation's number, for a worker about to be launched
  // (std::logic_error while one is wanted no more than now: !worker_wanted()); the thread
  // hands it batches once it has written the number to [kWorkerUp]. stop_worker(): asks
  // the thread to end the latest worker and waits up to timeout_s seconds until it has
  // ended (or, never started, will end as soon as it runs: a worker ends at its own stop
  // word or a later generation's); true when so.
  bool worker_wanted() const;
  // Whether the latest worker has started and not ended.
  bool worker_running() const;
  int start_worker();
  bool stop_worker(double timeout_s);
  // Does on the host what the fill worker kernel does, until told to end: the tests'
  // stand-in for it (pools in host memory). `generation` from start_worker().
  void serve_fills(int generation);
  // Fill batches handed to the worker since creation, and their record copies.
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
  StagedCopy* fills() const {
    return reinterpret_cast<StagedCopy*>(memory_->data() + fills_offset_);
  }
  void run();
  void answer(uint32_t seq);
  // Thread: after an answer to a request of MoE layer li with `rows` rows of hidden state
  // (x_), the fills its plan predicts (set_prefetch).
  void prefetch(int li, int rows);
  // Thread: whether the latest worker runs and may take a batch.
  bool worker_ready() const;
  // Thread: hands the worker the fills staged for side rows of layers other than `layer`
  // (the latest request's), when it is ready and has copied the last batch.
  void publish_fills(int layer);
  // Thread: ends the latest worker when asked to, or when `idle`, once it has copied
  // every batch.
  void end_worker(bool idle);

  std::shared_ptr<ExpertCache> cache_;
  int hidden_;
  int max_ids_;
  int x_rows_;
  std::shared_ptr<StagedCopies> staged_;
  size_t copies_offset_ = 0;  // bytes from the mailbox's start
  size_t fills_offset_ = 0;
  size_t capacity_ = 0;       // StagedCopy entries there
  std::unique_ptr<MappedHost> memory_;

  std::mutex plan_mu_;
  std::vector<std::vector<Target>> plan_;  // [source layer]
  std::vector<int> budget_;                // [source layer]
  std::vector<int32_t> ids_, rows_;        // the request being answered
  std::vector<float> x_;                   // [row * hidden + i]

  std::atomic<int32_t> handled_{0};      // the latest request answered, prefetch and all
  std::atomic<uint32_t> published_{0};  // the latest fill batch handed to the worker
  std::atomic<int32_t> worker_gen_{0};   // the latest worker's generation (0: none)
  std::atomic<int32_t> end_wanted_{0};   // stop_worker asked this generation to end
  std::atomic<uint64_t> batches_{0}, batch_records_{0};

  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> answered_{0};
  std::atomic<uint64_t> fast_{0};
  std::atomic<uint64_t> ordered_{0}, at_once_{0};
  std::atomic<uint64_t> answer_ns_{0};
  std::thread thread_;
};

}  // namespace es
