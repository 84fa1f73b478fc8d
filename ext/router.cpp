#include "router.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>

namespace es {

namespace {

// float32 -> bfloat16 bits, rounding to nearest even (NaN kept a NaN).
uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace

Router::Router(const float* weight, int num_experts, int hidden, const float* bias,
               int bias_values)
    : num_experts_(num_experts), hidden_(hidden) {
  if (bias_values != num_experts)
    throw std::invalid_argument("router: weight has " + std::to_string(num_experts) +
                                " rows, bias " + std::to_string(bias_values) + " values");
  if (num_experts < 1 || hidden < 1)
    throw std::invalid_argument("router: " + std::to_string(num_experts) + " experts x " +
                                std::to_string(hidden) + " hidden is empty");
  const size_t n = static_cast<size_t>(num_experts) * static_cast<size_t>(hidden);
  weight_.resize(n);
  for (size_t i = 0; i < n; ++i) weight_[i] = to_bf16(weight[i]);
  bias_.assign(bias, bias + num_experts);
}

namespace {

// Expert logits of M rows of x (M fixed, so that every loop below has a constant trip count
// and vectorizes): each weight row is read and converted from bfloat16 once for the M.
template <int M>
void block_logits(const uint16_t* weight, const float* bias, int num_experts, int hidden,
                  const float* x, float* out) {
  // Independent sums per row (so the loop vectorizes), as many as SSE registers hold for
  // four rows at once; the same for every M, so that a row's logit does not depend on the
  // rows beside it.
  constexpr int kLanes = 8;
  const int whole = hidden / kLanes * kLanes;
  const size_t h = static_cast<size_t>(hidden);
  for (int e = 0; e < num_experts; ++e) {
    const uint16_t* w = weight + static_cast<size_t>(e) * h;
    float lanes[M][kLanes] = {};
    for (int d = 0; d < whole; d += kLanes) {
      float wf[kLanes];
      for (int j = 0; j < kLanes; ++j) wf[j] = from_bf16(w[d + j]);
      for (int r = 0; r < M; ++r)
        for (int j = 0; j < kLanes; ++j) lanes[r][j] += wf[j] * x[r * h + d + j];
    }
    for (int r = 0; r < M; ++r) {
      float acc = 0.0f;
      for (int j = 0; j < kLanes; ++j) acc += lanes[r][j];
      for (int d = whole; d < hidden; ++d) acc += from_bf16(w[d]) * x[r * h + d];
      const float logit = acc + bias[e];
      // A NaN ranks last, so the order select() sorts by stays a strict weak ordering.
      out[static_cast<size_t>(r) * num_experts + e] =
          std::isnan(logit) ? -std::numeric_limits<float>::infinity() : logit;
    }
  }
}

}  // namespace

void Router::logits(const float* x, int rows, float* out) const {
  // Four rows at a time: the weights (num_experts x hidden) are the bytes that cost.
  const size_t h = static_cast<size_t>(hidden_), n = static_cast<size_t>(num_experts_);
  const uint16_t* w = weight_.data();
  const float* b = bias_.data();
  int r = 0;
  for (; r + 4 <= rows; r += 4)
    block_logits<4>(w, b, num_experts_, hidden_, x + r * h, out + r * n);
  switch (rows - r) {
    case 3: block_logits<3>(w, b, num_experts_, hidden_, x + r * h, out + r * n); break;
    case 2: block_logits<2>(w, b, num_experts_, hidden_, x + r * h, out + r * n); break;
    case 1: block_logits<1>(w, b, num_experts_, hidden_, x + r * h, out + r * n); break;
    default: break;
  }
}

void Router::select(const float* logits, int budget, int32_t* out) const {
  std::vector<int32_t> order(static_cast<size_t>(num_experts_));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + budget, order.end(), [&](int32_t a, int32_t b) {
    const float la = logits[a], lb = logits[b];
    return la != lb ? la > lb : a < b;
  });
  std::copy(order.begin(), order.begin() + budget, out);
}

void Router::check_budget(int budget) const {
  if (budget < 1 || budget > num_experts_)
    throw std::invalid_argument("router: budget " + std::to_string(budget) +
                                " not in [1, " + std::to_string(num_experts_) + "]");
}

void Router::top(const float* x, size_t x_values, int budget, int32_t* out) const {
  if (x_values != static_cast<size_t>(hidden_))
    throw std::invalid_argument("router: x has " + std::to_string(x_values) +
                                " values, hidden is " + std::to_string(hidden_));
  check_budget(budget);
  std::vector<float> l(static_cast<size_t>(num_experts_));
  logits(x, 1, l.data());
  select(l.data(), budget, out);
}

std::vector<int32_t> Router::top_rows(const float* x, int rows, int budget) const {
  if (rows < 1) throw std::invalid_argument("router: rows " + std::to_string(rows) + " < 1");
  check_budget(budget);
  const size_t width = static_cast<size_t>(budget);
  const size_t experts = static_cast<size_t>(num_experts_);
  std::vector<float> l(static_cast<size_t>(rows) * experts);
  logits(x, rows, l.data());
  std::vector<int32_t> ranked(static_cast<size_t>(rows) * width);
  for (int r = 0; r < rows; ++r)
    select(l.data() + static_cast<size_t>(r) * experts, budget,
           ranked.data() + static_cast<size_t>(r) * width);
  if (rows == 1) return ranked;
  std::vector<int32_t> merged;
  std::vector<uint8_t> seen(experts, 0);
  for (size_t k = 0; k < width; ++k)
    for (int r = 0; r < rows; ++r) {
      const int32_t e = ranked[static_cast<size_t>(r) * width + k];
      if (!seen[static_cast<size_t>(e)]) {
        seen[static_cast<size_t>(e)] = 1;
        merged.push_back(e);
      }
    }
  return merged;
}

}  // namespace es
