// Python bindings of engine._ext. Binding code only: no I/O, locking, validation or
// format knowledge lives here (the native types check their own arguments).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <utility>

#include "checksum.h"
#include "errors.h"
#include "expert_cache.h"
#include "mailbox.h"
#include "primitives.h"
#include "router.h"
#include "scratch_stream.h"
#include "segment_dtypes.h"
#include "slot_state.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

namespace {

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
    seg.dtype = es::segment_dtype(nb::cast<std::string>(s["dtype"]));
    for (auto v : nb::cast<nb::list>(s["shape"])) seg.shape.push_back(nb::cast<int>(v));
    seg.offset = nb::cast<int64_t>(s["offset"]);
    seg.nbytes = nb::cast<int64_t>(s["nbytes"]);
    L.segments.push_back(std::move(seg));
  }
  if (d.contains("sources")) {
    for (auto item : nb::cast<nb::list>(d["sources"])) {
      nb::dict s = nb::cast<nb::dict>(item);
      L.sources.push_back(es::SegmentSource{nb::cast<std::string>(s["path"]),
                                            nb::cast<int64_t>(s["offset"]),
                                            nb::cast<int64_t>(s["nbytes"])});
    }
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
  for (const auto& f : es::kStatFields) {
    if (f.micros)
      d[f.name] = static_cast<double>(s.*f.value) * 1e-6;
    else
      d[f.name] = s.*f.value;
  }
  return d;
}

// Docstrings of the Python API (engine._ext; engine/_ext.pyi is generated from them).
// Errors: std::invalid_argument -> ValueError, std::out_of_range -> IndexError,
// es::ReadError -> ExpertReadError (OSError), with ChecksumError / ExpertReadTimeout.
namespace doc {

const char* kCache = R"(The expert cache of one store: per MoE layer a pool of rows (real region,
two side-region banks, scratch rows), the reader pool, the side ledgers and the counters.

Thread safety: acquire, acquire_op, load_scratch, pin/unpin and reset belong to one
thread at a time (the generation thread, or the MLX stream that evaluates acquire_op);
a ScratchStream's thread runs load_scratch on the layer it streams meanwhile; snapshot,
check, the properties and the live toggles may be used from any thread.)";

const char* kInit = R"(Opens the blob files and allocates every pool.

Args:
    layers: one dict per MoE layer, in MoE order: layer (decoder index, for messages),
        path (blob file), stride and record_bytes (bytes), checksums (num_experts crc32
        ints), segments (list of dicts: key, dtype (a name of DTYPE_NAMES), shape
        (per expert), offset and nbytes (bytes in the record)); for an in-place store,
        sources (one dict per segment, in its order: path (a safetensors file), offset
        (bytes, expert 0's) and nbytes (per expert): expert e's bytes of the segment are
        at offset + e * nbytes), path then naming the records in messages and stride
        being the read buffer of a record (each segment's nbytes rounded up to 4096, plus
        4096, summed).
    num_experts: records per blob file, >= 1.
    expert_slots: real-region slots per layer, in [1, num_experts].
    side_slots: side-region rows per bank (two banks), >= 0.
    scratch_slots: rows for an over-capacity call's misses, experts per chunk, >= 1.
    policy: real-region eviction: "predictive", "lfu", "lru", "lfu-da" or "s3-fifo"
        (ext/real_region.h).
    decay_every: acquire calls per layer between LFU halvings (0: never).
    side_lfu: persistent LFU side region (bank 0) or the double buffer (both banks).
    sync: run prefetch fills inline where they are submitted.
    verify_checksums: check each record's crc32 on every read.
    uncached_io: bypass the page cache (O_DIRECT / F_NOCACHE).
    reader_threads: reader threads, >= 1.
    read_timeout_s: seconds a demand read or a drain waits without progress, in
        [0, 86400] (0: forever).
    top_k: experts per token; calls of at most top_k ids teach the predictive policy
        (0: every call does).
    layer_slots: real-region slots of each MoE layer, overriding expert_slots (empty:
        expert_slots for every layer), each in [1, num_experts].
    layer_side_slots: side-region rows per bank of each MoE layer, overriding side_slots
        (empty: side_slots for every layer), each in [0, side_slots].
    io_uring: demand reads through io_uring on the calling thread, io_uring_depth in
        flight, where the kernel has it (see the io_uring property); else on the reader
        threads. Prefetch fills always use the reader threads.
    io_uring_depth: demand reads in flight through io_uring, one read buffer (a
        record's stride) each, in [0, 4096] (0: `io_uring_depth`'s).
    adaptive_prefetch: how many of a prediction's experts each layer fills (its prefetch
        degree, up to its side slots) decided at run time from how often each rank of its
        predictions is routed to and from the forward times measured at neighbouring
        thresholds (prefetch_threshold); False: every prediction fills its side_slots.

Pool rows per layer: its real slots + 2 * its side slots + scratch_slots.

Raises:
    ValueError: a count or option out of range, an unknown dtype, segments that do not
        fit the record.
    ExpertReadError: a blob file cannot be opened or has the wrong size.)";

const char* kIoUringDepth = R"(Demand reads in flight through io_uring for a cache of
`reader_threads` reader threads, `top_k` experts per token and records of `stride` bytes
(one read buffer each): reader_threads + 1, raised to max(top_k, 8) while the buffers stay
within 64 MiB, so that a token's misses of a layer go in one submission and small records
get the queue depth the disk needs. What ExpertCache uses when its io_uring_depth is 0.)";

const char* kPlannedBytes = R"(Bytes an ExpertCache allocates: for each MoE layer `rows[i]` pool
rows of `record_bytes[i]` bytes and an expert table of `num_experts` int32, plus a read
buffer of `stride` bytes per reader thread and, where `io_uring_depth` > 0, the io_uring
region of that many buffers (each rounded as the cache allocates it: whole pages, huge
pages from 1 MiB on, the region at least 2 MiB). 0 for no layer.

Raises:
    ValueError: rows and record_bytes differ in length.)";

const char* kNumLayers = "MoE layers (pools).";
const char* kNumExperts = "Experts per MoE layer (records per blob).";
const char* kRows =
    "Pool rows of MoE layer `layer`: its real slots + 2 * its side slots + scratch_slots.";
const char* kExpertSlots = "Real-region slots of the largest MoE layer (layer_slots: each's).";
const char* kLayerSlots = "Real-region slots of each MoE layer (list of int, in MoE order).";
const char* kSideSlots =
    "Side-region rows per bank (two banks), and experts per prediction (layer_side_slots: "
    "each layer's rows).";
const char* kLayerSideSlots =
    "Side-region rows per bank of each MoE layer (list of int, in MoE order).";
const char* kIoUring =
    "Whether demand reads go through io_uring (asked for, and the kernel has it); else "
    "they use the reader threads.";
const char* kScratchSlots = "Scratch rows per layer: experts per chunk of an over-capacity call.";
const char* kPoolWrites =
    "How records reach the pools: \"memcpy\" (host memory, unified memory), or \"cuda\" "
    "(MLX CUDA's managed memory, written with cudaMemcpyAsync so its pages stay on the "
    "GPU).";

