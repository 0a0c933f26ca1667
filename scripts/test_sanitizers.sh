#!/usr/bin/env bash
# The test suite built with AddressSanitizer and UndefinedBehaviorSanitizer
# and run on the CPU paths (the reference, the LLVM CPU backend, lowering,
# NVRTC compiles, the CLI and the fuzz tests; GPU tests skip without a GPU).
# Any report ends the test that caused it (halt_on_error), so ctest fails.
# Called by scripts/test.sh; its own build folder, kept between runs.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${MOEFORGE_SANITIZE_BUILD_DIR:-build-sanitize}
export PATH="$PATH:/usr/local/cuda/bin"
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEFORGE_BUILD_BENCHMARKS=OFF \
    -DCMAKE_CXX_FLAGS="$FLAGS" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
    -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
fi
cmake --build "$BUILD_DIR" -j "$(nproc)" --target moeforge_tests
# Leaks are not checked: LLVM's JIT and NVRTC keep process-lifetime caches
# that LeakSanitizer would report as leaks of ours.
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# The format and link checks say nothing about memory; the rest runs.
(cd "$BUILD_DIR" && ctest --output-on-failure -j "$(nproc)" -E "^(format|link):")
