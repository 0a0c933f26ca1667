#include "lowering/gemm_plan.h"

#include <algorithm>
#include <memory>
#include <sstream>

#include "dsl/error.h"
#include "dsl/visitor.h"

namespace moeforge {

namespace {

void check_multiple_of_8(const GemmStep &g, const Dim &d, const char *role) {
  user_check(d.is_dynamic() || d.extent() % 8 == 0)
      << "definition '" << g.output << "': " << role << " dimension " << d.name() << " = " << d.extent()
      << " is not a multiple of 8; the CUDA backend moves 16-byte vectors: pad " << d.name() << " to "
      << (d.extent() + 7) / 8 * 8;
}

const char *mma_name(MmaKind m) {
  return m == MmaKind::wgmma_ws ? "wgmma_ws" : m == MmaKind::wgmma ? "wgmma" : "mma_sync";
}

} // namespace

GemmPlan plan_gemm(const KernelProgram &prog, const GemmStep &g) {
  const GemmTiling &t = g.tiling;
  GemmPlan p;
  p.step = g.name;
  p.tiling = t;
  p.nb = static_cast<int>(g.b.size());
  user_check(!g.fp8) << "definition '" << func_of(g) << "': FP8 operands ("
                     << "fp8(\"" << func_of(g) << "\", \"" << fp8_format_name(*g.fp8)
                     << "\")) are not built for the CUDA backend yet; the CPU backend and the reference run "
                     << "them. Drop fp8 from the schedule to run on a GPU";
  // The choices as flags while they are made; the plan keeps each as one
  // enum (GemmPlan::a_load, b_load, walk, store) once all are.
  bool wgmma = false, ws = false, in_place = false, tma = false, a_tma = false, b_tma_rows = false, a_tma_rows = false,
       persistent = false, cluster = false, pair_items = false, out_tma = false, wide_stores = false;
  check_multiple_of_8(g, g.k, "reduced");
  check_multiple_of_8(g, g.n, "column");
  // Columns of a run-time extent (the tokens: attention's scores over them):
  // the output's rows then start at multiples of 8 elements (stride8, which
  // lowering gives every intermediate with such rows), and B is read as
  // B^T [N, K] with a static K, whose rows the loads guard one by one.
  if (g.n.is_dynamic()) {
    user_check(prog.tensor(g.output).stride8)
        << "definition '" << g.output << "': its columns run over the dynamic " << g.n.name()
        << ", which the CUDA backend computes into intermediates only; make '" << g.output
        << "' feed a further definition that the layer outputs";
    user_check(g.b_trans && !g.k.is_dynamic())
        << "definition '" << g.output << "': the CUDA backend reads a B with a dynamic column extent (" << g.n.name()
        << ") as B^T [" << g.n.name() << ", " << g.k.name() << "] with a static " << g.k.name() << " only";
  }
  // A dynamic K: A's rows have a run-time length, so they must start at
  // multiples of 8 (stride8) for the 16-byte loads; B^T's rows likewise.
  user_check(!g.k.is_dynamic() || g.expert_k || prog.tensor(g.a).stride8)
      << "definition '" << g.output << "': '" << g.a << "' is read with rows over the dynamic " << g.k.name()
      << ", which the CUDA backend reads from intermediates only";
  user_check(!g.k.is_dynamic() || !g.b_trans)
      << "definition '" << g.output << "': the CUDA backend reads B^T [" << g.n.name() << ", " << g.k.name()
      << "] with a static " << g.k.name() << " only";
  p.mma = t.mma;
  in_place = g.operands_in_place;
  ws = t.mma == MmaKind::wgmma_ws;
  wgmma = t.mma == MmaKind::wgmma || ws;
  internal_check(!in_place || (wgmma && g.expert_k && p.nb <= 2))
      << "in-place operands are for wgmma expert reductions of one or two B operands";
  if (wgmma && !in_place) {
    user_check(p.nb * t.tile_n / 2 <= 128)
        << "definition '" << g.output << "': " << p.nb << " B operands with tile_n " << t.tile_n << " need "
        << p.nb * t.tile_n / 2 << " accumulator registers per thread under wgmma: use tile_n " << 256 / (2 * p.nb)
        << " or less";
  }
  // B by TMA: a dense [K, N] matrix per expert (or one for all rows), or
  // its transpose [N, K] read in place (the backward's dX = dH W^T), whose
  // shape is known here; expert reductions and dynamic K stay on cp.async.
  tma = wgmma && t.tma && !in_place && !g.expert_k && !g.k.is_dynamic() && !g.n.is_dynamic();
  // An expert reduction's operands by TMA: consecutive padded rows with
  // zeros on padding (WgmmaRowsWsConfig::mainloop<A_TMA, B_TMA>); the other
  // operand, gathered where it is (gather_in_gemms, gather_upstream_in_gemms),
  // by cp.async.
  auto zero_padded = [&](const std::string &name, RowMap rows) {
    return rows == RowMap::direct && prog.tensor(name).zero_padding && prog.tensor(name).dtype == DType::bf16;
  };
  const bool rows_by_tma = in_place && ws && t.tma;
  // A B stored sorted (lowering/sorted_rows.h) runs past its expert's rows
  // into the next one's, where A's rows are zero.
  auto sorted = [&](const std::string &name) { return prog.tensor(name).layout == RowLayout::sorted; };
  // Two B operands (merge_weight_gradients): both by TMA, stored alike.
  b_tma_rows = rows_by_tma;
  for (const std::string &b : g.b)
    b_tma_rows = b_tma_rows && (zero_padded(b, g.b_rows) || (sorted(b) && g.b_rows == RowMap::direct));
  p.a_sorted = sorted(g.a);
  p.b_sorted = sorted(g.b[0]);
  for (const std::string &b : g.b)
    internal_check(sorted(b) == p.b_sorted)
        << g.name << ": B operands '" << g.b[0] << "' and '" << b << "' stored in different row layouts";
  user_check(!in_place || p.nb == 1 || b_tma_rows)
      << "definition '" << g.output << "': an expert reduction with " << p.nb << " B operands "
      << "(merge_weight_gradients) reads them by TMA in the warp-specialised loop: add mma(\"" << g.func
      << "\", wgmma_ws) and tma(\"" << g.func << "\", true) with padded_elementwise(true), or drop "
      << "merge_weight_gradients";
  internal_check(!g.expert_k || !sorted(g.b[0]) || b_tma_rows)
      << g.name << ": an expert reduction reads '" << g.b[0] << "', stored sorted, by TMA only (sorted_rows.h)";
  p.k_unpadded = g.expert_k && p.a_sorted;
  internal_check(!p.k_unpadded || (b_tma_rows && p.b_sorted && g.a_rows == RowMap::direct))
      << g.name << ": an expert reduction reads '" << g.a << "', stored sorted, by TMA over a B stored sorted only "
      << "(sorted_rows.h)";
  // A when each expert's segment is whole boxes of 64 rows too (nothing
  // else zeroes rows of the next segment that a box would read), or when
  // both operands are sorted (the loop zeroes A's rows past the expert).
  a_tma_rows = rows_by_tma && ((zero_padded(g.a, g.a_rows) && g.block % 64 == 0) || p.k_unpadded);
  // A by TMA too when its rows are consecutive (tile order, or a dense A).
  a_tma = tma && g.a_rows == RowMap::direct;
  internal_check(!tma || (prog.tensor(g.a).dtype == DType::bf16 && prog.tensor(g.b[0]).dtype == DType::bf16))
      << "GEMM operands are bf16 (lowering converts them)";
  // Persistent blocks (warp-specialised GEMMs, expert reductions in place
  // included, whichever way their operands load): a loop over the tiles.
  persistent = t.persistent && (!g.expert_k || (in_place && ws));
  internal_check(!persistent || ws) << "definition '" << g.output << "': persistent without wgmma_ws "
                                    << "(Schedule::validate rejects it)";
  // Split-K: a dense GEMM over a dynamic K (the tokens: the router's weight
  // gradient x^T d_logits) has a handful of output tiles and a long K, so a
  // block per tile left most SMs idle. The grid's y slices K into runs of
  // whole k-tiles; each slice adds its partial sums into the f32 output,
  // which the runtime zeroes first. Only for a plain accumulator epilogue,
  // which is linear in the partial sums, and B as [K, N] (B^T's rows are K
  // long, which the loops take from K, here the slice's length).
  p.split_k = !g.route && !g.expert_k && !in_place && !g.b_trans && g.k.is_dynamic() && !t.persistent &&
              t.cluster_m == 1 && p.nb == 1 && g.extra.empty() && prog.tensor(g.output).dtype == DType::f32 &&
              g.epilogue.as<Access>() && g.epilogue.as<Access>()->func == g.accumulators[0] && !g.chained;
  // Two blocks per cluster sharing B (row tiles 2m, 2m + 1 of one expert).
  cluster = t.cluster_m == 2 && !g.expert_k && !in_place;
  user_check(!cluster || (ws && tma && !g.b_trans && !g.k.is_dynamic()))
      << "definition '" << g.output << "': clusters of two row tiles multicast TMA loads from the warp-specialised "
      << "loop: add mma(\"" << g.output << "\", wgmma_ws) and tma(\"" << g.output << "\", true), or drop cluster";
  // Persistent clusters: the pair walks (pair of row tiles, column tile)
  // items together (WgmmaWsConfig::pair_ring).
  pair_items = persistent && cluster;
  // Routed pairs: consecutive routing tiles (block = tile_m; they share B
  // when one expert holds both), or the two halves of one routing tile
  // (block = 2 tile_m: always one expert, every pair shares).
  user_check(!cluster || !g.route || g.block == t.tile_m || g.block == 2 * t.tile_m)
      << "definition '" << g.output << "': clusters of two row tiles need the routing block (" << g.block
      << ") to be tile_m or twice it, not tile_m " << t.tile_m << ": set tile(\"" << g.output << "\", " << g.block
      << ", ...), block(" << 2 * t.tile_m << ") or drop cluster";
  // A window of the route's tiles: tile ids from a list, one block or one
  // persistent walk over the window's tiles.
  p.windowed = g.windowed;
  internal_check(!p.windowed || (g.route && !g.expert_k)) << g.name << ": a tile window is for routed row tiles";
  user_check(!p.windowed || !cluster)
      << "definition '" << g.func << "': exchange_chunks runs the expert GEMMs over one group of experts' tiles at a "
      << "time, which the two-block clusters' pairs of tiles do not follow yet: drop cluster(\"" << g.func
      << "\", 2) or use exchange_chunks(1)";
  // A chained product: its A and B come through maps of their own, loaded
  // after the first product's k-tiles into the same ring.
  p.chained = g.chained.has_value();
  user_check(!p.chained || (ws && tma && a_tma && !cluster && p.nb == 1 && !g.chained->k.is_dynamic()))
      << "definition '" << g.func << "': chain_summed_gemms runs its two products (" << g.a << " x " << g.b[0] << ", "
      << (p.chained ? g.chained->a + " x " + g.chained->b : "") << ") in the warp-specialised loop with TMA "
      << "operands, A in tile order: add mma(\"" << g.func << "\", wgmma_ws) and tma(\"" << g.func
      << "\", true) with padded_elementwise(true) (or the blocked permutation), drop cluster, or drop "
      << "chain_summed_gemms";
  if (p.chained)
    check_multiple_of_8(g, g.chained->k, "chained reduced");

  // ---- the epilogue
  std::vector<std::pair<std::string, Expr>> outputs{{g.output, g.epilogue}};
  for (const GemmStep::Extra &e : g.extra)
    outputs.emplace_back(e.output, e.value);
  for (const auto &[name, value] : outputs)
    p.reads_row |= uses_var(value, g.row_var, g.accumulators); // the accumulators are registers
  // Latency trims that cost registers, for tiles whose accumulators leave
  // room (under 128 per thread; SwiGLU's 2 x 128-wide tile spills with them):
  // the epilogue's rows through sorted_pair are loaded before the main loop,
  // which hides their latency, and a persistent block's consumers skip the
  // producer's A row lookups, which they would otherwise wait for per tile.
  p.roomy = !wgmma || p.nb * t.tile_n / 2 < 128;
  // A routed tile's rows below `rows` are all real pairs, so an epilogue
  // that stores in tile order and never reads the pair index (h = gelu(acc),
  // say) needs no sorted_pair lookup: it was a dependent load per tile.
  p.pair_rows = g.out_rows != RowMap::direct || p.reads_row;
  bool sorted_output = sorted(g.output);
  for (const GemmStep::Extra &e : g.extra) {
    p.pair_rows |= prog.tensor(e.output).layout != RowLayout::padded && !sorted(e.output);
    sorted_output |= sorted(e.output);
  }
  p.prefetch_rows = g.route && !g.expert_k && !in_place && p.roomy && p.pair_rows;
  // The output tile through TMA (GemmTiling::tma_store): a bf16 output in
  // tile order with no pair lookups, staged in the ring, which a block per
  // tile no longer needs once its main loop is done, or (persistent blocks,
  // whose producer is filling the ring with the next tile) in a buffer of
  // its own past the ring, whose copy then overlaps the next main loop.
  // Persistent clusters (pair items) too: each block stages past its own
  // ring, as a persistent block does. A cluster per pair of row tiles (not
  // persistent) keeps plain stores, untested there.
  // Persistent expert reductions too (a bf16 weight gradient [E, M, N], the
  // expert the map's third coordinate): their tiles are short in K, so the
  // stores, which their consumers otherwise waited for, were a tenth of a
  // tile.
  // Fused outputs too (SwiGLU's h_silu_in, h_rhs and h), each through its
  // own map: all bf16 in tile order. A zero-padded one (read by TMA later)
  // gets its padding rows' zeros from the staged tile, whose rows past
  // `rows` are staged as 0, so every box of the tile is stored; that needs
  // the tile to be one routing block, as the plain stores' zeroing does.
  bool outputs_bf16 = true;
  for (const auto &[name, value] : outputs) {
    outputs_bf16 &= prog.tensor(name).dtype == DType::bf16;
    p.zero_rows |= g.route && !g.expert_k && prog.tensor(name).zero_padding;
  }
  // Shared memory: the stages, then (all but mma.sync) alignment slack,
  // the stages' barriers and a persistent block's tile-id ring
  // (WgmmaWsConfig::ring); a persistent TMA store's staging comes on top.
  p.stage_bytes = t.ring_bytes(p.nb);
  p.ring_bytes = p.stage_bytes + (wgmma ? 1024 : 0) + (ws || tma ? 16 * t.stages : 0) + (persistent ? 48 : 0);
  // A block per tile stages every output at once in its idle ring.
  const bool staging_fits = persistent || static_cast<int>(outputs.size()) * t.tile_m * t.tile_n * 2 <= p.stage_bytes;
  out_tma = t.tma_store && !g.out_add && (tma || (g.expert_k && persistent)) && (!cluster || pair_items) &&
            outputs_bf16 && (g.extra.empty() || !g.expert_k || p.nb > 1) && staging_fits &&
            (!p.zero_rows || (g.block == t.tile_m && t.cluster_m == 1)) &&
            (!g.route || g.expert_k || (g.out_rows == RowMap::direct && !p.pair_rows)) &&
            !sorted_output; // a tile's box would store its padding rows over the next expert's
  // A persistent block stages its output tile past the ring: whole if that
  // fits beside the stages, else in halves (TmaStoreTile's W), so that the
  // ring keeps its depth (3 stages instead of 4 slowed mixtral's weight
  // gradients by 8 %, more than the stores had cost).
  p.staged_cols =
      persistent && out_tma && p.ring_bytes + t.tile_m * t.tile_n * 2 > Schedule::max_shared_bytes && t.tile_n >= 128
          ? t.tile_n / 2
          : t.tile_n;
  p.staging_bytes = persistent && out_tma ? t.tile_m * p.staged_cols * 2 : 0;
  // 8-byte (bf16) or 16-byte (f32) stores under wgmma (its accumulator
  // columns: ni * 8 + 2 (lane & 3)), for every output alike.
  wide_stores = !out_tma && !p.split_k && wgmma && t.tile_n % 16 == 0;
  for (const auto &[name, value] : outputs)
    wide_stores &= prog.tensor(name).dtype == DType::bf16 || prog.tensor(name).dtype == DType::f32;
  auto load = [](bool rows, bool rows_by_tma, bool by_tma) {
    return rows ? (rows_by_tma ? OperandLoad::rows_tma : OperandLoad::rows_cp_async)
                : (by_tma ? OperandLoad::tma : OperandLoad::cp_async);
  };
  p.a_load = load(in_place, a_tma_rows, a_tma);
  p.b_load = load(in_place, b_tma_rows, tma);
  p.walk = pair_items   ? TileWalk::persistent_pairs
           : persistent ? TileWalk::persistent
           : cluster    ? TileWalk::cluster_pairs
                        : TileWalk::per_tile;
  p.store = out_tma ? TileStore::tma : wide_stores ? TileStore::wide : TileStore::plain;
  // The narrow tail: the warp-specialised walks (a block per tile,
  // persistent; an expert reduction's in its TMA or persistent form) choose
  // per tile between the whole tile's wgmmas and the half-width ones, with
  // one B operand; a cluster's pair shares its B stages whole.
  const int64_t n_extent = g.n.extent();
  const int tail_cols = n_extent > 0 ? static_cast<int>(n_extent % t.tile_n) : 0;
  const bool tail_is_narrow = tail_cols > 0 && tail_cols <= t.tile_n / 2;
  const bool walk_halves =
      ws && p.nb == 1 && t.tile_n >= 128 && !cluster && (!in_place || a_tma_rows || b_tma_rows || persistent);
  p.narrow_tail = t.narrow_tail && tail_is_narrow && walk_halves;
  if (in_place) {
    user_check(t.tile_k == 64) << "definition '" << g.output << "': the wgmma expert reduction needs tile_k 64";
  }
  p.threads = wgmma ? t.tile_m * 2 + (ws ? 128 : 0) : t.threads();
  // Two blocks per SM when both fit (shared memory, and at most 64
  // accumulators per thread so registers do): one block's epilogue and
  // prologue then overlap the other's main loop. The warp-specialised kernel
  // keeps one block, its producer and consumers under one register cap:
  // ptxas compiles code to setmaxnreg's count only where no path under
  // another count joins it, and the generated walks share their tile loop
  // between the roles (a consumer path needing 200 registers, 384 threads:
  // none spilled with the producer's path leaving at the split, 2.2 KB with
  // one loop after it; sm_90a, CUDA 13).
  p.min_blocks =
      wgmma && !ws && 2 * p.shared_bytes() <= Schedule::max_shared_bytes && p.nb * t.tile_n / 2 <= 64 ? 2 : 1;
  user_check(p.shared_bytes() <= Schedule::max_shared_bytes)
      << "definition '" << g.output << "': " << p.nb << " B operands with tile " << t.tile_m << "x" << t.tile_n << "x"
      << t.tile_k << " and " << t.stages << " stages need " << p.shared_bytes() << " bytes of shared memory, over "
      << Schedule::max_shared_bytes << ": use fewer stages or a smaller tile";

  // ---- named choices the plan could not take, each with the first reason
  const std::string f = "\"" + g.func + "\"";
  auto first = [](std::initializer_list<std::pair<bool, std::string>> reasons) -> std::string {
    for (const auto &[holds, why] : reasons)
      if (holds)
        return why;
    return "it does not fit this GEMM's loop";
  };
  if (t.named.tma && !tma && !b_tma_rows && !a_tma_rows)
    p.not_applied.push_back(
        "tma(" + f + ", true) is not applied: " +
        first({{!wgmma, "TMA loads feed the wgmma main loops, and this GEMM runs mma.sync"},
               {!g.expert_k && g.k.is_dynamic(),
                "its reduction runs over a run-time extent, which the TMA boxes are not made for"},
               {g.expert_k && !in_place, "an expert reduction reads its operands by TMA only in place"},
               {g.expert_k && !ws, "an expert reduction's TMA loads come from the warp-specialised loop (wgmma_ws)"},
               {g.expert_k && p.nb > 2, "an expert reduction's TMA loads take one or two B operands"},
               {g.expert_k,
                "an expert reduction reads an operand by TMA where it is zero-padded bf16 rows in the padded order "
                "(A's segments whole 64-row boxes too), which neither '" +
                    g.a + "' nor '" + g.b[0] +
                    "' is (padded_elementwise(true) and bf16_activations(true) make them so)"}}));
  if (t.named.persistent && !persistent)
    p.not_applied.push_back("persistent(" + f +
                            ", true) is not applied: a persistent expert reduction reads its operands in place "
                            "from the warp-specialised loop (mma(" +
                            f + ", wgmma_ws))");
  if (t.named.warps && wgmma)
    p.not_applied.push_back("warps(" + f + ", " + std::to_string(t.warps_m) + ", " + std::to_string(t.warps_n) +
                            ") is not applied: the " + mma_name(p.mma) +
                            " loop lays its warps out itself (a warpgroup per 64 rows of the tile); warps() shapes "
                            "mma_sync tiles");
  if (t.named.cluster && !cluster)
    p.not_applied.push_back("cluster(" + f +
                            ", 2) is not applied: an expert reduction (K over one expert's rows) "
                            "runs without clusters");
  if (t.named.narrow_tail && t.narrow_tail && !p.narrow_tail)
    p.not_applied.push_back(
        "narrow_tail(" + f + ", true) is not applied: " +
        first({{n_extent <= 0, "its columns are known at run time only"},
               {!tail_is_narrow, "its last column tile is full or more than half full (N = " +
                                     std::to_string(n_extent) + ", tile_n " + std::to_string(t.tile_n) + ")"},
               {!ws, "the half-width wgmmas come from the warp-specialised loop (mma(" + f + ", wgmma_ws))"},
               {p.nb != 1, "it has " + std::to_string(p.nb) + " B operands, whose wgmmas run as one"},
               {t.tile_n < 128, "its tile is 64 columns wide, the narrowest wgmma tile moeforge runs"},
               {cluster, "a cluster's pair of blocks shares its B stages whole"}}));
  if (t.named.tma_store && !out_tma)
    p.not_applied.push_back(
        "tma_store(" + f + ", true) is not applied: " +
        first(
            {{g.out_add, "its output is added into each pair's token row (atomic_combine), which a TMA store of a "
                         "tile cannot do"},
             {!(tma || (g.expert_k && persistent)),
              g.expert_k ? "an expert reduction's TMA store comes with persistent blocks (persistent(" + f + ", true))"
                         : "TMA stores come with TMA loads (tma(" + f + ", true) on the wgmma loop)"},
             {cluster && !pair_items, "in clusters, TMA stores come with persistent blocks (persistent(" + f +
                                          ", true)); a cluster per pair of row tiles keeps plain stores"},
             {!outputs_bf16, "an output is not bf16"},
             {!g.extra.empty() && g.expert_k && p.nb == 1, "an expert reduction with fused outputs keeps plain stores"},
             {!staging_fits, "its outputs' tiles do not fit the idle ring of stages, where a block per tile "
                             "stages them"},
             {p.zero_rows && !(g.block == t.tile_m && t.cluster_m == 1),
              "a zero-padded output needs tile_m equal to the routing block"},
             {g.route && !g.expert_k && !(g.out_rows == RowMap::direct && !p.pair_rows),
              "its rows are stored in pair order, through sorted_pair, which a TMA tile cannot follow "
              "(padded_elementwise(true) keeps per-pair outputs in tile order)"}}));
  return p;
}

std::string describe(const GemmPlan &p, const GemmStep &g, bool notes) {
  const GemmTiling &t = p.tiling;
  std::ostringstream o;
  o << "gemm " << g.name << " (" << g.output << (g.func.empty() || g.func == g.output ? "" : ", schedule of " + g.func)
    << ")\n";
  o << "  tile " << t.tile_m << "x" << t.tile_n << "x" << t.tile_k << ", " << t.stages << " stages, " << p.nb
    << " B operand" << (p.nb > 1 ? "s" : "") << "; main loop " << mma_name(p.mma)
    << (p.split_k ? ", split-K over the grid's y" : "")
    << (p.narrow_tail
            ? ", the last column tile (" + std::to_string(g.n.extent() % t.tile_n) + " columns) by m64n" +
                  std::to_string(narrow_width(t.tile_n, static_cast<int>(g.n.extent() % t.tile_n))) + " wgmmas"
            : "")
    << "\n";
  auto a_how = [&] {
    if (p.in_place())
      return !p.a_tma_rows() ? "rows in place by cp.async"
             : p.k_unpadded  ? "sorted rows (no padding) by TMA, zeroed past the expert's in the last k-tile"
                             : "padded rows by TMA";
    if (p.a_tma())
      return p.a_sorted ? "rows in tile order by TMA, stored sorted (no padding)" : "rows in tile order by TMA";
    return g.a_rows == RowMap::direct ? "rows by cp.async" : "rows gathered through sorted_pair by cp.async";
  };
  auto b_how = [&] {
    if (p.in_place())
      return !p.b_tma_rows() ? "rows in place by cp.async"
             : p.b_sorted    ? "sorted rows (no padding) by TMA"
                             : "padded rows by TMA";
    return p.tma() ? (g.b_trans ? "B^T [N, K] in place by TMA" : "by TMA") : "by cp.async";
  };
  o << "  A " << g.a << ": " << a_how() << "; B " << g.b[0];
  for (size_t i = 1; i < g.b.size(); ++i)
    o << ", " << g.b[i];
  o << ": " << b_how() << (p.cluster() ? ", multicast to a 2-block cluster" : "") << "\n";
  if (p.chained)
    o << "  then A2 " << g.chained->a << " x B2 " << g.chained->b << " (K2 = " << g.chained->k.name()
      << ") into the same accumulator\n";
  o << "  walk: "
    << (p.pair_items()   ? "persistent 2-block clusters over (row-tile pair, column tile) items"
        : p.persistent() ? "persistent blocks drawing tiles from a counter"
        : p.cluster()    ? "a 2-block cluster per pair of row tiles"
                         : "a block per output tile")
    << (p.windowed ? " of a window of the route's tiles" : "") << ", raster " << t.raster << "\n";
  o << "  epilogue: " << (p.out_tma() ? "staged in shared memory, stored by TMA" : "plain stores")
    << (p.out_tma() && p.persistent() ? " (" + std::to_string(p.staged_cols) + " columns at a time)" : "")
    << (p.wide_stores() ? ", 8/16-byte" : "") << (g.out_add ? ", added atomically into the tokens' rows" : "")
    << (p.pair_rows ? ", rows through sorted_pair" : "") << (p.prefetch_rows ? " (looked up before the main loop)" : "")
    << (p.zero_rows ? ", padding rows zeroed" : "") << "; outputs " << g.output;
  for (const GemmStep::Extra &e : g.extra)
    o << ", " << e.output << (e.row_sum ? " (row sum)" : "");
  o << "\n";
  for (const std::string &n : notes ? p.not_applied : std::vector<std::string>{})
    o << "  note: " << n << "\n";
  o << "  resources: " << p.threads << " threads, shared " << p.shared_bytes() << " bytes (stages " << p.stage_bytes
    << ", ring " << p.ring_bytes - p.stage_bytes << ", staging " << p.staging_bytes << "), " << p.min_blocks << " block"
    << (p.min_blocks > 1 ? "s" : "") << " per SM\n";
  return o.str();
}

void plan_gemms(KernelProgram &prog) {
  for (Step &s : prog.steps)
    if (auto *g = std::get_if<GemmStep>(&s)) {
      g->plan.reset();
      g->plan_refusal.clear();
      try {
        g->plan = std::make_shared<const GemmPlan>(plan_gemm(prog, *g));
      } catch (const UserError &e) {
        g->plan_refusal = e.what(); // the CUDA target cannot run it (the CPU backend may)
      }
    }
}

const GemmPlan &planned(const GemmStep &g) {
  user_check(g.plan_refusal.empty()) << g.plan_refusal;
  internal_check(g.plan != nullptr) << "GEMM step " << g.name << " has no plan: plan_gemms did not run on its program";
  return *g.plan;
}

std::vector<std::string> not_applied_choices(const KernelProgram &prog) {
  std::vector<std::string> out;
  for (const Step &s : prog.steps) {
    const auto *g = std::get_if<GemmStep>(&s);
    if (!g || !g->plan)
      continue; // refused by the CUDA target (the CPU backend may run it): the CUDA backend says why
    for (const std::string &n : g->plan->not_applied) {
      const std::string line = "definition '" + func_of(*g) + "': " + n;
      if (std::find(out.begin(), out.end(), line) == out.end())
        out.push_back(line);
    }
  }
  out.insert(out.end(), prog.not_applied.begin(), prog.not_applied.end());
  return out;
}

std::string describe_gemm_plans(const KernelProgram &prog, bool notes) {
  std::string out;
  for (const Step &s : prog.steps)
    if (const auto *g = std::get_if<GemmStep>(&s))
      out += describe(planned(*g), *g, notes);
  return out;
}

} // namespace moeforge