const char* kPool = R"(The pool arrays of MoE layer `layer`, one per segment in record order, each
shaped (rows, *segment shape) with the segment's dtype. They share memory with the
cache: rows change as experts are loaded, so read them only through the rows acquire
returns, in the same forward.

Raises:
    IndexError: `layer` is not in [0, num_layers).)";

const char* kAcquire = R"(Maps the expert ids of one MoE layer call to pool rows: real hit, side hit
(the bank being read) or a demand read into the real region.

Args:
    layer: MoE layer index; a layer not above the previous call's starts a new forward.
    ids: int32 C-contiguous numpy array, any shape (e.g. (tokens, top_k)), values in
        [0, num_experts).

Returns:
    (rows, missing): rows, int32 numpy array of the shape of `ids`; missing, a list of
    int. When the call's distinct misses exceed the evictable slots (expert_slots minus
    pinned) nothing is loaded: the entries of those experts are -1 and `missing` lists
    them (distinct, the ones with the most entries first, ties by id), to be read
    through a ScratchStream (or load_scratch); otherwise `missing` is empty.

Precondition: plan() said PLAN_SYNC for this call (or a trace hook is set), and every
earlier use of this layer's pool has been evaluated (the caller synchronised on `ids`),
so no row an unevaluated computation reads is reused.

Raises:
    IndexError: `layer` or an id out of range.
    ExpertReadError: a demand read failed (ChecksumError, ExpertReadTimeout).)";

const char* kAcquireOp = R"(Lazy int32 pool rows of `ids` for MoE layer `layer`, mapped by the cache
when MLX evaluates them, in stream order, with no host synchronisation.

Args:
    ids: mx.array of any shape and integer dtype (the router's expert ids).
    cpu_stream: build the primitive on the CPU stream (needed on a GPU device).
    after: an mx.array evaluated before it (not read), e.g. a prefetch_op scalar, so
        that it runs on the same stream just before this acquire.

Returns:
    mx.array, int32, the shape of `ids`.

Precondition: plan() said PLAN_STREAM for this call.

Raises:
    ValueError: `ids` is not of an integer dtype.
    A read error while it is evaluated leaves row 0 (a valid row) and is raised by the
    next raise_stream_error() or plan().)";

const char* kRaiseStreamError = R"(Raises (and clears) the first error of a stream-ordered acquire
since the last call: ExpertReadError, ChecksumError, ExpertReadTimeout or RuntimeError.
Call it after evaluating a forward that used acquire_op, before using its result.)";

const char* kPlan = R"(How the next call of MoE layer `layer` with `n` expert ids (`top_k` per
token) gets its pool rows, after raising a pending stream error (see
raise_stream_error).

Returns:
    PLAN_TABLE: table(layer)[ids] on the device, the layer being complete (a one-token
    call's top_k hits are counted now, a longer call's not at all); PLAN_STREAM:
    acquire_op, n being at most expert_slots - pinned; PLAN_SYNC: acquire on host ids,
    with over-capacity misses through a ScratchStream or the layer scratch.

Raises:
    IndexError: `layer` out of range.
    ExpertReadError (and subclasses), RuntimeError: a pending stream error.)";

const char* kIsComplete = R"(Whether every expert of MoE layer `layer` has a real slot (as plan()
last found it); a complete layer can never miss, so nothing of it is worth prefetching.

Raises:
    IndexError: `layer` out of range.)";

const char* kTable = R"((num_experts,) int32 mx.array: expert -> real slot of MoE layer `layer`,
valid while plan() returns PLAN_TABLE.

Raises:
    IndexError: `layer` out of range.)";

const char* kFill = R"(Reads every expert of MoE layer `layer` that has no real slot into a free
one; the layer is then complete (is_complete() from the next plan()). Counts loads,
bytes_read and read_seconds, not misses. Same thread rule as acquire.

Returns:
    The number of experts read.

Raises:
    IndexError: `layer` out of range.
    ValueError: the layer's real region does not hold every expert.
    ExpertReadError (and subclasses): a read failed (the experts that landed stay).)";

const char* kLayerScratch = R"(Bank `bank` (0 or 1) of the layer scratch that MoE layer `layer`'s
over-capacity calls use where the pools are device memory (`load_layer` uses bank 0,
`load_whole` both in turn): per segment key, in the store's order, an array
(num_experts, *segment shape), shared by every layer of the same segment layout and
allocated on first use, with as many records of page-locked host staging.

Raises:
    IndexError: `layer` out of range, or a bank other than 0 and 1.
    MemoryError: it cannot be allocated (naming the bytes).)";

const char* kReadLayer = R"(Starts reading every expert of MoE layer `layer` that has no real
slot and is not in the host tier into bank `bank`'s staging, each in the row of its id,
on the reader threads behind demand reads (a long prompt's next call: `load_whole`); an
earlier read-ahead of that bank not yet taken is given up.

Returns:
    How many records it started reading.

Raises:
    IndexError: `layer` out of range, or a bank other than 0 and 1.)";

const char* kLoadWhole = R"(Puts every expert of MoE layer `layer` in the row of its id of bank
`bank` of its layer scratch, so that a long prompt's call computes on it with the router's
ids as rows, never reading them on the host: records read by `read_layer` (waited for as
demand reads are), from the host tier, or read now, uploaded in runs of consecutive rows;
resident experts copied from their slots. Empty real slots take experts in id order.
Counts loads, bytes and read time, not lookups.

Precondition: every computation that read this bank before has been evaluated; the device
may be computing on the other bank.

Raises:
    IndexError: `layer` out of range, or a bank other than 0 and 1.
    ExpertReadError: a read failed (ChecksumError, ExpertReadTimeout).)";

const char* kReadAhead = R"(Starts reading `experts` (int ids, the misses predicted for the
next over-capacity call of MoE layer `layer`) into its layer scratch's host staging on the
reader threads, behind demand reads; experts with a real slot, or in the host tier, are
left out, and an earlier read-ahead not yet taken by `load_layer` is given up.

Returns:
    How many records it started reading.

Raises:
    IndexError: `layer` or an expert out of range.)";

const char* kLoadLayer = R"(Puts every expert of an over-capacity call of MoE layer `layer`
into rows of its layer scratch (`layer_scratch`), so that the call computes from it alone:
`missing` (acquire's) from records read ahead (`read_ahead`), the host tier, or read now
on the reader threads, the staging copied to the device in one copy per segment;
`resident` (the call's hits) from their pool rows `resident_rows` by device copies. Each
miss also fills an empty real slot while there is one (as `load_scratch`); misses, loads,
bytes and read time are counted.

Returns:
    The layer-scratch row of each expert, `missing` first, then `resident`.

Precondition: as acquire's (every earlier use of the layer scratch has been evaluated:
the caller synchronised on this call's ids).

Raises:
    IndexError: `layer`, an expert or a pool row out of range.
    ValueError: more experts than num_experts, or resident and resident_rows of
        different lengths.
    ExpertReadError: a read failed (ChecksumError, ExpertReadTimeout).)";

const char* kLoadScratch = R"(Reads `experts` (at most scratch_slots of the `missing` list of
acquire) into the scratch rows of MoE layer `layer`. While the real region has empty
slots, each expert read is also copied into one (no second read), so a prompt that
overflows a cold cache leaves its most-routed experts resident for decode.

