#include "staged_copies.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

namespace es {

StagedCopies::StagedCopies(const PoolWriter& writer, size_t slot_bytes, int slots, int reserve,
                           int layers, int tier_slots, int num_experts, Policy policy)
    : writer_(writer), slot_bytes_(slot_bytes), reserve_(reserve),
      tier_slots_(layers > 0 ? tier_slots : 0), num_experts_(num_experts), policy_(tier_policy(policy)) {
  if (tier_slots < 0)
    throw std::invalid_argument("host tier: " + std::to_string(tier_slots) + " slots per layer");
  if (reserve < 1 || slots <= reserve)
    throw std::invalid_argument("staging: " + std::to_string(slots) + " slots with " +
                                std::to_string(reserve) +
                                " reserved for demand reads (need slots > reserve >= 1)");
  if (slot_bytes == 0) throw std::invalid_argument("staging: slots of 0 bytes");
  const int tier_total = tier_slots_ * std::max(layers, 0);
  const int total = tier_total + slots;
  memory_ = std::make_unique<MappedHost>(writer_, slot_bytes_ * static_cast<size_t>(total),
                                         "staged pool writes");
  refs_.assign(static_cast<size_t>(total), 0);
  for (int s = total - 1; s >= tier_total; --s) free_.push_back(s);
  filling_.assign(static_cast<size_t>(tier_total), 0);
  if (tier_slots_ > 0)
    for (int li = 0; li < layers; ++li) tier_.emplace_back(tier_slots_, num_experts, policy_, 256);
}

Policy StagedCopies::tier_policy(Policy policy) {
  // The tier sees one expert at a time, with no router, no layers above and no token: the
  // next-use model's context features are empty there, and scoring every resident at each
  // use cost the answer's thread more than the copies it staged. Its popularity and
  // recency features are what LFU keeps.
  return policy == Policy::kPredictive ? Policy::kLFU : policy;
}

void StagedCopies::count_use(RealRegion& R, int expert) {
  if (tier_slots_ >= num_experts_) return;  // expert e stays in slot e: nothing is evicted
  R.use({expert}, ++tick_, CallContext{});
  R.end_call();
}

size_t StagedCopies::capacity(size_t spans_per_record, size_t row_copies) const {
  // A tier slot may be the source of copies to several rows (a real slot and a side
  // row): twice the slots bounds what one delivery holds in practice; more is an error.
  return 2 * refs_.size() * spans_per_record + row_copies;
}

uint64_t StagedCopies::device(const uint8_t* p) const {
  const uint8_t* base = memory_->data();
  if (p >= base && p < base + memory_->bytes())
    return memory_->device_address() + static_cast<uint64_t>(p - base);
  return reinterpret_cast<uint64_t>(p);  // pool memory: one address for host and device
}

void StagedCopies::release(int slot) {
  const int tier_total = static_cast<int>(filling_.size());
  if (slot >= 0 && --refs_[static_cast<size_t>(slot)] == 0 && slot >= tier_total)
    free_.push_back(slot);  // a tier slot keeps its record
}

std::vector<uint8_t*> StagedCopies::segments(int slot, const std::vector<Span>& spans) const {
  std::vector<uint8_t*> at;
  const int tier_total = static_cast<int>(filling_.size());
  // A transient slot: one record's segments in order, so (t, T) = (0, 1) from its start.
  uint8_t* base = slot_memory(slot);
  size_t t = 0, T = 1;
  if (slot < tier_total) {
    T = static_cast<size_t>(tier_slots_);
    t = static_cast<size_t>(slot % tier_slots_);
    base = slot_memory(slot - static_cast<int>(t));  // the layer's first tier slot
  }
  size_t off = 0;
  for (const auto& s : spans) {
    const size_t aligned = (s.bytes + 15) / 16 * 16;  // 16-byte aligned for the kernels
    at.push_back(base + T * off + t * aligned);
    off += aligned;
  }
  return at;
}

void StagedCopies::add_copies(int slot, const std::vector<Span>& spans) {
  const auto from = segments(slot, spans);
  for (size_t i = 0; i < spans.size(); ++i) {
    const auto& s = spans[i];
    drop_target(s.dst);
    // A row copy still pending that writes this row was staged earlier: it runs first
    // (row copies go before records), so it may stay.
    pending_.push_back({s.dst, from[i], s.bytes, slot, true, s.segment});
    ++refs_[static_cast<size_t>(slot)];
  }
}

int StagedCopies::take_tier_slot(int layer, int expert) {
  if (tier_slots_ == 0 || layer < 0 || layer >= static_cast<int>(tier_.size())) return -1;
  auto& R = tier_[static_cast<size_t>(layer)];
  if (R.slot_of(expert) >= 0) return -1;  // held, or being filled by another thread
  const int base = layer * tier_slots_;
  std::vector<uint8_t> busy(static_cast<size_t>(tier_slots_));
  for (int s = 0; s < tier_slots_; ++s)
    busy[static_cast<size_t>(s)] = refs_[static_cast<size_t>(base + s)] > 0;
  count_use(R, expert);
  // Where the tier holds every expert, slot e is expert e's and no other's (see the
  // layout): while copies still read an earlier record there (after clear_tier), the
  // record is not kept, rather than taking another expert's slot for good.
  int victim;
  if (tier_slots_ >= num_experts_ && expert < tier_slots_)
    victim = R.expert_at(expert) < 0 && !busy[static_cast<size_t>(expert)] ? expert : -1;
  else
    victim = R.choose_victim(busy);
  if (victim < 0) return -1;
  R.assign(victim, expert, tick_);
  const int slot = base + victim;
  filling_[static_cast<size_t>(slot)] = 1;
  refs_[static_cast<size_t>(slot)] = 1;  // held while the bytes are copied in
  return slot;
}

void StagedCopies::fill_slot(int slot, const std::vector<Span>& spans) {
  const auto to = segments(slot, spans);
  for (size_t i = 0; i < spans.size(); ++i) std::memcpy(to[i], spans[i].src, spans[i].bytes);
}

void StagedCopies::keep(const std::vector<Span>& spans, int layer, int expert) {
  size_t total = 0;
  for (const auto& s : spans) total += (s.bytes + 15) / 16 * 16;
  if (total > slot_bytes_) return;
  int slot;
  {
    std::lock_guard<std::mutex> lk(mu_);
    slot = take_tier_slot(layer, expert);
  }
  if (slot < 0) return;
  fill_slot(slot, spans);
  std::lock_guard<std::mutex> lk(mu_);
  filling_[static_cast<size_t>(slot)] = 0;
  release(slot);
}

bool StagedCopies::holds(int layer, int expert) const {
  std::lock_guard<std::mutex> lk(mu_);
  if (tier_slots_ == 0 || layer < 0 || layer >= static_cast<int>(tier_.size())) return false;
  const int at = tier_[static_cast<size_t>(layer)].slot_of(expert);
  return at >= 0 && !filling_[static_cast<size_t>(layer * tier_slots_ + at)];
}

std::vector<uint8_t> StagedCopies::copy_cached(int layer, const std::vector<int>& experts,
                                               const std::vector<std::vector<Span>>& spans,
                                               const PoolWriter& writer) {
  if (experts.size() != spans.size())
    throw std::invalid_argument("copy_cached: " + std::to_string(experts.size()) +
                                " experts and " + std::to_string(spans.size()) + " span lists");
  std::vector<uint8_t> copied(experts.size(), 0);
  std::vector<int> slots;  // taken: no eviction while they are read
  std::vector<Span> from;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (tier_slots_ == 0 || layer < 0 || layer >= static_cast<int>(tier_.size())) return copied;
    auto& R = tier_[static_cast<size_t>(layer)];
    for (size_t i = 0; i < experts.size(); ++i) {
      const int at = R.slot_of(experts[i]);
      if (at < 0) continue;
      const int slot = layer * tier_slots_ + at;
      if (filling_[static_cast<size_t>(slot)]) continue;
      count_use(R, experts[i]);
      ++refs_[static_cast<size_t>(slot)];
      slots.push_back(slot);
      copied[i] = 1;
      const auto seg = segments(slot, spans[i]);
      for (size_t j = 0; j < spans[i].size(); ++j)
        from.push_back({spans[i][j].dst, seg[j], spans[i][j].bytes, spans[i][j].segment});
    }
  }
  if (slots.empty()) return copied;
  try {
    writer.copy(from);
  } catch (const std::exception&) {
    copied.assign(copied.size(), 0);  // the caller reads the records instead
  }
  std::lock_guard<std::mutex> lk(mu_);
  for (int slot : slots) release(slot);
  return copied;
}

