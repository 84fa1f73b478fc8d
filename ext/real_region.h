// The demand-loaded real region of one MoE layer: `slots` slots, each holding one expert.
//
// Pure bookkeeping (no I/O, no locking: ExpertCache serialises access). Eviction takes an
// empty slot first, else an unpinned, not-busy slot chosen by the policy:
//   lfu         lowest LFU frequency (ties: least recently used). Frequencies are kept
//               per expert, resident or not, and halve every `decay_every` calls so that
//               old popularity fades (LFU with periodic decay);
//   lru         least recently used;
//   lfu-da      LFU with dynamic aging (Arlitt et al.): key = L + uses since the expert
//               came in, L = the key of the last victim;
//   s3-fifo     S3-FIFO (Yang et al., SOSP '23): a small FIFO (a tenth of the slots, at
//               least one) that new experts pass through, a main FIFO with a 2-bit use
//               count (reinserted while it is non-zero), and a ghost list of the small
//               FIFO's victims whose return goes straight to the main FIFO;
//   predictive  lowest estimated likelihood of being wanted at the next call
//               (NextUseModel: transitions, cross-layer co-activation, frequency,
//               recency, router hints, learned online); ties: least recently used.
// The LFU frequencies are counted under every policy: autopin and the snapshot use them.
//
// Pins never cost hits for long: while any expert is pinned, a shadow of the region (the
// same policy, no pins, started from the region's state when the first pin was set) is
// fed the same calls. When the shadow has had more real-region hits than the pinned
// region, the pinned expert of lowest LFU frequency is unpinned (counted in
// pins_dropped(), which autopin takes off its budget) and the shadow restarts from the
// region's state.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "next_use.h"

namespace es {

// In the order of policy_name; the first is CacheConfig's default.
enum class Policy : int { kPredictive = 0, kLFU = 1, kLRU = 2, kLFUDA = 3, kS3FIFO = 4 };
inline constexpr int kNumPolicies = 5;

// "predictive", "lfu", "lru", "lfu-da", "s3-fifo" (engine._ext.POLICY_NAMES).
const char* policy_name(Policy p);
// Inverse of policy_name; std::invalid_argument naming the choices otherwise.
Policy policy_from_name(const std::string& name);

// What the cache knows about an acquire call besides its experts (for `predictive`).
struct CallContext {
  std::vector<int> above1, above2;  // this token's experts at the previous two MoE layers
  std::vector<float> router;        // this layer's router probabilities (empty: none)
  bool one_token = true;            // the call routed a single token
};

class RealRegion {
 public:
  RealRegion(int slots, int num_experts, Policy policy, int decay_every);

  int slots() const { return static_cast<int>(slot_expert_.size()); }
  int num_experts() const { return static_cast<int>(expert_slot_.size()); }
  int slot_of(int expert) const { return expert_slot_[expert]; }
  int expert_at(int slot) const { return slot_expert_[slot]; }
  bool pinned(int expert) const { return pinned_[expert] != 0; }
  int pinned_count() const { return pinned_count_; }
  float freq(int expert) const { return freq_[expert]; }
  uint64_t loaded_at(int slot) const { return loaded_at_[slot]; }

  // Counts one acquire call's distinct `experts` at time `tick` (before any victim is
  // chosen for it): frequency, recency and the policy's own state.
  void use(const std::vector<int>& experts, uint64_t tick, const CallContext& ctx);
  // Ends one acquire call: applies the periodic decay.
  void end_call();

  // Chooses the slot a new expert goes to, never a pinned slot or one with busy[slot] set;
  // -1 when none is left. Advances the policy's own queues (s3-fifo) and aging (lfu-da).
  int choose_victim(const std::vector<uint8_t>& busy);
  // The slot a side-hit `expert` (not resident, just used) should be copied into, or -1:
  // none is free of busy and pinned, or the policy would rather keep every occupant
  // (lfu: no occupant used less often; predictive: none less likely to be wanted next;
  // lru, lfu-da and s3-fifo admit it as they admit a miss).
  int promotion_slot(int expert, const std::vector<uint8_t>& busy);
  // Puts `expert` in `slot` (evicting its occupant); returns the evicted expert or -1.
  int assign(int slot, int expert, uint64_t tick);
  // Empties `slot` (a load into it failed).
  void clear(int slot);

  void set_pinned(int expert, bool pinned);
  // Pins dropped because they cost hits (see above), since construction.
  uint64_t pins_dropped() const { return pins_dropped_; }
  void set_policy(Policy p);
  Policy policy() const { return policy_; }

  // Empty string when slot<->expert maps agree, pinned experts are resident and the
  // policy's counts are consistent.
  std::string check() const;

 private:
  bool candidate(int slot, const std::vector<uint8_t>& busy) const;
  int s3fifo_victim(const std::vector<uint8_t>& busy);
  // Frequency, recency and the per-slot policy state of one call's experts.
  void count_use(const std::vector<int>& experts, uint64_t tick);
  // A copy of this region's slots and policy state without pins, scoring with this
  // region's model (shared).
  std::unique_ptr<RealRegion> make_shadow() const;
  // The shadow's side of one call: counts, then loads its misses (no I/O).
  void shadow_call(const std::vector<int>& experts, uint64_t tick);
  void compare_with_shadow(const std::vector<int>& experts, uint64_t tick);

  Policy policy_;
  int decay_every_;
  int calls_ = 0;
  int pinned_count_ = 0;
  std::vector<int> slot_expert_;     // slots, -1 = empty
  std::vector<int> expert_slot_;     // num_experts, -1 = not resident
  std::vector<uint64_t> last_use_;   // slots
  std::vector<uint64_t> loaded_at_;  // slots
  std::vector<float> freq_;          // num_experts
  std::vector<uint8_t> pinned_;      // num_experts

  // lfu-da: uses since the expert came in and its key (floor + uses at its last use),
  // per slot, and the aging floor L.
  std::vector<uint64_t> da_uses_, da_key_;  // slots
  uint64_t da_floor_ = 0;
  // s3-fifo: queue of each slot (0 small, 1 main), its place (larger: newer), its use
  // count (0-3); the ghost list as the time each expert entered it.
  std::vector<uint8_t> fifo_main_;   // slots
  std::vector<uint64_t> fifo_seq_;   // slots
  std::vector<uint8_t> fifo_uses_;   // slots
  std::vector<uint64_t> ghost_at_;   // num_experts, 0 = not in the ghost list
  uint64_t fifo_clock_ = 0, ghost_clock_ = 0;
  // predictive: made when the policy is first set to it; a shadow shares its region's
  // (only the region feeds it: the shadow never calls use()).
  std::shared_ptr<NextUseModel> model_;
  std::vector<int> scratch_;  // residents, reused per call
  // Pins against the region without them (see the top of this file).
  std::shared_ptr<RealRegion> shadow_;
  uint64_t pinned_hits_ = 0, shadow_hits_ = 0, pins_dropped_ = 0;
};

}  // namespace es
