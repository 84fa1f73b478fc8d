"""SIGKILL at any instant: a convert (replacing an
older store), an autopin save, a trace save and a generation with prefetch in flight,
each killed at a random moment. The next start finds the old state or the new one, never
a half-written store, pin file or trace, and removes (or puts back) what the killed run
left.

Each kill is a child process that repeats its operation until the parent kills it after
a random delay (seeded; the seed is in the test id), so the kill lands anywhere in it.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from test_hostile_files import write_tokenizer

from engine import autopin
from engine.config import StreamConfig
from engine.convert import convert
from engine.generate import generate
from engine.model import load
from engine.safe_io import remove_leftovers
from engine.store import ExpertStore

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT = 120.0
TRACE_TOKENS = 100_000  # a save of some 0.1 s: a kill lands mostly inside one


def run_and_kill(code: str, seed: int, lo: float, hi: float) -> str:
    """Runs `code` in a child Python, waits for its first output line ("ready"), then
    SIGKILLs it after a delay drawn uniformly from [lo, hi] with `seed`. Returns what the
    child printed (its progress)."""
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ | {"PYTHONPATH": str(ROOT / "tests")},
    )
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        first = child.stdout.readline()
        assert first.strip() == "ready", first + child.stdout.read()
        assert time.monotonic() < deadline
        time.sleep(random.Random(seed).uniform(lo, hi))
        assert child.poll() is None, "the child ended before it was killed: " + child.stdout.read()
    finally:
        child.send_signal(signal.SIGKILL)
        out = child.communicate(timeout=60)[0]
    assert child.returncode == -signal.SIGKILL
    return out


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def assert_complete_store(path: Path) -> ExpertStore:
    store = ExpertStore(path)
    assert store.verify() == len(store.manifest.layers) * store.manifest.num_experts
    store.dense_weights()  # size, crc32 and header of the dense file
    return store


@pytest.mark.parametrize("seed", [1, 2])
def test_convert_killed_at_any_instant(model_dirs, tmp_path, seed):
    """The child converts over and over into one store (force: each round replaces the
    last), killed mid-way: the store is the old one or the new one, and the next convert
    removes the killed run's temporary directory."""
    model_dir = model_dirs("qwen3_moe")
    out = tmp_path / "out"
    out.mkdir()
    store = out / "store"
    convert(model_dir, store)  # the old state
    progress = run_and_kill(
        f"""
        from engine.convert import convert
        print("ready", flush=True)
        for i in range(10**6):
            convert({str(model_dir)!r}, {str(store)!r}, force=True)
            print("round", i, flush=True)
        """,
        seed,
        0.0,
        2.5,
    )
    assert "Traceback" not in progress, progress
    assert_complete_store(store)
    left = leftovers(out)
    assert all(name.startswith(".store.") for name in left), left
    remove_leftovers(out, "store")  # what the next convert (or load) does first
    assert sorted(p.name for p in out.iterdir()) == ["store"]


def test_killed_between_the_renames_the_old_store_is_put_back(model_dirs, tmp_path):
    """Killed after the old store was moved aside and before the new one took its place
    (a window too short to hit by timing): the next start puts the old store back."""
    model_dir = model_dirs("qwen3_moe")
    convert(model_dir, tmp_path / "store")
    dead = subprocess.Popen(["true"])
    dead.wait()
    os.rename(tmp_path / "store", tmp_path / f".store.old-{dead.pid}")
    shutil.copytree(tmp_path / f".store.old-{dead.pid}", tmp_path / f".store.tmp-{dead.pid}")
    sm = load(tmp_path / "store", StreamConfig(expert_slots=2))
    assert leftovers(tmp_path) == [] and sm.store.path == tmp_path / "store"
    assert_complete_store(tmp_path / "store")


def test_leftovers_of_live_processes_are_kept(tmp_path):
    """A run in progress (here: this process) is never cleaned up under its feet."""
    mine = tmp_path / f".store.tmp-{os.getpid()}"
    mine.mkdir()
    assert remove_leftovers(tmp_path) == [] and mine.exists()


@pytest.mark.parametrize("seed", [5])
def test_autopin_save_killed_at_any_instant(tmp_path, seed):
    path = tmp_path / autopin.PIN_FILE
    progress = run_and_kill(
        f"""
        import random
        from engine import autopin
        rng = random.Random({seed})
        print("ready", flush=True)
        for i in range(10**9):
            pins = [sorted(rng.sample(range(64), rng.randint(0, 64))) for _ in range(48)]
            autopin.save({str(path)!r}, pins, 64)
        """,
        seed,
        0.2,
        1.5,
    )
    assert "Traceback" not in progress, progress
    saved = json.loads(path.read_text())  # a whole file: old or new, never a part
    pins = autopin.load(path, 64, 48, 64)
    assert saved["num_experts"] == 64 and pins == [sorted(p) for p in saved["pins"]]
    remove_leftovers(tmp_path, autopin.PIN_FILE)
    assert [p.name for p in tmp_path.iterdir()] == [autopin.PIN_FILE]


