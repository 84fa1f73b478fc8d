"""Continuous batching behind `expertstream serve`: the replies of up to `--max-batch`
requests generated side by side by mlx-lm's own `BatchGenerator` over the streamed model.

A request joins the batch between decode steps: the generation thread takes it from the
queue, finds its prompt's longest known prefix in the prompt cache and hands the rest
to the generator, which prefills it (with any other prompt that joined) one
`prefill_step_size` forward per step, so a long prompt holds the others up for one
such forward at a time, then decodes it with the batch: one forward of every row's last
token per step. A reply leaves the batch when it ends: at the end-of-sequence token or
its max_tokens, or at the next step after a stop string cut its text or its client went
(its KV then goes to the prompt cache, as a whole reply's does).

Each row keeps what is its own: its sampler and seed (`engine.generate.keyed_sampler`: a
random key of its own, so a seeded reply repeats whatever else is in the batch), its
stop strings, log-probabilities and text (`engine.serve.reply.Reply`), its KV. A decode
step is one forward of the model over (rows, 1) tokens: each MoE layer's call carries
every row's ids, and the expert cache serves their union (the stream-ordered path while
the union fits the slots, the over-capacity path beyond them), so the rows of a step
share each expert's read. The cache's counters are the server's totals; the tokens are
counted per reply.

mlx-lm computes each row alone where the rows differ (its own KV, a mask over the left
padding that aligns them), so a greedy reply in a batch is the one the request gets
alone wherever the backend's batched kernels give each row the result they give one
(docs/server.md: "Many conversations at once").
"""

import queue
import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generation_stream
from mlx_lm.models.cache import make_prompt_cache

from engine import autopin
from engine.generate import keyed_sampler, restore_space
from engine.predictor import GenerationStopped
from engine.serve.bodies import Job
from engine.serve.reply import Reply


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
        seen: its tokens until the first that decodes to text (`restore_space`); None
            after it.
        first: when its first token came (`time.monotonic()`), or None.
    """

    reply: Reply
    detokenizer: object
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


class BatchLoop:
    """The generation thread's loop with `max_batch` above 1: it takes jobs into the
    batch and runs its steps until the thread is closed (`run`).

    Args:
        thread: the engine.serve.server.GenerationThread (its model, queue, prompt
            cache, counters and `active` replies).
    """

    def __init__(self, thread):
        self.thread = thread
        self.sm = thread.sm
        self.tokenizer = thread.sm.tokenizer
        self.rows: dict[int, Row] = {}  # generator uid -> row
        self.generator: BatchGenerator | None = None
        self.closed = False  # the queue said None: end once the rows have ended

    def run(self) -> None:
        """Serves jobs until the thread is closed. A shutdown (`cancel_all`) ends the
        step in progress at its next MoE layer."""
        self.sm.predictor.should_stop = lambda: self.thread._closing
        try:
            while True:
                self._take_jobs()
                if not self.rows:
                    if self.closed:
                        return
                    continue
                self._step()
        finally:
            self.sm.predictor.should_stop = None

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
        """Puts `reply`'s job into the generator over its prompt's cached prefix."""
        job: Job = reply.job
        if self.generator is None:
            eos = [[t] for t in self.tokenizer.eos_token_ids]
            self.generator = BatchGenerator(
                self.sm.model,
                stop_tokens=eos,
                completion_batch_size=self.thread.max_batch,
                prefill_batch_size=self.thread.max_batch,
                prefill_step_size=self.thread.prefill_step_size,
                stream=generation_stream,
            )
            if (recorder := self.sm.predictor.recorder) is not None:
                recorder.begin_segment()
        cache, cached = self.thread.fetch(job.prompt)
        reply.start(cached)
        (uid,) = self.generator.insert(
            [job.prompt[cached:]],
            max_tokens=[job.max_tokens],
            caches=[cache],
            all_tokens=[job.prompt[:cached]],
            samplers=[keyed_sampler(job.temperature, job.top_p, job.seed)],
        )
        self.rows[uid] = Row(reply, self.tokenizer.detokenizer)
        if (prompts := self.thread.prompt_cache) is not None:  # the batch's KV counts too
            batch = self.generator.prompt_cache_nbytes
            prompts.trim_to(n_bytes=max(0, self.thread.prompt_cache_bytes - batch))

    def _step(self) -> None:
        """One step of the generator (a decode step of the rows decoding, a prefill
        forward of the rows prefilling), its tokens handed to their replies; ends the
        rows that are done."""
        t0, responses = time.monotonic(), []
        try:
            _, responses = self.generator.next()
            # A read that failed inside a stream-ordered acquire left row 0 in its place:
            # the step's tokens are wrong, so its error is raised before any is handed out.
            self.sm.cache.raise_stream_error()
            now = time.monotonic()
            for r in responses:
                row = self.rows[r.uid]
                row.first = row.first or now
                text = row.text(r.token, r.finish_reason, self.tokenizer)
                row.reply.respond(r.token, text, r.logprobs)
                if r.finish_reason is not None:
                    self.thread.keep(r.all_tokens, r.prompt_cache)
                    self._end(r.uid, r.finish_reason, stopped=False)
            self._drop_stopping()
        except GenerationStopped:  # the server is shutting down
            self._end_all(None)
        except Exception as e:  # noqa: BLE001  (the batch's requests fail; the server goes on)
            self._end_all(e)
        finally:
            with self.thread.stats.lock:
                s = self.thread.stats
                s.generation_seconds += time.monotonic() - t0
                s.decode_steps += bool(responses)
                s.decode_rows += len(responses)
        if not self.rows:
            self._idle()

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

    def _end(self, uid: int, finish: str | None, stopped: bool) -> None:
        row = self.rows.pop(uid)
        row.reply.end(row.reply.sent, finish, stopped, *self._rates(row))
        self.thread.active.pop(row.reply.job, None)

    def _drop_stopping(self) -> None:
        """Takes the rows whose reply is to end (`Reply.stopping`) out of the batch; their
        KV goes to the prompt cache."""
        gone = [uid for uid, row in self.rows.items() if row.reply.stopping()]
        if not gone:
            return
        for cache, tokens in self.generator.remove(gone, return_prompt_caches=True).values():
            if tokens:
                self.thread.keep(list(tokens), cache)
        for uid in gone:
            self._end(uid, None, stopped=True)

    def _end_all(self, error: Exception | None) -> None:
        """Ends every row after a step that did not finish, failed with `error`, or
        stopped (None: the server is shutting down), and drops the generator: its KV is
        mid-forward."""
        for row in self.rows.values():
            if error is None:
                row.reply.end(row.reply.sent, None, True, *self._rates(row))
            else:
                row.reply.fail(error)
            self.thread.active.pop(row.reply.job, None)
        self.rows.clear()
        self.generator = None

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
        finally:
            self.generator = None  # the next burst starts afresh (and a trace segment)
