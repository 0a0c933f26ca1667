// Element-wise kernels (PointwiseStep): a thread, a warp or a block per
// element as the plan says (pointwise_plan.h), eight elements a thread where
// they are consecutive, a warp per softmax row, and per-row sums riding
// along; over a route's padded row slots where the output is padded.
#include "backends/cuda/codegen/emit_common.h"

#include <algorithm>
#include <functional>
#include <map>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "backends/cuda/codegen/expr_emitter.h"
#include "dsl/error.h"
#include "dsl/printer.h"
#include "lowering/pointwise_plan.h"

namespace moeforge::cuda {

namespace {

// The row slots of a step that walks a route's pairs in padded row order
// (padded_elementwise outputs, pair-order gathers): slot q computes pair q
// and zeroes padded row q if that is padding, so there are max(P,
// max_padded_rows) of them; only a dropping route can have fewer padded
// rows than pairs.
std::string padded_slots(const KernelProgram &prog, KernelBuilder &kb, const RoutingNode *r) {
  const std::string rows = max_padded_rows(prog, kb, r);
  if (!prog.routing(r).drops())
    return rows;
  const std::string pairs = kb.extent(r->pairs);
  return "(" + rows + " > " + pairs + " ? " + rows + " : " + pairs + ")";
}

// `p_row` (a row slot) is a padding row of route r's padded layout.
std::string padding_slot(const KernelProgram &prog, KernelBuilder &kb, const RoutingNode *r) {
  const std::string padding = kb.route(r, RoutingArray::sorted_pair) + "[p_row] < 0";
  if (!prog.routing(r).drops())
    return padding;
  return "p_row < " + max_padded_rows(prog, kb, r) + " && " + padding;
}

// A thread (a warp, a block) whose element is a pair that a route dropped
// at capacity stops before computing when nothing reads what it would
// write there (dropped_rows_unread: its padded outputs' drop row, pair-order
// ones read only by the route's combines, expert sums and GEMMs): expert
// choice offers T x E pairs and keeps cf x T. Other outputs are computed
// for every pair, as the reference has them.
void skip_dropped_pairs(const KernelProgram &prog, KernelBuilder &kb,
                        const std::map<const VarNode *, std::string> &vars, const std::vector<Var> &loop_vars,
                        const std::vector<const TensorDecl *> &outputs, std::ostream &body) {
  for (const RoutingNode *r : prog.routes) {
    if (!prog.routing(r).drops())
      continue;
    bool unread = true;
    for (const TensorDecl *t : outputs)
      unread = unread && dropped_rows_unread(prog, t->name, r);
    for (const Var &v : loop_vars)
      if (unread && v.same_as(r->pair))
        body << "  if (" << kb.route(r, RoutingArray::pair_pos) << "[" << vars.at(v.get())
             << "] == " << max_padded_rows(prog, kb, r)
             << " - 1) return;  // dropped at capacity: nothing reads what it would write\n";
  }
}

// A softmax row whose extent is static and at most this many columns per lane
// times 32 is held in registers: each element is read (its body evaluated)
// once instead of once per pass.
constexpr long long kSoftmaxRegisterColumns = 8;

// softmax(v, body) over one row, computed by a warp: lane l takes columns l,
// l + 32, ... (coalesced reads and writes), the row's max and sum of
// exponentials are warp reductions, then each lane writes its columns.
// `store(value)` writes the element at the column in em.vars[v].
void emit_softmax_row(ExprEmitter &em, KernelBuilder &kb, const Softmax &sm,
                      const std::function<void(const std::string &)> &store) {
  std::ostringstream &body = em.out();
  std::string v = "v_" + c_name(sm.var.name()), n = kb.extent(sm.var.dim());
  em.vars[sm.var.get()] = v;
  const Dim &d = sm.var.dim();
  if (!d.is_dynamic() && d.extent() <= 32 * kSoftmaxRegisterColumns) {
    const long long cols = (d.extent() + 31) / 32;
    // Per lane: xs[ci] = body at column lane + 32 ci, then its exponential.
    auto columns = [&](const std::function<void()> &each) {
      body << "#pragma unroll\n  for (int ci = 0; ci < " << cols << "; ++ci) {\n";
      body << "    const long long " << v << " = lane + 32LL * ci;\n";
      body << "    if (" << v << " >= " << n << ") continue;  // past the row\n";
      em.indent() += 2;
      each();
      em.indent() -= 2;
      body << "  }\n";
    };
    body << "  float xs[" << cols << "];  // this lane's columns of the row\n";
    body << "  float row_max = -mf::inf(), row_sum = 0.f;\n";
    columns([&] {
      std::string x = em.emit(sm.body);
      body << "    xs[ci] = " << x << ";\n    row_max = fmaxf(row_max, xs[ci]);\n";
    });
    body << "  row_max = mf::warp_max(row_max);\n";
    columns([&] { body << "    xs[ci] = expf(xs[ci] - row_max);\n    row_sum += xs[ci];\n"; });
    body << "  row_sum = mf::warp_sum(row_sum);\n";
    columns([&] { store("xs[ci] / row_sum"); });
    return;
  }
  // Long or dynamic rows: three strided passes, the body evaluated in each
  // (the row's reads hit in cache after the first).
  auto loop = [&](const std::function<void(const std::string &)> &each) {
    body << "  for (long long " << v << " = lane; " << v << " < " << n << "; " << v << " += 32) {\n";
    em.indent() += 2;
    each(em.emit(sm.body));
    em.indent() -= 2;
    body << "  }\n";
  };
  body << "  float row_max = -mf::inf(), row_sum = 0.f;\n";
  loop([&](const std::string &x) { body << "    row_max = fmaxf(row_max, " << x << ");\n"; });
  body << "  row_max = mf::warp_max(row_max);\n";
  loop([&](const std::string &x) { body << "    row_sum += expf(" << x << " - row_max);\n"; });
  body << "  row_sum = mf::warp_sum(row_sum);\n";
  loop([&](const std::string &x) { store("expf(" + x + " - row_max) / row_sum"); });
}

// Every tensor an element-wise step writes with its value: the primary
// output, then its siblings (merge_sibling_pointwise), stored alike or
// summed over the step's last index (row_sum).
struct Written {
  const TensorDecl *t;
  std::string ptr;
  Expr value;
  bool row_sum = false;
};

std::vector<const TensorDecl *> tensors_of(const std::vector<Written> &outs) {
  std::vector<const TensorDecl *> t;
  for (const Written &w : outs)
    t.push_back(w.t);
  return t;
}

std::vector<Written> written_by(const KernelProgram &prog, const PointwiseStep &s, KernelBuilder &kb) {
  std::vector<Written> outs{{&prog.tensor(s.output), kb.tensor(s.output, /*writes=*/true), s.body, false}};
  for (const ExtraOutput &e : s.extra)
    outs.push_back({&prog.tensor(e.output), kb.tensor(e.output, /*writes=*/true), e.value, e.row_sum});
  return outs;
}

// Whether an output is stored in bf16 (ExprEmitter::fast_special), set
// before each output's value is emitted: a kernel's f32 outputs (a row sum
// beside bf16 gradients, say) keep tanhf.
bool stored_bf16(const Written &w) { return w.t->dtype == DType::bf16; }

// The comment above an element-wise kernel: what each output is.
void describe(std::ostringstream &src, const PointwiseStep &s, const std::vector<Written> &outs) {
  for (size_t o = 0; o < outs.size(); ++o) {
    src << (o ? "//   and " : "// " + s.name + ": ") << outs[o].t->name << "(";
    for (size_t i = 0; i + (outs[o].row_sum ? 1 : 0) < s.vars.size(); ++i)
      src << (i ? ", " : "") << s.vars[i].name();
    src << ") = ";
    if (outs[o].row_sum)
      src << "sum(" << s.vars.back().name() << ", " << outs[o].value << ")\n";
    else
      src << outs[o].value << "\n";
  }
}

// An element-wise step with per-row sums riding along (ExtraOutput::row_sum:
// the gate gradient sum(j, h * dH) beside the activation's backward): a warp
// per row of the leading indices walks the last index, eight elements per
// lane where its extent allows, storing the element-wise outputs as it goes
// and adding each row sum in a register; the warp then adds its lanes'
// sums by shuffles and lane 0 stores them. No atomics, and no pass of its
// own over the matrices the sums read. A [pairs, n] result in the padded
// order walks row slots as emit_pointwise does (pair q at slot q, padding
// rows zeroed).
void emit_pointwise_row_sums(const KernelProgram &prog, const PointwiseStep &s, std::ostringstream &src,
                             GeneratedKernel &k) {
  k.name = c_name(s.name);
  k.step = s.name;
  k.threads = 256;
  KernelBuilder kb(prog, k);
  kb.may_alias(s);
  const std::vector<Written> outs = written_by(prog, s, kb);
  const TensorDecl &out = *outs[0].t;
  const PointwisePlan plan = plan_pointwise(prog, s); // a warp per row (pointwise_plan.h)
  internal_check(plan.walk == ElementWalk::warp_per_row) << s.name << ": not a step with row sums";
  const Var &col = s.vars.back();
  const long long n = col.dim().extent();
  const bool vectorize = plan.per_thread == 8;
  const int width = plan.per_thread;
  const bool padded_rows = plan.padded_rows;

  std::ostringstream body;
  ExprEmitter em(prog, kb, body, 4);
  std::string rows = "1LL";
  for (size_t i = 0; i + 1 < s.vars.size(); ++i)
    rows = "(" + rows + " * " + (padded_rows ? padded_slots(prog, kb, out.route) : kb.extent(s.vars[i].dim())) + ")";
  body << "  long long idx = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;  // a warp per row\n";
  body << "  const int lane = threadIdx.x & 31;\n";
  body << "  if (idx >= " << rows << ") return;  // whole warps: shuffles see every lane\n";
  const std::string step = std::to_string(32 * width);
  const std::string cv = "v_" + c_name(col.name()) + (vectorize ? "0" : "");
  const std::string walk = "  for (long long " + cv + " = (long long)lane * " + std::to_string(width) + "; " + cv +
                           " < " + std::to_string(n) + "; " + cv + " += " + step + ") {\n";
  if (padded_rows) {
    const std::string r = "v_" + c_name(s.vars[0].name());
    body << "  const long long p_row = idx;  // this warp's row slot\n";
    body << "  if (" << padding_slot(prog, kb, out.route) << ") {  // a padding row: zeros\n";
    body << "  " << walk;
    if (vectorize)
      body << "      const float zeros[8] = {};\n";
    for (const Written &w : outs) {
      if (w.row_sum || w.t->layout != RowLayout::padded) // a sorted output has no padding rows
        continue;
      const std::string at = "(p_row * " + std::to_string(n) + " + " + cv + ")";
      if (vectorize)
        body << "      mf::store8(" << w.ptr << " + " << at << ", zeros);\n";
      else
        body << "      " << w.ptr << "[" << at << "] = mf::from_f32<" << c_type(w.t->dtype) << ">(0.f);\n";
    }
    body << "    }\n  }\n";
    body << "  if (p_row >= " << kb.extent(out.route->pairs) << ") return;  // past the pairs: zeroing only\n";
    body << "  const long long " << r << " = p_row;  // pair order\n";
    em.vars[s.vars[0].get()] = r;
  } else {
    for (size_t i = s.vars.size() - 1; i-- > 0;) {
      const std::string c = "v_" + c_name(s.vars[i].name());
      body << "  const long long " << c << " = idx % " << kb.extent(s.vars[i].dim()) << ";\n";
      body << "  idx /= " << kb.extent(s.vars[i].dim()) << ";\n";
      em.vars[s.vars[i].get()] = c;
    }
  }
  skip_dropped_pairs(prog, kb, em.vars, std::vector<Var>(s.vars.begin(), s.vars.end() - 1), tensors_of(outs), body);
  std::vector<std::string> row_idx, out_idx;
  for (size_t i = 0; i + 1 < s.vars.size(); ++i)
    row_idx.push_back(em.vars.at(s.vars[i].get()));
  out_idx = row_idx;
  out_idx.push_back(cv);
  for (size_t o = 0; o < outs.size(); ++o)
    if (outs[o].row_sum)
      body << "  float sum" << o << " = 0.f;\n";
  body << walk;
  if (vectorize) {
    em.vec_var = col.get();
    em.vec_base = cv;
    em.vars[col.get()] = "(" + cv + " + u)";
  } else {
    em.vars[col.get()] = cv;
  }
  // Every value before any store, as emit_pointwise does.
  for (size_t o = 0; o < outs.size(); ++o) {
    em.fast_special = stored_bf16(outs[o]);
    const std::string value = em.emit(outs[o].value);
    if (vectorize) {
      body << "    float out" << o << "[8];\n#pragma unroll\n    for (int u = 0; u < 8; ++u)\n      out" << o
           << "[u] = " << value << ";\n";
      if (outs[o].row_sum)
        body << "#pragma unroll\n    for (int u = 0; u < 8; ++u)\n      sum" << o << " += out" << o << "[u];\n";
    } else {
      body << "    const float out" << o << " = " << value << ";\n";
      if (outs[o].row_sum)
        body << "    sum" << o << " += out" << o << ";\n";
    }
  }
  for (size_t o = 0; o < outs.size(); ++o) {
    if (outs[o].row_sum)
      continue;
    if (vectorize)
      body << "    mf::store8(" << outs[o].ptr << " + " << em.offset(*outs[o].t, out_idx) << ", out" << o << ");\n";
    else
      body << "    " << outs[o].ptr << "[" << em.offset(*outs[o].t, out_idx) << "] = mf::from_f32<"
           << c_type(outs[o].t->dtype) << ">(out" << o << ");\n";
  }
  body << "  }\n";
  for (size_t o = 0; o < outs.size(); ++o) {
    if (!outs[o].row_sum)
      continue;
    body << "#pragma unroll\n  for (int off = 16; off > 0; off >>= 1)\n    sum" << o
         << " += __shfl_xor_sync(0xffffffffu, sum" << o << ", off);\n";
    body << "  if (lane == 0)\n    " << outs[o].ptr << "[" << em.offset(*outs[o].t, row_idx) << "] = mf::from_f32<"
         << c_type(outs[o].t->dtype) << ">(sum" << o << ");\n";
  }

  k.grid.threads_per_element = 32;
  k.grid.elements_per_thread = 1;
  if (padded_rows) {
    k.grid.kind = GridShape::Kind::padded_rows;
    k.grid.route = out.route;
    k.grid.chunks_per_row = 32; // a warp per row slot
  } else {
    k.grid.kind = GridShape::Kind::elements;
    for (size_t i = 0; i + 1 < s.vars.size(); ++i)
      k.grid.count.push_back(s.vars[i].dim());
  }
  describe(src, s, outs);
  // At most one block of 256 per SM as far as the bounds say: with the plain
  // bound ptxas held the SwiGLU backward with its row sum to 64 registers
  // and spilled; it needs about 70.
  src << "extern \"C\" __global__ void __launch_bounds__(" << k.threads << ", 1) " << k.name << "(\n    "
      << kb.signature() << ") {\n"
      << kEntry << body.str() << "}\n\n";
}

} // namespace

void emit_pointwise(const KernelProgram &prog, const PointwiseStep &s, std::ostringstream &src, GeneratedKernel &k) {
  if (std::any_of(s.extra.begin(), s.extra.end(), [](const ExtraOutput &e) { return e.row_sum; }))
    return emit_pointwise_row_sums(prog, s, src, k);
  k.name = c_name(s.name);
  k.step = s.name;
  k.threads = 256;
  KernelBuilder kb(prog, k);
  kb.may_alias(s);
  const TensorDecl &out = prog.tensor(s.output);
  const std::vector<Written> outs = written_by(prog, s, kb);
  const std::string gOut = outs[0].ptr;
  const Softmax *softmax = s.body.as<Softmax>();

  std::ostringstream body;
  ExprEmitter em(prog, kb, body, 2);
  // One thread per element; for a softmax, one warp per row of the others.
  std::vector<Var> loop_vars;
  for (const Var &v : s.vars)
    if (!softmax || !v.same_as(softmax->var))
      loop_vars.push_back(v);
  // Who computes an element, how many each takes, and whether the grid
  // walks the padded order's row slots (pointwise_plan.h).
  const PointwisePlan plan = plan_pointwise(prog, s);
  const bool padded_rows = plan.padded_rows;
  auto extent_of = [&](size_t i) {
    return padded_rows && i == 0 ? padded_slots(prog, kb, out.route) : kb.extent(loop_vars[i].dim());
  };
  std::string total = "1LL";
  for (size_t i = 0; i < loop_vars.size(); ++i)
    total = "(" + total + " * " + extent_of(i) + ")";
  em.block_split = plan.walk == ElementWalk::block;
  em.warp_split = em.block_split || (plan.walk == ElementWalk::warp && !softmax);
  const bool warp_per_element = plan.walk == ElementWalk::warp || plan.walk == ElementWalk::block;
  const int per_thread = plan.per_thread;
  const bool vectorize = per_thread == 8;
  if (em.block_split) {
    body << "  long long idx = blockIdx.x;  // a block per element\n";
    body << "  const int lane = threadIdx.x & 31;\n";
  } else if (warp_per_element) {
    body << "  long long idx = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;  // a warp per "
         << (softmax ? "row" : "element") << "\n";
    body << "  const int lane = threadIdx.x & 31;\n";
  } else {
    body << "  long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;"
         << (vectorize ? "  // eight elements per thread" : "") << "\n";
  }
  body << "  if (idx >= " << total << (vectorize ? " / 8" : "") << ") return;"
       << (warp_per_element ? "  // whole warps: shuffles see every lane" : "") << "\n";
  for (size_t i = loop_vars.size(); i-- > 0;) {
    std::string c = "v_" + c_name(loop_vars[i].name());
    const std::string ext = extent_of(i);
    if (padded_rows && i == 0) {
      body << "  const long long p_row = idx;  // this thread's row slot\n";
      em.vars[loop_vars[i].get()] = c;
      continue;
    }
    if (vectorize && i + 1 == loop_vars.size()) {
      body << "  const long long " << c << "0 = idx % (" << ext << " / 8) * 8;\n";
      body << "  idx /= " << ext << " / 8;\n";
      em.vec_var = loop_vars[i].get();
      em.vec_base = c + "0";
    } else {
      body << "  const long long " << c << " = idx % " << ext << ";\n";
      body << "  idx /= " << ext << ";\n";
    }
    em.vars[loop_vars[i].get()] = c;
  }
  // The output's indices, once every one is in scope (a softmax's own index
  // is its row loop's).
  auto out_index = [&] {
    std::vector<std::string> idx;
    for (const Var &v : s.vars)
      idx.push_back(em.vars.at(v.get()));
    return idx;
  };
  // Row p_row of the padded output, at column `col`.
  auto padded_offset = [&](const std::string &col) { return "(p_row * " + kb.extent(out.dims[1]) + " + " + col + ")"; };
  if (padded_rows) {
    const std::string col = vectorize ? em.vec_base : em.vars.at(s.vars[1].get());
    body << "  if (" << padding_slot(prog, kb, out.route) << ") {  // a padding row: zeros\n";
    if (vectorize)
      body << "    const float zeros[8] = {};\n";
    for (const Written &w : outs) {
      if (w.t->layout != RowLayout::padded) // a sorted output has no padding rows
        continue;
      if (vectorize)
        body << "    mf::store8(" << w.ptr << " + " << padded_offset(col) << ", zeros);\n";
      else
        body << "    " << w.ptr << "[" << padded_offset(col) << "] = mf::from_f32<" << c_type(w.t->dtype)
             << ">(0.f);\n";
    }
    body << "  }\n";
    body << "  if (p_row >= " << kb.extent(out.route->pairs) << ") return;  // past the pairs: zeroing only\n";
    body << "  const long long " << em.vars.at(s.vars[0].get()) << " = p_row;  // pair order\n";
  }
  // (Not along the vectorised index: its eight elements are eight pairs.)
  skip_dropped_pairs(prog, kb, em.vars,
                     vectorize ? std::vector<Var>(loop_vars.begin(), loop_vars.end() - 1) : loop_vars, tensors_of(outs),
                     body);
  if (vectorize) {
    // Every value before any store: the loads the values share are then
    // one load each (no store in between that the compiler must assume
    // aliases them).
    em.vars[em.vec_var] = "(" + em.vec_base + " + u)";
    std::vector<std::string> out_idx = out_index();
    out_idx.back() = em.vec_base;
    for (size_t o = 0; o < outs.size(); ++o) {
      em.fast_special = stored_bf16(outs[o]);
      std::string value = em.emit(outs[o].value);
      body << "  float out" << o << "[8];\n#pragma unroll\n  for (int u = 0; u < 8; ++u)\n    out" << o
           << "[u] = " << value << ";\n";
    }
    for (size_t o = 0; o < outs.size(); ++o)
      body << "  mf::store8(" << outs[o].ptr << " + " << em.offset(*outs[o].t, out_idx) << ", out" << o << ");\n";
  } else {
    auto store = [&](const Written &w, const std::string &value) {
      em.out() << em.pad()
               << (em.block_split  ? "if (threadIdx.x == 0) "
                   : em.warp_split ? "if (lane == 0) "
                                   : "")
               << w.ptr << "[" << em.offset(*w.t, out_index()) << "] = mf::from_f32<" << c_type(w.t->dtype) << ">("
               << value << ");\n";
    };
    if (softmax) {
      em.fast_special = stored_bf16(outs[0]);
      emit_softmax_row(em, kb, *softmax, [&](const std::string &v) { store(outs[0], v); });
    } else {
      // Every value before any store (an output may be written over an
      // input the next value reads: PointwiseStep::in_place).
      for (size_t o = 0; o < outs.size(); ++o) {
        em.fast_special = stored_bf16(outs[o]);
        const std::string value = em.emit(outs[o].value);
        if (outs.size() == 1) {
          store(outs[o], value);
          break;
        }
        em.out() << em.pad() << "const float out" << o << " = " << value << ";\n";
      }
      for (size_t o = 0; outs.size() > 1 && o < outs.size(); ++o)
        store(outs[o], "out" + std::to_string(o));
    }
  }
  k.grid.kind = GridShape::Kind::elements;
  if (padded_rows) {
    k.grid.kind = GridShape::Kind::padded_rows;
    k.grid.route = out.route;
    k.grid.chunks_per_row = s.vars[1].dim().extent() / per_thread;
  }
  k.grid.threads_per_element = em.block_split ? k.threads : warp_per_element ? 32 : 1;
  k.grid.elements_per_thread = per_thread;
  for (const Var &v : loop_vars)
    k.grid.count.push_back(v.dim());
  describe(src, s, outs);
  src << "extern \"C\" __global__ void __launch_bounds__(" << k.threads << ") " << k.name << "(\n    " << kb.signature()
      << ") {\n"
      << kEntry << body.str() << "}\n\n";
}

} // namespace moeforge::cuda
