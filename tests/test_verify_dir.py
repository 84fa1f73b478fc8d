"""Verifying a model directory's weights: a model directory has no
checksums of its own, so a flipped byte converts silently; `engine.verify_dir` checks the
headers, the index and, in a Hugging Face snapshot, the hashes its blobs are named by."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from engine.safe_io import ModelFileError
from engine.verify_dir import main, verify_model_dir


def snapshot_of(model_dir: Path, root: Path) -> Path:
    """`model_dir` laid out as a Hugging Face cache snapshot: links to blobs named by the
    SHA-256 of their content (.safetensors, as Git LFS stores them) or their Git blob
    SHA-1 (the other files)."""
    snapshot = root / "models--org--name" / "snapshots" / "0123abc"
    blobs = root / "models--org--name" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in sorted(model_dir.iterdir()):
        data = f.read_bytes()
        if f.suffix == ".safetensors":
            name = hashlib.sha256(data).hexdigest()
        else:
            name = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (blobs / name).write_bytes(data)
        (snapshot / f.name).symlink_to(Path("../../blobs") / name)
    return snapshot


@pytest.fixture
def model_dir(model_dirs, tmp_path):
    return Path(shutil.copytree(model_dirs("qwen3_moe"), tmp_path / "model"))


def test_a_sound_directory_verifies(model_dir, tmp_path, capsys):
    assert verify_model_dir(model_dir) == (1, 0)
    snapshot = snapshot_of(model_dir, tmp_path)
    files = len(list(snapshot.iterdir()))  # each one's blob named by its hash
    assert verify_model_dir(snapshot) == (1, files)
    assert main([str(snapshot)]) == 0
    out = capsys.readouterr().out
    assert f"1 weight files match their headers and index; {files} files match" in out


def test_a_flipped_byte_is_found_by_the_shipped_hash(model_dir, tmp_path, capsys):
    snapshot = snapshot_of(model_dir, tmp_path)
    blob = (snapshot / "model.safetensors").resolve()
    data = bytearray(blob.read_bytes())
    data[-100] ^= 0x01  # inside a tensor: the header and sizes still agree
    blob.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match=r"model\.safetensors: content SHA-256 is [0-9a-f]+"):
        verify_model_dir(snapshot)
    assert main([str(snapshot)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "download it again" in err[0]


def test_the_index_must_match_the_files(model_dir):
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["metadata"]["total_size"] += 4
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelFileError, match=r"metadata\.total_size is \d+ but the weights hold"):
        verify_model_dir(model_dir)
    index["metadata"]["total_size"] -= 4
    index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"weight_map\['model\.norm\.weight'\] is"):
        verify_model_dir(model_dir)
