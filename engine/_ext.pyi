"""
ExpertStream native core: blob I/O, reader pool, real region, side region.
"""

from collections.abc import Sequence
from typing import Annotated, Final

import mlx.core
import numpy
from numpy.typing import NDArray


def record_crc32(data: bytes) -> int:
    """
    zlib's crc32 of `data`, as the cache checks every record it reads (the manifest's checksums): buffers of at least 1 MiB are split in 256 KiB chunks checked on helper threads and joined with crc32_combine. Returns an int in [0, 2**32).
    """

def io_uring_depth(reader_threads: int, top_k: int, stride: int) -> int:
    """
    Demand reads in flight through io_uring for a cache of
    `reader_threads` reader threads, `top_k` experts per token and records of `stride` bytes
    (one read buffer each): reader_threads + 1, raised to max(top_k, 8) while the buffers stay
    within 64 MiB, so that a token's misses of a layer go in one submission and small records
    get the queue depth the disk needs. What ExpertCache uses when its io_uring_depth is 0.
    """

def planned_bytes(rows: Sequence[int], record_bytes: Sequence[int], num_experts: int, reader_threads: int, stride: int, io_uring_depth: int) -> int:
    """
    Bytes an ExpertCache allocates: for each MoE layer `rows[i]` pool
    rows of `record_bytes[i]` bytes and an expert table of `num_experts` int32, plus a read
    buffer of `stride` bytes per reader thread and, where `io_uring_depth` > 0, the io_uring
    region of that many buffers (each rounded as the cache allocates it: whole pages, huge
    pages from 1 MiB on, the region at least 2 MiB). 0 for no layer.

    Raises:
        ValueError: rows and record_bytes differ in length.
    """

def staging_slot_size(record_bytes: int, segments: int) -> int:
    """
    Bytes of one staging or host-tier slot that holds a record of `record_bytes` bytes in `segments` segments (each 16-byte aligned, slots 256-byte aligned): what a host tier is sized by, per slot of its widest record.
    """

def crc32_implementation() -> str:
    """
    Which library computes record checksums: "libdeflate" where the build found it, else "zlib" (the same values; libdeflate is several times faster).
    """

DTYPE_NAMES: tuple = ...

STAT_KEYS: tuple = ...

POLICY_NAMES: tuple = ('predictive', 'lfu', 'lru', 'lfu-da', 's3-fifo')

SLOT_EMPTY: int = 0

SLOT_RESIDENT: int = 1

SLOT_PINNED: int = 2

SLOT_LOADING: int = 3

SLOT_JUST_LOADED: int = 4

ROW_FREE: int = 0

ROW_IN_FLIGHT: int = 1

ROW_PUBLISHED: int = 2

NO_ROW: int = 255

PLAN_TABLE: int = 0

PLAN_STREAM: int = 1

PLAN_SYNC: int = 2

class ExpertReadError(OSError):
    pass

class ChecksumError(ExpertReadError):
    pass

class ExpertReadTimeout(ExpertReadError):
    pass

class ResourceError(OSError):
    pass

class Router:
    """
    A dense copy of one MoE layer's router for the prefetch prediction:
    logits = weight @ x + bias, with weight kept as bfloat16 (num_experts x hidden x 2
    bytes) and float32 bias and sums. It only ranks experts; the model's own routing is
    never replaced.

    Args:
        weight: (num_experts, hidden) float32 numpy array.
        bias: (num_experts,) float32 numpy array.

    Raises:
        ValueError: empty or mismatched shapes.
    """

    def __init__(self, weight: Annotated[NDArray[numpy.float32], dict(shape=(None, None), order='C', device='cpu', writable=False)], bias: Annotated[NDArray[numpy.float32], dict(shape=(None,), order='C', device='cpu', writable=False)]) -> None: ...

    @property
    def num_experts(self) -> int: ...

    @property
    def hidden(self) -> int: ...

    def top(self, x: Annotated[NDArray[numpy.float32], dict(order='C', device='cpu', writable=False)], budget: int) -> NDArray[numpy.int32]:
        """
        The `budget` experts of highest logit for hidden state `x`
        ((hidden,) float32 numpy array), highest first (ties: lower expert id first; NaN logits
        last), as an int32 numpy array. For (rows, hidden) x (a decode step's replies): each
        row's top `budget` merged rank by rank (every row's best, then every row's second, ...),
        an expert once, at most rows x budget of them.

        Raises:
            ValueError: x is not (hidden,) or (rows, hidden) with rows >= 1, or budget not in
                [1, num_experts].
        """

