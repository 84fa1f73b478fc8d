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

void Router::top(const float* x, size_t x_values, int budget, int32_t* out) const {
  if (x_values != static_cast<size_t>(hidden_))
    throw std::invalid_argument("router: x has " + std::to_string(x_values) +
                                " values, hidden is " + std::to_string(hidden_));
  if (budget < 1 || budget > num_experts_)
    throw std::invalid_argument("router: budget " + std::to_string(budget) +
                                " not in [1, " + std::to_string(num_experts_) + "]");
  std::vector<float> logits(static_cast<size_t>(num_experts_));
  constexpr int kLanes = 16;  // independent sums, so the compiler vectorizes the loop
  const int whole = hidden_ / kLanes * kLanes;
  for (int e = 0; e < num_experts_; ++e) {
    const uint16_t* w = weight_.data() + static_cast<size_t>(e) * hidden_;
    float lanes[kLanes] = {};
    for (int d = 0; d < whole; d += kLanes)
      for (int j = 0; j < kLanes; ++j) lanes[j] += from_bf16(w[d + j]) * x[d + j];
    float acc = 0.0f;
    for (int j = 0; j < kLanes; ++j) acc += lanes[j];
    for (int d = whole; d < hidden_; ++d) acc += from_bf16(w[d]) * x[d];
    const float logit = acc + bias_[static_cast<size_t>(e)];
    // A NaN ranks last, so the order below stays a strict weak ordering.
    logits[static_cast<size_t>(e)] =
        std::isnan(logit) ? -std::numeric_limits<float>::infinity() : logit;
  }
  std::vector<int32_t> order(static_cast<size_t>(num_experts_));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + budget, order.end(), [&](int32_t a, int32_t b) {
    const float la = logits[static_cast<size_t>(a)], lb = logits[static_cast<size_t>(b)];
    return la != lb ? la > lb : a < b;
  });
  std::copy(order.begin(), order.begin() + budget, out);
}

std::vector<int32_t> Router::top_rows(const float* x, int rows, int budget) const {
  if (rows < 1) throw std::invalid_argument("router: rows " + std::to_string(rows) + " < 1");
  const size_t width = budget > 0 ? static_cast<size_t>(budget) : 0;
  std::vector<int32_t> ranked(static_cast<size_t>(rows) * width);
  for (int r = 0; r < rows; ++r)
    top(x + static_cast<size_t>(r) * hidden_, static_cast<size_t>(hidden_), budget,
        ranked.data() + static_cast<size_t>(r) * width);
  if (rows == 1) return ranked;
  std::vector<int32_t> merged;
  std::vector<uint8_t> seen(static_cast<size_t>(num_experts_), 0);
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
