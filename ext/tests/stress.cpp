// Native stress test of ExpertCache, built by `make asan` (AddressSanitizer + UBSan) and
// `make tsan` (ThreadSanitizer) at the repository root.
//
// One thread drives the cache as the generation thread does: acquire (forward after
// forward, with over-capacity calls streamed through the scratch rows or put in the
// layer scratch with the next layer read ahead), whole-layer calls into either bank of
// the layer scratch, asynchronous
// prefetch with re-predictions of in-flight experts, drains, resets, side-region mode and
// SYNC switches, switches between every eviction policy, router hints for the predictive
// policy, pin/unpin, and read faults: transient ones (one bad
// read: must be invisible) and persistent or hung ones (past the read timeout: must give
// a clean error). Meanwhile two threads poll snapshot() and check(). Every row handed out,
// and after each drain every mapped slot and published side row, is compared byte for byte
// with its record; a late write by a read given up on would show up there. Seeds 3, 7,
// 11, ... stage the pool writes as the acquire kernels need them (staged_copies.h, with a
// host tier of two slots per layer), and the driving thread performs each delivery right
// after its acquire, as the kernels would, checks that every row the hit table then gives
// holds its expert, sometimes copies a fill batch as the mailbox's copy stream would (the fills
// staged for other layers' side rows), and sometimes turns staging off and on (the host
// then writes what is staged).
//
// Usage: stress [seconds=8] [seed=1]. Prints "N operations, M violations" and exits 1 on
// any violation.
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "checksum.h"
#include "errors.h"
#include "expert_cache.h"
#include "staged_copies.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kLayers = 3;
constexpr int kExperts = 8;
constexpr int kStride = 4096;
constexpr double kTimeoutS = 0.1;
constexpr int kHangMs = 250;
// Two segments: (40, 16) uint32 and (1000,) uint8, 3560 bytes of a 4096-byte stride.
constexpr int64_t kSeg0 = 40 * 16 * 4;
constexpr int64_t kSeg1 = 1000;
constexpr int64_t kRecord = kSeg0 + kSeg1;

