#include "backends/cuda/tune/tune_space.h"

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
    << (tma_store ? ", tma_store" : "") << (cluster > 1 ? ", cluster " + std::to_string(cluster) : "")
    << (raster > 0 ? ", raster " + std::to_string(raster) : "") << (narrow_tail == 1 ? ", narrow tail" : "");
  return o.str();
}

std::vector<FuncChoice> func_choices() {
  // The knobs' ranges: the tiles the wgmma loops take (64-row tiles lose to
  // 128 on every shape measured; 64-column ones are for narrow GEMMs, the
  // router's logits over E columns, and decoding), 3 or 4 stages (a 128 x 256
  // tile has room for 4 and nothing past it), the two walk and store choices, and
  // clusters of two row tiles sharing B (persistent ones walk pairs of
  // tiles: the hand-written best forward of mbpaper's down-projection).
  // 64-column tiles also take 6 and 8 stages: a decoding step's GEMM has a
  // row or so a tile and streams the weights, and a deeper ring keeps more
  // of them in flight per SM (s54, H100: mixtral's down-projection at one
  // token 128 -> 80 us with 64-column tiles and 8 stages); the model drops
  // them where tiles have more rows than kFewRows to compute.
  std::vector<FuncChoice> out;
  for (int n : {128, 256, 64})
    for (int stages : n == 64 ? std::vector<int>{4, 3, 6, 8} : std::vector<int>{4, 3})
      for (bool persistent : {false, true})
        for (bool tma_store : {false, true})
          for (int cluster : {1, 2})
            out.push_back(FuncChoice{128, n, stages, persistent, tma_store, cluster});
  return out;
}

// The narrowest tile of the space: the model has no narrower one to offer.
constexpr int kNarrowestTile = 64;

// A row tile's rows at `tokens` tokens, on average: the tokens of a dense
// GEMM, an expert's share T k / E of the pairs of a routed one, at most the
// tile's rows; the whole tile where the count is unknown (0) or the rows are
// no token's (an expert reduction's output rows are a weight's).
double rows_per_tile(const GemmStep &g, int64_t tokens, int tile_m) {
  if (tokens <= 0 || g.expert_k || (g.route && g.route->expert_choice()))
    return tile_m;
  const int64_t experts = g.route ? g.route->expert_dim().extent() : 0;
  const double rows = !g.route      ? static_cast<double>(g.m.is_dynamic() ? tokens : g.m.extent())
                      : experts > 0 ? static_cast<double>(tokens) * g.route->k / static_cast<double>(experts)
                                    : static_cast<double>(tokens);
  return std::min(rows, static_cast<double>(tile_m));
}

// Where a 64-column tile's A bytes are at most half its B bytes (a row tile
// of 32 rows or fewer: decoding's few tokens an expert), reading A once per
// 64 columns costs little, and the narrow tile gives the grid twice the
// blocks to stream the weights with.
constexpr double kFewRows = 32;
// The deepest ring a tile with rows to compute needs (training's and
// prefill's GEMMs: 4 stages hide the loads, and deeper ones took shared
// memory from nothing that gained).
constexpr int kDeepestFullRing = 4;

std::string model_prune(const KernelProgram &program, const std::string &func, const FuncChoice &c, int64_t tokens) {
  for (const Step &st : program.steps) {
    const auto *g = std::get_if<GemmStep>(&st);
    if (!g || g->func != func)
      continue;
    const int64_t n = g->n.extent();
    if (n <= 0)
      return ""; // columns known at run time only: nothing to judge by
    std::ostringstream why;
    if (c.tile_n > kNarrowestTile && c.tile_n / 2 >= n) {
      why << "a " << c.tile_n << "-column tile over " << n << " columns: the " << c.tile_n / 2
          << "-column tile covers them with half the padded columns";
      return why.str();
    }
    if (c.stages > kDeepestFullRing && rows_per_tile(*g, tokens, c.tile_m) > kFewRows) {
      why << c.stages << " stages: a ring deeper than " << kDeepestFullRing << " is for streaming weights at "
          << kFewRows << " rows a tile or fewer (decoding); tiles with rows to compute hide their loads with "
          << kDeepestFullRing;
      return why.str();
    }
    if (c.tile_n == kNarrowestTile && n >= 256 && rows_per_tile(*g, tokens, c.tile_m) > kFewRows) {
      why << "a 64-column tile over " << n << " columns reads each A tile once per 64 columns, "
          << "twice the A traffic of a 128-column tile";
      return why.str();
    }
    return "";
  }
  return "";
}

