#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries here (no LLVM, so nothing large
# travels) and packs them with the shared libraries the device machine lacks
# into .gpu/, which the device tool carries. See scripts/device_run.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEFORGE_WITH_LLVM=OFF >/dev/null
cmake --build build-gpu -j "$(nproc)"
rm -rf .gpu && mkdir -p .gpu/lib
cp build-gpu/tests/moeforge_tests build-gpu/tools/moeforge .gpu/
[ -f build-gpu/benchmarks/bench_moe_forward ] && cp build-gpu/benchmarks/bench_moe_forward .gpu/
[ -f build-gpu/benchmarks/bench_moe_train ] && cp build-gpu/benchmarks/bench_moe_train .gpu/
[ -f build-gpu/benchmarks/bench_expert_exchange ] && cp build-gpu/benchmarks/bench_expert_exchange .gpu/
[ -f build-gpu/benchmarks/bench_expert_parallel ] && cp build-gpu/benchmarks/bench_expert_parallel .gpu/
[ -f build-gpu/benchmarks/bench_fp8_gemm ] && cp build-gpu/benchmarks/bench_fp8_gemm .gpu/
cp -L /usr/lib/x86_64-linux-gnu/libbenchmark.so.1debian .gpu/lib/
du -sh .gpu
