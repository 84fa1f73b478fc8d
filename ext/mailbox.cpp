#include "mailbox.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <pthread.h>
#endif

namespace es {

namespace {

using Clock = std::chrono::steady_clock;

// The thread spins this long after a request, so that the next layer's request is seen
// within a fraction of a microsecond; past it it sleeps between polls (a nap costs the
// next request tens of microseconds: the timer's slack). Longer than a token of a slow
// decode, so that only a pause in generation lets it sleep: a core spins while decoding.
constexpr auto kSpin = std::chrono::milliseconds(100);
constexpr auto kNap = std::chrono::microseconds(20);
// The fill worker ends after this long without a request: a kernel that spins holds its
// blocks' share of the GPU, and its stream cannot be synchronised while it runs (on the
// H200 the compute stream waited for it, docs/benchmarks.md). The next forward starts
// another (a launch).
constexpr auto kWorkerIdle = std::chrono::milliseconds(50);

inline void relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Words the device writes are read with acquire order and words it reads are written
// with release order: the device publishes a request's fields before its sequence
// number (__threadfence_system), and reads the rows only after seeing the reply's.
inline int32_t load(volatile int32_t* p) {
  return __atomic_load_n(const_cast<int32_t*>(p), __ATOMIC_ACQUIRE);
}
inline void store(volatile int32_t* p, int32_t v) {
  __atomic_store_n(const_cast<int32_t*>(p), v, __ATOMIC_RELEASE);
}

// Sequence numbers (batches, generations) wrap: a is b or after it.
inline bool reached(int32_t a, int32_t b) {
  return static_cast<int32_t>(static_cast<uint32_t>(a) - static_cast<uint32_t>(b)) >= 0;
}

}  // namespace

AcquireMailbox::AcquireMailbox(std::shared_ptr<ExpertCache> cache, int hidden, int max_ids,
                               int fill_slots, int tier_slots, int x_rows)
    : cache_(std::move(cache)), hidden_(hidden), max_ids_(max_ids), x_rows_(x_rows) {
  if (hidden < 1) throw std::invalid_argument("mailbox hidden size must be >= 1");
  if (x_rows < 1)
    throw std::invalid_argument("mailbox x_rows must be >= 1, got " + std::to_string(x_rows));
  if (max_ids < 1 || max_ids > kMaxIds)
    throw std::invalid_argument("mailbox max_ids must be in [1, " + std::to_string(kMaxIds) +
                                "], got " + std::to_string(max_ids));
  if (fill_slots < 1)
    throw std::invalid_argument("mailbox fill_slots must be >= 1, got " +
                                std::to_string(fill_slots));
  // A request's misses each take a reserved slot; a promotion is one row copy per segment.
  staged_ = cache_->enable_staging(max_ids + fill_slots, max_ids, tier_slots);
  size_t segments = 1;
  for (int li = 0; li < cache_->num_layers(); ++li)
    segments = std::max(segments, cache_->pool(li).size());
  capacity_ = staged_->capacity(segments, segments * static_cast<size_t>(max_ids));
  const size_t x_floats = static_cast<size_t>(hidden) * static_cast<size_t>(x_rows);
  copies_offset_ = (static_cast<size_t>(kHidden) * sizeof(int32_t) + x_floats * sizeof(float) +
                    255) / 256 * 256;
  fills_offset_ = copies_offset_ + (capacity_ * sizeof(StagedCopy) + 255) / 256 * 256;
  memory_ = std::make_unique<MappedHost>(
      cache_->writer(), fills_offset_ + capacity_ * sizeof(StagedCopy), "the acquire mailbox");
  std::memset(memory_->data(), 0, memory_->bytes());
  const size_t layers = static_cast<size_t>(cache_->num_layers());
  plan_.resize(layers);
  budget_.resize(layers, 0);
  ids_.resize(kMaxIds);
  rows_.resize(kMaxIds);
  x_.resize(x_floats);
  thread_ = std::thread([this] { run(); });
  cache_->set_answer_wait([this] { wait(); });
}

AcquireMailbox::~AcquireMailbox() {
  cache_->set_answer_wait(nullptr);
  // A request no kernel waits for (posted kFast, or a prefetch's) is answered as any
  // other: the cache counts the forward that ran.
  if (load(word(kFast)) != 0 || load(word(kCount)) == 0) wait();
  stop_worker(10.0);
  stop_.store(true, std::memory_order_release);
  thread_.join();
  const int32_t g = worker_gen_.load(std::memory_order_acquire);
  if (g != 0 && !reached(load(word(kWorkerDown)), g)) {
    // A worker launched and never started, or one that hangs: it must find its stop
    // word whenever it runs.
    memory_->abandon();
    return;
  }
  const int32_t request = load(word(kRequest));
  if (request != load(word(kReply))) {
    // A kernel is waiting: answer it with valid rows and fail the forward, and keep the
    // memory, which it reads after this returns.
    cache_->set_stream_error(std::make_exception_ptr(
        std::runtime_error("the acquire mailbox closed while a forward was running")));
    for (int i = 0; i < kMaxIds; ++i) word(kRows)[i] = 0;
    store(word(kRowCopies), 0);
    store(word(kRecordCopies), 0);
    store(word(kChunks), 0);
    store(word(kReply), request);
    memory_->abandon();
    return;
  }
  try {
    cache_->set_staging(false);  // what is staged is written now, and writes go direct
  } catch (const std::exception&) {
    // a failed write leaves rows that no table maps; the next acquire reads them again
  }
}

void AcquireMailbox::set_prefetch(int source, const std::vector<int>& targets,
                                  const std::vector<std::shared_ptr<const Router>>& routers,
                                  int budget) {
  const int layers = cache_->num_layers();
  if (source < 0 || source >= layers)
    throw std::out_of_range("MoE layer " + std::to_string(source) + " out of range [0, " +
                            std::to_string(layers) + ")");
  if (targets.size() != routers.size())
    throw std::invalid_argument("prefetch plan: " + std::to_string(targets.size()) +
                                " targets but " + std::to_string(routers.size()) + " routers");
  std::vector<Target> plan;
  for (size_t i = 0; i < targets.size(); ++i) {
    const int t = targets[i];
    if (t < 0 || t >= layers)
      throw std::out_of_range("prefetch target MoE layer " + std::to_string(t) +
                              " out of range [0, " + std::to_string(layers) + ")");
    const auto& r = routers[i];
    if (!r || r->hidden() != hidden_ || r->num_experts() != cache_->num_experts())
      throw std::invalid_argument("prefetch target MoE layer " + std::to_string(t) +
                                  ": the router must take " + std::to_string(hidden_) +
                                  " inputs and rank " +
                                  std::to_string(cache_->num_experts()) + " experts");
    plan.push_back({t, r});
  }
  if (!plan.empty() && (budget < 1 || budget > cache_->num_experts()))
    throw std::invalid_argument("prefetch budget must be in [1, " +
                                std::to_string(cache_->num_experts()) + "], got " +
                                std::to_string(budget));
  std::lock_guard<std::mutex> lk(plan_mu_);
  plan_[static_cast<size_t>(source)] = std::move(plan);
  budget_[static_cast<size_t>(source)] = budget;
}

void AcquireMailbox::run() {
#if defined(__linux__)
  pthread_setname_np(pthread_self(), "es-mailbox");  // for ps, gdb and /proc
#endif
  // The latest answer, not the latest request: one posted before this thread ran is
  // answered too.
  int32_t seen = load(word(kReply));
  handled_.store(seen, std::memory_order_release);
  auto last = Clock::now();
  int32_t started = 0;
  while (!stop_.load(std::memory_order_acquire)) {
    const int32_t request = load(word(kRequest));
    if (request != seen) {
      answer(static_cast<uint32_t>(request));
      handled_.store(request, std::memory_order_release);
      seen = request;
      last = Clock::now();
      continue;
    }
    // A worker is idle from when it started, not from a request before it.
    const int32_t up = load(word(kWorkerUp));
    if (up != started) {
      started = up;
      last = Clock::now();
    }
    const auto quiet = Clock::now() - last;
    end_worker(quiet >= kWorkerIdle);
    if (quiet < kSpin)
      relax();
    else
      std::this_thread::sleep_for(kNap);
  }
}

void AcquireMailbox::answer(uint32_t seq) {
  const auto t0 = Clock::now();
  // The kernel that posted this request runs after the kernels of every earlier answer,
  // so the copies those delivered are done: their staging slots are free again.
  staged_->completed();
  if (worker_gen_.load(std::memory_order_relaxed) != 0)
    staged_->completed_batches(static_cast<uint32_t>(load(word(kBatchDone))));
  const int li = load(word(kLayer));
  const int n = load(word(kCount));
  const int x_rows = load(word(kXRows));
  const bool fast = load(word(kFast)) != 0;
  const bool valid = li >= 0 && li < cache_->num_layers() && n >= 0 && n <= max_ids_ &&
                     x_rows >= 0 && x_rows <= x_rows_;
  if (valid) {
    for (int i = 0; i < n; ++i) ids_[static_cast<size_t>(i)] = word(kIds)[i];
    const volatile float* x = reinterpret_cast<const volatile float*>(word(kHidden));
    for (size_t i = 0; i < static_cast<size_t>(x_rows) * hidden_; ++i) x_[i] = x[i];
  }
  if (n > 0) {
    const int count = std::min(n, kMaxIds);
    Delivery delivery;
    try {
      if (!valid)
        throw std::logic_error("acquire mailbox: a request for MoE layer " +
                               std::to_string(li) + " with " + std::to_string(n) + " ids and " +
                               std::to_string(x_rows) + " rows of hidden state");
      if (!cache_->staging_on())
        throw std::logic_error("acquire mailbox: a request while pool writes are not staged");
      if (!cache_->acquire(li, ids_.data(), rows_.data(), static_cast<size_t>(n)).empty())
        throw std::logic_error("MoE layer " + std::to_string(li) + ": " + std::to_string(n) +
                               " expert ids exceed the evictable slots in a device acquire "
                               "(pinned after the graph was built?)");
      // A kFast request's kernel has its rows and reads no copies: what its acquire staged
      // (nothing, unless a slot was emptied after the kernel read the table) waits for
      // the next answer that is waited for.
      if (!fast) delivery = cache_->deliver(copies(), capacity_);
    } catch (...) {
      // Valid rows (0) and no copies, so the kernels that read them stay inside the pool;
      // the host raises the error before it uses the forward's result
      // (ExpertCache::set_stream_error). What stays staged is written by the next answer.
      // A kFast request's kernel computed from table rows that hold their experts: its
      // forward is right whatever this acquire met (a read error is counted and its slot
      // stays empty), so nothing is raised for it.
      std::fill(rows_.begin(), rows_.begin() + count, 0);
      delivery = Delivery{};
      if (!fast) cache_->set_stream_error(std::current_exception());
    }
    if (fast) {
      fast_.fetch_add(1, std::memory_order_relaxed);
    } else {
      for (int i = 0; i < count; ++i) word(kRows)[i] = rows_[static_cast<size_t>(i)];
      word(kRowCopies)[0] = static_cast<int32_t>(delivery.rows);
      word(kRecordCopies)[0] = static_cast<int32_t>(delivery.records);
      word(kChunks)[0] = static_cast<int32_t>(delivery.chunks);
      word(kNeedBatch)[0] = static_cast<int32_t>(published_.load(std::memory_order_relaxed));
      ordered_.fetch_add(delivery.rows, std::memory_order_relaxed);
      at_once_.fetch_add(delivery.records, std::memory_order_relaxed);
    }
  }
  store(word(kReply), static_cast<int32_t>(seq));
  answer_ns_.fetch_add(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                 Clock::now() - t0)
                                                 .count()),
                       std::memory_order_relaxed);
  answered_.fetch_add(1, std::memory_order_relaxed);
  if (!valid) return;
  if (x_rows > 0) prefetch(li, x_rows);
  publish_fills(li);
}

