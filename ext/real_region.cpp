#include "real_region.h"

namespace es {

RealRegion::RealRegion(int cap, int num_experts, Policy policy, int decay_every)
    : policy_(policy),
      decay_every_(decay_every),
      slot_expert_(cap, -1),
      expert_slot_(num_experts, -1),
      last_use_(cap, 0),
      loaded_at_(cap, 0),
      freq_(num_experts, 0.f),
      pinned_(num_experts, 0) {}

void RealRegion::touch(int expert, uint64_t tick) {
  freq_[expert] += 1.f;
  int s = expert_slot_[expert];
  if (s >= 0) last_use_[s] = tick;
}

void RealRegion::end_call() {
  if (decay_every_ <= 0 || ++calls_ < decay_every_) return;
  calls_ = 0;
  for (auto& f : freq_) f *= 0.5f;
}

int RealRegion::choose_victim(const std::vector<uint8_t>& busy) const {
  int best = -1;
  for (int s = 0; s < cap(); ++s) {
    if (busy[s]) continue;
    int e = slot_expert_[s];
    if (e < 0) return s;
    if (pinned_[e]) continue;
    if (best < 0) {
      best = s;
      continue;
    }
    int b = slot_expert_[best];
    bool better;
    if (policy_ == Policy::kLFU) {
      better = freq_[e] < freq_[b] || (freq_[e] == freq_[b] && last_use_[s] < last_use_[best]);
    } else {
      better = last_use_[s] < last_use_[best];
    }
    if (better) best = s;
  }
  return best;
}

int RealRegion::assign(int slot, int expert, uint64_t tick) {
  int old = slot_expert_[slot];
  if (old >= 0) expert_slot_[old] = -1;
  slot_expert_[slot] = expert;
  expert_slot_[expert] = slot;
  last_use_[slot] = tick;
  loaded_at_[slot] = tick;
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
  }
  if (pinned != pinned_count_) return "pinned count mismatch";
  return {};
}

}  // namespace es
