// The state codes of a real-region slot in a snapshot (LayerSnapshot::slot_state of
// expert_cache.h); side rows report side_region.h's RowState. Exported to Python by
// bindings.cpp as engine._ext.SLOT_*.
#pragma once

#include <cstdint>

namespace es {

enum class SlotState : uint8_t {
  kEmpty = 0,       // no expert
  kResident = 1,    // an expert, evictable
  kPinned = 2,      // an expert that eviction never takes
  kLoading = 3,     // a demand read into the slot is in progress
  kJustLoaded = 4,  // loaded by the latest acquire call
};

// The state engine.cache.snapshot gives the positions past a layer's own slots or side
// rows when it stacks layers of different widths: neither a SlotState nor a RowState.
inline constexpr uint8_t kNoRow = 255;

}  // namespace es
