// The dtypes a pool segment can hold, by their manifest names (store format): the one
// table, exported to Python as engine._ext.DTYPE_NAMES (engine.store builds its dtype map
// from it).
#pragma once

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "mlx/dtype.h"

namespace es {

inline const std::vector<std::pair<std::string, mlx::core::Dtype>>& segment_dtypes() {
  namespace mx = mlx::core;
  static const std::vector<std::pair<std::string, mx::Dtype>> table = {
      {"bool", mx::bool_},     {"uint8", mx::uint8},     {"uint16", mx::uint16},
      {"uint32", mx::uint32},  {"uint64", mx::uint64},   {"int8", mx::int8},
      {"int16", mx::int16},    {"int32", mx::int32},     {"int64", mx::int64},
      {"float16", mx::float16}, {"bfloat16", mx::bfloat16}, {"float32", mx::float32},
  };
  return table;
}

// The dtype of manifest name `name`; std::invalid_argument for a name not in the table.
inline mlx::core::Dtype segment_dtype(const std::string& name) {
  for (const auto& [n, dtype] : segment_dtypes())
    if (n == name) return dtype;
  throw std::invalid_argument("unsupported segment dtype '" + name + "'");
}

}  // namespace es
