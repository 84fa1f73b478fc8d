"""Generation with a streamed model: mlx-lm's own sampling and chat template, plus the
cache's figures.

`stream_generate` yields mlx-lm `GenerationResponse`s unchanged; `generate` collects a
whole reply into a `GenerationResult` with the stats the CLI and the app report.
"""

import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.generate import GenerationResponse, generation_stream
from mlx_lm.generate import stream_generate as mlx_stream_generate
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import apply_top_p, make_sampler

from engine import autopin
from engine.cache import REPORTED_STATS, STAT_KEYS, rates
from engine.chat import SYSTEM, USER, chat_ids, checked_ids, encode
from engine.config import PREFILL_STEP_SIZE, check_sampling
from engine.model import StreamedModel
from engine.predictor import GenerationStopped

# The largest float32: a temperature whose reciprocal exceeds it scales logits to inf.
_F32_MAX = float(np.finfo(np.float32).max)


def sampler(temperature: float, top_p: float = 1.0) -> Callable[[mx.array], mx.array]:
    """mlx-lm's sampler (`make_sampler`) of `temperature` and `top_p`, safe for tiny
    temperatures: mlx-lm scales the log-probabilities by 1 / temperature, which in float32
    turns every one of them to -inf once the scale overflows (and then samples garbage).
    Here the log-probabilities are shifted so that the most likely token's is 0 (the
    distribution is unchanged) and computed in float32, and a temperature whose reciprocal
    overflows float32 is greedy, as the limit of sampling at temperature -> 0 is.

    Args:
        temperature: >= 0 (0: greedy).
        top_p: in (0, 1].

    Returns:
        A function of log-probabilities (..., vocab) returning the sampled token ids (...).
    """
    if temperature == 0 or 1.0 / temperature > _F32_MAX:
        return make_sampler(temp=0.0)
    sample = make_sampler(temp=temperature, top_p=top_p)

    def shifted(logprobs: mx.array) -> mx.array:
        x = logprobs.astype(mx.float32)
        return sample(x - x.max(axis=-1, keepdims=True))

    return shifted


def keyed_sampler(
    temperature: float, top_p: float = 1.0, seed: int | None = None
) -> Callable[[mx.array], mx.array]:
    """`sampler` with a random key of its own instead of MLX's global one, for one of
    several sequences sampled side by side (a batch): its tokens depend on its own `seed`
    only, not on what else is sampled, and equal what `sampler` gives after
    `mx.random.seed(seed)` (each call splits the key as MLX splits its global key).

    Args:
        temperature, top_p: as for `sampler`.
        seed: the key's seed (0 to 2**64 - 1); None: a random one.

    Returns:
        A function of log-probabilities (1, vocab) returning the sampled token id (1,).
    """
    if temperature == 0 or 1.0 / temperature > _F32_MAX:
        return make_sampler(temp=0.0)
    key = mx.random.key(int.from_bytes(os.urandom(8)) if seed is None else seed)

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        x = logprobs.astype(mx.float32)
        x = x - x.max(axis=-1, keepdims=True)
        if 0 < top_p < 1.0:  # mlx-lm's chain for these settings: top_p, then categorical
            x = apply_top_p(x, top_p)
        key, sub = mx.random.split(key)
        return mx.random.categorical(x * (1.0 / temperature), key=sub)

    return sample


def restore_space(tokenizer, seen: list[int], text: str) -> str:
    """The first text piece of a reply (`text`, after its tokens `seen`) with the leading
    whitespace that mlx-lm's streaming detokenizer drops put back: it drops the first
    segment's leading space (right for a fresh chat reply, wrong for a continuation:
    "Once upon a" + "time"), where the tokenizer decodes one."""
    full = tokenizer.decode(seen)
    lost = full[: len(full) - len(text)]
    return full if full.endswith(text) and lost.isspace() else text


def prompt_tokens(
    sm: StreamedModel, prompt: str, chat: bool, system: str | None = None
) -> list[int]:
    """Token ids of `prompt`: through the tokenizer's chat template when `chat` and the
    model has one (a single user turn after the `system` prompt, if any, generation
    prompt added), else as given.

    Raises:
        ValueError: the store has no tokenizer, the prompt encodes to no tokens, or to an
            id outside the model's vocabulary.
    """
    tok = sm.tokenizer
    if tok is None:
        raise ValueError(
            f"{sm.store.path} has no tokenizer files (tokenizer.json / tokenizer_config.json): "
            "text generation needs the model's tokenizer; copy its files into the store"
        )
    vocab = sm.store.vocab_size
    if chat:
        system_turn = [{"role": SYSTEM, "content": system}] if system else []
        return chat_ids(tok, [*system_turn, {"role": USER, "content": prompt}], vocab)
    return checked_ids(encode(tok, prompt), vocab)


class ContextError(ValueError):
    """Prompt + reply exceed the model's context: `prompt_tokens`, `max_tokens` and the
    context `limit` (tokens), for a front end to say which of its settings to lower."""

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int):
        super().__init__(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context of {limit} tokens (max_position_embeddings)"
        )
        self.prompt_tokens, self.max_tokens, self.limit = prompt_tokens, max_tokens, limit


