// PrefetchThrottle: how many of each MoE layer's predicted experts a prefetch fills (the
// layer's prefetch degree), decided at run time as feedback-directed prefetching decides
// it in CPU caches: from what the predictions return and from what a fill costs on this
// machine's path.
//
// What a prediction returns, per MoE layer and rank: every prediction for a layer (its
// side_slots experts, in the router's order; an expert with a real slot needs no fill
// and is left out) is scored against the experts the layer's next one-token call is
// routed to. Rank r's usefulness is the share of its predictions so scored that were
// routed to: a fill of it would have been used. Every rank is scored whatever the degree,
// so a rank left unfilled can come back. Counts are halved every kWindow scored
// predictions of the layer, so the rate follows the conversation.
//
// What a fill costs: a used fill saves a miss (a demand read, or a copy from the host
// tier, on the critical path); any fill costs a read or a copy, reader CPU and bandwidth,
// which on one machine hide behind the compute and on another (a saturated disk, copies
// on the compute stream, few cores) cost as much as the miss. So the usefulness a fill
// must reach, the threshold, is measured rather than modelled: decode forwards alternate,
// kBlock at a time, between the threshold kept and a neighbour on kLadder (from "every
// side row" to "none"), and the neighbour is kept when its blocks were faster than the
// kept one's next to them (by kMargin) in kWins of kPairs pairs (a sign test: a shared
// machine's noise moves it rarely); else the other neighbour is tried next. A layer's
// degree is the number of its leading ranks whose usefulness reaches the threshold of the
// forward under way.
//
// Where to start: fills on reader threads beside the compute (pools in host memory) cost
// little next to the miss they save (kHostStart); fills delivered as copies on the
// compute stream (staged writes, MLX CUDA) cost about what the miss costs (kStagedStart).
//
// Not thread-safe: ExpertCache calls it under its lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace es {

class PrefetchThrottle {
 public:
  // Thresholds a fill's usefulness must reach, from "every side row" to "none".
  static constexpr double kLadder[] = {0.0, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.01};
  static constexpr int kLevels = sizeof(kLadder) / sizeof(kLadder[0]);
  static constexpr int kHostStart = 1;     // 0.1
  static constexpr int kStagedStart = 5;   // 0.6
  static constexpr int kBlock = 2;         // decode forwards in a row on one threshold
  static constexpr int kPairs = 6;         // block pairs per comparison
  static constexpr int kWins = 5;          // pairs the neighbour must win to be kept
  static constexpr double kMargin = 0.02;  // by this share of the kept block's time
  static constexpr uint32_t kWindow = 64;  // scored predictions per halving

  PrefetchThrottle() = default;
  // max_degree[li]: the most experts layer li fills per prediction (its side rows per
  // bank, 0 for a layer no layer prefetches for). adaptive false: every layer fills its
  // max_degree always (a fixed degree), and nothing is measured.
  PrefetchThrottle(const std::vector<int>& max_degree, bool adaptive);

  bool adaptive() const { return adaptive_; }
  // Fills are delivered as copies on the compute stream from now on (staged writes): the
  // threshold starts at kStagedStart, unless comparisons have already moved it.
  void staged();
  // The experts of a prediction that layer li fills in the forward under way: its
  // leading ranks whose usefulness reaches the forward's threshold.
  int degree(int li) const;
  // The threshold of the forward under way (0 when not adaptive: every side row).
  double threshold() const { return adaptive_ ? kLadder[probing_ ? probe_ : level_] : 0.0; }
  // The threshold kept so far (the one the comparisons settled on).
  double kept_threshold() const { return adaptive_ ? kLadder[level_] : 0.0; }

  // A prediction for layer li: n experts in the router's order (rank = index), skip[i]
  // set for those that need no fill (a real slot, a duplicate, out of range).
  void predicted(int li, const int32_t* ids, size_t n, const std::vector<uint8_t>& skip);
  // A one-token call of layer li routed to `experts`: scores the layer's last prediction.
  void routed(int li, const std::vector<int>& experts);
  // A forward ended, which ran `seconds` from its first acquire to its last; `decode`:
  // every call of it was one token (a prefill's forward is not compared).
  void forward_ended(double seconds, bool decode);

 private:
  double rate(int li, size_t r) const;
  void settle();
  void start_at(int level);

  bool adaptive_ = false;
  std::vector<int> max_degree_;              // [li]
  std::vector<std::vector<uint32_t>> seen_;  // [li][rank]: scored predictions
  std::vector<std::vector<uint32_t>> used_;  // [li][rank]: of those, routed to
  std::vector<uint32_t> scored_;             // [li]: since the last halving
  std::vector<std::vector<int>> pending_;    // [li][rank]: last prediction's expert, -1
  int level_ = kHostStart;  // the threshold kept
  int probe_ = kHostStart;  // the neighbour being tried
  int direction_ = 1;       // which neighbour is tried next
  bool moved_ = false;      // whether a comparison has settled yet
  bool probing_ = false;    // whether the forward under way runs the neighbour
  uint64_t blocks_ = 0;  // blocks finished
  // The block under way (decode seconds, forwards), and the finished blocks of each.
  double block_seconds_ = 0;
  int block_forwards_ = 0;
  std::vector<double> kept_blocks_, probe_blocks_;
};

}  // namespace es
