#!/usr/bin/env bash
# Installs moeforge's dependencies from Debian's packages, configures and
# builds the library, the CLI and the Python package (one build tree for
# both, so the C++ core compiles once), and runs the main example. Safe to
# run again. The tests and benchmarks build in the same tree with
# scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${MOEFORGE_BUILD_DIR:-build}

if command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  # llvm-19-dev: the newest LLVM Debian 12 offers; the CPU backend JITs with ORC.
  PKGS="cmake ninja-build g++ clang-format libeigen3-dev doctest-dev libbenchmark-dev llvm-19-dev"
  missing=""
  for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
  if [ -n "$missing" ]; then
    $SUDO apt-get update
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y $missing
  fi
fi
# The CUDA toolkit is optional: found at /usr/local/cuda when present.
export PATH="$PATH:/usr/local/cuda/bin"

# The Python package (import moeforge): its build tools from PyPI, then
# `pip install .`, which configures $BUILD_DIR (Ninja, Release) and builds
# the extension there, the core with it.
MOEFORGE_BUILD_DIR="$BUILD_DIR" bash scripts/install_python.sh
# The CLI, from the objects just built.
cmake --build "$BUILD_DIR" -j "$(nproc)" --target moeforge
"$BUILD_DIR/tools/moeforge" run moe_mlp --check
