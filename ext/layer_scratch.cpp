#include "layer_scratch.h"

#include <algorithm>
#include <cstring>

namespace es {

LayerScratch::LayerScratch(std::vector<mx::array> arrays_, std::vector<int64_t> offsets_,
                           std::vector<int64_t> nbytes_, int64_t record_bytes_, int rows_,
                           const PoolWriter& writer)
    : offsets(std::move(offsets_)),
      nbytes(std::move(nbytes_)),
      record_bytes(record_bytes_),
      rows(rows_),
      arrays(std::move(arrays_)) {
  for (auto& a : arrays) device.push_back(a.data<uint8_t>());
  host = std::make_unique<AlignedBuffer>(bytes());
  pinned = writer.pin(host->data(), host->size());
}

LayerScratch::~LayerScratch() {
  if (pinned) PoolWriter::unpin(host->data());
}

void LayerScratch::stage(int r, const uint8_t* record) const {
  for (size_t s = 0; s < offsets.size(); ++s)
    std::memcpy(host->data() + rows * offsets[s] + r * nbytes[s], record + offsets[s],
                static_cast<size_t>(nbytes[s]));
}

std::vector<Span> LayerScratch::upload(const std::vector<uint8_t>& staged) const {
  std::vector<Span> spans;
  const int n = std::min(rows, static_cast<int>(staged.size()));
  for (int first = 0; first < n;) {
    if (!staged[static_cast<size_t>(first)]) {
      ++first;
      continue;
    }
    int end = first;
    while (end < n && staged[static_cast<size_t>(end)]) ++end;
    for (size_t s = 0; s < offsets.size(); ++s)
      spans.push_back({device[s] + first * nbytes[s],
                       host->data() + rows * offsets[s] + first * nbytes[s],
                       static_cast<size_t>(end - first) * static_cast<size_t>(nbytes[s])});
    first = end;
  }
  return spans;
}

std::vector<Span> LayerScratch::row(int r) const {
  std::vector<Span> spans;
  for (size_t s = 0; s < offsets.size(); ++s)
    spans.push_back({device[s] + r * nbytes[s], nullptr, static_cast<size_t>(nbytes[s])});
  return spans;
}

std::vector<Span> LayerScratch::staged(int r) const {
  std::vector<Span> spans;
  for (size_t s = 0; s < offsets.size(); ++s)
    spans.push_back({nullptr, host->data() + rows * offsets[s] + r * nbytes[s],
                     static_cast<size_t>(nbytes[s])});
  return spans;
}

}  // namespace es