uint64_t splitmix(uint64_t& x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The record bytes of (layer, expert): distinct for every pair.
std::vector<uint8_t> record_bytes(int layer, int expert) {
  std::vector<uint8_t> r(kRecord);
  uint64_t state = static_cast<uint64_t>(layer) * 1000003u + static_cast<uint64_t>(expert) + 1;
  for (auto& b : r) b = static_cast<uint8_t>(splitmix(state));
  return r;
}

struct Violations {
  std::mutex mu;
  std::vector<std::string> list;
  void add(std::string what) {
    std::lock_guard<std::mutex> lk(mu);
    if (list.size() < 20) std::fprintf(stderr, "VIOLATION: %s\n", what.c_str());
    list.push_back(std::move(what));
  }
  size_t count() {
    std::lock_guard<std::mutex> lk(mu);
    return list.size();
  }
};

class Stress {
 public:
  Stress(const std::string& dir, uint64_t seed) : rng_(seed) {
    for (int l = 0; l < kLayers; ++l) {
      es::LayerSpec L;
      L.layer = 2 * l;  // decoder numbering differs from MoE numbering, as in real models
      L.path = dir + "/layer" + std::to_string(L.layer) + ".blob";
      L.stride = kStride;
      L.record_bytes = kRecord;
      L.segments = {{"a", es::mx::uint32, {40, 16}, 0, kSeg0},
                    {"b", es::mx::uint8, {1000}, kSeg0, kSeg1}};
      std::FILE* f = std::fopen(L.path.c_str(), "wb");
      if (!f) throw std::runtime_error("cannot create " + L.path);
      std::vector<uint8_t> pad(kStride - kRecord, 0);
      for (int e = 0; e < kExperts; ++e) {
        records_[l][e] = record_bytes(l, e);
        L.checksums.push_back(static_cast<uint32_t>(
            ::crc32(0L, records_[l][e].data(), static_cast<uInt>(kRecord))));
        std::fwrite(records_[l][e].data(), 1, kRecord, f);
        std::fwrite(pad.data(), 1, pad.size(), f);
      }
      std::fclose(f);
      paths_.push_back(L.path);
      specs_.push_back(std::move(L));
    }
    es::CacheConfig c;
    c.expert_slots = seed % 2 ? 3 : kExperts;  // even seeds: every expert fits, layers complete
    c.side_slots = 2;
    c.scratch_slots = 2;
    c.decay_every = 7;
    c.top_k = 2;  // calls of 1-2 ids teach the predictive policy, longer ones do not
    c.reader_threads = 2;
    c.read_timeout_s = kTimeoutS;
    // Seeds 1, 4, 5, 8, ...: demand reads through io_uring where the kernel has it;
    // 2, 3, 6, 7, ...: the reader threads (make asan / tsan run one seed of each).
    c.io_uring = (seed / 2) % 2 == 0;
    // Seeds 1, 4, 7, ...: the adaptive prefetch degree (prefetch_throttle.h); the others
    // fill every prediction, which keeps more fills in flight to race.
    c.adaptive_prefetch = seed % 3 == 1;
    cache_ = std::make_unique<es::ExpertCache>(specs_, kExperts, c);
    if (seed % 4 == 3) {
      staging_ = cache_->enable_staging(10, 6, 2);  // a call misses at most 6 experts
      deliveries_.resize(staging_->capacity(2, 16));
      cache_->set_staging(true);
      // As the mailbox's wait: staging off and a reset first see every batch landed.
      cache_->set_answer_wait([this] {
        while (!landing_.empty()) land();
      });
    }
  }

  ~Stress() {
    cache_.reset();
    for (const auto& p : paths_) ::unlink(p.c_str());
  }

  // The mutating thread: returns the number of operations run.
  uint64_t drive(double seconds);
  void poll(const std::atomic<bool>& stop, std::atomic<uint64_t>& polls);
  void finish();
  const char* demand_path() const { return cache_->io_uring() ? "io_uring" : "threads"; }

  Violations violations;
  uint64_t rows_checked = 0, clean_errors = 0, timeouts = 0, faults = 0;

 private:
  int randint(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }

  bool row_holds(int li, int row, int expert) const {
    auto pool = cache_->pool(li);
    const uint8_t* want = records_[li][expert].data();
    return std::memcmp(pool[0].data<uint8_t>() + static_cast<size_t>(row) * kSeg0, want,
                       kSeg0) == 0 &&
           std::memcmp(pool[1].data<uint8_t>() + static_cast<size_t>(row) * kSeg1,
                       want + kSeg0, kSeg1) == 0;
  }
  // Whether row `row` of bank `bank` of layer li's layer scratch holds `expert`.
  void expect_scratch_row(int li, int bank, int row, int expert, const char* what) {
    ++rows_checked;
    auto arrays = cache_->layer_scratch(li, bank);
    const uint8_t* want = records_[li][expert].data();
    if (std::memcmp(arrays[0].data<uint8_t>() + static_cast<size_t>(row) * kSeg0, want, kSeg0) ||
        std::memcmp(arrays[1].data<uint8_t>() + static_cast<size_t>(row) * kSeg1, want + kSeg0,
                    kSeg1))
      violations.add(std::string(what) + ": MoE layer " + std::to_string(li) + " bank " +
                     std::to_string(bank) + " row " + std::to_string(row) +
                     " does not hold expert " + std::to_string(expert));
  }
  void expect_row(int li, int row, int expert, const char* what) {
    ++rows_checked;
    if (!row_holds(li, row, expert))
      violations.add(std::string(what) + ": MoE layer " + std::to_string(li) + " row " +
                     std::to_string(row) + " does not hold expert " + std::to_string(expert));
  }
  void expect_consistent(const char* when) {
    if (auto msg = cache_->check(); !msg.empty()) violations.add(std::string(when) + ": " + msg);
  }
  void verify_all(const char* when);
  void error(int li, const std::exception& e);
  // What the mailbox's copy stream does beside a request of layer li (mailbox.h),
  // sometimes: the fills staged for other layers' side rows, taken as a batch and copied
  // later (a DMA that lands after the requests that follow), then landed.
  void batch(int li) {
    if (!staging_) return;
    if (chance(0.5)) {
      const uint32_t b = ++batches_;
      landing_.emplace_back(b, cache_->deliver_fills(li, b));
    }
    while (!landing_.empty() && chance(0.5)) land();
  }
  void land() {
    for (const auto& s : landing_.front().second) std::memmove(s.dst, s.src, s.bytes);
    cache_->fills_landed(landing_.front().first, true);
    landing_.pop_front();
  }
  // What the acquire kernels do after an answer: every staged copy made (staged seeds);
  // then every row the hit table gives holds its expert, as a kernel that takes its rows
  // from there without an answer reads them.
  void settle() {
    if (!staging_) return;
    staging_->completed();
    es::StagedCopies::execute(deliveries_.data(),
                              cache_->deliver(deliveries_.data(), deliveries_.size()));
    for (int li = 0; li < kLayers; ++li) {
      const int32_t* entries = cache_->hit_entries(li);
      for (int e = 0; e < kExperts; ++e)
        if (const int row = __atomic_load_n(entries + e, __ATOMIC_ACQUIRE); row >= 0)
          expect_row(li, row, e, "the hit table");
    }
  }

  void op_acquire();
  void op_whole();
  void op_prefetch();
  void op_fault();

  std::mt19937_64 rng_;
  std::vector<es::LayerSpec> specs_;
  std::vector<std::string> paths_;
  std::vector<uint8_t> records_[kLayers][kExperts];
  std::unique_ptr<es::ExpertCache> cache_;
  std::shared_ptr<es::StagedCopies> staging_;  // staged seeds
  std::vector<es::StagedCopy> deliveries_;
  uint32_t batches_ = 0;
  std::deque<std::pair<uint32_t, std::vector<es::Span>>> landing_;  // batches not landed yet
  int next_li_ = 0;
  bool hard_[kLayers] = {};       // a fault that may fail reads is armed on the layer
  Clock::time_point hang_until_;  // a hung read may hold a reader thread until then
  std::vector<int32_t> last_prediction_;
};

void Stress::verify_all(const char* when) {
  settle();
  const int cap = cache_->config().expert_slots;
  for (int li = 0; li < kLayers; ++li) {
    auto s = cache_->snapshot(li);
    for (int slot = 0; slot < cap; ++slot)
      if (s.slot_expert[slot] >= 0) expect_row(li, slot, s.slot_expert[slot], when);
    for (size_t r = 0; r < s.side_expert.size(); ++r)
      if (s.side_state[r] == static_cast<uint8_t>(es::RowState::kPublished))
        expect_row(li, cap + static_cast<int>(r), s.side_expert[r], when);
  }
}

void Stress::error(int li, const std::exception& e) {
  // Read errors are clean only where a fault that can fail reads is armed; a timeout
  // anywhere while a hung read may still hold a reader thread.
  bool timeout = dynamic_cast<const es::ReadTimeout*>(&e) != nullptr;
  bool read = dynamic_cast<const es::ReadError*>(&e) != nullptr;
  bool allowed = timeout ? Clock::now() < hang_until_ : read && hard_[li];
  if (!allowed) {
    violations.add(std::string("unexpected error in MoE layer ") + std::to_string(li) + ": " +
                   e.what());
    return;
  }
  ++clean_errors;
  timeouts += timeout;
  expect_consistent("after a read error");
}

void Stress::op_acquire() {
  // Mostly forward order (a wrap starts a new forward), sometimes any layer.
  int li = chance(0.8) ? next_li_ : randint(0, kLayers - 1);
  next_li_ = (li + 1) % kLayers;
  std::vector<int32_t> ids(static_cast<size_t>(randint(1, 6)));
  for (auto& e : ids) e = randint(0, kExperts - 1);
  std::vector<int32_t> local(ids.size(), -2);
  std::vector<int> missing;
  es::ExpertCache::Plan plan;
  try {
    // As one token of top-k = ids.size() (duplicates included: plan only counts them).
    plan = cache_->plan(li, static_cast<int64_t>(ids.size()), static_cast<int>(ids.size()));
  } catch (const std::exception& e) {
    violations.add(std::string("plan raised: ") + e.what());
    return;
  }
  if (plan == es::ExpertCache::kPlanTable) {  // complete: the table must name every row
    const int32_t* table = cache_->table(li).data<int32_t>();
    for (int e = 0; e < kExperts; ++e) expect_row(li, table[e], e, "table");
    return;
  }
  if (chance(0.3)) {  // router probabilities for the predictive policy
    std::vector<float> probs(kExperts);
    float sum = 0.f;
    for (auto& p : probs) sum += p = std::uniform_real_distribution<float>(0.f, 1.f)(rng_);
    for (auto& p : probs) p /= sum;
    cache_->hint(li, probs.data(), probs.size());
  }
  try {
    missing = cache_->acquire(li, ids.data(), local.data(), ids.size());
  } catch (const es::ReadError& e) {
    settle();
    error(li, e);
    return;
  }
  settle();
  batch(li);
  if (plan == es::ExpertCache::kPlanStream && !missing.empty())
    violations.add("plan said stream-ordered but the call was over capacity");
  for (size_t i = 0; i < ids.size(); ++i) {
    if (local[i] >= 0) {
      expect_row(li, local[i], ids[i], "acquire");
    } else if (local[i] != -1) {
      violations.add("acquire left an entry unset");
    }
  }
  if (!missing.empty() && !staging_ && chance(0.5)) {  // the layer scratch (CUDA's path)
    std::vector<int> resident, rows_of;
    for (size_t i = 0; i < ids.size(); ++i)
      if (local[i] >= 0 && std::find(resident.begin(), resident.end(), ids[i]) == resident.end()) {
        resident.push_back(ids[i]);
        rows_of.push_back(local[i]);
      }
    std::vector<int> rows;
    try {
      rows = cache_->load_layer(li, missing, resident, rows_of);
    } catch (const es::ReadError& e) {
      error(li, e);
      return;
    }
    std::vector<int> all = missing;
    all.insert(all.end(), resident.begin(), resident.end());
    for (size_t i = 0; i < all.size(); ++i) expect_scratch_row(li, 0, rows[i], all[i], "layer scratch");
    if (chance(0.5)) {  // the next layer's predicted misses, read while "it computes"
      std::vector<int> predicted;
      for (int k = randint(1, 6); k > 0; --k) predicted.push_back(randint(0, kExperts - 1));
      cache_->read_ahead((li + 1) % kLayers, predicted);
    }
    return;
  }
  const int scratch = cache_->config().scratch_slots;
  for (size_t start = 0; start < missing.size(); start += static_cast<size_t>(scratch)) {
    std::vector<int> chunk(missing.begin() + static_cast<long>(start),
                           missing.begin() + static_cast<long>(std::min(
                                                 missing.size(), start + scratch)));
    std::vector<int> rows;
    try {
      rows = cache_->load_scratch(li, chunk);
    } catch (const es::ReadError& e) {
      error(li, e);
      return;
    }
    for (size_t i = 0; i < chunk.size(); ++i) expect_row(li, rows[i], chunk[i], "scratch");
  }
}

void Stress::op_whole() {
  // A long prompt's call: its whole layer into a bank, maybe read ahead by the call
  // before (possibly for another layer, whose read-ahead is then given up).
  int li = randint(0, kLayers - 1), bank = randint(0, 1);
  if (chance(0.6)) cache_->read_layer(chance(0.8) ? li : randint(0, kLayers - 1), bank);
  try {
    cache_->load_whole(li, bank);
  } catch (const es::ReadError& e) {
    error(li, e);
    return;
  }
  for (int e = 0; e < kExperts; ++e) expect_scratch_row(li, bank, e, e, "whole layer");
  if (chance(0.5)) cache_->read_layer((li + 1) % kLayers, 1 - bank);
}

void Stress::op_prefetch() {
  int li = randint(0, kLayers - 1);
  std::vector<int32_t> ids;
  if (!last_prediction_.empty() && chance(0.5))
    ids = last_prediction_;  // re-predict experts whose fills may still be in flight
  for (int k = randint(1, 4); k > 0; --k) ids.push_back(randint(0, kExperts - 1));
  if (chance(0.3)) ids.insert(ids.end(), ids.begin(), ids.end());  // duplicates
  cache_->prefetch(li, ids.data(), ids.size());
  last_prediction_ = ids;
}

void Stress::op_fault() {
  int li = randint(0, kLayers - 1);
  int expert = chance(0.5) ? -1 : randint(0, kExperts - 1);
  double p = std::uniform_real_distribution<double>(0, 1)(rng_);
  ++faults;
  if (p < 0.6) {  // transient: one bad read, retried or re-read: must be invisible
    static const es::Fault kinds[] = {es::Fault::kEIO, es::Fault::kShortRead,
                                      es::Fault::kCorrupt};
    if (!hard_[li]) cache_->inject_fault(li, kinds[randint(0, 2)], expert, 1, 0);
  } else if (p < 0.8) {  // persistent for a while: reads fail after their retry
    static const es::Fault kinds[] = {es::Fault::kEIO, es::Fault::kShortRead,
                                      es::Fault::kCorrupt};
    cache_->inject_fault(li, kinds[randint(0, 2)], expert, randint(2, 6), 0);
    hard_[li] = true;
  } else if (p < 0.83) {  // a read hanging past the timeout
    cache_->inject_fault(li, es::Fault::kDelay, -1, 1, kHangMs);  // the next read
    hang_until_ = Clock::now() + std::chrono::milliseconds(3 * kHangMs);
  } else {  // the fault is gone
    cache_->inject_fault(li, es::Fault::kNone, -1, 0, 0);
    hard_[li] = false;
  }
}

uint64_t Stress::drive(double seconds) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  uint64_t ops = 0;
  while (Clock::now() < deadline) {
    double p = std::uniform_real_distribution<double>(0, 1)(rng_);
    try {
      if (p < 0.38) {
        op_acquire();
      } else if (p < 0.42) {
        if (!staging_) op_whole();
      } else if (p < 0.68) {
        op_prefetch();
      } else if (p < 0.75) {
        cache_->drain();
        if (cache_->inflight() != 0) violations.add("fills in flight after a drain");
        verify_all("after a drain");
      } else if (p < 0.77) {
        cache_->reset();
        if (cache_->inflight() != 0) violations.add("fills in flight after a reset");
        if (cache_->config().expert_slots == kExperts && chance(0.5)) {  // as engine.model.load does
          int li = randint(0, kLayers - 1);
          try {
            cache_->fill(li);
          } catch (const es::ReadError& err) {
            error(li, err);
          }
          verify_all("after a fill");
        }
      } else if (p < 0.81) {
        cache_->set_side_lfu(chance(0.5));
      } else if (p < 0.83) {
        cache_->set_sync(chance(0.3));
      } else if (p < 0.84) {
        cache_->set_policy(static_cast<es::Policy>(randint(0, 4)));
        if (staging_ && chance(0.5)) {  // the host writes what is staged, then stages again
          staging_->completed();
          cache_->set_staging(false);
          verify_all("after staging off");
          cache_->set_staging(true);
        }
      } else if (p < 0.90) {
        int li = randint(0, kLayers - 1), e = randint(0, kExperts - 1);
        try {
          cache_->pin(li, e);
          settle();
          auto s = cache_->snapshot(li);
          for (int slot = 0; slot < cache_->config().expert_slots; ++slot)
            if (s.slot_expert[slot] == e) expect_row(li, slot, e, "pin");
        } catch (const es::ReadError& err) {
          error(li, err);
        } catch (const std::invalid_argument&) {
          // would leave no evictable slot: refused, nothing changed
        }
      } else if (p < 0.94) {
        cache_->unpin(randint(0, kLayers - 1), randint(0, kExperts - 1));
      } else {
        op_fault();
      }
    } catch (const std::exception& e) {
      violations.add(std::string("unexpected exception: ") + e.what());
    }
    expect_consistent("after an operation");
    ++ops;
  }
  return ops;
}