@pytest.mark.parametrize("seed", [7])
def test_generation_with_prefetch_killed_at_any_instant(qwen_store, tmp_path, seed):
    """A generation with prefetch in flight and autopin saving between replies, killed:
    the store is intact, the pin file whole, and the next start generates exactly what
    a fresh load does."""
    store = Path(shutil.copytree(qwen_store.path, tmp_path / "store"))
    write_tokenizer(store)
    config = "StreamConfig(expert_slots=3, side_slots=2, prefetch=True, autopin_frac=0.34)"
    progress = run_and_kill(
        f"""
        from engine.config import StreamConfig
        from engine.generate import generate
        from engine.model import load
        sm = load({str(store)!r}, {config})
        print("ready", flush=True)
        for i in range(10**6):
            generate(sm, [1, 2, 3, 1, 2, 3][: 1 + i % 6], max_tokens=24)
            print("reply", i, flush=True)
        """,
        seed,
        0.2,
        3.0,
    )
    assert "Traceback" not in progress, progress
    assert_complete_store(store)
    pin_file = store / autopin.PIN_FILE
    if pin_file.exists():
        assert len(autopin.load(pin_file, 8, 4, 8)) == 4
    sm = load(store, StreamConfig(expert_slots=3, side_slots=2, prefetch=True, autopin_frac=0.34))
    assert not [p for p in store.iterdir() if ".tmp-" in p.name]
    fresh = load(store, StreamConfig())
    a = generate(sm, [1, 2, 3], max_tokens=16).tokens
    b = generate(fresh, [1, 2, 3], max_tokens=16).tokens
    assert np.array_equal(a, b)


@pytest.mark.parametrize("seed", [11, 12])
def test_trace_save_killed_at_any_instant(tmp_path, seed):
    """Re-recording over a good trace, killed mid-save: the file is the
    old trace or the new one, whole, and the next save removes what the killed one left."""
    from engine.trace import load_trace, random_trace

    path = tmp_path / "trace.npz"
    old = random_trace(TRACE_TOKENS, 8, 64, 4, seed=0)
    old.save(path)
    progress = run_and_kill(
        f"""
        from engine.trace import random_trace
        new = random_trace({TRACE_TOKENS}, 8, 64, 4, seed=1)
        print("ready", flush=True)
        while True:
            new.save({str(path)!r})
        """,
        seed,
        0.2,
        1.5,
    )
    assert "Traceback" not in progress, progress
    got = load_trace(path).ids  # a cut .npz raises here
    new = random_trace(TRACE_TOKENS, 8, 64, 4, seed=1)
    assert np.array_equal(got, old.ids) or np.array_equal(got, new.ids)
    old.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["trace.npz"]
    assert np.array_equal(load_trace(path).ids, old.ids)


# ---- files the product writes: atomically ----------------------------


def test_a_save_removes_what_killed_saves_of_other_names_left(tmp_path):
    """`.t3.npz.tmp-PID` of a killed save of t3.npz is removed by the next save in the
    directory, of any name; a live writer's temporary and the user's files are kept."""
    from engine.trace import random_trace

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".t3.npz.tmp-{dead.pid}"
    stale.write_bytes(b"half a trace")
    live = tmp_path / f".t4.npz.tmp-{os.getpid()}"
    live.write_bytes(b"being written")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / ".hidden").write_text("mine too")
    random_trace(8, 2, 8, 2, seed=0).save(tmp_path / "t5.npz")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".hidden", live.name, "notes.txt", "t5.npz"]


def test_atomic_write_keeps_the_old_file_when_the_write_fails(tmp_path):
    from engine.safe_io import atomic_write

    path = tmp_path / "out.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="cut"), atomic_write(path) as f:
        f.write(b"new, but cut")
        raise RuntimeError("cut")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]
    with atomic_write(path) as f:
        f.write(b"new")
    assert path.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_trace_save_over_a_good_trace_that_fails_keeps_it(tmp_path, monkeypatch):
    """A save that fails mid-way (here: numpy raising as on a full disk) keeps the good
    trace that was there."""
    import numpy as np

    from engine.trace import load_trace, random_trace

    path = tmp_path / "trace.npz"
    good = random_trace(50, 4, 8, 2)
    good.save(path)

    def full_disk(f, **arrays):
        f.write(b"PK\x03\x04 a cut zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez_compressed", full_disk)
    with pytest.raises(OSError, match="No space left"):
        random_trace(50, 4, 8, 2, seed=1).save(path)
    assert np.array_equal(load_trace(path).ids, good.ids)
    assert [p.name for p in tmp_path.iterdir()] == ["trace.npz"]
