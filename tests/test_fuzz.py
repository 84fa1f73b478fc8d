"""Property-based fuzzing of every parser of untrusted input.

Each parser gets valid files mutated at random (a value replaced by any JSON value, a key
dropped, bytes flipped or cut) and random input from scratch. The property: it accepts
the input or raises the project's own error naming the file (`ModelFileError`, of which
`StoreError` is one; `ValueError` from the chat template) — never another exception, and
what it accepts the next stage accepts too (a config that passes the checks builds its
model or is refused by name).

Bounded here (ES_FUZZ_EXAMPLES examples per parser, default 30); a longer run:
`ES_FUZZ_EXAMPLES=5000 pytest tests/test_fuzz.py` (docs/reliability.md has the figures).
"""

import copy
import json
import os
import shutil
import struct
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hostile_files import write_tokenizer

from engine import autopin
from engine.chat import chat_ids
from engine.experts import NotMoEError, UnsupportedModelError, find_experts, instantiate
from engine.model import load_store_tokenizer
from engine.safe_io import ModelFileError, parse_json
from engine.safetensors_header import parse_header, read_header
from engine.store import ExpertStore, Manifest, StoreError
from engine.validate import check_against_weights, check_config

EXAMPLES = int(os.environ.get("ES_FUZZ_EXAMPLES", "30"))
SEEN = Counter()  # inputs tried per parser, and how many of them were refused
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, -1, 1, 2**31, 2**32, 2**63, 10**12])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def paths(obj, prefix=()):
    """Every path (tuple of keys and indices) into a JSON value, the root included."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from paths(v, (*prefix, i))


@st.composite
def mutated(draw, base):
    """`base` (a JSON value) with 1-3 random edits: a value replaced, a key or item
    dropped, or a key added."""
    obj = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(list(paths(obj))))
        if not where:
            obj = draw(JSON) if draw(st.integers(0, 9)) == 0 else obj
            continue
        parent = obj
        for key in where[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "replace", "drop", "add"]))
        if action == "replace":
            parent[where[-1]] = draw(JSON)
        elif action == "drop":
            del parent[where[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(JSON)
        else:
            parent.append(draw(JSON))
    return obj


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    """Prints the inputs each parser got (run with -s to see them)."""
    yield
    names = sorted({k for k in SEEN if not k.endswith(" refused")})
    print(
        "\nfuzz inputs: "
        + "; ".join(f"{n} {SEEN[n]} ({SEEN[n + ' refused']} refused)" for n in names)
    )


def seen(name: str, refused: bool) -> None:
    SEEN[name] += 1
    SEEN[name + " refused"] += refused


@pytest.fixture(scope="module")
def pristine(qwen_store, tmp_path_factory):
    """A store copy that no example writes to (parsers get their input in memory)."""
    return Path(shutil.copytree(qwen_store.path, tmp_path_factory.mktemp("fuzz") / "store"))


# ---- manifest.json ------------------------------------------------------------------------


def test_fuzz_manifest(pristine):
    base = json.loads((pristine / "manifest.json").read_text())

    @FUZZ
    @given(data=mutated(base))
    def run(data):
        try:
            manifest = Manifest.from_json(data, pristine)
        except StoreError as e:
            seen("manifest", True)
            assert str(pristine) in str(e)
        else:
            seen("manifest", False)  # accepted: it describes exactly the files present
            assert manifest.to_json()["layers"] == [s.to_json() for s in manifest.layers]

    run()


@FUZZ
@given(raw=st.binary(max_size=200))
def test_fuzz_json_bytes(raw):
    try:
        parse_json(raw, "f.json")
        seen("json bytes", False)
    except ModelFileError as e:
        seen("json bytes", True)
        assert str(e).startswith("f.json: ")


# ---- config.json -----------------------------------------------------------------------


def test_fuzz_config(pristine):
    """A config that passes `check_config` and agrees with the weights builds its model
    (and its experts are found) or is refused by name: no TypeError, ZeroDivisionError or
    AssertionError from mlx-lm."""
    base = json.loads((pristine / "config.json").read_text())
    tensors = ExpertStore(pristine).dense_header()

    @FUZZ
    @given(config=mutated(base))
    def run(config):
        try:
            check_config(config, "config.json")
            check_against_weights(config, tensors, "config.json", "dense.safetensors")
            find_experts(instantiate(config, "config.json"), "config.json")
            seen("config", False)
        except (ModelFileError, UnsupportedModelError, NotMoEError) as e:
            seen("config", True)
            assert str(e).startswith("config.json: ")

    run()


# ---- safetensors headers ----------------------------------------------------------------


def test_fuzz_safetensors_header(pristine):
    data = (pristine / "dense.safetensors").read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    base = json.loads(data[8 : 8 + n])
    size = len(data) - 8 - n

    @FUZZ
    @given(header=mutated(base))
    def run(header):
        try:
            tensors = parse_header(json.dumps(header).encode(), size, "h")
        except ModelFileError as e:
            seen("safetensors header", True)
            assert str(e).startswith("h: ")
        else:
            seen("safetensors header", False)  # accepted: the tensors tile the buffer exactly
            spans = sorted((t.begin, t.end) for t in tensors.values())
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
            assert spans[-1][1] == size

    run()


@FUZZ
@given(
    cut=st.integers(0, 400),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=4),
)
def test_fuzz_safetensors_bytes(pristine, tmp_path, cut, flips):
    """Whole files with bytes flipped anywhere (header length included) or cut short."""
    data = bytearray((pristine / "dense.safetensors").read_bytes())
    for at, x in flips:
        data[at % len(data)] ^= x
    del data[len(data) - cut :]
    path = tmp_path / "x.safetensors"
    path.write_bytes(bytes(data))
    try:
        read_header(path)
        seen("safetensors file", False)
    except ModelFileError as e:
        seen("safetensors file", True)
        assert str(path) in str(e)


# ---- autopin.json -------------------------------------------------------------------------


@FUZZ
@given(data=mutated({"num_experts": 8, "pins": [[0, 3], [1], [], [7, 2]]}))
def test_fuzz_autopin_file(tmp_path, data):
    path = tmp_path / autopin.PIN_FILE
    path.write_text(json.dumps(data))
    pins = autopin.load(path, num_experts=8, num_layers=4, k=2)
    seen("autopin.json", pins == [])
    assert pins == [] or (
        len(pins) == 4 and all(len(p) <= 2 and all(0 <= e < 8 for e in p) for p in pins)
    )


# ---- tokenizer files and chat templates ----------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_store(pristine, tmp_path_factory):
    path = Path(shutil.copytree(pristine, tmp_path_factory.mktemp("tok") / "store"))
    write_tokenizer(path)
    return ExpertStore(path)


def test_fuzz_tokenizer_files(tokenizer_store):
    """tokenizer.json and tokenizer_config.json mutated: loaded, or refused by name."""
    path = tokenizer_store.path
    bases = {
        name: json.loads((path / name).read_text())
        for name in ("tokenizer.json", "tokenizer_config.json")
    }

    @settings(FUZZ, max_examples=max(10, EXAMPLES // 3))
    @given(name=st.sampled_from(sorted(bases)), data=st.data())
    def run(name, data):
        (path / name).write_text(json.dumps(data.draw(mutated(bases[name]))))
        try:
            load_store_tokenizer(tokenizer_store)
            seen("tokenizer files", False)
        except StoreError as e:
            seen("tokenizer files", True)
            assert str(path) in str(e)
        finally:
            (path / name).write_text(json.dumps(bases[name]))

    run()


TEMPLATE_PARTS = [
    "{% for m in messages %}",
    "{% endfor %}",
    "{{ m.content }}",
    "{{ m['role'] }}",
    "{% if add_generation_prompt %}",
    "{% endif %}",
    "{{ raise_exception('x') }}",
    "{{ messages[9].content }}",
    "{{ 1 / 0 }}",
    "{{ m.content.upper()|trim }}",
    "{%",
    "}}",
    "{{ bos_token }}",
    "text ",
    "{% set x = x + 1 %}",
    "{{ range(10**9)|list|length }}",
]


def test_fuzz_chat_template(tokenizer_store):
    tok = load_store_tokenizer(tokenizer_store)
    messages = [{"role": "user", "content": "The cat"}]

    @FUZZ
    @given(parts=st.lists(st.sampled_from(TEMPLATE_PARTS), max_size=8))
    def run(parts):
        tok._tokenizer.chat_template = "".join(parts) or None
        try:
            ids = chat_ids(tok, messages)
            seen("chat template", False)
        except ValueError as e:
            seen("chat template", True)
            assert "the chat template refuses the conversation" in str(e) or "empty" in str(e)
        else:
            assert all(isinstance(i, int) for i in ids)

    try:
        run()
    finally:
        tok._tokenizer.chat_template = None
