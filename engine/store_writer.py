"""The one writer of expert stores (the format of `engine.store` / docs/store-format.md).

`StoreWriter` builds a store in a temporary sibling directory: the dense weights, one
blob per MoE layer from its records (each written once, checksummed as it goes, padded to
the stride), then the manifest; `finish` renames the complete directory into place. Any
error, or leaving the `with` block without `finish`, removes the temporary directory, so
a store directory is either complete or absent. Every file is fsynced before the rename.
What a run killed mid-write leaves (`.NAME.tmp-PID`, `.NAME.old-PID`) is removed, or put
back, by the next start (`engine.safe_io.remove_leftovers`).
`engine.convert` (checkpoints) and `engine.synthetic` (random weights) both write through it.
"""

import errno
import json
import os
import shutil
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import mlx.core as mx

from engine.safe_io import fsync_dir, remove_leftovers
from engine.store import (
    DENSE_FILE,
    MANIFEST_FILE,
    LayerSpec,
    Manifest,
    Segment,
    blob_name,
    file_crc32,
    non_finite_segment,
    stride_for,
)

# Rounds of `_install` lost to other writers of the same store before it gives up.
_INSTALL_TRIES = 100


class StoreWriter:
    """Writes one store to `store_dir`.

    Args:
        store_dir: the store directory to create (or replace, see `finish`).
        num_experts: records per blob.

    Attributes:
        path: the temporary directory being written (other files, e.g. config.json
            and the tokenizer's, are copied in by the caller).
        layers: the `LayerSpec` of every layer written so far.
    """

    def __init__(self, store_dir: str | Path, num_experts: int):
        self.store_dir = Path(store_dir)
        self.num_experts = num_experts
        self.path = self.store_dir.parent / f".{self.store_dir.name}.tmp-{os.getpid()}"
        self.layers: list[LayerSpec] = []
        self._dense: tuple[int, int] | None = None  # (crc32, bytes) of dense.safetensors
        self._done = False

    def __enter__(self) -> "StoreWriter":
        remove_leftovers(self.store_dir.parent, self.store_dir.name)
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir(parents=True)
        return self

    def __exit__(self, *exc) -> None:
        if not self._done:
            shutil.rmtree(self.path, ignore_errors=True)

    def write_dense(self, weights: dict[str, mx.array]) -> None:
        """Writes `dense.safetensors` (MLX metadata) and clears `weights` to free them.

        Raises:
            OSError: the write failed (e.g. a full disk).
        """
        try:
            mx.save_safetensors(str(self.path / DENSE_FILE), weights, metadata={"format": "mlx"})
        except RuntimeError as e:  # MLX reports a failed write (e.g. a full disk) this way
            raise OSError(f"cannot write {DENSE_FILE} ({e}); is the disk full?") from e
        weights.clear()
        self._checksum_dense()

    def copy_dense(self, src: Path) -> None:
        """Copies another store's `dense.safetensors` as it is (a pipeline stage's store:
        engine.stage_store); its size and crc32 go into the manifest written by `finish`.

        Raises:
            OSError: the copy failed.
        """
        shutil.copyfile(src, self.path / DENSE_FILE)
        self._checksum_dense()

    def _checksum_dense(self) -> None:
        fd = os.open(self.path / DENSE_FILE, os.O_RDONLY)
        try:
            self._dense = file_crc32(fd)
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_layer(
        self,
        layer: int,
        module: str,
        segments: tuple[Segment, ...],
        quantization: dict,
        records: Iterable[Sequence],
    ) -> LayerSpec:
        """Writes the blob of decoder layer `layer` and records its `LayerSpec`.

        Args:
            layer: decoder layer index; layers are written in decoder order.
            module: weight-key prefix of the layer's stacked experts.
            segments: the record layout (`engine.store.layout_segments`).
            quantization: projection -> {"group_size", "bits", "mode"} or None.
            records: `num_experts` records in expert order, each a sequence of
                buffers (bytes-like, C-contiguous) that together hold its segments.

        Returns:
            The layer's LayerSpec.

        Raises:
            OSError: a write failed.
            ValueError: a record's size is not the segments' total, a float segment
                holds NaN or infinity (`engine.store.non_finite_segment`), or the count
                of records is not `num_experts`.
        """
        record_bytes = sum(s.nbytes for s in segments)
        stride = stride_for(record_bytes)
        file = blob_name(layer)
        where = f"{self.store_dir}: layer {layer}"
        checksums = write_blob(self.path / file, records, record_bytes, stride, segments, where)
        if len(checksums) != self.num_experts:
            raise ValueError(
                f"layer {layer}: {len(checksums)} records, expected {self.num_experts}"
            )
        spec = LayerSpec(
            layer=layer,
            moe_index=len(self.layers),
            module=module,
            file=file,
            record_bytes=record_bytes,
            stride=stride,
            segments=segments,
            quantization=quantization,
            checksums=tuple(checksums),
        )
        self.layers.append(spec)
        return spec

    def finish(
        self, model_type: str, top_k: int, num_hidden_layers: int, force: bool = False
    ) -> Path:
        """Writes the manifest and renames the store into place.

        An existing `store_dir` is replaced only when `force` (moved aside first and put
        back if the rename fails).

        Returns:
            `store_dir`.

        Raises:
            FileExistsError: `store_dir` exists and not `force`.
            OSError: a write or rename failed.
            ValueError: `write_dense` was not called.
        """
        if self._dense is None:
            raise ValueError(f"{self.store_dir}: the dense weights were not written")
        manifest = Manifest(
            model_type=model_type,
            num_experts=self.num_experts,
            top_k=top_k,
            num_hidden_layers=num_hidden_layers,
            layers=tuple(self.layers),
            dense_bytes=self._dense[1],
            dense_crc32=self._dense[0],
        )
        with open(self.path / MANIFEST_FILE, "w") as f:
            f.write(manifest_text(manifest.to_json()) + "\n")
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.path)
        _install(self.path, self.store_dir, force)
        self._done = True
        return self.store_dir


