#!/usr/bin/env bash
# Builds the desktop bundle from a wheel (packaging/README.md):
#     packaging/build_bundle.sh [WHEEL] [OUT]
# WHEEL defaults to the newest dist/expertstream-*.whl, OUT to dist/bundle.
#  1. a fresh virtual environment, build/bundle-venv, with the wheel, its `cpu` and `app` extras and
#     PyInstaller, made from $PYTHON (default python3; it must have a shared libpython);
#  2. PyInstaller on packaging/expertstream.spec: OUT/ExpertStream/ (and on macOS
#     OUT/ExpertStream.app);
#  3. Linux: the folder gets the `expertstream` command-line link, the .desktop file, the
#     icon, install-desktop-entry.sh and README.txt, and AppRun, which makes it an AppDir
#     too; it is packed as OUT/ExpertStream-VERSION-linux-ARCH.tar.gz, and as
#     OUT/ExpertStream-VERSION-ARCH.AppImage when appimagetool is on PATH.
#     macOS: the .app is zipped as OUT/ExpertStream-VERSION-macos-ARCH.zip.
set -euo pipefail
wheel=${1:+$(realpath "$1")}
out=${2:+$(realpath -m "$2")}
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
PYINSTALLER=${PYINSTALLER:-pyinstaller>=6.10,<7}
if [[ -z $wheel ]]; then  # the newest wheel in dist/
  for w in dist/expertstream-*.whl; do
    if [[ -f $w && (-z $wheel || $w -nt $wheel) ]]; then wheel=$w; fi
  done
fi
out=${out:-dist/bundle}
venv=build/bundle-venv
if [[ -z $wheel || ! -f $wheel ]]; then
  echo "build_bundle.sh: no wheel (make wheel builds one into dist/)" >&2
  exit 2
fi
version=$(basename "$wheel" | cut -d- -f2)
arch=$(uname -m)

echo "== bundle venv: ${wheel}[cpu,app], $PYINSTALLER"
"$PYTHON" -m venv --clear "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "${wheel}[cpu,app]" "$PYINSTALLER"

echo "== PyInstaller"
rm -rf "$out/ExpertStream" "$out/ExpertStream.app"
"$venv/bin/pyinstaller" --noconfirm --clean --log-level WARN \
  --distpath "$out" --workpath build/pyinstaller packaging/expertstream.spec

if [[ $(uname -s) == Darwin ]]; then
  ditto -c -k --keepParent "$out/ExpertStream.app" "$out/ExpertStream-$version-macos-$arch.zip"
  du -sh "$out/ExpertStream.app" "$out/ExpertStream-$version-macos-$arch.zip"
  exit 0
fi

dir=$out/ExpertStream
# PyInstaller bundles the libraries the Qt platform plugins need only if this machine has
# them; a bundle without them cannot open a window on X11 or Wayland.
missing=$(for plugin in "$dir"/_internal/PySide6/Qt/plugins/platforms/libq{xcb,wayland}.so; do
  LD_LIBRARY_PATH=$dir/_internal ldd "$plugin" | awk '/not found/ {print $1}'
done | sort -u)
if [[ -n $missing ]]; then
  echo "build_bundle.sh: the Qt platform plugins need libraries this machine lacks: ${missing//$'\n'/ }" >&2
  echo "  Debian/Ubuntu: apt-get install libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1" \
    "libxkbcommon-x11-0 libwayland-cursor0 libwayland-egl1" >&2
  exit 1
fi
ln -sfn expertstream-gui "$dir/expertstream"
ln -sfn expertstream-gui "$dir/AppRun"
cp packaging/linux/expertstream.desktop resources/icons/expertstream.png "$dir/"
cp packaging/linux/install-desktop-entry.sh packaging/linux/README.txt "$dir/"
chmod +x "$dir/install-desktop-entry.sh"

tarball=$out/ExpertStream-$version-linux-$arch.tar.gz
tar -C "$out" -czf "$tarball" ExpertStream
if command -v appimagetool >/dev/null; then
  ARCH=$arch appimagetool --no-appstream "$dir" "$out/ExpertStream-$version-$arch.AppImage"
else
  echo "(no appimagetool on PATH: no AppImage; the folder is an AppDir, see packaging/README.md)"
fi
du -sh "$dir" "$out"/ExpertStream-"$version"-*
