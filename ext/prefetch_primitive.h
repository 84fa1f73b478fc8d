// An MLX primitive that starts a side-region prefetch from inside the lazy graph.
//
// prefetch_op(cache, layer, ids) returns a uint8 scalar that depends on `ids` (the expert
// ids predicted for MoE layer `layer`). When MLX evaluates it, the ids exist and the fills
// are reserved and queued (or run inline in SYNC mode) with no host synchronisation on the
// main path; tying the scalar into the hidden state with mx.depends orders the reservation
// before that layer's acquire. It runs on a CPU stream (eval_cpu) on every platform; a
// Metal eval_gpu is not built, so callers pass a CPU stream.
#pragma once

#include <memory>

#include "expert_cache.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace es {

class PrefetchPrimitive : public mx::Primitive {
 public:
  PrefetchPrimitive(mx::Stream stream, std::shared_ptr<ExpertCache> cache, int layer)
      : mx::Primitive(stream), cache_(std::move(cache)), layer_(layer) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "ExpertPrefetch"; }

 private:
  std::shared_ptr<ExpertCache> cache_;
  int layer_;
};

// ids: any shape, any integer dtype (converted to int32). Throws std::invalid_argument
// for a non-integer dtype.
mx::array prefetch_op(std::shared_ptr<ExpertCache> cache, int layer, const mx::array& ids,
                      mx::StreamOrDevice s = {});

}  // namespace es