class ScratchStream:
    """
    The misses of one over-capacity call streamed through the scratch rows
    in banks (two when scratch_slots >= 2: the first ceil(scratch_slots / 2) rows and the
    rest; else one), the reads of the next chunk in flight while the current one computes.
    Made by ExpertCache.scratch_stream; each chunk's place in the graph is scratch_step. Its
    own thread reads the chunks in order (load_scratch: io_uring or the reader threads,
    checksums, timeouts, empty real slots filled, counters), from the first step on.
    """

    @property
    def layer(self) -> int: ...

    @property
    def banks(self) -> int:
        """
        How many banks the scratch rows are split into: 2, or 1 when
        scratch_slots is 1 (each chunk's read then waits for the previous chunk's compute).
        """

    @property
    def chunks(self) -> list[tuple[list[int], list[int]]]:
        """
        Per chunk, in order: (experts, rows), the chunk's experts (the
        misses in acquire's order) and the pool row each is read into (int lists).
        """

class ExpertCache:
    """
    The expert cache of one store: per MoE layer a pool of rows (real region,
    two side-region banks, scratch rows), the reader pool, the side ledgers and the counters.

    Thread safety: acquire, acquire_op, load_scratch, pin/unpin and reset belong to one
    thread at a time (the generation thread, or the MLX stream that evaluates acquire_op);
    a ScratchStream's thread runs load_scratch on the layer it streams meanwhile; snapshot,
    check, the properties and the live toggles may be used from any thread.
    """

    def __init__(self, layers: list, num_experts: int, expert_slots: int, side_slots: int = 0, scratch_slots: int = 1, policy: str = 'predictive', decay_every: int = 256, side_lfu: bool = True, sync: bool = False, verify_checksums: bool = True, uncached_io: bool = True, reader_threads: int = 2, read_timeout_s: float = 30.0, top_k: int = 0, layer_slots: Sequence[int] = [], layer_side_slots: Sequence[int] = [], io_uring: bool = True, io_uring_depth: int = 0, adaptive_prefetch: bool = True) -> None:
        """
        Opens the blob files and allocates every pool.

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
            ExpertReadError: a blob file cannot be opened or has the wrong size.
        """

    @property
    def num_layers(self) -> int:
        """MoE layers (pools)."""

    @property
    def num_experts(self) -> int:
        """Experts per MoE layer (records per blob)."""

    def rows(self, layer: int) -> int:
        """
        Pool rows of MoE layer `layer`: its real slots + 2 * its side slots + scratch_slots.
        """

    @property
    def layer_slots(self) -> list[int]:
        """Real-region slots of each MoE layer (list of int, in MoE order)."""

    @property
    def expert_slots(self) -> int:
        """Real-region slots of the largest MoE layer (layer_slots: each's)."""

    @property
    def side_slots(self) -> int:
        """
        Side-region rows per bank (two banks), and experts per prediction (layer_side_slots: each layer's rows).
        """

    @property
    def layer_side_slots(self) -> list[int]:
        """
        Side-region rows per bank of each MoE layer (list of int, in MoE order).
        """

    @property
    def io_uring(self) -> bool:
        """
        Whether demand reads go through io_uring (asked for, and the kernel has it); else they use the reader threads.
        """

    @property
    def scratch_slots(self) -> int:
        """Scratch rows per layer: experts per chunk of an over-capacity call."""

    @property
    def pool_writes(self) -> str:
        """
        How records reach the pools: "memcpy" (host memory, unified memory), or "cuda" (MLX CUDA's managed memory, written with cudaMemcpyAsync so its pages stay on the GPU).
        """

    def pool(self, layer: int) -> list[mlx.core.array]:
        """
        The pool arrays of MoE layer `layer`, one per segment in record order, each
        shaped (rows, *segment shape) with the segment's dtype. They share memory with the
        cache: rows change as experts are loaded, so read them only through the rows acquire
        returns, in the same forward.

        Raises:
            IndexError: `layer` is not in [0, num_layers).
        """

    def acquire(self, layer: int, ids: Annotated[NDArray[numpy.int32], dict(order='C', device='cpu', writable=False)]) -> tuple[NDArray[numpy.int32], list[int]]:
        """
        Maps the expert ids of one MoE layer call to pool rows: real hit, side hit
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
            ExpertReadError: a demand read failed (ChecksumError, ExpertReadTimeout).
        """

    def acquire_op(self, layer: int, ids: mlx.core.array, cpu_stream: bool = False, after: mlx.core.array | None = None) -> mlx.core.array:
        """
        Lazy int32 pool rows of `ids` for MoE layer `layer`, mapped by the cache
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
            next raise_stream_error() or plan().
        """

    def raise_stream_error(self) -> None:
        """
        Raises (and clears) the first error of a stream-ordered acquire
        since the last call: ExpertReadError, ChecksumError, ExpertReadTimeout or RuntimeError.
        Call it after evaluating a forward that used acquire_op, before using its result.
        """

    def plan(self, layer: int, n: int, top_k: int) -> int:
        """
        How the next call of MoE layer `layer` with `n` expert ids (`top_k` per
        token) gets its pool rows, after raising a pending stream error (see
        raise_stream_error).

        Returns:
            PLAN_TABLE: table(layer)[ids] on the device, the layer being complete (a one-token
            call's top_k hits are counted now, a longer call's not at all); PLAN_STREAM:
            acquire_op, n being at most expert_slots - pinned; PLAN_SYNC: acquire on host ids,
            with over-capacity misses through a ScratchStream or the layer scratch.

        Raises:
            IndexError: `layer` out of range.
            ExpertReadError (and subclasses), RuntimeError: a pending stream error.
        """

    def is_complete(self, layer: int) -> bool:
        """
        Whether every expert of MoE layer `layer` has a real slot (as plan()
        last found it); a complete layer can never miss, so nothing of it is worth prefetching.

        Raises:
            IndexError: `layer` out of range.
        """

    def set_staging(self, on: bool) -> None:
        """
        Staged pool writes on (after the fills in flight landed) or off (what is staged is written now, by the host: only when no kernel of a forward is queued). Made by an AcquireMailbox, whose answers deliver what is staged.

        Raises:
            RuntimeError: on without a mailbox; a failed write (off).
        """

    @property
    def staging_slot_bytes(self) -> int:
        """
        Bytes of one staging or host-tier slot (the widest record, each segment 16-byte aligned, 256-byte slots): what a host tier is sized by.
        """

    @property
    def staging_on(self) -> bool:
        """Whether pool writes are staged now (set_staging)."""

    @property
    def staged(self) -> tuple[int, int]:
        """
        (copies pending, staging slots in use): what the next answer delivers and the slots it and the answers before it hold (0, 0 without a mailbox).
        """

    @property
    def host_tier(self) -> tuple[int, int, int]:
        """
        (slots per MoE layer, experts held, bytes of host memory of the staging and the tier): the host-RAM tier of an AcquireMailbox ((0, 0, 0) without one).
        """

    def table(self, layer: int) -> mlx.core.array:
        """
        (num_experts,) int32 mx.array: expert -> real slot of MoE layer `layer`,
        valid while plan() returns PLAN_TABLE.

        Raises:
            IndexError: `layer` out of range.
        """

    def hint(self, layer: int, probs: Annotated[NDArray[numpy.float32], dict(order='C', device='cpu', writable=False)]) -> None:
        """
        Router probabilities of the tokens the next acquire of `layer` routes.

        Args:
            layer: MoE layer index.
            probs: float32 softmax over the experts, (num_experts,) or (tokens, num_experts),
                each in [0, 1].

        Evidence for the predictive eviction policy (which unchosen experts were close), used by
        that acquire only and only when it routes one token.

        Raises:
            ValueError: probs is not a multiple of num_experts values, or a value is outside
                [0, 1].
            IndexError: layer out of range.
        """

    def fill(self, layer: int) -> int:
        """
        Reads every expert of MoE layer `layer` that has no real slot into a free
        one; the layer is then complete (is_complete() from the next plan()). Counts loads,
        bytes_read and read_seconds, not misses. Same thread rule as acquire.

        Returns:
            The number of experts read.

        Raises:
            IndexError: `layer` out of range.
            ValueError: the layer's real region does not hold every expert.
            ExpertReadError (and subclasses): a read failed (the experts that landed stay).
        """

    def load_scratch(self, layer: int, experts: Sequence[int]) -> list[int]:
        """
        Reads `experts` (at most scratch_slots of the `missing` list of
        acquire) into the scratch rows of MoE layer `layer`. While the real region has empty
        slots, each expert read is also copied into one (no second read), so a prompt that
        overflows a cold cache leaves its most-routed experts resident for decode.

        Returns:
            The scratch row of each expert, in order.

        Precondition: the previous chunk's computation has been evaluated (its rows are reused).

        Raises:
            ValueError: more experts than scratch_slots.
            IndexError: `layer` or an expert out of range.
            ExpertReadError: a read failed.
        """

    def layer_scratch(self, layer: int, bank: int = 0) -> list[mlx.core.array]:
        """
        Bank `bank` (0 or 1) of the layer scratch that MoE layer `layer`'s
        over-capacity calls use where the pools are device memory (`load_layer` uses bank 0,
        `load_whole` both in turn): per segment key, in the store's order, an array
        (num_experts, *segment shape), shared by every layer of the same segment layout and
        allocated on first use, with as many records of page-locked host staging.

        Raises:
            IndexError: `layer` out of range, or a bank other than 0 and 1.
            MemoryError: it cannot be allocated (naming the bytes).
        """

    def read_layer(self, layer: int, bank: int) -> int:
        """
        Starts reading every expert of MoE layer `layer` that has no real
        slot and is not in the host tier into bank `bank`'s staging, each in the row of its id,
        on the reader threads behind demand reads (a long prompt's next call: `load_whole`); an
        earlier read-ahead of that bank not yet taken is given up.

        Returns:
            How many records it started reading.

        Raises:
            IndexError: `layer` out of range, or a bank other than 0 and 1.
        """

    def load_whole(self, layer: int, bank: int) -> None:
        """
        Puts every expert of MoE layer `layer` in the row of its id of bank
        `bank` of its layer scratch, so that a long prompt's call computes on it with the router's
        ids as rows, never reading them on the host: records read by `read_layer` (waited for as
        demand reads are), from the host tier, or read now, uploaded in runs of consecutive rows;
        resident experts copied from their slots. Empty real slots take experts in id order.
        Counts loads, bytes and read time, not lookups.

        Precondition: every computation that read this bank before has been evaluated; the device
        may be computing on the other bank.

        Raises:
            IndexError: `layer` out of range, or a bank other than 0 and 1.
            ExpertReadError: a read failed (ChecksumError, ExpertReadTimeout).
        """

    def read_ahead(self, layer: int, experts: Sequence[int]) -> int:
        """
        Starts reading `experts` (int ids, the misses predicted for the
        next over-capacity call of MoE layer `layer`) into its layer scratch's host staging on the
        reader threads, behind demand reads; experts with a real slot, or in the host tier, are
        left out, and an earlier read-ahead not yet taken by `load_layer` is given up.

        Returns:
            How many records it started reading.

        Raises:
            IndexError: `layer` or an expert out of range.
        """

    def load_layer(self, layer: int, missing: Sequence[int], resident: Sequence[int] = [], resident_rows: Sequence[int] = []) -> list[int]:
        """
        Puts every expert of an over-capacity call of MoE layer `layer`
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
            ExpertReadError: a read failed (ChecksumError, ExpertReadTimeout).
        """

    def scratch_stream(self, layer: int, experts: Sequence[int]) -> ScratchStream:
        """
        A ScratchStream for `experts` (acquire's `missing` of MoE
        layer `layer`). Reads nothing until its first step is evaluated.

        Raises:
            IndexError: `layer` or an expert out of range.
        """

    def scratch_step(self, stream: ScratchStream, chunk: int, rows: mlx.core.array, cpu_stream: bool = False, after: mlx.core.array | None = None) -> mlx.core.array:
        """
        Lazy int32 `rows` (the pool rows of the pairs chunk `chunk` of
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
            raised by the next raise_stream_error() or plan().
        """

    def prefetch(self, layer: int, ids: Annotated[NDArray[numpy.int32], dict(order='C', device='cpu', writable=False)]) -> None:
        """
        Reserves side rows of MoE layer `layer` for the predicted experts `ids`
        (int32 C-contiguous numpy array, any shape) and starts their reads on the reader pool
        (inline in sync mode). A failed fill only costs a later demand read.

        Raises:
            IndexError: `layer` out of range.
        """

    def prefetch_op(self, layer: int, x: mlx.core.array, router: Router, budget: int, cpu_stream: bool = False, after: mlx.core.array | None = None, rows: int = 1) -> mlx.core.array:
        """
        Lazy uint8 scalar that, when evaluated, ranks the experts of MoE
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
                another expert count, budget out of range, or rows < 1 (each naming the layer).
        """

    def drain(self) -> None:
        """
        Cancels queued prefetch fills and waits for started ones. A fill still
        reading after read_timeout seconds without any fill finishing is given up: its row is
        freed and
        the expert left to a later demand read.
        """

    def pin(self, layer: int, expert: int) -> None:
        """
        Pins `expert` of MoE layer `layer` in the real region (reading it if it is not
        resident); eviction never takes a pinned slot.

        Raises:
            IndexError: `layer` or `expert` out of range.
            ValueError: pinning it would leave no evictable slot (at most expert_slots - 1 pins).
            RuntimeError: every evictable slot is being loaded by other calls (pin again once
                they have landed).
            ExpertReadError: the read failed (the expert stays unpinned).
        """

    def unpin(self, layer: int, expert: int) -> None:
        """
        Unpins `expert` of MoE layer `layer` (it stays resident, evictable).
        Unpinning an expert that is not pinned does nothing. Precondition: 0 <= expert <
        num_experts.

        Raises:
            IndexError: `layer` out of range.
        """

    def set_policy(self, policy: str) -> None:
        """
        Sets the real-region eviction policy of every layer: "predictive", "lfu",
        "lru", "lfu-da" or "s3-fifo".

        Raises:
            ValueError: another name.
        """

    @property
    def side_lfu(self) -> bool:
        """
        Persistent LFU side region (True) or double buffer (False); a change applies at the next forward boundary, after a drain.
        """

    @side_lfu.setter
    def side_lfu(self, arg: bool, /) -> None: ...

    @property
    def sync(self) -> bool:
        """
        Run prefetch fills inline where they are submitted (from the next submission).
        """

    @sync.setter
    def sync(self, arg: bool, /) -> None: ...

    def reset(self) -> None:
        """
        Drains, then empties every real region (pins and frequencies too) and side ledger.
        """

    @property
    def forward(self) -> int:
        """Forward passes begun so far."""

    @property
    def inflight(self) -> int:
        """Prefetch fills in flight, all layers."""

    @property
    def prefetch_threshold(self) -> float:
        """
        The usefulness a prefetch fill must reach to be made in the forward under way: the share of a prediction rank's experts routed to (0: every side row, above 1: none). With adaptive_prefetch it is measured: decode forwards alternate between the threshold kept (kept_prefetch_threshold) and a neighbour, and the faster is kept; without, 0.
        """

    @property
    def kept_prefetch_threshold(self) -> float:
        """
        The prefetch threshold the comparisons of forward times settled on so far (prefetch_threshold).
        """

    @property
    def reading_seconds(self) -> float:
        """
        Wall time, in seconds, during which at least one record read of this cache was in flight (demand reads, prefetch fills and scratch streams of every layer, reads that overlap counted once): bytes_read over it is the read rate while reading, the figure a disk's own sequential rate (dd) compares with.
        """

    def check(self) -> str:
        """
        The first inconsistency found in any real region or side ledger, or an empty string when all are consistent (a test and debugging aid).
        """

    def snapshot(self, layer: int) -> dict:
        """
        The state of MoE layer `layer`, copied under the cache's lock (any
        thread).

        Returns:
            dict: slot_expert (expert_slots,) int32 (-1: empty); slot_state (expert_slots,)
            uint8 SLOT_* codes; side_expert (2 * its side slots,) int32, bank 0 then bank 1;
            side_state (2 * its side slots,) uint8 ROW_* codes; freq (num_experts,) float32 LFU
            frequencies; stats, a dict of the counters STAT_KEYS names (int; the *_seconds ones
            float seconds); prefetch_degree (int), the experts of a prediction for the layer
            that are filled now (at most its side slots; see prefetch_threshold).

        Raises:
            IndexError: `layer` out of range.
        """

    def inject_fault(self, layer: int, kind: str, expert: int = -1, count: int = 1, delay_ms: int = 0) -> None:
        """
        Test hook: makes the next `count` reads of `expert` (-1: any) of MoE
        layer `layer` fail as `kind`: "none" (clears), "eio", "short_read", "corrupt" (a
        checksum mismatch) or "delay" (waits `delay_ms` first).

        Raises:
            ValueError: an unknown kind.
        """

