// An expression of the algebra as C, for the two emitters that print
// values: a GEMM's epilogue (emit_gemm.cpp) and an element-wise kernel
// (emit_pointwise.cpp). Private to backends/cuda/codegen.
#pragma once

#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "backends/cuda/codegen/emit_common.h"
#include "dsl/error.h"
#include "dsl/printer.h"

namespace moeforge::cuda {

// Emits an expression as C: statements (loops for sums over a token's pairs)
// go to `out`; emit() returns the value's expression, valid after them.
class ExprEmitter {
public:
  ExprEmitter(const KernelProgram &prog, KernelBuilder &kb, std::ostringstream &out, int indent)
      : prog_(prog), kb_(kb), out_(out), indent_(indent) {}

  // A warp computes each element: the outermost reductions are split over
  // its lanes (lane, lane + 32, ...) and summed with shuffles; everything
  // else is computed alike by every lane. block_split: the whole block
  // computes each element, its threads splitting the reductions alike.
  bool warp_split = false, block_split = false;
  std::map<const VarNode *, std::string> vars;       // index variables in scope
  std::map<const FuncNode *, std::string> registers; // placeholders held in registers (accumulators)
  // The value being emitted is stored in bf16: tanh takes the
  // special-function unit's form (mf::tanh_fast, relative error ~2^-11,
  // under bf16's rounding of the result) instead of tanhf's ~20
  // instructions. The GeLU derivative autodiff writes out (three tanh of
  // one argument per element) made that arithmetic a share of the
  // backward's element-wise kernel comparable to its memory traffic.
  bool fast_special = false;

  // Eight elements per thread (emit_pointwise): values are expressions in a
  // lane u = 0..7, vec_var being vars[vec_var] = (vec_base + u); sums keep
  // eight accumulators, added to in unrolled loops over u. A read contiguous
  // in vec_var becomes one eight-wide load at the point it is needed, and
  // `array[u]` in the expression.
  const VarNode *vec_var = nullptr;
  std::string vec_base;

  std::string emit(const Expr &e) {
    switch (e.kind()) {
    case ExprKind::Const:
      return float_literal(e.as<Const>()->value);
    case ExprKind::Access:
      return access(*e.as<Access>());
    case ExprKind::Unary: {
      auto *u = e.as<Unary>();
      std::string a = emit(u->a);
      switch (u->op) {
      case UnaryOp::neg:
        return "(-" + a + ")";
      case UnaryOp::exp:
        return "expf(" + a + ")";
      case UnaryOp::log:
        return "logf(" + a + ")";
      case UnaryOp::tanh:
        return (fast_special ? "mf::tanh_fast(" : "tanhf(") + a + ")";
      case UnaryOp::sqrt:
        return "sqrtf(" + a + ")";
      case UnaryOp::rsqrt:
        return "rsqrtf(" + a + ")";
      default:
        return std::string("mf::") + unary_op_name(u->op) + "(" + a + ")";
      }
    }
    case ExprKind::Binary: {
      auto *b = e.as<Binary>();
      std::string x = emit(b->a), y = emit(b->b);
      if (b->op == BinaryOp::max)
        return "fmaxf(" + x + ", " + y + ")";
      return "(" + x + " " + binary_op_name(b->op) + " " + y + ")";
    }
    case ExprKind::RouteSum:
      return route_sum(*e.as<RouteSum>());
    case ExprKind::IndexEq: { // [a == b]: 1 where the two indices agree
      auto *n = e.as<IndexEq>();
      return "(" + index(n->a) + " == " + index(n->b) + " ? 1.f : 0.f)";
    }
    case ExprKind::Extent:
      return "((float)" + kb_.extent(e.as<Extent>()->dim) + ")";
    case ExprKind::Sum:
      return reduction(*e.as<Sum>());
    case ExprKind::Softmax:
      break;
    }
    internal_check(false) << "the CUDA codegen cannot emit " << to_string(e) << " here (lowering should have split it)";
  }

  std::string index(const Index &ix) {
    auto it = vars.find(ix.var.get());
    internal_check(it != vars.end()) << "index variable " << ix.var.name() << " not in scope";
    switch (ix.field) {
    case RouteField::none:
      return it->second;
    case RouteField::token:
      return "(" + it->second + " / " + std::to_string(ix.route->k) + "LL)";
    case RouteField::expert:
      return "(long long)" + kb_.route(ix.route.get(), RoutingArray::expert) + "[" + it->second + "]";
    }
    return "";
  }

