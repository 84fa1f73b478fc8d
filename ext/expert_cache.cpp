#include "expert_cache.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <unordered_map>
#include <utility>

#include "errors.h"
#include "read_batch.h"
#include "slot_state.h"

namespace es {

namespace {

// The float segments of a record, which BlobFile checks for NaN and infinity with each
// record's crc32 (exponent bits of float16, bfloat16, float32).
std::vector<FloatSpan> float_spans(const std::vector<Segment>& segments) {
  std::vector<FloatSpan> spans;
  for (const auto& seg : segments) {
    int width = 0;
    uint32_t exponent = 0;
    if (seg.dtype == mx::float16) {
      width = 2, exponent = 0x7C00;
    } else if (seg.dtype == mx::bfloat16) {
      width = 2, exponent = 0x7F80;
    } else if (seg.dtype == mx::float32) {
      width = 4, exponent = 0x7F800000;
    } else {
      continue;
    }
    spans.push_back({seg.key, seg.offset, seg.nbytes / width, width, exponent});
  }
  return spans;
}

// demand_read's landed[i] for a record staged from the host tier (1: read).
constexpr uint8_t kLandedFromTier = 2;

void check_layer(int li, int n) {
  if (li < 0 || li >= n)
    throw std::out_of_range("MoE layer index " + std::to_string(li) + " out of range [0, " +
                            std::to_string(n) + ")");
}

// `given` (one value per MoE layer), or `uniform` for each of `layers` when it is empty.
std::vector<int> per_layer(const std::vector<int>& given, int uniform, size_t layers,
                           const std::string& what) {
  if (given.empty()) return std::vector<int>(layers, uniform);
  if (given.size() != layers)
    throw std::invalid_argument(what + " per layer: " + std::to_string(given.size()) +
                                " values for " + std::to_string(layers) + " MoE layers");
  return given;
}

}  // namespace

// A prefetch fill's state: Pending -> Copying by its reader (compare-exchange, so the copy
// runs without the cache mutex); Pending -> Failed by its reader or Pending -> Abandoned
// by a timed-out drain, under the cache mutex. The one that leaves Pending other than to
// Copying releases the side row.
struct ExpertCache::FillTicket {
  std::atomic<int> state{kPending};
  std::atomic<bool> reading{false};  // a reader thread took the fill (it is not queued)
};

int io_uring_depth(int reader_threads, int top_k, int64_t stride) {
  const int64_t wanted =
      std::min<int64_t>(std::max(top_k, 8), kIoUringExtraBytes / std::max<int64_t>(stride, 1));
  return static_cast<int>(std::max<int64_t>(std::max(reader_threads, 1) + 1, wanted));
}

size_t planned_bytes(const std::vector<int>& rows, const std::vector<int64_t>& record_bytes,
                     int num_experts, int reader_threads, int64_t stride, int io_uring_depth) {
  if (rows.size() != record_bytes.size())
    throw std::invalid_argument("planned_bytes: " + std::to_string(rows.size()) + " rows for " +
                                std::to_string(record_bytes.size()) + " record sizes");
  if (rows.empty()) return 0;
  size_t total = 0;
  for (size_t li = 0; li < rows.size(); ++li)
    total += static_cast<size_t>(rows[li]) * static_cast<size_t>(record_bytes[li]) +
             sizeof(int32_t) * static_cast<size_t>(num_experts);
  const auto buffer = static_cast<size_t>(stride);
  total += static_cast<size_t>(reader_threads) * AlignedBuffer::allocated_bytes(buffer);
  if (io_uring_depth > 0)
    total += IoRing::region_bytes(static_cast<unsigned>(io_uring_depth), buffer);
  return total;
}

ExpertCache::ExpertCache(std::vector<LayerSpec> layers, int num_experts, CacheConfig config)
    : layers_(std::move(layers)),
      num_experts_(num_experts),
      config_(config),
      pending_lfu_(config.side_lfu),
      side_lfu_(config.side_lfu),
      sync_(config.sync) {
  if (num_experts_ < 1) throw std::invalid_argument("num_experts must be >= 1");
  slots_ = per_layer(config_.layer_slots, config_.expert_slots, layers_.size(), "expert slots");
  for (int c : slots_)
    if (c < 1 || c > num_experts_)
      throw std::invalid_argument("expert slots must be in [1, " +
                                  std::to_string(num_experts_) + "], got " + std::to_string(c));
  side_slots_ =
      per_layer(config_.layer_side_slots, config_.side_slots, layers_.size(), "side rows");
  throttle_ = PrefetchThrottle(side_slots_, config_.adaptive_prefetch);
  // config.side_slots is the widest layer's (snapshots are padded to it) and the
  // prediction size
  for (int sp : side_slots_)
    if (sp < 0 || sp > config_.side_slots)
      throw std::invalid_argument("side rows per layer must be in [0, " +
                                  std::to_string(config_.side_slots) + "], got " +
                                  std::to_string(sp));
  if (config_.scratch_slots < 1) throw std::invalid_argument("scratch rows must be >= 1");
  if (config_.top_k < 0) throw std::invalid_argument("top_k must be >= 0");
  if (config_.io_uring_depth < 0 || config_.io_uring_depth > kMaxIoUringDepth)
    throw std::invalid_argument("io_uring_depth must be in [0, " +
                                std::to_string(kMaxIoUringDepth) + "], got " +
                                std::to_string(config_.io_uring_depth));
  if (!(config_.read_timeout_s >= 0 && config_.read_timeout_s <= kMaxReadTimeoutS))
    throw std::invalid_argument("read_timeout_s must be in [0, " +
                                std::to_string(static_cast<int>(kMaxReadTimeoutS)) +
                                "] seconds, got " + std::to_string(config_.read_timeout_s));
  // A positive timeout below half a millisecond still waits (1 ms), never forever.
  read_timeout_ms_ = static_cast<int>(std::lround(config_.read_timeout_s * 1000));
  if (config_.read_timeout_s > 0 && read_timeout_ms_ == 0) read_timeout_ms_ = 1;
  for (size_t li = 0; li < layers_.size(); ++li) {
    const int rows = this->rows(static_cast<int>(li));
    const auto& L = layers_[li];
    files_.push_back(std::make_unique<BlobFile>(L.path, L.layer, num_experts_, L.stride,
                                                L.record_bytes, L.checksums, config_.uncached_io,
                                                float_spans(L.segments), L.sources));
    std::vector<mx::array> arrays;
    std::vector<uint8_t*> ptrs;
    int64_t end = 0;
    for (const auto& seg : L.segments) {
      if (seg.offset != end || seg.nbytes <= 0)
        throw std::invalid_argument(L.path + ": segment " + seg.key + " offset/size mismatch");
      end += seg.nbytes;
      mx::array a = segment_rows(L, seg, rows, std::to_string(rows) + " pool rows");
      if (li == 0 && arrays.empty()) writer_ = PoolWriter(a.data<uint8_t>());
      writer_.zero(a.data<uint8_t>(), a.nbytes());
      ptrs.push_back(a.data<uint8_t>());
      arrays.push_back(std::move(a));
    }
    if (end != L.record_bytes)
      throw std::invalid_argument(L.path + ": segments sum to " + std::to_string(end) +
                                  " bytes, record_bytes is " + std::to_string(L.record_bytes));
    std::vector<std::pair<const uint8_t*, const uint8_t*>> ranges;
    for (size_t s = 0; s < ptrs.size(); ++s) {
      const size_t n = static_cast<size_t>(L.segments[s].nbytes);
      ranges.emplace_back(ptrs[s], ptrs[s] + static_cast<size_t>(rows) * n);
      // The side rows only: scratch rows follow them.
      const size_t side_end = static_cast<size_t>(slots_[li] + 2 * side_slots_[li]);
      side_ranges_.push_back({ptrs[s] + static_cast<size_t>(slots_[li]) * n,
                              ptrs[s] + side_end * n, static_cast<int>(li), n});
    }
    pools_.push_back(std::move(arrays));
    pool_ptrs_.push_back(std::move(ptrs));
    pool_ranges_.push_back(std::move(ranges));
    real_.emplace_back(slots_[li], num_experts_, config_.policy, config_.decay_every);
    side_.push_back(side_ledgers(static_cast<int>(li), side_lfu_));
    loading_.emplace_back(slots_[li], 0);
    mx::array table = int32_values(num_experts_, L.path + " expert table");
    std::fill_n(table.data<int32_t>(), num_experts_, -1);
    tables_.push_back(std::move(table));
    complete_.push_back(0);
    fill_tickets_.emplace_back(2 * static_cast<size_t>(side_slots_[li]));
  }
  std::sort(side_ranges_.begin(), side_ranges_.end(),
            [](const SideRange& a, const SideRange& b) { return a.lo < b.lo; });
  stats_.resize(layers_.size());
  last_experts_.resize(layers_.size());
  last_forward_.assign(layers_.size(), 0);
  hits_stale_.assign(layers_.size(), 1);
  router_hint_.resize(layers_.size());
  readers_ = std::make_unique<ReaderPool>(config_.reader_threads);
  if (config_.io_uring && !layers_.empty()) {
    int64_t stride = 0;
    for (const auto& L : layers_) stride = std::max(stride, L.stride);
    const int depth = config_.io_uring_depth > 0
                          ? config_.io_uring_depth
                          : io_uring_depth(config_.reader_threads, config_.top_k, stride);
    ring_ = RingReader::create(static_cast<unsigned>(depth), static_cast<size_t>(stride),
                               &writer_);
  }
  auto unused = [this](int li, uint64_t records) {
    std::lock_guard<std::mutex> lk(mu_);
    stats_[static_cast<size_t>(li)].bytes_read +=
        records * static_cast<uint64_t>(layers_[static_cast<size_t>(li)].stride);
  };
  scratch_ = std::make_unique<LayerScratch>(
      LayerScratch::Io{layers_, files_, *readers_, read_clock_, writer_, host_writer_,
                       num_experts_, config_.reader_threads, config_.verify_checksums,
                       read_timeout_ms_},
      unused);
}

std::shared_ptr<StagedCopies> ExpertCache::enable_staging(int slots, int reserve,
                                                          int tier_slots) {
  std::lock_guard<std::mutex> lk(mu_);
  if (staged_) throw std::logic_error("pool writes are already staged for this cache");
  staged_ = std::make_shared<StagedCopies>(writer_, staging_slot_bytes(), slots, reserve,
                                           num_layers(), tier_slots, num_experts_,
                                           config_.policy);
  scratch_->set_tier(staged_);
  throttle_.staged();  // fills now reach the pools as copies on the compute stream
  hit_table_ = std::make_unique<MappedHost>(
      writer_, layers_.size() * static_cast<size_t>(num_experts_) * sizeof(int32_t),
      "the hit table");
  unmap_hits_locked();
  return staged_;
}

uintptr_t ExpertCache::hit_table_address() const {
  if (!hit_table_) throw std::logic_error("hit_table_address before enable_staging");
  return hit_table_->device_address();
}

const int32_t* ExpertCache::hit_entries(int li) const {
  check_layer(li, num_layers());
  if (!hit_table_) throw std::logic_error("hit_entries before enable_staging");
  return reinterpret_cast<const int32_t*>(hit_table_->data()) +
         static_cast<size_t>(li) * static_cast<size_t>(num_experts_);
}

void ExpertCache::unmap_hits_locked() {
  if (!hit_table_) return;
  // Stored through atomics: a kernel may read the entries meanwhile (-1 is always safe).
  auto* table = reinterpret_cast<int32_t*>(hit_table_->data());
  const size_t n = layers_.size() * static_cast<size_t>(num_experts_);
  for (size_t i = 0; i < n; ++i) __atomic_store_n(table + i, -1, __ATOMIC_RELAXED);
  std::fill(hits_stale_.begin(), hits_stale_.end(), 1);
}

void ExpertCache::unmap_layer_locked(int li) {
  auto* entries = reinterpret_cast<int32_t*>(hit_table_->data()) +
                  static_cast<size_t>(li) * static_cast<size_t>(num_experts_);
  for (int e = 0; e < num_experts_; ++e) __atomic_store_n(entries + e, -1, __ATOMIC_RELEASE);
  hits_stale_[li] = 1;
}

void ExpertCache::evict_locked(int li, int slot) {
  auto& R = real_[li];
  const int e = R.expert_at(slot);
  if (e >= 0 && hit_table_) {
    auto* entry = reinterpret_cast<int32_t*>(hit_table_->data()) +
                  static_cast<size_t>(li) * static_cast<size_t>(num_experts_) + e;
    __atomic_store_n(entry, -1, __ATOMIC_RELEASE);
  }
  R.clear(slot);
  hits_stale_[li] = 1;
}

Delivery ExpertCache::deliver(StagedCopy* out, size_t capacity) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!staged_) throw std::logic_error("deliver before enable_staging");
  const Delivery d = staged_->deliver(out, capacity);
  // Staging off leaves every entry -1 (the host paths write the pools themselves).
  if (!staging_on()) return d;
  auto* table = reinterpret_cast<int32_t*>(hit_table_->data());
  for (size_t li = 0; li < layers_.size(); ++li) {
    if (!hits_stale_[li]) continue;
    hits_stale_[li] = 0;
    const auto& R = real_[li];
    int32_t* row = table + li * static_cast<size_t>(num_experts_);
    for (int e = 0; e < num_experts_; ++e) {
      const int slot = R.slot_of(e);
      __atomic_store_n(row + e, slot >= 0 && !loading_[li][slot] ? slot : -1, __ATOMIC_RELAXED);
    }
  }
  return d;
}

