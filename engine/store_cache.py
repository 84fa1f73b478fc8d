"""The store cache: expert stores converted from mlx-lm model directories on first use,
keyed by the model's content, so two copies of one model share a store and a changed
model gets a new one. `expertstream cache list|rm` shows and removes them.

A store is `<cache>/<name>-<key>`, `<name>` being the model directory's name, or
`org--name` for a snapshot of the Hugging Face cache; a copy under another name finds it
by its key. Its directory's modification time is its last use (touched on every load),
and `SOURCE_FILE` in it names the model it was last loaded from.
"""

import hashlib
import json
import os
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from engine.convert import NotInPlaceError, aux_files, convert, index_in_place
from engine.hub import hub_cache_dir, repo_of
from engine.safe_io import ModelFileError, atomic_write, open_regular, read_json_object
from engine.store import (
    BLOB,
    IN_PLACE,
    MANIFEST_FILE,
    VERSION,
    ExpertStore,
    StaleStoreError,
    StoreError,
    is_store,
    read_config,
    store_version,
)

# {"model": the name it was loaded by (a hub id or a directory), "dir": that directory}
SOURCE_FILE = "source.json"
# What a model directory's first use writes: an in-place store where the checkpoint's
# experts are stacked tensors as its files store them, else (or with BLOB here) a blob
# store. Chosen from the figures of docs/benchmarks.md ("In place or a copy").
FIRST_USE = IN_PLACE

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
    name = (repo_of(model_dir) or model_dir.resolve().name).replace("/", "--")
    return root / f"{name}-{key}"


def cached_store(store: Path, blob_layers: range | None = None) -> ExpertStore | None:
    """The cached store `store`, or None where it must be written (again): absent,
    incomplete, of an older format, or an in-place store whose files changed or went
    missing since it indexed them.

    Raises:
        StoreError: the store is there but fails validation otherwise.
    """
    if store_version(store) != VERSION:
        return None
    try:
        return ExpertStore(store, blob_layers)
    except StaleStoreError:
        return None


def write_store(model_dir: Path, store: Path, force: bool, progress=None, announce=None) -> Path:
    """Writes the store of `model_dir` at `store` for its first use: as `FIRST_USE` says
    (`engine.convert.index_in_place`, falling back to `convert` where the experts cannot
    be read in place). `progress` and `announce` as those functions take them.

    Raises:
        The errors of `engine.convert.convert`.
    """
    if FIRST_USE == IN_PLACE:
        try:
            return index_in_place(
                model_dir, store, force=force, progress=progress, announce=announce
            )
        except NotInPlaceError:
            pass
    return convert(model_dir, store, force=force, progress=progress, announce=announce)


def record_use(store: Path, model: str, model_dir: Path) -> None:
    """Records a use of `store`, loaded as `model` (a hub id or a directory) from
    `model_dir`: its directory's modification time, and `SOURCE_FILE` when it names
    another source. Best effort: a read-only cache still loads."""
    source = {"model": str(model), "dir": str(Path(model_dir).absolute())}
    try:
        if _source(store) != source:
            with atomic_write(store / SOURCE_FILE) as f:
                f.write(json.dumps(source).encode())
        os.utime(store)
    except OSError:
        pass


def _source(store: Path) -> dict | None:
    """What `record_use` last wrote in `store`, or None."""
    try:
        return read_json_object(store / SOURCE_FILE)
    except (OSError, ModelFileError):
        return None


@dataclass
class CachedStore:
    """One store of the cache.

    Attributes:
        path: the store's directory.
        model: the model it was last loaded as (a hub id, a directory), or its
            model_type when unknown.
        kind: how it holds the experts: `BLOB` (written again, in blob files) or
            `IN_PLACE` (an index of the model's own files).
        size_bytes: bytes on disk of the store.
        download: the hub snapshot folder it was converted from, when that is in the
            Hugging Face cache (None for a model directory of the user's).
        download_bytes: bytes on disk of that snapshot's files (0 without one).
        last_used: its last use, seconds since the epoch.
    """

    path: Path
    model: str
    kind: str
    size_bytes: int
    download: Path | None
    download_bytes: int
    last_used: float


def _tree_bytes(path: Path, follow: bool) -> int:
    """Bytes of the files under `path` (links to files counted when `follow`)."""
    total = 0
    for f in path.rglob("*"):
        try:
            if (follow or not f.is_symlink()) and f.is_file():
                total += f.stat().st_size
        except OSError:
            continue
    return total


def _download_of(source: dict | None) -> Path | None:
    """The hub snapshot folder a store came from, where it still is in the hub cache."""
    folder = Path(source["dir"]) if source and isinstance(source.get("dir"), str) else None
    if folder is None or repo_of(folder) is None or not folder.is_dir():
        return None
    return folder if folder.resolve().is_relative_to(hub_cache_dir().resolve()) else None


def list_stores() -> list[CachedStore]:
    """The stores in the cache, most recently used first (other entries are skipped)."""
    root = store_cache_dir()
    out = []
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if not p.is_dir() or p.is_symlink() or not (p / MANIFEST_FILE).is_file():
            continue
        source = _source(p)
        model = source.get("model") if source else None
        if not isinstance(model, str):
            try:
                model = str(read_config(p).get("model_type", "?"))
            except StoreError:
                model = "?"
        download = _download_of(source)
        try:
            kind = read_json_object(p / MANIFEST_FILE).get("kind", BLOB)
        except (OSError, ModelFileError):
            kind = "?"
        out.append(
            CachedStore(
                path=p,
                model=model,
                kind=str(kind),
                size_bytes=_tree_bytes(p, follow=False),
                download=download,
                download_bytes=0 if download is None else _tree_bytes(download, follow=True),
                last_used=p.stat().st_mtime,
            )
        )
    return sorted(out, key=lambda s: -s.last_used)


def remove_store(name: str, download: bool = False) -> tuple[Path, Path | None]:
    """Deletes the cached store `name` (a directory name that `list_stores` shows), and
    with `download` the hub snapshot it came from (that revision, through
    huggingface_hub's own cache deletion: files other revisions share stay).

    Returns:
        (the store removed, the hub snapshot it came from or None): the snapshot is
        removed with `download`, else kept.

    Raises:
        ValueError: `name` is a path rather than a name, or no store of the cache has it.
    """
    if not name or Path(name).name != name or name in (".", ".."):
        raise ValueError(f"{name!r} is not a store name (see `expertstream cache list`)")
    path = store_cache_dir() / name
    if path.is_symlink() or not (path / MANIFEST_FILE).is_file():
        raise ValueError(f"no store named {name!r} in {store_cache_dir()}")
    snapshot = _download_of(_source(path))
    shutil.rmtree(path)
    if download and snapshot is not None:
        from huggingface_hub import scan_cache_dir

        scan_cache_dir(hub_cache_dir()).delete_revisions(snapshot.name).execute()
    return path, snapshot


def age(seconds_since_epoch: float) -> str:
    """'3 min ago', '2 h ago', '5 days ago' for a past time."""
    s = max(0.0, time.time() - seconds_since_epoch)
    for unit, n in (("days", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.0f} {unit} ago"
    return "just now"
