#include "backends/cpu/llvm_emit_steps.h"

namespace moeforge::cpu {

namespace {

// The source row of padded position p whose pair is r (r >= 0): the token
// r / k, the pair r, or p itself (a padded source).
Value *source_row(FunctionBuilder &fb, const RoutingNode *route, RowMap rows, Value *p, Value *r) {
  switch (rows) {
  case RowMap::gather_token:
    return fb.b.CreateSDiv(r, fb.c64(route->k));
  case RowMap::gather_pair:
    return r;
  case RowMap::direct:
    return p;
  }
  return nullptr;
}

} // namespace

void emit_pointwise(const KernelProgram &prog, const PointwiseStep &s, FunctionBuilder &fb) {
  auto &b = fb.b;
  const TensorDecl &out = prog.tensor(s.output);
  const Softmax *softmax = s.body.as<Softmax>();
  ExprEmitter em(prog, fb, s.name);
  std::vector<Var> loop_vars;
  for (const Var &v : s.vars)
    if (!softmax || !v.same_as(softmax->var))
      loop_vars.push_back(v);

  auto store_to = [&](const TensorDecl &t, Value *value) {
    std::vector<Value *> idx;
    for (const Var &v : s.vars)
      idx.push_back(em.vars.at(v.get()));
    fb.store(t, fb.offset(t, idx), value);
  };
  auto store = [&](Value *value) { store_to(out, value); };
  // Row sums (ExtraOutput::row_sum) add up in a register each over the last
  // index's loop and are stored after it, at the other indices.
  std::vector<Value *> sums(s.extra.size(), nullptr);
  auto inner = [&] {
    if (!softmax) {
      // Every value first, then the stores (merged siblings read no output
      // of the step, so the order only matters for what may be reused).
      std::vector<Value *> values{em.emit(s.body)};
      for (const ExtraOutput &e : s.extra)
        values.push_back(em.emit(e.value));
      store(values[0]);
      for (size_t o = 0; o < s.extra.size(); ++o) {
        if (s.extra[o].row_sum)
          b.CreateStore(b.CreateFAdd(b.CreateLoad(fb.f32(), sums[o]), values[o + 1]), sums[o]);
        else
          store_to(prog.tensor(s.extra[o].output), values[o + 1]);
      }
      return;
    }
    // softmax along v: the row's max, the sum of exponentials, then the
    // normalised values (max-subtracted, as the reference).
    Value *mx = fb.alloca_f32(1, "row_max"), *sum = fb.alloca_f32(1, "row_sum");
    b.CreateStore(llvm::ConstantFP::getInfinity(fb.f32(), /*Negative=*/true), mx);
    b.CreateStore(fb.cf(0.0), sum);
    Value *n = fb.extent(softmax->var.dim());
    auto loop = [&](const std::function<void(Value *)> &each) {
      fb.for_loop(fb.c64(0), n, "sm", [&](Value *v) {
        em.vars[softmax->var.get()] = v;
        each(em.emit(softmax->body));
      });
    };
    loop([&](Value *x) {
      b.CreateStore(b.CreateBinaryIntrinsic(llvm::Intrinsic::maxnum, b.CreateLoad(fb.f32(), mx), x), mx);
    });
    loop([&](Value *x) {
      Value *e = b.CreateUnaryIntrinsic(llvm::Intrinsic::exp, b.CreateFSub(x, b.CreateLoad(fb.f32(), mx)));
      b.CreateStore(b.CreateFAdd(b.CreateLoad(fb.f32(), sum), e), sum);
    });
    loop([&](Value *x) {
      Value *e = b.CreateUnaryIntrinsic(llvm::Intrinsic::exp, b.CreateFSub(x, b.CreateLoad(fb.f32(), mx)));
      store(b.CreateFDiv(e, b.CreateLoad(fb.f32(), sum)));
    });
  };
  // Nested loops, the first index outermost (row-major stores).
  std::function<void(size_t)> nest = [&](size_t i) {
    if (i == loop_vars.size()) {
      inner();
      return;
    }
    const bool last = i + 1 == loop_vars.size();
    for (size_t o = 0; last && o < s.extra.size(); ++o)
      if (s.extra[o].row_sum) {
        sums[o] = fb.alloca_f32(1, s.extra[o].output + "_sum");
        b.CreateStore(fb.cf(0.0), sums[o]);
      }
    auto body = [&](Value *v) {
      em.vars[loop_vars[i].get()] = v;
      nest(i + 1);
    };
    // The outermost index splits over threads: each value writes its own
    // outputs, unless a row sum runs along that very index (one index only).
    const bool split = i == 0 && !(last && std::any_of(s.extra.begin(), s.extra.end(),
                                                       [](const ExtraOutput &e) { return e.row_sum; }));
    if (split)
      fb.parallel_for(fb.c64(0), fb.extent(loop_vars[i].dim()), loop_vars[i].name(), body);
    else
      fb.for_loop(fb.c64(0), fb.extent(loop_vars[i].dim()), loop_vars[i].name(), body);
    for (size_t o = 0; last && o < s.extra.size(); ++o)
      if (s.extra[o].row_sum) {
        const TensorDecl &t = prog.tensor(s.extra[o].output);
        std::vector<Value *> idx;
        for (size_t v = 0; v + 1 < s.vars.size(); ++v)
          idx.push_back(em.vars.at(s.vars[v].get()));
        fb.store(t, fb.offset(t, idx), b.CreateLoad(fb.f32(), sums[o]));
      }
  };
  nest(0);
}

// ------------------------------------------------------------ copies into the padded order

// dst[p, :] = src[row(p), :] for p < padded_rows, zero on padding rows (a
// dst stored sorted: at the pair's sorted row, no padding rows).
void emit_gather(const KernelProgram &prog, const GatherStep &s, FunctionBuilder &fb) {
  auto &b = fb.b;
  const TensorDecl &src = prog.tensor(s.src), &dst = prog.tensor(s.dst);
  const Dim &cols = src.dims[1];
  user_check(!cols.is_dynamic()) << "step " << s.name << ": the row length " << cols.name() << " of '" << s.src
                                 << "' must be static for the CPU backend";
  const int64_t n = cols.extent(), row_bytes = n * dtype_bytes(dst.dtype);
  const bool same = src.dtype == dst.dtype;
  internal_check(src.outer_stride == 0 && dst.outer_stride == 0)
      << "step " << s.name << ": a gather copies whole rows of dense tensors";
  // A copy stored sorted (lowering/sorted_rows.h) has no padding rows.
  const bool sorted = dst.layout == RowLayout::sorted;
  Value *gsrc = fb.tensor(s.src), *gdst = fb.tensor(s.dst);
  fb.parallel_for(fb.c64(0), fb.route_scalar(s.route, RoutingArray::padded_rows), "p", [&](Value *p) { // a row each
    Value *r = fb.route_at(s.route, RoutingArray::sorted_pair, p);
    Value *is_pad = b.CreateICmpSLT(r, fb.c64(0));
    if (!sorted)
      fb.if_then(is_pad, [&] {
        Value *to = b.CreateGEP(b.getInt8Ty(), gdst, b.CreateMul(p, fb.c64(row_bytes)));
        b.CreateMemSet(to, b.getInt8(0), row_bytes, llvm::MaybeAlign(2));
      });
    fb.if_then(b.CreateNot(is_pad), [&] {
      // Pair r's row in dst's layout: p in the padded order, its sorted row.
      Value *first = fb.offset(dst, {r, fb.c64(0)});
      Value *to = b.CreateGEP(b.getInt8Ty(), gdst, b.CreateMul(first, fb.c64(dtype_bytes(dst.dtype))));
      Value *row = source_row(fb, s.route, s.rows, p, r);
      if (same) {
        Value *from = b.CreateGEP(b.getInt8Ty(), gsrc, b.CreateMul(row, fb.c64(row_bytes)));
        b.CreateMemCpy(to, llvm::MaybeAlign(2), from, llvm::MaybeAlign(2), row_bytes);
        return;
      }
      // An operand copy that changes the storage type (f32 -> bf16).
      fb.for_loop(fb.c64(0), fb.c64(n), "c", [&](Value *c) {
        fb.store(dst, b.CreateAdd(first, c), fb.load(src, b.CreateAdd(b.CreateMul(row, fb.c64(n)), c)));
      });
    });
  });
}

// ------------------------------------------------------------ transposes

void emit_transpose(const KernelProgram &prog, const TransposeStep &s, FunctionBuilder &fb) {
  auto &b = fb.b;
  const TensorDecl &src = prog.tensor(s.src), &dst = prog.tensor(s.dst);
  if (s.route) {
    // dst[c, p] = src[row(p), c] over every padded position p < max_padded_rows,
    // zero past padded_rows and on padding rows: the expert reduction's K loop
    // reads whole padded segments.
    internal_check(dst.layout == RowLayout::padded_t && src.dims.size() == 2)
        << "step " << s.name << ": a routed transpose writes a padded_t copy of a 2-D tensor";
    Value *cols = fb.extent(src.dims[1]), *stride = fb.max_padded_rows(s.route);
    Value *used = fb.route_scalar(s.route, RoutingArray::padded_rows);
    fb.for_loop(fb.c64(0), stride, "p", [&](Value *p) {
      Value *in_use = b.CreateICmpSLT(p, used);
      Value *r = b.CreateSelect(in_use, fb.route_at(s.route, RoutingArray::sorted_pair, p), fb.c64(-1));
      Value *is_pad = b.CreateICmpSLT(r, fb.c64(0));
      fb.if_then(is_pad, [&] {
        fb.for_loop(fb.c64(0), cols, "c",
                    [&](Value *c) { fb.store(dst, b.CreateAdd(b.CreateMul(c, stride), p), fb.cf(0.0)); });
      });
      fb.if_then(b.CreateNot(is_pad), [&] {
        Value *from = b.CreateMul(source_row(fb, s.route, s.rows, p, r), cols);
        fb.for_loop(fb.c64(0), cols, "c", [&](Value *c) {
          fb.store(dst, b.CreateAdd(b.CreateMul(c, stride), p), fb.load(src, b.CreateAdd(from, c)));
        });
      });
    });
    return;
  }
  // Dense: [..., R, C] -> [..., C, R], the leading dims kept.
  const size_t n = src.dims.size();
  internal_check(n >= 2 && dst.dims.size() == n && dst.dims[n - 2].same_as(src.dims[n - 1]) &&
                 dst.dims[n - 1].same_as(src.dims[n - 2]))
      << "step " << s.name << ": '" << s.dst << "' is not the transpose of '" << s.src << "'";
  Value *lead = fb.c64(1);
  for (size_t i = 0; i + 2 < n; ++i)
    lead = b.CreateMul(lead, fb.extent(src.dims[i]));
  Value *R = fb.extent(src.dims[n - 2]), *C = fb.extent(src.dims[n - 1]);
  fb.for_loop(fb.c64(0), lead, "l", [&](Value *l) {
    Value *base = b.CreateMul(l, b.CreateMul(R, C));
    fb.for_loop(fb.c64(0), R, "r", [&](Value *r) {
      fb.for_loop(fb.c64(0), C, "c", [&](Value *c) {
        Value *from = b.CreateAdd(base, b.CreateAdd(b.CreateMul(r, C), c));
        Value *to = b.CreateAdd(base, b.CreateAdd(b.CreateMul(c, R), r));
        fb.store(dst, to, fb.load(src, from));
      });
    });
  });
}

} // namespace moeforge::cpu