Returns:
    The scratch row of each expert, in order.

Precondition: the previous chunk's computation has been evaluated (its rows are reused).

Raises:
    ValueError: more experts than scratch_slots.
    IndexError: `layer` or an expert out of range.
    ExpertReadError: a read failed.)";

const char* kPrefetch = R"(Reserves side rows of MoE layer `layer` for the predicted experts `ids`
(int32 C-contiguous numpy array, any shape) and starts their reads on the reader pool
(inline in sync mode). A failed fill only costs a later demand read.

Raises:
    IndexError: `layer` out of range.)";

const char* kPrefetchOp = R"(Lazy uint8 scalar that, when evaluated, ranks the experts of MoE
layer `layer` with `router` (that layer's Router) for the last `rows` tokens of `x` (a
decode step's replies; one by default) and starts the prefetch of every row's top
`budget`, rank by rank (every row's best, then every row's second, ...), like prefetch:
one target's prediction in one op. On the default stream, or the CPU stream if
`cpu_stream`. Tie it into the graph with mx.depends, or pass it as an earlier acquire_op's
`after` (same stream). `after`: an mx.array evaluated first (not read), e.g. the scalar of
a nearer target's prediction from the same x, so one scalar stands for a chain of
predictions.

Args:
    x: (..., hidden) mx.array, float32, float16 or bfloat16, any strides: the hidden
        state entering an earlier MoE layer.
    budget: experts to prefetch per row, in [1, router.num_experts].
    rows: the most tokens of x predicted from, its last ones (at least 1).

Raises:
    IndexError: `layer` out of range.
    ValueError: x's dtype, x's last axis not the router's hidden size, a router of
        another expert count, budget out of range, or rows < 1 (each naming the layer).)";

const char* kRouter = R"(A dense copy of one MoE layer's router for the prefetch prediction:
logits = weight @ x + bias, with weight kept as bfloat16 (num_experts x hidden x 2
bytes) and float32 bias and sums. It only ranks experts; the model's own routing is
never replaced.

Args:
    weight: (num_experts, hidden) float32 numpy array.
    bias: (num_experts,) float32 numpy array.

Raises:
    ValueError: empty or mismatched shapes.)";

const char* kRouterTop = R"(The `budget` experts of highest logit for hidden state `x`
((hidden,) float32 numpy array), highest first (ties: lower expert id first; NaN logits
last), as an int32 numpy array. For (rows, hidden) x (a decode step's replies): each
row's top `budget` merged rank by rank (every row's best, then every row's second, ...),
an expert once, at most rows x budget of them.

Raises:
    ValueError: x is not (hidden,) or (rows, hidden) with rows >= 1, or budget not in
        [1, num_experts].)";

const char* kDrain = R"(Cancels queued prefetch fills and waits for started ones. A fill still
reading after read_timeout seconds without any fill finishing is given up: its row is
freed and
the expert left to a later demand read.)";

const char* kPin = R"(Pins `expert` of MoE layer `layer` in the real region (reading it if it is not
resident); eviction never takes a pinned slot.

Raises:
    IndexError: `layer` or `expert` out of range.
    ValueError: pinning it would leave no evictable slot (at most expert_slots - 1 pins).
    RuntimeError: every evictable slot is being loaded by other calls (pin again once
        they have landed).
    ExpertReadError: the read failed (the expert stays unpinned).)";

const char* kUnpin = R"(Unpins `expert` of MoE layer `layer` (it stays resident, evictable).
Unpinning an expert that is not pinned does nothing. Precondition: 0 <= expert <
num_experts.

Raises:
    IndexError: `layer` out of range.)";

const char* kSetPolicy = R"(Sets the real-region eviction policy of every layer: "predictive", "lfu",
"lru", "lfu-da" or "s3-fifo".

Raises:
    ValueError: another name.)";

const char* kSideLfu =
    "Persistent LFU side region (True) or double buffer (False); a change applies at the "
    "next forward boundary, after a drain.";
const char* kSync =
    "Run prefetch fills inline where they are submitted (from the next submission).";
const char* kReset =
    "Drains, then empties every real region (pins and frequencies too) and side ledger.";
const char* kForward = "Forward passes begun so far.";
const char* kInflight = "Prefetch fills in flight, all layers.";
const char* kReadingSeconds =
    "Wall time, in seconds, during which at least one record read of this cache was in "
    "flight (demand reads, prefetch fills and scratch streams of every layer, reads that "
    "overlap counted once): bytes_read over it is the read rate while reading, the figure "
    "a disk's own sequential rate (dd) compares with.";
const char* kCheck =
    "The first inconsistency found in any real region or side ledger, or an empty string "
    "when all are consistent (a test and debugging aid).";

const char* kSnapshot = R"(The state of MoE layer `layer`, copied under the cache's lock (any
thread).

Returns:
    dict: slot_expert (expert_slots,) int32 (-1: empty); slot_state (expert_slots,)
    uint8 SLOT_* codes; side_expert (2 * its side slots,) int32, bank 0 then bank 1;
    side_state (2 * its side slots,) uint8 ROW_* codes; freq (num_experts,) float32 LFU
    frequencies; stats, a dict of the counters STAT_KEYS names (int; the *_seconds ones
    float seconds); prefetch_degree (int), the experts of a prediction for the layer
    that are filled now (at most its side slots; see prefetch_threshold).

Raises:
    IndexError: `layer` out of range.)";

const char* kInjectFault = R"(Test hook: makes the next `count` reads of `expert` (-1: any) of MoE
layer `layer` fail as `kind`: "none" (clears), "eio", "short_read", "corrupt" (a
checksum mismatch) or "delay" (waits `delay_ms` first).

Raises:
    ValueError: an unknown kind.)";

const char* kHint = R"(Router probabilities of the tokens the next acquire of `layer` routes.

Args:
    layer: MoE layer index.
    probs: float32 softmax over the experts, (num_experts,) or (tokens, num_experts),
        each in [0, 1].

Evidence for the predictive eviction policy (which unchosen experts were close), used by
that acquire only and only when it routes one token.

Raises:
    ValueError: probs is not a multiple of num_experts values, or a value is outside
        [0, 1].
    IndexError: layer out of range.)";

const char* kScratchStream = R"(The misses of one over-capacity call streamed through the scratch rows
in banks (two when scratch_slots >= 2: the first ceil(scratch_slots / 2) rows and the
rest; else one), the reads of the next chunk in flight while the current one computes.
Made by ExpertCache.scratch_stream; each chunk's place in the graph is scratch_step. Its
own thread reads the chunks in order (load_scratch: io_uring or the reader threads,
checksums, timeouts, empty real slots filled, counters), from the first step on.)";