  // Row-major offset of `t` at the given index expressions; a padded tensor's
  // first index is a pair r, found at its padded position pair_pos[r] (a
  // sorted one's at that position less its expert's padding before it); a
  // stride8 tensor's rows are its last extent rounded up to 8; a tensor with
  // an outer stride has its first index that many elements apart.
  std::string offset(const TensorDecl &t, const std::vector<std::string> &idx) {
    if (t.outer_stride > 0 && !idx.empty()) {
      std::string rest = "0";
      for (size_t i = 1; i < idx.size(); ++i)
        rest = i == 1 ? idx[i] : "(" + rest + " * " + kb_.extent(t.dims[i]) + " + " + idx[i] + ")";
      return "(" + idx[0] + " * " + std::to_string(t.outer_stride) + "LL + " + rest + ")";
    }
    std::string off;
    for (size_t i = 0; i < idx.size(); ++i) {
      std::string v = idx[i];
      if (i == 0 && t.layout == RowLayout::padded)
        v = "(long long)" + kb_.route(t.route, RoutingArray::pair_pos) + "[" + v + "]";
      if (i == 0 && t.layout == RowLayout::sorted)
        v = sorted_row(kb_, t.route, v);
      std::string extent = kb_.extent(t.dims[i]);
      if (t.stride8 && i + 1 == t.dims.size())
        extent = "((" + extent + " + 7) / 8 * 8)";
      off = i == 0 ? v : "(" + off + " * " + extent + " + " + v + ")";
    }
    return off.empty() ? "0" : off;
  }

  std::string temp(const char *prefix) { return std::string(prefix) + std::to_string(counter_++); }
  std::string pad() const { return std::string(indent_, ' '); }
  std::ostringstream &out() { return out_; }
  int &indent() { return indent_; }

private:
  std::string access(const Access &a) {
    if (a.func)
      if (auto it = registers.find(a.func.get()); it != registers.end())
        return it->second;
    const TensorDecl &t = prog_.tensor(a.target_name());
    if (std::string v = hoisted(a, t); !v.empty())
      return v;
    std::vector<std::string> idx;
    for (const Index &ix : a.args)
      idx.push_back(index(ix));
    return "mf::to_f32(" + kb_.tensor(t.name) + "[" + offset(t, idx) + "])";
  }

  // The eight-wide load of a read whose last index is vec_var itself and
  // whose other indices do not involve it (so the eight elements are
  // consecutive in memory and aligned to eight, the extent being a multiple
  // of eight); empty when the read does not qualify.
  std::string hoisted(const Access &a, const TensorDecl &t) {
    if (!vec_var || a.args.empty() || t.stride8 || t.dtype == DType::f16)
      return "";
    const Index &last = a.args.back();
    if (last.var.get() != vec_var || last.field != RouteField::none ||
        (a.args.size() == 1 && (t.layout == RowLayout::padded || t.layout == RowLayout::sorted)))
      return "";
    for (size_t i = 0; i + 1 < a.args.size(); ++i)
      if (a.args[i].var.get() == vec_var)
        return "";
    std::string lane_var = vars.at(vec_var);
    vars[vec_var] = vec_base;
    std::vector<std::string> idx;
    for (const Index &ix : a.args)
      idx.push_back(index(ix));
    std::string at = kb_.tensor(t.name) + " + " + offset(t, idx);
    vars[vec_var] = lane_var;
    auto [it, fresh] = loads_.emplace(at, "");
    if (fresh) {
      it->second = temp("ld");
      out_ << pad() << "float " << it->second << "[8];\n"
           << pad() << "mf::load8(" << at << ", " << it->second << ");\n";
    }
    return it->second + "[u]";
  }

  // A sum's accumulator: one float, or eight in vector mode.
  void declare_sum(const std::string &acc) {
    out_ << pad() << "float " << acc << (vec_var ? "[8] = {}" : " = 0.f") << ";\n";
  }
  void add_to(const std::string &acc, const std::string &x) {
    if (vec_var)
      out_ << pad() << "#pragma unroll\n" << pad() << "for (int u = 0; u < 8; ++u) " << acc << "[u] += " << x << ";\n";
    else
      out_ << pad() << acc << " += " << x << ";\n";
  }
  std::string sum_value(const std::string &acc) const { return vec_var ? acc + "[u]" : acc; }

