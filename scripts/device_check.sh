#!/usr/bin/env bash
# Runs on the GPU machine (through the device tool, with .gpu/ carried from
# scripts/device_pack.sh), from the repository root: what a session checks
# on its last code, in stages that each fit one device call.
#   tests   the GPU suite in four shards side by side (42 test cases took
#           ~420 s one after another on an H100; ~140 s in shards;
#           SHARD_TIMEOUT, default 400 s each), the
#           other test cases (their GPU branches: ~90 s on an H200), then
#           compute-sanitizer memcheck on a few of them
#   sanitize  compute-sanitizer racecheck, synccheck and initcheck on small
#           cases (a bound layer, the grouped routing kernels, a training
#           step)
#   real    `moeforge run` at a real size (d = f = 2880, E = 128, k = 4,
#           T = 16384): cold, cached, and with --check, wall times
#   train   issue #16's table: bench_moe_train (tuned_wide storing, lean and
#           recomputing; uniform and skewed) and
#           torch_grouped_mm_train.py on the five training shapes, one
#           process each, in this call; STEADY=<s>: each side also timed
#           at the card's steady state (s seconds of its own steps after a
#           1 s pause, then about a second), store and lean only (what
#           `benchmarks/plot_train.py --steady` draws)
#   rounds  issue #16's comparison made steady: ROUNDS (3) rounds, each one
#           bench_moe_train process (tuned_wide store and lean, and the
#           default schedule, uniform and skewed) then one
#           torch_grouped_mm_train.py process (TORCH=0: none), on SHAPES
#           (default mixtral,fine64; one process per shape; SCHEDS
#           overrides the schedules' filter), every timed block after
#           COOLDOWN (3) s
#           idle in both harnesses; medians per case, ours / torch, and the
#           default / tuned_wide store (issue #48's bar: within 3 %)
#   python  scripts/device_python.sh (pip install, pytest, the torch module
#           against bench_moe_train), SHAPES as there
#   ep      the expert-parallel training step (bench_expert_parallel) on
#           one and two GPUs, against one GPU doing the same work
#   forward the forward benchmark, dropless against capacity-dropping
#           schedules (FORWARD_FILTER overrides its filter)
#   tune    `moeforge tune` on the forward of TUNE_SHAPES (default
#           mbpaper,fine64,mixtral; TUNE_BUDGET s each, default 240, from
#           the scattermoe preset; TUNE_FORWARD=0 skips it), with TUNE_TRAIN=1
#           the training step too (TUNE_TRAIN=<shapes>: those shapes')
#           (from benchmarks/schedules/train/tune_base.sched); then each
#           schedule found timed beside the preset and the hand-written
#           schedules (tuned_wide for training) in TUNE_ROUNDS (3) rounds
#           of one bench_moe_forward / bench_moe_train process, uniform and
#           skewed; benchmarks/tune_summary.py's medians (issue #17)
#   tuned   the schedules tune wrote (TUNED_DIR) checked against the float64
#           reference on the GPU, forward and training step, and under
#           compute-sanitizer memcheck (TUNE_SHAPES)
#   exchange  expert parallelism's NCCL row exchange and layer: their tests
#           (one rank, and two where the machine has two GPUs) under compute-sanitizer
#           memcheck too, then bench_expert_exchange on every GPU count up
#           to the machine's
#   fp8     issue 55's building blocks: the FP8 tests (rounding and the
#           three GEMM forms against the CPU rule and float64), under
#           compute-sanitizer memcheck too, then bench_fp8_gemm (the e4m3
#           GEMM and the roundings against cuBLAS bf16, same products)
# Usage: bash scripts/device_check.sh tests|real|python|all, or stages joined
# by commas (tests,real). Everything goes
# to $OUT/check/ and is packed into $OUT/check.tgz (the device tool brings
# back a few files only).
set -uo pipefail
what=${1:-all}
T0=$(date +%s)
. scripts/device_env.sh
R=$OUT/check
mkdir -p "$R"
# NCCL: the toolkit's, else the one PyTorch's wheels bring.
if [ ! -e /usr/local/cuda/lib64/libnccl.so.2 ] && [ -z "${MOEFORGE_LIBNCCL:-}" ]; then
  MOEFORGE_LIBNCCL=$(python3 -c "import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], 'lib', 'libnccl.so.2'))" 2>/dev/null)
  export MOEFORGE_LIBNCCL
