#include "primitives.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace es {

namespace {

void check_integer(const mx::array& ids, const char* what) {
  if (!mx::issubdtype(ids.dtype(), mx::integer))
    throw std::invalid_argument(std::string(what) + " ids must be an integer array");
}

template <typename T>
void gather_as(const mx::array& ids, int layer, std::vector<int32_t>& out) {
  // Row-major walk over any strides: the router's ids are usually a slice of its
  // argpartition (last axis contiguous, outer axes strided), read where they lie instead
  // of through astype/flatten/contiguous ops (each one an op per MoE layer per token).
  const T* base = ids.data<T>();
  const auto& shape = ids.shape();
  const auto& strides = ids.strides();
  const int nd = static_cast<int>(shape.size());
  std::vector<int> at(static_cast<size_t>(nd), 0);
  int64_t off = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const T v = base[off];
    if (v < 0 || static_cast<uint64_t>(v) > static_cast<uint64_t>(INT32_MAX))
      throw std::out_of_range("expert id " + std::to_string(v) + " out of range in MoE layer " +
                              std::to_string(layer));
    out[i] = static_cast<int32_t>(v);
    for (int d = nd - 1; d >= 0; --d) {  // next index, last axis fastest
      off += strides[d];
      if (++at[d] < shape[d]) break;
      off -= strides[d] * shape[d];
      at[d] = 0;
    }
  }
}

// The ids (of MoE layer `layer`, for messages) of an evaluated integer array in row-major
// order, as int32.
std::vector<int32_t> gather_ids(const mx::array& ids, int layer) {
  std::vector<int32_t> out(ids.size());
  if (out.empty()) return out;
  switch (ids.dtype()) {
    case mx::int8: gather_as<int8_t>(ids, layer, out); break;
    case mx::int16: gather_as<int16_t>(ids, layer, out); break;
    case mx::int32: gather_as<int32_t>(ids, layer, out); break;
    case mx::int64: gather_as<int64_t>(ids, layer, out); break;
    case mx::uint8: gather_as<uint8_t>(ids, layer, out); break;
    case mx::uint16: gather_as<uint16_t>(ids, layer, out); break;
    case mx::uint32: gather_as<uint32_t>(ids, layer, out); break;
    case mx::uint64: gather_as<uint64_t>(ids, layer, out); break;
    default: throw std::invalid_argument("expert ids must be an integer array");
  }
  return out;
}

// The last `rows` tokens' rows of an evaluated (..., hidden) float array (fewer where it
// has fewer tokens), as float32, row-major; their count in `rows`.
template <typename T>
void last_rows_as(const mx::array& x, int& rows, std::vector<float>& out) {
  const auto& shape = x.shape();
  const auto& strides = x.strides();
  const size_t nd = shape.size();
  const size_t hidden = static_cast<size_t>(shape[nd - 1]);
  const int64_t tokens = static_cast<int64_t>(x.size() / hidden);
  rows = static_cast<int>(std::min<int64_t>(rows, tokens));
  out.resize(static_cast<size_t>(rows) * hidden);
  for (int r = 0; r < rows; ++r) {
    int64_t rest = tokens - rows + r, off = 0;
    for (size_t d = nd - 1; d-- > 0;) {
      off += rest % shape[d] * strides[d];
      rest /= shape[d];
    }
    const T* base = x.data<T>() + off;
    for (size_t i = 0; i < hidden; ++i)
      out[static_cast<size_t>(r) * hidden + i] =
          static_cast<float>(base[static_cast<int64_t>(i) * strides[nd - 1]]);
  }
}

std::vector<float> last_rows(const mx::array& x, int& rows) {
  std::vector<float> out;
  switch (x.dtype()) {
    case mx::float32: last_rows_as<float>(x, rows, out); break;
    case mx::float16: last_rows_as<mx::float16_t>(x, rows, out); break;
    case mx::bfloat16: last_rows_as<mx::bfloat16_t>(x, rows, out); break;
    default: throw std::logic_error("prefetch: hidden dtype not checked by prefetch_op");
  }
  return out;
}

}  // namespace

