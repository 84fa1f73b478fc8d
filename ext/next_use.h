// NextUseModel: an online estimate, per MoE layer, of how likely each expert is to be
// wanted at the layer's next call (the next token), for the "predictive" eviction of
// RealRegion: evict the resident expert least likely to be wanted soon (Belady's MIN
// evicts the one wanted furthest in the future; this guesses it from what was seen).
//
// Evidence, all learned from the calls the cache sees (no offline training):
//   - token-to-token transitions of this layer: counts of "a chosen for token t-1, e
//     chosen for token t" (lag 1) and the same at lag 2;
//   - cross-layer co-activation: "a chosen by the previous MoE layer (and the one before
//     it) for token t-1, e chosen here for token t", applied to this token's choice there;
//   - frequency with aging at two rates (fast and slow), and recency;
//   - the router's probabilities for this token, when the engine hands them over (hint).
// Each expert gets a feature vector of these: for each context (the previous tokens, the
// layers above) the log lift log(P(e | context) / P(e)), with the conditional shrunk
// towards the expert's popularity P(e) while the context has few observations; the log
// popularity itself; the log recent frequency; recency; the log router probability. An
// online logistic regression (one weight vector per layer, SGD on the experts it scored
// at the previous call against which of them this call wanted) turns it into a logit.
// Every count decays exponentially per call; the decay is kept lazy (increments grow by
// 1 / (1 - rate) per call, everything is rescaled now and then), so a call costs
// O((resident + chosen) x chosen) and not O(E^2).
//
// Calls of several tokens (a prefill) count towards frequency and recency only: their
// experts are a union, not one token's choice.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace es {

class NextUseModel {
 public:
  // Feature indices (also of weights()).
  enum Feature {
    kBias = 0,
    kLag1,             // lift of this token's experts here (lag-1 transition)
    kLag2,             // lift of the previous token's experts here (lag 2)
    kAbove1,           // lift of this token's experts at the previous MoE layer
    kAbove2,           // ... and at the one before it
    kRecentFrequency,  // log share of recent uses (fast aging)
    kPopularity,       // log share of uses (slow aging)
    kRecency,          // exp(-calls since last use / 8)
    kRouter,           // log router probability (0 without a hint)
    kFeatures
  };

  explicit NextUseModel(int num_experts);

  int num_experts() const { return num_experts_; }

  // One acquire call of the layer.
  //   experts: the call's distinct experts.
  //   above1, above2: this token's distinct experts at the previous MoE layer and the
  //     one before it (empty for the first layers or when unknown).
  //   router: the layer's router probabilities for this token, num_experts values, or
  //     empty when not given.
  //   one_token: the call routed one token (a decode step).
  //   candidates: experts to score for the next eviction (the residents); the call's
  //     experts are scored as well.
  void observe(const std::vector<int>& experts, const std::vector<int>& above1,
               const std::vector<int>& above2, const std::vector<float>& router,
               bool one_token, const std::vector<int>& candidates);

  // Logit of `expert` being wanted at the next call, as of the last observe (0 for an
  // expert not scored then).
  float score(int expert) const { return score_[expert]; }
  const std::vector<float>& weights() const { return w_; }

  // Empty when every count is finite and non-negative, each table row sums to its row
  // total and the frequency totals match (relative tolerance 1e-3).
  std::string check() const;

 private:
  // Counts that decay by (1 - rate) per call, lazily: `unit` is what one event adds now.
  struct Decay {
    double rate;
    double unit = 1.0;
    void advance() { unit /= 1.0 - rate; }
    bool due() const { return unit > 1e6; }
  };

  float& table(int which, int a, int e) {
    return tables_[(static_cast<size_t>(which) * num_experts_ + a) * num_experts_ + e];
  }
  float table(int which, int a, int e) const {
    return tables_[(static_cast<size_t>(which) * num_experts_ + a) * num_experts_ + e];
  }
  float& row_total(int which, int a) {
    return row_totals_[static_cast<size_t>(which) * num_experts_ + a];
  }
  void count(int which, const std::vector<int>& from, const std::vector<int>& to);
  double popularity(int e) const;
  // log(P(e | given) / pop) from table `which`; 0 when `given` is empty.
  double lift(int which, const std::vector<int>& given, int e, double pop) const;
  void features(int e, const std::vector<int>& experts, const std::vector<float>& router,
                float* x) const;
  void learn(const std::vector<int>& experts);
  void rescale_tables();
  void rescale_freq(std::vector<float>& f, double& total, Decay& d);

  enum Table { kLagTable1 = 0, kLagTable2, kAboveTable1, kAboveTable2, kTables };

  int num_experts_;
  uint64_t calls_ = 0;
  std::vector<float> tables_;      // kTables x E x E
  std::vector<float> row_totals_;  // kTables x E
  Decay table_decay_{0.003};
  std::vector<float> fast_, slow_;  // per expert
  double fast_total_ = 0, slow_total_ = 0;
  Decay fast_decay_{0.03}, slow_decay_{0.003};
  std::vector<uint64_t> last_use_;  // call index of each expert's last use
  // Context of the last one-token calls: chosen at t-1 and t-2, above at t-1.
  std::vector<int> prev_, prev2_, prev_above1_, prev_above2_;
  bool prev_one_token_ = false, prev2_one_token_ = false;
  std::vector<float> w_;
  bool bias_set_ = false;
  std::vector<float> score_;
  // Experts scored at the last one-token call and their features, to learn from.
  std::vector<int> scored_;
  std::vector<float> scored_x_;
  std::vector<int> above1_, above2_;  // of the last call, for its features
  std::vector<uint64_t> stamp_;       // marks experts of one pass (== epoch_)
  uint64_t epoch_ = 0;
};

}  // namespace es