const char* kScratchChunks = R"(Per chunk, in order: (experts, rows), the chunk's experts (the
misses in acquire's order) and the pool row each is read into (int lists).)";

const char* kScratchBanks = R"(How many banks the scratch rows are split into: 2, or 1 when
scratch_slots is 1 (each chunk's read then waits for the previous chunk's compute).)";

const char* kScratchStreamMake = R"(A ScratchStream for `experts` (acquire's `missing` of MoE
layer `layer`). Reads nothing until its first step is evaluated.

Raises:
    IndexError: `layer` or an expert out of range.)";

const char* kScratchStep = R"(Lazy int32 `rows` (the pool rows of the pairs chunk `chunk` of
`stream` computes, any shape) returned as they are once that chunk's experts have landed
in them. When MLX evaluates it, `after` has been computed, so the bank of chunk - 1 is
free: it releases the next chunk into that bank (whose read then runs while this chunk
computes), then waits for this chunk's reads; the host never waits. On the default stream,
or the CPU stream if `cpu_stream` (needed on a GPU device).

Args:
    rows: mx.array, int32.
    after: the output of chunk - 1's compute (None only for chunk 0).

Returns:
    mx.array, int32, `rows`' shape and values.

Raises:
    IndexError: `chunk` out of range.
    ValueError: `rows` not int32, `after` missing for chunk >= 1, or `stream` made by
        another cache.
    A read error while it is evaluated leaves the chunk's rows holding other bytes and is
    raised by the next raise_stream_error() or plan().)";
const char* kMailbox = R"(The acquire mailbox of a cache on a CUDA device (ext/mailbox.h).

A kernel on the GPU's stream (engine.device_acquire) writes a decode step's expert ids, and
optionally the hidden state of each row's last token (a batch has a row per reply), into
this mailbox in mapped host memory and spins until the mailbox's thread has answered with
their pool rows (ExpertCache.acquire: hits, side hits, demand reads); the thread then
prefetches what the hidden states predict for the layer's targets (set_prefetch). No MLX
cross-stream event is involved. The cache's pool writes are staged in mapped memory
(ExpertCache.set_staging) and each answer delivers them to its kernels, which copy them
into the pools (ext/staged_copies.h).

Args:
    cache: the ExpertCache whose acquire answers the requests.
    hidden: the hidden size (floats) a request's hidden state has.
    max_ids: the most ids of one request, in [1, MAX_IDS]; as many staging slots (of the
        widest record, bytes) are kept for a request's demand reads.
    fill_slots: staging slots for prefetch fills (a fill that finds none gives up).
    tier_slots: host-tier slots per MoE layer (records kept in host memory after their
        copies ran, evicted by the cache's policy; 0: none).
    x_rows: the most rows of hidden state one request carries (a batch's replies).

Where the cache's pools are not CUDA memory the mailbox is plain host memory (`mapped` is
False): only `post` reaches it, as the tests do, and the fill stream's batches are copied
by the thread itself, a while after it queued them (ext/pool_writer.h, CopyStream).

Raises:
    ValueError: hidden < 1, max_ids, fill_slots, tier_slots or x_rows out of range.
    RuntimeError: the cache's writes are already staged, or the CUDA runtime refused to
        map the memory.)";

const char* kMailboxPost = R"(Posts a request as the kernel does and returns its rows.

Waits until the previous request was answered, writes `layer`, `ids` (int32, at most
max_ids; empty: a prefetch-only request) and `x` (float32 (hidden,) or (rows, hidden) with
rows at most x_rows, or None) and publishes the request. Where the hit table has every id,
the rows are its entries and the request is posted FAST (answered later, not waited for:
`wait`); else it waits for the answer and performs the pool copies it delivers. The host's
stand-in for the kernels (tests, pools in host memory): never while kernels post to this
mailbox.

Returns:
    (len(ids),) int32 pool rows (all 0 after a failed acquire, whose error
    ExpertCache.raise_stream_error raises).

Raises:
    ValueError: more than max_ids ids, or x is not (hidden,) or (rows, hidden) with rows
        in [1, x_rows].)";

const char* kMailboxSetPrefetch = R"(What the thread prefetches after a request of MoE layer
`source` that carries hidden states: for each of `targets` (MoE layers), the Router at the
same position ranks the experts for each row, and ExpertCache.prefetch takes the top
`budget` of every row, rank by rank (each row's best, then each row's second, ...), an
expert once. Replaces the layer's earlier plan; empty lists: none.

Raises:
    IndexError: a layer out of range.
    ValueError: lengths differ, a router of another hidden size or expert count, or budget
        outside [1, experts] with targets given.)";

}  // namespace doc

// The Python object holds the cache through a shared_ptr that prefetch primitives share,
// so a queued primitive never outlives the state it writes to.
struct Cache {
  std::shared_ptr<es::ExpertCache> impl;
};

struct MailboxHandle {
  std::unique_ptr<es::AcquireMailbox> impl;
};

// A Router is held the same way: the prefetch primitives share it without the GIL.
struct RouterHandle {
  std::shared_ptr<const es::Router> impl;
};

// A ScratchStream is held the same way: its step primitives share it.
struct ScratchHandle {
  std::shared_ptr<es::ScratchStream> impl;
};

