#include "side_region.h"

#include <unordered_set>

namespace es {

SideLedger::SideLedger(int rows, int num_experts)
    : row_expert_(rows, -1),
      row_state_(rows, RowState::kFree),
      row_read_(rows, 0),
      row_hit_(rows, 0),
      expert_row_(num_experts, -1),
      freq_(num_experts, 0) {}

void SideLedger::release(int row, int* dropped_unused) {
  int e = row_expert_[row];
  if (!row_hit_[row] && dropped_unused) ++*dropped_unused;
  expert_row_[e] = -1;
  freq_[e] = 0;
  row_expert_[row] = -1;
  row_state_[row] = RowState::kFree;
  row_hit_[row] = 0;
}

std::vector<std::pair<int, int>> SideLedger::reserve(const std::vector<int>& predicted, bool lfu,
                                                     uint64_t fence, int* dropped_unused) {
  std::unordered_set<int> wanted(predicted.begin(), predicted.end());
  auto reusable = [&](int r) {
    return row_state_[r] == RowState::kPublished && !wanted.count(row_expert_[r]) &&
           row_read_[r] < fence + 1;
  };
  if (!lfu) {
    for (int r = 0; r < rows(); ++r)
      if (reusable(r)) release(r, dropped_unused);
  }
  std::vector<std::pair<int, int>> out;
  for (int e : predicted) {
    int have = expert_row_[e];
    if (have >= 0) {
      if (row_state_[have] == RowState::kPublished) ++freq_[e];
      continue;  // published or in flight: never a second row
    }
    int row = -1;
    for (int r = 0; r < rows(); ++r) {
      if (row_state_[r] == RowState::kFree) {
        row = r;
        break;
      }
    }
    if (row < 0 && lfu) {
      for (int r = 0; r < rows(); ++r) {
        if (!reusable(r)) continue;
        if (row < 0) {
          row = r;
          continue;
        }
        int a = row_expert_[r], b = row_expert_[row];
        if (freq_[a] < freq_[b] || (freq_[a] == freq_[b] && a < b)) row = r;
      }
      if (row >= 0) release(row, dropped_unused);
    }
    if (row < 0) continue;  // every row is wanted, in flight or fenced
    row_expert_[row] = e;
    row_state_[row] = RowState::kInFlight;
    row_hit_[row] = 0;
    expert_row_[e] = row;
    freq_[e] = 1;
    out.emplace_back(e, row);
  }
  return out;
}

bool SideLedger::owns(int expert, int row, RowState state) const {
  return row >= 0 && row < rows() && row_expert_[row] == expert && row_state_[row] == state;
}

bool SideLedger::publish(int expert, int row) {
  if (!owns(expert, row, RowState::kInFlight)) return false;
  row_state_[row] = RowState::kPublished;
  return true;
}

bool SideLedger::withdraw(int expert, int row) {
  if (!owns(expert, row, RowState::kPublished)) return false;
  row_state_[row] = RowState::kInFlight;
  return true;
}

bool SideLedger::abandon(int expert, int row) {
  if (!owns(expert, row, RowState::kInFlight)) return false;
  expert_row_[expert] = -1;
  freq_[expert] = 0;
  row_expert_[row] = -1;
  row_state_[row] = RowState::kFree;
  return true;
}

int SideLedger::lookup(int expert) const {
  int r = expert_row_[expert];
  return (r >= 0 && row_state_[r] == RowState::kPublished) ? r : -1;
}

int SideLedger::in_flight(int expert) const {
  int r = expert_row_[expert];
  return (r >= 0 && row_state_[r] == RowState::kInFlight) ? r : -1;
}

bool SideLedger::mark_read(int row, uint64_t forward) {
  row_read_[row] = forward + 1;
  bool first = !row_hit_[row];
  row_hit_[row] = 1;
  return first;
}

int SideLedger::clear() {
  int unused = 0;
  for (int r = 0; r < rows(); ++r)
    if (row_state_[r] == RowState::kPublished) release(r, &unused);
  return unused;
}

int SideLedger::count(RowState s) const {
  int n = 0;
  for (auto st : row_state_) n += st == s;
  return n;
}

std::string SideLedger::check() const {
  int free = 0, busy = 0;
  for (int r = 0; r < rows(); ++r) {
    int e = row_expert_[r];
    if (row_state_[r] == RowState::kFree) {
      ++free;
      if (e != -1) return "free row " + std::to_string(r) + " has owner " + std::to_string(e);
      continue;
    }
    ++busy;
    if (e < 0) return "row " + std::to_string(r) + " is taken but has no owner";
    if (expert_row_[e] != r)
      return "row " + std::to_string(r) + " is owned by expert " + std::to_string(e) +
             " which maps to row " + std::to_string(expert_row_[e]);
  }
  int owners = 0;
  for (size_t e = 0; e < expert_row_.size(); ++e) {
    int r = expert_row_[e];
    if (r < 0) continue;
    ++owners;
    if (row_expert_[r] != static_cast<int>(e))
      return "expert " + std::to_string(e) + " maps to row " + std::to_string(r) +
             " owned by " + std::to_string(row_expert_[r]);
  }
  if (owners != busy) return "owners " + std::to_string(owners) + " != taken rows " +
                             std::to_string(busy);
  if (free + busy != rows()) return "free + taken != rows";
  return {};
}

}  // namespace es
