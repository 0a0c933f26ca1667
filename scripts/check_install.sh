#!/usr/bin/env bash
# Installs the built tree into a temporary prefix, then configures, builds and
# runs examples/consumer against it: the way another project uses moeforge
# (find_package(moeforge), <moeforge/moeforge.h>, moeforge::moeforge and
# moeforge::cpu). Run by scripts/test.sh after the build; needs the build
# directory (MOEFORGE_BUILD_DIR, default build) to be built already.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${MOEFORGE_BUILD_DIR:-build}
export PATH="$PATH:/usr/local/cuda/bin"
if [ ! -f "$BUILD_DIR/cmake_install.cmake" ]; then
  echo "check_install: $BUILD_DIR is not a configured build directory: run bash scripts/setup.sh first" >&2
  exit 2
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/moeforge-install.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
PREFIX="$WORK/prefix"

cmake --install "$BUILD_DIR" --prefix "$PREFIX" >"$WORK/install.log" || {
  cat "$WORK/install.log" >&2
  exit 1
}
echo "check_install: installed into $PREFIX: $(find "$PREFIX/include" -name '*.h' | wc -l) headers," \
  "$(find "$PREFIX/lib" -name '*.a' | wc -l) libraries"

GENERATOR=()
command -v ninja >/dev/null 2>&1 && GENERATOR=(-G Ninja)
cmake -S examples/consumer -B "$WORK/consumer" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$PREFIX" -DCMAKE_EXPORT_COMPILE_COMMANDS=ON >"$WORK/configure.log" 2>&1 || {
  cat "$WORK/configure.log" >&2
  exit 1
}
grep "moeforge .* at " "$WORK/configure.log" | sed 's/^-- /check_install: /'
# The consumer sees only the prefix: no include path into this tree.
if grep -Eo -- "-(I|isystem) ?$PWD[^ \"]*" "$WORK/consumer/compile_commands.json"; then
  echo "check_install: the consumer's include path reaches into the source tree (above), not only the prefix" >&2
  exit 1
fi
cmake --build "$WORK/consumer" -j "$(nproc)" >"$WORK/build.log" 2>&1 || {
  cat "$WORK/build.log" >&2
  exit 1
}
if ! "$WORK/consumer/consumer" >"$WORK/run.log" 2>&1; then
  cat "$WORK/run.log" >&2
  echo "check_install: FAIL: examples/consumer, built against the installed tree, failed" >&2
  exit 1
fi
tail -n 2 "$WORK/run.log" | sed 's/^/check_install: /'
echo "check_install: PASS"