std::vector<Span> ExpertCache::deliver_fills(int layer, uint32_t batch) {
  if (!staged_) throw std::logic_error("deliver_fills before enable_staging");
  std::lock_guard<std::mutex> lk(mu_);
  // The side row a pool address is in: (MoE layer, gen, row), or layer -1.
  auto side_row = [&](const uint8_t* dst) {
    auto it = std::upper_bound(side_ranges_.begin(), side_ranges_.end(), dst,
                               [](const uint8_t* p, const SideRange& r) { return p < r.lo; });
    if (it == side_ranges_.begin() || dst >= (--it)->hi) return std::array<int, 3>{-1, 0, 0};
    // Pool row slots + g * side + r is row r of ledger g; LFU keeps one ledger of both.
    const int i = static_cast<int>(static_cast<size_t>(dst - it->lo) / it->row_bytes);
    const int side = side_[it->layer].size() == 1 ? 2 * side_slots_[it->layer]
                                                    : side_slots_[it->layer];
    return std::array<int, 3>{it->layer, i / side, i % side};
  };
  // Only a published row: one still in flight is a reader's fill whose copy is staged and
  // whose publication is under way (this lock waits for it), which a later batch takes.
  auto take = [&](const uint8_t* dst) {
    const auto [li, gen, row] = side_row(dst);
    return li >= 0 && li != layer &&
           side_[li][gen].state(row) == RowState::kPublished;
  };
  std::vector<Span> copies = staged_->deliver_batch(take, batch);
  for (const auto& c : copies) {
    const auto [li, gen, row] = side_row(c.dst);
    auto& S = side_[li][gen];
    const int expert = S.expert_at(row);
    // The record's first segment withdraws the row; its others find it withdrawn.
    if (S.withdraw(expert, row)) batched_rows_.push_back({batch, li, gen, expert, row});
  }
  return copies;
}

