"""Checks built distributions: what they must hold, and no build junk.

    python packaging/check_wheel_contents.py dist/expertstream-*.whl dist/expertstream-*.tar.gz

Exits 1 with one line per problem. Run by packaging/check_wheel.sh.
"""

import configparser
import fnmatch
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

MODEL = "resources/models/tinystories-moe"
WHEEL_REQUIRED = (
    "engine/_ext.*.so",  # the compiled core
    "engine/_ext.pyi",  # and its typed interface
    "engine/__init__.py",
    "engine/cli.py",
    "engine/resources.py",
    "engine/serve/server.py",  # a subpackage: expertstream serve
    "app/__init__.py",
    "app/main.py",
    "engine/resources/style.qss",
    "engine/resources/icons/expertstream.svg",
    "engine/resources/icons/expertstream.png",
    f"engine/{MODEL}/config.json",
    f"engine/{MODEL}/model.safetensors",
    f"engine/{MODEL}/tokenizer.json",
)
SDIST_REQUIRED = (
    "pyproject.toml",
    "ext/CMakeLists.txt",
    "engine/__init__.py",
    "app/main.py",
    "resources/style.qss",
    "resources/icons/expertstream.svg",
    f"{MODEL}/model.safetensors",
    f"{MODEL}/tokenizer.json",
)
JUNK = ("__pycache__/*", "*.pyc", ".*", "*.o", "*.a", "*~", "*.orig", "*.rej", "CMakeFiles/*")
WHEEL_JUNK = (*JUNK, "build/*", "dist/*", "tests/*", "ext/*", "bench/*")
# Dot files git keeps, and the build and virtual-environment folders that must not ship.
SDIST_KEPT = (".gitignore", ".ci/*")
SDIST_JUNK = (*JUNK, "build/*", "dist/*", ".venv/*", "*.so", "*.egg-info/*")
SCRIPTS = {"expertstream": "engine.cli:main", "expertstream-gui": "app.main:main"}
RPATH = "$ORIGIN/../mlx/lib"


def _matches(name: str, patterns) -> bool:
    """`name` or any of its trailing sub-paths matches one of `patterns`."""
    parts = name.split("/")
    return any(fnmatch.fnmatch("/".join(parts[i:]), p) for i in range(len(parts)) for p in patterns)


def _contents(names: list[str], required, junk, kept=()) -> list[str]:
    found = [f"missing {p}" for p in required if not fnmatch.filter(names, p)]
    found += [
        f"junk {n}"
        for n in names
        if ".dist-info/" not in n and not _matches(n, kept) and _matches(n, junk)
    ]
    return found


def wheel_problems(wheel: str) -> list[str]:
    """Everything wrong with `wheel`, one message each (empty when it is fine)."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        found = _contents(names, WHEEL_REQUIRED, WHEEL_JUNK)
        extensions = [n for n in names if n.endswith((".so", ".dylib", ".pyd"))]
        if len(extensions) != 1:
            found.append(f"expected one native module, found {extensions}")
        (dist_info,) = {n.split("/")[0] for n in names if ".dist-info/" in n}
        entry_points = configparser.ConfigParser()
        entry_points.read_string(zf.read(f"{dist_info}/entry_points.txt").decode())
        scripts = dict(entry_points.items("console_scripts")) if entry_points.sections() else {}
        if scripts != SCRIPTS:
            found.append(f"console scripts {scripts}, expected {SCRIPTS}")
        if "linux" in Path(wheel).name:
            for ext in fnmatch.filter(names, "engine/_ext.*.so"):
                found += _rpath_problems(zf.read(ext), ext)
    return found


def sdist_problems(sdist: str) -> list[str]:
    """Everything wrong with `sdist` (a .tar.gz), one message each."""
    with tarfile.open(sdist) as tf:
        names = [m.name.split("/", 1)[1] for m in tf.getmembers() if "/" in m.name]
    found = _contents(names, SDIST_REQUIRED, SDIST_JUNK, SDIST_KEPT)
    copies = [n for n in names if n.endswith("model.safetensors")]
    if len(copies) != 1:
        found.append(f"expected one model.safetensors, found {copies}")
    return found


def _rpath_problems(data: bytes, member: str) -> list[str]:
    """The Linux module must find libmlx in the installed mlx package."""
    with tempfile.NamedTemporaryFile(suffix=".so") as f:
        f.write(data)
        f.flush()
        try:
            out = subprocess.run(
                ["readelf", "-d", f.name], capture_output=True, text=True, check=True
            ).stdout
        except (OSError, subprocess.CalledProcessError):
            return []  # no readelf (binutils): importing engine._ext in check_wheel.sh covers it
    return [] if RPATH in out else [f"{member}: RUNPATH/RPATH is not {RPATH}"]


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    failed = False
    for path in argv[1:]:
        found = wheel_problems(path) if path.endswith(".whl") else sdist_problems(path)
        for p in found:
            print(f"{path}: {p}", file=sys.stderr)
        if not found:
            print(f"{path}: contents OK")
        failed |= bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
