"""The expert store format: its constants, manifest schema, validation and a reference reader.

An expert store is a directory written by `engine.store_writer.StoreWriter` (for
`engine.convert` and `engine.synthetic`); its format is specified in
`docs/store-format.md`. A store is of one of two kinds: a blob store holds every expert
again in blob files, beside its dense weights and the model's config and tokenizer; an
in-place store holds only its manifest, which indexes where each expert's segments lie in
the checkpoint's own safetensors files (the `source`), and reads the dense weights,
config and tokenizer there too. This module is the one definition of that format: the
file names, segment keys, projections and dtypes (the native cache's own table,
`engine._ext.DTYPE_NAMES`), the record layout (`layout_segments`), the manifest in
frozen dataclasses (`Segment`, `LayerSpec`, `Manifest`, and for an in-place store
`Source`, `SourceFile`, `SegmentSource`) with its validation, and `ExpertStore`, whose
`read_record` is the plain-Python reference reader that tests and `verify` use. Only JSON
and safetensors are ever read from a store, and only from regular files
(`engine.safe_io`).
"""

import hashlib
import math
import os
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine import _ext
from engine.safe_io import MAX_TOKENIZER_BYTES, ModelFileError, read_json_object, stat_regular
from engine.safetensors_header import (
    MAX_HEADER_BYTES,
    SHAPE_RULE,
    TensorInfo,
    is_shape,
    read_header,
)
from engine.validate import MAX_EXPERTS, MAX_LAYERS, QUANT_BITS, QUANT_GROUP, QUANT_MODES

FORMAT = "expertstream-store"
VERSION = 2
CHECKSUM = "crc32"
ALIGNMENT = 4096
MANIFEST_FILE = "manifest.json"
DENSE_FILE = "dense.safetensors"
CONFIG_FILE = "config.json"
# The kinds of store: the experts written again as blob files, or read where they are.
BLOB = "blob"
IN_PLACE = "in-place"

# The projections of each streamed module kind (mlx-lm's SwitchGLU and SwitchMLP), in
# record order.
KINDS = {"SwitchGLU": ("gate_proj", "up_proj", "down_proj"), "SwitchMLP": ("fc1", "fc2")}
# Every projection a record may hold: SwitchGLU's, then SwitchMLP's.
PROJECTIONS = tuple(proj for projs in KINDS.values() for proj in projs)
PARAMS = ("weight", "scales", "biases", "global_scale", "bias")
SEGMENT_KEYS = tuple(f"{proj}.{param}" for proj in PROJECTIONS for param in PARAMS)

# Manifest dtype name -> MLX dtype, for exactly the dtypes the native pools can hold.
DTYPES = {name: getattr(mx, "bool_" if name == "bool" else name) for name in _ext.DTYPE_NAMES}


CRC_CHUNK = 8 << 20


class StoreError(ModelFileError):
    """An expert store is missing, incomplete, inconsistent or corrupt.

    The message names the offending file and the field or value.
    """


class StaleStoreError(StoreError):
    """A file an in-place store reads is missing, or changed (size, modification time or
    header) since the store indexed it: the index must be made again."""


def dtype_name(dtype: mx.Dtype) -> str:
    """The manifest name of an MLX dtype, e.g. `mx.bfloat16` -> "bfloat16".

    Raises:
        StoreError: the dtype has no manifest name.
    """
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise StoreError(f"dtype {dtype} cannot be stored")


def layout_segments(parts) -> tuple["Segment", ...]:
    """The record layout of `parts`, an iterable of (key, dtype name, per-expert shape) in
    record order: contiguous segments from offset 0, each `prod(shape) x itemsize` bytes.

    Raises:
        StoreError: a dtype is not one of `DTYPES`.
    """
    segments, offset = [], 0
    for key, dtype, shape in parts:
        if dtype not in DTYPES:
            raise StoreError(f"segment {key}: dtype {dtype} cannot be stored")
        nbytes = math.prod(shape) * DTYPES[dtype].size
        segments.append(Segment(key, dtype, tuple(shape), nbytes, offset))
        offset += nbytes
    return tuple(segments)


def blob_name(layer: int) -> str:
    """File name of the blob of decoder layer `layer`, e.g. "layer03.blob"."""
    return f"layer{layer:02d}.blob"


