#include "real_region.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace es {

namespace {

constexpr const char* kPolicyNames[kNumPolicies] = {"predictive", "lfu", "lru", "lfu-da",
                                                    "s3-fifo"};
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

RealRegion::RealRegion(int slots, int num_experts, Policy policy, int decay_every)
    : policy_(policy),
      decay_every_(decay_every),
      slot_expert_(slots, -1),
      expert_slot_(num_experts, -1),
      last_use_(slots, 0),
      loaded_at_(slots, 0),
      freq_(num_experts, 0.f),
      pinned_(num_experts, 0),
      da_uses_(slots, 0),
      da_key_(slots, 0),
      fifo_main_(slots, 0),
      fifo_seq_(slots, 0),
      fifo_uses_(slots, 0),
      ghost_at_(num_experts, 0) {
  set_policy(policy);
}

void RealRegion::set_policy(Policy p) {
  policy_ = p;
  if (p == Policy::kPredictive && !model_) model_ = std::make_shared<NextUseModel>(num_experts());
  if (shadow_) shadow_ = make_shadow();  // compare with the new policy from here on
}

void RealRegion::count_use(const std::vector<int>& experts, uint64_t tick) {
  for (int e : experts) {
    freq_[e] += 1.f;
    int s = expert_slot_[e];
    if (s < 0) continue;
    last_use_[s] = tick;
    da_key_[s] = da_floor_ + ++da_uses_[s];
    fifo_uses_[s] = std::min<uint8_t>(fifo_uses_[s] + 1, kFifoMaxUses);
  }
}

void RealRegion::use(const std::vector<int>& experts, uint64_t tick, const CallContext& ctx) {
  count_use(experts, tick);
  if (policy_ == Policy::kPredictive) {
    scratch_.clear();
    for (int e : slot_expert_)
      if (e >= 0) scratch_.push_back(e);
    if (shadow_)  // the shadow's residents are scored too: it evicts by the same model
      for (int e : shadow_->slot_expert_)
        if (e >= 0) scratch_.push_back(e);
    model_->observe(experts, ctx.above1, ctx.above2, ctx.router, ctx.one_token, scratch_);
  }
  if (shadow_) compare_with_shadow(experts, tick);
}

void RealRegion::compare_with_shadow(const std::vector<int>& experts, uint64_t tick) {
  for (int e : experts) {
    pinned_hits_ += expert_slot_[e] >= 0;
    shadow_hits_ += shadow_->expert_slot_[e] >= 0;
  }
  shadow_->shadow_call(experts, tick);
  if (shadow_hits_ <= pinned_hits_) return;
  // The pins have cost a hit: drop the least used one and compare afresh.
  int weakest = -1;
  for (int e = 0; e < num_experts(); ++e)
    if (pinned_[e] && (weakest < 0 || freq_[e] < freq_[weakest])) weakest = e;
  set_pinned(weakest, false);  // the last pin gone ends the shadow (set_pinned)
  ++pins_dropped_;
  if (shadow_) shadow_ = make_shadow();
  pinned_hits_ = shadow_hits_ = 0;
}

void RealRegion::shadow_call(const std::vector<int>& experts, uint64_t tick) {
  count_use(experts, tick);
  std::vector<uint8_t> busy(slots(), 0);
  for (int e : experts)
    if (expert_slot_[e] >= 0) busy[expert_slot_[e]] = 1;
  for (int e : experts) {
    if (expert_slot_[e] >= 0) continue;
    int slot = choose_victim(busy);
    if (slot < 0) return;  // more experts than slots (a prefill): the rest stream
    busy[slot] = 1;
    assign(slot, e, tick);
  }
  end_call();
}

std::unique_ptr<RealRegion> RealRegion::make_shadow() const {
  auto r = std::make_unique<RealRegion>(*this);  // shares the model: it scores both
  r->shadow_.reset();
  r->pinned_.assign(pinned_.size(), 0);
  r->pinned_count_ = 0;
  return r;
}

void RealRegion::end_call() {
  if (shadow_) shadow_->end_call();
  if (decay_every_ <= 0 || ++calls_ < decay_every_) return;
  calls_ = 0;
  for (auto& f : freq_) f *= 0.5f;
}

bool RealRegion::candidate(int slot, const std::vector<uint8_t>& busy) const {
  int e = slot_expert_[slot];
  return !busy[slot] && e >= 0 && !pinned_[e];
}

int RealRegion::choose_victim(const std::vector<uint8_t>& busy) {
  for (int s = 0; s < slots(); ++s)
    if (!busy[s] && slot_expert_[s] < 0) return s;
  if (policy_ == Policy::kS3FIFO) return s3fifo_victim(busy);
  int best = -1;
  for (int s = 0; s < slots(); ++s) {
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

int RealRegion::promotion_slot(int expert, const std::vector<uint8_t>& busy) {
  if (policy_ != Policy::kLFU && policy_ != Policy::kPredictive) return choose_victim(busy);
  int slot = choose_victim(busy);  // no side effects under these two policies
  if (slot < 0 || slot_expert_[slot] < 0) return slot;
  int victim = slot_expert_[slot];
  bool better = policy_ == Policy::kLFU ? freq_[expert] > freq_[victim]
                                        : model_->score(expert) > model_->score(victim);
  return better ? slot : -1;
}

int RealRegion::s3fifo_victim(const std::vector<uint8_t>& busy) {
  const int small_target = std::max(1, slots() / 10);
  const uint64_t ghost_cap = static_cast<uint64_t>(std::max(1, slots() - small_target));
  for (;;) {
    int small = 0, oldest_small = -1, oldest_main = -1;
    for (int s = 0; s < slots(); ++s) {
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
  if (pinned_count_ == 0) {
    shadow_.reset();
  } else if (!shadow_) {
    shadow_ = make_shadow();
    pinned_hits_ = shadow_hits_ = 0;
  }
}

std::string RealRegion::check() const {
  for (int s = 0; s < slots(); ++s) {
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
  if ((pinned_count_ > 0) != static_cast<bool>(shadow_))
    return "a shadow region exists without pins, or pins without one";
  if (shadow_) {
    if (shadow_->pinned_count_ != 0) return "the shadow region has pins";
    if (auto msg = shadow_->check(); !msg.empty()) return "shadow region: " + msg;
  }
  if (model_) return model_->check();
  return {};
}

}  // namespace es
