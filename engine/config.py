"""The one configuration object of a streamed model.

Every knob of the expert cache lives in `StreamConfig`. Front ends build it from their
flags and environment variables with `engine.flags`; nothing else reads the
environment.
"""

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from engine.memory import human_bytes

# Real-region eviction policies of the native cache (ext/real_region.h says what each
# does); the first is the default.
EVICTION_POLICIES = ("predictive", "lfu", "lru", "lfu-da", "s3-fifo")
EXPERT_MAJOR = ("auto", "on", "off")

# The longest read timeout, seconds (a day; the native cache refuses longer ones too).
MAX_READ_TIMEOUT_S = 86400

# More reader threads than this only add stacks: the disk's queue is full long before.
MAX_READER_THREADS = 256

# "auto" budgets (expert_memory, host_memory): at most this fraction of the memory the
# load has not yet planned (`engine.memory_plan.auto_bytes`, the one rule).
AUTO_MEMORY_FRACTION = 0.5

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
# A bare K, M, G or T is binary, as dd, docker, systemd and ulimit read it: 10G is 10 GiB.
BARE_UNITS = {"k": "KiB", "m": "MiB", "g": "GiB", "t": "TiB"}
_UNITS.update({bare: _UNITS[unit.lower()] for bare, unit in BARE_UNITS.items()})


class MemorySize(int):
    """A number of bytes parsed from a size as the user wrote it: `str()` gives that text
    ("50MiB"), so a message about the value quotes it as typed."""

    def __new__(cls, value: int, text: str):
        size = super().__new__(cls, value)
        size.text = text
        return size

    def __str__(self) -> str:
        return self.text

    def __getnewargs__(self):
        return int(self), self.text


def parse_memory(text: str) -> MemorySize | str:
    """A memory size as users write it: "6GiB", "512 MiB", "8GB" (powers of 1000),
    "10G" (a bare K, M, G, T: powers of 1024, `BARE_UNITS`), "1073741824" (bytes), or
    "auto". Returns bytes (a `MemorySize`: an int whose str is `text`), or "auto".

    Raises:
        ValueError: not a size with one of the units B, KB, MB, GB, TB, KiB, MiB, GiB,
            TiB, K, M, G, T, or a size that is not > 0 (the message quotes the text).
    """
    t = str(text).strip().lower()
    if t == "auto":
        return "auto"
    number = t.rstrip("abcdefghijklmnopqrstuvwxyz ").strip()
    unit = t[len(number) :].strip()
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if unit not in _UNITS or not math.isfinite(value):
        raise ValueError(
            f"{text!r} is not a memory size (e.g. 6GiB, 512MiB, 8GB, 10G for 10 GiB, or auto)"
        )
    if int(value * _UNITS[unit]) < 1:
        raise ValueError(f"must be > 0, got {str(text).strip()!r}")
    return MemorySize(int(value * _UNITS[unit]), str(text).strip())


# Prompt tokens per forward of a prefill (mlx-lm's default `prefill_step_size`).
PREFILL_STEP_SIZE = 2048


def size_words(size: MemorySize) -> str:
    """How a parsed size was read, for the line that reports it: "10G (read as 10 GiB:
    10.7 GB)" for a bare unit, "6GiB (6.4 GB)" otherwise, "1000000 (1.0 MB)" for bytes."""
    text = str(size)
    unit = text.lower().rstrip().lstrip("0123456789. ")
    if unit in BARE_UNITS:
        number = text.strip()[: -len(unit)].strip()
        return f"{text} (read as {number} {BARE_UNITS[unit]}: {human_bytes(size)})"
    return f"{text} ({human_bytes(size)})"


class ConfigError(ValueError):
    """A setting out of range: `field` (a StreamConfig field, or "temperature" /
    "top_p"), its `value`, and `what` it must be; or, with `also`, two fields given
    together that exclude each other. Front ends name the fields their own way
    (`engine.flags.describe`)."""

    def __init__(self, field: str, value, what: str, also: str | None = None):
        message = (
            f"{field} and {also} are both set: {what}" if also else f"{field} = {value!r}: {what}"
        )
        super().__init__(message)
        self.field, self.value, self.what, self.also = field, value, what, also


