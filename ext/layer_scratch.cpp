#include "layer_scratch.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <string>

#include "errors.h"
#include "staged_copies.h"

namespace es {

ScratchBank::ScratchBank(std::vector<mx::array> arrays_, std::vector<int64_t> offsets_,
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

ScratchBank::~ScratchBank() {
  if (pinned) PoolWriter::unpin(host->data());
}

void ScratchBank::stage(int r, const uint8_t* record) const {
  for (size_t s = 0; s < offsets.size(); ++s)
    std::memcpy(host->data() + rows * offsets[s] + r * nbytes[s], record + offsets[s],
                static_cast<size_t>(nbytes[s]));
}

std::vector<Span> ScratchBank::upload(const std::vector<uint8_t>& staged) const {
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
                       static_cast<size_t>(end - first) * static_cast<size_t>(nbytes[s]),
                       static_cast<int>(s)});
    first = end;
  }
  return spans;
}

std::vector<Span> ScratchBank::row(int r) const {
  std::vector<Span> spans;
  for (size_t s = 0; s < offsets.size(); ++s)
    spans.push_back({device[s] + r * nbytes[s], nullptr, static_cast<size_t>(nbytes[s]),
                     static_cast<int>(s)});
  return spans;
}

std::vector<Span> ScratchBank::staged(int r) const {
  std::vector<Span> spans;
  for (size_t s = 0; s < offsets.size(); ++s)
    spans.push_back({nullptr, host->data() + rows * offsets[s] + r * nbytes[s],
                     static_cast<size_t>(nbytes[s]), static_cast<int>(s)});
  return spans;
}

LayerScratch::LayerScratch(Io io, Unused unused) : io_(io), unused_(std::move(unused)) {
  // Layers whose segments agree in key, dtype, shape and place share a bank.
  std::vector<std::string> layouts;
  for (const auto& L : io_.layers) {
    std::string sig;
    for (const auto& seg : L.segments) {
      sig += seg.key + ":" + std::to_string(static_cast<int>(seg.dtype.val())) + ":" +
             std::to_string(seg.offset) + ":" + std::to_string(seg.nbytes);
      for (auto d : seg.shape) sig += "," + std::to_string(d);
      sig += ";";
    }
    auto at = std::find(layouts.begin(), layouts.end(), sig);
    layout_.push_back(static_cast<int>(at - layouts.begin()));
    if (at == layouts.end()) layouts.push_back(sig);
  }
  banks_.resize(2 * layouts.size());
  read_ahead_.resize(2 * layouts.size());
}

size_t LayerScratch::index(int li, int bank) const {
  if (bank < 0 || bank > 1)
    throw std::out_of_range("layer scratch bank " + std::to_string(bank) + " is not 0 or 1");
  return static_cast<size_t>(2 * layout_.at(static_cast<size_t>(li)) + bank);
}

std::shared_ptr<ScratchBank> LayerScratch::bank_locked(int li, int bank) {
  auto& b = banks_.at(index(li, bank));
  if (b) return b;
  const auto& L = io_.layers[static_cast<size_t>(li)];
  const int rows = io_.num_experts;
  std::vector<mx::array> arrays;
  std::vector<int64_t> offsets, nbytes;
  for (const auto& seg : L.segments) {
    mx::array a =
        segment_rows(L, seg, rows, "layer scratch of " + std::to_string(rows) + " rows");
    io_.writer.zero(a.data<uint8_t>(), a.nbytes());
    arrays.push_back(std::move(a));
    offsets.push_back(seg.offset);
    nbytes.push_back(seg.nbytes);
  }
  b = std::make_shared<ScratchBank>(std::move(arrays), std::move(offsets), std::move(nbytes),
                                    L.record_bytes, rows, io_.writer);
  return b;
}

std::vector<mx::array> LayerScratch::arrays(int li, int bank) {
  std::lock_guard<std::mutex> lk(mu_);
  return bank_locked(li, bank)->arrays;
}

