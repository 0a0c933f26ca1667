// Checking a Schedule against one layer. The primitives already checked
// everything that depends on the schedule alone; what is left depends on the
// Pipeline: which Funcs exist and are contractions, which contractions run
// over routed rows, and the static extents of the tensors they read.
#include <algorithm>

#include "dsl/error.h"
#include "dsl/visitor.h"
#include "schedules/schedule.h"

namespace moeforge {

namespace {

// A sum(...), or a sum over each expert's routed pairs (expert_sum: a
// weight gradient, which lowers to an expert reduction GEMM that a schedule
// tiles like any other).
struct HasSum : IRVisitor {
  bool found = false;
  void visit_node(const Sum &) override { found = true; }
  void visit_node(const RouteSum &s) override {
    found |= s.field == RouteField::expert;
    IRVisitor::visit_node(s);
  }
};

bool is_contraction(const Func &f) {
  HasSum v;
  v.visit(f.body());
  return v.found;
}

// The first Input/Param dimension read inside a sum(...) whose static extent
// is not a multiple of 8. Only dimensions indexed by a plain variable count:
// a route index (token(r), expert(r)) selects a row or a matrix and is never
// moved as a vector, and the token extent is dynamic anyway.
struct UnalignedDim : IRVisitor {
  int in_sum = 0;
  BufferPtr buffer;
  Dim dim;
  void visit_node(const Sum &s) override {
    ++in_sum;
    IRVisitor::visit_node(s);
    --in_sum;
  }
  void visit_node(const Access &a) override {
    if (buffer || !in_sum || !a.buffer)
      return;
    for (size_t i = 0; i < a.args.size(); ++i) {
      const Dim &d = a.buffer->dims[i];
      if (a.args[i].is_plain() && !d.is_dynamic() && d.extent() % 8 != 0) {
        buffer = a.buffer;
        dim = d;
        return;
      }
    }
  }
};

std::string join(const std::vector<std::string> &names) {
  std::string out;
  for (const std::string &n : names)
    out += (out.empty() ? "" : ", ") + n;
  return out.empty() ? "(none)" : out;
}

} // namespace

Schedule Schedule::only_funcs_of(const Pipeline &pipeline) const {
  std::vector<std::string> present;
  for (const Func &f : pipeline.funcs())
    present.push_back(f.name());
  Schedule s = *this;
  s.funcs_.clear();
  s.calls_.clear();
  for (const std::string &name : funcs_) {
    if (std::find(present.begin(), present.end(), name) != present.end()) {
      s.funcs_.push_back(name);
      continue;
    }
    s.overrides_.erase(name);
    s.named_by_.erase(name);
  }
  // A call that names a Func names it as its first argument, quoted.
  for (const std::string &call : calls_) {
    const size_t open = call.find("(\"");
    const size_t close = open == std::string::npos ? open : call.find('"', open + 2);
    const bool drops = close != std::string::npos && s.named_by_.count(call.substr(open + 2, close - open - 2)) == 0 &&
                       std::find(funcs_.begin(), funcs_.end(), call.substr(open + 2, close - open - 2)) != funcs_.end();
    if (!drops)
      s.calls_.push_back(call);
  }
  return s;
}

void Schedule::check_names(const Pipeline &pipeline) const {
  std::vector<Func> funcs = pipeline.funcs();
  std::vector<std::string> all, contractions;
  for (const Func &f : funcs) {
    all.push_back(f.name());
    if (is_contraction(f))
      contractions.push_back(f.name());
  }

  for (const std::string &name : funcs_) {
    const std::string &primitive = named_by_.at(name);
    user_check(std::find(all.begin(), all.end(), name) != all.end())
        << "schedule '" << name_ << "': " << primitive << "() names '" << name
        << "', which is not a Func of this pipeline: its Funcs are " << join(all)
        << "; its contractions (what a schedule can tile) are " << join(contractions);
    user_check(std::find(contractions.begin(), contractions.end(), name) != contractions.end())
        << "schedule '" << name_ << "': '" << name << "' has no contraction: " << primitive
        << "() applies only to Funcs with a sum(...); this pipeline's contractions are " << join(contractions);
  }
}

std::map<std::string, Fp8Format> Schedule::fp8_funcs(const Pipeline &pipeline) const {
  std::map<std::string, Fp8Format> out;
  for (const Func &f : pipeline.funcs())
    if (is_contraction(f))
      if (std::optional<Fp8Format> format = for_func(f.name()).fp8)
        out.emplace(f.name(), *format);
  return out;
}

void Schedule::validate(const Pipeline &pipeline) const {
  check_names(pipeline);
  for (const Func &f : pipeline.funcs()) {
    if (!is_contraction(f))
      continue;
    const GemmTiling t = for_func(f.name()).tiling;

    // Both permutations cut each expert's routed rows into blocks of block()
    // rows (padded copies when blocked, index lists when scattered); a tile of
    // rows must stay inside one block, hence inside one expert.
    for (const RoutingPtr &route : pipeline.routes()) {
      bool routed = std::any_of(f.args().begin(), f.args().end(), [&](const Var &v) { return v.same_as(route->pair); });
      user_check(!routed || block_ % t.tile_m == 0)
          << "schedule '" << name_ << "': '" << f.name() << "' runs over the routed pairs " << route->pair.name()
          << " of route '" << route->name << "', and tile_m " << t.tile_m << " does not divide block " << block_
          << ": use tile_m <= " << block_ << " or block " << t.tile_m
          << " (a tile of routed rows must not straddle two experts)";
    }

    // Primitives that only mean something together, checked here so that
    // every backend rejects the same schedules (the CPU backend would run
    // them as if the primitive were absent; CUDA could not).
    const std::string q = "\"" + f.name() + "\"";
    user_check(!t.persistent || t.mma == MmaKind::wgmma_ws)
        << "schedule '" << name_ << "': definition '" << f.name() << "': persistent blocks need the warp-specialised "
        << "loop: add mma(" << q << ", wgmma_ws) or drop persistent";
    user_check(t.cluster_m == 1 || (t.mma == MmaKind::wgmma_ws && t.tma))
        << "schedule '" << name_ << "': definition '" << f.name() << "': clusters of two row tiles multicast TMA "
        << "loads from the warp-specialised loop: add mma(" << q << ", wgmma_ws) and tma(" << q
        << ", true), or drop cluster";
  }
  user_check(!atomic_combine_ || ranks_ == 1)
      << "schedule '" << name_ << "': atomic_combine(true) with expert_parallel(" << ranks_
      << "): the combine runs on the token's GPU once its rows come back, where no GEMM epilogue makes them; drop "
         "one of the two";
  user_check(!atomic_input_gradient_ || ranks_ == 1)
      << "schedule '" << name_ << "': atomic_input_gradient(true) with expert_parallel(" << ranks_
      << "): the input gradient's rows are summed on the token's GPU once they come back, where no GEMM epilogue "
         "makes them; drop one of the two";
}

void check_vector_alignment(const Pipeline &pipeline) {
  // The CUDA backend loads and stores 16-byte vectors (8 bf16), so every
  // row it moves must start 16-byte aligned. Extents a tile does not divide
  // are fine: the tail is masked.
  for (const Func &f : pipeline.funcs()) {
    if (!is_contraction(f))
      continue;
    UnalignedDim u;
    u.visit(f.body());
    if (u.buffer) {
      int64_t n = u.dim.extent(), padded = (n + 7) / 8 * 8;
      user_error << "dimension " << u.dim.name() << " = " << n << " of '" << u.buffer->name
                 << "' is not a multiple of 8: the CUDA backend moves 16-byte vectors; pad " << u.dim.name() << " to "
                 << padded << " (read by the contraction in '" << f.name() << "'), or run on the CPU backend";
    }
  }
}

} // namespace moeforge
