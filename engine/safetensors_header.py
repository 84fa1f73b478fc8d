"""The header of a safetensors file, read and checked before MLX loads the file.

Format (huggingface/safetensors): an 8-byte little-endian header length N, N bytes of a
JSON object {tensor name: {"dtype", "shape", "data_offsets": [begin, end]}, optional
"__metadata__": {str: str}}, then the data buffer. `read_header` refuses what the format
forbids and what MLX would load silently wrong: a header longer than the file or than
100 MB, a dtype it does not know, a shape whose size disagrees with its offsets, and
offsets that overlap, leave a gap, start past 0 or end before or after the file does
(the buffer must be entirely indexed, without holes).
"""

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from engine.safe_io import ModelFileError, open_regular, parse_json

MAX_HEADER_BYTES = 100_000_000  # the limit of the safetensors reference implementation
MAX_DIM = 2**31 - 1  # MLX shapes are int32
# What a shape must be, for messages (`is_shape`).
SHAPE_RULE = f"a list of integers in [0, {MAX_DIM}]"

ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
    "C64": 8,
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: `dtype` (safetensors name, e.g. "BF16"), `shape`,
    and `begin`/`end`, its byte range inside the data buffer."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: str | Path, error: type[Exception] = ModelFileError) -> dict[str, TensorInfo]:
    """The checked tensor table of the safetensors file `path` (a regular file).

    Returns:
        {tensor name: TensorInfo}, in the header's order.

    Raises:
        error: naming the file and the tensor or field at fault (see the module doc).
        OSError: the file cannot be opened or read.
    """
    fd = open_regular(path, error)
    where = f"{path}: not a valid safetensors file"
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise error(f"{where}: {size} bytes, too short")
        n = struct.unpack("<Q", head)[0]
        if n < 2 or n > min(MAX_HEADER_BYTES, size - 8):
            raise error(
                f"{where}: header length {n} does not fit a file of {size} bytes "
                f"(at most {MAX_HEADER_BYTES})"
            )
        raw = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    if len(raw) != n:
        raise error(f"{where}: the file ended inside its header")
    return parse_header(raw, size - 8 - n, where, error)


def parse_header(
    raw: bytes, data_bytes: int, where: str, error: type[Exception] = ModelFileError
) -> dict[str, TensorInfo]:
    """The checked tensor table of a header `raw` whose data buffer is `data_bytes` long.

    Raises:
        error: `where`, then the tensor or field at fault.
    """
    header = parse_json(raw, where, error)
    if not isinstance(header, dict):
        raise error(f"{where}: the header is not a JSON object")
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            ok = entry is None or (  # MLX writes null when given no metadata
                isinstance(entry, dict) and all(isinstance(v, str) for v in entry.values())
            )
            if not ok:
                raise error(f"{where}: __metadata__ is not an object of strings")
            continue
        tensors[name] = _tensor(name, entry, where, error)
    end = 0
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if t.begin != end:
            what = "overlaps the tensor before it" if t.begin < end else "leaves a gap before it"
            raise error(f"{where}: tensor {name!r} at byte {t.begin} {what} (expected {end})")
        end = t.end
    if end != data_bytes:
        raise error(
            f"{where}: the tensors cover {end} bytes of a data buffer of {data_bytes} bytes"
        )
    return tensors


def is_shape(shape) -> bool:
    """Whether `shape` (parsed JSON) is `SHAPE_RULE`: a list of ints, not bools, each in
    [0, MAX_DIM]."""
    return isinstance(shape, list) and all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)


def _tensor(name: str, entry, where: str, error: type[Exception]) -> TensorInfo:
    ctx = f"{where}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise error(f"{ctx} is not a JSON object")
    dtype = entry.get("dtype")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise error(f"{ctx}: dtype {dtype!r} is not a safetensors dtype")
    shape = entry.get("shape")
    if not is_shape(shape):
        raise error(f"{ctx}: shape {shape!r} is not {SHAPE_RULE}")
    offsets = entry.get("data_offsets")
    ok = (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    )
    if not ok:
        raise error(f"{ctx}: data_offsets {offsets!r} is not [begin, end] with begin <= end")
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise error(
            f"{ctx}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes but "
            f"{dtype}{shape} has {nbytes}"
        )
    return TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])
