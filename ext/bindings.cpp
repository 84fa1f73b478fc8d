// Python bindings of engine._ext. Binding code only: no I/O or locking lives here.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <utility>

#include "errors.h"
#include "expert_cache.h"
#include "primitives.h"
#include "slot_state.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

namespace {

// The segment dtypes a pool can hold, by manifest name: the one table, exported to Python
// as DTYPE_NAMES (engine.store builds its dtype map from it).
const std::vector<std::pair<std::string, mx::Dtype>>& dtype_table() {
  static const std::vector<std::pair<std::string, mx::Dtype>> table = {
      {"bool", mx::bool_},     {"uint8", mx::uint8},     {"uint16", mx::uint16},
      {"uint32", mx::uint32},  {"uint64", mx::uint64},   {"int8", mx::int8},
      {"int16", mx::int16},    {"int32", mx::int32},     {"int64", mx::int64},
      {"float16", mx::float16}, {"bfloat16", mx::bfloat16}, {"float32", mx::float32},
  };
  return table;
}

mx::Dtype dtype_from_name(const std::string& name) {
  for (const auto& [n, dtype] : dtype_table())
    if (n == name) return dtype;
  throw std::invalid_argument("unsupported segment dtype '" + name + "'");
}

es::LayerSpec layer_from_dict(const nb::dict& d) {
  es::LayerSpec L;
  L.layer = nb::cast<int>(d["layer"]);
  L.path = nb::cast<std::string>(d["path"]);
  L.stride = nb::cast<int64_t>(d["stride"]);
  L.record_bytes = nb::cast<int64_t>(d["record_bytes"]);
  L.checksums = nb::cast<std::vector<uint32_t>>(d["checksums"]);
  for (auto item : nb::cast<nb::list>(d["segments"])) {
    nb::dict s = nb::cast<nb::dict>(item);
    es::Segment seg;
    seg.key = nb::cast<std::string>(s["key"]);
    seg.dtype = dtype_from_name(nb::cast<std::string>(s["dtype"]));
    for (auto v : nb::cast<nb::list>(s["shape"])) seg.shape.push_back(nb::cast<int>(v));
    seg.offset = nb::cast<int64_t>(s["offset"]);
    seg.nbytes = nb::cast<int64_t>(s["nbytes"]);
    L.segments.push_back(std::move(seg));
  }
  return L;
}

template <typename T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T> v, std::vector<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(heap->data(), shape.size(), shape.data(), owner);
}

nb::dict stats_dict(const es::LayerStats& s) {
  nb::dict d;
  d["hits"] = s.hits;
  d["misses"] = s.misses;
  d["loads"] = s.loads;
  d["bytes_read"] = s.bytes_read;
  d["side_hits"] = s.side_hits;
  d["prefetch_issued"] = s.prefetch_issued;
  d["prefetch_used"] = s.prefetch_used;
  d["prefetch_wasted"] = s.prefetch_wasted;
  d["prefetch_cancelled"] = s.prefetch_cancelled;
  d["evictions"] = s.evictions;
  d["overcap_calls"] = s.overcap_calls;
  d["read_seconds"] = static_cast<double>(s.read_seconds_us) * 1e-6;
  d["read_errors"] = s.read_errors;
  d["acquire_seconds"] = static_cast<double>(s.acquire_seconds_us) * 1e-6;
  return d;
}

es::Fault fault_from_name(const std::string& name) {
  if (name == "none") return es::Fault::kNone;
  if (name == "eio") return es::Fault::kEIO;
  if (name == "short_read") return es::Fault::kShortRead;
  if (name == "corrupt") return es::Fault::kCorrupt;
  if (name == "delay") return es::Fault::kDelay;
  throw std::invalid_argument("unknown fault '" + name +
                              "' (none, eio, short_read, corrupt, delay)");
}

// The Python object holds the cache through a shared_ptr that prefetch primitives share,
// so a queued primitive never outlives the state it writes to.
struct Cache {
  std::shared_ptr<es::ExpertCache> impl;
};

