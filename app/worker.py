"""The engine thread: loading and generation run there, never on the GUI thread.

Commands (load, generate, unload) are queued to one daemon thread per process; `stop`
and cancel are `threading.Event`s read by the worker between tokens / convert steps, so
the GUI never waits on it. Results come back as Qt signals of `Worker` (a QObject of the
GUI thread; emitting from the engine thread queues them to the GUI's event loop) and
carry plain Python data only (str, int, float, dataclasses of those): MLX arrays and
streams stay on the thread that made them. The engine is imported there too.

The engine thread lives as long as the process. MLX keeps per-thread state whose
destructor takes the GIL; a thread that ends while the interpreter is finalizing aborts
the process ("terminate called without an active exception"), so it must not end;
and it must be idle by then: Python ends a daemon thread that wakes during
finalization from inside its own thread-exit, which aborts the same way. So
`expertstream-gui` calls `ServiceThread.drain_all` before it returns.

Things the GUI thread calls directly, thread-safe in the engine: `snapshot()` (numpy
copies, polled by the inspector), `trace()` (the session's routing as numpy, recorded
by `engine.trace.record` on the engine thread, for the advisor) and the live toggles `set_prefetch`,
`set_side_lfu`, `set_sync` (they take effect at the next forward boundary / submission).
"""

import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QObject, Signal

from app.conversation import Conversation, prompt_ids
from app.defaults import app_defaults

LIVE_FIELDS = ("prefetch", "side_lfu", "sync")
TRACE_TOKENS = 4096  # routing kept for the advisor, tokens (the app's default)
# The app records expert ids only: the router's top probabilities cost about 4% of decode
# CPU time (ids alone about 1%: docs/benchmarks.md), and the advisor's replay gives the
# same hit rates without them (within 0.1 point).
RECORD_ROUTER = False

# The names of the pool settings as the window labels them (app.controls), for messages
# about their values; other fields keep their command-line flag's name.
SETTING_NAMES = {
    "expert_slots": "expert slots",
    "expert_memory": "expert memory",
    "side_slots": "side rows",
    "autopin_frac": "autopin budget",
    "ahead_lo": "ahead lo",
    "ahead_hi": "ahead hi",
    "cutoff": "cutoff",
}


class _Cancelled(Exception):
    """Raised in the convert or download progress callback when the app is closing."""


@dataclass
class ModelInfo:
    """What the GUI knows of the loaded model (plain data)."""

    name: str
    path: str
    store_path: str
    layers: list[int]
    num_experts: int
    top_k: int
    config: object
    # The load's memory plan (engine.memory_plan.MemoryPlan): real_slots per MoE layer as
    # the config gives them, layer_slots the pool's (the layers no layer prefetches for
    # hold their 2 x side rows as slots), the host tier, bytes and the memory available.
    plan: object
    chat_template: bool
    pool_bytes: int
    budget: object  # engine.advisor.Budget of the plan
    load_seconds: float
    context: int | None
    note: str = ""  # what the load changed of the settings asked for, and why
    compile_note: str = ""  # MLX CUDA's first compiles ahead (engine.kernel_cache), or ""


