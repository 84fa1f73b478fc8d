"""The store cache: expert stores converted from mlx-lm model directories on first use,
keyed by the model's content, so two copies of one model share a store and a changed
model gets a new one. `expertstream cache list|rm` shows and removes them.

A store is `<cache>/<model dir name>-<key>`; a copy under another name finds it by its
key. Its directory's modification time is its last use (touched on every load).
"""

import hashlib
import os
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from engine.convert import aux_files
from engine.safe_io import open_regular
from engine.store import MANIFEST_FILE, StoreError, is_store, read_config

SAMPLE_BYTES = 1 << 20  # sampled from the start, middle and end of each weight file


def store_cache_dir() -> Path:
    """Where converted stores of model directories live:
    `$EXPERTSTREAM_CACHE`, else `$XDG_CACHE_HOME/expertstream`, else `~/.cache/expertstream`."""
    if root := os.environ.get("EXPERTSTREAM_CACHE"):
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "expertstream"


def content_key(model_dir: Path) -> str:
    """16 hex digits of a hash of the model's content: every plain file that goes into
    the store (config, generation config, tokenizer) in full, and of each
    `*.safetensors` file its size, its header (every tensor's name, dtype, shape and
    offsets) and `SAMPLE_BYTES` from its start, middle and end. Names of the directory
    and modification times are not part of it.

    Raises:
        OSError: a file cannot be read.
        engine.safe_io.ModelFileError: a weight file is not a regular file.
    """
    h = hashlib.sha256()
    for f in aux_files(model_dir):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f.name.encode() + b"\0")
        size = f.stat().st_size
        h.update(str(size).encode())
        with os.fdopen(open_regular(f), "rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            h.update(head + fh.read(min(n, size)))
            for at in (0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)):
                fh.seek(at)
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def store_for(model_dir: Path) -> Path:
    """The cache path of `model_dir`'s store: an existing store with its content key
    (whatever directory it was converted from), else `<cache>/<name>-<key>`."""
    key = content_key(model_dir)
    root = store_cache_dir()
    for found in sorted(root.glob(f"*-{key}")) if root.is_dir() else []:
        if is_store(found):
            return found
    return root / f"{model_dir.resolve().name}-{key}"


def touch(store: Path) -> None:
    """Records a use of `store` (its directory's modification time); best effort."""
    try:
        os.utime(store)
    except OSError:
        pass  # a read-only cache still loads


@dataclass
class CachedStore:
    """One store of the cache: `path`, `model_type`, `size_bytes`, `last_used` (epoch s)."""

    path: Path
    model_type: str
    size_bytes: int
    last_used: float


def list_stores() -> list[CachedStore]:
    """The stores in the cache, most recently used first (other entries are skipped)."""
    root = store_cache_dir()
    out = []
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if not p.is_dir() or p.is_symlink() or not (p / MANIFEST_FILE).is_file():
            continue
        try:
            model_type = read_config(p).get("model_type", "?")
        except StoreError:
            model_type = "?"
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())
        out.append(CachedStore(p, str(model_type), size, p.stat().st_mtime))
    return sorted(out, key=lambda s: -s.last_used)


def remove_store(name: str) -> Path:
    """Deletes the cached store `name` (a directory name that `list_stores` shows).

    Raises:
        ValueError: `name` is a path rather than a name, or no store of the cache has it.
    """
    if not name or Path(name).name != name or name in (".", ".."):
        raise ValueError(f"{name!r} is not a store name (see `expertstream cache list`)")
    path = store_cache_dir() / name
    if path.is_symlink() or not (path / MANIFEST_FILE).is_file():
        raise ValueError(f"no store named {name!r} in {store_cache_dir()}")
    shutil.rmtree(path)
    return path


def age(seconds_since_epoch: float) -> str:
    """'3 min ago', '2 h ago', '5 days ago' for a past time."""
    s = max(0.0, time.time() - seconds_since_epoch)
    for unit, n in (("days", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.0f} {unit} ago"
    return "just now"
