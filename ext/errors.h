// Exceptions the native core raises; bindings.cpp maps them to Python classes:
// ReadError -> engine._ext.ExpertReadError (an OSError), ChecksumError -> ChecksumError
// and ReadTimeout -> ExpertReadTimeout (both ExpertReadErrors), ResourceError ->
// ResourceError (an OSError).
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

// No demand read of a batch finished within the read timeout; the reads given up on can
// never write a pool row afterwards.
struct ReadTimeout : ReadError {
  using ReadError::ReadError;
};

// The system refused a resource the cache needs to start (a thread).
struct ResourceError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace es