bool StagedCopies::stage_cached(int layer, int expert, const std::vector<Span>& spans) {
  std::lock_guard<std::mutex> lk(mu_);
  if (tier_slots_ == 0 || layer < 0 || layer >= static_cast<int>(tier_.size())) return false;
  auto& R = tier_[static_cast<size_t>(layer)];
  const int at = R.slot_of(expert);
  if (at < 0) return false;
  const int slot = layer * tier_slots_ + at;
  if (filling_[static_cast<size_t>(slot)]) return false;
  count_use(R, expert);
  add_copies(slot, spans);
  return true;
}

int StagedCopies::tier_held() const {
  std::lock_guard<std::mutex> lk(mu_);
  int n = 0;
  for (const auto& R : tier_)
    for (int s = 0; s < R.slots(); ++s) n += R.expert_at(s) >= 0;
  return n;
}

void StagedCopies::drop_target(uint8_t* dst) {
  for (auto& p : pending_) {
    if (!p.live || p.dst != dst || p.slot < 0) continue;
    p.live = false;
    release(p.slot);
  }
}

bool StagedCopies::stage_record(const std::vector<Span>& spans, bool demand, int layer,
                                int expert) {
  size_t total = 0;
  for (const auto& s : spans) total += (s.bytes + 15) / 16 * 16;
  if (total > slot_bytes_)
    throw std::invalid_argument("staging: a record of " + std::to_string(total) +
                                " bytes for slots of " + std::to_string(slot_bytes_));
  int slot = -1;
  bool tier = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    slot = take_tier_slot(layer, expert);
    tier = slot >= 0;
    if (slot < 0) {
      if (free_.empty() || (!demand && static_cast<int>(free_.size()) <= reserve_)) return false;
      slot = free_.back();
      free_.pop_back();
      refs_[static_cast<size_t>(slot)] = 1;  // held while the bytes are copied in
    }
  }
  fill_slot(slot, spans);
  std::lock_guard<std::mutex> lk(mu_);
  add_copies(slot, spans);
  if (tier) filling_[static_cast<size_t>(slot)] = 0;
  release(slot);  // the hold taken above
  return true;
}