bool ExpertCache::in_batch(int li, int gen, int row) const {
  return std::any_of(batched_rows_.begin(), batched_rows_.end(), [&](const BatchedRow& b) {
    return b.layer == li && b.gen == gen && b.row == row;
  });
}

void ExpertCache::fills_landed(uint32_t batch, bool ok) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    // Batches land in order and fewer than 2^31 are ever outstanding: a row's batch has
    // landed when it is not after this one.
    size_t kept = 0;
    for (const auto& b : batched_rows_) {
      if (static_cast<int32_t>(batch - b.batch) < 0) {
        batched_rows_[kept++] = b;
        continue;
      }
      auto& S = side_[b.layer][b.gen];
      if (ok) {
        S.publish(b.expert, b.row);
      } else {
        S.abandon(b.expert, b.row);
        ++stats_[b.layer].prefetch_wasted;
      }
    }
    batched_rows_.resize(kept);
  }
  drained_cv_.notify_all();  // a host acquire may wait for one of these rows
  staged_->completed_batches(batch);
}

void ExpertCache::set_answer_wait(std::function<void()> wait) {
  std::lock_guard<std::mutex> lk(answer_wait_mu_);
  answer_wait_ = std::move(wait);
}

void ExpertCache::wait_for_answers() {
  std::lock_guard<std::mutex> lk(answer_wait_mu_);
  if (answer_wait_) answer_wait_();
}

size_t ExpertCache::staging_slot_bytes() const {
  size_t bytes = 0;
  for (const auto& L : layers_)
    bytes = std::max(bytes, StagedCopies::slot_size(L.record_bytes, L.segments.size()));
  return bytes;
}

void ExpertCache::set_staging(bool on) {
  if (on && !staged_) throw std::logic_error("set_staging(true) before enable_staging");
  if (!on) wait_for_answers();
  if (!staged_ || on == staging_on()) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    unmap_hits_locked();
  }
  // The new setting first, then the fills that may have seen the old one land (a fill
  // is in flight from its reservation to its publication, so drain waits for it), then
  // what is staged is written.
  staging_on_.store(on, std::memory_order_release);
  drain();
  if (!on) staged_->flush(writer_);
}

ExpertCache::~ExpertCache() {
  drain();
  readers_.reset();
}

int ExpertCache::read_gen() const { return side_lfu_ ? 0 : static_cast<int>((forward_ + 1) % 2); }
int ExpertCache::fill_gen() const { return side_lfu_ ? 0 : static_cast<int>(forward_ % 2); }

std::vector<SideLedger> ExpertCache::side_ledgers(int li, bool lfu) const {
  // Persistent LFU mode: one ledger over both banks' rows (2 x side), so the rows the double
  // buffer needs hold predicted experts too: fewer fills and fewer misses per decode token
  // than two banks filled in turn. Row r of ledger g is pool row slots + g * side + r either
  // way.
  const int side = side_slots_[li];
  if (lfu) return {SideLedger(2 * side, num_experts_)};
  return {SideLedger(side, num_experts_), SideLedger(side, num_experts_)};
}

std::vector<Span> ExpertCache::row_spans(int li, int row) const {
  const auto& L = layers_[li];
  std::vector<Span> spans;
  for (size_t s = 0; s < L.segments.size(); ++s) {
    const auto& seg = L.segments[s];
    spans.push_back({pool_ptrs_[li][s] + static_cast<size_t>(row) * seg.nbytes, nullptr,
                     static_cast<size_t>(seg.nbytes), static_cast<int>(s)});
  }
  return spans;
}

bool ExpertCache::stage_from_tier(int li, int expert, int row) {
  if (!staging_on() || staged_->tier_slots() == 0) return false;
  return staged_->stage_cached(li, expert, row_spans(li, row));
}

bool ExpertCache::copy_from_tier(int li, int expert, const std::vector<Span>& to) {
  return staged_ && staged_->copy_cached(li, {expert}, {to}, writer_)[0];
}

void ExpertCache::copy_record(int li, int expert, const uint8_t* buf, int row, Write how) {
  const auto& L = layers_[li];
  std::vector<Span> spans = row_spans(li, row);
  for (size_t s = 0; s < spans.size(); ++s) spans[s].src = buf + L.segments[s].offset;
  try {
    if (how != Write::kDirect && staging_on_.load(std::memory_order_acquire)) {
      if (!staged_->stage_record(spans, how == Write::kDemand, li, expert))
        throw StagingFull("no staging slot free for a " +
                          std::string(how == Write::kDemand ? "demand read" : "prefetch fill"));
      return;
    }
    writer_.copy(spans);
    // A record read while writes are direct (prefill, or no acquire kernels yet) is kept
    // in the host tier too, so that a later miss of it is not read again.
    if (staged_ && staged_->tier_slots() > 0) staged_->keep(spans, li, expert);
  } catch (const StagingFull&) {
    throw;
  } catch (const std::exception& e) {
    throw ReadError(L.path + " (layer " + std::to_string(L.layer) + ", row " +
                    std::to_string(row) + "): " + e.what());
  }
}

void ExpertCache::copy_row(int li, int from, int to, Write how) {
  const auto& L = layers_[li];
  std::vector<Span> spans;
  spans.reserve(L.segments.size());
  for (size_t s = 0; s < L.segments.size(); ++s) {
    const auto n = static_cast<size_t>(L.segments[s].nbytes);
    spans.push_back({pool_ptrs_[li][s] + static_cast<size_t>(to) * n,
                     pool_ptrs_[li][s] + static_cast<size_t>(from) * n, n, static_cast<int>(s)});
  }
  if (how != Write::kDirect && staging_on_.load(std::memory_order_acquire))
    staged_->stage_rows(spans);
  else
    writer_.copy(spans);
}

std::exception_ptr ExpertCache::demand_read(int li, const std::vector<std::pair<int, int>>& loads,
                                            std::vector<uint8_t>& landed, ReadTally* tally,
                                            Write how) {
  const auto t0 = std::chrono::steady_clock::now();
  const size_t n = loads.size();
  landed.assign(n, 0);
  if (n == 0) return nullptr;
  // What the host tier holds is staged from there (copied at once, in one write, where
  // staging is off); the rest is read.
  std::vector<uint8_t> from_tier(n, 0);
  if (how != Write::kDirect && staging_on()) {
    for (size_t i = 0; i < n; ++i)
      from_tier[i] = stage_from_tier(li, loads[i].first, loads[i].second);
  } else if (staged_ && staged_->tier_slots() > 0) {
    std::vector<int> experts;
    std::vector<std::vector<Span>> to;
    for (const auto& [e, row] : loads) {
      experts.push_back(e);
      to.push_back(row_spans(li, row));
    }
    from_tier = staged_->copy_cached(li, experts, to, writer_);
  }
  std::vector<std::pair<int, int>> rest;
  std::vector<size_t> at;
  for (size_t i = 0; i < n; ++i) {
    if (from_tier[i]) {
      landed[i] = kLandedFromTier;
    } else {
      rest.push_back(loads[i]);
      at.push_back(i);
    }
  }
  std::vector<uint8_t> got(rest.size(), 0);
  std::vector<std::exception_ptr> errors(rest.size());
  std::exception_ptr first;  // a failed submission to the reader pool comes first
  bool ring = false;
  if (!rest.empty()) {
    ring = ring_ && ring_read(li, rest, got, errors, how);
    if (!ring) first = pool_read(li, rest, got, errors, how);
  }
  for (size_t j = 0; j < rest.size(); ++j) landed[at[j]] = got[j];
  for (size_t j = 0; j < rest.size() && !first; ++j) {
    if (got[j]) continue;
    first = errors[j] ? errors[j] : read_timeout(*files_[li], rest[j].first, read_timeout_ms_);
  }
  if (tally) {
    tally->micros += micros_since(t0);
    if (ring)
      tally->io_uring_reads += static_cast<uint64_t>(std::count(got.begin(), got.end(), 1));
  }
  return first;
}

