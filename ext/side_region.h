// The side-region ledger of one (MoE layer, bank): `rows()` rows filled by prefetch.
//
// A row is free, in flight (reserved, bytes being read) or published (bytes landed).
// An expert owns at most one row: re-predicting an expert whose fill is still in flight
// reserves nothing (a second row would leak the first). Only published
// rows are visible to lookup(). Invariant at every instant:
//   free + in_flight + published == rows, and no row has two owners.
// A row read by a forward that may not be evaluated yet (row_read_ >= fence) is never
// reused, so a fill cannot overwrite bytes a pending gather still reads.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace es {

enum class RowState : uint8_t { kFree = 0, kInFlight = 1, kPublished = 2 };

class SideLedger {
 public:
  SideLedger(int rows, int num_experts);

  int rows() const { return static_cast<int>(row_expert_.size()); }

  // Reserves rows for the predicted experts (in order of preference, deduplicated, none
  // resident in the real region). Persistent LFU mode: rows persist; a re-predicted
  // published expert gains frequency; a full ledger reuses the published row of the least
  // frequently predicted expert not in `predicted` (ties: smallest expert id).
  // Legacy mode: every published row outside `predicted` is released first.
  // Rows read at forward >= `fence` are never reused. Returns (expert, row) pairs now in
  // flight; `dropped_unused` counts published rows given up without ever being hit.
  std::vector<std::pair<int, int>> reserve(const std::vector<int>& predicted, bool lfu,
                                           uint64_t fence, int* dropped_unused);

  // In flight -> published. Returns false (and changes nothing) if (expert, row) is not an
  // in-flight reservation: that would be a ledger bug, counted by the caller.
  bool publish(int expert, int row);
  // Published -> in flight: its bytes are being written again (a fill batch on the copy
  // stream, AcquireMailbox), and it is not looked up until published again. False (and
  // nothing changes) if (expert, row) is not published.
  bool withdraw(int expert, int row);
  // In flight -> free (the fill failed or was cancelled).
  bool abandon(int expert, int row);

  // Published row of `expert`, or -1.
  int lookup(int expert) const;
  // Row of `expert` whose fill is in flight, or -1.
  int in_flight(int expert) const;
  // Records a hit on `row` by forward `forward`; returns true on the row's first hit.
  bool mark_read(int row, uint64_t forward);

  // Frees every published row (no fill may be in flight); returns how many were never hit.
  int clear();

  int count(RowState s) const;
  int expert_at(int row) const { return row_expert_[row]; }
  RowState state(int row) const { return row_state_[row]; }
  uint32_t freq(int expert) const { return freq_[expert]; }

  // Empty string when the invariant holds.
  std::string check() const;

 private:
  void release(int row, int* dropped_unused);
  // Whether `row` is `expert`'s and in `state`.
  bool owns(int expert, int row, RowState state) const;

  std::vector<int> row_expert_;      // rows, -1 = free
  std::vector<RowState> row_state_;  // rows
  std::vector<uint64_t> row_read_;   // rows: last forward that read the row, +1 (0 = never)
  std::vector<uint8_t> row_hit_;     // rows: hit since published
  std::vector<int> expert_row_;      // num_experts, -1 = no row (free)
  std::vector<uint32_t> freq_;       // num_experts: LFU prediction count of owners
};

}  // namespace es
