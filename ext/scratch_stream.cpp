#include "scratch_stream.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "mlx/backend/cpu/encoder.h"

namespace es {

ScratchStream::ScratchStream(std::shared_ptr<ExpertCache> cache, int layer,
                             std::vector<int> experts)
    : cache_(std::move(cache)), layer_(layer) {
  if (layer < 0 || layer >= cache_->num_layers())
    throw std::out_of_range("MoE layer index " + std::to_string(layer) + " out of range [0, " +
                            std::to_string(cache_->num_layers()) + ")");
  for (int e : experts)
    if (e < 0 || e >= cache_->num_experts())
      throw std::out_of_range("expert id " + std::to_string(e) + " out of range [0, " +
                              std::to_string(cache_->num_experts()) + ") in MoE layer " +
                              std::to_string(layer));
  const int scratch = cache_->config().scratch_slots;
  banks_ = scratch >= 2 ? 2 : 1;
  const int sizes[2] = {(scratch + 1) / 2, scratch / 2};
  const int firsts[2] = {0, sizes[0]};
  const int base = cache_->rows(layer) - scratch;
  for (size_t start = 0; start < experts.size();) {
    const int bank = static_cast<int>(experts_.size() % static_cast<size_t>(banks_));
    const int size = banks_ == 1 ? scratch : sizes[bank];
    const size_t end = std::min(experts.size(), start + static_cast<size_t>(size));
    std::vector<int> chunk(experts.begin() + static_cast<std::ptrdiff_t>(start),
                           experts.begin() + static_cast<std::ptrdiff_t>(end));
    std::vector<int> rows;
    for (size_t i = 0; i < chunk.size(); ++i)
      rows.push_back(base + firsts[bank] + static_cast<int>(i));
    experts_.push_back(std::move(chunk));
    rows_.push_back(std::move(rows));
    first_.push_back(firsts[bank]);
    start = end;
  }
  errors_.resize(experts_.size());
  landed_.assign(experts_.size(), 0);
}

ScratchStream::~ScratchStream() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void ScratchStream::read(size_t c) {
  {
    // In chunk order, as acquire listed them (most routed first): the empty real slots
    // that load_scratch fills then go to the busiest experts.
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return c == 0 || landed_[c - 1] != 0; });
  }
  std::exception_ptr err;
  try {
    cache_->load_scratch(layer_, experts_[c], first_[c]);
  } catch (...) {
    err = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    errors_[c] = err;
    landed_[c] = 1;
  }
  cv_.notify_all();
}

void ScratchStream::run() {
  for (;;) {
    size_t c;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stopping_ || claimed_ < released_ || claimed_ == chunks(); });
      if (stopping_ || claimed_ == chunks()) return;
      c = claimed_++;
    }
    read(c);
  }
}

void ScratchStream::step(size_t c) {
  if (c >= experts_.size())
    throw std::out_of_range("scratch chunk " + std::to_string(c) + " of " +
                            std::to_string(experts_.size()));
  std::unique_lock<std::mutex> lk(mu_);
  released_ = std::max(released_, std::min(experts_.size(), c + static_cast<size_t>(banks_)));
  // A chunk no read has started yet is read here: waking the thread for it would only add
  // its scheduling delay (on a loaded CPU, a time slice) to the wait.
  const bool here = claimed_ == c;
  if (here) ++claimed_;
  if (claimed_ < released_ && !thread_.joinable()) thread_ = std::thread([this] { run(); });
  cv_.notify_all();
  if (here) {
    lk.unlock();
    read(c);
    lk.lock();
  }
  cv_.wait(lk, [&] { return landed_[c] != 0; });
  if (errors_[c]) std::rethrow_exception(errors_[c]);
}

void ScratchStepPrimitive::eval_cpu(const std::vector<mx::array>& inputs,
                                    std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  // The rows pass through as they are (no copy): what the op adds is the wait, in stream
  // order before any consumer of its output.
  out.copy_shared_buffer(inputs[0]);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  encoder.dispatch([scratch = scratch_, chunk = chunk_] {
    try {
      scratch->step(chunk);
    } catch (...) {
      scratch->cache()->set_stream_error(std::current_exception());
    }
  });
}

void ScratchStepPrimitive::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "ExpertScratchStep runs on a CPU stream; create it with stream=mx.cpu (no GPU kernel is "
      "built)");
}

mx::array scratch_step_op(std::shared_ptr<ScratchStream> scratch, size_t chunk,
                          const mx::array& rows, const std::optional<mx::array>& after,
                          mx::StreamOrDevice s) {
  if (chunk >= scratch->chunks())
    throw std::out_of_range("scratch chunk " + std::to_string(chunk) + " out of range [0, " +
                            std::to_string(scratch->chunks()) + ")");
  if (rows.dtype() != mx::int32) throw std::invalid_argument("scratch step: rows must be int32");
  if (chunk > 0 && !after)
    throw std::invalid_argument("scratch step " + std::to_string(chunk) +
                                " needs `after`: the previous chunk's output, so that its "
                                "bank is free before the next read goes into it");
  std::vector<mx::array> inputs{rows};
  if (after) inputs.push_back(*after);
  return mx::array(rows.shape(), mx::int32,
                   std::make_shared<ScratchStepPrimitive>(mx::to_stream(s), std::move(scratch),
                                                          chunk),
                   std::move(inputs));
}

}  // namespace es
