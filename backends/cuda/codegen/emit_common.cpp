// The shared helpers of emit_common.h: C names and literals, and a route's
// row expressions, with the routing block its padded row bound is made of.
#include "backends/cuda/codegen/emit_common.h"

#include <cctype>
#include <cmath>
#include <cstdio>

namespace moeforge::cuda {

namespace {

// The routing block of a route (its RoutingStep's).
int route_block(const KernelProgram &prog, const RoutingNode *r) {
  for (const Step &s : prog.steps)
    if (auto *rs = std::get_if<RoutingStep>(&s); rs && rs->route == r)
      return rs->block;
  internal_check(false) << "no routing step for route " << r->name;
}

} // namespace

std::string c_name(const std::string &s) {
  std::string out;
  for (char c : s)
    out += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return out;
}

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

} // namespace moeforge::cuda