std::pair<std::shared_ptr<ScratchBank>, LayerScratch::ReadAhead> LayerScratch::take(int li,
                                                                                   int bank) {
  std::lock_guard<std::mutex> lk(mu_);
  auto b = bank_locked(li, bank);
  return {std::move(b), std::exchange(read_ahead_[index(li, bank)], ReadAhead{})};
}

std::shared_ptr<ReadBatch> LayerScratch::stage_reads(int li,
                                                     const std::shared_ptr<ScratchBank>& bank,
                                                     const std::vector<int>& experts,
                                                     const std::vector<int>& rows, bool ahead) {
  auto batch = std::make_shared<ReadBatch>(experts.size());
  const LayerSpec* L = &io_.layers[static_cast<size_t>(li)];
  const BlobFile* file = io_.files[static_cast<size_t>(li)].get();
  const auto stride = static_cast<size_t>(L->stride);
  // Under b.mu: read i of b settles as `state`.
  auto settle_as = [](ReadBatch& b, size_t i, int state, std::exception_ptr err) {
    b.state[i] = state;
    b.error[i] = std::move(err);
    ++b.settled;
    b.cv.notify_all();
  };
  // Whether read i is still pending (not given up); a `state` other than kPending
  // settles it so if it is.
  auto pending = [batch, settle_as](size_t i, int state, std::exception_ptr err) {
    std::lock_guard<std::mutex> lk(batch->mu);
    if (batch->state[i] != kPending) return false;
    if (state != kPending) settle_as(*batch, i, state, std::move(err));
    return state == kPending;
  };
  // The record of read i (stride bytes at buf) goes into staging row rows[i], and into
  // the host tier, unless the read was given up meanwhile (its bytes are dropped).
  auto land = [this, li, L, bank, batch, settle_as, e = experts, r = rows](
                  size_t i, const uint8_t* buf) {
    auto& b = *batch;
    {
      std::lock_guard<std::mutex> lk(b.mu);
      if (b.state[i] != kPending) return;
      b.state[i] = kCopying;
    }
    bank->stage(r[i], buf);
    if (tier_ && tier_->tier_slots() > 0) {
      // Kept in the host tier too, so that a later miss of it is not read again; the
      // record is staged whether or not that succeeds.
      try {
        std::vector<Span> spans = bank->staged(r[i]);
        for (size_t s = 0; s < spans.size(); ++s) spans[s].src = buf + L->segments[s].offset;
        tier_->keep(spans, li, e[i]);
      } catch (const std::exception&) {
      }
    }
    std::lock_guard<std::mutex> lk(b.mu);
    settle_as(b, i, kDone, nullptr);
  };
  // Read i on this thread (`attempts` as BlobFile::read_record).
  auto read_one = [this, file, stride, pending, land, e = experts](size_t i, int attempts) {
    if (!pending(i, kPending, nullptr)) return;  // given up before it started
    uint8_t* buf = nullptr;
    try {
      // Host memory only: the staging is copied to the device by its load.
      buf = bounce_buffer(stride, io_.host_writer);
      ReadClock::Span reading(&io_.clock);
      file->read_record(e[i], buf, io_.verify_checksums, attempts);
    } catch (...) {
      pending(i, kFailed, std::current_exception());
      return;
    }
    land(i, buf);
  };
  // Reads `run` (reads of adjacent records, in file order) on this thread: one read of
  // them all, then any it did not deliver on its own.
  auto read_run = [this, file, stride, batch, pending, land, read_one,
                   e = experts](std::vector<size_t> run, bool cancelled) {
    if (cancelled) {
      for (size_t i : run) pending(i, kAbandoned, nullptr);
      return;
    }
    {
      // Only the span from its first to its last read still pending (a given-up
      // read-ahead reads nothing more).
      std::lock_guard<std::mutex> lk(batch->mu);
      auto wanted = [&](size_t i) { return batch->state[i] == kPending; };
      run.erase(run.begin(), std::find_if(run.begin(), run.end(), wanted));
      run.erase(std::find_if(run.rbegin(), run.rend(), wanted).base(), run.end());
    }
    if (run.size() <= 1) {
      if (!run.empty()) read_one(run[0], 2);
      return;
    }
    // A buffer of its own, unpinned: the thread's bounce buffer stays the size (and
    // page-locking) its other reads need.
    thread_local std::unique_ptr<AlignedBuffer> run_buffer;
    std::vector<uint8_t> ok;
    try {
      const size_t bytes = run.size() * stride;
      if (!run_buffer || run_buffer->size() < bytes)
        run_buffer = std::make_unique<AlignedBuffer>(bytes);
      {
        ReadClock::Span reading(&io_.clock);
        file->read_run(e[run[0]], static_cast<int>(run.size()), run_buffer->data(),
                      io_.verify_checksums, ok);
      }
      for (size_t j = 0; j < run.size(); ++j)
        if (ok[j]) land(run[j], run_buffer->data() + j * stride);
    } catch (const std::exception&) {
      ok.clear();  // no attempt made: each read on its own, which words any error
    }
    for (size_t j = 0; j < run.size(); ++j)
      if (ok.empty() || !ok[j]) read_one(run[j], ok.empty() ? 2 : 1);
  };
  // Runs of adjacent records: the reads shared evenly among the reader threads (each
  // checks and copies its own records), up to kReadRunBytes each (one record where it is
  // larger).
  std::vector<size_t> order(experts.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return experts[a] < experts[b]; });
  const size_t threads = static_cast<size_t>(std::max(io_.reader_threads, 1));
  const size_t per_run = std::clamp<size_t>((order.size() + threads - 1) / threads, 1,
                                            std::max<size_t>(1, kReadRunBytes / stride));
  std::vector<std::vector<size_t>> runs;
  for (size_t i : order) {
    if (!runs.empty() && runs.back().size() < per_run &&
        experts[i] == experts[runs.back().back()] + 1) {
      runs.back().push_back(i);
    } else {
      runs.push_back({i});
    }
  }
  try {
    if (ahead) {
      for (auto& run : runs)
        io_.readers.submit_prefetch(
            [read_run, run = std::move(run)](bool cancelled) { read_run(run, cancelled); });
    } else {
      std::vector<std::function<void()>> tasks;
      for (auto& run : runs)
        tasks.emplace_back([read_run, run = std::move(run)] { read_run(run, false); });
      io_.readers.submit_demand(std::move(tasks));
    }
  } catch (...) {
    batch->settle(io_.read_timeout_ms, true);  // what was queued never writes the rows
    throw;
  }
  return batch;
}

