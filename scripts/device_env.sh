# Sourced by every script that runs on the GPU machine (from the repository
# root, with the packed binaries carried in .gpu/, scripts/device_pack.sh): the
# libraries the machine lacks, one compile cache for every process of a call
# (NVRTC's cubins are then built once), and $OUT made. device_note FILE
# appends the card, its driver, clock and power limit, and the time to FILE:
# every result folder says what it ran on and when.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache
device_note() {
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader | tee -a "$1"
  date -u +%Y-%m-%dT%H:%M:%SZ | tee -a "$1"
}