def check_sampling(temperature: float = 0.0, top_p: float = 1.0) -> None:
    """Refuses sampling settings that mlx-lm's sampler cannot honour: a temperature that
    is not a finite number >= 0 (nan samples garbage, 0 is greedy), or a top_p outside
    (0, 1] (mlx-lm's sampler takes 0 as "off", the opposite of what it asks for). The one
    check of the CLI's --temp / --top-p, the server's fields and `stream_generate`.

    Raises:
        ConfigError: naming "temperature" or "top_p".
    """
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError("temperature", temperature, "must be a finite number >= 0 (0: greedy)")
    if not 0 < top_p <= 1:
        raise ConfigError("top_p", top_p, "must be in (0, 1]")


@dataclass(frozen=True)
class StreamConfig:
    """How experts are cached and prefetched.

    Attributes:
        expert_slots: real-region slots per MoE layer; None means every expert (fully
            cached after first use). Memory: expert_slots x record stride bytes per layer.
        expert_memory: instead of expert_slots, the bytes of all real regions together
            (or "auto": `AUTO_MEMORY_FRACTION` of the memory available at load,
            `engine.memory_plan.auto_bytes`); each layer gets slots by its own record
            size (`engine.memory_plan.layer_slots`).
        side_slots: side-region rows per bank, and experts per prediction (two banks: the
            persistent LFU mode keeps predicted experts in both banks' 2 x side_slots rows,
            the legacy double buffer reads one bank while the other fills); 0 disables
            the side region. A layer no layer prefetches for (the first MoE layer, or
            one whose router is not found) holds its 2 x side_slots rows as real slots
            instead (`engine.memory_plan.held_rows`).
        prefetch: run the predictor and fill the side region.
        adaptive_prefetch: how many of a prediction's side_slots experts each layer fills
            (its prefetch degree) is decided at run time: from how often each rank of the
            layer's predictions is routed to, against the usefulness a fill needs on this
            machine, measured by comparing decode forward times at neighbouring
            thresholds (ext/prefetch_throttle.h); side_slots is then an upper bound.
            False: every prediction fills side_slots experts.
        ahead_lo: target distance (in MoE layers) for source layers before `cutoff`.
        ahead_hi: target distance from `cutoff` on. Every MoE layer after the first is
            predicted once per forward whatever the distances: a source whose distance
            grows also predicts the layers it would skip (`Predictor.targets_for`).
        cutoff: first MoE layer index that uses `ahead_hi`; None means half the MoE layers.
        side_lfu: persistent LFU side region (True) or legacy double buffer (False).
        sync: fill the side region synchronously where the prefetch is submitted.
        policy: real-region eviction, one of `EVICTION_POLICIES`: "predictive" (evict the
            expert least likely to be wanted at the next token, learned online from
            transitions, cross-layer co-activation, frequency and recency), "lfu"
            (frequency with periodic halving), "lru", "lfu-da" (LFU with dynamic aging) or
            "s3-fifo".
        decay_every: acquire calls per layer between LFU halvings (0: never); the LFU
            frequencies (autopin's input) are counted under every policy.
        autopin_frac: fraction of `expert_slots` that autopin may pin (0 disables autopin).
        scratch_slots: scratch rows of an over-capacity call: one whose misses exceed the
            evictable slots streams them through these rows in two banks (from 2 rows
            on), a chunk per bank, the next chunk read while one computes (None:
            top-k). It counts experts, not tokens (unlike mlx-lm's prefill chunk). Where
            the pools are CUDA memory such a call uses the layer scratch instead
            (`engine.predictor.Predictor.layer_scratch`): these rows go unused, and
            None means 1.
        reader_threads: background reader threads; None:
            `engine.memory_plan.default_reader_threads`
            (enough for one token's misses to be read at once, and for the disk's
            queue depth).
        verify_checksums: check each record's crc32 on every read.
        uncached_io: bypass the page cache (O_DIRECT / F_NOCACHE).
        read_timeout_s: a demand read (or a drain of prefetch fills) that sees no read
            finish for this long gives up: ExpertReadTimeout naming the file, layer and
            expert (a given-up fill is left to a later demand read); the late read never
            writes a pool row. 0 waits forever. Not applied to SYNC fills, which read on
            the submitting thread.
        io_uring: demand reads through io_uring on the thread that waits for them (one
            system call per batch of misses, no hand-off to a reader thread),
            `engine.cache.io_uring_depth` in flight, used where the kernel has it (Linux 5.11+, not
            disabled); else, and for prefetch fills, the reader threads read.
        device_acquire: on an MLX CUDA device, a decode step's acquire is a kernel on the
            GPU's stream that a host thread answers through mapped memory
            (`engine.device_acquire`); False takes the CPU-stream `acquire_op`, the path
            every other backend takes.
        host_memory: with device_acquire, the bytes of page-locked host memory that keep
            records read from disk (the host-RAM tier between the disk and the GPU pools:
            a miss it holds is copied from there, not read), split evenly among the MoE
            layers and evicted by `policy`; "auto": every expert, up to
            `AUTO_MEMORY_FRACTION` of the memory the pools and dense weights leave
            (`engine.memory_plan.auto_bytes`); a budget that the plan cannot hold with
            the rest is refused at load; 0 or None: no tier. Where the pools are host
            memory (CPU, Metal) the pools are the tier: no other is made.
        fill_stream: with device_acquire, prefetch fills are copied by the device's copy
            engines on a CUDA stream of their own while the compute runs
            (`engine.device_acquire`; experimental: on an H200, serving 1 and 4 clients
            with it gave no figure in seven minutes, docs/benchmarks.md); False: by the
            copy kernel of the next answer, on the compute stream ahead of the experts.
        max_batch: the most sequences one forward carries (`expertstream serve
            --max-batch`): with device_acquire, one acquire kernel's request holds up to
            max_batch x top_k ids, its mailbox and staging slots sized at load.
        expert_major: how calls of many tokens (a prompt's chunks) compute their
            experts: "auto" expert-major where the backend and quantization make it
            faster (MLX CUDA, affine), "on" wherever a call has enough tokens, "off"
            always mlx-lm's form; either way bit for bit mlx-lm's outputs
            (`engine.expert_compute.ExpertMajor`).
    """

    expert_slots: int | None = None
    expert_memory: int | str | None = None
    side_slots: int = 0
    prefetch: bool = False
    adaptive_prefetch: bool = True
    ahead_lo: int = 1
    ahead_hi: int = 2
    cutoff: int | None = None
    side_lfu: bool = True
    sync: bool = False
    policy: str = EVICTION_POLICIES[0]
    decay_every: int = 256
    autopin_frac: float = 0.0
    scratch_slots: int | None = None
    reader_threads: int | None = None
    verify_checksums: bool = True
    uncached_io: bool = True
    read_timeout_s: float = 30.0
    io_uring: bool = True
    device_acquire: bool = True
    host_memory: int | str | None = "auto"
    fill_stream: bool = False
    max_batch: int = 1
    expert_major: str = "auto"

    def __post_init__(self):
        def need(ok: bool, field: str, value, what: str):
            if not ok:
                raise ConfigError(field, value, what)

        need(
            self.expert_slots is None or self.expert_slots >= 1,
            "expert_slots",
            self.expert_slots,
            "must be >= 1",
        )
        need(
            self.expert_memory is None
            or self.expert_memory == "auto"
            or (isinstance(self.expert_memory, int) and self.expert_memory > 0),
            "expert_memory",
            self.expert_memory,
            'must be a positive number of bytes or "auto"',
        )
        need(
            self.host_memory is None
            or self.host_memory == "auto"
            or (isinstance(self.host_memory, int) and self.host_memory >= 0),
            "host_memory",
            self.host_memory,
            'must be a number of bytes >= 0, "auto" or None',
        )
        need(
            self.expert_major in EXPERT_MAJOR,
            "expert_major",
            self.expert_major,
            f"must be one of {', '.join(EXPERT_MAJOR)}",
        )
        if self.expert_memory is not None and self.expert_slots is not None:
            raise ConfigError("expert_slots", None, "give one of them", also="expert_memory")
        need(self.side_slots >= 0, "side_slots", self.side_slots, "must be >= 0")
        need(self.max_batch >= 1, "max_batch", self.max_batch, "must be >= 1")
        need(self.ahead_lo >= 1, "ahead_lo", self.ahead_lo, "must be >= 1")
        need(self.ahead_hi >= 1, "ahead_hi", self.ahead_hi, "must be >= 1")
        need(self.cutoff is None or self.cutoff >= 0, "cutoff", self.cutoff, "must be >= 0")
        need(
            self.policy in EVICTION_POLICIES,
            "policy",
            self.policy,
            f"must be one of {', '.join(EVICTION_POLICIES)}",
        )
        need(self.decay_every >= 0, "decay_every", self.decay_every, "must be >= 0")
        need(0.0 <= self.autopin_frac < 1.0, "autopin_frac", self.autopin_frac, "must be in [0, 1)")
        need(
            self.scratch_slots is None or self.scratch_slots >= 1,
            "scratch_slots",
            self.scratch_slots,
            "must be >= 1",
        )
        need(
            self.reader_threads is None or 1 <= self.reader_threads <= MAX_READER_THREADS,
            "reader_threads",
            self.reader_threads,
            f"must be in [1, {MAX_READER_THREADS}]",
        )
        need(
            0 <= self.read_timeout_s <= MAX_READ_TIMEOUT_S,
            "read_timeout_s",
            self.read_timeout_s,
            f"must be in [0, {MAX_READ_TIMEOUT_S}] seconds",
        )

    def replace(self, **changes) -> "StreamConfig":
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)


