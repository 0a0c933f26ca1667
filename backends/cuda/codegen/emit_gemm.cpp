// GEMM kernels (GemmStep): the plan's choices (gemm_plan.h) printed as a
// call of the tile library's main loop, with the A operand's loader and the
// epilogue around it (the algebra on the accumulators, its stores). The
// largest emitter, so a file of its own.
#include "backends/cuda/codegen/emit_common.h"

#include <cctype>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "backends/cuda/codegen/expr_emitter.h"
#include "dsl/error.h"
#include "dsl/printer.h"
#include "lowering/gemm_plan.h"
#include "schedules/schedule.h"

namespace moeforge::cuda {

namespace {

// Elements from one expert's matrix of a per-expert operand to the next:
// `dense` (its [K, N] size, as a C++ expression) or the stride it is stored
// with inside a larger tensor.
std::string expert_stride(const TensorDecl &t, const std::string &dense) {
  return t.outer_stride > 0 ? std::to_string(t.outer_stride) + "LL" : dense;
}

// Whether C code uses the identifier `name` (not as part of a longer one).
bool mentions(const std::string &code, const std::string &name) {
  auto ident = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  for (size_t at = code.find(name); at != std::string::npos; at = code.find(name, at + 1))
    if ((at == 0 || !ident(code[at - 1])) && (at + name.size() == code.size() || !ident(code[at + name.size()])))
      return true;
  return false;
}

// The A operand's loader, once per tile: a TMA map of rows in tile order
// (a_tma), or each loading thread's row pointers, gathered through
// sorted_pair where the rows are routed (wrapped as Cfg::ACopy for the TMA
// loops, which take B through tensor maps).
// producer_only: a warp-specialised loop, where the consumers never load A
// and need not wait for these lookups (a persistent block's consumers would
// wait for them at every tile).
// `row0`: A's row of the tile's first row in tile order ("p0"; "sbase" for
// an A stored sorted).
void emit_a_operand(const GemmStep &g, KernelBuilder &kb, const std::string &gA, const std::string &sorted_pair,
                    const std::string &row0, bool tma, bool a_tma, bool producer_only, bool split_k,
                    std::ostringstream &body) {
  if (a_tma) {
    body << "  const Cfg::ATma a_load{&" << kb.tma(g.a, 0, g.k.extent()) << ", (int)" << row0 << ", rows};  // " << g.a
         << " rows in tile order, by TMA\n";
  } else {
    // A rows: resolved once per tile, not per k step.
    body << "  const mf::bf16 *gA[Cfg::A_ITERS];\n  bool a_ok[Cfg::A_ITERS];\n";
    if (producer_only)
      body << "  if (tid >= Cfg::CONSUMERS)  // the producer warpgroup's copies\n";
    body << "#pragma unroll\n  for (int i = 0; i < Cfg::A_ITERS; ++i) {\n";
    body << "    const int lr = Cfg::a_load_row(tid, i);\n";
    switch (g.a_rows) {
    case RowMap::direct:
      body << "    const long long row = lr < rows ? " << row0 << " + lr : 0;  // " << g.a
           << " rows are in tile order\n";
      body << "    a_ok[i] = lr < rows;\n";
      break;
    case RowMap::gather_pair:
    case RowMap::gather_token: {
      std::string div = g.a_rows == RowMap::gather_token ? " / " + std::to_string(g.route->k) : "";
      body << "    const int r = lr < rows ? " << sorted_pair << "[p0 + lr] : -1;\n";
      body << "    const long long row = r < 0 ? 0 : (long long)r" << div
           << ";  // gathered: " << (div.empty() ? "pair r" : "token(r) = r" + div) << "\n";
      body << "    a_ok[i] = r >= 0;\n";
      break;
    }
    }
    if (g.expert_k)
      body << "    gA[i] = " << gA << " + row * LDA + k_begin + Cfg::a_load_chunk(tid, i) * 8;\n  }\n";
    else
      body << "    gA[i] = " << gA << " + row * " << (g.k.is_dynamic() ? "LDA" : "K") << (split_k ? " + k_begin" : "")
           << " + Cfg::a_load_chunk(tid, i) * 8;\n  }\n";
    if (tma)
      body << "  const Cfg::ACopy a_load{gA, a_ok};\n";
  }
}

// The call of an epilogue lambda `fn` on element e (0 or 1) of a thread's
// column pair: every accumulator's value there, the row, the column.
// `ni` and `col` name the column group and its first column (the next
// group: "ni + 1", "col + 8").
std::string epilogue_call(const std::string &fn, int nb, const std::string &vr, int e, const std::string &ni = "ni",
                          const std::string &col = "col") {
  std::string call = fn + "(";
  for (int b = 0; b < nb; ++b)
    call += "Cfg::get(acc, " + std::to_string(b) + ", mi, " + ni + ", h * 2 + " + std::to_string(e) + "), ";
  return call + vr + ", " + col + " + " + std::to_string(e) + ")";
}

// The row a fused output of `g` is stored at, in its own layout: the tile's
// row (padded, or a dense GEMM's), from the tile's unpadded first row
// (sorted), or the pair's (pair order).
std::string fused_output_row(const GemmStep &g, const TensorDecl &t) {
  if (g.expert_k) // a further weight gradient (two B operands): expert's [M, N] matrix, maybe inside a larger one
    return "(expert * " +
           (t.outer_stride > 0 ? std::to_string(t.outer_stride / g.n.extent()) + "LL" : std::string("M")) +
           " + p0 + lr)";
  if (!g.route || t.layout == RowLayout::padded)
    return "(p0 + lr)";
  return t.layout == RowLayout::sorted ? "(sbase + lr)" : "(long long)r";
}

// The epilogue with plain stores: each thread stores its accumulator
// fragments (two columns at a time) of every row below `rows`, the GEMM's
// output and each fused one in its own layout.
void emit_store_epilogue(const KernelProgram &prog, const GemmStep &g, KernelBuilder &kb, int nb, const std::string &vr,
                         const std::vector<std::pair<std::string, Expr>> &outputs, bool pair_rows, bool prefetch_rows,
                         bool wide_stores, bool add, const std::string &sorted_pair, const std::string &gC,
                         std::ostringstream &body) {
  // LDC: the outputs' row stride, N rounded up to 8 for stride8 outputs
  // (rows of a run-time length start at multiples of 8, so the wide stores
  // stay aligned). Every output of a GEMM has its columns, so one stride.
  const bool stride8 = prog.tensor(outputs[0].first).stride8;
  for (const auto &[name, value] : outputs)
    internal_check(prog.tensor(name).stride8 == stride8)
        << g.name << ": outputs of one GEMM with different row strides (" << name << ")";
  const std::string ldc = stride8 ? "LDC" : "N";
  if (stride8)
    body << "  const long long LDC = (N + 7) / 8 * 8;\n";
  body << "#pragma unroll\n  for (int mi = 0; mi < Cfg::MI; ++mi)\n#pragma unroll\n  for (int h = 0; h < 2; ++h) {\n";

  body << "    const int lr = Cfg::acc_row(warp, lane, mi, h * 2);\n";
  // Outputs whose padding rows must hold zeros (TensorDecl::zero_padding:
  // GEMMs read them by TMA) get them from the tile's rows past `rows`.
  std::vector<std::string> zeroed;
  for (const auto &[name, value] : outputs)
    if (const TensorDecl &t = prog.tensor(name); g.route && !g.expert_k && t.zero_padding)
      zeroed.push_back(kb.tensor(name, /*writes=*/true));
  if (!zeroed.empty()) {
    body << "    if (lr >= rows) {  // padding rows: zeros, for readers that load whole boxes by TMA\n"
         << "#pragma unroll\n      for (int ni = 0; ni < Cfg::NI; ++ni) {\n"
         << "        const int col = n0 + Cfg::acc_col(warp, lane, ni, 0);\n        if (col >= N) continue;\n";
    for (const std::string &z : zeroed)
      body << "        mf::store2(" << z << " + (p0 + lr) * " << ldc << " + col, 0.f, 0.f);\n";
    body << "      }\n      continue;\n    }\n";
  } else {
    body << "    if (lr >= rows) continue;\n";
  }
  if (g.expert_k) {
    // An output stored inside a larger tensor (a weight gradient in place):
    // each expert's rows start outer_stride elements apart, a whole number
    // of rows (emit_gemm checks).
    const TensorDecl &c = prog.tensor(g.output);
    user_check(c.outer_stride % g.n.extent() == 0)
        << g.name << ": '" << g.output << "' is stored every " << c.outer_stride << " elements along "
        << c.dims[0].name() << ", not a whole number of its " << g.n.extent() << "-element rows";
    const std::string rows_apart = c.outer_stride > 0 ? std::to_string(c.outer_stride / g.n.extent()) + "LL" : "M";
    body << "    const long long " << vr << " = p0 + lr, out_row = expert * " << rows_apart << " + " << vr << ";\n";
  } else if (g.route) {
    if (pair_rows)
      body << "    const int r = " << (prefetch_rows ? std::string("r_pre[mi][h]") : sorted_pair + "[p0 + lr]")
           << ";\n    if (r < 0) continue;  // padding row\n";
    else
      body << "    const int r = -1;  // unread: rows below `rows` are real pairs, stored in tile order\n";
    body << "    const long long " << vr << " = r;\n";
    const bool sorted_out = prog.tensor(g.output).layout == RowLayout::sorted;
    body << "    const long long out_row = "
         << (g.out_add ? "r / " + std::to_string(g.route->k) + ";  // the pair's token, whose row it adds into"
             : g.out_rows == RowMap::direct
                 ? std::string(sorted_out ? "sbase + lr;  // tile order, stored sorted" : "p0 + lr;  // tile order")
                 : std::string("r;  // scattered back to pair order"))
         << "\n";
  } else {
    body << "    const long long " << vr << " = p0 + lr, out_row = " << vr << ";\n";
  }
  if (wide_stores) {
    // Two column groups at a time, the halves exchanged with the neighbour
    // lane (mf::store2x2): a bf16 row's 4-byte stores wrote half sectors and
    // the epilogue waited on the store queue; now a warp's
    // store writes whole 32-byte sectors, with half the instructions.
    // A row's last tile (BN not dividing N): the quad's 16 columns are
    // all past N (skipped), or the second 8 are (computed at in-range
    // columns, since the epilogue may read by column, and not stored).
    body << "#pragma unroll\n    for (int ni = 0; ni < Cfg::NI; ni += 2) {\n";
    body << "      const int col = n0 + Cfg::acc_col(warp, lane, ni, 0);\n";
    body << "      if (N % Cfg::BN != 0 && col - (lane & 3) * 2 >= N) continue;  // the quad's columns, all past N\n";
    body << "      const int col8 = N % Cfg::BN != 0 && col + 8 >= N ? col : col + 8;  // read in range\n";
    for (int e = 0; e < 2; ++e)
      body << "      const float v" << e << " = " << epilogue_call("epilogue", nb, vr, e) << ";\n";
    for (int e = 0; e < 2; ++e)
      body << "      const float w" << e << " = " << epilogue_call("epilogue", nb, vr, e, "ni + 1", "col8") << ";\n";
    body << "      mf::store2x2" << (g.out_add ? "<true>(" : "(") << gC << " + out_row * " << ldc
         << ", col, v0, v1, w0, w1, N);" << (g.out_add ? "  // added into the token's row" : "") << "\n";
    for (size_t o = 1; o < outputs.size(); ++o) {
      // A fused output, in its own layout: padded (tile order), sorted or pair.
      const TensorDecl &t = prog.tensor(outputs[o].first);
      const std::string fn = "epilogue" + std::to_string(o);
      const std::string row = fused_output_row(g, t);
      body << "      {\n";
      for (int e = 0; e < 2; ++e)
        body << "        const float x" << e << " = " << epilogue_call(fn, nb, vr, e) << ";\n";
      for (int e = 0; e < 2; ++e)
        body << "        const float y" << e << " = " << epilogue_call(fn, nb, vr, e, "ni + 1", "col8") << ";\n";
      body << "        mf::store2x2(" << kb.tensor(outputs[o].first, /*writes=*/true) << " + " << row << " * " << ldc
           << ", col, x0, x1, y0, y1, N);\n      }\n";
    }
    body << "    }\n  }\n";
    return;
  }
  body << "#pragma unroll\n    for (int ni = 0; ni < Cfg::NI; ++ni) {\n";
  // When BN divides N every tile is whole: no column test, and no branch
  // around each column pair, which kept the compiler from interleaving the
  // pairs' math (the epilogue stalled on each pair's dependency chain).
  body << "      const int col = n0 + Cfg::acc_col(warp, lane, ni, 0);\n";
  body << "      if (N % Cfg::BN != 0 && col >= N) continue;\n";
  for (int e = 0; e < 2; ++e)
    body << "      const float v" << e << " = " << epilogue_call("epilogue", nb, vr, e) << ";\n";
  body << "      mf::" << (add || g.out_add ? "add2(" : "store2(") << gC << " + out_row * " << ldc << " + col, v0, v1);"
       << (add         ? "  // this K slice's share"
           : g.out_add ? "  // added into the token's row"
                       : "")
       << "\n";
  for (size_t o = 1; o < outputs.size(); ++o) {
    // A fused output is stored in its own layout: padded (tile order), sorted or pair.
    const TensorDecl &t = prog.tensor(outputs[o].first);
    const std::string row = fused_output_row(g, t);
    body << "      {\n";
    for (int e = 0; e < 2; ++e)
      body << "        const float w" << e << " = " << epilogue_call("epilogue" + std::to_string(o), nb, vr, e)
           << ";\n";
    body << "        mf::store2(" << kb.tensor(outputs[o].first, /*writes=*/true) << " + " << row << " * " << ldc
         << " + col, w0, w1);\n      }\n";
  }
  body << "    }\n  }\n";
}

// The epilogue through TMA (GemmTiling::tma_store; WgmmaConfig::out_put4 and
// out_store): every thread stages its values, zero on rows past the tile's
// `rows` and columns past N (the copy drops columns past N; padding rows
// of a tile-order output are the tile's own), then each warpgroup's boxes
// go out in one copy per 64 x 64 box.
void emit_tma_store_epilogue(const GemmStep &g, KernelBuilder &kb, int nb, const std::string &vr, bool persistent,
                             int staged_cols, const std::vector<std::pair<std::string, Expr>> &outputs, bool zero_rows,
                             std::ostringstream &body) {
  const int parts = planned(g).tiling.tile_n / staged_cols;
  const std::string w = std::to_string(staged_cols);
  if (parts > 1)
    body << "  // The tile in " << parts << " parts of " << w << " columns: the staging past the ring holds one.\n";
  if (!persistent) // every output at once: the ring, idle now, holds them all
    body << "  const unsigned s_ring = Cfg::out_begin(smem);  // the tiles' staging area\n";
  for (size_t o = 0; o < outputs.size(); ++o) {
    const std::string fn = o ? "epilogue" + std::to_string(o) : "epilogue";
    body << "  // " << outputs[o].first << "\n";
    body << "#pragma unroll\n  for (int part = 0; part < " << parts << "; ++part) {\n";
    if (persistent) // once the previous copy has read it
      body << "  const unsigned s_out = Cfg::out_reuse(ring.out);  // past the ring: the tile's own staging\n";
    else
      body << "  const unsigned s_out = s_ring + " << o << " * (Cfg::BM * " << w << " * 2);\n";
    // Two column groups per stmatrix (Cfg::out_put4). Values past `rows` or
    // N are staged as 0 (the copy clips columns past N; rows past `rows`
    // are the tile's padding). The guard is a select, not a branch, where
    // the epilogue reads nothing by row or column out of range: routed
    // outputs never read the row here, and a tile that divides N has no
    // column past it.
    body << "  const int mi = 0;  // wgmma: one row group per warp\n";
    body << "#pragma unroll\n  for (int pi = 0; pi < " << w << " / 8; pi += 2) {\n";
    body << "    const int ni = part * (" << w << " / 8) + pi;  // the column group in the tile\n";
    body << "    float v[2][4];  // [group ni, ni + 1][row h = 0, 1 x column e = 0, 1]\n";
    body << "#pragma unroll\n    for (int dn = 0; dn < 2; ++dn)\n#pragma unroll\n"
         << "    for (int h = 0; h < 2; ++h) {\n";
    body << "      const int lr = Cfg::acc_row(warp, lane, mi, h * 2);\n";
    if (g.route && !g.expert_k)
      body << "      const long long " << vr << " = -1;  // unread: rows below `rows` are real pairs, in tile order\n";
    else
      body << "      const long long " << vr << " = p0 + lr;\n";
    body << "      const int col = n0 + Cfg::acc_col(warp, lane, ni + dn, 0);\n";
    body << "      const bool ok = lr < rows && (N % Cfg::BN == 0 || col < N);\n";
    for (int e = 0; e < 2; ++e)
      body << "      v[dn][h * 2 + " << e << "] = ok ? " << epilogue_call(fn, nb, vr, e, "ni + dn") << " : 0.f;\n";
    body << "    }\n";
    body << "    Cfg::template out_put4<" << w
         << ">(s_out, warp, lane, pi, v[0][0], v[0][1], v[0][2], v[0][3], v[1][0], v[1][1], v[1][2], "
            "v[1][3]);\n  }\n";
    // A block per tile waits, after its last output, until the copies have
    // read their staging (the block's shared memory must outlive them); a
    // persistent block goes on, the copy overlapping what follows, and
    // waits before it reuses the buffer and once at the end. An expert
    // reduction's output is one [M, N] matrix per expert; a zero-padded
    // output stores every box of the tile (rows = the tile's).
    const bool last = o + 1 == outputs.size();
    body << "  Cfg::template out_store<" << w << ">(s_out, &"
         << kb.tma(outputs[o].first, g.expert_k ? g.m.extent() : 0, g.n.extent()) << ", p0, "
         << (zero_rows ? "Cfg::BM" : "rows") << ", n0 + part * " << w << ", N, "
         << (persistent || !last ? "false" : "true") << (g.expert_k ? ", (int)expert" : "") << ");\n  }\n";
  }
}

// An expert reduction's tile `id` (a block's index, or a persistent
// block's tile id): its expert, its row and column tile within the expert
// (rasterised), and the expert's padded segment of sorted rows, which is
// the reduction (K) range, empty for an expert with no pairs; with both
// operands stored sorted (GemmPlan::k_unpadded), its pairs' rows there.
void emit_expert_tile(KernelBuilder &kb, const GemmStep &g, const std::string &id, std::ostringstream &body) {
  std::string off = kb.route(g.route, planned(g).k_unpadded ? RoutingArray::offsets_unpadded : RoutingArray::offsets);
  body << "  const long long expert = " << id << " / (NUM_M * NUM_N);\n";
  body << "  const int pid = (int)(" << id << " % (NUM_M * NUM_N));\n";
  body << "  mf::raster_mn(pid, NUM_M, NUM_N, " << planned(g).tiling.raster
       << ", m_tile, n_tile);  // within the expert\n";
  body << "  const long long k_begin = " << off << "[expert];\n";
  body << "  const int K = (int)(" << off << "[expert + 1] - k_begin);\n";
}

} // namespace

void emit_gemm(const KernelProgram &prog, const GemmStep &g, std::ostringstream &src, GeneratedKernel &k) {
  // Every choice below was made by the plan (gemm_plan.h, plan_gemms),
  // legality included: a refusal is the user's error here. The code is
  // printed from the plan alone, the tile it was made for included.
  const GemmPlan &plan = planned(g);
  const GemmTiling &t = plan.tiling;
  const int nb = plan.nb;
  k.name = c_name(g.name);
  k.step = g.name;
  // Of what a GEMM writes, only an expert reduction's output may be stored
  // inside a larger tensor (a weight's gradient in place); its A operand is
  // never such a tensor (routed rows are).
  for (const std::string &o : step_outputs(Step{g}))
    user_check(prog.tensor(o).outer_stride == 0 || (g.expert_k && o == g.output))
        << g.name << ": '" << o << "' is stored inside a larger tensor, which this GEMM writes only as an expert "
        << "reduction's output";
  internal_check(prog.tensor(g.a).outer_stride == 0) << g.name << ": A '" << g.a << "' is read densely";
  KernelBuilder kb(prog, k);
  const bool in_place = plan.in_place(), ws = plan.ws(), wgmma = plan.wgmma(), tma = plan.tma();
  const bool b_tma_rows = plan.b_tma_rows(), a_tma_rows = plan.a_tma_rows(), a_tma = plan.a_tma();
  std::string gA = a_tma ? "" : a_tma_rows ? "&" + kb.tma(g.a, 0, g.m.extent()) : kb.tensor(g.a);
  std::vector<std::string> gB;
  for (const std::string &b : g.b)
    gB.push_back(tma ? "" : b_tma_rows ? "&" + kb.tma(b, 0, g.n.extent()) : kb.tensor(b));
  // Tensors stored sorted (lowering/sorted_rows.h): a tile's rows start at
  // `sbase` in them, an expert reduction's B rows b_shift before k_begin.
  auto sorted = [&](const std::string &name) { return prog.tensor(name).layout == RowLayout::sorted; };
  bool reads_or_writes_sorted =
      (plan.a_sorted && !g.expert_k) || (g.chained && sorted(g.chained->a)) || sorted(g.output);
  for (const GemmStep::Extra &e : g.extra)
    reads_or_writes_sorted |= sorted(e.output);
  // A sorted B under a padded A starts b_shift rows before A's; under a
  // sorted A (k_unpadded) both start at the expert's unpadded row.
  const bool b_sorted = g.expert_k && plan.b_sorted && !plan.k_unpadded;
  internal_check(!reads_or_writes_sorted ||
                 (g.route && !g.expert_k && (!sorted(g.output) || g.out_rows == RowMap::direct)))
      << g.name << ": a tensor stored sorted is read as A or stored in tile order by a routed GEMM";
  internal_check(!b_sorted || (in_place && b_tma_rows && !plan.a_sorted))
      << g.name << ": an expert reduction reads a B stored sorted by TMA, in place";
  internal_check(!plan.k_unpadded || (in_place && a_tma_rows && b_tma_rows))
      << g.name << ": an expert reduction reads A and B stored sorted by TMA, in place";

  std::ostringstream body;
  internal_check(!in_place || (wgmma && g.expert_k && (nb == 1 || (ws && b_tma_rows))))
      << "in-place operands are for wgmma expert reductions, two B operands by TMA";
  if (in_place) {
    body << "  using Cfg = mf::" << (ws ? "WgmmaRowsWsConfig<" : "WgmmaRowsConfig<") << t.tile_m << ", " << t.tile_n
         << ", " << t.stages << (nb > 1 ? ", " + std::to_string(nb) : "") << ">;  // Hopper warpgroup MMA, "
         << (a_tma_rows && b_tma_rows ? "A and B by TMA"
             : b_tma_rows             ? "A by rows, B by TMA"
             : a_tma_rows             ? "A by TMA, B by rows"
                                      : "A and B by rows")
         << (ws ? ", warp-specialised" : "") << "\n";
  } else if (wgmma) {
    body << "  using Cfg = mf::" << (ws ? "WgmmaWsConfig<" : "WgmmaConfig<") << t.tile_m << ", " << t.tile_n << ", "
         << t.stages << ", " << nb << (g.b_trans ? ", true" : "") << ">;  // Hopper warpgroup MMA"
         << (ws ? ", warp-specialised" : "") << (g.b_trans ? ", B read transposed ([N, K])" : "") << "\n";
  } else {
    internal_check(!g.b_trans) << "mma.sync reads B as [K, N]: lowering materialises B^T for it";
    body << "  using Cfg = mf::GemmConfig<" << t.tile_m << ", " << t.tile_n << ", " << t.tile_k << ", " << t.stages
         << ", " << t.warps_m << ", " << t.warps_n << ", " << nb << ">;  // warp-level mma.sync\n";
  }
  body << "  extern __shared__ __align__(128) unsigned char smem[];\n";
  body << "  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;\n";
  // Timeline stamps (nothing unless compiled with MF_TIMELINE): a block per
  // tile only, whose phases are the tile's.
  // Persistent blocks: a loop over the tiles, `skip` leaving one tile.
  const bool persistent = plan.persistent();
  const bool stamp_tiles = persistent; // persistent blocks stamp per tile
  auto stamp = [&](int phase) {
    if (timeline_requested())
      body << (stamp_tiles ? "  MF_STAMP_AT(tile_id, " : "  MF_STAMP(") << phase << ");\n";
  };
  // With the main-loop call, the tile's rows (timeline: tiles of an expert's
  // last rows apart from full ones).
  auto stamp_rows = [&] {
    if (timeline_requested())
      body << (stamp_tiles ? "  MF_NOTE_ROWS_AT(tile_id, rows);\n" : "  MF_NOTE_ROWS(rows);\n");
  };
  if (!stamp_tiles)
    stamp(0);
  // N: the columns, a constant, or the token count at run time (attention's
  // scores p(r, u) over the tokens u), then every column test below is a
  // run-time one.
  if (g.n.is_dynamic())
    body << "  const int N = (int)" << kb.extent(g.n) << ";\n";
  else
    body << "  constexpr int N = " << g.n.extent() << ";\n";
  // Split-K: the grid's y slices K into runs of whole k-tiles, each adding
  // its partial sums into the zeroed f32 output.
  const bool split_k = plan.split_k;
  if (g.expert_k)
    body << "  // K: this expert's padded rows (below)\n";
  else if (split_k)
    body << "  const int K_ALL = (int)" << kb.extent(g.k) << ";\n"
         << "  const long long LDA = "
         << (prog.tensor(g.a).stride8 ? "(K_ALL + 7) / 8 * 8;  // zero-padded rows\n" : "K_ALL;\n")
         << "  // This block's slice of K (split-K over gridDim.y): whole k-tiles.\n"
         << "  const int k_slice = (K_ALL + (int)gridDim.y * " << t.tile_k << " - 1) / ((int)gridDim.y * " << t.tile_k
         << ") * " << t.tile_k << ";\n"
         << "  const int k_begin = (int)blockIdx.y * k_slice;\n"
         << "  const int K = min(k_slice, K_ALL - k_begin);\n"
         << "  if (K <= 0) return;  // the whole block: a slice past K\n";
  else if (g.k.is_dynamic())
    body << "  const int K = (int)" << kb.extent(g.k) << ";\n"
         << "  const long long LDA = "
         << (prog.tensor(g.a).stride8 ? "(K + 7) / 8 * 8;  // zero-padded rows\n" : "K;\n");
  else
    body << "  constexpr int K = " << g.k.extent() << ";\n";
  body << "  " << (g.n.is_dynamic() ? "const" : "constexpr") << " int NUM_N = (N + Cfg::BN - 1) / Cfg::BN;\n";
  body << "  int m_tile, n_tile;\n";
  const bool cluster = plan.cluster();
  // Persistent clusters: the pair walks (pair of row tiles, column tile)
  // items together (WgmmaWsConfig::pair_ring); a block whose tile of the
  // pair is empty runs the item's stages with no rows, keeping the pair in
  // step.
  const bool pair_items = plan.pair_items();
  const bool chained = plan.chained;
  // The epilogue: the algebra around the sums, per output element.
  std::string vr = "v_" + c_name(g.row_var.name()), vc = "v_" + c_name(g.col_var.name());
  std::map<const FuncNode *, std::string> accumulators; // held in registers, passed to each lambda
  std::string params;
  for (int b = 0; b < nb; ++b) {
    accumulators[g.accumulators[b].get()] = "acc" + std::to_string(b);
    params += "float acc" + std::to_string(b) + ", ";
  }
  // One lambda per output: the GEMM's own, then the fused element-wise ones.
  std::vector<std::pair<std::string, Expr>> outputs{{g.output, g.epilogue}};
  for (const GemmStep::Extra &e : g.extra)
    outputs.emplace_back(e.output, e.value);
  std::ostringstream epilogues; // emitted after the main loop
  bool reads_row = false;       // does any epilogue read the row index (pair r)?
  for (size_t o = 0; o < outputs.size(); ++o) {
    std::ostringstream code;
    ExprEmitter eo(prog, kb, code, 4);
    eo.fast_special = prog.tensor(outputs[o].first).dtype == DType::bf16;
    eo.vars[g.row_var.get()] = vr;
    eo.vars[g.col_var.get()] = vc;
    eo.registers = accumulators;
    std::string value = eo.emit(outputs[o].second);
    epilogues << "  // " << outputs[o].first << "(" << g.row_var.name() << ", " << g.col_var.name()
              << ") = " << outputs[o].second << "\n";
    epilogues << "  auto epilogue" << (o ? std::to_string(o) : "") << " = [&](" << params << "long long " << vr
              << ", long long " << vc << ") -> float {\n"
              << code.str() << "    return " << value << ";\n  };\n";
    reads_row |= mentions(code.str() + value, vr);
  }
  internal_check(reads_row == plan.reads_row) << g.name << ": the plan and the epilogue disagree on reading the row";
  const bool pair_rows = plan.pair_rows, prefetch_rows = plan.prefetch_rows, zero_rows = plan.zero_rows;
  const bool out_tma = plan.out_tma();
  const std::string gC = out_tma ? "" : kb.tensor(g.output, /*writes=*/true);
  // A persistent block stages its output tile past the ring: whole if that
  // fits beside the stages, else in halves (TmaStoreTile's W), so that the
  // ring keeps its depth (3 stages instead of 4 slowed mixtral's weight
  // gradients by 8 %, more than the stores had cost).
  const int staged_cols = plan.staged_cols;
  const std::string staging = ", Cfg::BM * " + std::to_string(staged_cols) + " * 2);  // + the output's staging";
  const char *skip = persistent ? "continue" : "return";
  // Persistent blocks' row tiles. Routed: the routing's own tile count (read
  // on the device), so no block walks the upper bound's empty tiles.
  // A window's tiles: window[0] of them, ids window[1 ...] (GemmStep::windowed).
  // The launch's grid counts the same row tiles (launch_grid.h).
  k.grid.row_tiles_per_block = g.route ? g.block / t.tile_m : 1;
  const std::string row_tiles = std::to_string(k.grid.row_tiles_per_block);
  const std::string window = plan.windowed ? kb.route(g.route, RoutingArray::window) : "";
  const std::string rows_total = plan.windowed ? "(long long)" + window + "[0] * " + row_tiles
                                 : g.route
                                     ? "(long long)*" + kb.route(g.route, RoutingArray::num_tiles) + " * " + row_tiles
                                     : "(" + kb.extent(g.m) + " + Cfg::BM - 1) / Cfg::BM";
  if (pair_items) {
    body << "  const long long PAIRS = (" << rows_total << " + 1) / 2;  // pairs of row tiles\n";
    body << "  const long long TOTAL = PAIRS * NUM_N;  // items: a pair of row tiles x a column tile\n";
    body << "  auto ring = Cfg::pair_ring(smem" << (out_tma ? staging : ");") << "\n";
    body << "  const int rank = (int)mf::cluster_rank();\n";
    body << "  for (long long item = blockIdx.x >> 1; item < TOTAL; item = Cfg::pair_next(ring, " << kb.tile_counter()
         << ")) {\n";
    body << "  const long long tile_id = 2 * item + rank;  // this block's tile of the item\n";
    stamp(0);
    body << "  mf::raster_mn((int)item, (int)PAIRS, NUM_N, " << t.raster << ", m_tile, n_tile);\n";
    body << "  m_tile = 2 * m_tile + rank;  // this block's row tile in the pair\n";
  } else if (persistent && g.expert_k) {
    // Every expert's tiles in one range: tile_id / (NUM_M * NUM_N) is the expert.
    body << "  constexpr long long M = " << g.m.extent() << ";\n";
    body << "  constexpr int NUM_M = (int)((M + Cfg::BM - 1) / Cfg::BM);\n";
    body << "  constexpr long long TOTAL = " << g.route->expert_dim().extent()
         << "LL * NUM_M * NUM_N;  // output tiles of every expert\n";
    body << "  auto ring = Cfg::ring(smem" << (out_tma ? staging : ");") << "\n";
    body << "  for (long long tile_id = blockIdx.x; tile_id < TOTAL; tile_id = Cfg::next_tile(ring, "
         << kb.tile_counter() << ")) {\n";
    stamp(0);
    emit_expert_tile(kb, g, "tile_id", body);
  } else if (persistent) {
    body << "  const long long TOTAL = (" << rows_total << ") * NUM_N;  // output tiles\n";
    body << "  auto ring = Cfg::ring(smem" << (out_tma ? staging : ");") << "\n";
    body << "  for (long long tile_id = blockIdx.x; tile_id < TOTAL; tile_id = Cfg::next_tile(ring, "
         << kb.tile_counter() << ")) {\n";
    stamp(0);
    body << "  mf::raster_mn((int)tile_id, (int)(TOTAL / NUM_N), NUM_N, " << t.raster << ", m_tile, n_tile);\n";
  } else if (g.expert_k) {
    // One grid slice per expert; the expert's padded segment of sorted rows
    // is the reduction (K) range, empty for an expert with no pairs.
    const RoutingNode *r = g.route;
    body << "  constexpr long long M = " << g.m.extent() << ";\n";
    body << "  constexpr int NUM_M = (int)((M + Cfg::BM - 1) / Cfg::BM);\n";
    emit_expert_tile(kb, g, "blockIdx.x", body);
    if (!in_place)
      body << "  const long long LDA = " << max_padded_rows(prog, kb, r) << ";  // " << g.a << "'s padded row stride\n";
  } else if (cluster) {
    // Blocks 2c and 2c + 1 form a cluster: row tiles 2m and 2m + 1 of one column tile.
    // Rasterised over the pairs: gridDim.x / 2 / NUM_N of them (mf::raster
    // would count gridDim.x / NUM_N row tiles, twice too many, and map a
    // partial last band of pairs wrongly, leaving tiles unwritten).
    body << "  mf::raster_mn(blockIdx.x >> 1, (int)(gridDim.x / 2 / NUM_N), NUM_N, " << t.raster
         << ", m_tile, n_tile);\n";
    body << "  m_tile = 2 * m_tile + (blockIdx.x & 1);  // this block's row tile in the cluster's pair\n";
  } else {
    body << "  mf::raster(blockIdx.x, NUM_N, " << t.raster << ", m_tile, n_tile);\n";
  }
  body << "  const int n0 = n_tile * Cfg::BN;\n";
  std::string sorted_pair;
  if (g.expert_k) {
    body << "  const long long p0 = (long long)m_tile * Cfg::BM;\n";
    body << "  const int rows = (int)min((long long)Cfg::BM, M - p0);\n";
  } else if (g.route) {
    const RoutingNode *r = g.route;
    int sub = g.block / t.tile_m;
    sorted_pair = kb.route(r, RoutingArray::sorted_pair);
    body << "  // This block's rows: part m_tile % " << sub << " of routing tile m_tile / " << sub
         << " (one expert's rows, padded to " << g.block << ").\n";
    const std::string num_tiles = plan.windowed ? "" : kb.route(r, RoutingArray::num_tiles);
    if (pair_items) {
      // Past the last routing tile (an odd count): the partner's tile, no rows.
      body << "  const bool live = m_tile / " << sub << " < *" << num_tiles << ";\n";
      body << "  const int tile = (live ? m_tile : m_tile - rank) / " << sub << ", part = m_tile % " << sub << ";\n";
      body << "  const long long p0 = " << kb.route(r, RoutingArray::tile_row_start) << "[tile] + part * Cfg::BM;\n";
      body << "  const int rows = live ? max(0, " << kb.route(r, RoutingArray::tile_rows)
           << "[tile] - part * Cfg::BM) : 0;  // 0: this block only keeps the pair in step\n";
    } else if (plan.windowed) {
      body << "  const int w_tile = m_tile / " << sub << ", part = m_tile % " << sub << ";\n";
      body << "  if (w_tile >= " << window << "[0]) " << skip << ";  // grids are sized by the window's tiles\n";
      body << "  const int tile = " << window << "[1 + w_tile];  // the window's w_tile-th tile of the route\n";
      body << "  const long long p0 = " << kb.route(r, RoutingArray::tile_row_start) << "[tile] + part * Cfg::BM;\n";
      body << "  const int rows = " << kb.route(r, RoutingArray::tile_rows) << "[tile] - part * Cfg::BM;\n";
      body << "  if (rows <= 0) " << skip << ";\n";
    } else {
      body << "  const int tile = m_tile / " << sub << ", part = m_tile % " << sub << ";\n";
      body << "  if (tile >= *" << num_tiles << ") " << skip << ";  // grids are sized by an upper bound\n";
      body << "  const long long p0 = " << kb.route(r, RoutingArray::tile_row_start) << "[tile] + part * Cfg::BM;\n";
      body << "  const int rows = " << kb.route(r, RoutingArray::tile_rows) << "[tile] - part * Cfg::BM;\n";
      body << "  if (rows <= 0) " << skip << ";\n";
    }
    body << "  const long long expert = " << kb.route(r, RoutingArray::tile_expert) << "[tile];\n";
    if (reads_or_writes_sorted)
      body << "  const long long sbase = p0 - " << kb.route(r, RoutingArray::offsets) << "[expert] + "
           << kb.route(r, RoutingArray::offsets_unpadded)
           << "[expert];  // the tile's first row in the tensors stored sorted (no padding)\n";
  } else {
    body << "  const long long M = " << kb.extent(g.m) << ";\n";
    body << "  const long long p0 = (long long)m_tile * Cfg::BM;\n";
    if (pair_items)
      body
          << "  const int rows = (int)max(0LL, min((long long)Cfg::BM, M - p0));  // 0: the last pair's missing half\n";
    else
      body << "  const int rows = (int)min((long long)Cfg::BM, M - p0);\n";
    if (cluster && !pair_items)
      body << "  if (rows <= 0) return;  // the grid's last pair is rounded up\n";
    body << "  const long long expert = 0;  // one B for every row\n  (void)expert;\n";
  }
  // The narrow tail: the walks' `cols`, the tile's columns before N, pick
  // narrower wgmmas where the tile is half full or less.
  const std::string half = plan.narrow_tail ? ", N - n0" : "";
  if (in_place) {
    if (b_sorted)
      body << "  const int b_shift = " << kb.route(g.route, RoutingArray::offsets) << "[expert] - "
           << kb.route(g.route, RoutingArray::offsets_unpadded) << "[expert];  // " << g.b[0]
           << "'s rows: sorted, without the padding before this expert\n";
    // Row maps of the reduced index p: 0 = row p (padded), d = sorted_pair[p] / d.
    auto div = [&](RowMap m) { return m == RowMap::direct ? 0 : m == RowMap::gather_pair ? 1 : g.route->k; };
    body << "  Cfg::Acc acc = {};\n";
    stamp(1);
    // Each operand as (rows, TMA map): one of them null.
    auto operand = [](bool by_tma, const std::string &g_x) { return by_tma ? "nullptr, " + g_x : g_x + ", nullptr"; };
    if (a_tma_rows || b_tma_rows || persistent)
      body << "  if (!Cfg::" << (persistent ? "tile<" : "mainloop<") << (a_tma_rows ? "true" : "false") << ", "
           << (b_tma_rows ? "true" : "false")
           << (b_sorted          ? ", true"
               : plan.k_unpadded ? ", false, true"
                                 : "")
           << ">(" << (persistent ? "ring, " : "smem, ") << operand(a_tma_rows, gA) << ", " << div(g.a_rows)
           << ", (int)M, (int)p0, " << operand(b_tma_rows, gB[0]) << ", " << div(g.b_rows) << ", N, n0, "
           << kb.route(g.route, RoutingArray::sorted_pair) << ", k_begin, K, acc"
           << (nb > 1     ? ", Cfg::BN, " + std::string(b_sorted ? "b_shift" : "0") + ", " + gB[1]
               : b_sorted ? (half.empty() ? ", Cfg::BN" : half) + ", b_shift"
                          : half)
           << "))\n"
           << (persistent ? "    continue;  // the producer: on to the next tile\n\n"
                          : "    return;  // a loading-only warpgroup\n\n");
    else
      body << "  if (!Cfg::mainloop(smem, " << gA << ", " << div(g.a_rows) << ", (int)M, (int)p0, " << gB[0] << ", "
           << div(g.b_rows) << ", N, n0, " << kb.route(g.route, RoutingArray::sorted_pair) << ", k_begin, K, acc))\n"
           << "    return;  // a loading-only warpgroup\n\n";
  } else {
    emit_a_operand(g, kb, gA, sorted_pair, plan.a_sorted ? "sbase" : "p0", tma, a_tma, ws && persistent && plan.roomy,
                   split_k, body);
    if (tma) {
      body << "  const mf::TmaDesc *tB[" << nb << "] = {";
      for (int b = 0; b < nb; ++b)
        body << (b ? ", " : "") << "&"
             << (g.b_trans ? kb.tma(g.b[b], g.n.extent(), g.k.extent()) : kb.tma(g.b[b], g.k.extent(), g.n.extent()));
      body << "};  // B tiles by TMA, batch " << (g.b_per_expert ? "= expert" : "0") << "\n";
      if (chained) {
        const GemmStep::Chained &c = *g.chained;
        body << "  // The chained product, after A B's k-tiles: " << c.a << " x " << c.b << (g.b_trans ? "^T" : "")
             << "\n";
        body << "  constexpr int K2 = " << c.k.extent() << ";\n";
        body << "  const Cfg::ATma a_load2{&" << kb.tma(c.a, 0, c.k.extent()) << ", (int)"
             << (sorted(c.a) ? "sbase" : "p0") << ", rows};\n";
        body << "  const mf::TmaDesc *tB2[1] = {&"
             << (g.b_trans ? kb.tma(c.b, g.n.extent(), c.k.extent()) : kb.tma(c.b, c.k.extent(), g.n.extent()))
             << "};\n";
      }
    } else {
      body << "  const mf::bf16 *gB[" << nb << "] = {";
      for (int b = 0; b < nb; ++b)
        body << (b ? ", " : "") << gB[b]
             << (g.expert_k       ? " + k_begin * N"
                 : split_k        ? " + (long long)k_begin * N"
                 : g.b_per_expert ? " + (long long)expert * " + expert_stride(prog.tensor(g.b[b]), "K * N")
                                  : "");
      body << "};\n";
    }
    if (prefetch_rows) {
      // The epilogue's rows through sorted_pair, loaded now so that the
      // main loop hides their latency.
      body << "  int r_pre[Cfg::MI][2];  // pair r of each accumulator row, -1 past the tile's rows\n"
           << "#pragma unroll\n  for (int mi = 0; mi < Cfg::MI; ++mi)\n#pragma unroll\n"
           << "    for (int h = 0; h < 2; ++h) {\n"
           << "      const int lr = Cfg::acc_row(warp, lane, mi, h * 2);\n"
           << "      r_pre[mi][h] = lr < rows ? " << sorted_pair << "[p0 + lr] : -1;\n    }\n";
    }
    body << "  Cfg::Acc acc = {};\n";
    stamp(1);
    stamp_rows();
    const std::string batch = g.b_per_expert ? "(int)expert" : "0";
    // The warp-specialised loop: one walk (a block per tile: mainloop;
    // persistent: tile) over what its stages load (WgmmaWsConfig's
    // CopyLoads, TmaLoads, ChainLoads).
    const std::string loads = chained ? "Cfg::chain_loads(a_load, tB, a_load2, tB2, " + batch + ", K, K2, n0), rows"
                              : tma   ? "Cfg::tma_loads(a_load, tB, " + batch + ", K, n0), rows"
                                      : "Cfg::CopyLoads{gA, a_ok, gB, K, N, n0}, Cfg::BM";
    internal_check(!chained || ws) << g.name << ": a chained product runs in the warp-specialised loop";
    if (ws && persistent && !cluster)
      body << "  if (!Cfg::tile(ring, " << loads << ", acc" << half
           << "))\n    continue;  // the producer: on to the next tile\n\n";
    else if (ws && !cluster)
      body << "  if (!Cfg::mainloop(smem, " << loads << ", acc" << half
           << "))\n    return;  // a loading-only warpgroup\n\n";
    else if (cluster) {
      // Both blocks of the pair decide alike: share B when both tiles hold rows of one expert.
      if (g.route && g.block == 2 * t.tile_m)
        body << "  const bool share = " << kb.route(g.route, RoutingArray::tile_rows)
             << "[tile] > Cfg::BM;  // both halves of the routing tile hold rows\n";
      else if (g.route)
        body << "  const int pair_tile = m_tile & ~1;\n  const bool share = pair_tile + 1 < *"
             << kb.route(g.route, RoutingArray::num_tiles) << " && " << kb.route(g.route, RoutingArray::tile_expert)
             << "[pair_tile] == " << kb.route(g.route, RoutingArray::tile_expert) << "[pair_tile + 1];\n";
      else
        body << "  const bool share = (long long)(m_tile | 1) * Cfg::BM < M;  // both row tiles hold rows\n";
      if (pair_items)
        body << "  if (!Cfg::pair_tile_tma(ring, a_load, tB, " << batch
             << ", K, n0, rows, share, acc))\n    continue;  // the producer: on to the next item\n\n";
      else
        body << "  if (!Cfg::mainloop_tma_pair(smem, a_load, tB, " << batch
             << ", K, n0, rows, share, acc))\n    return;  // a loading-only warpgroup\n\n";
    } else {
      body << "  if (!Cfg::"
           << (tma ? "mainloop_tma(smem, a_load, tB, " + batch + ", K, n0, rows, acc)"
                   : "mainloop(smem, gA, a_ok, gB, K, N, n0, acc)")
           << ")\n    return;  // a loading-only warpgroup\n\n";
    }
  }

  stamp(3);
  body << epilogues.str();
  if (out_tma)
    emit_tma_store_epilogue(g, kb, nb, vr, persistent, staged_cols, outputs, zero_rows, body);
  else
    emit_store_epilogue(prog, g, kb, nb, vr, outputs, pair_rows, prefetch_rows, plan.wide_stores(), split_k,
                        sorted_pair, gC, body);
  stamp(4);
  if (pair_items)
    body << "  }  // next item\n  Cfg::pair_done(tile_counter);\n" << (out_tma ? "  Cfg::out_done();\n" : "");
  else if (persistent)
    body << "  }  // next tile\n  Cfg::tiles_done(tile_counter);\n" << (out_tma ? "  Cfg::out_done();\n" : "");

  k.grid.kind = g.expert_k ? GridShape::Kind::expert_tiles
                : g.route  ? GridShape::Kind::routed_tiles
                           : GridShape::Kind::dense_tiles;
  k.grid.route = g.route;
  k.grid.count = {g.m};
  k.grid.n = g.n;
  k.grid.tile_m = t.tile_m;
  k.grid.tile_n = t.tile_n;
  k.grid.persistent = persistent;
  k.grid.windowed = plan.windowed;
  if (split_k) {
    k.grid.split_k = true;
    k.grid.split_k_dim = g.k;
    k.grid.tile_k = t.tile_k;
  }
  if (split_k || (g.out_add && !g.out_add_onto_written)) { // the slices or pairs add into it
    // Zeroing a tensor stored inside a larger one would zero its neighbours' rows too.
    const TensorDecl &c = prog.tensor(g.output);
    user_check(c.outer_stride == 0) << g.name << ": '" << g.output << "' is stored inside a larger tensor (every "
                                    << c.outer_stride << " elements along " << c.dims[0].name()
                                    << "), which split-K or added rows cannot zero first: drop split_k for " << g.func;
    k.zero_first = g.output;
  }
  k.shared_bytes = plan.shared_bytes();
  k.threads = plan.threads;
  const int min_blocks = plan.min_blocks;

  src << "// " << g.name << ": " << g.output << " = epilogue(" << g.a << " x {";
  for (int b = 0; b < nb; ++b)
    src << (b ? ", " : "") << g.b[b];
  src << "}" << (chained ? " + " + g.chained->a + " x {" + g.chained->b + "}" : "") << "), tile " << t.tile_m << "x"
      << t.tile_n << "x" << t.tile_k << ", " << t.stages << " stages\n";
  k.grid.cluster_m = cluster ? 2 : 1;
  src << "extern \"C\" __global__ void __launch_bounds__(" << k.threads << ", " << min_blocks << ") "
      << (cluster ? "__cluster_dims__(2, 1, 1) " : "") << k.name << "(\n    " << kb.signature() << ") {\n"
      << kEntry << body.str() << "}\n\n";
}

} // namespace moeforge::cuda