void Stress::poll(const std::atomic<bool>& stop, std::atomic<uint64_t>& polls) {
  const int cap = cache_->config().expert_slots, spec = cache_->config().side_slots;
  while (!stop.load()) {
    if (auto msg = cache_->check(); !msg.empty()) violations.add("poller: " + msg);
    for (int li = 0; li < kLayers; ++li) {
      auto s = cache_->snapshot(li);
      if (static_cast<int>(s.slot_expert.size()) != cap ||
          static_cast<int>(s.side_state.size()) != 2 * spec)
        violations.add("poller: snapshot has the wrong shape");
      for (size_t r = 0; r < s.side_state.size(); ++r) {
        bool free = s.side_state[r] == 0;
        if (free != (s.side_expert[r] < 0) || s.side_state[r] > 2)
          violations.add("poller: side row " + std::to_string(r) + " owner/state mismatch");
      }
      for (int slot = 0; slot < cap; ++slot) {
        if (s.slot_state[slot] > 4) violations.add("poller: bad slot state");
        for (int other = 0; other < slot; ++other)
          if (s.slot_expert[slot] >= 0 && s.slot_expert[slot] == s.slot_expert[other])
            violations.add("poller: expert " + std::to_string(s.slot_expert[slot]) +
                           " in two slots");
      }
    }
    (void)cache_->inflight();
    (void)cache_->forward();
    ++polls;
    std::this_thread::sleep_for(std::chrono::microseconds(50));  // the app polls, not spins
  }
}

