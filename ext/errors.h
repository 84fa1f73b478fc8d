// Exceptions the native core raises; bindings.cpp maps them to Python classes
// (ReadError -> engine.errors.ExpertReadError, an OSError; ChecksumError is a ReadError).
#pragma once

#include <stdexcept>
#include <string>

namespace es {

struct ReadError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct ChecksumError : ReadError {
  using ReadError::ReadError;
};

}  // namespace es
