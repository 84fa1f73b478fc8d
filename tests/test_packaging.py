"""Packaging files, checked without building anything.

The console scripts resolve to callables, the bundle's entry point dispatches on its name,
the PyInstaller spec compiles and every file it names exists, the .desktop file and the
Info.plist are valid, the icon renders in every format, and the scripts parse. The slow
end-to-end checks are packaging/check_wheel.sh (wheel and sdist in fresh venvs) and
`make bundle`.
"""

import ast
import configparser
import importlib
import importlib.util
import io
import os
import plistlib
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402
from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtGui import QImage, QImageReader, QPainter  # noqa: E402
from PySide6.QtSvg import QSvgRenderer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PACKAGING = ROOT / "packaging"
ICONS = ROOT / "resources" / "icons"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.parametrize("name", ["expertstream", "expertstream-gui"])
def test_console_scripts_point_at_callables(name):
    target = PYPROJECT["project"]["scripts"][name]
    module, attr = target.split(":")
    assert callable(getattr(importlib.import_module(module), attr))


def test_wheel_ships_the_packages_and_resources():
    skb = PYPROJECT["tool"]["scikit-build"]
    assert skb["wheel"]["packages"] == ["engine", "app"]
    assert skb["wheel"]["install-dir"] == "engine"  # CMake's `resources` -> engine/resources
    assert ".*" in skb["wheel"]["exclude"]
    # An unanchored pattern also matches build/ and dist/ copies of resources/.
    assert all(p.startswith("/") for p in skb.get("sdist", {}).get("include", []))
    cmake = (ROOT / "ext" / "CMakeLists.txt").read_text()
    assert "DESTINATION resources)" in cmake
    assert "$ORIGIN/../mlx/lib" in cmake


def _launcher():
    spec = importlib.util.spec_from_file_location("bundle_launcher", PACKAGING / "expertstream.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("argv0", "expected"),
    [
        ("/opt/ExpertStream/expertstream", "cli"),
        ("expertstream.exe", "cli"),
        ("/opt/ExpertStream/expertstream-gui", "gui"),
        ("/tmp/.mount_X/AppRun", "gui"),
        ("/Applications/ExpertStream.app/Contents/MacOS/expertstream-gui", "gui"),
    ],
)
def test_bundle_entry_point_dispatches_on_its_name(monkeypatch, argv0, expected):
    import app.main
    import engine.cli

    monkeypatch.setattr(engine.cli, "main", lambda: "cli")
    monkeypatch.setattr(app.main, "main", lambda: "gui")
    monkeypatch.setattr(sys, "argv", [argv0])
    assert _launcher().main() == expected


def _spec_paths(tree: ast.AST) -> list[Path]:
    """Paths the spec builds as PACKAGING / "..." or ICONS / "..." from string constants."""
    bases = {"PACKAGING": PACKAGING, "ICONS": ICONS}
    found = []

    def resolve(node):
        if isinstance(node, ast.Name) and node.id in bases:
            return bases[node.id]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            left = resolve(node.left)
            if left is not None and isinstance(node.right, ast.Constant):
                return left / node.right.value
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            path = resolve(node)
            if path is not None and path not in bases.values():
                found.append(path)
    return found


def test_pyinstaller_spec_compiles_and_names_existing_files():
    source = (PACKAGING / "expertstream.spec").read_text()
    tree = ast.parse(source, "expertstream.spec")
    compile(tree, "expertstream.spec", "exec")
    paths = _spec_paths(tree)
    names = {p.name for p in paths}
    assert {"expertstream.py", "Info.plist", "expertstream.icns"} <= names
    for path in paths:
        assert path.exists(), path


def test_desktop_file_is_valid():
    desktop = PACKAGING / "linux" / "expertstream.desktop"
    if shutil.which("desktop-file-validate"):
        out = subprocess.run(
            ["desktop-file-validate", str(desktop)], capture_output=True, text=True
        )
        assert out.returncode == 0 and "error" not in out.stdout, out.stdout
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str
    parser.read(desktop)
    entry = parser["Desktop Entry"]
    assert entry["Type"] == "Application"
    assert entry["Exec"] == "expertstream-gui"  # the bundle's executable
    assert entry["Icon"] == "expertstream"  # expertstream.png beside it
    assert entry["Terminal"] == "false"
    assert entry["Categories"].endswith(";")


