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
// Fill batches in flight on the copy stream at most: a batch per answer, so about a
// decode step's MoE layers.
constexpr int kFillDepth = 64;
// The fill stream is polled at most this often: each poll is a CUDA runtime call, and a
// thread that calls the runtime in a tight loop contends for the driver's locks with the
// thread that launches the compute.
constexpr auto kLandEvery = std::chrono::microseconds(20);

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
  memory_ = std::make_unique<MappedHost>(
      cache_->writer(), copies_offset_ + capacity_ * sizeof(StagedCopy), "the acquire mailbox");
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
  stop_.store(true, std::memory_order_release);
  thread_.join();
  const int32_t request = load(word(kRequest));
  const bool waiting = request != load(word(kReply));
  if (waiting) {
    // A kernel is waiting: answer it with valid rows and fail the forward (before the
    // batches below, whose copies may queue behind it).
    cache_->set_stream_error(std::make_exception_ptr(
        std::runtime_error("the acquire mailbox closed while a forward was running")));
    for (int i = 0; i < kMaxIds; ++i) word(kRows)[i] = 0;
    store(word(kRowCopies), 0);
    store(word(kRecordCopies), 0);
    store(word(kChunks), 0);
    store(word(kReply), request);
  }
  // The batches in flight read staging slots and write pool rows: they land first, and
  // their rows are published.
  while (streaming() && streaming()->in_flight() > 0) {
    land();
    std::this_thread::yield();
  }
  if (waiting) {
    memory_->abandon();  // the kernel reads it after this returns
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
  auto polled = last;
  while (!stop_.load(std::memory_order_acquire)) {
    if (CopyStream* cs = streaming(); cs && cs->in_flight() > 0) {
      if (const auto now = Clock::now(); now - polled >= kLandEvery) {
        land();
        polled = now;
      }
    }
    const int32_t request = load(word(kRequest));
    if (request != seen) {
      answer(static_cast<uint32_t>(request));
      handled_.store(request, std::memory_order_release);
      seen = request;
      last = Clock::now();
      continue;
    }
    if (Clock::now() - last < kSpin)
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
  const uint32_t published = published_.load(std::memory_order_acquire);
  while (landed_.load(std::memory_order_acquire) != published) std::this_thread::yield();
}

void AcquireMailbox::set_fill_stream(bool on) {
  if (on && !streaming()) {
    // Made outside the lock the thread's prefetch takes: it makes CUDA calls.
    auto made = std::make_unique<CopyStream>(cache_->writer(), kFillDepth);
    std::lock_guard<std::mutex> lk(plan_mu_);
    if (!fill_stream_) {
      fill_stream_ = std::move(made);
      stream_.store(fill_stream_.get(), std::memory_order_release);
    }
  }
  fill_stream_on_.store(on, std::memory_order_relaxed);
}

void AcquireMailbox::publish_fills(int layer) {
  CopyStream* cs = streaming();
  if (!fill_stream_on_.load(std::memory_order_relaxed) || !cs || cs->full()) return;
  const uint32_t next = published_.load(std::memory_order_relaxed) + 1;  // wraps
  const std::vector<Span> copies = cache_->deliver_fills(layer, next);
  if (copies.empty()) return;
  flying_.push_back(next);
  published_.store(next, std::memory_order_release);
  batches_.fetch_add(1, std::memory_order_relaxed);
  batch_records_.fetch_add(copies.size(), std::memory_order_relaxed);
  try {
    cs->queue(copies);
  } catch (const std::runtime_error&) {
    // In flight all the same: the failure is reported when the batch lands.
  }
}

void AcquireMailbox::land() {
  for (const std::string& error : streaming()->poll()) {
    const uint32_t batch = flying_.front();
    flying_.pop_front();
    // A batch whose copies did not all run leaves its rows empty: the forward that
    // prefetched them computed nothing from them, but the error is the process's to see.
    if (!error.empty())
      cache_->set_stream_error(std::make_exception_ptr(std::runtime_error(error)));
    cache_->fills_landed(batch, error.empty());
    landed_.store(batch, std::memory_order_release);
  }
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
