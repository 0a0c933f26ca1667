#!/usr/bin/env bash
# Runs on the GPU machine (through the device tool), from the repository
# root: the layer inside a model (issue 48). Builds and installs the Python
# package there (no LLVM), then, by stage (STAGES, comma-separated; default
# all):
#   cpp     the C++ GPU tests of caller memory and the training layer (with
#           .gpu/ carried from scripts/device_pack.sh; CPP_TESTS: another
#           doctest filter), and compute-sanitizer memcheck on the
#           caller-memory ones (MEMCHECK=0: not)
#   pytest  tests/python/test_torch.py (PYTEST_FILES: others) on the GPU (lifetimes, token counts,
#           memory back to the weights after every step)
#   stack   benchmarks/torch_stack_train.py: SHAPES (default
#           qwen3moe,fine64) x LAYERS (default 8) for IMPLS (default
#           moeforge,torch,sonicmoe; SonicMoE from .peers/sonicmoe when
#           carried, see ../shared/peers/), SCHEDULE (default: the module's
#           own default; a file, or "tuned_wide" for
#           benchmarks/schedules/train/tuned_wide_swiglu.sched), GRADS
#           (comma-separated: kept, the default, and/or none: torch's
#           default zero_grad), STEADY (seconds of each row's own steps
#           before its timed ones; default 0), REPS (timed steps, default 5),
#           FRESH_POOL (1, the default: torch's free cached blocks emptied
#           before the timed steps; 0: not), ROUTING (uniform, the default,
#           and/or skewed), ROUNDS (default 1: rows alternating that often);
#           PYTORCH_CUDA_ALLOC_CONF passes through (the JSON records it)
#   probe   benchmarks/stack_memory_probe.py (what is alive at the step's
#           peak, with the frames that made it, each block of 32 MiB or
#           more listed) for each of IMPLS but torch on each of SHAPES
#   profile benchmarks/kernel_profile.py: one layer's training step, its
#           kernels by name with their time per step, for each of IMPLS on
#           each of SHAPES (issue 50's per-kernel comparison); PROFILE_LAYERS
#           (default 1; e.g. "1 8"): a residual stack of that many layers
#   decode  benchmarks/torch_decode.py (issue 53): one layer's forward alone
#           over the token sweep, moeforge and torch._grouped_mm in one
#           process, then SonicMoE beside torch._grouped_mm in another (its
#           autotuner may take minutes at a new token count, and a process
#           cut by its timeout keeps the rows it printed); DECODE_SHAPES
#           (default mixtral,qwen3moe,gptoss), DECODE_TOKENS (default the
#           script's sweep), DECODE_PROFILE (N: moeforge's and torch's
#           kernels over N forwards per row), DECODE_SCHEDULES (schedule
#           files, comma-separated: more moeforge columns), DECODE_PEERS=0
#           (no SonicMoE process), DECODE_TUNE (seconds: moeforge's forward
#           tuned per token bucket first, the tuned schedules then run),
#           DECODE_AB=1 (moeforge alone twice more, with the switch
#           DECODE_AB_OFF names set to 1, then without again: an A/B/A;
#           default MOEFORGE_NO_EARLY_LAUNCH, the early launches;
#           MOEFORGE_NO_ONE_BLOCK_ROUTING: the routing of a few tokens in
#           one block)
#   moa     benchmarks/torch_moa.py (issue 54): Mixture-of-Attention,
#           moeforge (default, and fused_attention for the forward) beside a
#           PyTorch MoA (grouped projections around one SDPA call), forward
#           and training step with their memory; MOA_SHAPES (T:E:k,...)
# SonicMoE's first step at a shape is its autotuner compiling and timing
# every GEMM config (more than 8 minutes at qwen3moe): its caches (QuACK's
# and Triton's autotune choices and compiled kernels, about 1 MB packed)
# are packed into $OUT/stack/peer-cache.txz, and unpacked from
# .peers/peer-cache.txz when that is carried, else from the committed
# benchmarks/peers/sonicmoe-cache-h200.txz, so a later call skips them.
# Logs and JSON go to $OUT/$STACK_DIR (default stack), packed into
# $OUT/$STACK_DIR.tgz at the end, so one device call can run this twice
# (e.g. L=24 on fewer shapes) without overwriting.
set -uo pipefail
. scripts/device_env.sh
R=$OUT/${STACK_DIR:-stack}
mkdir -p "$R"
STAGES=${STAGES:-cpp,pytest,stack}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
status=0
device_note "$R/device.txt"
T0=$(date +%s)
if has cpp && [ -x .gpu/moeforge_tests ]; then
  timeout 300 .gpu/moeforge_tests -tc="${CPP_TESTS:-cuda caller memory*,cuda training: tensors sharing*,cuda bind*}" \
    >"$R/cpp.log" 2>&1 || status=1
  grep -E "ERROR|CRASHED|test cases|Status" "$R/cpp.log" | head -12
  if [ "${MEMCHECK:-1}" != 0 ]; then
    timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 .gpu/moeforge_tests \
      -tc="cuda caller memory: the same step*,cuda caller memory: misuse*" >"$R/memcheck.log" 2>&1 || status=1
    grep -E "ERROR SUMMARY|Status" "$R/memcheck.log" | head -4
  fi
  echo "cpp done at $(( $(date +%s) - T0 )) s"