using Ids = nb::ndarray<const int32_t, nb::c_contig, nb::device::cpu>;
using Probs = nb::ndarray<const float, nb::c_contig, nb::device::cpu>;
using Matrix = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Vector = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// The keyword defaults of ExpertCache(): the native cache's own.
const es::CacheConfig kDefaults{};

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "ExpertStream native core: blob I/O, reader pool, real region, side region.";

  m.def(
      "record_crc32",
      [](nb::bytes data) {
        const auto* p = static_cast<const uint8_t*>(data.data());
        nb::gil_scoped_release release;
        return es::record_crc32(p, data.size());
      },
      "data"_a,
      "zlib's crc32 of `data`, as the cache checks every record it reads (the manifest's "
      "checksums): buffers of at least 1 MiB are split in 256 KiB chunks checked on helper "
      "threads and joined with crc32_combine. Returns an int in [0, 2**32).");
  m.def("io_uring_depth", &es::io_uring_depth, "reader_threads"_a, "top_k"_a, "stride"_a,
        doc::kIoUringDepth);
  m.def("planned_bytes", &es::planned_bytes, "rows"_a, "record_bytes"_a, "num_experts"_a,
        "reader_threads"_a, "stride"_a, "io_uring_depth"_a, doc::kPlannedBytes);
  m.def("staging_slot_size", &es::StagedCopies::slot_size, "record_bytes"_a, "segments"_a,
        "Bytes of one staging or host-tier slot that holds a record of `record_bytes` bytes in "
        "`segments` segments (each 16-byte aligned, slots 256-byte aligned): what a host tier "
        "is sized by, per slot of its widest record.");
  // A function, not a constant: a constant's value would be written into the generated
  // stub, which must be the same whichever library the build found.
  m.def(
      "crc32_implementation",
      &es::crc32_implementation,
      "Which library computes record checksums: \"libdeflate\" where the build found it, "
      "else \"zlib\" (the same values; libdeflate is several times faster).");

  nb::list dtype_names;
  for (const auto& [name, dtype] : es::segment_dtypes()) dtype_names.append(name);
  m.attr("DTYPE_NAMES") = nb::tuple(dtype_names);
  nb::list stat_keys;
  for (const auto& f : es::kStatFields) stat_keys.append(f.name);
  m.attr("STAT_KEYS") = nb::tuple(stat_keys);
  nb::list policy_names;
  for (int i = 0; i < es::kNumPolicies; ++i)
    policy_names.append(es::policy_name(static_cast<es::Policy>(i)));
  m.attr("POLICY_NAMES") = nb::tuple(policy_names);
  // Snapshot state codes: slot_state (es::SlotState) and side_state (es::RowState).
  m.attr("SLOT_EMPTY") = static_cast<int>(es::SlotState::kEmpty);
  m.attr("SLOT_RESIDENT") = static_cast<int>(es::SlotState::kResident);
  m.attr("SLOT_PINNED") = static_cast<int>(es::SlotState::kPinned);
  m.attr("SLOT_LOADING") = static_cast<int>(es::SlotState::kLoading);
  m.attr("SLOT_JUST_LOADED") = static_cast<int>(es::SlotState::kJustLoaded);
  m.attr("ROW_FREE") = static_cast<int>(es::RowState::kFree);
  m.attr("ROW_IN_FLIGHT") = static_cast<int>(es::RowState::kInFlight);
  m.attr("ROW_PUBLISHED") = static_cast<int>(es::RowState::kPublished);
  m.attr("NO_ROW") = static_cast<int>(es::kNoRow);
  // What ExpertCache.plan returns (es::ExpertCache::Plan).
  m.attr("PLAN_TABLE") = static_cast<int>(es::ExpertCache::kPlanTable);
  m.attr("PLAN_STREAM") = static_cast<int>(es::ExpertCache::kPlanStream);
  m.attr("PLAN_SYNC") = static_cast<int>(es::ExpertCache::kPlanSync);

  auto read_error = nb::exception<es::ReadError>(m, "ExpertReadError", PyExc_OSError);
  nb::exception<es::ChecksumError>(m, "ChecksumError", read_error);
  nb::exception<es::ReadTimeout>(m, "ExpertReadTimeout", read_error);
  nb::exception<es::ResourceError>(m, "ResourceError", PyExc_OSError);

  nb::class_<RouterHandle>(m, "Router", doc::kRouter)
      .def(
          "__init__",
          [](RouterHandle* self, Matrix weight, Vector bias) {
            new (self) RouterHandle{std::make_shared<const es::Router>(
                weight.data(), static_cast<int>(weight.shape(0)),
                static_cast<int>(weight.shape(1)), bias.data(), static_cast<int>(bias.shape(0)))};
          },
          "weight"_a, "bias"_a)
      .def_prop_ro("num_experts", [](const RouterHandle& r) { return r.impl->num_experts(); })
      .def_prop_ro("hidden", [](const RouterHandle& r) { return r.impl->hidden(); })
      .def(
          "top",
          [](const RouterHandle& r, Probs x, int budget) {
            const int hidden = r.impl->hidden();
            if (x.ndim() == 2) {
              if (static_cast<int>(x.shape(1)) != hidden)
                throw std::invalid_argument("router: x rows have " +
                                            std::to_string(x.shape(1)) + " values, hidden is " +
                                            std::to_string(hidden));
              std::vector<int32_t> out =
                  r.impl->top_rows(x.data(), static_cast<int>(x.shape(0)), budget);
              const size_t n = out.size();
              return to_numpy(std::move(out), {n});
            }
            if (x.ndim() != 1)
              throw std::invalid_argument("router: x must be (hidden,) or (rows, hidden)");
            const size_t n = static_cast<size_t>(std::max(budget, 0));
            std::vector<int32_t> out(n);
            r.impl->top(x.data(), x.shape(0), budget, out.data());
            return to_numpy(std::move(out), {n});
          },
          "x"_a, "budget"_a, doc::kRouterTop);

  nb::class_<ScratchHandle>(m, "ScratchStream", doc::kScratchStream)
      .def_prop_ro("layer", [](const ScratchHandle& h) { return h.impl->layer(); })
      .def_prop_ro("banks", [](const ScratchHandle& h) { return h.impl->banks(); },
                   doc::kScratchBanks)
      .def_prop_ro(
          "chunks",
          [](const ScratchHandle& h) {
            std::vector<std::pair<std::vector<int>, std::vector<int>>> out;
            for (size_t c = 0; c < h.impl->chunks(); ++c)
              out.emplace_back(h.impl->experts(c), h.impl->rows(c));
            return out;
          },
          doc::kScratchChunks);

  nb::class_<Cache>(m, "ExpertCache", doc::kCache)
      .def(
          "__init__",
          [](Cache* self, nb::list layers, int num_experts, int expert_slots, int side_slots,
             int scratch_slots, const std::string& policy, int decay_every, bool side_lfu,
             bool sync, bool verify_checksums, bool uncached_io, int reader_threads,
             double read_timeout_s, int top_k, const std::vector<int>& layer_slots,
             const std::vector<int>& layer_side_slots, bool io_uring, int io_uring_depth,
             bool adaptive_prefetch) {
            std::vector<es::LayerSpec> specs;
            for (auto item : layers) specs.push_back(layer_from_dict(nb::cast<nb::dict>(item)));
            const es::CacheConfig c{.expert_slots = expert_slots,
                                    .layer_slots = layer_slots,
                                    .side_slots = side_slots,
                                    .layer_side_slots = layer_side_slots,
                                    .scratch_slots = scratch_slots,
                                    .policy = es::policy_from_name(policy),
                                    .top_k = top_k,
                                    .decay_every = decay_every,
                                    .side_lfu = side_lfu,
                                    .sync = sync,
                                    .verify_checksums = verify_checksums,
                                    .uncached_io = uncached_io,
                                    .reader_threads = reader_threads,
                                    .read_timeout_s = read_timeout_s,
                                    .io_uring = io_uring,
                                    .io_uring_depth = io_uring_depth,
                                    .adaptive_prefetch = adaptive_prefetch};
            new (self) Cache{std::make_shared<es::ExpertCache>(std::move(specs), num_experts, c)};
          },
          "layers"_a, "num_experts"_a, "expert_slots"_a, "side_slots"_a = kDefaults.side_slots,
          "scratch_slots"_a = kDefaults.scratch_slots,
          "policy"_a = std::string(es::policy_name(kDefaults.policy)),
          "decay_every"_a = kDefaults.decay_every, "side_lfu"_a = kDefaults.side_lfu,
          "sync"_a = kDefaults.sync, "verify_checksums"_a = kDefaults.verify_checksums,
          "uncached_io"_a = kDefaults.uncached_io, "reader_threads"_a = kDefaults.reader_threads,
          "read_timeout_s"_a = kDefaults.read_timeout_s, "top_k"_a = kDefaults.top_k,
          "layer_slots"_a = std::vector<int>{}, "layer_side_slots"_a = std::vector<int>{},
          "io_uring"_a = kDefaults.io_uring, "io_uring_depth"_a = kDefaults.io_uring_depth,
          "adaptive_prefetch"_a = kDefaults.adaptive_prefetch, doc::kInit)
      .def_prop_ro("num_layers", [](const Cache& c) { return c.impl->num_layers(); },
                   doc::kNumLayers)
      .def_prop_ro("num_experts", [](const Cache& c) { return c.impl->num_experts(); },
                   doc::kNumExperts)
      .def("rows", [](const Cache& c, int li) { return c.impl->rows(li); }, "layer"_a,
           doc::kRows)
      .def_prop_ro("layer_slots", [](const Cache& c) { return c.impl->layer_slots(); },
                   doc::kLayerSlots)
      .def_prop_ro(
          "expert_slots",
          [](const Cache& c) {
            const auto& slots = c.impl->layer_slots();
            return slots.empty() ? 0 : *std::max_element(slots.begin(), slots.end());
          },
          doc::kExpertSlots)
      .def_prop_ro("side_slots", [](const Cache& c) { return c.impl->config().side_slots; },
                   doc::kSideSlots)
      .def_prop_ro("layer_side_slots", [](const Cache& c) { return c.impl->layer_side_slots(); },
                   doc::kLayerSideSlots)
      .def_prop_ro("io_uring", [](const Cache& c) { return c.impl->io_uring(); }, doc::kIoUring)
      .def_prop_ro("scratch_slots", [](const Cache& c) { return c.impl->config().scratch_slots; },
                   doc::kScratchSlots)
      .def_prop_ro("pool_writes", [](const Cache& c) { return c.impl->pool_writes(); },
                   doc::kPoolWrites)
      .def("pool", [](const Cache& c, int li) { return c.impl->pool(li); }, "layer"_a,
           nb::sig("def pool(self, layer: int) -> list[mlx.core.array]"), doc::kPool)
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
            return std::make_pair(to_numpy(std::move(local), shape), std::move(missing));
          },
          "layer"_a, "ids"_a, doc::kAcquire)
      .def(
          "acquire_op",
          [](Cache& c, int li, const mx::array& ids, bool cpu_stream,
             std::optional<mx::array> after) {
            if (cpu_stream)
              return es::acquire_op(c.impl, li, ids, after, mx::Device(mx::Device::cpu));
            return es::acquire_op(c.impl, li, ids, after);
          },
          "layer"_a, "ids"_a, "cpu_stream"_a = false, "after"_a = nb::none(),
          nb::sig("def acquire_op(self, layer: int, ids: mlx.core.array, cpu_stream: bool = False, "
                  "after: mlx.core.array | None = None) -> mlx.core.array"),
          doc::kAcquireOp)
      .def(
          "raise_stream_error", [](Cache& c) { c.impl->raise_stream_error(); },
          doc::kRaiseStreamError)
      .def(
          "plan",
          [](Cache& c, int li, int64_t n, int top_k) { return int(c.impl->plan(li, n, top_k)); },
          "layer"_a, "n"_a, "top_k"_a, doc::kPlan)
      .def("is_complete", [](const Cache& c, int li) { return c.impl->is_complete(li); },
           "layer"_a, doc::kIsComplete)
      .def(
          "set_staging",
          [](Cache& c, bool on) {
            nb::gil_scoped_release release;
            c.impl->set_staging(on);
          },
          "on"_a,
          "Staged pool writes on (after the fills in flight landed) or off (what is staged "
          "is written now, by the host: only when no kernel of a forward is queued). Made "
          "by an AcquireMailbox, whose answers deliver what is staged.\n\nRaises:\n"
          "    RuntimeError: on without a mailbox; a failed write (off).")
      .def_prop_ro(
          "staging_slot_bytes", [](const Cache& c) { return c.impl->staging_slot_bytes(); },
          "Bytes of one staging or host-tier slot (the widest record, each segment 16-byte "
          "aligned, 256-byte slots): what a host tier is sized by.")
      .def_prop_ro(
          "staging_on", [](const Cache& c) { return c.impl->staging_on(); },
          "Whether pool writes are staged now (set_staging).")
      .def_prop_ro(
          "staged",
          [](const Cache& c) {
            auto s = c.impl->staging();
            return s ? std::make_pair(s->pending(), s->busy()) : std::make_pair(size_t{0}, 0);
          },
          "(copies pending, staging slots in use): what the next answer delivers and the "
          "slots it and the answers before it hold (0, 0 without a mailbox).")
      .def_prop_ro(
          "host_tier",
          [](const Cache& c) {
            auto s = c.impl->staging();
            return s ? std::make_tuple(s->tier_slots(), s->tier_held(), s->bytes())
                     : std::make_tuple(0, 0, size_t{0});
          },
          "(slots per MoE layer, experts held, bytes of host memory of the staging and the "
          "tier): the host-RAM tier of an AcquireMailbox ((0, 0, 0) without one).")
      .def("table", [](const Cache& c, int li) { return c.impl->table(li); }, "layer"_a,
           nb::sig("def table(self, layer: int) -> mlx.core.array"), doc::kTable)
      .def(
          "hint",
          [](Cache& c, int li, Probs probs) {
            nb::gil_scoped_release release;
            c.impl->hint(li, probs.data(), probs.size());
          },
          "layer"_a, "probs"_a, doc::kHint)
      .def(
          "fill",
          [](Cache& c, int li) {
            nb::gil_scoped_release release;
            return c.impl->fill(li);
          },
          "layer"_a, doc::kFill)
      .def(
          "load_scratch",
          [](Cache& c, int li, const std::vector<int>& experts) {
            nb::gil_scoped_release release;
            return c.impl->load_scratch(li, experts);
          },
          "layer"_a, "experts"_a, doc::kLoadScratch)
      .def(
          "layer_scratch",
          [](Cache& c, int li, int bank) {
            nb::gil_scoped_release release;
            return c.impl->layer_scratch(li, bank);
          },
          "layer"_a, "bank"_a = 0, doc::kLayerScratch)
      .def(
          "read_layer",
          [](Cache& c, int li, int bank) {
            nb::gil_scoped_release release;
            return c.impl->read_layer(li, bank);
          },
          "layer"_a, "bank"_a, doc::kReadLayer)
      .def(
          "load_whole",
          [](Cache& c, int li, int bank) {
            nb::gil_scoped_release release;
            c.impl->load_whole(li, bank);
          },
          "layer"_a, "bank"_a, doc::kLoadWhole)
      .def(
          "read_ahead",
          [](Cache& c, int li, const std::vector<int>& experts) {
            nb::gil_scoped_release release;
            return c.impl->read_ahead(li, experts);
          },
          "layer"_a, "experts"_a, doc::kReadAhead)
      .def(
          "load_layer",
          [](Cache& c, int li, const std::vector<int>& missing, const std::vector<int>& resident,
             const std::vector<int>& resident_rows) {
            nb::gil_scoped_release release;
            return c.impl->load_layer(li, missing, resident, resident_rows);
          },
          "layer"_a, "missing"_a, "resident"_a = std::vector<int>{},
          "resident_rows"_a = std::vector<int>{}, doc::kLoadLayer)
      .def(
          "scratch_stream",
          [](Cache& c, int li, std::vector<int> experts) {
            return ScratchHandle{std::make_shared<es::ScratchStream>(c.impl, li,
                                                                     std::move(experts))};
          },
          "layer"_a, "experts"_a, doc::kScratchStreamMake)
      .def(
          "scratch_step",
          [](Cache& c, const ScratchHandle& h, size_t chunk, const mx::array& rows,
             bool cpu_stream, std::optional<mx::array> after) {
            if (h.impl->cache() != c.impl)
              throw std::invalid_argument("scratch_step: the stream belongs to another cache");
            if (cpu_stream)
              return es::scratch_step_op(h.impl, chunk, rows, after, mx::Device(mx::Device::cpu));
            return es::scratch_step_op(h.impl, chunk, rows, after);
          },
          "stream"_a, "chunk"_a, "rows"_a, "cpu_stream"_a = false, "after"_a = nb::none(),
          nb::sig("def scratch_step(self, stream: ScratchStream, chunk: int, rows: mlx.core.array, "
                  "cpu_stream: bool = False, after: mlx.core.array | None = None) -> "
                  "mlx.core.array"),
          doc::kScratchStep)
      .def(
          "prefetch",
          [](Cache& c, int li, Ids ids) {
            nb::gil_scoped_release release;
            c.impl->prefetch(li, ids.data(), ids.size());
          },
          "layer"_a, "ids"_a, doc::kPrefetch)
      .def(
          "prefetch_op",
          [](Cache& c, int li, const mx::array& x, const RouterHandle& router, int budget,
             bool cpu_stream, std::optional<mx::array> after, int rows) {
            if (cpu_stream)
              return es::prefetch_op(c.impl, li, x, router.impl, budget, rows, after,
                                     mx::Device(mx::Device::cpu));
            return es::prefetch_op(c.impl, li, x, router.impl, budget, rows, after);
          },
          "layer"_a, "x"_a, "router"_a, "budget"_a, "cpu_stream"_a = false,
          "after"_a = nb::none(), "rows"_a = 1,
          nb::sig("def prefetch_op(self, layer: int, x: mlx.core.array, router: Router, "
                  "budget: int, cpu_stream: bool = False, after: mlx.core.array | None = None, "
                  "rows: int = 1) -> mlx.core.array"),
          doc::kPrefetchOp)
      .def(
          "drain",
          [](Cache& c) {
            nb::gil_scoped_release release;
            c.impl->drain();
          },
          doc::kDrain)
      .def(
          "pin",
          [](Cache& c, int li, int e) {
            nb::gil_scoped_release release;
            c.impl->pin(li, e);
          },
          "layer"_a, "expert"_a, doc::kPin)
      .def("unpin", [](Cache& c, int li, int e) { c.impl->unpin(li, e); }, "layer"_a, "expert"_a,
           doc::kUnpin)
      .def(
          "set_policy",
          [](Cache& c, const std::string& p) { c.impl->set_policy(es::policy_from_name(p)); },
          "policy"_a, doc::kSetPolicy)
      .def_prop_rw(
          "side_lfu", [](const Cache& c) { return c.impl->side_lfu(); },
          [](Cache& c, bool on) { c.impl->set_side_lfu(on); }, doc::kSideLfu)
      .def_prop_rw(
          "sync", [](const Cache& c) { return c.impl->sync(); },
          [](Cache& c, bool on) { c.impl->set_sync(on); }, doc::kSync)
      .def(
          "reset",
          [](Cache& c) {
            nb::gil_scoped_release release;
            c.impl->reset();
          },
          doc::kReset)
      .def_prop_ro("forward", [](const Cache& c) { return c.impl->forward(); }, doc::kForward)
      .def_prop_ro("inflight", [](const Cache& c) { return c.impl->inflight(); }, doc::kInflight)
      .def_prop_ro(
          "prefetch_threshold", [](const Cache& c) { return c.impl->prefetch_threshold(); },
          "The usefulness a prefetch fill must reach to be made in the forward under way: "
          "the share of a prediction rank's experts routed to (0: every side row, above 1: "
          "none). With adaptive_prefetch it is measured: decode forwards alternate between "
          "the threshold kept (kept_prefetch_threshold) and a neighbour, and the faster "
          "is kept; without, 0.")
      .def_prop_ro(
          "kept_prefetch_threshold",
          [](const Cache& c) { return c.impl->kept_prefetch_threshold(); },
          "The prefetch threshold the comparisons of forward times settled on so far "
          "(prefetch_threshold).")
      .def_prop_ro(
          "reading_seconds", [](const Cache& c) { return c.impl->reading_seconds(); },
          doc::kReadingSeconds)
      .def("check", [](const Cache& c) { return c.impl->check(); }, doc::kCheck)
      .def(
          "snapshot",
          [](const Cache& c, int li) {
            es::LayerSnapshot s;
            {
              nb::gil_scoped_release release;
              s = c.impl->snapshot(li);
            }
            size_t slots = s.slot_expert.size(), side = s.side_expert.size(), e = s.freq.size();
            nb::dict d;
            d["slot_expert"] = to_numpy(std::move(s.slot_expert), {slots});
            d["slot_state"] = to_numpy(std::move(s.slot_state), {slots});
            d["side_expert"] = to_numpy(std::move(s.side_expert), {side});
            d["side_state"] = to_numpy(std::move(s.side_state), {side});
            d["freq"] = to_numpy(std::move(s.freq), {e});
            d["stats"] = stats_dict(s.stats);
            d["prefetch_degree"] = s.prefetch_degree;
            return d;
          },
          "layer"_a, doc::kSnapshot)
      .def(
          "inject_fault",
          [](Cache& c, int li, const std::string& kind, int expert, int count, int delay_ms) {
            c.impl->inject_fault(li, es::fault_from_name(kind), expert, count, delay_ms);
          },
          "layer"_a, "kind"_a, "expert"_a = -1, "count"_a = 1, "delay_ms"_a = 0, doc::kInjectFault);

  using Box = es::AcquireMailbox;
  nb::class_<MailboxHandle>(m, "AcquireMailbox", doc::kMailbox)
      .def(
          "__init__",
          [](MailboxHandle* self, const Cache& cache, int hidden, int max_ids, int fill_slots,
             int tier_slots, int x_rows) {
            new (self) MailboxHandle{std::make_unique<Box>(cache.impl, hidden, max_ids,
                                                           fill_slots, tier_slots, x_rows)};
          },
          "cache"_a, "hidden"_a, "max_ids"_a, "fill_slots"_a, "tier_slots"_a = 0, "x_rows"_a = 1)
      .def_ro_static("REQUEST", &Box::kRequest, "Word of the latest request's sequence number.")
      .def_ro_static("REPLY", &Box::kReply, "Word of the latest answered sequence number.")
      .def_ro_static("LAYER", &Box::kLayer, "Word of the request's MoE layer.")
      .def_ro_static("COUNT", &Box::kCount, "Word of the request's number of ids.")
      .def_ro_static("X_ROWS", &Box::kXRows,
                     "Word: the rows of hidden state the request carries (0: none).")
      .def_ro_static("ROW_COPIES", &Box::kRowCopies, "Word: the answer's row copies.")
      .def_ro_static("RECORD_COPIES", &Box::kRecordCopies, "Word: the answer's record copies.")
      .def_ro_static("CHUNKS", &Box::kChunks, "Word: the record copies' chunks in all.")
      .def_ro_static("FAST", &Box::kFast,
                     "Word: 1 when the kernel took the rows from the hit table and does not "
                     "wait for the answer.")
      .def_ro_static("IDS", &Box::kIds, "First word of the ids (int32).")
      .def_ro_static("ROWS", &Box::kRows, "First word of the rows (int32).")
      .def_ro_static("HIDDEN", &Box::kHidden,
                     "First word of the hidden states ((rows, hidden) float32, row-major).")
      .def_ro_static("MAX_IDS", &Box::kMaxIds, "The most ids a mailbox's max_ids allows.")
      .def_ro_static("CHUNK_BYTES", &es::StagedCopies::kChunkBytes,
                     "Bytes of a record copy's chunk (the last one of a copy may be short).")
      .def_prop_ro(
          "max_ids", [](const MailboxHandle& b) { return b.impl->max_ids(); },
          "The most ids of one request.")
      .def_prop_ro(
          "x_rows", [](const MailboxHandle& b) { return b.impl->x_rows(); },
          "The most rows of hidden state one request carries.")
      .def_prop_ro(
          "copies_address", [](const MailboxHandle& b) { return b.impl->copies_address(); },
          "The device address of the answer's copies: (src, dst, bytes, first_chunk) uint64 "
          "each, row copies first.")
      .def_prop_rw(
          "fill_stream", [](const MailboxHandle& b) { return b.impl->fill_stream(); },
          [](MailboxHandle& b, bool on) { b.impl->set_fill_stream(on); },
          "Whether the thread queues prefetch fills on a CUDA stream of their own after each "
          "request, copied by the device's copy engines beside the compute (False, the "
          "default: they go with the next answer that is waited for). Set False, the "
          "batches in flight still land.")
      .def_prop_ro(
          "fill_batches", [](const MailboxHandle& b) { return b.impl->fill_batches(); },
          "(batches, copies): fill batches queued on the fill stream since creation, and "
          "the copies in them (a record segment each, before merging).")
      .def_prop_ro(
          "address", [](const MailboxHandle& b) { return b.impl->device_address(); },
          "The address kernels write to (the device pointer of the mapped memory).")
      .def_prop_ro(
          "mapped", [](const MailboxHandle& b) { return b.impl->mapped(); },
          "Whether the memory is mapped for the pools' CUDA device.")
      .def_prop_ro(
          "hidden", [](const MailboxHandle& b) { return b.impl->hidden(); },
          "The hidden size (floats) of a request's hidden state.")
      .def_prop_ro(
          "hit_table_address",
          [](const MailboxHandle& b) { return b.impl->hit_table_address(); },
          "The device address of the cache's hit table: (MoE layers, experts) int32, the "
          "real slot a kernel may take without asking, else -1 (ExpertCache::"
          "hit_table_address in ext/expert_cache.h).")
      .def_prop_ro(
          "answered", [](const MailboxHandle& b) { return b.impl->answered(); },
          "Requests answered since creation.")
      .def_prop_ro(
          "fast_answers", [](const MailboxHandle& b) { return b.impl->fast_answers(); },
          "Requests answered since creation that were posted FAST: rows from the hit "
          "table, not waited for.")
      .def_prop_ro(
          "delivered", [](const MailboxHandle& b) { return b.impl->delivered(); },
          "(in order, at once): the pool copies its answers have delivered since creation, "
          "row copies made one after another by the acquire kernel (where a copy of the "
          "same answer writes what one reads or writes) and copies made all at once by "
          "the copy kernel's blocks (records, and row copies that need no order).")
      .def(
          "wait",
          [](const MailboxHandle& b) {
            nb::gil_scoped_release release;
            b.impl->wait();
          },
          "Waits until the mailbox's thread has answered every request posted so far "
          "(the cache's set_staging(False) and reset() do first).")
      .def_prop_ro(
          "answer_seconds", [](const MailboxHandle& b) { return b.impl->answer_seconds(); },
          "Seconds the mailbox's thread spent answering since creation, from reading a "
          "request to publishing its reply: what a posting kernel waits beyond the "
          "hand-offs (the prefetch after a reply is not counted).")
      .def_prop_ro(
          "sequence", [](const MailboxHandle& b) { return b.impl->sequence(); },
          "(request, reply): the sequence numbers of the latest request and the latest "
          "answer; equal when no request waits.")
      .def(
          "set_prefetch",
          [](MailboxHandle& b, int source, const std::vector<int>& targets,
             const std::vector<RouterHandle>& routers, int budget) {
            std::vector<std::shared_ptr<const es::Router>> impls;
            for (const auto& r : routers) impls.push_back(r.impl);
            b.impl->set_prefetch(source, targets, impls, budget);
          },
          "source"_a, "targets"_a, "routers"_a, "budget"_a, doc::kMailboxSetPrefetch)
      .def(
          "post",
          [](MailboxHandle& b, int layer, Ids ids, std::optional<Probs> x) {
            int x_rows = 1;
            if (x) {
              const int hidden = b.impl->hidden();
              const bool shaped = (x->ndim() == 1 && static_cast<int>(x->shape(0)) == hidden) ||
                                  (x->ndim() == 2 && static_cast<int>(x->shape(1)) == hidden);
              if (!shaped)
                throw std::invalid_argument("x must be (hidden,) or (rows, hidden) float32 "
                                            "with hidden " + std::to_string(hidden));
              if (x->ndim() == 2) x_rows = static_cast<int>(x->shape(0));
            }
            std::vector<int32_t> rows;
            {
              nb::gil_scoped_release release;
              rows = b.impl->post(layer, ids.data(), static_cast<int>(ids.size()),
                                  x ? x->data() : nullptr, x_rows);
            }
            const size_t n = rows.size();
            return to_numpy(std::move(rows), {n});
          },
          "layer"_a, "ids"_a, "x"_a = nb::none(), doc::kMailboxPost);
}