def write_blob(
    path: Path,
    records: Iterable[Sequence],
    record_bytes: int,
    stride: int,
    segments: tuple[Segment, ...] = (),
    where: str = "",
) -> list:
    """Writes each record of `records` (a sequence of buffers) padded with zeros to
    `stride` bytes into a new file, and fsyncs it; a record whose float `segments` hold
    NaN or infinity is refused (`where` names its layer in the message).

    Returns:
        crc32 of each record's unpadded bytes.

    Raises:
        OSError: on any write failure (e.g. ENOSPC).
        ValueError: a record is not `record_bytes` long, or holds NaN or infinity.
    """
    padding = bytes(stride - record_bytes)
    checksums = []
    with open(path, "wb") as f:
        for e, parts in enumerate(records):
            record = b"".join(memoryview(part).cast("B") for part in parts)
            if len(record) != record_bytes:
                raise ValueError(
                    f"{path}: record {e} has {len(record)} bytes, expected {record_bytes}"
                )
            if (key := non_finite_segment(segments, record)) is not None:
                raise ValueError(f"{where} expert {e}: {key} holds NaN or infinity")
            f.write(record)
            f.write(padding)
            checksums.append(zlib.crc32(record))
        f.flush()
        os.fsync(f.fileno())
    return checksums


def manifest_text(obj, depth: int = 0) -> str:
    """JSON with one line per small object or list of scalars (one line per
    segment, checksums on one line), indented otherwise."""
    compact = json.dumps(obj)
    if not isinstance(obj, (dict, list)) or len(compact) <= 100:
        return compact
    if isinstance(obj, list) and not any(isinstance(x, (dict, list)) for x in obj):
        return compact
    pad = "  " * (depth + 1)
    if isinstance(obj, dict):
        items = [f"{pad}{json.dumps(k)}: {manifest_text(v, depth + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * depth + "}"
    items = [pad + manifest_text(v, depth + 1) for v in obj]
    return "[\n" + ",\n".join(items) + "\n" + "  " * depth + "]"


def _install(tmp: Path, store_dir: Path, force: bool) -> None:
    """Rename the complete `tmp` to `store_dir`, replacing an old store only when `force`
    (the old one is moved aside first and put back if the rename fails otherwise).

    Another writer of the same store may install its own between any two steps (two
    `convert --force` at once): without `force` that is the FileExistsError of a store
    that appeared; with it, the store there is replaced again, the last writer winning,
    and both report success (each store was whole when it was installed).

    Raises:
        FileExistsError: `store_dir` exists, or appeared, and not `force`.
        OSError: a rename failed for another reason, or other writers replaced the
            store `_INSTALL_TRIES` times in a row.
    """
    raced = (errno.ENOTEMPTY, errno.EEXIST)  # a store arrived at store_dir meanwhile
    appeared = FileExistsError(errno.EEXIST, "appeared while the store was written", str(store_dir))
    for _ in range(_INSTALL_TRIES):
        if not (store_dir.exists() or store_dir.is_symlink()):
            try:
                os.rename(tmp, store_dir)
            except OSError as e:
                if e.errno not in raced:
                    raise
                if not force:
                    raise appeared from None
                continue
            break
        if not force:
            raise appeared
        old = store_dir.parent / f".{store_dir.name}.old-{os.getpid()}"
        try:
            os.rename(store_dir, old)
        except FileNotFoundError:  # another writer moved it aside first
            continue
        try:
            os.rename(tmp, store_dir)
        except OSError as e:
            if e.errno not in raced:
                os.rename(old, store_dir)
                raise
            shutil.rmtree(old, ignore_errors=True)  # older than the store now there
            continue
        except BaseException:
            os.rename(old, store_dir)
            raise
        shutil.rmtree(old, ignore_errors=True)
        break
    else:
        raise OSError(errno.EBUSY, "other writers kept replacing it meanwhile", str(store_dir))
    fsync_dir(store_dir.parent)