fi
export NCCL_NVLS_ENABLE=0
status=0
has() { [ "$what" = all ] || [[ ",$what," == *",$1,"* ]]; }
device_note "$R/device.txt"
if has tests; then
  n=$(.gpu/moeforge_tests --test-suite=gpu --list-test-cases | grep -vc "^\[doctest\]\|^===")
  q=$(( (n + 3) / 4 ))
  # Line-buffered, so a shard cut by its timeout still shows where it was.
  for i in 0 1 2 3; do
    timeout "${SHARD_TIMEOUT:-400}" stdbuf -oL .gpu/moeforge_tests --test-suite=gpu --duration=true --first=$(( i * q + 1 )) \
      --last=$(( (i + 1) * q )) >"$R/tests_$i.log" 2>&1 &
  done
  wait
  for i in 0 1 2 3; do
    grep -q "Status: SUCCESS" "$R/tests_$i.log" || status=1
    grep -E "ERROR|CRASHED|test cases|Status" "$R/tests_$i.log" | head -8
  done
  echo "gpu suite ($n test cases) done at $(( $(date +%s) - T0 )) s" | tee -a "$R/device.txt"
  # The other test cases too: some take a GPU branch where one is present
  # (the CLI's tune and run), which no machine without a GPU exercises.
  # QUICK=1 leaves them out (a call short of device time).
  if [ "${QUICK:-0}" != 1 ]; then
    timeout 400 stdbuf -oL .gpu/moeforge_tests --test-suite-exclude=gpu >"$R/tests_rest.log" 2>&1
    grep -q "Status: SUCCESS" "$R/tests_rest.log" || status=1
    grep -E "ERROR|CRASHED|test cases|Status" "$R/tests_rest.log" | head -8
    echo "the other test cases done at $(( $(date +%s) - T0 )) s" | tee -a "$R/device.txt"
  fi
  timeout "${MEMCHECK_TIMEOUT:-240}" compute-sanitizer --tool memcheck --error-exitcode 9 .gpu/moeforge_tests \
    -tc="cuda bind*,cuda gpu: group-limited*,cuda layer: the dense MLP*,cuda training: the RMSNorm*,cuda capacity*,cuda gpu: a NaN*,cuda gpu: a layer raises*,cuda gpu: moa and attention forward*,cuda gpu: a few tokens routed*,cuda sorted saved: the MoE edge cases*,cuda sorted gathers: the MoE edge cases*,cuda merge weight gradients: the MoE edge cases*,cuda caller memory: the same step*" \
    >"$R/memcheck.log" 2>&1
  echo "memcheck exit code: $?" | tee -a "$R/device.txt"
  tail -3 "$R/memcheck.log"
  # The fused attention's kernels on their own (its 4096-token rows are slow
  # under the checker, so they get their own limit, and training at 1024
  # tokens is left out; ATTENTION_MEMCHECK=0: not).
  if [ "${ATTENTION_MEMCHECK:-1}" != 0 ]; then
    timeout "${ATTENTION_MEMCHECK_TIMEOUT:-180}" compute-sanitizer --tool memcheck --error-exitcode 9 \
      .gpu/moeforge_tests -tc="cuda gpu: fused attention*" -tce="*1024 tokens*" >"$R/memcheck_attention.log" 2>&1
    echo "memcheck (fused attention) exit code: $?" | tee -a "$R/device.txt"
    tail -3 "$R/memcheck_attention.log"
  fi
