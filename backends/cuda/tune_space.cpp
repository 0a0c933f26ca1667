#include "backends/cuda/tune_space.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <variant>

#include "dsl/error.h"
#include "lowering/gemm_plan.h"
#include "lowering/lower.h"
#include "lowering/training.h"

namespace moeforge::cuda {

namespace {

KernelProgram lowered(const Pipeline &pipeline, const std::string &output, const Schedule &s, bool training) {
  return training ? lower_training(pipeline, pipeline.func(output), s).program : lower(pipeline, s);
}

} // namespace

std::string FuncChoice::text() const {
  std::ostringstream o;
  o << tile_m << "x" << tile_n << ", " << stages << " stages" << (persistent ? ", persistent" : "")
    << (tma_store ? ", tma_store" : "") << (cluster > 1 ? ", cluster " + std::to_string(cluster) : "");
  return o.str();
}

std::vector<FuncChoice> func_choices() {
  // The knobs' ranges: the tiles the wgmma loops take (64-row tiles lose to
  // 128 on every shape measured), 3 or 4 stages (a 128 x 256 tile has room
  // for 4 and nothing past it), the two walk and store choices, and clusters
  // of two row tiles sharing B (persistent ones walk pairs of tiles: the
  // hand-written best forward of mbpaper's down-projection).
  std::vector<FuncChoice> out;
  for (int n : {128, 256})
    for (int stages : {4, 3})
      for (bool persistent : {false, true})
        for (bool tma_store : {false, true})
          for (int cluster : {1, 2})
            out.push_back(FuncChoice{128, n, stages, persistent, tma_store, cluster});
  return out;
}

Schedule with_choice(const Schedule &base, const std::string &func, const FuncChoice &c) {
  Schedule s = base;
  s.tile(func, c.tile_m, c.tile_n, 64)
      .stages(func, c.stages)
      .persistent(func, c.persistent)
      .tma_store(func, c.tma_store)
      .cluster(func, c.cluster);
  return s;
}

std::vector<std::string> tunable_funcs(const Pipeline &pipeline, const std::string &output, const Schedule &base,
                                       bool training) {
  std::vector<std::string> out;
  for (const Step &st : lowered(pipeline, output, base, training).steps)
    if (const auto *g = std::get_if<GemmStep>(&st))
      if (std::find(out.begin(), out.end(), g->func) == out.end())
        out.push_back(g->func);
  return out;
}

LayoutCandidates layout_candidates(const Pipeline &pipeline, const std::string &output, const Schedule &base,
                                   bool training) {
  LayoutCandidates out;
  if (pipeline.routes().empty())
    return out;                            // no routed rows: neither choice means anything
  std::map<std::string, std::string> seen; // the program's text -> the change that gave it
  auto program_text = [&](const Schedule &s) {
    const KernelProgram k = lowered(pipeline, output, s, training);
    std::ostringstream o;
    o << k;
    return o.str() + describe_gemm_plans(k, /*notes=*/false);
  };
  seen.emplace(program_text(base), "the current settings");
  for (Permutation p : {Permutation::blocked, Permutation::scattered})
    for (GateFusion g : {GateFusion::combine, GateFusion::epilogue}) {
      if (p == base.permutation() && g == base.gate())
        continue;
      std::string what;
      if (p != base.permutation())
        what = std::string("permutation(") + permutation_name(p) + ")";
      if (g != base.gate())
        what += (what.empty() ? "" : " ") + std::string("gate(") + gate_fusion_name(g) + ")";
      Schedule s = base;
      s.permutation(p).gate(g);
      try {
        const std::string text = program_text(s);
        if (auto it = seen.find(text); it != seen.end()) {
          out.pruned.emplace_back(what, "the same program as " + it->second);
          continue;
        }
        seen.emplace(text, what);
        out.kept.push_back({what, s});
      } catch (const UserError &e) {
        out.pruned.emplace_back(what, e.what());
      }
    }
  return out;
}

FuncCandidates candidates_for(const Pipeline &pipeline, const std::string &output, const Schedule &base,
                              const std::string &func, bool training) {
  FuncCandidates fc;
  fc.func = func;
  std::map<std::string, std::string> seen; // the plans' text -> the choice that gave them
  // The base's own settings are what the search already has: no candidate.
  seen.emplace(describe_gemm_plans(lowered(pipeline, output, base, training), /*notes=*/false), "the current settings");
  for (const FuncChoice &c : func_choices()) {
    try {
      const KernelProgram p = lowered(pipeline, output, with_choice(base, func, c), training);
      const std::string plans = describe_gemm_plans(p, /*notes=*/false);
      if (auto it = seen.find(plans); it != seen.end()) {
        fc.pruned.push_back({c, "the same plans as " + it->second});
        continue;
      }
      seen.emplace(plans, c.text());
      fc.kept.push_back(c);
    } catch (const UserError &e) {
      fc.pruned.push_back({c, e.what()});
    }
  }
  return fc;
}

} // namespace moeforge::cuda
