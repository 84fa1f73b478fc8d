// The demand-loaded real region of one MoE layer: `cap` slots, each holding one expert.
//
// Pure bookkeeping (no I/O, no locking: ExpertCache serialises access). Eviction picks an
// empty slot first, else the unpinned, not-busy slot whose expert has the lowest LFU
// frequency (ties: least recently used) or, under LRU, the least recently used one.
// LFU frequencies are kept per expert, resident or not, and halve every `decay_every`
// calls so that old popularity fades (the "LFU with periodic decay" of DESIGN.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace es {

enum class Policy : int { kLFU = 0, kLRU = 1 };

class RealRegion {
 public:
  RealRegion(int cap, int num_experts, Policy policy, int decay_every);

  int cap() const { return static_cast<int>(slot_expert_.size()); }
  int num_experts() const { return static_cast<int>(expert_slot_.size()); }
  int slot_of(int expert) const { return expert_slot_[expert]; }
  int expert_at(int slot) const { return slot_expert_[slot]; }
  bool pinned(int expert) const { return pinned_[expert] != 0; }
  int pinned_count() const { return pinned_count_; }
  float freq(int expert) const { return freq_[expert]; }
  uint64_t loaded_at(int slot) const { return loaded_at_[slot]; }

  // Counts one use of `expert` at time `tick` (frequency + recency).
  void touch(int expert, uint64_t tick);
  // Ends one acquire call: applies the periodic decay.
  void end_call();

  // Chooses the slot a new expert goes to, never a pinned slot or one with busy[slot] set;
  // -1 when none is left.
  int choose_victim(const std::vector<uint8_t>& busy) const;
  // Puts `expert` in `slot` (evicting its occupant); returns the evicted expert or -1.
  int assign(int slot, int expert, uint64_t tick);
  // Empties `slot` (a load into it failed).
  void clear(int slot);

  void set_pinned(int expert, bool pinned);
  void set_policy(Policy p) { policy_ = p; }
  Policy policy() const { return policy_; }

  // Empty string when slot<->expert maps agree and pinned experts are resident.
  std::string check() const;

 private:
  Policy policy_;
  int decay_every_;
  int calls_ = 0;
  int pinned_count_ = 0;
  std::vector<int> slot_expert_;     // cap, -1 = empty
  std::vector<int> expert_slot_;     // num_experts, -1 = not resident
  std::vector<uint64_t> last_use_;   // cap
  std::vector<uint64_t> loaded_at_;  // cap
  std::vector<float> freq_;          // num_experts
  std::vector<uint8_t> pinned_;      // num_experts
};

}  // namespace es
