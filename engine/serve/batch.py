"""Continuous batching behind `expertstream serve`: the replies of up to `--max-batch`
requests generated side by side over the streamed model, in mlx-lm's batch KV caches
(`BatchKVCache` and its kin: each row its own KV, a mask over the padding that aligns
them) and with its sampling math.

Each turn of the generation thread's loop does, in this order:

1. prefill: one forward of the next `prefill_step_size` prompt tokens of every row
   prefilling, all but each prompt's last token, right-padded to the longest (as
   mlx-lm's `PromptProcessingBatch` pads them), so that a long prompt holds the others
   up for one such forward at a time;
2. first tokens: the rows whose prompt has only its last token left forward it, one
   token a row (as a reply alone forwards it after its prefill), and their first
   tokens, sampled from its logits, are sent at once; the rows then join the decode,
   each first token its next input, or end there (an end-of-sequence token, or
   max_tokens 1);
3. decode: one forward of every decoding row's next input, one token a row;

then the queued jobs join, up to `max_batch` rows in all, each over its prompt's longest
known prefix in the prompt cache.

So a joining request's first token comes out of its own prefill: after the decode step
in flight when it came, its prefill's forwards and its last token's, with no decode step
of the batch between. (mlx-lm's `BatchGenerator.next`, driven as it is, forwards that
last token at its next call, after a decode step of the batch, and hands out the token
it gives at the call after, after another.) The last token is forwarded apart, as alone,
rather than at the end of the prefill's last forward: mlx-lm's models compute the logits
of every position a forward takes, and a prefill forward's (rows x width x vocab) take
memory beside its KV, and compute of the scale of a forward of one token a row. The
decode pipelines as mlx-lm's does: a step starts the forward of the tokens the step
before sampled and hands those out while it runs, so that the host's work (the text, the
HTTP events, the next step's graph) overlaps the device's.

A reply leaves the batch when it ends: at the end-of-sequence token or its max_tokens,
or at the end of the turn in which a stop string cut its text or its client went (its
KV then goes to the prompt cache, as a whole reply's does).

Each row keeps what is its own: its sampler and seed (`engine.generate.keyed_sampler`: a
random key of its own, so a seeded reply repeats whatever else is in the batch), its
stop strings, log-probabilities and text (`engine.serve.reply.Reply`), its KV. A decode
step is one forward of the model over (rows, 1) tokens: each MoE layer's call carries
every row's ids, and the expert cache serves their union (the stream-ordered path while
the union fits the slots, the over-capacity path beyond them), so the rows of a step
share each expert's read. The cache's counters are the server's totals; the tokens are
counted per reply.

Each row is computed apart where the rows differ, so a greedy reply in a batch is the
one the request gets alone wherever the backend's kernels compute a row of a batch as
they compute it alone (docs/server.md: "Many conversations at once").
"""

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.models.cache import make_prompt_cache

from engine import autopin
from engine.generate import keyed_sampler, restore_space
from engine.predictor import GenerationStopped
from engine.serve.reply import Reply

# Decode steps between frees of MLX's buffer cache (mlx-lm's generators free it so too).
CLEAR_CACHE_STEPS = 256


def batches(model) -> bool:
    """Whether `model`'s KV caches can be batched (mlx-lm's test: every layer's cache
    merges with others); a model whose caches cannot is served one reply at a time."""
    return all(hasattr(c, "merge") for c in make_prompt_cache(model))


@dataclass
class Row:
    """One reply in the batch.

    Attributes:
        reply: its Reply (job, text, events).
        detokenizer: its own streaming detokenizer.
        sample: its sampler: log-probabilities (1, vocab) -> token id (1,).
        rest: its prompt tokens not forwarded yet.
        tokens: the tokens whose KV its cache holds (the prompt cache's key for it).
        input: its next token to forward, (1,) ids; None before its first token.
        logprobs: the log-probabilities (vocab,) `input` was sampled from while it is
            still to be handed out; None once it has been (a first token is at once).
        seen: its tokens until the first that decodes to text (`restore_space`); None
            after it.
        first: when its first token came (`time.monotonic()`), or None.
    """

    reply: Reply
    detokenizer: object
    sample: Callable[[mx.array], mx.array]
    rest: list[int]
    tokens: list[int]
    input: mx.array | None = None
    logprobs: mx.array | None = None
    seen: list[int] | None = field(default_factory=list)
    first: float | None = None

    def text(self, token: int, finish: str | None, tokenizer) -> str:
        """The text `token` adds to the reply, as engine.generate.stream_generate writes
        it: the end-of-sequence token ("stop") adds none, the last token ends the
        detokenizer's stream."""
        if finish != "stop":
            self.detokenizer.add_token(token)
        if finish is not None:
            self.detokenizer.finalize()
        text = self.detokenizer.last_segment
        if self.seen is not None:
            self.seen.append(token)
            if text:
                text = restore_space(tokenizer, self.seen, text)
                self.seen = None
        return text


