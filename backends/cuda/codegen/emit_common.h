// What the step emitters (emit_gemm.cpp, emit_pointwise.cpp,
// emit_copies.cpp, emit_attention.cpp) share: C names and literals, the
// builder that collects a kernel's arguments as its body is printed, and a
// route's row expressions; then the emitters themselves, which generate_cuda
// (codegen_cuda.cpp) calls a step each. Private to backends/cuda/codegen.
#pragma once

#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "backends/cuda/codegen/codegen_cuda.h"
#include "dsl/error.h"

namespace moeforge::cuda {

std::string c_name(const std::string &s);

// Every kernel's first statement: the runtime launches generated kernels
// early (programmatic dependent launch, tiles/grid_dependency.cuh), so each
// waits here for the kernel before it to finish.
constexpr const char *kEntry = "  mf::wait_for_previous_grid();\n";

std::string c_type(DType t);

std::string float_literal(double v);

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
    if (n->base) {
      // Appended piecewise: GCC 12 warns falsely (-Wrestrict) on "(" + extent_of(...) where this is inlined.
      std::string s = "(";
      s += extent_of(n->base);
      return s + " * " + std::to_string(n->factor) + "LL)";
    }
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

// max_padded_rows of a route as a C expression: (ceil(P / bs) + E) * bs, the
// row stride of its padded_t tensors (runtime/routing_host.h); for a route
// that drops pairs at capacity, bounded by the kept pairs instead, which
// the host computes (an argument).
std::string max_padded_rows(const KernelProgram &prog, KernelBuilder &kb, const RoutingNode *r);

// The row pair r is stored at in a tensor stored sorted (RowLayout::sorted):
// its padded row less the padding before its expert e = expert[r].
std::string sorted_row(KernelBuilder &kb, const RoutingNode *route, const std::string &r);

// A step's kernel: its text (a comment saying what it computes, then the
// definition) into `src`; its name, arguments and launch shape into `k`.
void emit_gemm(const KernelProgram &prog, const GemmStep &g, std::ostringstream &src, GeneratedKernel &k);
void emit_pointwise(const KernelProgram &prog, const PointwiseStep &s, std::ostringstream &src, GeneratedKernel &k);
void emit_gather(const KernelProgram &prog, const GatherStep &s, std::ostringstream &src, GeneratedKernel &k);
void emit_transpose(const KernelProgram &prog, const TransposeStep &s, std::ostringstream &src, GeneratedKernel &k);
void emit_attention(const KernelProgram &prog, const AttentionStep &s, std::ostringstream &src, GeneratedKernel &k);

} // namespace moeforge::cuda