bool ExpertCache::ring_read(int li, const std::vector<std::pair<int, int>>& loads,
                            std::vector<uint8_t>& landed, std::vector<std::exception_ptr>& errors,
                            Write how) {
  std::vector<int> experts;
  for (auto [e, row] : loads) {
    if (e < 0 || e >= num_experts_) return false;  // the reader pool words the error
    experts.push_back(e);
  }
  return ring_->read(
      *files_[li], experts, config_.verify_checksums, read_timeout_ms_,
      [&](size_t i, const uint8_t* bytes) { copy_record(li, loads[i].first, bytes, loads[i].second, how); }, landed,
      errors, &read_clock_);
}

std::exception_ptr ExpertCache::pool_read(int li, const std::vector<std::pair<int, int>>& loads,
                                          std::vector<uint8_t>& landed,
                                          std::vector<std::exception_ptr>& errors,
                                          Write how) {
  const size_t n = loads.size();
  auto batch = std::make_shared<ReadBatch>(n);
  std::vector<std::function<void()>> tasks;
  tasks.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    tasks.emplace_back([this, li, batch, i, how, e = loads[i].first, row = loads[i].second] {
      auto& b = *batch;
      {
        std::lock_guard<std::mutex> lk(b.mu);
        if (b.state[i] != kPending) return;  // given up before it started
      }
      uint8_t* buf = nullptr;
      std::exception_ptr err;
      try {
        buf = bounce_buffer(static_cast<size_t>(layers_[li].stride), bounce_writer());
        ReadClock::Span reading(&read_clock_);
        files_[li]->read_record(e, buf, config_.verify_checksums);
      } catch (...) {
        err = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lk(b.mu);
        if (b.state[i] != kPending) return;  // given up while reading: drop the bytes
        if (err) {
          b.state[i] = kFailed;
          b.error[i] = err;
          ++b.settled;
          b.cv.notify_all();
          return;
        }
        b.state[i] = kCopying;
      }
      try {
        copy_record(li, e, buf, row, how);
      } catch (...) {
        err = std::current_exception();
      }
      std::lock_guard<std::mutex> lk(b.mu);
      b.state[i] = err ? kFailed : kDone;
      if (err) b.error[i] = err;
      ++b.settled;
      b.cv.notify_all();
    });
  }
  std::exception_ptr submit_error;  // then some reads may be queued: give them all up
  try {
    readers_->submit_demand(std::move(tasks));
  } catch (...) {
    submit_error = std::current_exception();
  }

  batch->settle(read_timeout_ms_, submit_error != nullptr);
  std::lock_guard<std::mutex> lk(batch->mu);
  for (size_t i = 0; i < n; ++i) {
    landed[i] = batch->state[i] == kDone;
    if (batch->state[i] == kFailed) errors[i] = batch->error[i];
  }
  return submit_error;
}

void ExpertCache::begin_forward_locked(std::unique_lock<std::mutex>& lk) {
  if (staging_on() && side_lfu_ && pending_lfu_ == side_lfu_) {
    // Staged writes land in stream order, so a fill still reading may finish in this
    // forward: its row is in flight (no acquire maps it) until its copy is staged, and
    // the answer that maps it delivers the copy. Only the queued fills are stale (they
    // were for the last forward's later layers); the mailbox's thread does not wait.
    lk.unlock();
    readers_->cancel_prefetches();
    lk.lock();
  } else {
    drain_locked(lk);
  }
  ++forward_;
  // A fill batch still landing writes rows the new ledgers would hand out: later.
  if (pending_lfu_ != side_lfu_ && batched_rows_.empty()) {
    side_lfu_ = pending_lfu_;
    for (size_t li = 0; li < side_.size(); ++li) {
      for (auto& g : side_[li]) stats_[li].prefetch_wasted += g.clear();
      side_[li] = side_ledgers(static_cast<int>(li), side_lfu_);
    }
  }
}

void ExpertCache::drain_locked(std::unique_lock<std::mutex>& lk) {
  lk.unlock();
  readers_->cancel_prefetches();  // runs the cancelled tasks, which take mu_
  lk.lock();
  const auto timeout = std::chrono::milliseconds(read_timeout_ms_);
  while (inflight_ > 0) {
    const uint64_t before = fills_settled_;
    auto progressed = [&] { return inflight_ == 0 || fills_settled_ != before; };
    if (read_timeout_ms_ <= 0) {
      drained_cv_.wait(lk, progressed);
    } else if (!drained_cv_.wait_for(lk, timeout, progressed)) {
      abandon_stuck_fills_locked();
    }
  }
}

void ExpertCache::abandon_stuck_fills_locked() {
  for (size_t li = 0; li < side_.size(); ++li) {
    for (int g = 0; g < static_cast<int>(side_[li].size()); ++g) {
      auto& S = side_[li][g];
      for (int row = 0; row < S.rows(); ++row) {
        if (S.state(row) != RowState::kInFlight) continue;
        const auto& t = fill_tickets_[li][static_cast<size_t>(g * side_slots_[li] + row)];
        int expect = kPending;
        if (!t || !t->state.compare_exchange_strong(expect, kAbandoned)) continue;
        S.abandon(S.expert_at(row), row);
        ++stats_[li].prefetch_wasted;
        ++stats_[li].read_errors;
        --inflight_;
      }
    }
  }
}

void ExpertCache::drain() {
  std::unique_lock<std::mutex> lk(mu_);
  drain_locked(lk);
}

void ExpertCache::set_stream_error(std::exception_ptr e) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!stream_error_) stream_error_ = std::move(e);
}

void ExpertCache::raise_stream_error() {
  std::exception_ptr e;
  {
    std::lock_guard<std::mutex> lk(mu_);
    std::swap(e, stream_error_);
  }
  if (e) std::rethrow_exception(e);
}

bool ExpertCache::is_complete(int li) const {
  check_layer(li, num_layers());
  std::lock_guard<std::mutex> lk(mu_);
  return complete_[li] != 0;
}

ExpertCache::Plan ExpertCache::plan(int li, int64_t n, int top_k) {
  check_layer(li, num_layers());
  raise_stream_error();
  std::lock_guard<std::mutex> lk(mu_);
  auto& R = real_[li];
  if (!complete_[li] && slots_[li] == num_experts_) {
    bool all = true;
    for (int e = 0; e < num_experts_ && all; ++e) all = R.slot_of(e) >= 0;
    if (all) {
      int32_t* t = tables_[li].data<int32_t>();
      for (int e = 0; e < num_experts_; ++e) t[e] = R.slot_of(e);
      complete_[li] = 1;
    }
  }
  // A staged copy may still be on its way to a row of this layer (a pin's load): the
  // call then takes an acquire, whose answer delivers it.
  const bool staged = complete_[li] && staging_on() && staged_->pending_into(pool_ranges_[li]);
  if (complete_[li] && !staged) {
    // A token's top-k ids are distinct lookups; a longer call's distinct experts are not
    // known without reading its ids, and go uncounted.
    if (n == top_k) stats_[li].hits += static_cast<uint64_t>(top_k);
    return kPlanTable;
  }
  return n <= slots_[li] - R.pinned_count() ? kPlanStream : kPlanSync;
}