void AcquireMailbox::prefetch(int li, int rows) {
  // After the answer, while the device computes this layer: the next request waits for
  // it, so the fills are reserved before any later layer's acquire, as on the CPU stream.
  std::vector<Target> plan;
  int budget;
  {
    std::lock_guard<std::mutex> lk(plan_mu_);
    plan = plan_[static_cast<size_t>(li)];
    budget = budget_[static_cast<size_t>(li)];
  }
  for (const auto& t : plan) {
    try {
      const std::vector<int32_t> top = t.router->top_rows(x_.data(), rows, budget);
      cache_->prefetch(t.layer, top.data(), top.size());
    } catch (const std::exception&) {
      // A failed prediction or reservation only costs the demand reads it would have saved.
    }
  }
}

std::pair<uint32_t, uint32_t> AcquireMailbox::sequence() const {
  return {static_cast<uint32_t>(load(word(kRequest))), static_cast<uint32_t>(load(word(kReply)))};
}

void AcquireMailbox::wait() const {
  // Handled: answered, and its prefetch and fill batch made.
  while (handled_.load(std::memory_order_acquire) != load(word(kRequest)))
    std::this_thread::yield();
  const auto published = static_cast<int32_t>(published_.load(std::memory_order_acquire));
  while (load(word(kBatchDone)) != published) std::this_thread::yield();
}