def check_context(sm: StreamedModel, n_prompt: int, max_tokens: int) -> None:
    """Raises ContextError (a ValueError) when prompt + reply exceed the model's context
    window (`ExpertStore.context_length`), naming both numbers."""
    limit = sm.store.context_length
    if limit is not None and n_prompt + max_tokens > limit:
        raise ContextError(n_prompt, max_tokens, limit)


def stream_generate(
    sm: StreamedModel,
    prompt: list[int],
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    prompt_cache=None,
    cached_tokens: int = 0,
    prefill_step_size: int = PREFILL_STEP_SIZE,
) -> Iterator[GenerationResponse]:
    """Yields one mlx-lm GenerationResponse per token (greedy at temperature 0).

    The reply's text is what the tokenizer decodes (`restore_space`).

    Args:
        prompt: token ids (after the `cached_tokens` already in `prompt_cache`).
        max_tokens: reply length limit, tokens (>= 1).
        prompt_cache: an mlx-lm KV cache to continue a conversation, or None.
        cached_tokens: tokens `prompt_cache` already holds (counted against the context).
        prefill_step_size: prompt tokens per forward of the prefill.

    Raises:
        ValueError: max_tokens < 1, the context is exceeded (`check_context`), or a
            sampling setting is out of range (`engine.config.check_sampling`'s ConfigError).
        engine.cache.ExpertReadError (ChecksumError, ExpertReadTimeout): an expert could
            not be read; no token computed without it is yielded.
        GenerationStopped: the caller's stop hook asked to stop mid-forward.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens is {max_tokens}: a reply needs at least 1 token")
    check_sampling(temperature, top_p)
    check_context(sm, cached_tokens + len(prompt), max_tokens)
    seen, restored = [], False
    for r in mlx_stream_generate(
        sm.model,
        sm.tokenizer,
        mx.array(prompt),
        max_tokens=max_tokens,
        sampler=sampler(temperature, top_p),
        prompt_cache=prompt_cache,
        prefill_step_size=prefill_step_size,
    ):
        # A read that failed inside a stream-ordered acquire left row 0 in its place: the
        # token is wrong, so its error is raised before the token is handed out.
        sm.cache.raise_stream_error()
        if not restored:
            seen.append(r.token)
            if r.text:
                restored = True
                r = dataclasses.replace(r, text=restore_space(sm.tokenizer, seen, r.text))
        yield r


@dataclass
class GenerationResult:
    """A finished reply.

    Attributes:
        text: the decoded reply.
        tokens: generated token ids.
        prompt_tokens: prompt length, tokens.
        prefill_tps: mlx-lm's prompt tokens per second (prompt tokens / time to the first
            token); None when stopped before the first token.
        decode_tps: mlx-lm's generation tokens per second, by its convention
            (`GenerationResponse.generation_tps`): every generated token, the first one
            (sampled from the prefill's logits) included, over the time since the first
            token, i.e. over `len(tokens)` (what "(N tokens)" beside it counts). None
            with fewer than 2 tokens: no decode step ran, and mlx-lm's figure would
            divide by the few microseconds after the first token.
        peak_memory_bytes: MLX peak memory of the process, bytes.
        cache: cache counter totals for this reply (`cache_delta`: hit_rate and
            prefetch_accuracy recomputed over the reply, None where undefined).
        stopped: the caller's `stop` ended the reply early.
        finish_reason: "stop" (end-of-sequence token), "length" (max_tokens) or None
            (stopped).
        cached_tokens: prompt tokens taken from a kept KV cache (not prefilled).
        seconds: wall time of the reply, seconds: from the call of `generate` until the
            last forward has ended and pins are settled.
    """

    text: str
    tokens: list[int]
    prompt_tokens: int
    prefill_tps: float | None
    decode_tps: float | None
    peak_memory_bytes: int
    cache: dict = field(default_factory=dict)
    stopped: bool = False
    finish_reason: str | None = None
    cached_tokens: int = 0
    seconds: float = 0.0

    def stats(self) -> dict:
        """The stats object of `expertstream generate --json`: this reply's figures (the
        cache counters are its deltas, not the totals since load that the server's
        /v1/stats gives); decode_tps is None (JSON null) without a decode step, and
        hit_rate, prefetch_accuracy, prefill_tps where they would divide by 0."""
        return {
            **{k: self.cache[k] for k in REPORTED_STATS},
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": len(self.tokens),
            "prefill_tps": self.prefill_tps,
            "decode_tps": self.decode_tps,
            "peak_memory_bytes": self.peak_memory_bytes,
        }


def cache_delta(before: dict, after: dict) -> dict:
    """Counter totals (`STAT_KEYS`) accumulated between two `CacheSnapshot.totals()`,
    and their `rates` (None where nothing was looked up / prefetched)."""
    d = {k: after[k] - before[k] for k in STAT_KEYS}
    return d | rates(d)


def generate(
    sm: StreamedModel,
    prompt: list[int],
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    on_response: Callable[[GenerationResponse], None] | None = None,
    stop: Callable[[], bool] | None = None,
    prompt_cache=None,
    cached_tokens: int = 0,
    stop_mid_forward: bool = True,
    prefill_step_size: int = PREFILL_STEP_SIZE,
) -> GenerationResult:
    """Generates a whole reply and updates autopin afterwards (when enabled); a trace
    recorder of `sm` (`engine.trace.record`) gets the reply as one segment.

    Args:
        on_response: called with each mlx-lm GenerationResponse as it is produced.
        stop: polled after each token and, with `stop_mid_forward`, at every MoE layer
            call (so also during a long prefill); the reply ends early when it returns
            True (`GenerationResult.stopped`). A pipeline stage polls it between tokens
            only (engine.serve.pipeline): every rank must end at the same token.
        prompt_cache, cached_tokens, prefill_step_size: as for `stream_generate`.

    Raises:
        ValueError: from `stream_generate`, before any forward.
    """
    t0 = time.monotonic()
    mx.reset_peak_memory()
    before = sm.snapshot().totals()
    text, tokens, last, stopped = [], [], None, False
    sm.predictor.should_stop = stop if stop_mid_forward else None
    recorder = sm.predictor.recorder
    if recorder is not None:
        recorder.begin_segment()
    try:
        responses = stream_generate(
            sm,
            prompt,
            max_tokens,
            temperature,
            top_p,
            prompt_cache,
            cached_tokens,
            prefill_step_size,
        )
        for r in responses:
            tokens.append(r.token)
            text.append(r.text)
            last = r
            if on_response:
                on_response(r)
            if stop and stop():
                stopped = True
                break
    except GenerationStopped:
        stopped = True
        if prompt_cache is not None:
            # The forward stopped midway left the KV the caller keeps lazy, over a graph
            # that reads pools and scratch rows: evaluated later, inside the next reply's
            # forward, its reads would interleave with that forward's own. It runs now.
            mx.eval([c.state for c in prompt_cache])
    finally:
        sm.predictor.should_stop = None
        if recorder is not None:
            recorder.settle()
        # mlx-lm has already started the forward of the token after the last one: it
        # ends before the figures are read (its reads count) and before the caller goes
        # on (in a pipeline, its transfers would interleave with the caller's next
        # collective), a failed reply's too.
        mx.synchronize(generation_stream)
        # Between replies the host writes the pools itself (pins, resets, the next
        # prompt): what the acquire kernels would have delivered is written now.
        sm.cache.set_staging(False)
    after = sm.snapshot().totals()
    if sm.config.autopin_frac > 0:  # re-pin between replies, and keep the set for next time
        pins = autopin.repin(sm.cache, sm.autopin_budget())
        autopin.save(sm.pin_path, pins, sm.store.manifest.num_experts)
    return GenerationResult(
        text="".join(text),
        tokens=tokens,
        prompt_tokens=len(prompt),
        prefill_tps=last.prompt_tps if last else None,
        decode_tps=last.generation_tps if last and last.generation_tokens > 1 else None,
        peak_memory_bytes=int(mx.get_peak_memory()),
        cache=cache_delta(before, after),
        stopped=stopped,
        finish_reason=None if stopped or last is None else last.finish_reason,
        cached_tokens=cached_tokens,
        seconds=time.monotonic() - t0,
    )


class ChatSession:
    """Replies that keep mlx-lm's prompt cache (KV) between turns: each prompt prefills
    only the tokens after its longest common prefix with what the cache holds, so a
    follow-up turn costs its own tokens, not the whole conversation's. A different
    conversation shares no prefix and starts afresh. Use it on one thread (it holds MLX
    arrays).

    Args:
        sm: the streamed model.
    """

    def __init__(self, sm: StreamedModel):
        self.sm = sm
        self._cache = None
        self._ids: list[int] = []  # the tokens whose keys and values the cache holds

    def reset(self) -> None:
        """Forgets the kept cache (the next reply prefills its whole prompt)."""
        self._cache, self._ids = None, []

    def generate(self, prompt: list[int], max_tokens: int = 256, **kwargs) -> GenerationResult:
        """`generate` over the kept cache; keyword arguments as for `generate`.

        A stopped or failed reply leaves the cache partial (a forward cut at a MoE
        layer), so the session starts afresh after one.

        Raises:
            ValueError: as `generate`.
        """
        common = 0
        for a, b in zip(self._ids, prompt, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(prompt) - 1)  # at least one token to feed
        if self._cache is None or common == 0:
            self._cache, common = make_prompt_cache(self.sm.model), 0
        else:
            trim_prompt_cache(self._cache, len(self._ids) - common)
        self._ids = []  # unknown until the reply ends well
        result = generate(
            self.sm,
            prompt[common:],
            max_tokens,
            prompt_cache=self._cache,
            cached_tokens=common,
            **kwargs,
        )
        if result.stopped:
            self.reset()
        else:
            # mlx-lm feeds every generated token but the last back through the model.
            held = self._cache[0].offset
            self._ids = (prompt + result.tokens)[:held]
            trim_prompt_cache(self._cache, held - len(self._ids))
        return result