fi
if has exchange; then
  echo "NCCL: ${MOEFORGE_LIBNCCL:-/usr/local/cuda/lib64/libnccl.so.2}; GPUs: $(nvidia-smi -L | wc -l)" | tee -a "$R/device.txt"
  timeout 300 .gpu/moeforge_tests -tc="expert exchange*,cuda expert parallel*" --duration=true \
    >"$R/exchange_tests.log" 2>&1 || status=1
  grep -E "SKIPPED|ERROR|test cases|Status" "$R/exchange_tests.log" | head -8
  # NCCL probes kernel images and peer access and handles the API errors itself:
  # only memory errors count.
  timeout 300 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    .gpu/moeforge_tests -tc="expert exchange*,cuda expert parallel*" \
    >"$R/exchange_memcheck.log" 2>&1
  echo "exchange memcheck exit code: $?" | tee -a "$R/device.txt"
  tail -2 "$R/exchange_memcheck.log"
  timeout 200 .gpu/bench_expert_exchange --benchmark_out="$R/exchange.json" --benchmark_out_format=json \
    --benchmark_counters_tabular=true >"$R/exchange.log" 2>&1 || status=1
  grep -E "^exchange|ERROR" "$R/exchange.log" | cut -c1-160
  echo "exchange done at $(( $(date +%s) - T0 )) s" | tee -a "$R/device.txt"
fi
if has ep; then
  # The expert-parallel training step on one and two GPUs against one GPU
  # doing the same work (bench_expert_parallel).
  timeout 500 .gpu/bench_expert_parallel --benchmark_out="$R/ep.json" --benchmark_out_format=json \
    --benchmark_counters_tabular=true >"$R/ep.log" 2>&1 || status=1
  grep -E "^ep/|ERROR" "$R/ep.log" | cut -c1-240
  echo "ep done at $(( $(date +%s) - T0 )) s" | tee -a "$R/device.txt"
fi
if has sanitize; then
  small="cuda bind: a layer*,cuda gpu: group-limited*,cuda training: RMSNorm*,cuda capacity: expert_choice_moe*,cuda gpu: a few tokens routed*"
  for tool in racecheck synccheck initcheck; do
    timeout 180 compute-sanitizer --tool $tool --error-exitcode 9 .gpu/moeforge_tests -tc="$small" \
      >"$R/$tool.log" 2>&1
    rc=$?
    echo "$tool exit code: $rc" | tee -a "$R/device.txt"
    [ $rc = 0 ] || status=1
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test cases" "$R/$tool.log" | tail -3
  done
fi
if has real; then
  real=(swiglu_moe --tokens 16384 --d 2880 --f 2880 --experts 128 --topk 4)
  for run in cold cached check; do
    extra=()
    [ "$run" = check ] && extra=(--check)
    s=$(date +%s%N)
    MOEFORGE_PROGRESS=1 timeout 120 .gpu/moeforge run "${real[@]}" "${extra[@]}" >"$R/real_$run.log" 2>&1
    rc=$?
    echo "real $run: exit $rc, wall $(( ($(date +%s%N) - s) / 1000000 )) ms" | tee -a "$R/device.txt"
    [ $rc = 0 ] || status=1
  done
  grep -h "moeforge:\|PASS\|FAIL" "$R"/real_*.log
fi
if has forward; then
  # The forward benchmark's dropless and capacity-dropping schedules side
  # by side (issue #19: capacity beside the dropless schedules).
  timeout 400 .gpu/bench_moe_forward --benchmark_filter="${FORWARD_FILTER:-forward/(mixtral|fine64|mbpaper)/tuned_tma(@cap.*)?/}" \
    --benchmark_out="$R/forward.json" --benchmark_out_format=json > "$R/forward.log" 2>&1 || status=1
  grep -E "forward/" "$R/forward.log" | head -40
  echo "forward done at $(( $(date +%s) - T0 )) s" | tee -a "$R/device.txt"