class PoolMemoryError(ValueError):
    """The memory plan of `config` (pools, layer scratch, acquire staging, host tier and
    dense weights) does not fit in the memory available (`engine.memory_plan.
    plan_memory`), or the pools' allocation failed: `what` says how much was asked for,
    why (layers x rows x record size) and what is left; the message adds which setting
    to change, naming StreamConfig fields as ConfigError does. Front ends name them their
    own way with `in_words`."""

    def __init__(self, what: str, config: StreamConfig):
        super().__init__(f"{what}: {_pool_remedy(config, {})}")
        self.what, self.config = what, config

    def in_words(self, names: Mapping[str, str]) -> str:
        """The message with each StreamConfig field named by `names[field]` (the field
        itself when absent)."""
        return f"{self.what}: {_pool_remedy(self.config, names)}"


def _pool_remedy(config: StreamConfig, names: Mapping[str, str]) -> str:
    """What to change of `config` for smaller pools, naming the setting the user gave:
    its fields by `names[field]` (the field itself when absent)."""
    slots, memory = (names.get(f, f) for f in ("expert_slots", "expert_memory"))
    if config.expert_slots is not None:
        fix = f"lower {slots}, or use {memory} auto"
    elif config.expert_memory == "auto":
        fix = f"give {memory} a size below auto's ({AUTO_MEMORY_FRACTION:.0%} of that)"
    elif config.expert_memory is not None:
        fix = f"lower {memory}, or use {memory} auto"
    else:
        fix = f"every expert is cached by default: use {memory} auto, or give {slots}"
    sized = (
        ("side_slots", config.side_slots),
        ("scratch_slots", config.scratch_slots),
        ("host_memory", isinstance(config.host_memory, int) and config.host_memory),
    )
    given = [names.get(f, f) for f, on in sized if on]
    return fix + (f" (or lower {' / '.join(given)})" if given else "")
