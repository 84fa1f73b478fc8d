#include "real_region.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace es {

namespace {

constexpr const char* kPolicyNames[] = {"lfu", "lru", "lfu-da", "s3-fifo", "predictive"};
constexpr uint8_t kFifoMaxUses = 3;

}  // namespace

const char* policy_name(Policy p) { return kPolicyNames[static_cast<int>(p)]; }

Policy policy_from_name(const std::string& name) {
  std::string choices;
  for (int i = 0; i < static_cast<int>(std::size(kPolicyNames)); ++i) {
    if (name == kPolicyNames[i]) return static_cast<Policy>(i);
    choices += std::string(i ? ", " : "") + "'" + kPolicyNames[i] + "'";
  }
  throw std::invalid_argument("policy must be one of " + choices + ", got '" + name + "'");
}

RealRegion::RealRegion(int cap, int num_experts, Policy policy, int decay_every)
    : policy_(policy),
      decay_every_(decay_every),
      slot_expert_(cap, -1),
      expert_slot_(num_experts, -1),
      last_use_(cap, 0),
      loaded_at_(cap, 0),
      freq_(num_experts, 0.f),
      pinned_(num_experts, 0),
      da_uses_(cap, 0),
      da_key_(cap, 0),
      fifo_main_(cap, 0),
      fifo_seq_(cap, 0),
      fifo_uses_(cap, 0),
      ghost_at_(num_experts, 0) {
  set_policy(policy);
}

void RealRegion::set_policy(Policy p) {
  policy_ = p;
  if (p == Policy::kPredictive && !model_) model_ = std::make_unique<NextUseModel>(num_experts());
}

void RealRegion::use(const std::vector<int>& experts, uint64_t tick, const CallContext& ctx) {
  for (int e : experts) {
    freq_[e] += 1.f;
    int s = expert_slot_[e];
    if (s < 0) continue;
    last_use_[s] = tick;
    da_key_[s] = da_floor_ + ++da_uses_[s];
    fifo_uses_[s] = std::min<uint8_t>(fifo_uses_[s] + 1, kFifoMaxUses);
  }
  if (policy_ != Policy::kPredictive) return;
  scratch_.clear();
  for (int e : slot_expert_)
    if (e >= 0) scratch_.push_back(e);
  model_->observe(experts, ctx.above1, ctx.above2, ctx.router, ctx.one_token, scratch_);
}

void RealRegion::end_call() {
  if (decay_every_ <= 0 || ++calls_ < decay_every_) return;
  calls_ = 0;
  for (auto& f : freq_) f *= 0.5f;
}

bool RealRegion::candidate(int slot, const std::vector<uint8_t>& busy) const {
  int e = slot_expert_[slot];
  return !busy[slot] && e >= 0 && !pinned_[e];
}

int RealRegion::choose_victim(const std::vector<uint8_t>& busy) {
  for (int s = 0; s < cap(); ++s)
    if (!busy[s] && slot_expert_[s] < 0) return s;
  if (policy_ == Policy::kS3FIFO) return s3fifo_victim(busy);
  int best = -1;
  for (int s = 0; s < cap(); ++s) {
    if (!candidate(s, busy)) continue;
    if (best < 0) {
      best = s;
      continue;
    }
    int e = slot_expert_[s], b = slot_expert_[best];
    bool older = last_use_[s] < last_use_[best];
    bool better;
    switch (policy_) {
      case Policy::kLFU:
        better = freq_[e] < freq_[b] || (freq_[e] == freq_[b] && older);
        break;
      case Policy::kLFUDA:
        better = da_key_[s] < da_key_[best] || (da_key_[s] == da_key_[best] && older);
        break;
      case Policy::kPredictive: {
        float x = model_->score(e), y = model_->score(b);
        better = x < y || (x == y && older);
        break;
      }
      default:
        better = older;
    }
    if (better) best = s;
  }
    // max: a busy or pinned expert may hold a key below the floor; the floor never falls.
  if (best >= 0 && policy_ == Policy::kLFUDA) da_floor_ = std::max(da_floor_, da_key_[best]);
  return best;
}

