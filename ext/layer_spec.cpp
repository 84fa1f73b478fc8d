#include "layer_spec.h"

#include <stdexcept>

#include "mlx/allocator.h"

namespace es {

namespace {

mx::allocator::Data checked_malloc(size_t bytes, const std::string& what) {
  auto data = mx::allocator::malloc(bytes);
  if (bytes > 0 && data.buffer().ptr() == nullptr)
    throw PoolAllocError("cannot allocate " + std::to_string(bytes) + " bytes for " + what);
  return data;
}

}  // namespace

mx::array segment_rows(const LayerSpec& L, const Segment& seg, int rows,
                       const std::string& what) {
  mx::Shape shape{rows};
  shape.insert(shape.end(), seg.shape.begin(), seg.shape.end());
  const size_t bytes = static_cast<size_t>(rows) * static_cast<size_t>(seg.nbytes);
  mx::array a(checked_malloc(bytes, L.path + " segment " + seg.key + " (" + what + ")"), shape,
              seg.dtype);
  if (a.nbytes() != bytes)
    throw std::invalid_argument(L.path + ": segment " + seg.key +
                                " shape and dtype disagree with nbytes");
  return a;
}

mx::array int32_values(int n, const std::string& what) {
  return mx::array(checked_malloc(sizeof(int32_t) * static_cast<size_t>(n), what), {n},
                   mx::int32);
}

}  // namespace es
