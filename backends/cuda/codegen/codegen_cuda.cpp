#include "backends/cuda/codegen/codegen_cuda.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "backends/cuda/codegen/tile_library.h"
#include "dsl/error.h"
#include "dsl/printer.h"
#include "dsl/visitor.h"
#include "lowering/gemm_plan.h"
#include "lowering/pointwise_plan.h"
#include "schedules/schedule.h"

namespace moeforge {

bool timeline_requested() { return std::getenv("MOEFORGE_TIMELINE") != nullptr; }

namespace {

std::string c_name(const std::string &s) {
  std::string out;
  for (char c : s)
    out += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return out;
}

// Every kernel's first statement: the runtime launches generated kernels
// early (programmatic dependent launch, tiles/grid_dependency.cuh), so each
// waits here for the kernel before it to finish.
constexpr const char *kEntry = "  mf::wait_for_previous_grid();\n";

std::string c_type(DType t) { return t == DType::f32 ? "float" : (t == DType::bf16 ? "mf::bf16" : "__half"); }

std::string float_literal(double v) {
  if (std::isinf(v))
    return v > 0 ? "mf::inf()" : "(-mf::inf())";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  std::string s = buf;
  if (s.find_first_of(".eE") == std::string::npos)
    s += ".0";
  return "(" + s + "f)";
}

// Elements from one expert's matrix of a per-expert operand to the next:
// `dense` (its [K, N] size, as a C++ expression) or the stride it is stored
// with inside a larger tensor.
std::string expert_stride(const TensorDecl &t, const std::string &dense) {
  return t.outer_stride > 0 ? std::to_string(t.outer_stride) + "LL" : dense;
}

// Collects a kernel's arguments as its body is emitted, then prints the
// signature, so every argument is one the body uses.
class KernelBuilder {
public:
  KernelBuilder(const KernelProgram &prog, GeneratedKernel &k) : prog_(prog), k_(k) {}