std::vector<int> ExpertCache::acquire(int li, const int32_t* ids, int32_t* local, size_t n) {
  check_layer(li, num_layers());
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lk(mu_);
  // Charged on every exit, the lock held (lk is declared first, so it is released after).
  struct Timer {
    uint64_t& us;
    std::chrono::steady_clock::time_point t0;
    ~Timer() {
      us += static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                      std::chrono::steady_clock::now() - t0)
                                      .count());
    }
  } timer{stats_[li].acquire_seconds_us, t0};
  if (li <= last_li_) {
    const std::chrono::duration<double> span = forward_last_ - forward_first_;
    throttle_.forward_ended(span.count(), forward_decode_);
    begin_forward_locked(lk);
    forward_first_ = t0;
    forward_decode_ = true;
  }
  forward_last_ = t0;
  last_li_ = li;
  auto& R = real_[li];
  auto& S = side_[li][read_gen()];
  auto& st = stats_[li];
  const int slots = slots_[li];
  const int side_base = slots + read_gen() * side_slots_[li];
  ++tick_;

  // Distinct experts of this call, in first-seen order, with their row (-1: miss).
  std::unordered_map<int, int> row_of;
  std::vector<int> order;
  // A slot whose load is under way (a pin's, its lock released) is no victim.
  std::vector<uint8_t> busy(loading_[li].begin(), loading_[li].end());
  for (size_t i = 0; i < n; ++i) {
    int e = ids[i];
    if (e < 0 || e >= num_experts_)
      throw std::out_of_range("expert id " + std::to_string(e) + " out of range [0, " +
                              std::to_string(num_experts_) + ") in MoE layer " +
                              std::to_string(li));
    if (row_of.count(e)) continue;
    order.push_back(e);
    int slot = R.slot_of(e);
    if (slot >= 0) {
      row_of[e] = slot;
      busy[slot] = 1;
      ++st.hits;
    } else if (int r = S.lookup(e); r >= 0) {
      row_of[e] = side_base + r;
      if (S.mark_read(r, forward_)) ++st.prefetch_used;
      ++st.side_hits;
      ++st.hits;
    } else {
      row_of[e] = -1;
    }
  }
  // A miss whose fill a reader has already started lands sooner than a second read of
  // the same record (which would also compete with it for the disk): wait for it. A
  // fill still queued behind others is not waited for.
  for (int e : order) {
    if (row_of[e] >= 0) continue;
    int r = S.in_flight(e);
    if (r < 0) continue;
    const auto& t = fill_tickets_[li][static_cast<size_t>(read_gen() * side_slots_[li] + r)];
    // A row in a fill batch publishes when its batch lands, which this thread may be
    // the one to notice (the mailbox's): not waited for.
    if (!t || !t->reading || in_batch(li, read_gen(), r)) continue;
    auto settled = [&] { return S.in_flight(e) < 0; };
    if (read_timeout_ms_ > 0) {
      drained_cv_.wait_for(lk, std::chrono::milliseconds(read_timeout_ms_), settled);
    } else {
      drained_cv_.wait(lk, settled);
    }
    if (int row = S.lookup(e); row >= 0) {
      row_of[e] = side_base + row;
      if (S.mark_read(row, forward_)) ++st.prefetch_used;
      ++st.side_hits;
      ++st.hits;
      ++st.prefetch_late;
    }
  }
  CallContext ctx;
  for (int up : {1, 2})
    if (li >= up && last_forward_[li - up] == forward_)
      (up == 1 ? ctx.above1 : ctx.above2) = last_experts_[li - up];
  ctx.router = std::move(router_hint_[li]);
  router_hint_[li].clear();
  ctx.one_token = config_.top_k <= 0 || n <= static_cast<size_t>(config_.top_k);
  forward_decode_ = forward_decode_ && ctx.one_token;
  if (ctx.one_token) throttle_.routed(li, order);
  R.use(order, tick_, ctx);
  last_experts_[li] = order;
  last_forward_[li] = forward_;
  std::vector<int> missing;
  for (int e : order)
    if (row_of[e] < 0) missing.push_back(e);

  int evictable = 0;
  for (int s = 0; s < slots; ++s) {
    int e = R.expert_at(s);
    evictable += !busy[s] && (e < 0 || !R.pinned(e));
  }
  if (static_cast<int>(missing.size()) > evictable) {
    ++st.overcap_calls;
    R.end_call();
    for (size_t i = 0; i < n; ++i) local[i] = row_of[ids[i]];
    // Most-routed first: the first chunks then take the real region's empty slots
    // (load_scratch), so a prompt read into a cold cache leaves its busiest experts there.
    std::unordered_map<int, int> tokens;
    for (size_t i = 0; i < n; ++i) ++tokens[ids[i]];
    std::sort(missing.begin(), missing.end(), [&](int a, int b) {
      return tokens[a] != tokens[b] ? tokens[a] > tokens[b] : a < b;
    });
    return missing;
  }

  // Demand loads: choose victims now, read without the lock, publish after the bytes land.
  std::vector<std::pair<int, int>> loads;  // (expert, slot)
  for (int e : missing) {
    int slot = R.choose_victim(busy);
    busy[slot] = 1;
    if (R.expert_at(slot) >= 0) {
      ++st.evictions;
      evict_locked(li, slot);
    }
    loads.emplace_back(e, slot);
  }
  st.misses += loads.size();
  // Side hits move into the real region (a row copy, no read), into the slots the misses
  // left, so that their next use is a real hit whatever the side region does meanwhile.
  for (int e : order) {
    int row = row_of[e];
    if (row < slots) continue;  // a real hit or a miss
    int slot = R.promotion_slot(e, busy);
    if (slot < 0) {
      ++st.promotions_declined;
      continue;
    }
    busy[slot] = 1;
    if (R.expert_at(slot) >= 0) {
      ++st.evictions;
      evict_locked(li, slot);
    }
    copy_row(li, row, slot, Write::kDemand);
    R.assign(slot, e, tick_);  // this call still reads the side row (the fence holds it)
    hits_stale_[li] = 1;
    ++st.promotions;
  }
  R.end_call();
  if (!loads.empty()) {
    std::exception_ptr err = load_slots(li, loads, lk);
    for (auto [e, slot] : loads)
      if (R.expert_at(slot) == e) row_of[e] = slot;
    if (err) std::rethrow_exception(err);
  }
  for (size_t i = 0; i < n; ++i) local[i] = row_of[ids[i]];
  return {};
}

