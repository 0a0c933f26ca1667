#include "backends/cpu/llvm_emit_steps.h"

namespace moeforge::cpu {

void emit_gemm(const KernelProgram &prog, const GemmStep &g, FunctionBuilder &fb) {
  auto &b = fb.b;
  // K and N may be dynamic (d_wr = x^T d_logits reduces over the tokens;
  // attention's scores q k^T have a column per token): the accumulators hold
  // one block of TN columns, the schedule's tile_n (or a static N below it).
  Value *N = fb.extent(g.n);
  const int nb = static_cast<int>(g.b.size());
  // Columns in blocks of the schedule's tile_n: the accumulators of one row
  // block stay in L1 while K streams through; the last block may be partial
  // (an untiled N such as 72 with tile_n 64).
  const int64_t TN = g.n.is_dynamic() ? g.tiling.tile_n : std::min<int64_t>(g.tiling.tile_n, g.n.extent());
  const TensorDecl &A = prog.tensor(g.a), &C = prog.tensor(g.output);
  std::vector<const TensorDecl *> B;
  for (const std::string &name : g.b)
    B.push_back(&prog.tensor(name));
  std::vector<Value *> acc;
  for (int i = 0; i < nb; ++i)
    acc.push_back(fb.alloca_f32(TN, "acc" + std::to_string(i)));
  internal_check(!g.b_trans || !g.expert_k) << "an expert reduction's B is never transposed";
  internal_check(!g.chained || (nb == 1 && !g.expert_k)) << "a chained product is for single-B GEMMs";
  // The B operands `update` reads: the GEMM's own, or its chained
  // product's while that one's loop is emitted (GemmStep::chained). A
  // transposed B has a loop of its own (a dot product per column, below).

  // One output row of C, stored at row `out_row`, the epilogue's row index
  // being `row_index`: N in blocks of TN; accumulate(n0, update) calls
  // update(i, b_row, a) once per k: acc_i[j] += a * B_i[b_row + j].
  using Update = std::function<void(int i, Value *b_row, Value *a)>;
  // p_row: the row in tile order, where a fused output in the padded layout
  // goes (a pair-order one goes to row_index, a sorted one to s_row: p_row
  // less the padding before the tile's expert; null where none is sorted).
  auto columns = [&](Value *out_row, Value *row_index, Value *p_row, Value *s_row,
                     const std::function<void(Value * n0, Value * width, const Update &)> &accumulate) {
    fb.for_loop(
        fb.c64(0), N, "n0",
        [&](Value *n0) {
          Value *width =
              b.CreateSelect(b.CreateICmpSLT(b.CreateSub(N, n0), fb.c64(TN)), b.CreateSub(N, n0), fb.c64(TN), "width");
          for (int i = 0; i < nb; ++i)
            fb.for_loop(fb.c64(0), width, "zero",
                        [&](Value *j) { b.CreateStore(fb.cf(0.0), b.CreateGEP(fb.f32(), acc[i], j)); });
          // acc[i][j] += a * B_i[b_row + j] for the columns of this block.
          accumulate(n0, width, [&](int i, Value *b_row, Value *a) {
            fb.for_loop(fb.c64(0), width, "j", [&](Value *j) {
              Value *slot = b.CreateGEP(fb.f32(), acc[i], j);
              // b_row: B[k, n0] (row-major [K, N]).
              Value *at = b.CreateAdd(b_row, j);
              Value *prod = b.CreateFMul(a, fb.load(*B[i], at));
              b.CreateStore(b.CreateFAdd(b.CreateLoad(fb.f32(), slot), prod), slot);
            });
          });
          // The epilogue, per element, in f32; stored as C's dtype.
          fb.for_loop(fb.c64(0), width, "epi", [&](Value *j) {
            ExprEmitter em(prog, fb, g.name);
            Value *col = b.CreateAdd(n0, j);
            em.vars[g.row_var.get()] = row_index;
            em.vars[g.col_var.get()] = col;
            for (int i = 0; i < nb; ++i)
              em.registers[g.accumulators[i].get()] = b.CreateLoad(fb.f32(), b.CreateGEP(fb.f32(), acc[i], j));
            Value *v = em.emit(g.epilogue);
            Value *at = b.CreateAdd(b.CreateMul(out_row, N), col);
            // out_add: the pair's share of its token's combine, rounded to
            // C's dtype at each addition as the GPU's atomic adds are.
            fb.store(C, at, g.out_add ? b.CreateFAdd(fb.load(C, at), v) : v);
            for (const GemmStep::Extra &x : g.extra) { // fused element-wise outputs
              const TensorDecl &t = prog.tensor(x.output);
              internal_check(t.layout != RowLayout::sorted || s_row) << g.name << ": '" << t.name << "' is sorted";
              // An expert reduction's further output (a second B's weight
              // gradient) is a matrix per expert, as its own output is.
              Value *at = g.expert_k                                  ? out_row
                          : !g.route || t.layout == RowLayout::padded ? p_row
                          : t.layout == RowLayout::sorted             ? s_row
                                                                      : row_index;
              fb.store(t, b.CreateAdd(b.CreateMul(at, N), col), em.emit(x.value));
            }
          });
        },
        TN);
  };

  if (g.expert_k) {
    // C[e, m, n] = sum over e's padded segment [offsets[e], offsets[e+1]) of
    // A^T[m, p] * B[p, n]; both operands are zero on padding rows, and an
    // expert with no rows gets zeros.
    const RoutingNode *rt = g.route;
    if (g.operands_in_place) {
      // A and B read where they are: row(p) of each through its row map,
      // padding rows (sorted_pair[p] < 0) skipped.
      Value *M = fb.extent(g.m);
      auto row_of = [&](RowMap m, Value *p, Value *r) -> Value * {
        return m == RowMap::direct ? p : m == RowMap::gather_pair ? r : b.CreateSDiv(r, fb.c64(rt->k));
      };
      // A or B stored sorted (lowering/sorted_rows.h): its rows without the
      // padding before expert e.
      const bool a_sorted = A.layout == RowLayout::sorted, b_sorted = B[0]->layout == RowLayout::sorted;
      internal_check(!b_sorted || g.b_rows == RowMap::direct) << g.name << ": a sorted B is read in tile order";
      for (const TensorDecl *bi : B) // two B operands (merge_weight_gradients) are stored alike
        internal_check((bi->layout == RowLayout::sorted) == b_sorted)
            << g.name << ": B operands '" << B[0]->name << "' and '" << bi->name << "' in different row layouts";
      internal_check(!a_sorted || g.a_rows == RowMap::direct) << g.name << ": a sorted A is read in tile order";
      // Experts in parallel: each writes its own C[e].
      fb.parallel_for(fb.c64(0), fb.c64(rt->expert_dim().extent()), "e", [&](Value *e) {
        Value *p0 = fb.route_at(rt, RoutingArray::offsets, e);
        Value *p1 = fb.route_at(rt, RoutingArray::offsets, b.CreateAdd(e, fb.c64(1)));
        Value *shift =
            a_sorted || b_sorted ? b.CreateSub(p0, fb.route_at(rt, RoutingArray::offsets_unpadded, e)) : nullptr;
        fb.for_loop(fb.c64(0), M, "m", [&](Value *m) {
          columns(b.CreateAdd(b.CreateMul(e, M), m), m, m, nullptr, [&](Value *n0, Value *, const Update &update) {
            fb.for_loop(p0, p1, "p", [&](Value *p) {
              Value *r = fb.route_at(rt, RoutingArray::sorted_pair, p);
              fb.if_then(b.CreateICmpSGE(r, fb.c64(0)), [&] {
                Value *a_row = a_sorted ? b.CreateSub(p, shift) : row_of(g.a_rows, p, r);
                Value *a = fb.load(A, b.CreateAdd(b.CreateMul(a_row, M), m));
                Value *b_row = b_sorted ? b.CreateSub(p, shift) : row_of(g.b_rows, p, r);
                for (int i = 0; i < nb; ++i)
                  update(i, b.CreateAdd(b.CreateMul(b_row, N), n0), a);
              });
            });
          });
        });
      });
      return;
    }
    internal_check(A.layout == RowLayout::padded_t && B[0]->layout == RowLayout::padded && nb == 1)
        << "step " << g.name << ": an expert reduction reads A^T (padded_t) and B (padded)";
    Value *stride = fb.max_padded_rows(rt), *M = fb.extent(g.m);
    fb.parallel_for(fb.c64(0), fb.c64(rt->expert_dim().extent()), "e", [&](Value *e) {
      Value *p0 = fb.route_at(rt, RoutingArray::offsets, e);
      Value *p1 = fb.route_at(rt, RoutingArray::offsets, b.CreateAdd(e, fb.c64(1)));
      fb.for_loop(fb.c64(0), M, "m", [&](Value *m) {
        Value *a_base = b.CreateMul(m, stride);
        columns(b.CreateAdd(b.CreateMul(e, M), m), m, m, nullptr, [&](Value *n0, Value *, const Update &update) {
          fb.for_loop(p0, p1, "p", [&](Value *p) {
            Value *a = fb.load(A, b.CreateAdd(a_base, p));
            update(0, b.CreateAdd(b.CreateMul(p, N), n0), a);
          });
        });
      });
    });
    return;
  }

  // The products summed into the accumulators: A B, then A2 B2 where chained.
  struct Product {
    const TensorDecl *a;
    std::vector<const TensorDecl *> b;
    Value *k;
  };
  std::vector<Product> products{{&A, B, fb.extent(g.k)}};
  if (g.chained)
    products.push_back({&prog.tensor(g.chained->a), {&prog.tensor(g.chained->b)}, fb.extent(g.chained->k)});
  // One output row: p is the row in tile order (padded position, or m when
  // dense), r the pair (or m), expert the B slice.
  // Tensors stored sorted (lowering/sorted_rows.h) that the GEMM reads as A
  // (or A2) or writes as a further output: row p of the tile order is row
  // p - offsets[e] + offsets_unpadded[e] there.
  bool any_sorted = A.layout == RowLayout::sorted || C.layout == RowLayout::sorted ||
                    (g.chained && prog.tensor(g.chained->a).layout == RowLayout::sorted);
  for (const GemmStep::Extra &x : g.extra)
    any_sorted |= prog.tensor(x.output).layout == RowLayout::sorted;
  internal_check(!any_sorted ||
                 (g.route && !g.expert_k && (A.layout != RowLayout::sorted || g.a_rows == RowMap::direct) &&
                  (C.layout != RowLayout::sorted || g.out_rows == RowMap::direct)))
      << g.name << ": tensors stored sorted are a routed GEMM's A in tile order or its outputs in tile order";
  auto row = [&](Value *p, Value *r, Value *expert) {
    Value *a_row = g.a_rows == RowMap::direct        ? p
                   : g.a_rows == RowMap::gather_pair ? r
                                                     : b.CreateSDiv(r, fb.c64(g.route->k));
    Value *out_row = g.out_rows == RowMap::direct         ? p
                     : g.out_rows == RowMap::gather_token ? b.CreateSDiv(r, fb.c64(g.route->k))
                                                          : r;
    Value *s_row = any_sorted ? b.CreateAdd(b.CreateSub(p, fb.route_at(g.route, RoutingArray::offsets, expert)),
                                            fb.route_at(g.route, RoutingArray::offsets_unpadded, expert))
                              : nullptr;
    if (C.layout == RowLayout::sorted)
      out_row = s_row;
    columns(out_row, r, p, s_row, [&](Value *n0, Value *width, const Update &update) {
      for (const Product &pr : products) {
        Value *K = pr.k;
        Value *a_base = b.CreateMul(pr.a->layout == RowLayout::sorted ? s_row : a_row, K);
        Value *b_base = g.b_per_expert ? b.CreateMul(expert, b.CreateMul(K, N)) : fb.c64(0);
        B = pr.b;
        if (g.b_trans) {
          // B read in place transposed ([N, K]): column n0 + j is a row of B,
          // contiguous in k. Each column is a dot product along k (its sum
          // in ascending k, as before), eight columns at a time so that
          // eight independent sums are in flight: one sum alone waits on
          // its previous add at every k, and k outermost over all columns
          // would touch `width` rows of B K apart at every step.
          constexpr int kCols = 8;
          Value *full = b.CreateMul(b.CreateSDiv(width, fb.c64(kCols)), fb.c64(kCols));
          // The sums live in scalar allocas, which mem2reg makes registers
          // (a slot of the accumulator array, indexed by j, stays memory).
          std::vector<Value *> sums;
          for (int u = 0; u < kCols; ++u)
            sums.push_back(fb.alloca_f32(1, "dot" + std::to_string(u)));
          auto dot = [&](Value *j0, int cols) {
            for (int i = 0; i < nb; ++i) {
              std::vector<Value *> slot, b_col;
              for (int u = 0; u < cols; ++u) {
                Value *j = b.CreateAdd(j0, fb.c64(u));
                slot.push_back(b.CreateGEP(fb.f32(), acc[i], j));
                b_col.push_back(b.CreateAdd(b_base, b.CreateMul(b.CreateAdd(n0, j), K)));
                b.CreateStore(b.CreateLoad(fb.f32(), slot[u]), sums[u]);
              }
              // Reassociation lets LLVM vectorize the sums along k (partial
              // sums per lane, added at the end): the order differs from a
              // plain loop's by rounding only, as the GPU's tiles do.
              llvm::IRBuilderBase::FastMathFlagGuard guard(b);
              llvm::FastMathFlags reassoc;
              reassoc.setAllowReassoc();
              b.setFastMathFlags(reassoc);
              fb.for_loop(fb.c64(0), K, "kt", [&](Value *kk) {
                Value *a = fb.load(*pr.a, b.CreateAdd(a_base, kk));
                for (int u = 0; u < cols; ++u) {
                  Value *prod = b.CreateFMul(a, fb.load(*B[i], b.CreateAdd(b_col[u], kk)));
                  b.CreateStore(b.CreateFAdd(b.CreateLoad(fb.f32(), sums[u]), prod), sums[u]);
                }
              });
              for (int u = 0; u < cols; ++u)
                b.CreateStore(b.CreateLoad(fb.f32(), sums[u]), slot[u]);
            }
          };
          fb.for_loop(
              fb.c64(0), full, "jt", [&](Value *j0) { dot(j0, kCols); }, kCols);
          fb.for_loop(full, width, "jr", [&](Value *j) { dot(j, 1); });
          continue;
        }
        fb.for_loop(fb.c64(0), K, "k", [&](Value *kk) {
          Value *a = fb.load(*pr.a, b.CreateAdd(a_base, kk));
          Value *b_row = b.CreateAdd(b_base, b.CreateAdd(b.CreateMul(kk, N), n0));
          for (int i = 0; i < nb; ++i)
            update(i, b_row, a);
        });
      }
    });
  };

  if (g.route) {
    // Grouped: the used tiles of the routing table, each one expert's rows,
    // in parallel (a pair's row lies in one tile). A GEMM that adds its rows
    // into their tokens' (out_add) zeroes the output first (unless it adds
    // onto what an earlier GEMM wrote there) and walks its tiles in order:
    // two pairs of one token lie in different tiles.
    const RoutingNode *rt = g.route;
    if (g.out_add && !g.out_add_onto_written) {
      internal_check(C.dims.size() == 2) << "step " << g.name << ": an added output is [tokens, n]";
      fb.for_loop(fb.c64(0), b.CreateMul(fb.extent(C.dims[0]), fb.extent(C.dims[1])), "z",
                  [&](Value *i) { fb.store(C, i, fb.cf(0.0)); });
    }
    auto tiles = [&](Value *end, const std::string &name, const std::function<void(Value *)> &body) {
      if (g.out_add)
        fb.for_loop(fb.c64(0), end, name, body);
      else
        fb.parallel_for(fb.c64(0), end, name, body);
    };
    tiles(fb.route_scalar(rt, RoutingArray::num_tiles), "tile", [&](Value *tile) {
      Value *expert = fb.route_at(rt, RoutingArray::tile_expert, tile);
      Value *p0 = fb.route_at(rt, RoutingArray::tile_row_start, tile);
      Value *rows = fb.route_at(rt, RoutingArray::tile_rows, tile);
      fb.for_loop(fb.c64(0), rows, "lr", [&](Value *lr) {
        Value *p = b.CreateAdd(p0, lr);
        Value *r = fb.route_at(rt, RoutingArray::sorted_pair, p);
        fb.if_then(b.CreateICmpSGE(r, fb.c64(0)), [&] { row(p, r, expert); }); // padding rows: nothing to do
      });
    });
  } else {
    fb.parallel_for(fb.c64(0), fb.extent(g.m), "m", [&](Value *m) { row(m, m, fb.c64(0)); });
  }
}

} // namespace moeforge::cpu
