// MLX primitives that run the expert cache from inside the lazy graph.
//
// acquire_op(cache, layer, ids) returns the pool rows of `ids` (the router's expert ids of
// MoE layer `layer`) as a lazy int32 array of the same shape. When MLX evaluates it, the
// ids exist: the cache maps them to rows (real hit, side hit or demand read) on the
// stream's thread, in graph order. The host never waits on the router, so Python builds a
// whole token's graph without a pipeline drain, and a miss costs the read itself. Every
// earlier task of the stream has run by then, so no row an earlier layer still reads is
// reused (the read fence of the synchronous path, now by stream order).
//
// prefetch_op(cache, layer, x, router, budget) returns a uint8 scalar that depends on `x`
// (the hidden state entering an earlier MoE layer). When MLX evaluates it, `router` (MoE
// layer `layer`'s) ranks the experts for x's last token and the top `budget` are
// reserved and queued (or read inline in SYNC mode): one op per target layer, a source
// layer's ops chained through `after`. Tying the last scalar into the hidden state with
// mx.depends, or into an earlier acquire_op as its `after` (on a GPU, so that the GPU never
// waits for it), orders the reservations before that layer's acquire.
//
// Both run on a CPU stream (eval_cpu) on every platform: on a GPU device MLX orders them
// with the GPU work through its cross-stream events. No eval_gpu is built.
#pragma once

#include <memory>
#include <optional>

#include "expert_cache.h"
#include "mlx/primitives.h"
#include "router.h"
#include "mlx/utils.h"

namespace es {

class AcquirePrimitive : public mx::Primitive {
 public:
  AcquirePrimitive(mx::Stream stream, std::shared_ptr<ExpertCache> cache, int layer)
      : mx::Primitive(stream), cache_(std::move(cache)), layer_(layer) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "ExpertAcquire"; }

 private:
  std::shared_ptr<ExpertCache> cache_;
  int layer_;
};

class PrefetchPrimitive : public mx::Primitive {
 public:
  PrefetchPrimitive(mx::Stream stream, std::shared_ptr<ExpertCache> cache, int layer,
                    std::shared_ptr<const Router> router, int budget, int rows)
      : mx::Primitive(stream),
        cache_(std::move(cache)),
        layer_(layer),
        router_(std::move(router)),
        budget_(budget),
        rows_(rows) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "ExpertPrefetch"; }

 private:
  std::shared_ptr<ExpertCache> cache_;
  int layer_;
  std::shared_ptr<const Router> router_;
  int budget_;
  int rows_;
};

// ids: any shape, strides and integer dtype (the router's ids as they are: read in place
// when evaluated, so the op adds one node to the graph). Returns int32 pool rows of the
// same shape. The caller guarantees the call cannot be over capacity (ExpertCache::plan
// said kPlanStream); if it is anyway, or a read fails, the rows are all 0 (a valid row,
// so the kernels that consume them never index outside the pool) and the error goes to
// ExpertCache::set_stream_error, for the host to raise before it uses the result.
// `after`: an array to evaluate first (not read), e.g. a prefetch_op's scalar, so that it
// runs on this op's stream just before it. Throws std::invalid_argument for a non-integer
// dtype.
mx::array acquire_op(std::shared_ptr<ExpertCache> cache, int layer, const mx::array& ids,
                     const std::optional<mx::array>& after = std::nullopt,
                     mx::StreamOrDevice s = {});

// x: (..., hidden) float32, float16 or bfloat16, any strides; the rows of its last `rows`
// tokens (a decode step's replies; fewer where it has fewer) are read in place and ranked
// by Router::top_rows. budget in [1, router's experts]. Throws std::out_of_range for a
// layer the cache does not have, std::invalid_argument for another dtype, a hidden size
// other than the router's, an empty x, a router of another expert count, a budget out of
// range or rows < 1 (each naming the layer). `after`: an array to evaluate first (not
// read), e.g. the scalar of a nearer target's prediction from the same x, as in acquire_op.
mx::array prefetch_op(std::shared_ptr<ExpertCache> cache, int layer, const mx::array& x,
                      std::shared_ptr<const Router> router, int budget, int rows = 1,
                      const std::optional<mx::array>& after = std::nullopt,
                      mx::StreamOrDevice s = {});

}  // namespace es
