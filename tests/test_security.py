"""Untrusted model files: only safetensors and JSON are read, nothing in a model
directory or store is ever executed, and manifest paths stay inside the store.

Each trap, if sprung, creates a marker file; the tests assert the marker never appears,
through `convert` and through `engine.model.load` (which converts model directories on
first use). Already covered elsewhere: manifest `file` values that name anything outside
the store are refused (test_store.py::test_file_cannot_escape_the_store) and a config's
`model_file` is refused by convert (test_convert.py::test_refuses_model_file_and_bad_config).
"""

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from mlx_lm.utils import load_tokenizer
from tokenizers import Tokenizer, models, pre_tokenizers

from engine import tokenizer as tokenizer_mod
from engine.convert import convert
from engine.model import load
from engine.store import ExpertStore, StoreError


class Trap:
    """Unpickling it creates the marker file (open(marker, "w"))."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def evil_code(marker: Path) -> str:
    """Python source that creates the marker when imported, and defines a tokenizer
    class so that a loader trusting it would get that far."""
    return (
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n"
    )


def write_tokenizer(directory: Path, config: dict) -> None:
    vocab = {"[UNK]": 0, "The": 1, "cat": 2, "sat": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "TRAP-SPRUNG"
    yield path
    assert not path.exists(), "code or a pickle from the model files was executed"


@pytest.fixture
def model_dir(model_dirs, tmp_path):
    """A private copy of the qwen3_moe model directory, free to booby-trap."""
    return Path(shutil.copytree(model_dirs("qwen3_moe"), tmp_path / "model"))


@pytest.fixture
def store_dir(qwen_store, tmp_path):
    return Path(shutil.copytree(qwen_store.path, tmp_path / "store"))


# ---- pickles ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pkl", "model.npz", "model.pt"])
def test_pickle_weights_are_never_loaded(model_dir, tmp_path, marker, name):
    """A model directory whose only weights are pickle-based: refused by name, unread."""
    for f in model_dir.glob("model*.safetensors*"):
        f.unlink()
    if name.endswith(".npz"):
        np.savez(model_dir / name, w=np.array([Trap(marker)], dtype=object))
    else:
        (model_dir / name).write_bytes(pickle.dumps({"w": Trap(marker)}))
    with pytest.raises(FileNotFoundError, match=rf"found {name}: only safetensors are read"):
        convert(model_dir, tmp_path / "store")
    with pytest.raises(FileNotFoundError, match=rf"found {name}"):
        load(model_dir)
    assert not (tmp_path / "store").exists()


def test_pickle_named_safetensors_is_refused(model_dir, tmp_path, marker):
    (model_dir / "model.safetensors").write_bytes(pickle.dumps({"w": Trap(marker)}))
    with pytest.raises(ValueError, match=r"model\.safetensors: not a valid safetensors file"):
        convert(model_dir, tmp_path / "store")


def test_pickle_in_a_store_is_refused(store_dir, marker):
    (store_dir / "dense.safetensors").write_bytes(pickle.dumps({"w": Trap(marker)}))
    with pytest.raises(StoreError, match=r"dense\.safetensors: \d+ bytes, but the manifest's"):
        load(store_dir)


def test_stray_pickles_beside_safetensors_are_ignored(model_dir, tmp_path, marker):
    """Pickles next to real safetensors weights are neither read nor copied."""
    for name in ("pytorch_model.bin", "training_args.bin", "optimizer.pt"):
        (model_dir / name).write_bytes(pickle.dumps(Trap(marker)))
    store = ExpertStore(convert(model_dir, tmp_path / "store"))
    assert not any(p.suffix in (".bin", ".pt") for p in store.path.iterdir())
    load(store.path)


# ---- code ----------------------------------------------------------------------------------


def test_model_file_is_never_run(model_dir, tmp_path, marker):
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"model_file": "evil.py"}))
    (model_dir / "evil.py").write_text(evil_code(marker))
    with pytest.raises(ValueError, match="model_file"):
        convert(model_dir, tmp_path / "store")
    with pytest.raises(ValueError, match="model_file"):
        load(model_dir)


def test_model_file_in_a_store_is_never_run(store_dir, marker):
    """A hand-made store asking for custom model code: mlx-lm's class for the model type
    is used, the file is never imported."""
    config = json.loads((store_dir / "config.json").read_text())
    (store_dir / "config.json").write_text(json.dumps(config | {"model_file": "evil.py"}))
    (store_dir / "evil.py").write_text(evil_code(marker))
    sm = load(store_dir)
    assert type(sm.model).__module__ == "mlx_lm.models.qwen3_moe"


AUTO_MAP = {
    "AutoConfig": "configuration_evil.EvilConfig",
    "AutoModelForCausalLM": "modeling_evil.EvilModel",
    "AutoTokenizer": ["tokenization_evil.EvilTokenizer", "tokenization_evil.EvilTokenizer"],
}


def test_auto_map_of_a_model_directory_is_never_run(model_dir, tmp_path, marker):
    """auto_map in config.json and tokenizer_config.json with the code beside them:
    convert copies no .py file, and loading runs none."""
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"auto_map": AUTO_MAP}))
    write_tokenizer(model_dir, {"auto_map": AUTO_MAP, "tokenizer_class": "EvilTokenizer"})
    for name in ("configuration_evil.py", "modeling_evil.py", "tokenization_evil.py"):
        (model_dir / name).write_text(evil_code(marker))
    store = ExpertStore(convert(model_dir, tmp_path / "store"))
    assert not list(store.path.glob("*.py"))
    sm = load(model_dir)
    assert sm.tokenizer.encode("The cat sat", add_special_tokens=False) == [1, 2, 3]


@pytest.mark.parametrize(
    "tokenizer_config",
    [
        {"auto_map": AUTO_MAP, "tokenizer_class": "EvilTokenizer"},
        {"auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}},
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template_type": "tokenization_evil"},
    ],
    ids=["auto_map", "auto_map-slow-only", "chat_template_type"],
)
def test_tokenizer_code_in_a_store_is_never_run(store_dir, marker, tokenizer_config):
    """A store with tokenizer code of its own: loaded with a built-in tokenizer class,
    or refused with a clear error; the code never runs."""
    write_tokenizer(store_dir, tokenizer_config)
    (store_dir / "tokenization_evil.py").write_text(evil_code(marker))
    try:
        sm = load(store_dir)
    except StoreError as e:
        assert str(store_dir) in str(e)
    else:
        assert type(sm.tokenizer._tokenizer).__name__ != "EvilTokenizer"


def test_the_tokenizer_trap_is_live(store_dir, tmp_path):
    """Control: the same files do run their code when remote code is trusted, so the
    tests above would notice a loader that trusts it (engine.model passes False)."""
    marker = tmp_path / "control-marker"
    write_tokenizer(store_dir, {"auto_map": AUTO_MAP, "tokenizer_class": "EvilTokenizer"})
    (store_dir / "tokenization_evil.py").write_text(evil_code(marker))
    load_tokenizer(store_dir, {"trust_remote_code": True})
    assert marker.exists()


def test_load_passes_trust_remote_code_false(store_dir, monkeypatch):
    write_tokenizer(store_dir, {"tokenizer_class": "PreTrainedTokenizerFast"})
    seen = []

    def spy(path, extra=None, **kw):
        seen.append(extra)
        return load_tokenizer(path, extra, **kw)

    monkeypatch.setattr(tokenizer_mod, "load_tokenizer", spy)
    load(store_dir)
    assert seen == [{"trust_remote_code": False}]


# ---- paths ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../layer00.blob", "/etc/hostname", "..", "layer00.blob/.."])
def test_manifest_path_cannot_escape_through_load(store_dir, name):
    """The user-facing entry point refuses what test_store checks on ExpertStore."""
    manifest = json.loads((store_dir / "manifest.json").read_text())
    manifest["layers"][0]["file"] = name
    (store_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=r"is not a plain file name inside the store"):
        load(store_dir)