Schedule with_choice(const Schedule &base, const std::string &func, const FuncChoice &c) {
  Schedule s = base;
  s.tile(func, c.tile_m, c.tile_n, 64)
      .stages(func, c.stages)
      .persistent(func, c.persistent)
      .tma_store(func, c.tma_store)
      .cluster(func, c.cluster);
  if (c.raster > 0)
    s.raster(func, c.raster);
  if (c.narrow_tail >= 0)
    s.narrow_tail(func, c.narrow_tail == 1);
  return s;
}

FuncChoice choice_in(const Schedule &s, const std::string &func) {
  const GemmTiling t = s.for_func(func).tiling;
  // An unnamed narrow tail stays unnamed (-1): a chosen schedule's file names what changed.
  return FuncChoice{t.tile_m,    t.tile_n,    t.stages, t.persistent,
                    t.tma_store, t.cluster_m, t.raster, t.narrow_tail ? 1 : -1};
}

std::vector<int> raster_choices() { return {1, 2, 4, 8}; }

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
  // The product of the layer-wide knobs that change speed alone: the rows'
  // format, the block of rows an expert's count is padded to, where the gate
  // multiplies, and two layouts between steps (element-wise results in
  // padded row order; two summed GEMMs as one). Precision and memory
  // choices (bf16 activations and weight gradients, memory reuse,
  // recomputing) change what the layer keeps or how it rounds: the user's,
  // kept from the base.
  for (Permutation p : {Permutation::blocked, Permutation::scattered})
    for (GateFusion g : {GateFusion::combine, GateFusion::epilogue})
      for (int block : {128, 256})
        for (bool padded : {false, true})
          for (bool chain : {false, true}) {
            Schedule s = base;
            s.permutation(p).gate(g).block(block).padded_elementwise(padded).chain_summed_gemms(chain);
            std::string what;
            auto add = [&](bool changed, const std::string &knob) {
              if (changed)
                what += (what.empty() ? "" : " ") + knob;
            };
            add(p != base.permutation(), std::string("permutation(") + permutation_name(p) + ")");
            add(block != base.block(), "block(" + std::to_string(block) + ")");
            add(g != base.gate(), std::string("gate(") + gate_fusion_name(g) + ")");
            add(padded != base.padded_elementwise(),
                std::string("padded_elementwise(") + (padded ? "true" : "false") + ")");
            add(chain != base.chain_summed_gemms(),
                std::string("chain_summed_gemms(") + (chain ? "true" : "false") + ")");
            if (what.empty())
              continue; // the base itself
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

namespace {

// func's candidates among `choices` around `base`: legal, kept by the cheap
// model, and each with plans no earlier one (nor base) has.
FuncCandidates candidates_among(const Pipeline &pipeline, const std::string &output, const Schedule &base,
                                const std::string &func, bool training, const std::vector<FuncChoice> &choices,
                                int64_t tokens) {
  FuncCandidates fc;
  fc.func = func;
  std::map<std::string, std::string> seen; // the plans' text -> the choice that gave them
  // The base's own settings are what the search already has: no candidate.
  seen.emplace(describe_gemm_plans(lowered(pipeline, output, base, training), /*notes=*/false), "the current settings");
  for (const FuncChoice &c : choices) {
    try {
      const KernelProgram p = lowered(pipeline, output, with_choice(base, func, c), training);
      if (std::string why = model_prune(p, func, c, tokens); !why.empty()) {
        fc.pruned.push_back({c, why});
        continue;
      }
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

} // namespace

FuncCandidates candidates_for(const Pipeline &pipeline, const std::string &output, const Schedule &base,
                              const std::string &func, bool training, int64_t tokens) {
  return candidates_among(pipeline, output, base, func, training, func_choices(), tokens);
}

FuncCandidates raster_candidates_for(const Pipeline &pipeline, const std::string &output, const Schedule &base,
                                     const std::string &func, bool training, int64_t tokens) {
  std::vector<FuncChoice> choices;
  const FuncChoice current = choice_in(base, func);
  for (int band : raster_choices())
    if (band != current.raster) {
      FuncChoice c = current;
      c.raster = band;
      choices.push_back(c);
    }
  return candidates_among(pipeline, output, base, func, training, choices, tokens);
}

FuncCandidates narrow_tail_candidates_for(const Pipeline &pipeline, const std::string &output, const Schedule &base,
                                          const std::string &func, bool training, int64_t tokens) {
  FuncChoice c = choice_in(base, func);
  c.narrow_tail = c.narrow_tail == 1 ? 0 : 1;
  return candidates_among(pipeline, output, base, func, training, {c}, tokens);
}

} // namespace moeforge::cuda