void AcquirePrimitive::eval_cpu(const std::vector<mx::array>& inputs,
                                std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  // Runs on the stream's thread once `ids` (and `after`) have been computed. An error is handed to the
  // cache for the host to raise (ExpertCache::set_stream_error), with valid rows.
  encoder.dispatch([ids = inputs[0], out = mx::array::unsafe_weak_copy(out), cache = cache_,
                    layer = layer_]() mutable {
    int32_t* rows = out.data<int32_t>();
    const size_t n = ids.size();
    try {
      const std::vector<int32_t> flat = gather_ids(ids, layer);
      if (!cache->acquire(layer, flat.data(), rows, n).empty())
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
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  // Runs on the stream's thread once `x` (and `after`) have been computed. A failed prediction or
  // reservation only costs the demand reads it would have saved.
  encoder.dispatch([x = inputs[0], out = mx::array::unsafe_weak_copy(out), cache = cache_,
                    layer = layer_, router = router_, budget = budget_,
                    rows = rows_]() mutable {
    out.data<uint8_t>()[0] = 0;
    try {
      const std::vector<float> x_rows = last_rows(x, rows);
      const std::vector<int32_t> ids = router->top_rows(x_rows.data(), rows, budget);
      cache->prefetch(layer, ids.data(), ids.size());
    } catch (const std::exception&) {
    }
  });
}

void PrefetchPrimitive::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "ExpertPrefetch runs on a CPU stream; create it with stream=mx.cpu (no GPU kernel is "
      "built)");
}

mx::array acquire_op(std::shared_ptr<ExpertCache> cache, int layer, const mx::array& ids,
                     const std::optional<mx::array>& after, mx::StreamOrDevice s) {
  check_integer(ids, "acquire");
  std::vector<mx::array> inputs{ids};
  if (after) inputs.push_back(*after);
  return mx::array(ids.shape(), mx::int32,
                   std::make_shared<AcquirePrimitive>(mx::to_stream(s), std::move(cache), layer),
                   std::move(inputs));
}

mx::array prefetch_op(std::shared_ptr<ExpertCache> cache, int layer, const mx::array& x,
                      std::shared_ptr<const Router> router, int budget, int rows,
                      const std::optional<mx::array>& after, mx::StreamOrDevice s) {
  if (layer < 0 || layer >= cache->num_layers())
    throw std::out_of_range("prefetch: MoE layer " + std::to_string(layer) + " out of range [0, " +
                            std::to_string(cache->num_layers()) + ")");
  const std::string where = "prefetch for MoE layer " + std::to_string(layer) + ": ";
  if (x.dtype() != mx::float32 && x.dtype() != mx::float16 && x.dtype() != mx::bfloat16) {
    std::ostringstream dtype;
    dtype << x.dtype();
    throw std::invalid_argument(where + "hidden state of dtype " + dtype.str() +
                                ", expected float32, float16 or bfloat16");
  }
  if (x.ndim() == 0 || x.size() == 0 || x.shape().back() != router->hidden())
    throw std::invalid_argument(where + "hidden state of shape (..., " +
                                std::to_string(x.ndim() ? x.shape().back() : 0) +
                                ") for a router of hidden size " +
                                std::to_string(router->hidden()));
  if (router->num_experts() != cache->num_experts())
    throw std::invalid_argument(where + "a router of " + std::to_string(router->num_experts()) +
                                " experts for a cache of " +
                                std::to_string(cache->num_experts()));
  if (budget < 1 || budget > router->num_experts())
    throw std::invalid_argument(where + "budget " + std::to_string(budget) + " not in [1, " +
                                std::to_string(router->num_experts()) + "]");
  if (rows < 1) throw std::invalid_argument(where + "rows " + std::to_string(rows) + " < 1");
  std::vector<mx::array> inputs{x};
  if (after) inputs.push_back(*after);
  return mx::array(mx::Shape{}, mx::uint8,
                   std::make_shared<PrefetchPrimitive>(mx::to_stream(s), std::move(cache), layer,
                                                       std::move(router), budget, rows),
                   std::move(inputs));
}

}  // namespace es