fi
if { has stack || has probe || has profile || has decode; } && [ -d .peers/sonicmoe ]; then
  mkdir -p /tmp/site && tar -C /tmp/site -xJf .peers/sonicmoe/libsbase.tar.xz &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .peers/sonicmoe/*.whl \
      >"$R/sonic_pip.log" 2>&1 || echo "SonicMoE did not install: $(tail -3 "$R/sonic_pip.log")"
  export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/python_packages
  export QUACK_CACHE_AUTOTUNING=1 TRITON_CACHE_AUTOTUNING=1 QUACK_COMPILE_WORKERS=16
  export QUACK_CACHE_DIR=/tmp/peer-cache/quack TRITON_CACHE_DIR=/tmp/peer-cache/triton QUACK_HOME=/tmp/peer-cache/home
  mkdir -p /tmp/peer-cache/quack /tmp/peer-cache/triton
  cache=.peers/peer-cache.txz
  [ -f "$cache" ] || cache=benchmarks/peers/sonicmoe-cache-h200.txz
  [ -f "$cache" ] && tar -C /tmp/peer-cache -xJf "$cache"
fi
# One file, not a tree: the device tool brings back no deep folders.
save_peer_cache() {
  [ -d /tmp/peer-cache ] || return 0
  tar -C /tmp/peer-cache -cJf "$R/peer-cache.txz" . &&
    echo "peer caches saved: $(find /tmp/peer-cache -name '*.autotune.json' | wc -l) autotune choices"
}
# The package only where it runs: a SonicMoE-only stack (IMPLS=sonicmoe, its
# autotuner's first call at a shape) spends no time building moeforge.
if has pytest || has decode || has moa || { { has stack || has probe || has profile; } && [[ ",${IMPLS:-moeforge}," == *",moeforge"* ]]; }; then
  python3 -m pip install -q --no-build-isolation . -Ccmake.define.MOEFORGE_WITH_LLVM=OFF -Cbuild-dir=/tmp/pybuild \
    >"$R/pip.log" 2>&1 || { tail -20 "$R/pip.log"; exit 1; }
  echo "pip install done at $(( $(date +%s) - T0 )) s"
fi
if has pytest; then
  timeout "${PYTEST_TIMEOUT:-400}" python3 -m pytest -q -rs ${PYTEST_FILES:-tests/python/test_torch.py} >"$R/pytest.log" 2>&1 || status=1
  tail -15 "$R/pytest.log"
  echo "pytest done at $(( $(date +%s) - T0 )) s"
fi
if has stack; then
  sched=${SCHEDULE:-}
  [ "$sched" = tuned_wide ] && sched=benchmarks/schedules/train/tuned_wide_swiglu.sched
  PYTHONUNBUFFERED=1 timeout "${STACK_TIMEOUT:-450}" python3 benchmarks/torch_stack_train.py \
    --shapes "${SHAPES:-qwen3moe,fine64}" --layers "${LAYERS:-8}" --impls "${IMPLS:-moeforge,torch,sonicmoe}" \
    --schedule "$sched" --grads "${GRADS:-kept}" \
    --steady "${STEADY:-0}" --reps "${REPS:-5}" --fresh-pool "${FRESH_POOL:-1}" --routing "${ROUTING:-uniform}" \
    --rounds "${ROUNDS:-1}" --out "$R/stack.json" >"$R/stack.log" 2>&1 || status=1
  save_peer_cache
  tail -20 "$R/stack.log"
  echo "stack done at $(( $(date +%s) - T0 )) s"
fi
if has probe; then
  shapes=${SHAPES:-qwen3moe,fine64} impls=${IMPLS:-moeforge,torch,sonicmoe}
  for shape in ${shapes//,/ }; do
    for impl in ${impls//,/ }; do
      [ "$impl" = torch ] && continue
      timeout "${PROBE_TIMEOUT:-150}" python3 benchmarks/stack_memory_probe.py --impl "$impl" --shape "$shape" \
        --layers "${LAYERS:-8}" --blocks 32 --dump "$R/trace_${impl}_${shape}.json.gz" >"$R/probe_${impl}_${shape}.log" 2>&1 || status=1
      grep -v "^  *[0-9.]* MiB  " "$R/probe_${impl}_${shape}.log" | cut -c1-200 | head -60
    done
  done
  echo "probe done at $(( $(date +%s) - T0 )) s"
fi
if has profile; then
  shapes=${SHAPES:-qwen3moe,fine64}
  for shape in ${shapes//,/ }; do
    for l in ${PROFILE_LAYERS:-1}; do
      timeout "${PROFILE_TIMEOUT:-200}" python3 benchmarks/kernel_profile.py --shape "$shape" --layers "$l" \
        --impls "${IMPLS:-moeforge,sonicmoe,torch}" --json "$R/profile_${shape}_L$l.json" \
        >"$R/profile_${shape}_L$l.log" 2>&1 || status=1
      grep -v "^  .* 0\.[0-9] % \|Warning\|_warn_once" "$R/profile_${shape}_L$l.log" | head -80
    done
  done
  save_peer_cache
  echo "profile done at $(( $(date +%s) - T0 )) s"
fi
if has decode; then
  tokens=${DECODE_TOKENS:+--tokens $DECODE_TOKENS}
  for impls in moeforge,torch torch,sonicmoe; do
    [ "$impls" = torch,sonicmoe ] && { [ ! -d .peers/sonicmoe ] || [ "${DECODE_PEERS:-1}" = 0 ]; } && continue
    prof=
    [ "$impls" = moeforge,torch ] &&
      prof="${DECODE_PROFILE:+--profile $DECODE_PROFILE} ${DECODE_SCHEDULES:+--schedules $DECODE_SCHEDULES} ${DECODE_TUNE:+--tune $DECODE_TUNE}"
    PYTHONUNBUFFERED=1 timeout "${DECODE_TIMEOUT:-240}" python3 benchmarks/torch_decode.py \
      --shapes "${DECODE_SHAPES:-mixtral,qwen3moe,gptoss}" $tokens --impls "$impls" $prof \
      --out "$R/decode_${impls/,/_}.json" >"$R/decode_${impls/,/_}.log" 2>&1 || status=1
    grep -v '^{' "$R/decode_${impls/,/_}.log" | tail -40
  done
  if [ "${DECODE_AB:-0}" = 1 ]; then
    # B: the switch DECODE_AB_OFF names set to 1 (default: the early launches).
    for run in off on2; do
      (if [ $run = off ]; then export "${DECODE_AB_OFF:-MOEFORGE_NO_EARLY_LAUNCH}=1"; fi
       PYTHONUNBUFFERED=1 timeout "${DECODE_TIMEOUT:-240}" python3 benchmarks/torch_decode.py \
         --shapes "${DECODE_SHAPES:-mixtral,qwen3moe,gptoss}" $tokens --impls moeforge \
         --out "$R/decode_moeforge_$run.json" >"$R/decode_moeforge_$run.log" 2>&1) || status=1
      grep -v '^{' "$R/decode_moeforge_$run.log" | tail -30 | sed "s/^/$run /"
    done
  fi
  save_peer_cache
  echo "decode done at $(( $(date +%s) - T0 )) s"
fi
if has moa; then
  PYTHONUNBUFFERED=1 timeout "${MOA_TIMEOUT:-400}" python3 benchmarks/torch_moa.py ${MOA_SHAPES:+--shapes $MOA_SHAPES} \
    --out "$R/moa.json" >"$R/moa.log" 2>&1 || status=1
  grep -v '^{' "$R/moa.log" | tail -12
  echo "moa done at $(( $(date +%s) - T0 )) s"
fi
# One file per stage folder: the device tool brings back a few files per call
# and leaves the rest out (a call's stack.json and stack.log were lost so).
d=${STACK_DIR:-stack}
(cd "$OUT" && tar czf "$d.tgz" "$d" && rm -rf "$d")
exit $status
