// Attention kernels (AttentionStep): thin over the tile library's online
// softmax and its gradients (tiles/attention.cuh), so small; apart from the
// copies, since it computes.
#include "backends/cuda/codegen/emit_common.h"

#include <sstream>
#include <string>

namespace moeforge::cuda {

// An attention step (lowering/fuse_attention.h) over a route's padded row
// slots or the rows of q. The forward: its softmax online over every key
// and value row, on the tensor cores (16 rows a warp, 64 a block) where q,
// key and value are bf16 and the head dims fit the MMA's (FK a multiple of
// 16, FV of 8), else a warp per row on the CUDA cores. The gradients: the
// query's part 16 row slots a warp, the key's 16 tokens a warp, on the
// tensor cores where the operands are bf16 and both head dims multiples of
// 16; else a warp per row slot, or per token, on the CUDA cores.
void emit_attention(const KernelProgram &prog, const AttentionStep &s, std::ostringstream &src, GeneratedKernel &k) {
  using Part = AttentionStep::Part;
  k.name = c_name(s.name);
  k.step = s.name;
  KernelBuilder kb(prog, k);
  const TensorDecl &q = prog.tensor(s.q), &key = prog.tensor(s.key), &value = prog.tensor(s.value);
  const long long fk = key.dims[1].extent(), fv = value.dims[1].extent();
  const bool bf16_operands = q.dtype == DType::bf16 && key.dtype == DType::bf16 && value.dtype == DType::bf16;
  // The gradients' d_z is an MMA operand too (dP = d_z value^T): FV a
  // multiple of 16, where the forward's p value needs 8.
  const bool mma = bf16_operands && fk % 16 == 0 && fv % (s.part == Part::forward ? 8 : 16) == 0;
  k.threads = mma ? 128 : 256;
  const int rows_per_block = mma ? 64 : k.threads / 32;
  // Which row each row tensor keeps for a slot (tiles/attention.cuh's AttnRows).
  auto rows_of = [&](const std::string &name) {
    return s.route && prog.tensor(name).layout == RowLayout::pair ? std::string("mf::AttnRows{sorted_pair}")
                                                                  : std::string("mf::AttnRows{nullptr}");
  };
  std::ostringstream body;
  body << "  const long long T = " << kb.extent(key.dims[0]) << ";  // key and value rows\n";
  if (s.route) {
    body << "  const long long ROWS = " << max_padded_rows(prog, kb, s.route) << ";\n";
    body << "  const int *used = " << kb.route(s.route, RoutingArray::padded_rows) << ";\n";
    body << "  const int *sorted_pair = " << kb.route(s.route, RoutingArray::sorted_pair) << ";\n";
    body << "  auto live = [&](long long r) { return r < *used && sorted_pair[r] >= 0; };  // padding slots\n";
  } else {
    body << "  const long long ROWS = " << kb.extent(q.dims[0]) << ";\n";
    body << "  auto live = [](long long) { return true; };\n";
  }
  if (s.part == Part::key_gradient) { // a block per 64 tokens
    k.grid.kind = GridShape::Kind::elements;
    k.grid.count = {key.dims[0]};
    k.grid.threads_per_element = k.threads / rows_per_block;
  } else if (s.route) {
    k.grid.kind = GridShape::Kind::padded_rows;
    k.grid.route = s.route;
    k.grid.chunks_per_row = k.threads / rows_per_block;
  } else {
    k.grid.kind = GridShape::Kind::elements;
    k.grid.count = {q.dims[0]};
    k.grid.threads_per_element = k.threads / rows_per_block;
  }
  const std::string gq = kb.tensor(s.q), gk = kb.tensor(s.key), gv = kb.tensor(s.value);
  const std::string scale = float_literal(s.scale);
  const std::string first = "(long long)blockIdx.x * 64 + (threadIdx.x >> 5) * 16";
  if (s.part == Part::forward) {
    const std::string gz = kb.tensor(s.output, true);
    const std::string glse = s.lse.empty() ? "(float *)nullptr" : kb.tensor(s.lse, true);
    const std::string lse_rows = s.lse.empty() ? "mf::AttnRows{nullptr}" : rows_of(s.lse);
    if (mma) {
      body << "  const long long row0 = " << first << ";  // a warp's 16 row slots\n";
      body << "  mf::attention_rows_mma<" << fk << ", " << fv << ">(" << gq << ", " << gk << ", " << gv << ", " << gz
           << ", " << glse << ", " << rows_of(s.q) << ", " << rows_of(s.output) << ", " << lse_rows
           << ", row0, ROWS, T, " << scale << ", live);\n";
    } else {
      body << "  const long long slot = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;  // a warp per row\n";
      body << "  if (slot >= ROWS) return;\n";
      body << "  const bool lv = live(slot);\n";
      body << "  const long long qr = " << rows_of(s.q) << ".at(slot, lv), zr = " << rows_of(s.output)
           << ".at(slot, lv), lr = " << lse_rows << ".at(slot, lv);\n";
      body << "  mf::attention_row_warp<" << fk << ", " << fv << ">(" << gq << " + (lv ? qr : 0) * " << fk << "LL, "
           << gk << ", " << gv << ", zr >= 0 ? " << gz << " + zr * " << fv << "LL : nullptr, "
           << (s.lse.empty() ? glse : "lr >= 0 ? " + glse + " + lr : nullptr") << ", T, " << scale << ", lv);\n";
    }
    src << "// " << s.name << ": " << s.output << "[r, c] = sum(u, softmax(u, " << s.scale << " * " << s.q << "[r] . "
        << s.key << "[u]) * " << s.value << "[u, c])" << (s.route ? " over the padded slots of " + s.route->name : "")
        << ", the softmax online" << (s.lse.empty() ? "" : ", each row's log-sum-exp to " + s.lse)
        << (mma ? " (tensor cores)" : "") << "\n";
  } else if (s.part == Part::query_gradient) {
    const std::string gz = kb.tensor(s.z), gdz = kb.tensor(s.d_z), glse = kb.tensor(s.lse);
    const std::string gdq = kb.tensor(s.output, true), gdelta = kb.tensor(s.delta, true);
    if (mma) {
      body << "  const long long row0 = " << first << ";  // a warp's 16 row slots\n";
      body << "  mf::attention_query_gradient_mma<" << fk << ", " << fv << ">(" << gq << ", " << gk << ", " << gv
           << ", " << gz << ", " << gdz << ", " << glse << ", " << gdq << ", " << gdelta << ",\n      " << rows_of(s.q)
           << ", " << rows_of(s.z) << ", " << rows_of(s.d_z) << ", " << rows_of(s.lse) << ", " << rows_of(s.output)
           << ", " << rows_of(s.delta) << ", row0, ROWS, T, " << scale << ", live);\n";
    } else {
      body << "  const long long slot = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;  // a warp per row\n";
      body << "  if (slot >= ROWS) return;\n";
      body << "  const bool lv = live(slot);\n";
      body << "  auto at = [&](mf::AttnRows rows) { return lv ? rows.at(slot, true) : 0LL; };  // read where live\n";
      body << "  const long long dqr = " << rows_of(s.output) << ".at(slot, lv), dr = " << rows_of(s.delta)
           << ".at(slot, lv);\n";
      body << "  mf::attention_query_gradient_warp<" << fk << ", " << fv << ">(" << gq << " + at(" << rows_of(s.q)
           << ") * " << fk << "LL, " << gk << ", " << gv << ", " << gz << " + at(" << rows_of(s.z) << ") * " << fv
           << "LL, " << gdz << " + at(" << rows_of(s.d_z) << ") * " << fv << "LL, lv ? " << glse << "[at("
           << rows_of(s.lse) << ")] : 0.f,\n      dqr >= 0 ? " << gdq << " + dqr * " << fk << "LL : nullptr, dr >= 0 ? "
           << gdelta << " + dr : nullptr, T, " << scale << ", lv);\n";
    }
    src << "// " << s.name << ": " << s.delta << "[r] = " << s.d_z << "[r] . " << s.z << "[r]; " << s.output
        << "[r] = sum(u, ds(r, u) " << s.key << "[u]), p made again from " << s.lse << (mma ? " (tensor cores)" : "")
        << "\n";
  } else {
    const std::string gdz = kb.tensor(s.d_z), glse = kb.tensor(s.lse), gdelta = kb.tensor(s.delta);
    const std::string gdk = kb.tensor(s.output, true), gdv = kb.tensor(s.d_value, true);
    if (!mma) {
      body << "  const long long u = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;  // a warp per token\n";
      body << "  if (u >= T) return;\n";
      body << "  mf::attention_key_gradient_warp<" << fk << ", " << fv << ">(" << gq << ", " << gk << ", " << gv << ", "
           << gdz << ", " << glse << ", " << gdelta << ", " << gdk << ", " << gdv << ",\n      " << rows_of(s.q) << ", "
           << rows_of(s.d_z) << ", " << rows_of(s.lse) << ", " << rows_of(s.delta) << ", u, ROWS, " << scale
           << ", live);\n";
    } else {
      body << "  const long long u_first = " << first << ";  // a warp's 16 tokens\n";
      auto call = [&](const char *keys, const char *values) {
        std::ostringstream c;
        c << "mf::attention_key_gradient_mma<" << fk << ", " << fv << ", " << keys << ", " << values << ">(" << gq
          << ", " << gk << ", " << gv << ", " << gdz << ", " << glse << ", " << gdelta << ", " << gdk << ", " << gdv
          << ",\n      " << rows_of(s.q) << ", " << rows_of(s.d_z) << ", " << rows_of(s.lse) << ", " << rows_of(s.delta)
          << ", u_first, ROWS, T, " << scale << ", live);\n";
        return c.str();
      };
      // Both sets of accumulators in one warp up to head dims of 64 + 64;
      // past that d_key and d_value in two blocks each (blockIdx.y), which
      // make the scores each but keep within the registers.
      k.grid.y_parts = fk + fv > 128 ? 2 : 1;
      if (k.grid.y_parts == 2)
        body << "  if (blockIdx.y == 0)\n    " << call("true", "false") << "  else\n    " << call("false", "true");
      else
        body << "  " << call("true", "true");
    }
    src << "// " << s.name << ": " << s.output << "[u] = sum(r, ds(r, u) " << s.q << "[r]); " << s.d_value
        << "[u] = sum(r, p(r, u) " << s.d_z << "[r]) over every row slot" << (mma ? " (tensor cores)" : "") << "\n";
  }
  src << "extern \"C\" __global__ void __launch_bounds__(" << k.threads << ") " << k.name << "(\n    " << kb.signature()
      << ") {\n"
      << kEntry << body.str() << "}\n\n";
}

} // namespace moeforge::cuda