class AcquireMailbox:
    """
    The acquire mailbox of a cache on a CUDA device (ext/mailbox.h).

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
            map the memory.
    """

    def __init__(self, cache: ExpertCache, hidden: int, max_ids: int, fill_slots: int, tier_slots: int = 0, x_rows: int = 1) -> None: ...

    REQUEST: Final[int] = ...
    """Word of the latest request's sequence number."""

    REPLY: Final[int] = ...
    """Word of the latest answered sequence number."""

    LAYER: Final[int] = ...
    """Word of the request's MoE layer."""

    COUNT: Final[int] = ...
    """Word of the request's number of ids."""

    X_ROWS: Final[int] = ...
    """Word: the rows of hidden state the request carries (0: none)."""

    ROW_COPIES: Final[int] = ...
    """Word: the answer's row copies."""

    RECORD_COPIES: Final[int] = ...
    """Word: the answer's record copies."""

    CHUNKS: Final[int] = ...
    """Word: the record copies' chunks in all."""

    FAST: Final[int] = ...
    """
    Word: 1 when the kernel took the rows from the hit table and does not wait for the answer.
    """

    IDS: Final[int] = ...
    """First word of the ids (int32)."""

    ROWS: Final[int] = ...
    """First word of the rows (int32)."""

    HIDDEN: Final[int] = ...
    """First word of the hidden states ((rows, hidden) float32, row-major)."""

    MAX_IDS: Final[int] = ...
    """The most ids a mailbox's max_ids allows."""

    CHUNK_BYTES: Final[int] = ...
    """Bytes of a record copy's chunk (the last one of a copy may be short)."""

    @property
    def max_ids(self) -> int:
        """The most ids of one request."""

    @property
    def x_rows(self) -> int:
        """The most rows of hidden state one request carries."""

    @property
    def copies_address(self) -> int:
        """
        The device address of the answer's copies: (src, dst, bytes, first_chunk) uint64 each, row copies first.
        """

    @property
    def fill_stream(self) -> bool:
        """
        Whether the thread queues prefetch fills on a CUDA stream of their own after each request, copied by the device's copy engines beside the compute (False, the default: they go with the next answer that is waited for). Set False, the batches in flight still land.
        """

    @fill_stream.setter
    def fill_stream(self, arg: bool, /) -> None: ...

    @property
    def fill_batches(self) -> tuple[int, int]:
        """
        (batches, copies): fill batches queued on the fill stream since creation, and the copies in them (a record segment each, before merging).
        """

    @property
    def address(self) -> int:
        """
        The address kernels write to (the device pointer of the mapped memory).
        """

    @property
    def mapped(self) -> bool:
        """Whether the memory is mapped for the pools' CUDA device."""

    @property
    def hidden(self) -> int:
        """The hidden size (floats) of a request's hidden state."""

    @property
    def hit_table_address(self) -> int:
        """
        The device address of the cache's hit table: (MoE layers, experts) int32, the real slot a kernel may take without asking, else -1 (ExpertCache::hit_table_address in ext/expert_cache.h).
        """

    @property
    def answered(self) -> int:
        """Requests answered since creation."""

    @property
    def fast_answers(self) -> int:
        """
        Requests answered since creation that were posted FAST: rows from the hit table, not waited for.
        """

    @property
    def delivered(self) -> tuple[int, int]:
        """
        (in order, at once): the pool copies its answers have delivered since creation, row copies made one after another by the acquire kernel (where a copy of the same answer writes what one reads or writes) and copies made all at once by the copy kernel's blocks (records, and row copies that need no order).
        """

    def wait(self) -> None:
        """
        Waits until the mailbox's thread has answered every request posted so far (the cache's set_staging(False) and reset() do first).
        """

    @property
    def answer_seconds(self) -> float:
        """
        Seconds the mailbox's thread spent answering since creation, from reading a request to publishing its reply: what a posting kernel waits beyond the hand-offs (the prefetch after a reply is not counted).
        """

    @property
    def sequence(self) -> tuple[int, int]:
        """
        (request, reply): the sequence numbers of the latest request and the latest answer; equal when no request waits.
        """

    def set_prefetch(self, source: int, targets: Sequence[int], routers: Sequence[Router], budget: int) -> None:
        """
        What the thread prefetches after a request of MoE layer
        `source` that carries hidden states: for each of `targets` (MoE layers), the Router at the
        same position ranks the experts for each row, and ExpertCache.prefetch takes the top
        `budget` of every row, rank by rank (each row's best, then each row's second, ...), an
        expert once. Replaces the layer's earlier plan; empty lists: none.

        Raises:
            IndexError: a layer out of range.
            ValueError: lengths differ, a router of another hidden size or expert count, or budget
                outside [1, experts] with targets given.
        """

    def post(self, layer: int, ids: Annotated[NDArray[numpy.int32], dict(order='C', device='cpu', writable=False)], x: Annotated[NDArray[numpy.float32], dict(order='C', device='cpu', writable=False)] | None = None) -> NDArray[numpy.int32]:
        """
        Posts a request as the kernel does and returns its rows.

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
                in [1, x_rows].
        """