  std::string tensor(const std::string &name, bool writes = false) {
    std::string c = "g_" + c_name(name);
    if (add(KernelArg{KernelArg::Kind::tensor, name, nullptr})) {
      const TensorDecl &t = prog_.tensor(name);
      params_.push_back((writes ? "" : "const ") + c_type(t.dtype) +
                        (may_alias_.count(name) ? " *" : " *__restrict__ ") + c);
    }
    return c;
  }
  // The tensors of an element-wise step that writes an output over an
  // input's bytes (PointwiseStep::in_place): their pointers are not
  // __restrict__, so the compiler keeps each element's loads before its
  // stores. Called before the step's tensors are named.
  void may_alias(const PointwiseStep &s) {
    for (const auto &[out, in] : s.in_place) {
      may_alias_.insert(out);
      may_alias_.insert(in);
    }
  }
  std::string route(const RoutingNode *r, RoutingArray array) {
    const std::string name = routing_array_name(array);
    std::string c = "rt_" + c_name(r->name) + "_" + name;
    KernelArg a{KernelArg::Kind::route, name, r};
    a.array = array;
    if (add(a))
      params_.push_back("const int *__restrict__ " + c);
    return c;
  }
  // A TMA tensor map of `name` seen as batches of [rows, cols] matrices.
  std::string tma(const std::string &name, long long rows, long long cols) {
    std::string c = "tma_" + c_name(name);
    KernelArg a{KernelArg::Kind::tma, name, nullptr};
    a.rows = rows;
    a.cols = cols;
    // A tensor stored with an outer stride (a Param inside a larger
    // tensor, or its gradient): its matrices lie that far apart.
    if (const TensorDecl &t = prog_.tensor(name); t.outer_stride > 0) {
      user_check(rows > 0 && rows * cols == elements_past_first(t))
          << "TMA tiles of '" << name << "' (stored every " << t.outer_stride << " elements along " << t.dims[0].name()
          << ") must be one [" << t.dims[0].name() << "] index's matrix each";
      a.matrix_stride = t.outer_stride;
    }
    if (add(a))
      params_.push_back("const __grid_constant__ mf::TmaDesc " + c);
    return c;
  }
  // Two ints the runtime zeroes once, from which persistent blocks draw
  // their tiles (WgmmaWsConfig::next_tile; the kernel leaves them zero).
  std::string tile_counter() {
    if (add(KernelArg{KernelArg::Kind::counter, "tile_counter", nullptr}))
      params_.push_back("int *__restrict__ tile_counter");
    return "tile_counter";
  }
  // A Dim's extent as a C expression; dynamic extents become arguments.
  std::string extent(const Dim &d) { return extent_of(d.node()); }
  // A run-time extent by name (ProgramShapes binds it): a dropping route's
  // padded row bound (max_padded_rows_extent).
  std::string named_extent(const std::string &name) {
    std::string c = "ext_" + c_name(name);
    if (add(KernelArg{KernelArg::Kind::extent, name, nullptr}))
      params_.push_back("long long " + c);
    return c;
  }
  std::string signature() const {
    std::string s;
    for (size_t i = 0; i < params_.size(); ++i)
      s += (i ? ",\n    " : "") + params_[i];
    return s;
  }

private:
  std::set<std::string> may_alias_;
  std::string extent_of(const std::shared_ptr<const DimNode> &n) {
    if (n->base)
      return "(" + extent_of(n->base) + " * " + std::to_string(n->factor) + "LL)";
    if (n->extent >= 0)
      return std::to_string(n->extent) + "LL";
    std::string c = "ext_" + c_name(n->name);
    if (add(KernelArg{KernelArg::Kind::extent, n->name, nullptr}))
      params_.push_back("long long " + c);
    return c;
  }
  bool add(const KernelArg &a) {
    for (const KernelArg &x : k_.args)
      if (x.kind == a.kind && x.name == a.name && x.route == a.route)
        return false;
    k_.args.push_back(a);
    return true;
  }
  const KernelProgram &prog_;
  GeneratedKernel &k_;
  std::vector<std::string> params_;
};

// Emits an expression as C: statements (loops for sums over a token's pairs)
// go to `out`; emit() returns the value's expression, valid after them.
std::string max_padded_rows(const KernelProgram &prog, KernelBuilder &kb, const RoutingNode *r);
std::string sorted_row(KernelBuilder &kb, const RoutingNode *route, const std::string &r);

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

// The routing block of a route (its RoutingStep's).
int route_block(const KernelProgram &prog, const RoutingNode *r) {
  for (const Step &s : prog.steps)
    if (auto *rs = std::get_if<RoutingStep>(&s); rs && rs->route == r)
      return rs->block;
  internal_check(false) << "no routing step for route " << r->name;
}

// max_padded_rows of a route as a C expression: (ceil(P / bs) + E) * bs, the
// row stride of its padded_t tensors (runtime/routing_host.h); for a route
// that drops pairs at capacity, bounded by the kept pairs instead, which
// the host computes (an argument).
// The row pair r is stored at in a tensor stored sorted (RowLayout::sorted):
// its padded row less the padding before its expert e = expert[r].
std::string sorted_row(KernelBuilder &kb, const RoutingNode *route, const std::string &r) {
  const std::string e = kb.route(route, RoutingArray::expert) + "[" + r + "]";
  return "((long long)" + kb.route(route, RoutingArray::pair_pos) + "[" + r + "] - " +
         kb.route(route, RoutingArray::offsets) + "[" + e + "] + " + kb.route(route, RoutingArray::offsets_unpadded) +
         "[" + e + "])";
}

std::string max_padded_rows(const KernelProgram &prog, KernelBuilder &kb, const RoutingNode *r) {
  if (prog.routing(r).drops())
    return kb.named_extent(max_padded_rows_extent(r));
  std::string bs = std::to_string(route_block(prog, r)) + "LL";
  return "((" + kb.extent(r->pairs) + " + " + bs + " - 1) / " + bs + " + " + std::to_string(r->expert_dim().extent()) +
         "LL) * " + bs;
}

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

// ------------------------------------------------------------ GEMM kernels

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

// ------------------------------------------------------------ element-wise kernels

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

// ------------------------------------------------------------ attention

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

} // namespace

CudaModuleSource generate_cuda(const KernelProgram &program) {
  CudaModuleSource m;
  std::ostringstream pre;
  pre << "// Generated by moeforge from the kernel program of schedule '" << program.schedule_name << "'.\n";
  m.timeline = timeline_requested();
  if (m.timeline) // GEMMs stamp their phases (tiles/timeline.cuh, CudaLayer::timeline)
    pre << "#define MF_TIMELINE 1\n";
  pre << "#include \"" << kTileLibraryName << "\"\n\n";
  m.preamble = pre.str();
  m.source = m.preamble;
  for (const Step &step : program.steps) {
    if (std::holds_alternative<RoutingStep>(step))
      continue;
    GeneratedKernel k;
    std::ostringstream src;
    if (auto *g = std::get_if<GemmStep>(&step))
      emit_gemm(program, *g, src, k);
    else if (auto *p = std::get_if<PointwiseStep>(&step))
      emit_pointwise(program, *p, src, k);
    else if (auto *t = std::get_if<TransposeStep>(&step))
      emit_transpose(program, *t, src, k);
    else if (auto *a = std::get_if<AttentionStep>(&step))
      emit_attention(program, *a, src, k);
    else
      emit_gather(program, std::get<GatherStep>(step), src, k);
    k.source = src.str();
    m.source += k.source;
    m.kernels.push_back(std::move(k));
  }
  return m;
}

} // namespace moeforge
