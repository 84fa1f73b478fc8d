#include "prefetch_primitive.h"

#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace es {

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

mx::array prefetch_op(std::shared_ptr<ExpertCache> cache, int layer, const mx::array& ids,
                      mx::StreamOrDevice s) {
  if (!mx::issubdtype(ids.dtype(), mx::integer))
    throw std::invalid_argument("prefetch ids must be an integer array");
  auto flat = mx::flatten(mx::astype(ids, mx::int32, s), s);
  flat = mx::contiguous(flat, false, s);
  return mx::array(mx::Shape{}, mx::uint8,
                   std::make_shared<PrefetchPrimitive>(mx::to_stream(s), std::move(cache), layer),
                   {flat});
}

}  // namespace es