bool AcquireMailbox::worker_ready() const {
  const int32_t g = worker_gen_.load(std::memory_order_acquire);
  return g != 0 && load(word(kWorkerUp)) == g && load(word(kWorkerStop)) != g;
}

void AcquireMailbox::publish_fills(int layer) {
  const uint32_t last = published_.load(std::memory_order_relaxed);
  if (!worker_ready() || static_cast<uint32_t>(load(word(kBatchDone))) != last) return;
  staged_->completed_batches(last);
  // 0 is no batch (the kernels then read no done word): numbers skip it when they wrap.
  const uint32_t next = last + 1 == 0 ? 1 : last + 1;
  const Delivery d = cache_->deliver_fills(fills(), capacity_, layer, next);
  if (d.records == 0) return;
  store(word(kBatchRecords), static_cast<int32_t>(d.records));
  store(word(kBatchChunks), static_cast<int32_t>(d.chunks));
  published_.store(next, std::memory_order_release);
  store(word(kBatch), static_cast<int32_t>(next));
  batches_.fetch_add(1, std::memory_order_relaxed);
  batch_records_.fetch_add(d.records, std::memory_order_relaxed);
}

void AcquireMailbox::end_worker(bool idle) {
  const int32_t g = worker_gen_.load(std::memory_order_acquire);
  if (g == 0 || load(word(kWorkerStop)) == g) return;
  // Idle only once started: a launch may take a while to run.
  const bool wanted = end_wanted_.load(std::memory_order_acquire) == g;
  if (!wanted && !(idle && load(word(kWorkerUp)) == g)) return;
  if (static_cast<uint32_t>(load(word(kBatchDone))) != published_.load(std::memory_order_relaxed))
    return;
  store(word(kWorkerStop), g);
}