def stride_for(record_bytes: int) -> int:
    """`record_bytes` rounded up to a multiple of `ALIGNMENT` (4096) bytes."""
    return -(-record_bytes // ALIGNMENT) * ALIGNMENT


def read_stride(segments) -> int:
    """The read buffer of one record of an in-place store, bytes: each segment is read
    from the aligned offset below its bytes to the aligned end above them, so it takes
    its nbytes rounded up to `ALIGNMENT`, plus one `ALIGNMENT`."""
    return sum(stride_for(seg.nbytes) + ALIGNMENT for seg in segments)


def header_digest(path: str | Path) -> str:
    """sha256 (hex) of the header of the safetensors file `path`: its first 8 bytes and
    the JSON they announce (at most `MAX_HEADER_BYTES`); what an in-place store checks
    to tell that a file changed.

    Raises:
        OSError: the file cannot be read.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        head = os.pread(fd, 8, 0)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        return hashlib.sha256(head + os.pread(fd, min(n, MAX_HEADER_BYTES), 8)).hexdigest()
    finally:
        os.close(fd)


def data_start(path: str | Path) -> int:
    """The byte offset of the data buffer of the safetensors file `path` (where its
    tensors' `begin` offsets count from).

    Raises:
        OSError: the file cannot be read.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        head = os.pread(fd, 8, 0)
    finally:
        os.close(fd)
    return 8 + struct.unpack("<Q", head)[0]


@dataclass(frozen=True)
class SourceFile:
    """A safetensors file an in-place store reads, as it was when indexed.

    Attributes:
        name: its name inside `Source.dir` (a plain file name).
        size: its size, bytes.
        mtime_ns: its modification time, nanoseconds since the epoch.
        header_sha256: `header_digest` of it.
    """

    name: str
    size: int
    mtime_ns: int
    header_sha256: str

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "size": self.size,
            "mtime_ns": self.mtime_ns,
            "header_sha256": self.header_sha256,
        }


@dataclass(frozen=True)
class Source:
    """The checkpoint an in-place store reads: the model directory `dir` (absolute) and
    its safetensors `files`; the config and tokenizer are read there too."""

    dir: str
    files: tuple[SourceFile, ...]

    def path(self, file: int) -> Path:
        """The path of `files[file]`."""
        return Path(self.dir) / self.files[file].name

    def to_json(self) -> dict:
        return {"dir": self.dir, "files": [f.to_json() for f in self.files]}


@dataclass(frozen=True)
class SegmentSource:
    """Where one segment of every record of an in-place layer lies: expert e's bytes of
    it are the segment's `nbytes` at `offset + e * nbytes` of `Source.files[file]` (the
    stacked tensor, C-contiguous, whose expert 0 starts at `offset`)."""

    file: int
    offset: int

    def to_json(self) -> dict:
        return {"file": self.file, "offset": self.offset}


@dataclass(frozen=True)
class Segment:
    """One parameter of an expert inside a record.

    Attributes:
        key: "<proj>.<param>", e.g. "gate_proj.scales" or "fc1.weight" (one of
            `SEGMENT_KEYS`).
        dtype: MLX dtype name (a key of `DTYPES`).
        shape: per-expert shape; the pool array of this key is `(rows, *shape)`.
        nbytes: `prod(shape) * itemsize`.
        offset: byte offset inside the record.
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "offset": self.offset,
        }


@dataclass(frozen=True)
class LayerSpec:
    """One MoE layer of the store: its blob file (or its sources) and record layout.

    Attributes:
        layer: decoder layer index (`model.layers.<layer>`).
        moe_index: index among MoE layers only.
        module: module path of the streamed SwitchGLU / SwitchMLP, which is the
            weight-key prefix of its experts, e.g. "model.layers.3.mlp.switch_mlp",
            "model.layers.3.mlp.experts", "language_model.model.layers.3.feed_forward.experts".
        file: blob file name inside the store, e.g. "layer03.blob"; None in place.
        record_bytes: bytes of one expert's segments (padding excluded).
        stride: a multiple of 4096: bytes between records in the blob, >= record_bytes;
            in place, the read buffer of a record (`read_stride`).
        segments: in record order (gate, up, down or fc1, fc2; weight, scales, biases,
            global_scale, bias).
        quantization: projection -> {"group_size", "bits", "mode"}, or None when
            the projection is not quantized.
        checksums: crc32 of each record's first `record_bytes` bytes.
        sources: in place, where each segment lies (one per segment, in their order);
            empty in a blob store.
    """

    layer: int
    moe_index: int
    module: str
    file: str | None
    record_bytes: int
    stride: int
    segments: tuple[Segment, ...]
    quantization: dict
    checksums: tuple[int, ...]
    sources: tuple[SegmentSource, ...] = ()

    def to_json(self) -> dict:
        out = {
            "layer": self.layer,
            "moe_index": self.moe_index,
            "module": self.module,
            "file": self.file,
            "record_bytes": self.record_bytes,
            "stride": self.stride,
            "segments": [s.to_json() for s in self.segments],
            "quantization": {
                proj: None if q is None else dict(q) for proj, q in self.quantization.items()
            },
            "checksums": list(self.checksums),
        }
        if self.sources:
            out["sources"] = [src.to_json() for src in self.sources]
        return out


@dataclass(frozen=True)
class Manifest:
    """The parsed, validated `manifest.json` of a store.

    Attributes:
        model_type: the model config's `model_type`.
        num_experts: records per blob file.
        top_k: experts per token.
        num_hidden_layers: decoder layers of the model (MoE or not).
        layers: MoE layers in decoder order.
        dense_bytes: size of `dense.safetensors`, bytes; in place, of the checkpoint's
            tensors that are not experts.
        dense_crc32: crc32 of the whole of `dense.safetensors`; None in place.
        checksum: checksum algorithm of `LayerSpec.checksums` and `dense_crc32` ("crc32").
        kind: `BLOB` or `IN_PLACE`.
        source: in place, the checkpoint it reads; None for a blob store.
    """

    model_type: str
    num_experts: int
    top_k: int
    num_hidden_layers: int
    layers: tuple[LayerSpec, ...]
    dense_bytes: int
    dense_crc32: int | None
    checksum: str = CHECKSUM
    kind: str = BLOB
    source: Source | None = None

    def to_json(self) -> dict:
        out = {
            "format": FORMAT,
            "version": VERSION,
            "model_type": self.model_type,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "num_hidden_layers": self.num_hidden_layers,
            "checksum": self.checksum,
            "dense_bytes": self.dense_bytes,
            "dense_crc32": self.dense_crc32,
        }
        if self.source is not None:
            out["kind"] = self.kind
            out["source"] = self.source.to_json()
        out["layers"] = [spec.to_json() for spec in self.layers]
        return out

    @classmethod
    def from_json(
        cls, data: dict, store_dir: str | Path, blob_layers: range | None = None
    ) -> "Manifest":
        """Parse and validate a manifest against the store directory.

        Checks the format and version, every field's type and range, segment
        order, sizes and contiguity, strides, checksums count, quantization,
        that each `file` is a plain name inside `store_dir`, that each blob's
        size is exactly `num_experts * stride`, that `dense.safetensors` and
        `config.json` exist, and that the config's `model_type` matches.

        Args:
            data: the decoded `manifest.json`.
            store_dir: the store directory the manifest belongs to.
            blob_layers: decoder layers whose blob files must be here (a pipeline
                stage's); None: every MoE layer's.

        Raises:
            StoreError: naming the file and the field or value at fault.
        """
        store_dir = Path(store_dir)
        where = str(store_dir / MANIFEST_FILE)
        _expect(isinstance(data, dict), where, "top level is not a JSON object")
        fmt = data.get("format")
        _expect(fmt == FORMAT, where, f"format is {fmt!r}, expected {FORMAT!r}")
        version = _int(data, "version", where)
        _expect(
            version == VERSION,
            where,
            f"version {version} is not supported (this build reads {VERSION}): convert the "
            "model again (`expertstream convert --force`; stores converted on first use are "
            "converted again by themselves)",
        )
        kind = data.get("kind", BLOB)
        _expect(
            kind in (BLOB, IN_PLACE), where, f"kind is {kind!r}, expected {BLOB!r} or {IN_PLACE!r}"
        )
        model_type = _str(data, "model_type", where)
        num_experts = _int(data, "num_experts", where, lo=1, hi=MAX_EXPERTS)
        top_k = _int(data, "top_k", where, lo=1, hi=num_experts)
        num_hidden_layers = _int(data, "num_hidden_layers", where, lo=1, hi=MAX_LAYERS)
        dense_bytes = _int(data, "dense_bytes", where, lo=8 if kind == BLOB else 0)
        source = None
        if kind == BLOB:
            dense_crc32 = _int(data, "dense_crc32", where, lo=0, hi=2**32 - 1)
        else:
            dense_crc32 = data.get("dense_crc32")
            _expect(dense_crc32 is None, where, "dense_crc32 is set in an in-place store")
            source = _parse_source(data.get("source"), f"{where}: source")
        checksum = data.get("checksum")
        _expect(
            checksum == CHECKSUM,
            where,
            f"checksum is {checksum!r}, expected {CHECKSUM!r}",
        )
        raw_layers = _list(data, "layers", where)
        _expect(len(raw_layers) > 0, where, "layers is empty")

        layers = []
        for i, raw in enumerate(raw_layers):
            spec = _parse_layer(raw, i, num_experts, num_hidden_layers, where, source)
            if layers:
                _expect(
                    spec.layer > layers[-1].layer,
                    where,
                    f"layers[{i}].layer {spec.layer} is not after {layers[-1].layer}",
                )
            layers.append(spec)

        if source is None:
            wanted = [s for s in layers if blob_layers is None or s.layer in blob_layers]
            _check_present(store_dir, wanted, blob_layers)
            for spec in wanted:
                _check_blob(store_dir / spec.file, num_experts * spec.stride, spec)
            dense = store_dir / DENSE_FILE
            _expect(dense.exists(), str(dense), "missing")
            size = stat_regular(dense, error=StoreError)
            _expect(
                size == dense_bytes,
                str(dense),
                f"{size} bytes, but the manifest's dense_bytes is {dense_bytes}",
            )
        else:
            _check_source(source, store_dir)
        config_dir = store_dir if source is None else Path(source.dir)
        config = read_config(config_dir)
        config_type = config.get("model_type")
        _expect(
            config_type == model_type,
            str(config_dir / CONFIG_FILE),
            f"model_type {config_type!r} does not match the manifest's {model_type!r}",
        )
        return cls(
            model_type=model_type,
            num_experts=num_experts,
            top_k=top_k,
            num_hidden_layers=num_hidden_layers,
            layers=tuple(layers),
            dense_bytes=dense_bytes,
            dense_crc32=dense_crc32,
            checksum=checksum,
            kind=kind,
            source=source,
        )


def _expect(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise StoreError(f"{where}: {message}")


def _int(obj: dict, key: str, where: str, lo: int | None = None, hi=None) -> int:
    v = obj.get(key)
    ok = isinstance(v, int) and not isinstance(v, bool)
    _expect(ok, where, f"{key} is {v!r}, expected an integer")
    _expect(lo is None or v >= lo, where, f"{key} is {v}, expected >= {lo}")
    _expect(hi is None or v <= hi, where, f"{key} is {v}, expected <= {hi}")
    return v


def _str(obj: dict, key: str, where: str) -> str:
    v = obj.get(key)
    _expect(isinstance(v, str) and v != "", where, f"{key} is {v!r}, expected a string")
    return v


def _list(obj: dict, key: str, where: str) -> list:
    v = obj.get(key)
    _expect(isinstance(v, list), where, f"{key} is {v!r}, expected a list")
    return v


def _check_file_name(name: str, where: str) -> None:
    """Refuse any `file` value that could name something outside the store."""
    plain = (
        name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and ".." not in name
        and "\0" not in name
        and not os.path.isabs(name)
        and Path(name).name == name
    )
    _expect(plain, where, f"{name!r} is not a plain file name inside the store")


def _parse_layer(
    raw: dict,
    i: int,
    num_experts: int,
    num_hidden_layers: int,
    where: str,
    source: "Source | None" = None,
) -> LayerSpec:
    ctx = f"layers[{i}]"
    _expect(isinstance(raw, dict), where, f"{ctx} is not a JSON object")
    layer = _int(raw, "layer", f"{where}: {ctx}", lo=0, hi=num_hidden_layers - 1)
    moe_index = _int(raw, "moe_index", f"{where}: {ctx}")
    _expect(moe_index == i, where, f"{ctx}.moe_index is {moe_index}, expected {i}")
    module = _str(raw, "module", f"{where}: {ctx}")
    numbered = [int(p) for p in module.split(".") if p.isdigit()]
    _expect(
        numbered[-1:] == [layer],
        where,
        f"{ctx}.module {module!r} is not a module of decoder layer {layer} "
        f"(its last number is the layer: model.layers.{layer}.<block>.switch_mlp)",
    )
    if source is None:
        file = _str(raw, "file", f"{where}: {ctx}")
        _check_file_name(file, f"{where}: {ctx}.file")
        _expect(
            file == blob_name(layer),
            where,
            f"{ctx}.file is {file!r}, expected {blob_name(layer)!r} for layer {layer}",
        )
    else:
        file = raw.get("file")
        _expect(file is None, where, f"{ctx}.file is {file!r} in an in-place store")
    record_bytes = _int(raw, "record_bytes", f"{where}: {ctx}", lo=1)
    stride = _int(raw, "stride", f"{where}: {ctx}", lo=1)
    _expect(
        stride % ALIGNMENT == 0,
        where,
        f"{ctx}.stride {stride} is not a multiple of {ALIGNMENT}",
    )
    _expect(
        stride >= record_bytes,
        where,
        f"{ctx}.stride {stride} is smaller than record_bytes {record_bytes}",
    )
    _expect(
        source is not None or stride == stride_for(record_bytes),
        where,
        f"{ctx}.stride {stride} is not record_bytes {record_bytes} rounded up to "
        f"{ALIGNMENT} ({stride_for(record_bytes)})",
    )

    segments = []
    offset = 0
    last_rank = -1
    for j, seg in enumerate(_list(raw, "segments", f"{where}: {ctx}")):
        sctx = f"{ctx}.segments[{j}]"
        _expect(isinstance(seg, dict), where, f"{sctx} is not a JSON object")
        key = seg.get("key")
        _expect(key in SEGMENT_KEYS, where, f"{sctx}.key {key!r} is not a segment key")
        rank = SEGMENT_KEYS.index(key)
        _expect(
            rank > last_rank,
            where,
            f"{sctx}.key {key!r} is out of order or repeated "
            "(order: gate, up, down, fc1, fc2; weight, scales, biases, global_scale, bias)",
        )
        last_rank = rank
        dtype = seg.get("dtype")
        _expect(
            isinstance(dtype, str) and dtype in DTYPES,
            where,
            f"{sctx}.dtype {dtype!r} is not a storable dtype ({', '.join(DTYPES)})",
        )
        shape = seg.get("shape")
        _expect(is_shape(shape), where, f"{sctx}.shape {shape!r} is not {SHAPE_RULE}")
        nbytes = _int(seg, "nbytes", f"{where}: {sctx}")
        want = math.prod(shape) * DTYPES[dtype].size
        _expect(
            nbytes == want,
            where,
            f"{sctx}.nbytes is {nbytes}, expected {want} for {dtype}{shape}",
        )
        seg_offset = _int(seg, "offset", f"{where}: {sctx}")
        _expect(
            seg_offset == offset,
            where,
            f"{sctx}.offset is {seg_offset}, expected {offset} (segments are contiguous)",
        )
        offset += nbytes
        segments.append(Segment(key, dtype, tuple(shape), nbytes, seg_offset))
    _expect(len(segments) > 0, where, f"{ctx}.segments is empty")
    _expect(
        offset == record_bytes,
        where,
        f"{ctx}: segments sum to {offset} bytes but record_bytes is {record_bytes}",
    )

    keys = {s.key for s in segments}
    raw_q = raw.get("quantization")
    _expect(isinstance(raw_q, dict), where, f"{ctx}.quantization is not an object")
    quantization = {}
    for proj in PROJECTIONS:
        present = f"{proj}.weight" in keys
        if proj not in raw_q:
            _expect(not present, where, f"{ctx}.quantization lacks {proj!r}")
            continue
        _expect(present, where, f"{ctx}.quantization names {proj!r} without segments")
        quantization[proj] = _parse_quantization(
            raw_q[proj], f"{proj}.scales" in keys, f"{where}: {ctx}.quantization.{proj}"
        )
    extra = set(raw_q) - set(PROJECTIONS)
    _expect(not extra, where, f"{ctx}.quantization has unknown keys {sorted(extra)}")

    checksums = _list(raw, "checksums", f"{where}: {ctx}")
    _expect(
        len(checksums) == num_experts,
        where,
        f"{ctx}.checksums has {len(checksums)} entries, expected {num_experts}",
    )
    _expect(
        all(isinstance(c, int) and not isinstance(c, bool) for c in checksums)
        and all(0 <= c < 2**32 for c in checksums),
        where,
        f"{ctx}.checksums holds values that are not crc32 integers",
    )
    sources = ()
    if source is not None:
        _expect(
            stride == read_stride(segments),
            where,
            f"{ctx}.stride {stride} is not the read buffer of its segments "
            f"({read_stride(segments)})",
        )
        sources = _parse_sources(raw, ctx, segments, num_experts, source, where)
    return LayerSpec(
        layer=layer,
        moe_index=moe_index,
        module=module,
        file=file,
        record_bytes=record_bytes,
        stride=stride,
        segments=tuple(segments),
        quantization=quantization,
        checksums=tuple(checksums),
        sources=sources,
    )


def _parse_sources(
    raw: dict, ctx: str, segments: list, num_experts: int, source: Source, where: str
) -> tuple[SegmentSource, ...]:
    """An in-place layer's `sources`: one per segment, each inside its file."""
    items = _list(raw, "sources", f"{where}: {ctx}")
    _expect(
        len(items) == len(segments),
        where,
        f"{ctx}.sources has {len(items)} entries for {len(segments)} segments",
    )
    out = []
    for j, (item, seg) in enumerate(zip(items, segments, strict=True)):
        sctx = f"{where}: {ctx}.sources[{j}]"
        _expect(isinstance(item, dict), sctx, "is not a JSON object")
        file = _int(item, "file", sctx, lo=0, hi=len(source.files) - 1)
        offset = _int(item, "offset", sctx, lo=0)
        end = offset + num_experts * seg.nbytes
        size = source.files[file].size
        _expect(
            end <= size,
            sctx,
            f"the experts of {seg.key} end at byte {end}, past the {size} bytes of "
            f"{source.files[file].name}",
        )
        out.append(SegmentSource(file, offset))
    return tuple(out)


def _parse_source(raw, where: str) -> Source:
    """An in-place store's `source`: an absolute directory and its files."""
    _expect(isinstance(raw, dict), where, "is not a JSON object")
    folder = _str(raw, "dir", where)
    _expect(os.path.isabs(folder), where, f"dir {folder!r} is not an absolute path")
    files = []
    for j, item in enumerate(_list(raw, "files", where)):
        fctx = f"{where}.files[{j}]"
        _expect(isinstance(item, dict), fctx, "is not a JSON object")
        name = _str(item, "name", fctx)
        _check_file_name(name, f"{fctx}.name")
        digest = item.get("header_sha256")
        hexdigits = set("0123456789abcdef")
        _expect(
            isinstance(digest, str) and len(digest) == 64 and set(digest) <= hexdigits,
            fctx,
            f"header_sha256 is {digest!r}, expected 64 hex digits",
        )
        files.append(
            SourceFile(name, _int(item, "size", fctx, lo=8), _int(item, "mtime_ns", fctx), digest)
        )
    _expect(len(files) > 0, where, "files is empty")
    return Source(folder, tuple(files))


def _check_source(source: Source, store_dir: Path) -> None:
    """Raises StaleStoreError naming the first file of `source` that is missing, or whose
    size, modification time or header is not what the index recorded."""
    again = f"the in-place store {store_dir} must index the model again"
    for i, f in enumerate(source.files):
        path = source.path(i)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise StaleStoreError(f"{path}: missing ({again})") from None
        except OSError as e:
            raise StoreError(f"{path}: cannot read ({e.strerror or e})") from None
        if not stat.S_ISREG(st.st_mode):
            stat_regular(path, error=StoreError)  # raises, naming the kind
        changed = None
        if st.st_size != f.size:
            changed = f"its size is {st.st_size} bytes, indexed at {f.size}"
        elif st.st_mtime_ns != f.mtime_ns:
            changed = "its modification time is not the one indexed"
        elif header_digest(path) != f.header_sha256:
            changed = "its safetensors header is not the one indexed"
        if changed:
            raise StaleStoreError(f"{path}: changed since it was indexed: {changed} ({again})")


def _parse_quantization(q, has_scales: bool, where: str) -> dict | None:
    if q is None:
        _expect(not has_scales, where, "is null but the projection has scales")
        return None
    _expect(isinstance(q, dict), where, f"{q!r} is neither null nor an object")
    _expect(has_scales, where, "is set but the projection has no scales")
    group_size = _int(q, "group_size", where, lo=QUANT_GROUP[0], hi=QUANT_GROUP[1])
    bits = _int(q, "bits", where, lo=QUANT_BITS[0], hi=QUANT_BITS[1])
    mode = _str(q, "mode", where)
    _expect(mode in QUANT_MODES, where, f"mode {mode!r} is not one of {', '.join(QUANT_MODES)}")
    return {"group_size": group_size, "bits": bits, "mode": mode}


def layer_range(layers: range) -> str:
    """ "decoder layers 2-3" for range(2, 4), "decoder layer 1" for range(1, 2)."""
    if len(layers) == 1:
        return f"decoder layer {layers.start}"
    return f"decoder layers {layers.start}-{layers.stop - 1}"


def _check_present(store_dir: Path, specs: list[LayerSpec], blob_layers: range | None) -> None:
    """Raises StoreError naming every blob file of `specs` that is not in `store_dir`
    (`_check_blob` names a single one when every blob is wanted)."""
    missing = [s for s in specs if not (store_dir / s.file).exists()]
    if missing and (blob_layers is not None or len(missing) > 1):
        need = "" if blob_layers is None else f" (this stage runs {layer_range(blob_layers)})"
        raise StoreError(
            f"{store_dir}: missing blob files {', '.join(s.file for s in missing)}{need}"
        )


def _check_blob(path: Path, want: int, spec: LayerSpec) -> None:
    _expect(path.exists(), str(path), f"blob of layer {spec.layer} is missing")
    size = stat_regular(path, error=StoreError)
    _expect(
        size >= want,
        str(path),
        f"truncated: {size} bytes, expected {want} (num_experts x stride {spec.stride})",
    )
    _expect(
        size == want,
        str(path),
        f"size mismatch: {size} bytes, expected {want} (num_experts x stride {spec.stride})",
    )


def _read_json(path: Path) -> dict:
    try:
        return read_json_object(path, error=StoreError)
    except FileNotFoundError:
        raise StoreError(f"{path}: missing") from None
    except OSError as e:
        raise StoreError(f"{path}: cannot read ({e.strerror or e})") from None


def read_config(store_dir: str | Path) -> dict:
    """The model config (`config.json`) of a store.

    Raises:
        StoreError: the file is missing, not JSON, or not a JSON object.
    """
    return _read_json(Path(store_dir) / CONFIG_FILE)


def load_manifest(store_dir: str | Path, blob_layers: range | None = None) -> Manifest:
    """Read and validate `store_dir/manifest.json` (see `Manifest.from_json`).

    Raises:
        StoreError: no manifest (not a store, or an interrupted convert),
            unreadable JSON, or any validation failure.
    """
    store_dir = Path(store_dir)
    if not os.path.lexists(store_dir / MANIFEST_FILE):
        raise StoreError(
            f"{store_dir / MANIFEST_FILE}: missing; {store_dir} is not a complete expert store"
        )
    return Manifest.from_json(_read_json(store_dir / MANIFEST_FILE), store_dir, blob_layers)


def is_store(path: str | Path) -> bool:
    """True when `path` is a directory with a `manifest.json` of this format.

    A cheap check (it reads only the manifest's `format`); `ExpertStore`
    validates everything.
    """
    try:
        data = read_json_object(Path(path) / MANIFEST_FILE)
    except (OSError, ValueError):
        return False
    return data.get("format") == FORMAT


def store_version(path: str | Path) -> int | None:
    """The manifest's `version` of the store at `path`, None when it is not a store."""
    try:
        data = read_json_object(Path(path) / MANIFEST_FILE)
    except (OSError, ValueError):
        return None
    return data.get("version") if data.get("format") == FORMAT else None


class ExpertStore:
    """A validated expert store directory.

    Attributes:
        path: the store directory.
        manifest: its validated `Manifest`.
        model_dir: where the model's config and tokenizer files are: `path`, or for an
            in-place store the checkpoint's directory (`Manifest.source`).
        config: the model config (`config.json`) as a dict.

    Args:
        blob_layers: decoder layers whose blob files must be present (a pipeline
            stage's, for a host that holds only those); None: all of them (an in-place
            store needs every file of its source).

    Raises:
        StoreError: when the store fails validation (see `Manifest.from_json`);
            StaleStoreError when a file an in-place store reads is missing or changed.
    """

    def __init__(self, path: str | Path, blob_layers: range | None = None):
        self.path = Path(path)
        _check_entries(self.path)
        self.manifest = load_manifest(self.path, blob_layers)
        source = self.manifest.source
        self.model_dir = self.path if source is None else Path(source.dir)
        self.config = read_config(self.model_dir)
        self._by_layer = {spec.layer: spec for spec in self.manifest.layers}

    @property
    def in_place(self) -> bool:
        """Whether the experts are read from the checkpoint's own files."""
        return self.manifest.source is not None

    @property
    def size_bytes(self) -> int:
        """Bytes on disk of the model's weights as this store holds them: its files, or in
        place the checkpoint's safetensors files it reads (their size when indexed)."""
        source = self.manifest.source
        if source is not None:
            return sum(f.size for f in source.files)
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())

    def __repr__(self) -> str:
        return f"ExpertStore({str(self.path)!r})"

    def layer(self, decoder_idx: int) -> LayerSpec:
        """The spec of decoder layer `decoder_idx`.

        Raises:
            KeyError: that decoder layer is not an MoE layer of this store.
        """
        try:
            return self._by_layer[decoder_idx]
        except KeyError:
            raise KeyError(
                f"decoder layer {decoder_idx} is not an MoE layer of {self.path} "
                f"(MoE layers: {sorted(self._by_layer)})"
            ) from None

    @property
    def context_length(self) -> int | None:
        """The model's context window in tokens (`max_position_embeddings` of its
        config), or None where the config gives none."""
        return self.config.get("max_position_embeddings") or None

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size (`vocab_size` of its config), or None where the
        config gives none."""
        return self.config.get("vocab_size") or None

    def blob_path(self, spec: LayerSpec) -> Path:
        """Path of the blob file of `spec` (a blob store's)."""
        return self.path / spec.file

    def records_path(self, spec: LayerSpec) -> Path:
        """What names the records of `spec` in messages: its blob, or in place the
        checkpoint's directory."""
        return self.model_dir if self.in_place else self.blob_path(spec)

    def segment_sources(self, spec: LayerSpec) -> list[tuple[Path, int, int]]:
        """Where the segments of `spec` lie in place: (file, offset of expert 0's bytes,
        bytes per expert) per segment, in record order; empty for a blob store."""
        source = self.manifest.source
        if source is None:
            return []
        return [
            (source.path(src.file), src.offset, seg.nbytes)
            for src, seg in zip(spec.sources, spec.segments, strict=True)
        ]

    def _weight_files(self) -> list[Path]:
        """The safetensors files of the dense weights: `dense.safetensors`, or in place
        every file of the source."""
        source = self.manifest.source
        if source is None:
            return [self.path / DENSE_FILE]
        return [source.path(i) for i in range(len(source.files))]

    def dense_header(self) -> dict[str, TensorInfo]:
        """The checked tensor table of `dense.safetensors` (engine.safetensors_header);
        in place, of every file of the source (the experts' tensors included).

        Raises:
            StoreError: a header is malformed, or its offsets overlap, leave gaps or
                disagree with a tensor's dtype and shape.
        """
        tensors = {}
        for path in self._weight_files():
            try:
                tensors.update(read_header(path, StoreError))
            except OSError as e:
                raise StoreError(f"{path}: cannot load ({e.strerror or e})") from None
        return tensors

    def dense_weights(self) -> dict[str, mx.array]:
        """All non-expert weights, lazily loaded from `dense.safetensors`, under mlx-lm's
        sanitized key names, once the file's crc32 and size match the manifest's and its
        header is checked (`dense_header`). In place: every tensor of the source's files
        as the checkpoint names them, the experts' included (nothing is read until
        evaluated): the family's `sanitize`, then `engine.convert.drop_experts`, leave
        the dense weights.

        Raises:
            StoreError: a file cannot be read, its size or crc32 is not the manifest's,
                its header is malformed, or MLX refuses it.
        """
        self.dense_header()
        if not self.in_place:
            _check_crc(self.path / DENSE_FILE, self.manifest.dense_bytes, self.manifest.dense_crc32)
        weights = {}
        for path in self._weight_files():
            try:
                weights.update(mx.load(str(path), format="safetensors"))
            except (RuntimeError, ValueError, OSError) as e:
                raise StoreError(f"{path}: cannot load ({e})") from None
        return weights

    def read_record(self, spec: LayerSpec, e: int) -> bytes:
        """Expert `e`'s record of layer `spec`: `spec.record_bytes` bytes read with one
        positional read at `e * spec.stride` (padding excluded); in place, one read per
        segment at its source.

        Raises:
            IndexError: `e` is not in `[0, num_experts)`.
            StoreError: the file ends before the record does.
        """
        n = self.manifest.num_experts
        if not 0 <= e < n:
            raise IndexError(f"expert {e} out of range [0, {n})")
        if self.in_place:
            parts = []
            for path, offset, nbytes in self.segment_sources(spec):
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                try:
                    parts.append(os.pread(fd, nbytes, offset + e * nbytes))
                finally:
                    os.close(fd)
                _expect(
                    len(parts[-1]) == nbytes,
                    str(path),
                    f"truncated: expert {e} of layer {spec.layer} has {len(parts[-1])} of "
                    f"{nbytes} bytes",
                )
            return b"".join(parts)
        path = self.blob_path(spec)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            data = os.pread(fd, spec.record_bytes, e * spec.stride)
        finally:
            os.close(fd)
        if len(data) != spec.record_bytes:
            raise StoreError(
                f"{path}: truncated: expert {e} has {len(data)} of {spec.record_bytes} bytes"
            )
        return data

    def verify(self, layers: list[int] | None = None) -> int:
        """Check every record's crc32, that its padding is zero and that its float
        segments are finite (`non_finite_segment`: a record damaged and its checksum
        written to match).

        Args:
            layers: decoder layer indices to check; all MoE layers if None.

        Returns:
            The number of records checked.

        Raises:
            KeyError: a requested layer is not an MoE layer.
            StoreError: naming the blob file, layer and expert of the first
                corrupt record.
        """
        specs = self.manifest.layers if layers is None else [self.layer(i) for i in layers]
        checked = 0
        if self.in_place:  # no padding: each record's crc32
            for spec in specs:
                for e in range(self.manifest.num_experts):
                    crc = zlib.crc32(self.read_record(spec, e))
                    _expect(
                        crc == spec.checksums[e],
                        f"{self.model_dir}: layer {spec.layer} expert {e}",
                        f"crc32 {crc:#010x} does not match the manifest's "
                        f"{spec.checksums[e]:#010x}",
                    )
                    checked += 1
            return checked
        for spec in specs:
            path = self.blob_path(spec)
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                for e in range(self.manifest.num_experts):
                    _check_record(path, spec, e, os.pread(fd, spec.stride, e * spec.stride))
                    checked += 1
            finally:
                os.close(fd)
        return checked


def file_crc32(fd: int) -> tuple[int, int]:
    """(crc32, size in bytes) of the whole file open at `fd`, read in chunks."""
    crc = size = 0
    while chunk := os.pread(fd, CRC_CHUNK, size):
        crc = zlib.crc32(chunk, crc)
        size += len(chunk)
    return crc, size


def _check_crc(path: Path, want_size: int, want_crc: int) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise StoreError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        crc, size = file_crc32(fd)
    finally:
        os.close(fd)
    _expect(size == want_size, str(path), f"{size} bytes, the manifest says {want_size}")
    _expect(
        crc == want_crc,
        str(path),
        f"crc32 {crc:#010x} does not match the manifest's dense_crc32 {want_crc:#010x} "
        "(the file is corrupt)",
    )


def _check_entries(store_dir: Path) -> None:
    """Refuses a store holding anything but regular files of bounded size (a FIFO would
    block the tokenizer's or MLX's reads, a device flood them); links are followed."""
    try:
        entries = sorted(store_dir.iterdir())
    except OSError:
        return  # load_manifest reports the directory
    for entry in entries:
        if entry.name.startswith("."):
            continue
        try:
            st = entry.stat()
        except FileNotFoundError:
            continue  # a dangling link: what the store needs is reported missing by name
        except OSError as e:
            raise StoreError(f"{entry}: cannot read ({e.strerror or e})") from None
        if stat.S_ISDIR(st.st_mode):
            continue
        if not stat.S_ISREG(st.st_mode):
            stat_regular(entry, error=StoreError)  # raises, naming the kind
        if not entry.name.endswith(".blob") and entry.name != DENSE_FILE:
            _expect(
                st.st_size <= MAX_TOKENIZER_BYTES,
                str(entry),
                f"{st.st_size} bytes, more than the {MAX_TOKENIZER_BYTES} a file of a store "
                "other than weights may have",
            )


# The float dtypes a segment may have, as (the unsigned integer of their width, their
# exponent's bits): a value whose exponent bits are all set is NaN or infinity.
_EXPONENT_BITS = {
    "float16": (np.uint16, 0x7C00),
    "bfloat16": (np.uint16, 0x7F80),
    "float32": (np.uint32, 0x7F800000),
}


def non_finite(dtype: str, data, offset: int = 0, nbytes: int | None = None) -> bool:
    """Whether the `nbytes` bytes of values of `dtype` (a manifest dtype name) at `offset`
    of `data` (bytes-like; default: to its end) hold NaN or infinity (every exponent bit
    set); False for a dtype that is not a float (the uint8 scales of the mx and nv modes
    are not checked)."""
    if dtype not in _EXPONENT_BITS:
        return False
    kind, mask = _EXPONENT_BITS[dtype]
    size = np.dtype(kind).itemsize
    count = (len(data) - offset if nbytes is None else nbytes) // size
    values = np.frombuffer(data, kind, count, offset)
    return bool(np.any((values & kind(mask)) == mask))


def non_finite_segment(segments: tuple[Segment, ...], record) -> str | None:
    """The key of the first float segment (scales, biases, unquantized weights) of the
    record bytes `record` (bytes-like, at least the segments' extent) holding NaN or
    infinity, which make every reply empty; None when there is none (`non_finite`)."""
    for s in segments:
        if non_finite(s.dtype, record, s.offset, s.nbytes):
            return s.key
    return None


def _check_record(path: Path, spec: LayerSpec, e: int, data: bytes) -> None:
    where = f"{path}: layer {spec.layer} expert {e}"
    _expect(
        len(data) == spec.stride,
        where,
        f"truncated: {len(data)} of {spec.stride} bytes",
    )
    crc = zlib.crc32(memoryview(data)[: spec.record_bytes])
    _expect(
        crc == spec.checksums[e],
        where,
        f"crc32 {crc:#010x} does not match the manifest's {spec.checksums[e]:#010x}",
    )
    pad = spec.stride - spec.record_bytes
    _expect(
        data.count(0, spec.record_bytes) == pad,
        where,
        "padding is not zero",
    )
    key = non_finite_segment(spec.segments, data)
    _expect(key is None, where, f"{key} holds NaN or infinity (a damaged store)")