std::exception_ptr ExpertCache::load_slots(int li, const std::vector<std::pair<int, int>>& loads,
                                           std::unique_lock<std::mutex>& lk) {
  for (auto [e, slot] : loads) loading_[li][slot] = 1;
  // A demand record staged outside an answer that is waited for (a pin, or the acquire of
  // an answer not waited for) must not wait for one: with the layer's entries gone, its
  // next request is waited for and delivers it.
  if (hit_table_ && staging_on()) unmap_layer_locked(li);
  lk.unlock();
  std::vector<uint8_t> landed;
  ReadTally tally;
  std::exception_ptr err = demand_read(li, loads, landed, &tally, Write::kDemand);
  lk.lock();
  auto& st = stats_[li];
  st.read_seconds_us += tally.micros;
  st.io_uring_reads += tally.io_uring_reads;
  for (size_t i = 0; i < loads.size(); ++i) {
    auto [e, slot] = loads[i];
    loading_[li][slot] = 0;
    if (i >= landed.size() || !landed[i]) {
      ++st.read_errors;
      continue;
    }
    real_[li].assign(slot, e, tick_);
    hits_stale_[li] = 1;
    ++st.loads;
    if (landed[i] == kLandedFromTier) {
      ++st.host_hits;
      st.host_bytes += static_cast<uint64_t>(layers_[li].record_bytes);
    } else {
      st.bytes_read += static_cast<uint64_t>(layers_[li].stride);
    }
  }
  return err;
}

int ExpertCache::fill(int li) {
  check_layer(li, num_layers());
  std::unique_lock<std::mutex> lk(mu_);
  if (slots_[li] != num_experts_)
    throw std::invalid_argument("fill: MoE layer " + std::to_string(li) + " has " +
                                std::to_string(slots_[li]) + " real slots for " +
                                std::to_string(num_experts_) + " experts");
  auto& R = real_[li];
  std::vector<int> free;  // slots == num_experts: one for every absent expert
  for (int s = 0; s < slots_[li]; ++s)
    if (R.expert_at(s) < 0 && !loading_[li][s]) free.push_back(s);
  std::vector<std::pair<int, int>> loads;  // (expert, slot)
  for (int e = 0; e < num_experts_; ++e) {
    if (R.slot_of(e) >= 0) continue;
    if (loads.size() == free.size()) throw std::logic_error("fill: no free slot for an expert");
    loads.emplace_back(e, free[loads.size()]);
  }
  if (loads.empty()) return 0;
  if (std::exception_ptr err = load_slots(li, loads, lk)) std::rethrow_exception(err);
  return static_cast<int>(loads.size());
}

void ExpertCache::hint(int li, const float* probs, size_t n) {
  check_layer(li, num_layers());
  const auto E = static_cast<size_t>(num_experts_);
  if (n == 0 || n % E != 0)
    throw std::invalid_argument("router hint of MoE layer " + std::to_string(li) + " has " +
                                std::to_string(n) + " values, not a multiple of " +
                                std::to_string(num_experts_) + " experts");
  for (size_t i = 0; i < n; ++i)
    if (!(probs[i] >= 0.f && probs[i] <= 1.f))
      throw std::invalid_argument("router hint of MoE layer " + std::to_string(li) +
                                  ": probability of expert " + std::to_string(i % E) + " is " +
                                  std::to_string(probs[i]) + ", not in [0, 1]");
  std::lock_guard<std::mutex> lk(mu_);
  if (n == E) {
    router_hint_[li].assign(probs, probs + n);
  } else {
    router_hint_[li].clear();  // several tokens: no one token's evidence
  }
}

std::vector<int> ExpertCache::load_scratch(int li, const std::vector<int>& experts, int first) {
  check_layer(li, num_layers());
  if (first < 0 || static_cast<int>(experts.size()) > config_.scratch_slots - first)
    throw std::invalid_argument("load_scratch: " + std::to_string(experts.size()) +
                                " experts from scratch row " + std::to_string(first) + " of " +
                                std::to_string(config_.scratch_slots) + " scratch rows");
  const int base = slots_[li] + 2 * side_slots_[li] + first;
  std::vector<std::pair<int, int>> loads;
  std::vector<int> rows;
  for (size_t i = 0; i < experts.size(); ++i) {
    int e = experts[i];
    if (e < 0 || e >= num_experts_)
      throw std::out_of_range("expert id " + std::to_string(e) + " out of range");
    int row = base + static_cast<int>(i);
    rows.push_back(row);
    loads.emplace_back(e, row);
  }
  std::vector<uint8_t> landed;
  ReadTally tally;
  std::exception_ptr err = demand_read(li, loads, landed, &tally, Write::kDirect);
  const auto read = static_cast<uint64_t>(std::count(landed.begin(), landed.end(), 1));
  const auto tier = static_cast<uint64_t>(std::count(landed.begin(), landed.end(), kLandedFromTier));
  const uint64_t ok = read + tier;
  std::lock_guard<std::mutex> lk(mu_);
  // Experts read into scratch rows also fill the real region's empty slots, by a row copy
  // (no read): an empty slot is mapped by no computation, so nothing can read it while it
  // is written. Without this a prompt over capacity left a cold cache empty, and decode
  // missed on nearly every expert of its first tokens.
  auto& R = real_[li];
  for (size_t i = 0; i < loads.size(); ++i) {
    const auto [e, row] = loads[i];
    if (!landed[i] || R.slot_of(e) >= 0) continue;
    int slot = 0;
    while (slot < slots_[li] && (R.expert_at(slot) >= 0 || loading_[li][slot])) ++slot;
    if (slot == slots_[li]) break;
    try {
      copy_row(li, row, slot, Write::kDirect);
    } catch (const std::exception&) {
      continue;  // the slot stays empty: no partial row is ever mapped
    }
    R.assign(slot, e, tick_);
    hits_stale_[li] = 1;
  }
  auto& st = stats_[li];
  st.misses += experts.size();
  st.loads += ok;
  st.read_errors += experts.size() - ok;
  st.bytes_read += read * static_cast<uint64_t>(layers_[li].stride);
  st.host_hits += tier;
  st.host_bytes += tier * static_cast<uint64_t>(layers_[li].record_bytes);
  st.read_seconds_us += tally.micros;
  st.io_uring_reads += tally.io_uring_reads;
  st.acquire_seconds_us += tally.micros;  // the over-capacity path's share of the cache's time
  if (err) std::rethrow_exception(err);
  return rows;
}

std::vector<mx::array> ExpertCache::layer_scratch(int li, int bank) {
  check_layer(li, num_layers());
  return scratch_->arrays(li, bank);
}

int ExpertCache::read_ahead(int li, const std::vector<int>& experts) {
  check_layer(li, num_layers());
  for (int e : experts)
    if (e < 0 || e >= num_experts_)
      throw std::out_of_range("expert id " + std::to_string(e) + " out of range [0, " +
                              std::to_string(num_experts_) + ") in MoE layer " +
                              std::to_string(li));
  return start_read_ahead(li, 0, experts, false);
}

int ExpertCache::read_layer(int li, int bank) {
  check_layer(li, num_layers());
  std::vector<int> every(static_cast<size_t>(num_experts_));
  for (int e = 0; e < num_experts_; ++e) every[static_cast<size_t>(e)] = e;
  return start_read_ahead(li, bank, every, true);
}

int ExpertCache::start_read_ahead(int li, int bank, const std::vector<int>& experts, bool by_id) {
  std::vector<int> todo;
  {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<uint8_t> seen(static_cast<size_t>(num_experts_), 0);
    for (int e : experts) {
      if (seen[static_cast<size_t>(e)]++ || real_[li].slot_of(e) >= 0) continue;
      if (staged_ && staged_->holds(li, e)) continue;
      todo.push_back(e);
    }
  }
  return scratch_->read_ahead(li, bank, todo, by_id);
}

