#include "next_use.h"

#include <algorithm>
#include <cmath>

namespace es {

namespace {

// Pseudo-counts: a context's conditional starts at the expert's popularity, worth kAlpha
// observations per context expert; popularity starts uniform, worth kBeta calls.
constexpr double kAlpha = 2.0;
constexpr double kBeta = 1.0;
constexpr float kLearningRate = 0.03f;
constexpr double kRecencyCalls = 8.0;  // recency feature: exp(-calls since last use / this)
constexpr double kFloor = 1e-3;        // log floor of the frequency and router features

bool finite_non_negative(float v) { return std::isfinite(v) && v >= 0.f; }

}  // namespace

NextUseModel::NextUseModel(int num_experts)
    : num_experts_(num_experts),
      tables_(static_cast<size_t>(kTables) * num_experts * num_experts, 0.f),
      row_totals_(static_cast<size_t>(kTables) * num_experts, 0.f),
      fast_(num_experts, 0.f),
      slow_(num_experts, 0.f),
      last_use_(num_experts, 0),
      w_(kFeatures, 0.f),
      score_(num_experts, 0.f),
      stamp_(num_experts, 0) {
  // Until the weights are learned: popularity plus half of each context's evidence (a
  // damped naive Bayes) and some recency; the bias is set at the first token
  // (observe). This start is what beat LFU on the first 100 tokens of the traces.
  w_[kLag1] = w_[kLag2] = w_[kAbove1] = w_[kAbove2] = 0.5f;
  w_[kPopularity] = 1.f;
  w_[kRecency] = 0.5f;
}

void NextUseModel::count(int which, const std::vector<int>& from, const std::vector<int>& to) {
  const auto unit = static_cast<float>(table_decay_.unit);
  for (int a : from) {
    for (int e : to) table(which, a, e) += unit;
    row_total(which, a) += unit * static_cast<float>(to.size());
  }
}

double NextUseModel::popularity(int e) const {
  const double u = slow_decay_.unit;
  return (slow_[e] / u + kBeta / num_experts_) / (slow_total_ / u + kBeta);
}

double NextUseModel::lift(int which, const std::vector<int>& given, int e, double pop) const {
  if (given.empty()) return 0.0;
  double num = 0, den = 0;
  for (int a : given) {
    num += table(which, a, e);
    den += row_totals_[static_cast<size_t>(which) * num_experts_ + a];
  }
  const double u = table_decay_.unit, prior = kAlpha * static_cast<double>(given.size());
  return std::log((num / u + prior * pop) / (den / u + prior) / pop);
}

void NextUseModel::features(int e, const std::vector<int>& experts,
                            const std::vector<float>& router, float* x) const {
  const double E = num_experts_, pop = popularity(e);
  static const std::vector<int> none;
  x[kBias] = 1.f;
  x[kLag1] = static_cast<float>(lift(kLagTable1, experts, e, pop));
  x[kLag2] = static_cast<float>(lift(kLagTable2, prev_one_token_ ? prev_ : none, e, pop));
  x[kAbove1] = static_cast<float>(lift(kAboveTable1, above1_, e, pop));
  x[kAbove2] = static_cast<float>(lift(kAboveTable2, above2_, e, pop));
  x[kRecentFrequency] = static_cast<float>(
      std::log(fast_total_ > 0 ? E * fast_[e] / fast_total_ + kFloor : 1.0 + kFloor));
  x[kPopularity] = static_cast<float>(std::log(E * pop));
  x[kRecency] =
      static_cast<float>(std::exp(-static_cast<double>(calls_ - last_use_[e]) / kRecencyCalls));
  x[kRouter] = router.empty() ? 0.f : static_cast<float>(std::log(E * router[e] + kFloor));
}

void NextUseModel::learn(const std::vector<int>& experts) {
  ++epoch_;
  for (int e : experts) stamp_[e] = epoch_;
  for (size_t i = 0; i < scored_.size(); ++i) {
    const float* x = &scored_x_[i * kFeatures];
    float z = 0.f;
    for (int f = 0; f < kFeatures; ++f) z += w_[f] * x[f];
    const float y = stamp_[scored_[i]] == epoch_ ? 1.f : 0.f;
    const float g = kLearningRate * (y - 1.f / (1.f + std::exp(-z)));
    for (int f = 0; f < kFeatures; ++f) w_[f] += g * x[f];
  }
}

void NextUseModel::rescale_tables() {
  const auto s = static_cast<float>(1.0 / table_decay_.unit);
  for (auto& v : tables_) v *= s;
  for (auto& v : row_totals_) v *= s;
  table_decay_.unit = 1.0;
}

void NextUseModel::rescale_freq(std::vector<float>& f, double& total, Decay& d) {
  const double s = 1.0 / d.unit;
  for (auto& v : f) v = static_cast<float>(v * s);
  total *= s;
  d.unit = 1.0;
}

void NextUseModel::observe(const std::vector<int>& experts, const std::vector<int>& above1,
                           const std::vector<int>& above2, const std::vector<float>& router,
                           bool one_token, const std::vector<int>& candidates) {
  ++calls_;
  if (one_token && !bias_set_) {
    // Start the bias at the base rate: k of E experts are wanted at each token.
    const double k = static_cast<double>(experts.size());
    if (k > 0 && k < num_experts_) w_[kBias] = static_cast<float>(std::log(k / (num_experts_ - k)));
    bias_set_ = true;
  }
  if (one_token && !scored_.empty()) learn(experts);

  table_decay_.advance();
  if (one_token && prev_one_token_) {
    count(kLagTable1, prev_, experts);
    count(kAboveTable1, prev_above1_, experts);
    count(kAboveTable2, prev_above2_, experts);
    if (prev2_one_token_) count(kLagTable2, prev2_, experts);
  }
  if (table_decay_.due()) rescale_tables();

  fast_decay_.advance();
  slow_decay_.advance();
  for (int e : experts) {
    fast_[e] += static_cast<float>(fast_decay_.unit);
    slow_[e] += static_cast<float>(slow_decay_.unit);
    fast_total_ += fast_decay_.unit;
    slow_total_ += slow_decay_.unit;
    last_use_[e] = calls_;
  }
  if (fast_decay_.due()) rescale_freq(fast_, fast_total_, fast_decay_);
  if (slow_decay_.due()) rescale_freq(slow_, slow_total_, slow_decay_);

  // Score the residents and this call's experts (the next call's eviction candidates).
  above1_ = above1;
  above2_ = above2;
  scored_.clear();
  scored_x_.clear();
  ++epoch_;
  float x[kFeatures];
  auto score_one = [&](int e) {
    if (stamp_[e] == epoch_) return;
    stamp_[e] = epoch_;
    features(e, experts, router, x);
    float z = 0.f;
    for (int f = 0; f < kFeatures; ++f) z += w_[f] * x[f];
    score_[e] = z;
    if (!one_token) return;
    scored_.push_back(e);
    scored_x_.insert(scored_x_.end(), x, x + kFeatures);
  };
  for (int e : candidates) score_one(e);
  for (int e : experts) score_one(e);

  prev2_ = prev_;
  prev2_one_token_ = prev_one_token_;
  prev_ = experts;
  prev_one_token_ = one_token;
  prev_above1_ = above1;
  prev_above2_ = above2;
}

std::string NextUseModel::check() const {
  const int E = num_experts_;
  for (int t = 0; t < kTables; ++t) {
    for (int a = 0; a < E; ++a) {
      double sum = 0;
      for (int e = 0; e < E; ++e) {
        float v = table(t, a, e);
        if (!finite_non_negative(v))
          return "next-use table " + std::to_string(t) + " has a bad count at (" +
                 std::to_string(a) + ", " + std::to_string(e) + ")";
        sum += v;
      }
      const double total = row_totals_[static_cast<size_t>(t) * E + a];
      if (std::fabs(sum - total) > 1e-3 * std::max(total, 1.0))
        return "next-use table " + std::to_string(t) + " row " + std::to_string(a) + " sums to " +
               std::to_string(sum) + " but its total is " + std::to_string(total);
    }
  }
  double fast = 0, slow = 0;
  for (int e = 0; e < E; ++e) {
    if (!finite_non_negative(fast_[e]) || !finite_non_negative(slow_[e]))
      return "next-use frequency of expert " + std::to_string(e) + " is not a count";
    fast += fast_[e];
    slow += slow_[e];
  }
  if (std::fabs(fast - fast_total_) > 1e-3 * std::max(fast_total_, 1.0) ||
      std::fabs(slow - slow_total_) > 1e-3 * std::max(slow_total_, 1.0))
    return "next-use frequencies do not sum to their totals";
  for (float w : w_)
    if (!std::isfinite(w)) return "next-use weights are not finite";
  return {};
}

}  // namespace es
