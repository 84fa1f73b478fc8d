// Router: a dense copy of one MoE layer's router, for the prefetch prediction.
//
// The predictor applies the router of a later MoE layer to the current hidden state and
// prefetches its top experts. Built from MLX ops, that is five ops per MoE layer per token
// (reshape, router matmul, argpartition, slice, the prefetch itself), each one a task on
// the stream that evaluates the token: on a CPU of few cores they cost about as much as
// the reads the prediction hides. Router::top does it inside the one prefetch primitive
// (ext/primitives.h) instead.
//
// The copy is logits = weight @ x + bias with bfloat16 weights (half the bytes of float32;
// the prediction only ranks experts, it never changes a layer's output) and float32 bias
// and accumulation. Thread-safe: immutable after construction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace es {

class Router {
 public:
  // weight: num_experts x hidden float32, row-major; bias: bias_values float32, one per
  // expert. Throws std::invalid_argument for empty or mismatched sizes.
  Router(const float* weight, int num_experts, int hidden, const float* bias, int bias_values);

  int num_experts() const { return num_experts_; }
  int hidden() const { return hidden_; }

  // The `budget` experts of highest logit for hidden state x (`x_values` floats, which
  // must be `hidden`), into out[0..budget) in descending logit order (ties: lower expert
  // id first). budget must be in [1, num_experts]. Throws std::invalid_argument otherwise.
  void top(const float* x, size_t x_values, int budget, int32_t* out) const;

  // For `rows` hidden states (x: rows * hidden floats, row-major; a decode step of a
  // batch has a row per reply), each row's top `budget` merged rank by rank: every row's
  // best expert, then every row's second, ..., an expert once (at its first place), so a
  // caller that keeps only the first n serves every row alike. Throws as top() does, and
  // std::invalid_argument for rows < 1.
  std::vector<int32_t> top_rows(const float* x, int rows, int budget) const;

 private:
  // out[r * num_experts + e]: expert e's logit for row r of x (rows * hidden floats); a
  // NaN logit as -infinity.
  void logits(const float* x, int rows, float* out) const;
  // The `budget` experts of highest logit, highest first (ties: lower id first).
  void select(const float* logits, int budget, int32_t* out) const;
  void check_budget(int budget) const;

  int num_experts_;
  int hidden_;
  std::vector<uint16_t> weight_;  // bfloat16 bits, row-major
  std::vector<float> bias_;
};

}  // namespace es
