#include "primitives.h"

#include <algorithm>
#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace es {

namespace {

mx::array flat_int32(const mx::array& ids, const char* what, mx::StreamOrDevice s) {
  if (!mx::issubdtype(ids.dtype(), mx::integer))
    throw std::invalid_argument(std::string(what) + " ids must be an integer array");
  auto flat = mx::flatten(mx::astype(ids, mx::int32, s), s);
  return mx::contiguous(flat, false, s);
}

}  // namespace

void AcquirePrimitive::eval_cpu(const std::vector<mx::array>& inputs,
                                std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_output_array(out);
  // Runs on the stream's thread once `ids` has been computed. An error is handed to the
  // cache for the host to raise (ExpertCache::set_stream_error), with valid rows.
  encoder.dispatch([ids = inputs[0], out = mx::array::unsafe_weak_copy(out), cache = cache_,
                    layer = layer_]() mutable {
    int32_t* rows = out.data<int32_t>();
    const size_t n = ids.size();
    try {
      if (!cache->acquire(layer, ids.data<int32_t>(), rows, n).empty())
        throw std::logic_error("MoE layer " + std::to_string(layer) + ": " +
                               std::to_string(n) +
                               " expert ids exceed the evictable slots in a stream-ordered "
                               "acquire (pinned after the graph was built?)");
    } catch (...) {
      std::fill(rows, rows + n, 0);
      cache->set_stream_error(std::current_exception());
    }
  });
}

void AcquirePrimitive::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "ExpertAcquire runs on a CPU stream; create it with stream=mx.cpu (no GPU kernel is "
      "built)");
}

void PrefetchPrimitive::eval_cpu(const std::vector<mx::array>& inputs,
                                 std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_output_array(out);
  // Runs on the stream's thread once `ids` has been computed.
  encoder.dispatch([ids = inputs[0], out = mx::array::unsafe_weak_copy(out), cache = cache_,
                    layer = layer_]() mutable {
    out.data<uint8_t>()[0] = 0;
    cache->prefetch(layer, ids.data<int32_t>(), ids.size());
  });
}

void PrefetchPrimitive::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "ExpertPrefetch runs on a CPU stream; create it with stream=mx.cpu (no GPU kernel is "
      "built)");
}

mx::array acquire_op(std::shared_ptr<ExpertCache> cache, int layer, const mx::array& ids,
                     mx::StreamOrDevice s) {
  auto flat = flat_int32(ids, "acquire", s);
  auto rows = mx::array(mx::Shape{static_cast<int>(flat.size())}, mx::int32,
                        std::make_shared<AcquirePrimitive>(mx::to_stream(s), std::move(cache),
                                                           layer),
                        {flat});
  return mx::reshape(rows, ids.shape(), s);
}

mx::array prefetch_op(std::shared_ptr<ExpertCache> cache, int layer, const mx::array& ids,
                      mx::StreamOrDevice s) {
  auto flat = flat_int32(ids, "prefetch", s);
  return mx::array(mx::Shape{}, mx::uint8,
                   std::make_shared<PrefetchPrimitive>(mx::to_stream(s), std::move(cache), layer),
                   {flat});
}

}  // namespace es