int RealRegion::s3fifo_victim(const std::vector<uint8_t>& busy) {
  const int small_target = std::max(1, cap() / 10);
  const uint64_t ghost_cap = static_cast<uint64_t>(std::max(1, cap() - small_target));
  for (;;) {
    int small = 0, oldest_small = -1, oldest_main = -1;
    for (int s = 0; s < cap(); ++s) {
      if (slot_expert_[s] < 0) continue;
      small += !fifo_main_[s];
      if (!candidate(s, busy)) continue;
      int& oldest = fifo_main_[s] ? oldest_main : oldest_small;
      if (oldest < 0 || fifo_seq_[s] < fifo_seq_[oldest]) oldest = s;
    }
    if (oldest_small >= 0 && (small >= small_target || oldest_main < 0)) {
      int s = oldest_small;
      if (fifo_uses_[s] > 1) {  // used again while in the small FIFO: promote
        fifo_main_[s] = 1;
        fifo_seq_[s] = ++fifo_clock_;
        fifo_uses_[s] = 0;
        continue;
      }
      ghost_at_[slot_expert_[s]] = ++ghost_clock_;
      // Forget ghosts that fell off the end, so the clock test in assign() stays exact.
      for (auto& g : ghost_at_)
        if (g && ghost_clock_ - g >= ghost_cap) g = 0;
      return s;
    }
    if (oldest_main < 0) return -1;
    int s = oldest_main;
    if (fifo_uses_[s] > 0) {  // reinsert at the head with one use less
      --fifo_uses_[s];
      fifo_seq_[s] = ++fifo_clock_;
      continue;
    }
    return s;
  }
}

int RealRegion::assign(int slot, int expert, uint64_t tick) {
  int old = slot_expert_[slot];
  if (old >= 0) expert_slot_[old] = -1;
  slot_expert_[slot] = expert;
  expert_slot_[expert] = slot;
  last_use_[slot] = tick;
  loaded_at_[slot] = tick;
  da_uses_[slot] = 1;
  da_key_[slot] = da_floor_ + 1;
  fifo_main_[slot] = ghost_at_[expert] != 0;  // back from the ghost list: main FIFO
  ghost_at_[expert] = 0;
  fifo_seq_[slot] = ++fifo_clock_;
  fifo_uses_[slot] = 0;
  return old;
}

void RealRegion::clear(int slot) {
  int old = slot_expert_[slot];
  if (old >= 0) {
    expert_slot_[old] = -1;
    if (pinned_[old]) set_pinned(old, false);
  }
  slot_expert_[slot] = -1;
}

void RealRegion::set_pinned(int expert, bool pinned) {
  if (static_cast<bool>(pinned_[expert]) == pinned) return;
  pinned_[expert] = pinned;
  pinned_count_ += pinned ? 1 : -1;
}

std::string RealRegion::check() const {
  for (int s = 0; s < cap(); ++s) {
    int e = slot_expert_[s];
    if (e >= 0 && expert_slot_[e] != s)
      return "slot " + std::to_string(s) + " holds expert " + std::to_string(e) +
             " but the expert maps to slot " + std::to_string(expert_slot_[e]);
    if (e >= 0 && (fifo_uses_[s] > kFifoMaxUses || fifo_seq_[s] > fifo_clock_))
      return "slot " + std::to_string(s) + " has a bad s3-fifo use count or place";
    if (e >= 0 && (da_uses_[s] == 0 || da_key_[s] > da_floor_ + da_uses_[s] ||
                   da_key_[s] < da_uses_[s]))
      return "slot " + std::to_string(s) + " has an lfu-da key outside [uses, floor + uses]";
  }
  int pinned = 0;
  for (int e = 0; e < num_experts(); ++e) {
    int s = expert_slot_[e];
    if (s >= 0 && slot_expert_[s] != e)
      return "expert " + std::to_string(e) + " maps to slot " + std::to_string(s) +
             " which holds " + std::to_string(slot_expert_[s]);
    if (pinned_[e]) {
      ++pinned;
      if (s < 0) return "pinned expert " + std::to_string(e) + " is not resident";
    }
    if (!(freq_[e] >= 0.f) || !std::isfinite(freq_[e]))
      return "expert " + std::to_string(e) + " has LFU frequency " + std::to_string(freq_[e]);
    if (s >= 0 && ghost_at_[e] != 0)
      return "expert " + std::to_string(e) + " is resident and in the s3-fifo ghost list";
  }
  if (pinned != pinned_count_) return "pinned count mismatch";
  if (model_) return model_->check();
  return {};
}

}  // namespace es
