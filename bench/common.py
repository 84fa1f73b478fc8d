"""Shared measuring helpers: timed generation, process memory and I/O counters."""

import os
import statistics
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

PROMPT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in "
    "the sunshine with her dog, Max. One day, Lily and Max went to the park near their "
    "house. They saw a big tree with red apples. Lily wanted to pick an apple, but the "
    "tree was too tall. She"
)


@dataclass
class Timing:
    """One generation: prefill = prompt tokens / time to the first token (mlx-lm's
    definition); decode = generated tokens after the first / time after the first (the
    tokens the decode steps made; mlx-lm's generation_tps counts the first one too)."""

    prompt_tokens: int
    tokens: list[int]
    prefill_s: float
    decode_s: float
    wall_s: float
    # The first token's log-probabilities over the vocabulary (float32; the prefill's
    # last logits, log-softmaxed): equal arrays mean equal logits.
    first_logprobs: np.ndarray | None = None

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def timed_generate(model, prompt: list[int], max_tokens: int, on_first_token=None) -> Timing:
    """Greedy generation with mlx-lm's `generate_step`; `on_first_token()` runs once the
    prompt is processed (e.g. to snapshot cache counters)."""
    sampler = make_sampler(temp=0.0)
    tokens = []
    t0 = time.perf_counter()
    t_first, first = None, None
    for tok, logprobs in generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, sampler=sampler
    ):
        tokens.append(int(tok))
        if t_first is None:
            t_first = time.perf_counter()
            first = logprobs
            if on_first_token is not None:
                on_first_token()
    t_end = time.perf_counter()
    t_first = t_first or t_end
    logprobs = None if first is None else np.array(first.astype(mx.float32))
    return Timing(len(prompt), tokens, t_first - t0, t_end - t_first, t_end - t0, logprobs)


def prompt_ids(tokenizer, vocab_size: int, length: int = 64) -> list[int]:
    """The benchmark prompt: `PROMPT` through the tokenizer, or (no tokenizer) `length`
    fixed pseudo-random token ids below `vocab_size`."""
    if tokenizer is not None:
        return list(tokenizer.encode(PROMPT))
    rng = np.random.default_rng(1234)
    return [int(t) for t in rng.integers(1, vocab_size, length)]


def vm_hwm_bytes() -> int:
    """Peak resident set size of this process (VmHWM), bytes; 0 where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_vm_hwm() -> bool:
    """Resets VmHWM to the current RSS (Linux: write 5 to clear_refs); False if not."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def disk_read_bytes() -> int:
    """Bytes this process caused to be fetched from storage (/proc/self/io read_bytes:
    page-cache misses, mmap faults and O_DIRECT reads alike); -1 where unavailable."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def med_spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of `values` ((0, 0, 0) when empty)."""
    if not values:
        return 0.0, 0.0, 0.0
    return statistics.median(values), min(values), max(values)


def machine_load() -> dict:
    """Load averages and CPU count at this instant (how noisy the figures are)."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        one = five = fifteen = -1.0
    return {
        "loadavg_1m": one,
        "loadavg_5m": five,
        "loadavg_15m": fifteen,
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
