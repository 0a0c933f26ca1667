#!/usr/bin/env bash
# Installs the Python package `moeforge` into the python3 on PATH: the build
# tools from PyPI (nanobind, scikit-build-core; numpy and pytest for the
# tests), then `pip install .`, building the extension in the C++ build tree
# ($MOEFORGE_BUILD_DIR, default build/; configured with the Python package,
# the tests and the benchmarks on, as the other scripts build it), so the
# core compiles once for the CLI, the tests and Python, and a second install
# only rebuilds what changed. (`pip install .` alone builds in build-python/.)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${MOEFORGE_BUILD_DIR:-build}
export PATH="$PATH:/usr/local/cuda/bin"
# Debian's own python3 marks itself externally managed (PEP 668); this
# package goes into whichever python3 is first on PATH, as a user asked.
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
if ! python3 -m pip --version >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y python3-pip python3-dev
fi
python3 -m pip install -q "nanobind>=2.0" "scikit-build-core>=0.10" numpy pytest
python3 -m pip install -q --no-build-isolation -C build-dir="$BUILD_DIR" \
  -C cmake.define.MOEFORGE_BUILD_TESTS=ON -C cmake.define.MOEFORGE_BUILD_BENCHMARKS=ON .
python3 -c "import moeforge; print('moeforge', moeforge.__version__, 'for Python: CPU backend', moeforge.has_cpu_backend)"
