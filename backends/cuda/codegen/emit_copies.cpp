// The kernels that only move rows and elements: the padded copy of a
// route's rows (GatherStep) and transposes (TransposeStep), both through
// 16-byte or shared-memory tiles so reads and writes stay coalesced.
#include "backends/cuda/codegen/emit_common.h"

#include <sstream>
#include <string>
#include <vector>

#include "dsl/error.h"

namespace moeforge::cuda {

// ------------------------------------------------------------ the padded copy (blocked)

void emit_gather(const KernelProgram &prog, const GatherStep &s, std::ostringstream &src, GeneratedKernel &k) {
  k.name = c_name(s.name);
  k.step = s.name;
  k.threads = 256;
  KernelBuilder kb(prog, k);
  const TensorDecl &from = prog.tensor(s.src);
  const Dim &cols = from.dims[1];
  user_check(!cols.is_dynamic() && cols.extent() % 8 == 0)
      << "tensor '" << s.src << "': its row length " << cols.name() << " must be a static multiple of 8 for the "
      << "blocked permutation's 16-byte copies";
  std::string gSrc = kb.tensor(s.src), gDst = kb.tensor(s.dst, true), sp = kb.route(s.route, RoutingArray::sorted_pair);
  std::string padded = kb.route(s.route, RoutingArray::padded_rows);
  // Pair order (below) for gathers; before the signature, which lists what is used.
  // A copy stored sorted (lowering/sorted_rows.h) has no padding rows: pair
  // r goes to its padded row less the padding before its expert.
  const bool sorted = prog.tensor(s.dst).layout == RowLayout::sorted;
  internal_check(!sorted || s.rows != RowMap::direct) << s.name << ": a copy stored sorted is gathered in pair order";
  std::string pairs, pair_pos, to_sorted;
  if (s.rows != RowMap::direct) {
    pairs = kb.extent(s.route->pairs);
    pair_pos = kb.route(s.route, RoutingArray::pair_pos);
  }
  if (sorted)
    to_sorted = sorted_row(kb, s.route, "r");
  // Each thread copies U 16-byte chunks of a row, chunks / U apart so a
  // warp's accesses stay consecutive: it issues all U loads before its
  // stores. One chunk a thread left too few bytes in flight to cover DRAM's
  // latency: fine64's 537 MB copy took 0.234 ms, 0.164 with four.
  const long long chunks = cols.extent() / 8;
  // Narrower rows (small copies, where this was not measured) keep one.
  const int U = chunks % 4 == 0 && chunks >= 128 ? 4 : 1;
  const long long span = chunks / U; // threads a row
  k.grid.kind = GridShape::Kind::padded_rows;
  k.grid.route = s.route;
  k.grid.chunks_per_row = span;
  std::string row = s.rows == RowMap::gather_token  ? "(long long)(r / " + std::to_string(s.route->k) + ")"
                    : s.rows == RowMap::gather_pair ? "(long long)r"
                                                    : "p";
  const std::string each = "#pragma unroll\n  for (int j = 0; j < " + std::to_string(U) + "; ++j)\n    ";
  const std::string at = "c + j * " + std::to_string(span) + "LL";
  auto src_row = [&] {
    return "reinterpret_cast<const uint4 *>(" + gSrc + " + " + row + " * " + std::to_string(cols.extent()) + ")";
  };
  auto dst_row = [&](const std::string &r) {
    return "reinterpret_cast<uint4 *>(" + gDst + " + (long long)(" + r + ") * " + std::to_string(cols.extent()) + ")";
  };
  src << "// " << s.name << ": " << s.dst << "[p, :] = " << s.src << "[" << row << "] (r = sorted_pair[p]), "
      << (sorted ? "stored sorted (no padding rows)" : "zero on padding") << "\n";
  src << "extern \"C\" __global__ void __launch_bounds__(256) " << k.name << "(\n    " << kb.signature() << ") {\n"
      << kEntry;
  src << "  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n";
  src << "  const long long p = idx / " << span << ", c = idx % " << span << ";\n";
  src << "  uint4 v[" << U << "];\n";
  if (s.rows == RowMap::direct) {
    src << "  if (p >= *" << padded << ") return;\n";
    src << "  const int r = " << sp << "[p];\n";
    src << "  " << each << "v[j] = r >= 0 ? " << src_row() << "[" << at << "] : make_uint4(0, 0, 0, 0);\n";
    src << "  " << each << dst_row("p") << "[" << at << "] = v[j];\n}\n\n";
    return;
  }
  // Row slot p: padded row p zeroed if it is padding, and pair r = p (when
  // p < pairs) copied to its padded row pair_pos[r]. In pair order a
  // token's k pairs read its row one after another, from cache after the
  // first; in padded order each read came from DRAM again (fine64: x is
  // 64 MB, read 8 times).
  // Slots past the padded rows still copy their pair: a route that drops
  // pairs at capacity can have fewer padded rows than pairs.
  if (sorted) {
    src << "  if (p >= " << pairs << ") return;\n";
    src << "  const long long r = p;  // pair order\n";
    src << "  " << each << "v[j] = " << src_row() << "[" << at << "];\n";
    src << "  const long long to = " << to_sorted << ";  // its row stored sorted\n";
    src << "  " << each << dst_row("to") << "[" << at << "] = v[j];\n}\n\n";
    return;
  }
  src << "  if (p >= *" << padded << " && p >= " << pairs << ") return;\n";
  src << "  if (p < *" << padded << " && " << sp << "[p] < 0) {\n";
  src << "  " << each << dst_row("p") << "[" << at << "] = make_uint4(0, 0, 0, 0);  // padding\n  }\n";
  src << "  if (p >= " << pairs << ") return;\n";
  src << "  const long long r = p;  // pair order\n";
  src << "  " << each << "v[j] = " << src_row() << "[" << at << "];\n";
  src << "  const long long to = " << pair_pos << "[r];\n";
  src << "  " << each << dst_row("to") << "[" << at << "] = v[j];\n}\n\n";
}

// ------------------------------------------------------------ transposes

namespace {

// Any transpose (f32 or bf16, dense or routed): 32 x 32 tiles through shared
// memory, an element per thread and access, so both the reads and the
// writes are coalesced. Dense: the last two dims swap, one grid slice per
// leading index. Routed: dst[c, p] = src[row(p), c] over every padded
// position p.
void emit_transpose_scalar(const TransposeStep &s, KernelBuilder &kb, std::ostringstream &body, const std::string &gSrc,
                           const std::string &gDst, const std::string &batch, const TensorDecl &from,
                           const TensorDecl &to) {
  body << "  __shared__ float tile[32][33];\n";
  body << "  const long long tiles_r = (R + 31) / 32, tiles_c = (C + 31) / 32;\n";
  body << "  const long long b = blockIdx.x / (tiles_r * tiles_c), t = blockIdx.x % (tiles_r * tiles_c);\n";
  body << "  if (b >= " << batch << ") return;\n";
  body << "  const long long r0 = (t / tiles_c) * 32, c0 = (t % tiles_c) * 32;\n";
  body << "  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;\n";
  body << "  for (int i = ty; i < 32; i += 8) {\n";
  body << "    const long long r = r0 + i, c = c0 + tx;\n";
  body << "    float v = 0.f;\n";
  if (s.route) {
    std::string sp = kb.route(s.route, RoutingArray::sorted_pair),
                padded = kb.route(s.route, RoutingArray::padded_rows);
    std::string row = s.rows == RowMap::gather_token  ? "(long long)(pr / " + std::to_string(s.route->k) + ")"
                      : s.rows == RowMap::gather_pair ? "(long long)pr"
                                                      : "r";
    body << "    const int pr = r < *" << padded << " ? " << sp << "[r] : -1;  // padding and unused rows: 0\n";
    body << "    if (pr >= 0 && c < C) v = mf::to_f32(" << gSrc << "[" << row << " * CS + c]);\n";
  } else {
    // A source stored inside a larger tensor: its matrices outer_stride apart.
    const std::string matrix =
        from.outer_stride > 0 ? "b * " + std::to_string(from.outer_stride) + "LL + r * CS" : "(b * R + r) * CS";
    body << "    if (r < R && c < C) v = mf::to_f32(" << gSrc << "[" << matrix << " + c]);\n";
  }
  body << "    tile[i][tx] = v;\n  }\n  __syncthreads();\n";
  body << "  for (int i = ty; i < 32; i += 8) {\n";
  body << "    const long long c = c0 + i, r = r0 + tx;\n";
  body << "    if (c < C && r < RS) " << gDst << "[(b * C + c) * RS + r] = mf::from_f32<" << c_type(to.dtype)
       << ">(tile[tx][i]);\n  }\n";
}

} // namespace

// A dense bf16 transpose (x^T for the router's weight gradient: 64 MB a
// step on mixtral and fine64): 64 x 64 tiles, each thread moving eight
// elements in one 16-byte load and one 16-byte store where rows are
// 16-byte aligned (C and RS multiples of 8), element by element otherwise.
// The scalar kernel's 2-byte accesses reached a third of the memory's rate.
void emit_transpose(const KernelProgram &prog, const TransposeStep &s, std::ostringstream &src, GeneratedKernel &k) {
  k.name = c_name(s.name);
  k.step = s.name;
  k.threads = 256;
  KernelBuilder kb(prog, k);
  const TensorDecl &from = prog.tensor(s.src), &to = prog.tensor(s.dst);
  internal_check(to.outer_stride == 0) << s.name << ": a transpose writes a dense copy of its own";
  internal_check(from.outer_stride == 0 || (!s.route && from.dims.size() == 3))
      << s.name << ": '" << s.src << "' (stored inside a larger tensor) is transposed as [E, R, C] matrices";
  std::string gSrc = kb.tensor(s.src), gDst = kb.tensor(s.dst, true);
  std::ostringstream body;
  std::string R, C, batch = "1LL";
  if (s.route) {
    R = max_padded_rows(prog, kb, s.route);
    C = kb.extent(from.dims.back());
  } else {
    size_t n = from.dims.size();
    R = kb.extent(from.dims[n - 2]);
    C = kb.extent(from.dims[n - 1]);
    for (size_t i = 0; i + 2 < n; ++i)
      batch = "(" + batch + " * " + kb.extent(from.dims[i]) + ")";
  }
  body << "  const long long R = " << R << ", C = " << C << ";\n";
  // src's row stride: C, or C rounded up to 8 (stride8: rows of a run-time
  // length); dst's: R, or R rounded up to 8 with a zero tail.
  body << "  const long long CS = " << (from.stride8 ? "(C + 7) / 8 * 8" : "C") << ";\n";
  body << "  const long long RS = " << (to.stride8 ? "(R + 7) / 8 * 8" : "R") << ";\n";
  // The tiled kernel reads packed matrices; one stored inside a larger
  // tensor (a weight read transposed by mma.sync GEMMs) goes element-wise.
  if (!s.route && from.dtype == DType::bf16 && to.dtype == DType::bf16 && from.outer_stride == 0) {
    // A 64 x 64 tile a block (tiles/transpose.cuh).
    body << "  mf::transpose_bf16_tile(" << gSrc << ", " << gDst << ", R, C, CS, RS, " << batch << ");\n";
    k.grid.tile_m = 64;
  } else {
    emit_transpose_scalar(s, kb, body, gSrc, gDst, batch, from, to);
    k.grid.tile_m = 32;
  }
  k.grid.kind = GridShape::Kind::transpose;
  k.grid.route = s.route;
  k.grid.count = s.route ? std::vector<Dim>{from.dims.back()} : from.dims;
  src << "// " << s.name << ": " << s.dst << " = " << s.src << "^T"
      << (s.route ? " over the padded rows of " + s.route->name : "") << "\n";
  src << "extern \"C\" __global__ void __launch_bounds__(256) " << k.name << "(\n    " << kb.signature() << ") {\n"
      << kEntry << body.str() << "}\n\n";
}

} // namespace moeforge::cuda
