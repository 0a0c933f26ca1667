// Attention kernels (AttentionStep): thin over the tile library's online
// softmax (tiles/attention.cuh), so small; apart from the copies, since it
// computes.
#include "backends/cuda/codegen/emit_common.h"

#include <sstream>
#include <string>

namespace moeforge::cuda {

// An attention step (lowering/fuse_attention.h), its softmax online over
// every key and value row (tiles/attention.cuh), over a route's padded row
// slots or the dense rows: on the tensor cores, 16 rows a warp and 64 a
// block, where q, key and value are bf16 and the head dims fit the MMA's
// (FK a multiple of 16, FV of 8); else a warp per row on the CUDA cores.
void emit_attention(const KernelProgram &prog, const AttentionStep &s, std::ostringstream &src, GeneratedKernel &k) {
  k.name = c_name(s.name);
  k.step = s.name;
  KernelBuilder kb(prog, k);
  const TensorDecl &q = prog.tensor(s.q), &key = prog.tensor(s.key), &value = prog.tensor(s.value),
                   &out = prog.tensor(s.output);
  const std::string gq = kb.tensor(s.q), gk = kb.tensor(s.key), gv = kb.tensor(s.value), gz = kb.tensor(s.output, true);
  const long long fk = q.dims[1].extent(), fv = out.dims[1].extent();
  const bool mma =
      q.dtype == DType::bf16 && key.dtype == DType::bf16 && value.dtype == DType::bf16 && fk % 16 == 0 && fv % 8 == 0;
  k.threads = mma ? 128 : 256;
  const int rows_per_block = mma ? 64 : k.threads / 32;
  std::ostringstream body;
  body << "  const long long T = " << kb.extent(key.dims[0]) << ";  // key and value rows\n";
  if (s.route) {
    body << "  const long long ROWS = " << max_padded_rows(prog, kb, s.route) << ";\n";
    body << "  const int *used = " << kb.route(s.route, RoutingArray::padded_rows) << ";\n";
    body << "  const int *sorted_pair = " << kb.route(s.route, RoutingArray::sorted_pair) << ";\n";
    body << "  auto live = [&](long long r) { return r < *used && sorted_pair[r] >= 0; };  // padding rows: zeros\n";
    k.grid.kind = GridShape::Kind::padded_rows;
    k.grid.route = s.route;
    k.grid.chunks_per_row = k.threads / rows_per_block;
  } else {
    body << "  const long long ROWS = " << kb.extent(q.dims[0]) << ";\n";
    body << "  auto live = [](long long) { return true; };\n";
    k.grid.kind = GridShape::Kind::elements;
    k.grid.count = {q.dims[0]};
    k.grid.threads_per_element = k.threads / rows_per_block;
  }
  if (mma) {
    body << "  const long long row0 = (long long)blockIdx.x * 64 + (threadIdx.x >> 5) * 16;  // a warp's 16 rows\n";
    body << "  mf::attention_rows_mma<" << fk << ", " << fv << ">(" << gq << ", " << gk << ", " << gv << ", " << gz
         << ", row0, ROWS, T, " << float_literal(s.scale) << ", live);\n";
  } else {
    body << "  const long long p_row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;  // a warp per row\n";
    body << "  if (p_row >= ROWS) return;\n";
    body << "  mf::attention_row_warp<" << fk << ", " << fv << ">(" << gq << " + p_row * " << fk << "LL, " << gk << ", "
         << gv << ", " << gz << " + p_row * " << fv << "LL, T, " << float_literal(s.scale) << ", live(p_row));\n";
  }
  src << "// " << s.name << ": " << s.output << "[r, c] = sum(u, softmax(u, " << s.scale << " * " << s.q << "[r] . "
      << s.key << "[u]) * " << s.value << "[u, c])" << (s.route ? " over the padded rows of " + s.route->name : "")
      << ", the softmax online" << (mma ? " (tensor cores)" : "") << "\n";
  src << "extern \"C\" __global__ void __launch_bounds__(" << k.threads << ") " << k.name << "(\n    " << kb.signature()
      << ") {\n"
      << kEntry << body.str() << "}\n\n";
}

} // namespace moeforge::cuda