bool AcquireMailbox::worker_wanted() const {
  const int32_t g = worker_gen_.load(std::memory_order_acquire);
  return g == 0 || load(word(kWorkerStop)) == g;
}

bool AcquireMailbox::worker_running() const {
  const int32_t g = worker_gen_.load(std::memory_order_acquire);
  return g != 0 && load(word(kWorkerUp)) == g && load(word(kWorkerDown)) != g;
}

int AcquireMailbox::start_worker() {
  if (!worker_wanted()) throw std::logic_error("a fill worker is running already");
  int32_t g = worker_gen_.load(std::memory_order_acquire) + 1;
  if (g <= 0) g = 1;  // wrapped
  worker_gen_.store(g, std::memory_order_release);
  return g;
}

bool AcquireMailbox::stop_worker(double timeout_s) {
  const int32_t g = worker_gen_.load(std::memory_order_acquire);
  if (g == 0) return true;
  end_wanted_.store(g, std::memory_order_release);
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                         std::chrono::duration<double>(timeout_s));
  // Ended: it wrote its generation down, or it never started and its stop word is set
  // (then it takes no batch and ends as soon as it runs).
  auto ended = [&] {
    return reached(load(word(kWorkerDown)), g) ||
           (!reached(load(word(kWorkerUp)), g) && reached(load(word(kWorkerStop)), g));
  };
  while (!ended()) {
    if (Clock::now() > until) return false;
    std::this_thread::sleep_for(kNap);
  }
  return true;
}