using Ids = nb::ndarray<const int32_t, nb::c_contig, nb::device::cpu>;

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "ExpertStream native core: blob I/O, reader pool, real region, side region.";

  nb::list dtype_names;
  for (const auto& [name, dtype] : dtype_table()) dtype_names.append(name);
  m.attr("DTYPE_NAMES") = nb::tuple(dtype_names);
  // Snapshot state codes: slot_state (es::SlotState) and side_state (es::RowState).
  m.attr("SLOT_EMPTY") = static_cast<int>(es::SlotState::kEmpty);
  m.attr("SLOT_RESIDENT") = static_cast<int>(es::SlotState::kResident);
  m.attr("SLOT_PINNED") = static_cast<int>(es::SlotState::kPinned);
  m.attr("SLOT_LOADING") = static_cast<int>(es::SlotState::kLoading);
  m.attr("SLOT_JUST_LOADED") = static_cast<int>(es::SlotState::kJustLoaded);
  m.attr("ROW_FREE") = static_cast<int>(es::RowState::kFree);
  m.attr("ROW_IN_FLIGHT") = static_cast<int>(es::RowState::kInFlight);
  m.attr("ROW_PUBLISHED") = static_cast<int>(es::RowState::kPublished);

  auto read_error = nb::exception<es::ReadError>(m, "ExpertReadError", PyExc_OSError);
  nb::exception<es::ChecksumError>(m, "ChecksumError", read_error);
  nb::exception<es::ReadTimeout>(m, "ExpertReadTimeout", read_error);

  nb::class_<Cache>(m, "ExpertCache")
      .def(
          "__init__",
          [](Cache* self, nb::list layers, int num_experts, int expert_slots, int side_slots,
             int scratch_slots,
             const std::string& policy, int decay_every, bool side_lfu, bool sync, bool verify,
             bool uncached, int threads, double read_timeout) {
            std::vector<es::LayerSpec> specs;
            for (auto item : layers) specs.push_back(layer_from_dict(nb::cast<nb::dict>(item)));
            es::CacheConfig c;
            c.cap = expert_slots;
            c.spec = side_slots;
            c.scratch = scratch_slots;
            if (policy != "lfu" && policy != "lru")
              throw std::invalid_argument("policy must be 'lfu' or 'lru', got '" + policy + "'");
            c.policy = policy == "lfu" ? es::Policy::kLFU : es::Policy::kLRU;
            c.decay_every = decay_every;
            c.side_lfu = side_lfu;
            c.sync = sync;
            c.verify = verify;
            c.uncached = uncached;
            c.threads = threads;
            if (!(read_timeout >= 0 && read_timeout <= 86400))
              throw std::invalid_argument("read_timeout must be in [0, 86400] seconds, got " +
                                          std::to_string(read_timeout));
            c.read_timeout_ms = static_cast<int>(std::lround(read_timeout * 1000));
            if (read_timeout > 0 && c.read_timeout_ms == 0) c.read_timeout_ms = 1;
            new (self) Cache{std::make_shared<es::ExpertCache>(std::move(specs), num_experts, c)};
          },
          "layers"_a, "num_experts"_a, "expert_slots"_a, "side_slots"_a = 0, "scratch_slots"_a = 1,
          "policy"_a = "lfu", "decay_every"_a = 256, "side_lfu"_a = true, "sync"_a = false,
          "verify"_a = true, "uncached"_a = true, "threads"_a = 2,
          "read_timeout"_a = 30.0)
      .def_prop_ro("num_layers", [](const Cache& c) { return c.impl->num_layers(); })
      .def_prop_ro("num_experts", [](const Cache& c) { return c.impl->num_experts(); })
      .def_prop_ro("rows", [](const Cache& c) { return c.impl->rows(); })
      .def_prop_ro("expert_slots", [](const Cache& c) { return c.impl->config().cap; })
      .def_prop_ro("side_slots", [](const Cache& c) { return c.impl->config().spec; })
      .def_prop_ro("scratch_slots", [](const Cache& c) { return c.impl->config().scratch; })
      .def("pool", [](const Cache& c, int li) { return c.impl->pool(li); }, "layer"_a)
      .def(
          "acquire",
          [](Cache& c, int li, Ids ids) {
            std::vector<int32_t> local(ids.size());
            std::vector<int> missing;
            {
              nb::gil_scoped_release release;
              missing = c.impl->acquire(li, ids.data(), local.data(), ids.size());
            }
            std::vector<size_t> shape(ids.shape_ptr(), ids.shape_ptr() + ids.ndim());
            return nb::make_tuple(to_numpy(std::move(local), shape), missing);
          },
          "layer"_a, "ids"_a)
      .def(
          "acquire_op",
          [](Cache& c, int li, const mx::array& ids, bool cpu_stream) {
            if (cpu_stream) return es::acquire_op(c.impl, li, ids, mx::Device(mx::Device::cpu));
            return es::acquire_op(c.impl, li, ids);
          },
          "layer"_a, "ids"_a, "cpu_stream"_a = false,
          "Lazy int32 pool rows of `ids` (any shape) for MoE layer `layer`, mapped by the "
          "cache when evaluated, in stream order, without a host synchronisation; on the "
          "default stream, or the CPU stream if `cpu_stream`. Precondition: plan() said "
          "PLAN_STREAM for this call. A read error while evaluating it leaves row 0 and is "
          "raised by the next raise_stream_error() or plan().")
      .def(
          "raise_stream_error",
          [](Cache& c) { c.impl->raise_stream_error(); },
          "Raises (and clears) the first error of a stream-ordered acquire since the last "
          "call: ExpertReadError, ChecksumError, ExpertReadTimeout or RuntimeError. Call it "
          "after evaluating a forward that used acquire_op, before using its result.")
      .def(
          "plan", [](Cache& c, int li, int64_t n, int top_k) { return int(c.impl->plan(li, n, top_k)); },
          "layer"_a, "n"_a, "top_k"_a,
          "How the next call of MoE layer `layer` with `n` expert ids (`top_k` per token) "
          "gets its pool rows (after raising a pending stream error, see "
          "raise_stream_error): 0 (PLAN_TABLE) table(layer)[ids] on the device, the layer "
          "being complete and the call one token (its top_k hits are counted now); 1 "
          "(PLAN_STREAM) acquire_op, n being at most expert_slots - pinned; 2 (PLAN_SYNC) "
          "acquire on host ids, with over-capacity chunks.")
      .def("is_complete", [](const Cache& c, int li) { return c.impl->is_complete(li); },
           "layer"_a,
           "Whether every expert of MoE layer `layer` has a real slot (as plan() last found "
           "it); a complete layer can never miss, so nothing of it is worth prefetching.")
      .def("table", [](const Cache& c, int li) { return c.impl->table(li); }, "layer"_a,
           "(num_experts,) int32 expert -> real slot of MoE layer `layer`, valid while "
           "plan() returns PLAN_TABLE.")
      .def(
          "load_scratch",
          [](Cache& c, int li, const std::vector<int>& experts) {
            nb::gil_scoped_release release;
            return c.impl->load_scratch(li, experts);
          },
          "layer"_a, "experts"_a)
      .def(
          "prefetch",
          [](Cache& c, int li, Ids ids) {
            nb::gil_scoped_release release;
            c.impl->prefetch(li, ids.data(), ids.size());
          },
          "layer"_a, "ids"_a)
      .def(
          "prefetch_op",
          [](Cache& c, int li, const mx::array& ids, bool cpu_stream) {
            if (cpu_stream) return es::prefetch_op(c.impl, li, ids, mx::Device(mx::Device::cpu));
            return es::prefetch_op(c.impl, li, ids);
          },
          "layer"_a, "ids"_a, "cpu_stream"_a = false,
          "Lazy uint8 scalar that starts the prefetch of `ids` for MoE layer `layer` when "
          "evaluated; on the default stream, or the CPU stream if `cpu_stream`.")
      .def(
          "drain",
          [](Cache& c) {
            nb::gil_scoped_release release;
            c.impl->drain();
          })
      .def(
          "pin",
          [](Cache& c, int li, int e) {
            nb::gil_scoped_release release;
            c.impl->pin(li, e);
          },
          "layer"_a, "expert"_a)
      .def("unpin", [](Cache& c, int li, int e) { c.impl->unpin(li, e); }, "layer"_a, "expert"_a)
      .def(
          "set_policy",
          [](Cache& c, const std::string& p) {
            if (p != "lfu" && p != "lru")
              throw std::invalid_argument("policy must be 'lfu' or 'lru', got '" + p + "'");
            c.impl->set_policy(p == "lfu" ? es::Policy::kLFU : es::Policy::kLRU);
          },
          "policy"_a)
      .def_prop_rw(
          "side_lfu", [](const Cache& c) { return c.impl->side_lfu(); },
          [](Cache& c, bool on) { c.impl->set_side_lfu(on); })
      .def_prop_rw(
          "sync", [](const Cache& c) { return c.impl->sync(); },
          [](Cache& c, bool on) { c.impl->set_sync(on); })
      .def(
          "reset",
          [](Cache& c) {
            nb::gil_scoped_release release;
            c.impl->reset();
          })
      .def_prop_ro("forward", [](const Cache& c) { return c.impl->forward(); })
      .def_prop_ro("inflight", [](const Cache& c) { return c.impl->inflight(); })
      .def("check", [](const Cache& c) { return c.impl->check(); })
      .def(
          "snapshot",
          [](const Cache& c, int li) {
            es::LayerSnapshot s;
            {
              nb::gil_scoped_release release;
              s = c.impl->snapshot(li);
            }
            size_t cap = s.slot_expert.size(), side = s.side_expert.size(), e = s.freq.size();
            nb::dict d;
            d["slot_expert"] = to_numpy(std::move(s.slot_expert), {cap});
            d["slot_state"] = to_numpy(std::move(s.slot_state), {cap});
            d["side_expert"] = to_numpy(std::move(s.side_expert), {side});
            d["side_state"] = to_numpy(std::move(s.side_state), {side});
            d["freq"] = to_numpy(std::move(s.freq), {e});
            d["stats"] = stats_dict(s.stats);
            return d;
          },
          "layer"_a)
      .def(
          "inject_fault",
          [](Cache& c, int li, const std::string& kind, int expert, int count, int delay_ms) {
            c.impl->inject_fault(li, fault_from_name(kind), expert, count, delay_ms);
          },
          "layer"_a, "kind"_a, "expert"_a = -1, "count"_a = 1, "delay_ms"_a = 0);
}