def test_install_desktop_entry_writes_a_valid_entry(tmp_path):
    bundle = tmp_path / "My Apps" / "ExpertStream"
    bundle.mkdir(parents=True)
    for src in (
        PACKAGING / "linux" / "install-desktop-entry.sh",
        PACKAGING / "linux" / "expertstream.desktop",
        ICONS / "expertstream.png",
    ):
        shutil.copy(src, bundle)
    data = tmp_path / "data"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "XDG_DATA_HOME": str(data)}
    script = bundle / "install-desktop-entry.sh"
    subprocess.run(["sh", str(script)], env=env, check=True, capture_output=True)
    entry = data / "applications" / "expertstream.desktop"
    assert f'Exec="{bundle}/expertstream-gui"' in entry.read_text().splitlines()
    assert (data / "icons" / "hicolor" / "512x512" / "apps" / "expertstream.png").is_file()
    if shutil.which("desktop-file-validate"):
        subprocess.run(["desktop-file-validate", str(entry)], check=True)
    subprocess.run(["sh", str(script), "--remove"], env=env, check=True, capture_output=True)
    assert not entry.exists()


def test_info_plist():
    with open(PACKAGING / "macos" / "Info.plist", "rb") as f:
        plist = plistlib.load(f)
    assert plist["CFBundleIdentifier"].count(".") >= 2
    assert plist["CFBundleName"] == "ExpertStream"
    assert plist["NSHighResolutionCapable"] is True
    # PyInstaller's BUNDLE writes these from the spec; a copy here would go stale.
    assert not {"CFBundleExecutable", "CFBundleShortVersionString", "CFBundleIconFile"} & set(plist)


def test_svg_icon_renders(qapp):
    renderer = QSvgRenderer(str(ICONS / "expertstream.svg"))
    assert renderer.isValid()
    image = QImage(64, 64, QImage.Format.Format_ARGB32)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    renderer.render(painter)
    painter.end()
    assert image.pixelColor(32, 32).alpha() == 255  # opaque in the middle
    assert image.pixelColor(0, 0).alpha() == 0  # rounded corners


@pytest.mark.parametrize(
    ("name", "size"),
    [("expertstream.png", 512), ("expertstream.icns", 1024), ("expertstream.ico", 256)],
)
def test_icon_renditions_load(qapp, name, size):
    reader = QImageReader(str(ICONS / name))
    sizes = []
    for i in range(max(1, reader.imageCount())):
        reader.jumpToImage(i)
        image = reader.read()
        assert not image.isNull(), (name, i, reader.errorString())
        sizes.append(image.width())
    assert max(sizes) == size


@pytest.mark.parametrize(
    "script", ["build_bundle.sh", "check_wheel.sh", "linux/install-desktop-entry.sh"]
)
def test_shell_scripts_parse(script):
    path = PACKAGING / script
    assert os.access(path, os.X_OK), f"{path} is not executable"
    subprocess.run(["bash", "-n", str(path)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(path)], check=True)


def test_make_package_target():
    if not shutil.which("make"):
        pytest.skip("no make")
    out = subprocess.run(
        ["make", "-n", "package"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "-m build --outdir dist" in out
    assert "packaging/build_bundle.sh" in out


def _checker():
    spec = importlib.util.spec_from_file_location(
        "check_wheel_contents", PACKAGING / "check_wheel_contents.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wheel_contents_checker(tmp_path):
    checker = _checker()
    wheel = tmp_path / "expertstream-0.1.0-cp311-cp311-macosx_14_0_arm64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for pattern in checker.WHEEL_REQUIRED:
            zf.writestr(pattern.replace("*", "cpython-311-darwin"), b"")
        zf.writestr("engine/resources/.DS_Store", b"")
        zf.writestr(
            "expertstream-0.1.0.dist-info/entry_points.txt",
            "[console_scripts]\n" + "".join(f"{k} = {v}\n" for k, v in checker.SCRIPTS.items()),
        )
    assert checker.wheel_problems(str(wheel)) == ["junk engine/resources/.DS_Store"]


def test_sdist_contents_checker(tmp_path):
    checker = _checker()
    sdist = tmp_path / "expertstream-0.1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        for name in (*checker.SDIST_REQUIRED, ".gitignore", ".ci/run"):
            info = tarfile.TarInfo(f"expertstream-0.1.0/{name}")
            tf.addfile(info, io.BytesIO())
        junk = tarfile.TarInfo("expertstream-0.1.0/build/venv/engine/resources/model.safetensors")
        tf.addfile(junk, io.BytesIO())
    found = checker.sdist_problems(str(sdist))
    assert found[0] == "junk build/venv/engine/resources/model.safetensors"
    assert found[1].startswith("expected one model.safetensors")
    assert len(found) == 2
