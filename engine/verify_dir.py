"""Verifying an mlx-lm model directory's weights before trusting them.

A model directory has no checksums of its own (a store has: its manifest's), so a byte
flipped inside a tensor converts and generates different text silently. `verify_model_dir`
checks what the directory does carry: every `model*.safetensors` against its own header
(`engine.safetensors_header.read_header`: offsets cover the file exactly), the index
(`model.safetensors.index.json`) against the files (each weight where the index says,
`metadata.total_size` the sum of the tensors' bytes), and, where the checkpoint ships
hashes, each file's content: a Hugging Face cache snapshot's files are links to blobs
named by the SHA-256 of their content (files stored with Git LFS, the weights) or by
their Git blob SHA-1 (small files).

    python -m engine.verify_dir MODEL_DIR
"""

import hashlib
import re
import sys
from pathlib import Path

from engine.safe_io import ModelFileError, contained, open_regular, read_json_object
from engine.safetensors_header import read_header

INDEX_FILE = "model.safetensors.index.json"
_CHUNK = 8 << 20


def _content_hash(path: Path, git_blob: bool) -> str:
    """The SHA-256 of `path`'s content, or with `git_blob` its Git blob SHA-1."""
    with open(open_regular(path), "rb") as f:
        if git_blob:
            size = f.seek(0, 2)
            f.seek(0)
            h = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)
        else:
            h = hashlib.sha256()
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _shipped_hash(path: Path) -> tuple[str, bool] | None:
    """(hash, is a Git blob SHA-1) that `path`'s link target is named by, or None."""
    if not path.is_symlink():
        return None
    name = Path(path.resolve()).name
    if re.fullmatch(r"[0-9a-f]{64}", name):
        return name, False
    if re.fullmatch(r"[0-9a-f]{40}", name):
        return name, True
    return None


def verify_model_dir(model_dir: str | Path) -> tuple[int, int]:
    """Checks the weights of an mlx-lm model directory against its headers, its index and
    the hashes it ships (see the module docstring).

    Returns:
        (weight files checked against their headers and the index, files whose content
        matched a shipped hash).

    Raises:
        FileNotFoundError: no `model*.safetensors`, or a file the index names is missing.
        ModelFileError: naming the file and what does not match: a header, the index
            (a weight it places elsewhere or not at all, `total_size`), or a hash.
    """
    model_dir = Path(model_dir)
    files = [contained(model_dir, f.name) for f in sorted(model_dir.glob("model*.safetensors"))]
    if not files:
        raise FileNotFoundError(f"{model_dir}: no model*.safetensors weights")
    holds = {f.name: read_header(f) for f in files}
    index_path = contained(model_dir, INDEX_FILE)
    if index_path.exists():
        _check_index(index_path, read_json_object(index_path), holds)
    hashed = 0
    for path in sorted(model_dir.iterdir()):
        shipped = _shipped_hash(path)
        if shipped is None or path.is_dir():
            continue
        want, git_blob = shipped
        got = _content_hash(contained(model_dir, path.name), git_blob)
        if got != want:
            kind = "Git blob SHA-1" if git_blob else "SHA-256"
            raise ModelFileError(
                f"{path}: content {kind} is {got} but the checkpoint's is {want} "
                "(damaged or changed: download it again)"
            )
        hashed += 1
    return len(files), hashed


def _check_index(path: Path, index: dict, holds: dict) -> None:
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise ModelFileError(f"{path}: weight_map is missing or not an object")
    for name, file in weight_map.items():
        if file not in holds:
            raise FileNotFoundError(f"{path}: weight_map[{name!r}] is {file!r}, which is missing")
        if name not in holds[file]:
            raise ModelFileError(f"{path}: weight_map[{name!r}] is {file!r}, which lacks it")
    for file, tensors in holds.items():
        for name in tensors:
            if weight_map.get(name) != file:
                raise ModelFileError(
                    f"{path}: {file} holds {name!r} but weight_map says {weight_map.get(name)!r}"
                )
    total = (index.get("metadata") or {}).get("total_size")
    size = sum(t.end - t.begin for tensors in holds.values() for t in tensors.values())
    if type(total) is int and total != size:
        raise ModelFileError(
            f"{path}: metadata.total_size is {total} but the weights hold {size} bytes "
            "(a file of another version of the checkpoint?)"
        )


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.verify_dir MODEL_DIR`: 0 when it verifies, 2 (one line) if not."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m engine.verify_dir MODEL_DIR", file=sys.stderr)
        return 2
    try:
        files, hashed = verify_model_dir(argv[0])
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    hashes = f"{hashed} files match their shipped hashes" if hashed else "no hashes shipped"
    print(f"{argv[0]}: {files} weight files match their headers and index; {hashes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
