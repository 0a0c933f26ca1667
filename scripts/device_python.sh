#!/usr/bin/env bash
# Runs on the GPU machine (through the device tool, with .gpu/ carried from
# scripts/device_pack.sh): builds and installs the Python package there (its
# Python 3.12 has torch, nanobind and scikit-build-core; no LLVM, so the CPU
# backend is off), runs the Python tests (moeforge.torch against plain
# PyTorch, a training loop, CUDA graph capture) and times the torch module
# against the same compiled layer (benchmarks/torch_module_train.py) on the
# schedules bench_moe_train writes. Logs and JSON go to $OUT/python (or
# $OUT/$PYTHON_DIR), packed into a .tgz of that name at the end (the device
# tool brings back a few files), so one call can run this twice.
# SHAPES: the shapes to time (default all five); ROUNDS: alternating rounds
# (default 5); PYTEST=0 skips the tests (a timing-only call), PYTEST_FILES
# names the test files to run (default all of tests/python) and
# PYTEST_TIMEOUT their time (default 600 s); MODULE=0 skips
# the module's timing; TRANSFORMERS_TABLE=1 trains transformers' small models
# with each experts implementation (benchmarks/transformers_train.py, needs
# .peers/transformers from scripts/prep_transformers.sh); PROBE=1 runs
# benchmarks/reduce_overhead_probe.py (what inductor's CUDA-graph trees
# refuse); DECODE=1 runs benchmarks/torch_decode.py's token sweep (issue
# #53; DECODE_IMPLS, default moeforge,torch).
set -uo pipefail
. scripts/device_env.sh
D=${PYTHON_DIR:-python}
R=$OUT/$D
mkdir -p "$R/sched"
SHAPES=${SHAPES:-mixtral,fine64,mbpaper,qwen3moe,gptoss}
status=0
device_note "$R/device.txt"
python3 -m pip install -q --no-build-isolation . -Ccmake.define.MOEFORGE_WITH_LLVM=OFF -Cbuild-dir=/tmp/pybuild \
  >"$R/pip.log" 2>&1 || { tail -20 "$R/pip.log"; exit 1; }
if [ -d .peers/transformers ]; then # scripts/prep_transformers.sh: moeforge.transformers' tests run too
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .peers/transformers/*.whl \
    >"$R/transformers.log" 2>&1 || tail -5 "$R/transformers.log"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ "${PYTEST:-1}" != 0 ]; then
  timeout "${PYTEST_TIMEOUT:-600}" python3 -m pytest -q -rs ${PYTEST_FILES:-tests/python} >"$R/pytest.log" 2>&1 ||
    status=1
  tail -15 "$R/pytest.log"
fi
if [ "${PROBE:-0}" = 1 ]; then
  timeout 300 python3 benchmarks/reduce_overhead_probe.py >"$R/reduce_overhead_probe.log" 2>&1
  tail -12 "$R/reduce_overhead_probe.log"
fi
if [ "${DECODE:-0}" = 1 ]; then
  PYTHONUNBUFFERED=1 timeout 400 python3 benchmarks/torch_decode.py --impls "${DECODE_IMPLS:-moeforge,torch}" \
    --out "$R/decode.json" >"$R/decode.log" 2>&1 || status=1
  tail -40 "$R/decode.log"
fi
if [ "${TRANSFORMERS_TABLE:-0}" = 1 ]; then
  PYTHONUNBUFFERED=1 timeout "${TRANSFORMERS_TIMEOUT:-500}" python3 benchmarks/transformers_train.py --out "$R/transformers.json" \
    >"$R/transformers_train.log" 2>&1 || status=1
  tail -16 "$R/transformers_train.log"
fi
if [ "${MODULE:-1}" = 0 ]; then
  (cd "$OUT" && tar czf "$D.tgz" "$D" && rm -rf "$D")
  exit $status
fi
MOEFORGE_WRITE_SCHEDULES=$R/sched timeout 400 .gpu/bench_moe_train \
  --benchmark_filter="train/(${SHAPES//,/|})/uniform/tuned_wide/store" --benchmark_out="$R/train.json" \
  --benchmark_out_format=json --benchmark_counters_tabular=true >"$R/train.log" 2>&1 || status=1
grep -E "^train" "$R/train.log" | cut -c1-160
PYTHONUNBUFFERED=1 timeout 540 python3 benchmarks/torch_module_train.py --schedules "$R/sched" --variant tuned_wide_store \
  --shapes "$SHAPES" --bench .gpu/bench_moe_train --rounds "${ROUNDS:-5}" --out "$R/module.json" 2>&1 | tee "$R/module.log" ||
  status=1
(cd "$OUT" && tar czf "$D.tgz" "$D" && rm -rf "$D")
exit $status
