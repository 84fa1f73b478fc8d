# Native stress test of the expert cache under sanitizers (issue 6):
#   make asan   AddressSanitizer + UndefinedBehaviorSanitizer
#   make tsan   ThreadSanitizer
# Each configures ext/ with plain CMake into build/<name> (the Python module is not built),
# builds ext/tests/stress.cpp against the installed MLX and runs it for STRESS_SECONDS,
# once with STRESS_SEED (odd: 3 of 8 slots) and once with the next seed (even: every
# expert fits, so layers become complete and the device table is checked).
# Any sanitizer report or cache violation fails the target.

PYTHON ?= $(shell test -x .venv/bin/python && echo .venv/bin/python || echo python3)
# ext/ needs CMake >= 3.27: `pip install cmake` into the venv where the system's is older.
CMAKE ?= $(shell test -x .venv/bin/cmake && echo .venv/bin/cmake || echo cmake)
STRESS_SECONDS ?= 8
STRESS_SEED ?= 1
CMAKE_FLAGS = -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEXPERTSTREAM_BUILD_MODULE=OFF \
	-DEXPERTSTREAM_BUILD_TESTS=ON -DPython_EXECUTABLE=$(abspath $(shell command -v $(PYTHON)))

.PHONY: asan tsan sanitizers

sanitizers: asan tsan

asan:
	$(CMAKE) -S ext -B build/asan $(CMAKE_FLAGS) -DEXPERTSTREAM_SANITIZE=address >/dev/null
	$(CMAKE) --build build/asan --target stress -j 2
	ASAN_OPTIONS=halt_on_error=1:abort_on_error=1:detect_leaks=1:strict_string_checks=1 \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
		build/asan/stress $(STRESS_SECONDS) $(STRESS_SEED)
	ASAN_OPTIONS=halt_on_error=1:abort_on_error=1:detect_leaks=1:strict_string_checks=1 \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
		build/asan/stress $(STRESS_SECONDS) $$(( $(STRESS_SEED) + 1 ))

tsan:
	$(CMAKE) -S ext -B build/tsan $(CMAKE_FLAGS) -DEXPERTSTREAM_SANITIZE=thread >/dev/null
	$(CMAKE) --build build/tsan --target stress -j 2
	TSAN_OPTIONS="halt_on_error=1 exitcode=66 second_deadlock_stack=1" \
		build/tsan/stress $(STRESS_SECONDS) $(STRESS_SEED)
	TSAN_OPTIONS="halt_on_error=1 exitcode=66 second_deadlock_stack=1" \
		build/tsan/stress $(STRESS_SECONDS) $$(( $(STRESS_SEED) + 1 ))

# Packaging (issue 7, packaging/README.md):
#   make package      the wheel and sdist into dist/, then the desktop bundle into dist/bundle/
#   make wheel        python -m build (the wheel is built from the sdist), in build/package-tools,
#                     then packaging/repair_wheel.sh: the manylinux wheel (Linux)
#   make bundle       packaging/build_bundle.sh: the PyInstaller bundle of the newest wheel in dist/
#   make check-wheel  packaging/check_wheel.sh: wheel and sdist installed in fresh venvs, run (CI)
.PHONY: package wheel bundle check-wheel

package: wheel bundle

wheel:
	$(PYTHON) -m venv build/package-tools
	build/package-tools/bin/python -m pip install -q build
	build/package-tools/bin/python -m build --outdir dist .
	packaging/repair_wheel.sh build/package-tools dist

bundle:
	PYTHON=$(PYTHON) packaging/build_bundle.sh

check-wheel:
	PYTHON=$(PYTHON) packaging/check_wheel.sh