fi
TUNE_SHAPES=${TUNE_SHAPES:-mbpaper,fine64,mixtral}
if has fp8; then
  timeout 240 .gpu/moeforge_tests -tc="*FP8*,*e4m3*" --duration=true >"$R/fp8_tests.log" 2>&1 || status=1
  grep -E "SKIPPED|ERROR|FAILED|test cases|Status" "$R/fp8_tests.log" | head -12
  timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 .gpu/moeforge_tests \
    -tc="cuda gpu: *e4m3*,cuda gpu: a weight rounds*,cuda gpu: activation rows*" >"$R/fp8_memcheck.log" 2>&1
  echo "fp8 memcheck exit code: $?" | tee -a "$R/device.txt"
  tail -2 "$R/fp8_memcheck.log"
  timeout 300 .gpu/bench_fp8_gemm --benchmark_out="$R/fp8_bench.json" --benchmark_out_format=json \
    --benchmark_counters_tabular=true >"$R/fp8_bench.log" 2>&1 || status=1
  grep -E "^fp8_gemm|ERROR|Benchmark" "$R/fp8_bench.log" | cut -c1-260
  echo "fp8 done at $(( $(date +%s) - T0 )) s" | tee -a "$R/device.txt"
fi
if has tune; then
  # bench_moe_forward's shapes (benchmarks/moe_shapes.h) as the CLI's examples.
  declare -A layer=(
    [mbpaper]="moe_mlp --tokens 16384 --d 1024 --f 4096 --experts 64 --topk 1"
    [fine64]="swiglu_moe --tokens 16384 --d 2048 --f 1408 --experts 64 --topk 8"
    [mixtral]="swiglu_moe --tokens 8192 --d 4096 --f 14336 --experts 8 --topk 2")
  files="" filter="" tfiles="" tfilter=""
  for shape in ${TUNE_SHAPES//,/ }; do
    if [ "${TUNE_FORWARD:-1}" = 1 ]; then
      # shellcheck disable=SC2086
      timeout 660 .gpu/moeforge tune ${layer[$shape]} --schedule scattermoe --budget-seconds "${TUNE_BUDGET:-240}" \
        >"$R/${shape}_tuned.sched" 2>"$R/tune_$shape.log" || status=1
      tail -2 "$R/tune_$shape.log"
      files="$files${files:+,}$R/${shape}_tuned.sched"
      # Each shape's own tuned schedule, the preset and the hand-written ones.
      filter="$filter${filter:+|}$shape/(.*${shape}_tuned.sched|scattermoe|tuned_tma[a-z_]*)/"
    fi
    if [ "${TUNE_TRAIN:-}" = 1 ] || [[ ",${TUNE_TRAIN:-}," == *",$shape,"* ]]; then
      # The training step from tuned_wide's precision and memory choices.
      # shellcheck disable=SC2086
      timeout 660 .gpu/moeforge tune ${layer[$shape]} --train --schedule benchmarks/schedules/train/tune_base.sched \
        --budget-seconds "${TUNE_BUDGET:-240}" >"$R/${shape}_train_tuned.sched" 2>"$R/tune_train_$shape.log" || status=1
      tail -2 "$R/tune_train_$shape.log"
      tfiles="$tfiles${tfiles:+,}$R/${shape}_train_tuned.sched"
      tfilter="$tfilter${tfilter:+|}$shape/(uniform|skewed)/(.*${shape}_train_tuned.sched|tuned_wide)/store"
    fi
    echo "tune $shape done at $(( $(date +%s) - T0 )) s" | tee -a "$R/device.txt"
  done
  # TUNE_ROUNDS (3) rounds of every case in one process, 1 s idle before
  # each timed block: medians per case (benchmarks/schedule_files.h).
  if [ -n "$files" ]; then
    MOEFORGE_BENCH_ROUNDS=${TUNE_ROUNDS:-3} MOEFORGE_BENCH_COOLDOWN_S=1 MOEFORGE_BENCH_SCHEDULES="$files" \
      timeout 500 .gpu/bench_moe_forward --benchmark_filter="forward/($filter)" \
      --benchmark_out="$R/tune_forward.json" --benchmark_out_format=json >"$R/tune_forward.log" 2>&1 || status=1
  fi
  if [ -n "$tfiles" ]; then
    MOEFORGE_BENCH_ROUNDS=${TUNE_ROUNDS:-3} MOEFORGE_BENCH_COOLDOWN_S=1 MOEFORGE_BENCH_SCHEDULES="$tfiles" \
      timeout 500 .gpu/bench_moe_train --benchmark_filter="train/($tfilter)" \
      --benchmark_out="$R/tune_train.json" --benchmark_out_format=json >"$R/tune_train.log" 2>&1 || status=1
  fi
  python3 benchmarks/tune_summary.py "$R"/tune_forward.json "$R"/tune_train.json | tee "$R/tune_summary.txt"
  echo "tune done at $(( $(date +%s) - T0 )) s" | tee -a "$R/device.txt"
fi
if has tuned; then
  # The schedules tune wrote (TUNED_DIR, folders: <shape>_tuned.sched, <shape>_train_tuned.sched)
  # checked on the GPU against the float64 reference: the forward at the
  # shape's width (64 sampled tokens checked), the training step at a smaller
  # width (the whole reference gradient), each again under memcheck.
  declare -A fwd=(
    [mbpaper]="moe_mlp --tokens 4096 --d 1024 --f 4096 --experts 64 --topk 1"
    [fine64]="swiglu_moe --tokens 4096 --d 2048 --f 1408 --experts 64 --topk 8"
    [mixtral]="swiglu_moe --tokens 2048 --d 4096 --f 14336 --experts 8 --topk 2")
  declare -A trn=(
    [mbpaper]="moe_mlp --tokens 1024 --d 512 --f 1024 --experts 64 --topk 1"
    [fine64]="swiglu_moe --tokens 512 --d 512 --f 768 --experts 64 --topk 8"
    [mixtral]="swiglu_moe --tokens 512 --d 512 --f 1024 --experts 8 --topk 2")
  for shape in ${TUNE_SHAPES//,/ }; do
    for kind in run train; do
      name="${shape}_tuned.sched" flags=${fwd[$shape]}
      [ $kind = train ] && name="${shape}_train_tuned.sched" flags=${trn[$shape]}
      f=""
      for d in $TUNED_DIR; do [ -e "$d/$name" ] && f="$d/$name"; done
      [ -n "$f" ] || continue
      # shellcheck disable=SC2086
      .gpu/moeforge $kind $flags --schedule "$f" --check >"$R/tuned_${kind}_$shape.log" 2>&1 || status=1
      echo "$kind $shape $name: $(grep -c PASS "$R/tuned_${kind}_$shape.log") PASS, $(grep -c FAIL "$R/tuned_${kind}_$shape.log") FAIL"
      # Under memcheck at the training step's smaller width and 256 tokens.
      small=$(echo "${trn[$shape]}" | sed -E 's/--tokens [0-9]+/--tokens 256/')
      # shellcheck disable=SC2086
      compute-sanitizer --tool memcheck --error-exitcode 9 .gpu/moeforge $kind $small --schedule "$f" \
        >"$R/tuned_${kind}_${shape}_memcheck.log" 2>&1 || status=1
      grep "ERROR SUMMARY" "$R/tuned_${kind}_${shape}_memcheck.log"
    done
  done
  echo "tuned done at $(( $(date +%s) - T0 )) s" | tee -a "$R/device.txt"
fi
if has train; then
  filter="train/[a-z0-9]+/[a-z]+/tuned_wide/"
  steady=()
  if [ -n "${STEADY:-}" ]; then
    # Each case is then timed three times over (bursts, its steady state,
    # the roof's): recomputing, never the fastest, is left out to fit.
    filter="train/[a-z0-9]+/[a-z]+/tuned_wide/(store|lean)/"
    steady=(--cooldown 1 --steady "$STEADY")
  fi
  MOEFORGE_BENCH_STEADY_S=${STEADY:-} MOEFORGE_BENCH_COOLDOWN_S=${STEADY:+1} timeout 420 .gpu/bench_moe_train \
    --benchmark_filter="$filter" --benchmark_out="$R/train.json" \
    --benchmark_out_format=json --benchmark_counters_tabular=true >"$R/train.log" 2>&1 || status=1
  grep -E "^train" "$R/train.log" | cut -c1-150
  PYTHONUNBUFFERED=1 timeout 240 python3 benchmarks/torch_grouped_mm_train.py "${steady[@]}" --out "$R/torch_train.json" \
    >"$R/torch_train.log" 2>&1 || status=1
  tail -12 "$R/torch_train.log"
  echo "train done at $(( $(date +%s) - T0 )) s" | tee -a "$R/device.txt"
fi
if has rounds; then
  shapes=${SHAPES:-mixtral,fine64}
  scheds=${SCHEDS:-tuned_wide/(store|lean)|default/store|default_narrow/store}
  for i in $(seq 1 "${ROUNDS:-3}"); do
    # One process per shape: five shapes' compiles and cooldowns in one
    # process ran past any single timeout worth waiting for.
    for s in ${shapes//,/ }; do
      MOEFORGE_BENCH_COOLDOWN_S=${COOLDOWN:-3} timeout 200 .gpu/bench_moe_train \
        --benchmark_filter="train/$s/(uniform|skewed)/($scheds)" \
        --benchmark_out="$R/rounds_ours_${i}_$s.json" --benchmark_out_format=json >"$R/rounds_ours_${i}_$s.log" 2>&1 || status=1
    done
    if [ "${TORCH:-1}" != 0 ]; then
      timeout 200 python3 benchmarks/torch_grouped_mm_train.py --shapes "$shapes" --cooldown "${COOLDOWN:-3}" \
        --out "$R/rounds_torch_$i.json" >"$R/rounds_torch_$i.log" 2>&1 || status=1
    fi
    echo "round $i done at $(( $(date +%s) - T0 )) s"
  done
  python3 - "$R" <<'PY' | tee "$R/rounds_summary.txt"
import glob, json, statistics, sys
r = sys.argv[1]
ours, torch = {}, {}
for f in sorted(glob.glob(f"{r}/rounds_ours_*.json")):
    for b in json.load(open(f))["benchmarks"]:
        _, shape, routing, sched, memory = b["run_name"].split("/")[:5]
        ours.setdefault((shape, routing, f"{sched} {memory}"), []).append(b["real_time"])
for f in sorted(glob.glob(f"{r}/rounds_torch_*.json")):
    for c in json.load(open(f))["results"]:
        if "ms" in c:
            torch.setdefault((c["shape"], c["routing"]), []).append(c["ms"])
for (shape, routing), t in sorted(torch.items()):
    tm = statistics.median(t)
    mine = {m: statistics.median(v) for (s, rt, m), v in ours.items() if (s, rt) == (shape, routing)}
    best = min(mine.values()) if mine else float("nan")
    print(f"{shape} {routing}: torch {tm:.2f} ms {t}; ours " +
          ", ".join(f"{m} {v:.2f} ms {ours[(shape, routing, m)]}" for m, v in sorted(mine.items())) +
          f"; best ours / torch {best / tm:.3f}")
for shape, routing in sorted({(s, rt) for s, rt, _ in ours}):
    med = {m: statistics.median(v) for (s, rt, m), v in ours.items() if (s, rt) == (shape, routing)}
    # Each variant of the default (default_narrow, default+choice from
    # MOEFORGE_BENCH_DEFAULT_CHOICES) against the default itself.
    for m in sorted(med):
        if m.startswith("default") and m != "default store" and "default store" in med:
            print(f"{shape} {routing}: {m} {med[m]:.2f} ms / default {med['default store']:.2f} = "
                  f"{med[m] / med['default store']:.3f}")
    if "default store" in med and "tuned_wide store" in med:
        lean = med.get("tuned_wide lean")
        print(f"{shape} {routing}: default {med['default store']:.2f} ms / tuned_wide store "
              f"{med['tuned_wide store']:.2f} = {med['default store'] / med['tuned_wide store']:.3f}" +
              (f", / tuned_wide lean {lean:.2f} = {med['default store'] / lean:.3f}" if lean else ""))
PY
fi
if has python; then
  OUT=$R bash scripts/device_python.sh || status=1
fi
echo "done at $(( $(date +%s) - T0 )) s, status $status" | tee -a "$R/device.txt"
(cd "$OUT" && tar czf check.tgz check && rm -rf check)
exit $status