void LayerScratch::retire(ReadAhead& ra) {
  if (!ra.batch) return;
  ra.batch->settle(io_.read_timeout_ms, true);
  uint64_t landed = 0;
  {
    std::lock_guard<std::mutex> lk(ra.batch->mu);
    for (int state : ra.batch->state) landed += state == kDone;
  }
  unused_(ra.layer, landed);
  ra = ReadAhead{};
}

std::vector<uint8_t> LayerScratch::fetch(int li, const std::shared_ptr<ScratchBank>& bank,
                                         const std::vector<int>& experts,
                                         const std::vector<int>& rows,
                                         std::vector<uint8_t>& staged, Load& out) {
  std::vector<uint8_t> in_row(experts.size(), 0);
  if (tier_ && tier_->tier_slots() > 0) {  // one write for every expert the tier holds
    std::vector<std::vector<Span>> to;
    for (int r : rows) to.push_back(bank->row(r));
    const auto t0 = std::chrono::steady_clock::now();
    in_row = tier_->copy_cached(li, experts, to, io_.writer);
    out.copy_micros += micros_since(t0);
  }
  std::vector<int> reads, read_rows;
  std::vector<size_t> at;  // [j]: the index of reads[j] in experts
  for (size_t i = 0; i < experts.size(); ++i) {
    if (in_row[i]) {
      ++out.host_hits;
    } else {
      reads.push_back(experts[i]);
      read_rows.push_back(rows[i]);
      at.push_back(i);
    }
  }
  if (reads.empty()) return in_row;
  const auto t0 = std::chrono::steady_clock::now();
  auto batch = stage_reads(li, bank, reads, read_rows, false);
  batch->settle(io_.read_timeout_ms, false);
  out.read_micros += micros_since(t0);
  std::lock_guard<std::mutex> lk(batch->mu);
  for (size_t j = 0; j < reads.size(); ++j) {
    if (batch->state[j] == kDone) {
      in_row[at[j]] = 1;
      staged[static_cast<size_t>(read_rows[j])] = 1;
      ++out.records_read;
    } else {
      ++out.read_errors;
      if (!out.error)
        out.error = batch->error[j] ? batch->error[j]
                                    : read_timeout(*io_.files[static_cast<size_t>(li)],
                                                   reads[j], io_.read_timeout_ms);
    }
  }
  return in_row;
}

