// Drives ext/pool_writer.cpp's CUDA path through the stand-in runtime (argv[1], loaded
// first so that the writer finds it): two segments' arrays laid end to end, as CUDA
// managed allocations can be, in both the destination and the source. Prints the runtime
// copies made for the last row of segment 0 and the first of segment 1 (which continue
// each other), tagged as two segments and as one, then whether the bytes arrived.
#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "pool_writer.h"

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  void* fake = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
  if (!fake) return 3;
  auto copies = reinterpret_cast<int (*)()>(dlsym(fake, "fake_copies"));
  constexpr size_t kRow = 64, kRows = 4, kArray = kRow * kRows;
  std::vector<uint8_t> dst(2 * kArray, 0), src(2 * kArray);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + 1);
  es::PoolWriter writer(dst.data());
  auto row = [&](int segment, size_t r) {
    const size_t at = static_cast<size_t>(segment) * kArray + r * kRow;
    return es::Span{dst.data() + at, src.data() + at, kRow, segment};
  };
  const std::vector<es::Span> ends = {row(0, kRows - 1), row(1, 0)};
  int before = copies();
  writer.copy(ends);
  std::printf("%s %d", writer.kind(), copies() - before);
  std::vector<es::Span> one = ends;
  one[1].segment = 0;
  before = copies();
  writer.copy(one);
  std::printf(" %d", copies() - before);
  const size_t first = kArray - kRow;
  std::printf(" %d\n", std::memcmp(dst.data() + first, src.data() + first, 2 * kRow) == 0);
  return 0;
}
