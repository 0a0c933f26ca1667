#!/usr/bin/env bash
# Builds (if needed) and runs the whole test suite. GPU tests skip visibly
# where no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${MOEFORGE_BUILD_DIR:-build}
export PATH="$PATH:/usr/local/cuda/bin"
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
fi
cmake --build "$BUILD_DIR" -j "$(nproc)"
(cd "$BUILD_DIR" && ctest --output-on-failure -j "$(nproc)")
# The Python package, rebuilt where the sources changed, and its tests.
bash scripts/install_python.sh
python3 -m pytest -q tests/python
# The suite again under AddressSanitizer and UBSan (its own build folder).
bash scripts/test_sanitizers.sh
# The installed library, as another project uses it (find_package(moeforge)).
MOEFORGE_BUILD_DIR="$BUILD_DIR" bash scripts/check_install.sh