std::exception_ptr LayerScratch::copy(int li, const std::vector<Span>& copies,
                                      Load& out) const {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    io_.writer.copy(copies);
    out.copy_micros += micros_since(t0);
    return nullptr;
  } catch (const std::exception& e) {
    const auto& L = io_.layers[static_cast<size_t>(li)];
    return std::make_exception_ptr(ReadError(L.path + " (layer " + std::to_string(L.layer) +
                                             ", layer scratch): " + e.what()));
  }
}

int LayerScratch::read_ahead(int li, int bank, const std::vector<int>& experts, bool by_id) {
  auto [b, old] = take(li, bank);
  retire(old);  // its rows are about to be read into
  std::vector<int> rows = experts;  // by id
  if (!by_id)
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int>(i);
  auto batch = experts.empty() ? nullptr : stage_reads(li, b, experts, rows, true);
  std::lock_guard<std::mutex> lk(mu_);
  read_ahead_[index(li, bank)] = ReadAhead{li, experts, batch, by_id};
  return static_cast<int>(experts.size());
}

LayerScratch::Load LayerScratch::load_layer(int li, const std::vector<int>& missing,
                                            const Sources& resident) {
  auto [bank, ahead] = take(li, 0);
  const auto E = static_cast<size_t>(io_.num_experts);
  Load out;
  // Each row holds one expert: a record the read-ahead landed (staging row i: experts[i];
  // used by this call or not) or one that a free row takes now (read into staging, copied
  // from the host tier, or copied from its slot). Only rows holding a staged record are
  // uploaded, in runs, so a row filled from the tier or a slot is never overwritten; the
  // experts are distinct, so num_experts rows always suffice.
  std::vector<int> row_of(E, -1);
  std::vector<uint8_t> staged(E, 0);  // per row: holds a staged record to upload
  if (ahead.batch && !(ahead.layer == li && !ahead.by_id)) retire(ahead);
  if (ahead.batch) {
    ahead.batch->settle(io_.read_timeout_ms, false);
    std::lock_guard<std::mutex> lk(ahead.batch->mu);
    for (size_t i = 0; i < ahead.experts.size(); ++i)
      if (ahead.batch->state[i] == kDone) {
        row_of[static_cast<size_t>(ahead.experts[i])] = static_cast<int>(i);
        staged[i] = 1;
        ++out.records_read;
      }
  }
  std::vector<int> free_rows;  // lowest last
  for (int r = io_.num_experts - 1; r >= 0; --r)
    if (!staged[static_cast<size_t>(r)]) free_rows.push_back(r);
  auto take_row = [&] {
    if (free_rows.empty()) throw std::logic_error("load_layer: no layer-scratch row left");
    const int r = free_rows.back();
    free_rows.pop_back();
    return r;
  };
  // The misses not read ahead, and the rows they take: in id order, so that experts that
  // follow one another in the host tier take rows that do too (one copy per segment).
  std::vector<int> now, now_rows, by_id = missing;
  std::sort(by_id.begin(), by_id.end());
  for (int e : by_id)
    if (row_of[static_cast<size_t>(e)] < 0) {
      now.push_back(e);
      now_rows.push_back(take_row());
    }
  const std::vector<uint8_t> in_row = fetch(li, bank, now, now_rows, staged, out);
  for (size_t j = 0; j < now.size(); ++j)
    if (in_row[j]) row_of[static_cast<size_t>(now[j])] = now_rows[j];
  std::vector<int> resident_at;
  if (!out.error) {
    // The staged records, and the resident experts from their pool rows (a hit that was
    // read ahead too keeps its staged row): the call then computes from the bank alone.
    std::vector<Span> copies = bank->upload(staged);
    // Rows taken in the order of the experts' pool rows, so that experts in consecutive
    // slots land in consecutive rows (one copy per segment).
    std::vector<size_t> by_slot(resident.size());
    std::iota(by_slot.begin(), by_slot.end(), size_t{0});
    std::sort(by_slot.begin(), by_slot.end(), [&](size_t a, size_t b) {
      return resident[a].second.front().src < resident[b].second.front().src;
    });
    resident_at.assign(resident.size(), -1);
    for (size_t i : by_slot) {
      const auto& [e, from] = resident[i];
      int r = row_of[static_cast<size_t>(e)];
      if (r < 0) {
        r = take_row();
        add_copies(copies, bank->row(r), from);
      }
      resident_at[i] = r;
    }
    out.error = copy(li, copies, out);
  }
  for (int e : missing) out.rows.push_back(row_of[static_cast<size_t>(e)]);
  out.rows.insert(out.rows.end(), resident_at.begin(), resident_at.end());
  if (!out.error) {
    // As ExpertCache::load_scratch: the call's experts also fill the real region's empty
    // slots, most routed first (acquire's order).
    out.loads = missing.size();
    for (size_t i = 0; i < missing.size(); ++i)
      out.fill.emplace_back(missing[i], as_sources(bank->row(out.rows[i])));
  }
  return out;
}

