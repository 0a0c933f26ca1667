#include "backends/cuda/codegen/tile_library.h"

#include <sstream>

#include "backends/cuda/device/tiles/attention_cuh.h"
#include "backends/cuda/device/tiles/cluster_cuh.h"
#include "backends/cuda/device/tiles/copies_cuh.h"
#include "backends/cuda/device/tiles/elementwise_cuh.h"
#include "backends/cuda/device/tiles/fp8_cuh.h"
#include "backends/cuda/device/tiles/grid_dependency_cuh.h"
#include "backends/cuda/device/tiles/mma_sync_cuh.h"
#include "backends/cuda/device/tiles/timeline_cuh.h"
#include "backends/cuda/device/tiles/tma_cuh.h"
#include "backends/cuda/device/tiles/transpose_cuh.h"
#include "backends/cuda/device/tiles/wgmma_cuh.h"
#include "backends/cuda/device/tiles/wgmma_rows_cuh.h"
#include "backends/cuda/device/tiles/wgmma_ws_cuh.h"
#include "backends/cuda/device/tiles_cuh.h"
#include "dsl/error.h"

namespace moeforge {

namespace {

// wgmma.mma_async m64nNk16 with N/2 fp32 accumulators per thread: the operand
// list is too long to write by hand, so it is generated once per N.
// trans_b: 1 for B stored N-major in shared memory (B[K, N] in global), 0
// for K-major (B stored [N, K]: a transposed operand read as it is).
// trans_a: 1 for A stored M-major in shared memory (an expert reduction's
// A, whose rows are the reduced index).
std::string wgmma_instance(int n, int trans_b, int trans_a = 0) {
  const int regs = n / 2;
  std::ostringstream s;
  s << "template <> struct Wgmma<" << n << ", " << trans_b << ", " << trans_a << "> {\n"
    << "  __device__ static __forceinline__ void mma(float (&d)[" << regs
    << "], unsigned long long da, unsigned long long db) {\n"
    << "    asm volatile(\"{\\n.reg .pred p;\\nsetp.ne.b32 p, 1, 0;\\n\"\n"
    << "                 \"wgmma.mma_async.sync.aligned.m64n" << n << "k16.f32.bf16.bf16 {";
  for (int i = 0; i < regs; ++i)
    s << (i ? ", " : "") << "%" << i;
  s << "}, %" << regs << ", %" << regs + 1 << ", p, 1, 1, " << trans_a << ", " << trans_b
    << ";\\n}\\n\"\n                 : ";
  for (int i = 0; i < regs; ++i)
    s << (i ? ", " : "") << "\"+f\"(d[" << i << "])";
  s << "\n                 : \"l\"(da), \"l\"(db));\n  }\n};\n";
  return s.str();
}

// wgmma.mma_async m64nNk32 over e4m3 operands (both K-major: 8-bit wgmma
// takes no transpose), N/2 fp32 accumulators per thread; `accumulate` 0
// overwrites d (the first k32 step of a stage, tiles/fp8.cuh).
std::string wgmma_e4m3_instance(int n) {
  const int regs = n / 2;
  std::ostringstream s;
  s << "template <> struct WgmmaE4m3<" << n << "> {\n"
    << "  __device__ static __forceinline__ void mma(float (&d)[" << regs
    << "], unsigned long long da, unsigned long long db, int accumulate) {\n"
    << "    asm volatile(\"{\\n.reg .pred p;\\nsetp.ne.b32 p, %" << regs + 2 << ", 0;\\n\"\n"
    << "                 \"wgmma.mma_async.sync.aligned.m64n" << n << "k32.f32.e4m3.e4m3 {";
  for (int i = 0; i < regs; ++i)
    s << (i ? ", " : "") << "%" << i;
  s << "}, %" << regs << ", %" << regs + 1 << ", p, 1, 1;\\n}\\n\"\n                 : ";
  for (int i = 0; i < regs; ++i)
    s << (i ? ", " : "") << "\"+f\"(d[" << i << "])";
  s << "\n                 : \"l\"(da), \"l\"(db), \"r\"(accumulate));\n  }\n};\n";
  return s.str();
}

// Replaces the line `marker` of a part's source by `text`.
std::string with_instances(std::string source, const std::string &marker, const std::string &text, const char *part) {
  const size_t at = source.find(marker);
  internal_check(at != std::string::npos) << "tiles/" << part << ".cuh has no line '" << marker << "'";
  source.replace(at, marker.size(), text);
  return source;
}

} // namespace

const std::vector<cuda::NamedHeader> &tile_library_headers() {
  static const std::vector<cuda::NamedHeader> headers = [] {
    std::string instances;
    for (int n : {64, 128, 256})
      instances += wgmma_instance(n, 1) + wgmma_instance(n, 0) + wgmma_instance(n, 1, 1);
    const std::string wgmma =
        with_instances(tile_parts::wgmma::kSource, "// MOEFORGE_WGMMA_INSTANCES\n", instances, "wgmma");
    const std::string fp8 = with_instances(tile_parts::fp8::kSource, "// MOEFORGE_WGMMA_E4M3_INSTANCES\n",
                                           wgmma_e4m3_instance(64) + wgmma_e4m3_instance(128), "fp8");
    // In the order tiles.cuh includes them.
    return std::vector<cuda::NamedHeader>{
        {kTileLibraryName, kTileLibrarySource},
        {"moeforge_tiles_grid_dependency.cuh", tile_parts::grid_dependency::kSource},
        {"moeforge_tiles_timeline.cuh", tile_parts::timeline::kSource},
        {"moeforge_tiles_elementwise.cuh", tile_parts::elementwise::kSource},
        {"moeforge_tiles_copies.cuh", tile_parts::copies::kSource},
        {"moeforge_tiles_transpose.cuh", tile_parts::transpose::kSource},
        {"moeforge_tiles_attention.cuh", tile_parts::attention::kSource},
        {"moeforge_tiles_mma_sync.cuh", tile_parts::mma_sync::kSource},
        {"moeforge_tiles_tma.cuh", tile_parts::tma::kSource},
        {"moeforge_tiles_cluster.cuh", tile_parts::cluster::kSource},
        {"moeforge_tiles_wgmma.cuh", wgmma},
        {"moeforge_tiles_wgmma_rows.cuh", tile_parts::wgmma_rows::kSource},
        {"moeforge_tiles_wgmma_ws.cuh", tile_parts::wgmma_ws::kSource},
        {"moeforge_tiles_fp8.cuh", fp8},
    };
  }();
  return headers;
}

} // namespace moeforge
