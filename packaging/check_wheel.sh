#!/usr/bin/env bash
# End-to-end check of the Python packages, for CI. Outside the source tree, in a
# temporary folder:
#  1. python -m build: the sdist, and the wheel built from that sdist, made a manylinux
#     wheel by packaging/repair_wheel.sh (auditwheel, patchelf) on Linux;
#  2. the contents of both (packaging/check_wheel_contents.py);
#  3. a fresh virtual environment with the wheel and its `cpu` and `app` extras, from which it runs
#     one streamed generation (`expertstream generate`) and one offscreen screenshot
#     (`expertstream-gui --screenshot`), and checks the PNG and that `expertstream bench`
#     says it needs a source checkout (the benchmarks are not shipped);
#  4. a second fresh virtual environment that pip-installs the sdist (pip builds it again)
#     and runs one generation.
# Needs python3 (>= 3.11), a C++ compiler and the zlib headers, and the network for PyPI.
# Runtime here (2 cores): about 3 minutes. KEEP=1 keeps the temporary folder.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/expertstream-check-wheel.XXXXXX")
if [[ -z ${KEEP:-} ]]; then trap 'rm -rf "$work"' EXIT; fi
cd "$work"
# Converted stores go here, not to ~/.cache; no source tree on the import path.
export EXPERTSTREAM_CACHE=$work/store-cache PYTHONNOUSERSITE=1
unset PYTHONPATH
start=$SECONDS
step() { echo "== [$((SECONDS - start))s] $*"; }

step "python -m build (sdist, then the wheel from it)"
"$PYTHON" -m venv tools
tools/bin/python -m pip install -q build
tools/bin/python -m build --outdir dist "$src" >build.log 2>&1 || { tail -n 40 build.log; exit 1; }

step "auditwheel repair (Linux: a manylinux wheel)"
bash "$src/packaging/repair_wheel.sh" tools dist
wheel=$(ls dist/expertstream-*.whl)
if [[ $(uname -s) == Linux && $wheel != *manylinux* ]]; then
  echo "not a manylinux wheel: $wheel"; exit 1
fi
sdist=$(ls dist/expertstream-*.tar.gz)
ls -l dist

step "contents"
tools/bin/python "$src/packaging/check_wheel_contents.py" "$wheel" "$sdist"

step "fresh venv with the wheel"
"$PYTHON" -m venv wheel-venv
wheel-venv/bin/python -m pip install -q "${wheel}[cpu,app]"
wheel-venv/bin/python - <<'EOF'
import engine, engine._ext
from engine.resources import default_model_path
assert "site-packages" in engine.__file__, engine.__file__
assert default_model_path().is_dir(), default_model_path()
print("engine from", engine.__file__)
EOF

step "expertstream generate"
wheel-venv/bin/expertstream generate --max-tokens 16 --expert-slots 8

step "expertstream bench: not in the wheel, and says so"
if wheel-venv/bin/expertstream bench --suite quick 2>bench.err; then
  echo "expertstream bench ran from the wheel"; exit 1
fi
grep -q "source checkout" bench.err || { cat bench.err; exit 1; }

step "expertstream-gui --screenshot"
QT_QPA_PLATFORM=offscreen wheel-venv/bin/expertstream-gui --screenshot shot.png \
  --prompt "Once upon a time" --max-tokens 24
QT_QPA_PLATFORM=offscreen wheel-venv/bin/python - <<'EOF'
from PySide6.QtGui import QImage
image = QImage("shot.png")
assert not image.isNull() and image.width() >= 800 and image.height() >= 500, image.size()
print(f"shot.png {image.width()}x{image.height()}")
EOF

step "fresh venv with the sdist"
"$PYTHON" -m venv sdist-venv
sdist-venv/bin/python -m pip install -q "${sdist}[cpu]"
sdist-venv/bin/expertstream generate --max-tokens 8 --expert-slots 8

step "wheel and sdist OK"