LayerScratch::Load LayerScratch::load_whole(int li, int bank_index, const Sources& resident) {
  auto [bank, ahead] = take(li, bank_index);
  const auto E = static_cast<size_t>(io_.num_experts);
  std::vector<const std::vector<Span>*> pool_row(E, nullptr);  // [e]: resident expert's
  for (const auto& [e, from] : resident) pool_row[static_cast<size_t>(e)] = &from;
  Load out;
  std::vector<uint8_t> staged(E, 0);
  if (ahead.batch && !(ahead.layer == li && ahead.by_id)) retire(ahead);
  if (ahead.batch) {
    ahead.batch->settle(io_.read_timeout_ms, false);
    std::lock_guard<std::mutex> lk(ahead.batch->mu);
    for (size_t i = 0; i < ahead.experts.size(); ++i) {
      if (ahead.batch->state[i] != kDone) continue;
      ++out.records_read;
      // One that has a real slot since (the cache was used between) is copied from it.
      const auto e = static_cast<size_t>(ahead.experts[i]);
      staged[e] = pool_row[e] == nullptr;
    }
  }
  // Every expert in the row of its id: staged (read ahead, or read now) and uploaded
  // in runs of consecutive rows, copied from the host tier, or, resident, from its slot.
  std::vector<int> now;
  for (int e = 0; e < io_.num_experts; ++e)
    if (!pool_row[static_cast<size_t>(e)] && !staged[static_cast<size_t>(e)]) now.push_back(e);
  fetch(li, bank, now, now, staged, out);
  if (!out.error) {
    std::vector<Span> copies = bank->upload(staged);
    for (const auto& [e, from] : resident) add_copies(copies, bank->row(e), from);
    out.error = copy(li, copies, out);
  }
  if (!out.error) {
    out.loads = out.host_hits + static_cast<uint64_t>(std::count(staged.begin(), staged.end(), 1));
    // Empty real slots take experts in id order: the routing is not read here.
    for (int e = 0; e < io_.num_experts; ++e) out.fill.emplace_back(e, as_sources(bank->row(e)));
  }
  return out;
}

void LayerScratch::reset() {
  std::vector<ReadAhead> aheads;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& ra : read_ahead_) aheads.push_back(std::exchange(ra, ReadAhead{}));
  }
  for (auto& ra : aheads) retire(ra);
}

}  // namespace es