void Stress::finish() {
  for (int li = 0; li < kLayers; ++li) cache_->inject_fault(li, es::Fault::kNone, -1, 0, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(2 * kHangMs));  // hung reads return
  cache_->drain();
  if (cache_->inflight() != 0) violations.add("fills in flight at the end");
  expect_consistent("at the end");
  verify_all("at the end");
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = argc > 1 ? std::atof(argv[1]) : 8.0;
  uint64_t seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1;
  char tmpl[] = "/tmp/expertstream-stress-XXXXXX";
  if (!::mkdtemp(tmpl)) {
    std::perror("mkdtemp");
    return 2;
  }
  const auto t0 = Clock::now();
  uint64_t ops = 0, violations = 0;
  std::atomic<uint64_t> polls{0};
  {
    Stress stress(tmpl, seed);
    std::atomic<bool> stop{false};
    std::vector<std::thread> pollers;
    for (int i = 0; i < 2; ++i) pollers.emplace_back([&] { stress.poll(stop, polls); });
    // Large buffers checked at the same time, so the sanitizers see the split crc's
    // helper threads work for several callers at once (the cache's records are small).
    std::atomic<uint64_t> crc_errors{0};
    for (int i = 0; i < 2; ++i)
      pollers.emplace_back([&, i] {
        std::vector<uint8_t> buf(es::kSplitBytes + 3 * es::kChunkBytes + 17 * (i + 1));
        std::mt19937 rng(static_cast<uint32_t>(seed + i));
        while (!stop) {
          for (auto& b : buf) b = static_cast<uint8_t>(rng());
          const auto want = static_cast<uint32_t>(
              ::crc32(0L, buf.data(), static_cast<uInt>(buf.size())));
          if (es::record_crc32(buf.data(), buf.size()) != want) ++crc_errors;
        }
      });
    ops = stress.drive(seconds);
    stress.finish();
    stop = true;
    for (auto& t : pollers) t.join();
    violations = stress.violations.count() + crc_errors.load();
    std::printf(
        "%llu operations, %llu violations (%llu polls, %llu rows verified, %llu faults "
        "injected, %llu clean read errors of which %llu timeouts, demand reads by %s, "
        "%.1f s)\n",
        static_cast<unsigned long long>(ops), static_cast<unsigned long long>(violations),
        static_cast<unsigned long long>(polls.load()),
        static_cast<unsigned long long>(stress.rows_checked),
        static_cast<unsigned long long>(stress.faults),
        static_cast<unsigned long long>(stress.clean_errors),
        static_cast<unsigned long long>(stress.timeouts), stress.demand_path(),
        std::chrono::duration<double>(Clock::now() - t0).count());
  }
  ::rmdir(tmpl);
  return violations == 0 ? 0 : 1;
}