void ExpertCache::load_whole(int li, int bank) {
  check_layer(li, num_layers());
  const auto t0 = std::chrono::steady_clock::now();
  LayerScratch::Sources resident;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (int e = 0; e < num_experts_; ++e)
      if (const int slot = real_[li].slot_of(e); slot >= 0)
        resident.emplace_back(e, as_sources(row_spans(li, slot)));
  }
  const LayerScratch::Load load = scratch_->load_whole(li, bank, resident);
  std::lock_guard<std::mutex> lk(mu_);
  ++stats_[li].overcap_calls;
  finish_load(li, load, t0);
}

std::vector<int> ExpertCache::load_layer(int li, const std::vector<int>& missing,
                                         const std::vector<int>& resident,
                                         const std::vector<int>& resident_rows) {
  check_layer(li, num_layers());
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto* ids : {&missing, &resident})
    for (int e : *ids)
      if (e < 0 || e >= num_experts_)
        throw std::out_of_range("expert id " + std::to_string(e) + " out of range [0, " +
                                std::to_string(num_experts_) + ") in MoE layer " +
                                std::to_string(li));
  if (resident.size() != resident_rows.size())
    throw std::invalid_argument("load_layer: " + std::to_string(resident.size()) +
                                " resident experts and " + std::to_string(resident_rows.size()) +
                                " rows");
  for (int r : resident_rows)
    if (r < 0 || r >= rows(li))
      throw std::out_of_range("pool row " + std::to_string(r) + " out of range [0, " +
                              std::to_string(rows(li)) + ") in MoE layer " + std::to_string(li));
  if (missing.size() + resident.size() > static_cast<size_t>(num_experts_))
    throw std::invalid_argument("load_layer: " + std::to_string(missing.size() + resident.size()) +
                                " experts for a layer scratch of " +
                                std::to_string(num_experts_) + " rows");
  LayerScratch::Sources from;
  for (size_t i = 0; i < resident.size(); ++i)
    from.emplace_back(resident[i], as_sources(row_spans(li, resident_rows[i])));
  const LayerScratch::Load load = scratch_->load_layer(li, missing, from);
  std::lock_guard<std::mutex> lk(mu_);
  stats_[li].misses += missing.size();
  finish_load(li, load, t0);
  return load.rows;
}

void ExpertCache::finish_load(int li, const LayerScratch::Load& load,
                              std::chrono::steady_clock::time_point t0) {
  fill_empty_slots(li, load.fill);
  const auto& L = layers_[li];
  auto& st = stats_[li];
  st.loads += load.loads;
  st.read_errors += load.read_errors;
  st.bytes_read += load.records_read * static_cast<uint64_t>(L.stride);
  st.host_hits += load.host_hits;
  st.host_bytes += load.host_hits * static_cast<uint64_t>(L.record_bytes);
  st.read_seconds_us += load.read_micros;
  st.copy_seconds_us += load.copy_micros;
  st.acquire_seconds_us += micros_since(t0);
  if (load.error) std::rethrow_exception(load.error);
}

void ExpertCache::fill_empty_slots(int li, const LayerScratch::Sources& from) {
  auto& R = real_[li];
  std::vector<Span> copies;
  std::vector<std::pair<int, int>> assigned;  // (slot, expert)
  int slot = 0;
  for (const auto& [e, src] : from) {
    if (R.slot_of(e) >= 0) continue;
    while (slot < slots_[li] && (R.expert_at(slot) >= 0 || loading_[li][slot])) ++slot;
    if (slot == slots_[li]) break;
    add_copies(copies, row_spans(li, slot), src);
    assigned.emplace_back(slot++, e);
  }
  try {
    if (!copies.empty()) writer_.copy(copies);
    for (auto [sl, e] : assigned) R.assign(sl, e, tick_);
    if (!assigned.empty()) hits_stale_[li] = 1;
  } catch (const std::exception&) {
    // the slots stay empty: no partial row is ever mapped
  }
}
void ExpertCache::fill_task(int li, int gen, int expert, int row,
                            const std::shared_ptr<FillTicket>& t, bool cancelled,
                            bool tier_only) {
  bool landed = false, from_tier = false;
  int expect_tier = kPending;
  if (!cancelled && staged_ && t->state.compare_exchange_strong(expect_tier, kCopying)) {
    const int at = slots_[li] + gen * side_slots_[li] + row;
    from_tier = landed =
        staging_on() ? stage_from_tier(li, expert, at)
                     : copy_from_tier(li, expert, row_spans(li, at));
    if (!landed) t->state.store(kPending);
  }
  if (tier_only && !landed && !cancelled) {
    readers_->submit_prefetch([this, li, gen, expert, row, t](bool c) {
      fill_task(li, gen, expert, row, t, c);
    });
    return;  // the reader's task settles the ticket
  }
  if (!cancelled && !landed && t->state.load() == kPending) {
    t->reading = true;
    uint8_t* buf = nullptr;
    bool read = false;
    try {
      buf = bounce_buffer(static_cast<size_t>(layers_[li].stride), bounce_writer());
      ReadClock::Span reading(&read_clock_);
      files_[li]->read_record(expert, buf, config_.verify_checksums);
      read = true;
    } catch (...) {
      // a failed prefetch only costs a later demand read
    }
    int expect = kPending;
    if (read && t->state.compare_exchange_strong(expect, kCopying)) {
      try {
        copy_record(li, expert, buf, slots_[li] + gen * side_slots_[li] + row, Write::kFill);
        landed = true;
      } catch (const StagingFull&) {
        cancelled = true;  // no slot free for it: a later demand read costs what it saved
        t->state.store(kPending);
      } catch (...) {
        t->state.store(kPending);  // settled Failed below, or Abandoned by a drain: released
      }
    }
  }
  std::lock_guard<std::mutex> lk(mu_);
  int expect = kPending;
  if (!landed && !t->state.compare_exchange_strong(expect, kFailed))
    return;  // a timed-out drain gave up on this fill and released its row
  auto& S = side_[li][gen];
  auto& st = stats_[li];
  if (landed) {
    S.publish(expert, row);
    ++st.loads;
    if (from_tier) {
      ++st.host_hits;
      st.host_bytes += static_cast<uint64_t>(layers_[li].record_bytes);
    } else {
      st.bytes_read += static_cast<uint64_t>(layers_[li].stride);
    }
  } else if (cancelled) {
    S.abandon(expert, row);
    ++st.prefetch_cancelled;
  } else {
    S.abandon(expert, row);
    ++st.prefetch_wasted;
    ++st.read_errors;
  }
  --inflight_;
  ++fills_settled_;
  drained_cv_.notify_all();
}