@dataclass
class Batch:
    """Rows side by side and their KV: one of mlx-lm's batch caches per layer, whose row
    i is `rows[i]`'s."""

    rows: list[Row] = field(default_factory=list)
    kv: list = field(default_factory=list)

    def add(self, rows: list[Row], caches: list[list]) -> None:
        """Appends `rows`, each with its KV (mlx-lm's one-sequence caches, one a layer)."""
        if rows:
            merged = [layer[0].merge(list(layer)) for layer in zip(*caches, strict=True)]
            self.extend(Batch(rows, merged))

    def extend(self, other: "Batch") -> None:
        """Appends the rows of `other` and their KV."""
        if not other.rows:
            return
        if self.kv:
            for mine, theirs in zip(self.kv, other.kv, strict=True):
                mine.extend(theirs)
        else:
            self.kv = other.kv
        self.rows += other.rows

    def take(self, gone: list[int]) -> list[tuple[Row, list]]:
        """Takes the rows at the indices `gone` out; returns each with its KV (one-sequence
        caches, one a layer), in the order of `gone`."""
        if not gone:  # a filter keeping every row would still copy the KV
            return []
        out = [(self.rows[i], [c.extract(i) for c in self.kv]) for i in gone]
        keep = [i for i in range(len(self.rows)) if i not in gone]
        if keep:
            for c in self.kv:
                c.filter(keep)
        else:
            self.kv = []
        self.rows = [self.rows[i] for i in keep]
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of its KV."""
        return sum(c.nbytes for c in self.kv)


class BatchLoop:
    """The generation thread's loop with `max_batch` above 1: it takes jobs into the
    batch and runs its turns until the thread is closed (`run`).

    Args:
        thread: the engine.serve.server.GenerationThread (its model, queue, prompt
            cache, counters and `active` replies).
    """

    def __init__(self, thread):
        self.thread = thread
        self.sm = thread.sm
        self.tokenizer = thread.sm.tokenizer
        self.eos = set(self.tokenizer.eos_token_ids)
        self.prefill = Batch()  # the rows prefilling
        self.ready = Batch()  # the rows whose prompt has only its last token left
        self.decode = Batch()  # the rows decoding
        self.steps = 0  # decode steps run
        self.closed = False  # the queue said None: end once the rows have ended

    @property
    def batches(self) -> tuple[Batch, Batch, Batch]:
        """The rows prefilling, ready for their first token, and decoding."""
        return self.prefill, self.ready, self.decode

    @property
    def rows(self) -> list[Row]:
        """Every row in the batch."""
        return [row for batch in self.batches for row in batch.rows]

    def run(self) -> None:
        """Serves jobs until the thread is closed, in bursts: from a job taken while no
        reply generates until the last reply ends. A shutdown (`cancel_all`) ends the
        turn in progress at its next MoE layer."""
        self.sm.predictor.should_stop = lambda: self.thread._closing
        try:
            with mx.stream(generation_stream):
                while True:
                    self._take_jobs()
                    if self.rows:
                        self._burst()
                    elif self.closed:
                        return
        finally:
            self.sm.predictor.should_stop = None

    def _burst(self) -> None:
        """Runs turns until the last row ends, then settles as between replies."""
        if (recorder := self.sm.predictor.recorder) is not None:
            recorder.begin_segment()
        with wired_limit(self.sm.model, [generation_stream]):
            self._turn()
            while self.rows:
                self._take_jobs()
                self._turn()
        self._idle()

    def _take_jobs(self) -> None:
        """Takes queued jobs into the batch, up to `max_batch` rows; waits for one while
        the batch is empty."""
        while not self.closed and len(self.rows) < self.thread.max_batch:
            if self.rows:
                try:
                    job = self.thread._jobs.get_nowait()
                except queue.Empty:
                    return
            else:
                job = self.thread._next_job()
            if job is None:
                self.closed = True
            elif (reply := self.thread._begin(job)) is not None:
                try:
                    self._join(reply)
                except Exception as e:  # noqa: BLE001  (the request fails; the server goes on)
                    reply.fail(e)
                    self.thread.active.pop(job, None)

    def _join(self, reply: Reply) -> None:
        """Puts `reply`'s job into the prefill over its prompt's cached prefix (among
        the rows ready for their first token when only the last prompt token is left)."""
        job = reply.job
        if not job.prompt:
            raise ValueError("the prompt is empty: there is no token to generate after")
        cache, cached = self.thread.fetch(job.prompt)
        reply.start(cached)
        sample = keyed_sampler(job.temperature, job.top_p, job.seed)
        row = Row(
            reply, self.tokenizer.detokenizer, sample, job.prompt[cached:], job.prompt[:cached]
        )
        joins = self.prefill if len(row.rest) > 1 else self.ready
        joins.add([row], [make_prompt_cache(self.sm.model) if cache is None else cache])
        if (prompts := self.thread.prompt_cache) is not None:  # the batch's KV counts too
            batch = sum(b.nbytes for b in self.batches)
            prompts.trim_to(n_bytes=max(0, self.thread.prompt_cache_bytes - batch))

    def _turn(self) -> None:
        """A prefill forward, the first tokens of the rows ready for them, then a decode
        step; the rows that are done, or whose reply is to end, leave the batch."""
        t0 = time.monotonic()
        try:
            if self.prefill.rows:
                self._prefill()
            if self.ready.rows:
                self._first_tokens()
            if self.decode.rows:
                self._decode()
            self._drop_stopping()
        except GenerationStopped:  # the server is shutting down
            self._end_all(None)
        except Exception as e:  # noqa: BLE001  (the batch's requests fail; the server goes on)
            self._end_all(e)
        finally:
            with self.thread.stats.lock:
                self.thread.stats.generation_seconds += time.monotonic() - t0

    def _prefill(self) -> None:
        """One forward of the next `prefill_step_size` prompt tokens of every row
        prefilling, all but its prompt's last token; the rows left with only that token
        are ready for their first token."""
        batch, step = self.prefill, self.thread.prefill_step_size
        chunks = [row.rest[: min(step, len(row.rest) - 1)] for row in batch.rows]
        lengths = [len(c) for c in chunks]
        padding = [max(lengths) - n for n in lengths]
        if any(padding):  # right padding: each cache rolls it to the left of the row's KV
            for c in batch.kv:
                c.prepare(lengths=lengths, right_padding=padding)
        tokens = [c + [0] * p for c, p in zip(chunks, padding, strict=True)]
        self.sm.model(mx.array(tokens), cache=batch.kv)
        if any(padding):
            for c in batch.kv:
                c.finalize()
        mx.eval([c.state for c in batch.kv])
        mx.clear_cache()
        for row, chunk in zip(batch.rows, chunks, strict=True):
            row.rest = row.rest[len(chunk) :]
            row.tokens += chunk
        ready = batch.take([i for i, row in enumerate(batch.rows) if len(row.rest) == 1])
        self.ready.add([row for row, _ in ready], [cache for _, cache in ready])

    def _first_tokens(self) -> None:
        """Forwards the last prompt token of every row ready for its first token, and
        hands out the first tokens at once; the rows then join the decode, each first
        token its next input."""
        batch = self.ready
        inputs = [row.rest.pop() for row in batch.rows]
        sampled, logprobs = self._forward(batch, mx.array(inputs))
        mx.eval(sampled, logprobs)
        self.sm.cache.raise_stream_error()  # as after a decode step (`_decode`)
        ended = {}
        for i, (row, token) in enumerate(zip(batch.rows, inputs, strict=True)):
            row.tokens.append(token)
            row.input = sampled[i]
            if finish := self._hand_out(row, row.input.item(), logprobs[i]):
                ended[i] = finish
        self._end_rows(batch, ended)
        self.decode.extend(batch)
        self.ready = Batch()

    def _decode(self) -> None:
        """One decode step: starts the forward of every row's next input, then hands out
        those inputs that the step before sampled while it runs; ends the rows done."""
        batch = self.decode
        inputs = [row.input for row in batch.rows]
        sampled, logprobs = self._forward(batch, mx.concatenate(inputs))
        mx.async_eval(sampled, logprobs)
        # The inputs themselves, not their concatenation: that is part of this step's
        # forward, and waiting for it would wait for the whole forward.
        mx.eval(inputs)
        tokens = [t.item() for t in inputs]
        # A read that failed inside a stream-ordered acquire left row 0 in its place: the
        # step's tokens are wrong, so its error is raised before any is handed out.
        self.sm.cache.raise_stream_error()
        ended = {}
        for i, (row, token) in enumerate(zip(batch.rows, tokens, strict=True)):
            row.tokens.append(token)
            if row.logprobs is not None and (finish := self._hand_out(row, token, row.logprobs)):
                ended[i] = finish
            row.input, row.logprobs = sampled[i], logprobs[i]
        with self.thread.stats.lock:
            self.thread.stats.decode_steps += 1
            self.thread.stats.decode_rows += len(tokens)
        self.steps += 1
        if self.steps % CLEAR_CACHE_STEPS == 0:
            mx.clear_cache()
        self._end_rows(batch, ended)

    def _forward(self, batch: Batch, inputs: mx.array) -> tuple[list[mx.array], mx.array]:
        """One forward of `inputs` (rows,), a token a row of `batch`, lazy: each row's
        next token sampled by its own sampler ((1,) each), and the log-probabilities
        (rows, vocab) they were sampled from."""
        logits = self.sm.model(inputs[:, None], cache=batch.kv)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return [row.sample(logprobs[i : i + 1]) for i, row in enumerate(batch.rows)], logprobs

    def _hand_out(self, row: Row, token: int, logprobs: mx.array) -> str | None:
        """Hands `token`, sampled from `logprobs` (vocab,), to `row`'s reply; returns how
        it ends the reply: "stop" (end of sequence), "length" (max_tokens) or None."""
        reply = row.reply
        finish = None
        if token in self.eos:
            finish = "stop"
        elif reply.sent + 1 >= reply.job.max_tokens:
            finish = "length"
        row.first = row.first or time.monotonic()
        reply.respond(token, row.text(token, finish, self.tokenizer), logprobs)
        return finish

    def _rates(self, row: Row) -> tuple[float | None, float | None]:
        """(prefill, decode) tokens/s of `row` so far, by mlx-lm's definitions: prompt
        tokens fed over the time to the first token; every token over the time since the
        first (None with fewer than 2)."""
        reply, now = row.reply, time.monotonic()
        if row.first is None:
            return None, None
        fed = len(reply.job.prompt) - reply.cached
        prefill = fed / (row.first - reply.began) if row.first > reply.began else None
        decode = reply.sent / (now - row.first) if reply.sent > 1 and now > row.first else None
        return prefill, decode

    def _end_rows(self, batch: Batch, ended: dict[int, str]) -> None:
        """Ends the replies of the rows of `batch` at the indices of `ended` (their finish
        reasons) and takes them out; their KV goes to the prompt cache."""
        for (row, cache), finish in zip(batch.take(list(ended)), ended.values(), strict=True):
            self.thread.keep(row.tokens, cache)
            self._end(row, finish, stopped=False)

    def _end(self, row: Row, finish: str | None, stopped: bool) -> None:
        """Ends `row`'s reply, taken out of the batch."""
        row.reply.end(row.reply.sent, finish, stopped, *self._rates(row))
        self.thread.active.pop(row.reply.job, None)

    def _drop_stopping(self) -> None:
        """Takes the rows whose reply is to end (`Reply.stopping`) out of the batch,
        wherever they are; their KV goes to the prompt cache."""
        for batch in self.batches:
            gone = [i for i, row in enumerate(batch.rows) if row.reply.stopping()]
            for row, cache in batch.take(gone):
                if row.tokens:
                    self.thread.keep(row.tokens, cache)
                self._end(row, None, stopped=True)

    def _end_all(self, error: Exception | None) -> None:
        """Ends every row after a turn that did not finish, failed with `error`, or
        stopped (None: the server is shutting down), and drops their KV: it is
        mid-forward."""
        for row in self.rows:
            if error is None:
                row.reply.end(row.reply.sent, None, True, *self._rates(row))
            else:
                row.reply.fail(error)
            self.thread.active.pop(row.reply.job, None)
        self.prefill, self.ready, self.decode = Batch(), Batch(), Batch()

    def _idle(self) -> None:
        """Between bursts, as between replies generated alone (engine.generate.generate):
        the last forward has ended, the routing recorded so far is copied, the pools are
        written by the host again, and autopin repins."""
        sm = self.sm
        try:
            if (recorder := sm.predictor.recorder) is not None:
                recorder.settle()
            mx.synchronize(generation_stream)
            sm.cache.set_staging(False)
            if sm.config.autopin_frac > 0:
                pins = autopin.repin(sm.cache, sm.autopin_budget())
                autopin.save(sm.pin_path, pins, sm.store.manifest.num_experts)
        except Exception as e:  # noqa: BLE001  (no reply to fail: /health says it)
            with self.thread.stats.lock:
                self.thread.stats.last_error = f"between replies: {type(e).__name__}: {e}"
