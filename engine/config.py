"""The one configuration object of a streamed model.

Every knob of the expert cache lives in `StreamConfig`. Environment variables (the seed's
names) are read once, at start-up, by `config_from_env`; CLI flags override them. Nothing
below the CLI reads the environment.
"""

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

# The seed's environment variables and the StreamConfig field each one sets.
ENV_FIELDS = {
    "EXPERT_SLOTS": "expert_slots",
    "SIDEREGION_LFU": "side_lfu",
    "SIDEREGION_SYNC": "sync",
    "AUTOPIN_BUDGET_FRAC": "autopin_frac",
    "PREFILL_CHUNK": "prefill_chunk",
}


@dataclass(frozen=True)
class StreamConfig:
    """How experts are cached and prefetched.

    Attributes:
        expert_slots: real-region slots per MoE layer (`cap`); None means every expert
            (fully cached after first use). Memory: cap x record stride bytes per layer.
        spec_slots: side-region rows per generation (`spec`); 0 disables the side region.
        prefetch: run the predictor and fill the side region.
        ahead_lo: target distance (in MoE layers) for source layers before `cutoff`.
        ahead_hi: target distance from `cutoff` on.
        cutoff: first MoE layer index that uses `ahead_hi`; None means half the MoE layers.
        side_lfu: persistent LFU side region (True) or legacy double buffer (False).
        sync: fill the side region synchronously where the prefetch is submitted.
        policy: real-region eviction, "lfu" (frequency with periodic halving) or "lru".
        decay_every: acquire calls per layer between LFU halvings (0: never).
        autopin_frac: fraction of `cap` that autopin may pin (0 disables autopin).
        prefill_chunk: scratch rows that stream an over-capacity call's misses, chunk by
            chunk (None: top-k).
        reader_threads: background reader threads.
        verify_checksums: check each record's crc32 on every read.
        uncached_io: bypass the page cache (O_DIRECT / F_NOCACHE).
        read_timeout_s: a demand read (or a drain of prefetch fills) that sees no read
            finish for this long gives up: ExpertReadTimeout naming the file, layer and
            expert (a given-up fill is left to a later demand read); the late read never
            writes a pool row. 0 waits forever. Not applied to SYNC fills, which read on
            the submitting thread.
    """

    expert_slots: int | None = None
    spec_slots: int = 0
    prefetch: bool = False
    ahead_lo: int = 1
    ahead_hi: int = 2
    cutoff: int | None = None
    side_lfu: bool = True
    sync: bool = False
    policy: str = "lfu"
    decay_every: int = 256
    autopin_frac: float = 0.0
    prefill_chunk: int | None = None
    reader_threads: int = 2
    verify_checksums: bool = True
    uncached_io: bool = True
    read_timeout_s: float = 30.0

    def __post_init__(self):
        def need(ok: bool, field: str, value, what: str):
            if not ok:
                raise ValueError(f"StreamConfig.{field} = {value!r}: {what}")

        need(
            self.expert_slots is None or self.expert_slots >= 1,
            "expert_slots",
            self.expert_slots,
            "must be >= 1",
        )
        need(self.spec_slots >= 0, "spec_slots", self.spec_slots, "must be >= 0")
        need(self.ahead_lo >= 1, "ahead_lo", self.ahead_lo, "must be >= 1")
        need(self.ahead_hi >= 1, "ahead_hi", self.ahead_hi, "must be >= 1")
        need(self.cutoff is None or self.cutoff >= 0, "cutoff", self.cutoff, "must be >= 0")
        need(self.policy in ("lfu", "lru"), "policy", self.policy, "must be 'lfu' or 'lru'")
        need(self.decay_every >= 0, "decay_every", self.decay_every, "must be >= 0")
        need(0.0 <= self.autopin_frac < 1.0, "autopin_frac", self.autopin_frac, "must be in [0, 1)")
        need(
            self.prefill_chunk is None or self.prefill_chunk >= 1,
            "prefill_chunk",
            self.prefill_chunk,
            "must be >= 1",
        )
        need(self.reader_threads >= 1, "reader_threads", self.reader_threads, "must be >= 1")
        need(
            0 <= self.read_timeout_s <= 86400,
            "read_timeout_s",
            self.read_timeout_s,
            "must be in [0, 86400] seconds",
        )

    def replace(self, **changes) -> "StreamConfig":
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def _parse(field: str, text: str):
    kind = {f.name: f.type for f in dataclasses.fields(StreamConfig)}[field]
    if "bool" in str(kind):
        if text.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if text.strip().lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected 0 or 1, got {text!r}")
    if "float" in str(kind):
        return float(text)
    return int(text)


def config_from_env(environ: Mapping[str, str] | None = None) -> dict:
    """The StreamConfig fields set by the seed's environment variables.

    Returns:
        {field: value} for each variable of `ENV_FIELDS` present in `environ`
        (default `os.environ`).

    Raises:
        ValueError: a variable's value does not parse; the message names the variable.
    """
    environ = os.environ if environ is None else environ
    out = {}
    for var, field in ENV_FIELDS.items():
        if var in environ:
            try:
                out[field] = _parse(field, environ[var])
            except ValueError as e:
                raise ValueError(f"environment variable {var}={environ[var]!r}: {e}") from None
    return out