class ServiceThread:
    """A thread of the process that runs submitted callables one at a time, in order,
    and never ends (see the module docstring): the engine thread, the advisor's."""

    _instances: dict[str, "ServiceThread"] = {}
    _lock = threading.Lock()

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    @classmethod
    def get(cls, name: str = "expertstream-engine") -> "ServiceThread":
        """The thread called `name`, started on first use."""
        with cls._lock:
            if name not in cls._instances:
                cls._instances[name] = cls(name)
            return cls._instances[name]

    def submit(self, fn: Callable[[], None]) -> None:
        self._queue.put(fn)

    def drain(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds for everything submitted so far to have run;
        True when it has."""
        done = threading.Event()
        self.submit(done.set)
        return done.wait(timeout)

    @classmethod
    def drain_all(cls, timeout: float = 60.0) -> bool:
        """Drains every service thread (see the module docstring), each for up to
        `timeout` seconds; True when all are idle."""
        with cls._lock:
            threads = list(cls._instances.values())
        return all([t.drain(timeout) for t in threads])

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            try:
                fn()
            except Exception:  # noqa: BLE001  (a command's own errors are its signals)
                traceback.print_exc()


class Worker(QObject):
    """Its methods `load`, `generate` and `unload` run on the engine thread; it is
    created on (and its signals delivered to) the GUI thread."""

    loadProgress = Signal(float, float)  # done bytes, total bytes of a first use's store
    firstUse = Signal(str)  # what a first use does to make the store: "indexing", "converting"
    downloadProgress = Signal(float, float)  # done bytes, total bytes of a hub download
    loaded = Signal(object)  # ModelInfo
    loadFailed = Signal(str)
    token = Signal(str, int)  # text segment, token id
    replyFinished = Signal(object)  # engine.generate.GenerationResult
    replyFailed = Signal(str, str)  # message, partial reply text

    def __init__(self, stop: threading.Event, cancel: threading.Event):
        super().__init__()
        self._stop = stop
        self._cancel = cancel
        self._lock = threading.Lock()
        self._sm = None
        self._session = None  # engine.generate.ChatSession of the loaded model
        self._last_progress = 0.0
        self.trace_tokens = TRACE_TOKENS
        self._recorder = None  # engine.trace.TraceRecorder: the session's routing

    # called from the GUI thread
    def snapshot(self):
        """The loaded model's CacheSnapshot, or None before the first load."""
        with self._lock:
            return None if self._sm is None else self._sm.snapshot()

    def set_live(self, name: str, on: bool) -> None:
        """Applies one live toggle (`LIVE_FIELDS`) to the loaded model."""
        with self._lock:
            if self._sm is not None:
                getattr(self._sm, f"set_{name}")(on)

    def trace(self):
        """The session's routing trace so far (numpy; an engine.trace.Trace), or None
        when nothing is recorded."""
        rec = self._recorder
        return None if rec is None else rec.trace("session")

    # run on the engine thread
    def set_trace_tokens(self, tokens: int) -> None:
        """Keeps the last `tokens` tokens of routing (0: stops recording, drops it)."""
        self.trace_tokens = tokens
        if tokens == 0:
            if self._recorder is not None:
                self._recorder.close()
            self._recorder = None
        elif self._recorder is not None:
            self._recorder.set_max_tokens(tokens)
        elif self._sm is not None:
            from engine.trace import record

            self._recorder = record(self._sm, tokens, router=RECORD_ROUTER)

    def _progress(self, done: int, total: int) -> None:
        self._report(self.loadProgress, done, total)

    def _download_progress(self, done: int, total: int) -> None:
        self._report(self.downloadProgress, done, total)

    def _report(self, signal, done: int, total: int) -> None:
        """Emits `signal(done, total)` at most every 50 ms (and at the end); raises
        _Cancelled once the app is closing, which ends the convert or download."""
        if self._cancel.is_set():
            raise _Cancelled
        now = time.monotonic()
        if done >= total or now - self._last_progress > 0.05:
            self._last_progress = now
            signal.emit(float(done), float(total))

    def load(self, path, overrides: dict) -> None:
        """Loads `path` (None: the embedded model) with the app defaults overridden by
        `overrides` (StreamConfig fields); emits `loaded` or `loadFailed`. The model
        in use stays until the new one has loaded."""
        t0 = time.monotonic()
        try:
            from engine import kernel_cache
            from engine.advisor import Budget
            from engine.cache import PoolMemoryError, pool_bytes
            from engine.config import ConfigError, StreamConfig
            from engine.flags import describe, flag_names, with_defaults
            from engine.generate import ChatSession
            from engine.open_model import open_model
            from engine.resources import default_model_path
            from engine.store import IN_PLACE

            def app_config(m) -> StreamConfig:
                return StreamConfig(
                    **with_defaults(app_defaults(m.num_experts, m.top_k), overrides)
                )

            source = Path(default_model_path() if path is None else path)
            compiles = kernel_cache.compile_note()
            sm = open_model(
                source,
                app_config,
                auto_when_too_large=overrides.get("expert_slots") is None
                and overrides.get("expert_memory") is None,
                progress=self._progress,
                download=self._download_progress,
                announce=lambda kind, _written, _experts: self.firstUse.emit(
                    "indexing" if kind == IN_PLACE else "converting"
                ),
            )
        except _Cancelled:
            return
        except (ConfigError, PoolMemoryError) as e:  # named as the window labels them
            where = path or "the embedded model"
            names = flag_names() | SETTING_NAMES
            words = e.in_words(names) if isinstance(e, PoolMemoryError) else describe(e, names)
            self.loadFailed.emit(f"could not open {where}: {words}")
            return
        except Exception as e:  # noqa: BLE001  (any failure is reported, the app goes on)
            self.loadFailed.emit(f"could not open {path or 'the embedded model'}: {error_text(e)}")
            return
        store, m = sm.store, sm.store.manifest
        old = self._sm
        with self._lock:
            self._sm = sm
        self._session = ChatSession(sm)
        self._record(sm, old)
        del old  # freed here, on the engine thread
        self.loaded.emit(
            ModelInfo(
                name=source.name,
                path=str(source),
                store_path=str(store.path),
                layers=[s.layer for s in m.layers],
                num_experts=m.num_experts,
                top_k=m.top_k,
                config=sm.config,
                plan=sm.plan,
                chat_template=bool(getattr(sm.tokenizer, "chat_template", None)),
                pool_bytes=pool_bytes(sm.cache),
                budget=Budget.of(sm.plan),
                load_seconds=time.monotonic() - t0,
                context=store.context_length,
                note=_fallback_note(sm.plan),
                compile_note=compiles,
            )
        )

    def _record(self, sm, old) -> None:
        """Records `sm`'s routing; a rebuild of the same model keeps the trace so far
        (routing does not depend on the cache)."""
        from engine.trace import record

        rec = self._recorder
        if self.trace_tokens == 0:
            return
        if rec is not None and old is not None and old.store.path == sm.store.path:
            rec.attach(sm)
        else:
            if rec is not None:
                rec.close()
            self._recorder = record(sm, self.trace_tokens, router=RECORD_ROUTER)

    def generate(self, request: dict) -> None:
        """Generates a reply to `request["conversation"]` (a Conversation) with
        `system` (the system prompt), `max_tokens`, `temperature`, `top_p`; emits `token`
        per token, then `replyFinished` (also when stopped) or `replyFailed`. The model's
        KV cache is kept between replies, so a follow-up prefills only its new turn."""
        from engine.generate import ContextError

        text: list[str] = []
        try:
            sm = self._sm
            if sm is None:
                raise RuntimeError("no model is loaded")
            conv: Conversation = request["conversation"]
            ids = prompt_ids(sm.tokenizer, conv, request["system"])

            def on_response(r):
                text.append(r.text)
                self.token.emit(r.text, int(r.token))

            result = self._session.generate(
                ids,
                request["max_tokens"],
                temperature=request["temperature"],
                top_p=request["top_p"],
                on_response=on_response,
                stop=self._stop.is_set,
            )
            self.replyFinished.emit(result)
        except ContextError as e:
            self.replyFailed.emit(_context_message(e), "".join(text))
        except Exception as e:  # noqa: BLE001  (shown in the window; the app goes on)
            self.replyFailed.emit(error_text(e), "".join(text))
        finally:
            _settle_random_state()

    def unload(self) -> None:
        """Drops the model (on the engine thread, where its arrays were made)."""
        with self._lock:
            sm, self._sm = self._sm, None
        self._session = None
        if self._recorder is not None:
            self._recorder.close()
        del sm


def error_text(e: Exception) -> str:
    """An exception as the window says it: its message, an OSError's file and reason
    (`engine.safe_io.os_error_text`), never Python's name for it; the name only for
    an exception that carries no message at all (a bug to report)."""
    from engine.safe_io import os_error_text

    text = os_error_text(e) if isinstance(e, OSError) else str(e)
    return text or f"an internal error ({type(e).__name__}, no message)"


def _fallback_note(plan) -> str:
    """What the load changed of the app's default pool size, in the window's words: ""
    when nothing, else that the default did not fit (`MemoryPlan.fell_back`) and what
    expert memory auto bought instead."""
    from engine.config import AUTO_MEMORY_FRACTION
    from engine.memory import human_bytes

    if not plan.fell_back:
        return ""
    asked = plan.asked
    return (
        f"The default {asked.config.expert_slots} expert slots per layer "
        f"({human_bytes(asked.expert_bytes)}) and the dense weights "
        f"({human_bytes(asked.dense_bytes)}) exceed the {human_bytes(plan.available)} of "
        f"memory available: expert memory is set to auto ({AUTO_MEMORY_FRACTION:.0%} of it, "
        f"{plan.slots_text()} slots per layer), so the experts stream from disk"
    )


def _context_message(e) -> str:
    """A ContextError (engine.generate) in the window's terms: which setting to lower."""
    room = e.limit - e.prompt_tokens
    fix = f"lower max tokens to {room} or less" if room >= 1 else "start a new chat"
    return (
        f"the conversation ({e.prompt_tokens} tokens) + max tokens ({e.max_tokens}) exceeds "
        f"the model's context of {e.limit} tokens: {fix}"
    )


def _settle_random_state() -> None:
    """Evaluates MLX's global random key, which sampling leaves as a lazy array of this
    thread's stream (any other thread, e.g. at exit, must not be the one to free it)."""
    import mlx.core as mx

    mx.eval(mx.random.state)


class EngineClient:
    """The GUI side of the engine thread. Signals of the worker are `self.worker.*`."""

    def __init__(self):
        self._stop = threading.Event()
        self._cancel = threading.Event()
        self.worker = Worker(self._stop, self._cancel)
        self._thread = ServiceThread.get()

    def load(self, path: str | None, overrides: dict) -> None:
        """Queues a load of `path` (None: embedded model) with StreamConfig `overrides`."""
        overrides = dict(overrides)
        self._thread.submit(lambda: self.worker.load(path, overrides))

    def generate(
        self,
        conversation: Conversation,
        max_tokens: int,
        temperature: float,
        top_p: float,
        system: str = "",
    ) -> None:
        """Queues a reply to (a copy of) `conversation`, with the `system` prompt
        (chat-template models only)."""
        self._stop.clear()
        request = {
            "conversation": conversation.copy(),
            "system": system,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
        }
        self._thread.submit(lambda: self.worker.generate(request))

    def stop(self) -> None:
        """Asks the reply in progress to end after its current token."""
        self._stop.set()

    def snapshot(self):
        """The loaded model's CacheSnapshot (thread-safe), or None."""
        return self.worker.snapshot()

    def trace(self):
        """The session's routing trace (numpy, thread-safe), or None."""
        return self.worker.trace()

    def set_trace_tokens(self, tokens: int) -> None:
        """Queues a new bound of the recorded routing (0: off), applied between replies."""
        self._thread.submit(lambda: self.worker.set_trace_tokens(tokens))

    def set_live(self, name: str, on: bool) -> None:
        """Sets a live toggle (prefetch, side_lfu, sync) on the loaded model now."""
        self.worker.set_live(name, on)

    def shutdown(self, timeout: float = 60.0) -> bool:
        """Stops any reply or convert, drops the model, and waits (up to `timeout`
        seconds) until the engine thread has done so; True when it has."""
        self._stop.set()
        self._cancel.set()
        done = threading.Event()

        def unload() -> None:
            self.worker.unload()
            done.set()

        self._thread.submit(unload)
        return done.wait(timeout)