void ExpertCache::prefetch(int li, const int32_t* ids, size_t n) {
  check_layer(li, num_layers());
  if (side_slots_[li] == 0) return;
  std::vector<std::pair<int, int>> todo;
  std::vector<std::shared_ptr<FillTicket>> tickets;
  int gen;
  bool sync;
  {
    std::lock_guard<std::mutex> lk(mu_);
    gen = fill_gen();
    sync = sync_;
    const auto& R = real_[li];
    std::vector<int> predicted;
    std::vector<uint8_t> seen(num_experts_, 0), skip(n, 1);
    // Ranks past the side rows (a caller's longer prediction) go with the last one.
    const int d = throttle_.degree(li);
    const size_t degree = d >= side_slots_[li] ? n : static_cast<size_t>(d);
    for (size_t i = 0; i < n; ++i) {
      int e = ids[i];
      if (e < 0 || e >= num_experts_ || seen[e] || R.slot_of(e) >= 0) continue;
      seen[e] = 1;
      skip[i] = 0;
      if (i < degree) predicted.push_back(e);
    }
    throttle_.predicted(li, ids, n, skip);
    int dropped = 0;
    todo = side_[li][gen].reserve(predicted, side_lfu_, forward_, &dropped);
    stats_[li].prefetch_wasted += dropped;
    stats_[li].prefetch_issued += todo.size();
    inflight_ += static_cast<int>(todo.size());
    for (auto [e, row] : todo) {
      auto t = std::make_shared<FillTicket>();
      fill_tickets_[li][static_cast<size_t>(gen * side_slots_[li] + row)] = t;
      tickets.push_back(std::move(t));
    }
  }
  // A fill the host tier holds is only staged (no read, no host copy): done here, its copy
  // is pending when the caller returns, so the mailbox's next fill batch takes it.
  const bool staging = staging_on() && staged_ && staged_->tier_slots() > 0;
  for (size_t i = 0; i < todo.size(); ++i) {
    auto [e, row] = todo[i];
    if (sync) {
      fill_task(li, gen, e, row, tickets[i], false);
    } else if (staging && staged_->holds(li, e)) {
      fill_task(li, gen, e, row, tickets[i], false, true);
    } else {
      readers_->submit_prefetch([this, li, gen, e = e, row = row, t = tickets[i]](bool cancelled) {
        fill_task(li, gen, e, row, t, cancelled);
      });
    }
  }
}

void ExpertCache::pin(int li, int expert) {
  check_layer(li, num_layers());
  if (expert < 0 || expert >= num_experts_)
    throw std::out_of_range("expert id " + std::to_string(expert) + " out of range");
  std::unique_lock<std::mutex> lk(mu_);
  auto& R = real_[li];
  if (R.slot_of(expert) < 0) {
    if (R.pinned_count() + 1 >= slots_[li])
      throw std::invalid_argument("pinning expert " + std::to_string(expert) + " of MoE layer " +
                                  std::to_string(li) + " would leave no evictable slot (" +
                                  std::to_string(slots_[li]) + " real slots)");
    std::vector<uint8_t> busy(loading_[li].begin(), loading_[li].end());
    int slot = R.choose_victim(busy);
    if (slot < 0)
      throw std::runtime_error("pinning expert " + std::to_string(expert) + " of MoE layer " +
                               std::to_string(li) + ": every evictable slot is being loaded; "
                               "pin again when the loads have landed");
    if (R.expert_at(slot) >= 0) {
      ++stats_[li].evictions;
      evict_locked(li, slot);
    }
    ++tick_;
    if (std::exception_ptr err = load_slots(li, {{expert, slot}}, lk))
      std::rethrow_exception(err);  // the slot stays empty
  } else if (!R.pinned(expert) && R.pinned_count() + 1 >= slots_[li]) {
    throw std::invalid_argument("pinning expert " + std::to_string(expert) +
                                " would leave no evictable slot (" +
                                std::to_string(slots_[li]) + " real slots)");
  }
  R.set_pinned(expert, true);
}

void ExpertCache::unpin(int li, int expert) {
  check_layer(li, num_layers());
  if (expert < 0 || expert >= num_experts_)
    throw std::out_of_range("expert id " + std::to_string(expert) + " out of range");
  std::lock_guard<std::mutex> lk(mu_);
  real_[li].set_pinned(expert, false);
}

void ExpertCache::set_policy(Policy p) {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& R : real_) R.set_policy(p);
  config_.policy = p;
}

void ExpertCache::set_side_lfu(bool on) {
  std::lock_guard<std::mutex> lk(mu_);
  pending_lfu_ = on;
}

void ExpertCache::set_sync(bool on) {
  std::lock_guard<std::mutex> lk(mu_);
  sync_ = on;
}

bool ExpertCache::side_lfu() const {
  std::lock_guard<std::mutex> lk(mu_);
  return pending_lfu_;
}

bool ExpertCache::sync() const {
  std::lock_guard<std::mutex> lk(mu_);
  return sync_;
}

void ExpertCache::reset() {
  wait_for_answers();
  scratch_->reset();  // before the tier is emptied
  std::unique_lock<std::mutex> lk(mu_);
  drain_locked(lk);
  unmap_hits_locked();
  for (size_t li = 0; li < real_.size(); ++li) {
    real_[li] = RealRegion(slots_[li], num_experts_, config_.policy, config_.decay_every);
    complete_[li] = 0;  // plan() refills the table once every expert is resident again
    last_experts_[li].clear();
    router_hint_[li].clear();
    for (auto& g : side_[li]) stats_[li].prefetch_wasted += g.clear();
  }
  if (staged_) staged_->clear_tier();
  last_li_ = -1;
}

LayerSnapshot ExpertCache::snapshot(int li) const {
  check_layer(li, num_layers());
  std::lock_guard<std::mutex> lk(mu_);
  const auto& R = real_[li];
  LayerSnapshot s;
  s.slot_expert.resize(slots_[li]);
  s.slot_state.resize(slots_[li]);
  for (int k = 0; k < slots_[li]; ++k) {
    int e = R.expert_at(k);
    s.slot_expert[k] = e;
    SlotState state = e < 0 ? SlotState::kEmpty
                      : R.pinned(e) ? SlotState::kPinned
                                    : SlotState::kResident;
    if (loading_[li][k])
      state = SlotState::kLoading;
    else if (state == SlotState::kResident && R.loaded_at(k) == tick_)
      state = SlotState::kJustLoaded;
    s.slot_state[k] = static_cast<uint8_t>(state);
  }
  for (const auto& S : side_[li]) {
    for (int r = 0; r < S.rows(); ++r) {
      s.side_expert.push_back(S.expert_at(r));
      s.side_state.push_back(static_cast<uint8_t>(S.state(r)));
    }
  }
  s.freq.resize(num_experts_);
  for (int e = 0; e < num_experts_; ++e) s.freq[e] = R.freq(e);
  s.stats = stats_[li];
  s.stats.pins_dropped = R.pins_dropped();
  s.prefetch_degree = throttle_.degree(li);
  return s;
}

uint64_t ExpertCache::forward() const {
  std::lock_guard<std::mutex> lk(mu_);
  return forward_;
}

int ExpertCache::inflight() const {
  std::lock_guard<std::mutex> lk(mu_);
  return inflight_;
}

double ExpertCache::prefetch_threshold() const {
  std::lock_guard<std::mutex> lk(mu_);
  return throttle_.threshold();
}

double ExpertCache::kept_prefetch_threshold() const {
  std::lock_guard<std::mutex> lk(mu_);
  return throttle_.kept_threshold();
}

std::string ExpertCache::check() const {
  std::lock_guard<std::mutex> lk(mu_);
  int inflight = 0;
  for (size_t li = 0; li < real_.size(); ++li) {
    if (auto msg = real_[li].check(); !msg.empty())
      return "MoE layer " + std::to_string(li) + " real region: " + msg;
    for (int g = 0; g < static_cast<int>(side_[li].size()); ++g) {
      if (auto msg = side_[li][g].check(); !msg.empty())
        return "MoE layer " + std::to_string(li) + " side gen " + std::to_string(g) + ": " + msg;
      inflight += side_[li][g].count(RowState::kInFlight);
    }
  }
  inflight -= static_cast<int>(batched_rows_.size());  // fills landing, not reads
  if (inflight != inflight_)
    return "in-flight rows " + std::to_string(inflight) + " != in-flight counter " +
           std::to_string(inflight_);
  return {};
}

void ExpertCache::inject_fault(int li, Fault fault, int expert, int count, int delay_ms) {
  check_layer(li, num_layers());
  files_[li]->inject_fault(fault, expert, count, delay_ms);
}

}  // namespace es