  // sum(i, body) that lowering kept element-wise (a reduction, not a GEMM):
  // a loop over i in this thread.
  std::string reduction(const Sum &s) {
    std::string acc = temp("sum"), v = temp("i");
    const bool split = warp_split && split_depth_ == 0;
    declare_sum(acc);
    const std::string first = block_split ? "threadIdx.x" : "lane", step = block_split ? " += blockDim.x" : " += 32";
    out_ << pad() << "for (long long " << v << " = " << (split ? first : "0") << "; " << v << " < "
         << kb_.extent(s.var.dim()) << "; " << (split ? v + step : "++" + v) << ") {\n";
    indent_ += 2;
    split_depth_ += split;
    const auto loads = loads_; // loads inside the loop are its own
    vars[s.var.get()] = v;
    add_to(acc, emit(s.body));
    loads_ = loads;
    vars.erase(s.var.get());
    split_depth_ -= split;
    indent_ -= 2;
    out_ << pad() << "}\n";
    if (split)
      out_ << pad() << acc << " = mf::" << (block_split ? "block_sum(" : "warp_sum(") << acc << ");\n";
    return sum_value(acc);
  }

  std::string route_sum(const RouteSum &s) {
    if (s.field == RouteField::expert)
      return expert_sum(s);
    // Pairs are numbered r = t * k + slot: a token's pairs are k consecutive
    // rows, so the combine is a fixed loop, deterministic and atomic-free.
    std::string acc = temp("sum"), slot = temp("slot"), r = temp("r");
    int k = s.route->k;
    declare_sum(acc);
    out_ << pad() << "for (int " << slot << " = 0; " << slot << " < " << k << "; ++" << slot << ") {\n";
    indent_ += 2;
    out_ << pad() << "const long long " << r << " = " << vars.at(s.target.get()) << " * " << k << "LL + " << slot
         << ";\n";
    // A pair dropped at capacity sits at the drop row (routing_host.h) and
    // adds nothing; its values may be anything, so it is skipped, not
    // multiplied by 0.
    if (prog_.routing(s.route.get()).drops())
      out_ << pad() << "if (" << kb_.route(s.route.get(), RoutingArray::pair_pos) << "[" << r
           << "] == " << max_padded_rows(prog_, kb_, s.route.get()) << " - 1) continue;  // dropped at capacity\n";
    vars[s.route->pair.get()] = r;
    const auto loads = loads_;
    add_to(acc, emit(s.body));
    loads_ = loads;
    vars.erase(s.route->pair.get());
    indent_ -= 2;
    out_ << pad() << "}\n";
    return sum_value(acc);
  }

  // expert_sum(route, e, body): a loop over expert e's pairs, which sit at
  // padded rows offsets[e] .. offsets[e] + counts[e] - 1 in sorted_pair.
  std::string expert_sum(const RouteSum &s) {
    const RoutingNode *r = s.route.get();
    std::string acc = temp("sum"), p = temp("p"), pr = temp("r"), e = vars.at(s.target.get());
    std::string off = kb_.route(r, RoutingArray::offsets), cnt = kb_.route(r, RoutingArray::counts),
                sp = kb_.route(r, RoutingArray::sorted_pair);
    declare_sum(acc);
    out_ << pad() << "for (long long " << p << " = " << off << "[" << e << "]; " << p << " < " << off << "[" << e
         << "] + " << cnt << "[" << e << "]; ++" << p << ") {\n";
    indent_ += 2;
    out_ << pad() << "const long long " << pr << " = " << sp << "[" << p << "];\n";
    vars[r->pair.get()] = pr;
    const auto loads = loads_;
    add_to(acc, emit(s.body));
    loads_ = loads;
    vars.erase(r->pair.get());
    indent_ -= 2;
    out_ << pad() << "}\n";
    return sum_value(acc);
  }

  const KernelProgram &prog_;
  KernelBuilder &kb_;
  std::ostringstream &out_;
  int indent_;
  int counter_ = 0;
  int split_depth_ = 0;
  std::map<std::string, std::string> loads_; // eight-wide loads in scope, by address
};

} // namespace moeforge::cuda