void StagedCopies::stage_rows(const std::vector<Span>& spans) {
  std::lock_guard<std::mutex> lk(mu_);
  for (const auto& s : spans) {
    // Reads a row whose record is pending: read that record's slot instead (the record
    // would land only after this copy ran).
    const Pending* from = nullptr;
    for (const auto& p : pending_)
      if (p.live && p.slot >= 0 && p.dst == s.src) from = &p;
    Pending copy{s.dst, s.src, s.bytes, -1, true, s.segment};
    if (from) {
      copy.src = from->src;
      copy.slot = from->slot;
    }
    drop_target(s.dst);  // a record pending for this row would land after this copy
    if (copy.slot >= 0) ++refs_[static_cast<size_t>(copy.slot)];
    pending_.push_back(copy);
  }
}

Delivery StagedCopies::deliver(StagedCopy* out, size_t capacity) {
  std::lock_guard<std::mutex> lk(mu_);
  size_t live = 0;
  for (const auto& p : pending_) live += p.live;
  if (live > capacity)
    throw std::length_error("staging: " + std::to_string(live) + " pool copies pending for " +
                            std::to_string(capacity) + " places");
  // Row copies run one after another before the records (in one block of the acquire
  // kernel) only where order matters: a copy writes what a row copy reads or writes. Else
  // (promotions beside demand reads, the usual answer) they go with the records, which
  // every block of the copy kernel copies at once.
  auto overlap = [](const uint8_t* a, const uint8_t* b, size_t n, size_t m) {
    return a < b + m && b < a + n;
  };
  bool ordered = false;
  for (size_t x = 0; x < pending_.size() && !ordered; ++x) {
    const auto& a = pending_[x];
    if (!a.live || a.slot >= 0) continue;
    for (size_t y = 0; y < pending_.size() && !ordered; ++y) {
      const auto& b = pending_[y];
      ordered = y != x && b.live &&
                (overlap(b.dst, a.src, b.bytes, a.bytes) || overlap(b.dst, a.dst, b.bytes, a.bytes));
    }
  }
  Delivery d;
  size_t i = 0;
  if (ordered)
    for (const auto& p : pending_)
      if (p.live && p.slot < 0)
        out[i++] = {device(p.src), device(p.dst), p.bytes, 0}, ++d.rows;
  for (const auto& p : pending_)
    if (p.live) {
      delivered_spans_.emplace_back(p.dst, p.dst + p.bytes);
      if (p.slot < 0) delivered_spans_.emplace_back(p.src, p.src + p.bytes);
    }
  for (const auto& p : pending_) {
    if (!p.live || (ordered && p.slot < 0)) continue;
    out[i++] = {device(p.src), device(p.dst), p.bytes, d.chunks};
    ++d.records;
    d.chunks += (p.bytes + kChunkBytes - 1) / kChunkBytes;
    if (p.slot >= 0) delivered_.push_back(p.slot);
  }
  pending_.clear();
  return d;
}

