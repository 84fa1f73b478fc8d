"""The import layers of docs/architecture.md, and the native boundary's stub, hold.

- the app never imports `engine._ext` (it goes through `engine.cache`), nor does `bench`;
- the engine never imports `bench` or `app`;
- no core module of the engine imports a front end (`is_front_end`): the command line, the
  servers and their flags sit on top of it;
- no import cycles among the modules of engine/, app/ and bench/, counting imports
  inside functions too (a deferred import does not make a cycle acceptable);
- engine/_ext.pyi is what nanobind's stubgen makes of the built `engine._ext`.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "app", "bench")
# Front ends of the engine: the console entry (the command line and the flag names it
# shares) and the HTTP server's package. Every other engine module is core.
FRONT_END_MODULES = ("engine.cli", "engine.flags")
FRONT_END_PACKAGES = ("engine.serve",)


def is_front_end(mod: str) -> bool:
    """Whether engine module `mod` is a front end: a console entry module, or a front-end
    package or any module inside it."""
    return mod in FRONT_END_MODULES or any(
        mod == p or mod.startswith(p + ".") for p in FRONT_END_PACKAGES
    )


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in the file, as absolute names (`from a
    import b` counts as `a.b` when that is a module of ours, else as `a`)."""
    tree = ast.parse(path.read_text(), str(path))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}")
            found.add(base)
    return found


def our_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports (`engine._ext` included, a module
    without a .py file)."""
    mods = our_modules()
    known = set(mods) | {"engine._ext"}
    return {m: {i for i in imports_of(p) if i in known and i != m} for m, p in mods.items()}


def test_layers():
    wrong = []
    for mod, deps in graph().items():
        top = mod.split(".")[0]
        for dep in deps:
            dep_top = dep.split(".")[0]
            if top in ("app", "bench") and dep == "engine._ext":
                wrong.append(f"{mod} imports engine._ext (use engine.cache)")
            if top == "engine" and dep_top in ("app", "bench"):
                wrong.append(f"{mod} imports {dep}: the engine never imports {dep_top}")
            if top == "engine" and not is_front_end(mod) and is_front_end(dep):
                wrong.append(f"{mod} imports {dep}: a core module never imports a front end")
            if top == "app" and dep_top == "bench":
                wrong.append(f"{mod} imports {dep}: the benchmarks are not shipped")
    assert wrong == []


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join([*path[path.index(d) :], d]))
            elif d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert cycles == []


def test_the_layer_check_sees_imports():
    """The checks above read real imports: a known edge of each kind is found."""
    g = graph()
    assert "engine.cache" in g["app.monitor"]
    assert "engine._ext" in g["engine.cache"]
    assert "engine.model" in g["bench.peers"]
    assert "engine.predictor" in g["engine.model"]
    assert "engine.flags" in g["engine.cli"] and "engine.serve.server" in g["engine.cli"]
    assert is_front_end("engine.serve.openai") and not is_front_end("engine.chat")


def test_native_stub_is_current(tmp_path):
    out = tmp_path / "_ext.pyi"
    subprocess.run(
        [sys.executable, "-m", "nanobind.stubgen", "-q", "-m", "engine._ext", "-o", str(out)],
        check=True,
        cwd=ROOT,
    )
    assert out.read_text() == (ROOT / "engine" / "_ext.pyi").read_text(), (
        "engine/_ext.pyi is stale: run `make stubs` (python -m nanobind.stubgen -m engine._ext"
        " -o engine/_ext.pyi) and commit it"
    )


def test_one_vocabulary_across_the_boundary():
    """The native cache's keyword arguments are StreamConfig's fields where both have
    them, with the same defaults (the stub shows the native ones), and its eviction
    policies are `EVICTION_POLICIES`, in the same order."""
    import mlx.core  # noqa: F401  (before the extension)

    from engine import _ext
    from engine.config import EVICTION_POLICIES, MAX_READ_TIMEOUT_S, StreamConfig

    stub = ast.parse((ROOT / "engine" / "_ext.pyi").read_text())
    cache = next(n for n in stub.body if isinstance(n, ast.ClassDef) and n.name == "ExpertCache")
    init = next(n for n in cache.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args.args[len(init.args.args) - len(init.args.defaults) :]
    native = {a.arg: ast.literal_eval(d) for a, d in zip(args, init.args.defaults, strict=True)}
    python = {f: getattr(StreamConfig(), f) for f in StreamConfig.__dataclass_fields__}
    shared = {f: v for f, v in python.items() if f in native and v is not None}
    assert sorted(shared) == [
        "adaptive_prefetch",
        "decay_every",
        "io_uring",
        "policy",
        "read_timeout_s",
        "side_lfu",
        "side_slots",
        "sync",
        "uncached_io",
        "verify_checksums",
    ]
    assert {f: native[f] for f in shared} == shared
    assert _ext.POLICY_NAMES == EVICTION_POLICIES
    # the read timeout's range is the same on both sides (a cache of no layer checks it)
    refused = rf"read_timeout_s.*must be in \[0, {MAX_READ_TIMEOUT_S}\] seconds"
    for bad in (-0.001, MAX_READ_TIMEOUT_S + 0.001, float("nan")):
        with pytest.raises(ValueError, match=refused):
            StreamConfig(read_timeout_s=bad)
        with pytest.raises(ValueError, match=refused):
            _ext.ExpertCache([], 1, 1, read_timeout_s=bad)
    StreamConfig(read_timeout_s=MAX_READ_TIMEOUT_S)
    assert _ext.ExpertCache([], 1, 1, read_timeout_s=MAX_READ_TIMEOUT_S).num_layers == 0
