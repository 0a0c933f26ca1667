#!/usr/bin/env bash
# Fetches transformers (5.25, the version moeforge.transformers is tested
# with) and its dependencies as cp312 wheels into DEST (default
# .peers/transformers), for the GPU machine, whose Python 3.12 has torch and
# numpy but no transformers and no network. About 31 MB: it travels beside
# .gpu/ in one call. Add .peers/ to .git/info/exclude and carry the folder;
# scripts/device_python.sh installs it into /tmp/site when it is there, so
# tests/python/test_transformers.py runs on the GPU too.
set -euo pipefail
dest=${1:-.peers/transformers}
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
w=$(mktemp -d)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$w" transformers==5.25.0
rm -f "$w"/numpy-*.whl # the device's own numpy serves
cp "$w"/*.whl "$dest/"
rm -rf "$w"
du -sh "$dest"
