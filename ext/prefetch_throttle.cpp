#include "prefetch_throttle.h"

#include <algorithm>

namespace es {

PrefetchThrottle::PrefetchThrottle(const std::vector<int>& max_degree, bool adaptive)
    : adaptive_(adaptive), max_degree_(max_degree) {
  const size_t layers = max_degree.size();
  seen_.resize(layers);
  used_.resize(layers);
  pending_.resize(layers);
  scored_.assign(layers, 0);
  for (size_t li = 0; li < layers; ++li) {
    const size_t ranks = static_cast<size_t>(std::max(max_degree[li], 0));
    seen_[li].assign(ranks, 0);
    used_[li].assign(ranks, 0);
    pending_[li].assign(ranks, -1);
  }
  start_at(kHostStart);
}

void PrefetchThrottle::start_at(int level) {
  level_ = level;
  direction_ = 1;
  probe_ = level_ + direction_;
  kept_blocks_.clear();
  probe_blocks_.clear();
}

void PrefetchThrottle::staged() {
  if (!moved_) start_at(kStagedStart);
}

double PrefetchThrottle::rate(int li, size_t r) const {
  // One routed and one not routed before any is scored: an unscored rank starts at 1/2.
  return (used_[li][r] + 1.0) / (seen_[li][r] + 2.0);
}

int PrefetchThrottle::degree(int li) const {
  const int most = max_degree_[li];
  if (!adaptive_) return most;
  const double th = threshold();
  int d = 0;
  while (d < most && rate(li, static_cast<size_t>(d)) >= th) ++d;
  return d;
}

void PrefetchThrottle::predicted(int li, const int32_t* ids, size_t n,
                                 const std::vector<uint8_t>& skip) {
  auto& p = pending_[li];
  std::fill(p.begin(), p.end(), -1);
  for (size_t r = 0; r < std::min(n, p.size()); ++r)
    if (!skip[r]) p[r] = ids[r];
}

void PrefetchThrottle::routed(int li, const std::vector<int>& experts) {
  auto& p = pending_[li];
  bool any = false;
  for (size_t r = 0; r < p.size(); ++r) {
    if (p[r] < 0) continue;
    any = true;
    ++seen_[li][r];
    used_[li][r] += std::find(experts.begin(), experts.end(), p[r]) != experts.end();
    p[r] = -1;
  }
  if (!any || ++scored_[li] < kWindow) return;
  scored_[li] = 0;
  for (size_t r = 0; r < p.size(); ++r) {
    seen_[li][r] /= 2;
    used_[li][r] /= 2;
  }
}

void PrefetchThrottle::forward_ended(double seconds, bool decode) {
  if (!adaptive_ || !decode) return;  // a prefill's forward leaves the block as it was
  block_seconds_ += seconds;
  if (++block_forwards_ < kBlock) return;
  (probing_ ? probe_blocks_ : kept_blocks_).push_back(block_seconds_);
  block_seconds_ = 0;
  block_forwards_ = 0;
  ++blocks_;
  if (std::min(kept_blocks_.size(), probe_blocks_.size()) >= static_cast<size_t>(kPairs))
    settle();
  probing_ = blocks_ % 2 == 1;
}

void PrefetchThrottle::settle() {
  int wins = 0;
  for (int i = 0; i < kPairs; ++i)
    wins += probe_blocks_[static_cast<size_t>(i)] <
            (1.0 - kMargin) * kept_blocks_[static_cast<size_t>(i)];
  moved_ = true;
  if (wins >= kWins) {
    level_ = probe_;  // and the next neighbour the same way
  } else {
    direction_ = -direction_;
  }
  if (level_ + direction_ < 0 || level_ + direction_ >= kLevels) direction_ = -direction_;
  probe_ = level_ + direction_;
  kept_blocks_.clear();
  probe_blocks_.clear();
}

}  // namespace es