void AcquireMailbox::serve_fills(int generation) {
  store(word(kWorkerUp), generation);
  int32_t done = load(word(kBatchDone));
  for (;;) {
    const int32_t batch = load(word(kBatch));
    if (batch != done) {
      Delivery d;
      d.records = static_cast<uint32_t>(load(word(kBatchRecords)));
      d.chunks = static_cast<uint64_t>(load(word(kBatchChunks)));
      StagedCopies::execute(fills(), d);
      done = batch;
      store(word(kBatchDone), done);
    } else if (reached(load(word(kWorkerStop)), generation)) {
      break;
    } else {
      std::this_thread::yield();
    }
  }
  store(word(kWorkerDown), generation);
}

std::vector<int32_t> AcquireMailbox::post(int layer, const int32_t* ids, int n, const float* x,
                                          int x_rows) {
  if (n < 0 || n > max_ids_)
    throw std::invalid_argument("a mailbox request holds at most " + std::to_string(max_ids_) +
                                " ids, got " + std::to_string(n));
  if (x && (x_rows < 1 || x_rows > x_rows_))
    throw std::invalid_argument("a mailbox request holds 1 to " + std::to_string(x_rows_) +
                                " rows of hidden state, got " + std::to_string(x_rows));
  const int32_t previous = load(word(kRequest));
  while (load(word(kReply)) != previous) std::this_thread::yield();
  // The kernel's lookup (a layer or an id out of range is left to the thread's answer).
  std::vector<int32_t> rows(static_cast<size_t>(n));
  bool fast = n > 0 && layer >= 0 && layer < cache_->num_layers();
  const int32_t* entries = fast ? cache_->hit_entries(layer) : nullptr;
  for (int i = 0; i < n && fast; ++i) {
    const int e = ids[i];
    rows[static_cast<size_t>(i)] =
        e >= 0 && e < cache_->num_experts() ? __atomic_load_n(entries + e, __ATOMIC_ACQUIRE) : -1;
    fast = rows[static_cast<size_t>(i)] >= 0;
  }
  store(word(kLayer), layer);
  store(word(kCount), n);
  store(word(kXRows), x ? x_rows : 0);
  store(word(kFast), fast ? 1 : 0);
  for (int i = 0; i < n; ++i) word(kIds)[i] = ids[i];
  if (x) {
    volatile float* dst = reinterpret_cast<volatile float*>(word(kHidden));
    for (size_t i = 0; i < static_cast<size_t>(x_rows) * hidden_; ++i) dst[i] = x[i];
  }
  const int32_t seq = static_cast<int32_t>(static_cast<uint32_t>(previous) + 1);
  store(word(kRequest), seq);
  if (fast) return rows;
  while (load(word(kReply)) != seq) std::this_thread::yield();
  if (n > 0) {
    // Batches are copied in order, and the thread may hand the worker the next one before
    // this wait reads the done word: waits until the named one is done, or a later one.
    while (!reached(load(word(kBatchDone)), load(word(kNeedBatch)))) std::this_thread::yield();
    Delivery d;
    d.rows = static_cast<uint32_t>(load(word(kRowCopies)));
    d.records = static_cast<uint32_t>(load(word(kRecordCopies)));
    d.chunks = static_cast<uint64_t>(load(word(kChunks)));
    StagedCopies::execute(copies(), d);
  }
  for (int i = 0; i < n; ++i) rows[static_cast<size_t>(i)] = load(word(kRows) + i);
  return rows;
}

}  // namespace es