std::vector<Span> StagedCopies::deliver_batch(const std::function<bool(const uint8_t*)>& take,
                                              uint32_t batch) {
  std::lock_guard<std::mutex> lk(mu_);
  auto overlap = [](const uint8_t* a, const uint8_t* b, size_t n, size_t m) {
    return a < b + m && b < a + n;
  };
  // A record that a pending row copy reads or writes must land after it: it stays
  // pending, for an answer's delivery that orders them. So does one whose row a copy of
  // the latest answer, which may not have run yet, reads or writes: the batch would be
  // copied beside it, not after it.
  auto held = [&](const Pending& p) {
    for (const auto& r : pending_)
      if (r.live && r.slot < 0 &&
          (overlap(r.src, p.dst, r.bytes, p.bytes) || overlap(r.dst, p.dst, r.bytes, p.bytes)))
        return true;
    for (const auto& [lo, hi] : delivered_spans_)
      if (overlap(lo, p.dst, static_cast<size_t>(hi - lo), p.bytes)) return true;
    return false;
  };
  std::vector<Span> out;
  std::vector<Pending> rest;
  for (const auto& p : pending_) {
    if (!p.live) continue;  // dropped: its reference went with it
    if (p.slot < 0 || !take(p.dst) || held(p)) {
      rest.push_back(p);
      continue;
    }
    out.push_back({p.dst, p.src, p.bytes, p.segment});
    batched_.emplace_back(batch, p.slot);
  }
  pending_.swap(rest);
  return out;
}

void StagedCopies::completed() {
  std::lock_guard<std::mutex> lk(mu_);
  for (int slot : delivered_) release(slot);
  delivered_.clear();
  delivered_spans_.clear();
}

void StagedCopies::completed_batches(uint32_t done) {
  std::lock_guard<std::mutex> lk(mu_);
  // Batches are copied in order, and fewer than 2^31 are ever outstanding: a batch is
  // copied when it is not after `done`.
  size_t kept = 0;
  for (const auto& [batch, slot] : batched_) {
    if (static_cast<int32_t>(done - batch) >= 0)
      release(slot);
    else
      batched_[kept++] = {batch, slot};
  }
  batched_.resize(kept);
}

void StagedCopies::flush(const PoolWriter& writer) {
  std::vector<Pending> todo;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (int slot : delivered_) release(slot);
    delivered_.clear();
    delivered_spans_.clear();
    for (const auto& b : batched_) release(b.second);
    batched_.clear();
    todo.swap(pending_);
  }
  // Row copies one at a time in order (a later one may read what an earlier wrote),
  // then the records.
  for (const auto& p : todo)
    if (p.live && p.slot < 0) writer.copy({{p.dst, p.src, p.bytes, p.segment}});
  std::vector<Span> records;
  for (const auto& p : todo)
    if (p.live && p.slot >= 0) records.push_back({p.dst, p.src, p.bytes, p.segment});
  std::exception_ptr err;
  try {
    if (!records.empty()) writer.copy(records);
  } catch (...) {
    err = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& p : todo)
      if (p.live && p.slot >= 0) release(p.slot);
  }
  if (err) std::rethrow_exception(err);
}

void StagedCopies::execute(const StagedCopy* copies, const Delivery& d) {
  auto copy = [](const StagedCopy& c) {
    std::memmove(reinterpret_cast<void*>(c.dst), reinterpret_cast<const void*>(c.src), c.bytes);
  };
  for (uint32_t i = 0; i < d.rows; ++i) copy(copies[i]);
  // The kernels copy the records in no particular order: last to first here, so that a
  // delivery that needed an order among them fails the tests.
  for (uint32_t i = d.rows + d.records; i > d.rows; --i) copy(copies[i - 1]);
}

size_t StagedCopies::pending() const {
  std::lock_guard<std::mutex> lk(mu_);
  size_t n = 0;
  for (const auto& p : pending_) n += p.live;
  return n;
}

bool StagedCopies::pending_into(
    const std::vector<std::pair<const uint8_t*, const uint8_t*>>& ranges) const {
  std::lock_guard<std::mutex> lk(mu_);
  for (const auto& p : pending_)
    if (p.live)
      for (const auto& [lo, hi] : ranges)
        if (p.dst >= lo && p.dst < hi) return true;
  return false;
}

void StagedCopies::clear_tier() {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& R : tier_) R = RealRegion(tier_slots_, num_experts_, policy_, 256);
}

int StagedCopies::busy() const {
  std::lock_guard<std::mutex> lk(mu_);
  return slots() - static_cast<int>(free_.size());
}

}  // namespace es
