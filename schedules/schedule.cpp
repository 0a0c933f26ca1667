#include "schedules/schedule.h"

#include <charconv>
#include <cmath>
#include <initializer_list>
#include <sstream>

#include "dsl/error.h"

namespace moeforge {

namespace {

bool one_of(int v, std::initializer_list<int> allowed) {
  for (int a : allowed)
    if (v == a)
      return true;
  return false;
}

// Names travel through the text form inside double quotes, so a quote, a
// backslash or a line break in one could not be replayed.
bool printable_name(const std::string &s) {
  if (s.empty())
    return false;
  for (char c : s)
    if (c == '"' || c == '\\' || static_cast<unsigned char>(c) < 0x20)
      return false;
  return true;
}

std::string func_label(const std::string &func) {
  return func == Schedule::all_funcs ? std::string("the default ('*')") : "'" + func + "'";
}

std::string quoted(const std::string &s) { return "\"" + s + "\""; }

// The shortest text that reads back as the same double, so that a traced
// capacity(1.25) replays exactly.
std::string format_number(double v) {
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return ec == std::errc() ? std::string(buf, end) : std::to_string(v);
}

void check_func_name(const std::string &call, const std::string &func) {
  user_check(printable_name(func)) << call << ": '" << func
                                   << "' is not a usable Func name: pass a Func's name, or \"*\" for every "
                                      "contraction (names cannot be empty or hold quotes, backslashes or "
                                      "line breaks)";
}

} // namespace

const char *permutation_name(Permutation p) {
  switch (p) {
  case Permutation::blocked:
    return "blocked";
  case Permutation::scattered:
    return "scattered";
  }
  return "?";
}

const char *mma_kind_name(MmaKind m) {
  switch (m) {
  case MmaKind::mma_sync:
    return "mma_sync";
  case MmaKind::wgmma:
    return "wgmma";
  case MmaKind::wgmma_ws:
    return "wgmma_ws";
  }
  return "?";
}

const char *gate_fusion_name(GateFusion g) {
  switch (g) {
  case GateFusion::combine:
    return "combine";
  case GateFusion::epilogue:
    return "epilogue";
  }
  return "?";
}

Schedule::Schedule(std::string name) : name_(std::move(name)) {
  user_check(printable_name(name_)) << "schedule name '" << name_
                                    << "' is not usable: give a non-empty label without quotes, backslashes or "
                                       "line breaks (e.g. \"megablocks\")";
}

Schedule &Schedule::permutation(Permutation p) {
  std::string call = std::string("permutation(") + permutation_name(p) + ")";
  user_check(p == Permutation::blocked || p == Permutation::scattered)
      << "permutation(" << static_cast<int>(p) << "): unknown strategy: use Permutation::blocked or "
      << "Permutation::scattered";
  permutation_ = p;
  calls_.push_back(call);
  return *this;
}

Schedule &Schedule::block(int rows) {
  std::string call = "block(" + std::to_string(rows) + ")";
  user_check(one_of(rows, {64, 128, 256}))
      << call << ": block size " << rows << " is not supported: use 64, 128 or 256";
  block_ = rows;
  calls_.push_back(call);
  return *this;
}

Schedule &Schedule::capacity(double factor) {
  std::string call = "capacity(" + format_number(factor) + ")";
  user_check(!std::isnan(factor) && factor > 0 && factor <= 1024)
      << call << ": the capacity factor must be "
      << (factor > 1024 ? "at most 1024, where no expert drops a pair anyway" : "a positive number")
      << " (1.0: an expert takes its even share T * k / E of the pairs; 1.25 or 2.0 leave room for imbalance); "
      << "for no dropping, do not call capacity()";
  capacity_ = factor;
  calls_.push_back(call);
  return *this;
}

Schedule &Schedule::expert_parallel(int ranks) {
  std::string call = "expert_parallel(" + std::to_string(ranks) + ")";
  user_check(ranks >= 1 && ranks <= 1024)
      << call << ": the experts spread over 1 to 1024 ranks (GPUs); 1 keeps the layer on one GPU";
  ranks_ = ranks;
  calls_.push_back(call);
  return *this;
}

Schedule &Schedule::exchange_chunks(int chunks) {
  std::string call = "exchange_chunks(" + std::to_string(chunks) + ")";
  user_check(chunks >= 1 && chunks <= 1024)
      << call << ": the forward's rows cross in 1 to 1024 rounds, each a group of a rank's experts; 1 sends them "
      << "at once";
  chunks_ = chunks;
  calls_.push_back(call);
  return *this;
}

Schedule Schedule::on_one_rank() const {
  Schedule s = *this;
  s.ranks_ = 1;
  s.chunks_ = 1;
  s.calls_.clear();
  for (const std::string &c : calls_)
    if (c.rfind("expert_parallel(", 0) != 0 && c.rfind("exchange_chunks(", 0) != 0)
      s.calls_.push_back(c);
  return s;
}

Schedule &Schedule::gate(GateFusion g) {
  std::string call = std::string("gate(") + gate_fusion_name(g) + ")";
  user_check(g == GateFusion::combine || g == GateFusion::epilogue)
      << "gate(" << static_cast<int>(g) << "): unknown gate fusion: use GateFusion::combine or "
      << "GateFusion::epilogue";
  gate_ = g;
  calls_.push_back(call);
  return *this;
}

Schedule &Schedule::flag(bool &field, const char *primitive, bool on) {
  field = on;
  calls_.push_back(std::string(primitive) + "(" + (on ? "true" : "false") + ")");
  return *this;
}

Schedule &Schedule::bf16_activations(bool on) { return flag(bf16_activations_, "bf16_activations", on); }

Schedule &Schedule::reuse_memory(bool on) { return flag(reuse_memory_, "reuse_memory", on); }

Schedule &Schedule::bf16_weight_gradients(bool on) { return flag(bf16_weight_gradients_, "bf16_weight_gradients", on); }

Schedule &Schedule::padded_elementwise(bool on) { return flag(padded_elementwise_, "padded_elementwise", on); }

Schedule &Schedule::recompute_elementwise(bool on) { return flag(recompute_elementwise_, "recompute_elementwise", on); }

Schedule &Schedule::gate_gradient_from_dh(bool on) { return flag(gate_gradient_from_dh_, "gate_gradient_from_dh", on); }
Schedule &Schedule::chain_summed_gemms(bool on) { return flag(chain_summed_gemms_, "chain_summed_gemms", on); }
Schedule &Schedule::atomic_combine(bool on) { return flag(atomic_combine_, "atomic_combine", on); }
Schedule &Schedule::atomic_input_gradient(bool on) { return flag(atomic_input_gradient_, "atomic_input_gradient", on); }
Schedule &Schedule::gather_in_gemms(bool on) { return flag(gather_in_gemms_, "gather_in_gemms", on); }
Schedule &Schedule::split_pointwise_for_memory(bool on) {
  return flag(split_pointwise_for_memory_, "split_pointwise_for_memory", on);
}
Schedule &Schedule::gradients_over_saved(bool on) { return flag(gradients_over_saved_, "gradients_over_saved", on); }
Schedule &Schedule::sorted_saved(bool on) { return flag(sorted_saved_, "sorted_saved", on); }
Schedule &Schedule::sorted_gathers(bool on) { return flag(sorted_gathers_, "sorted_gathers", on); }
Schedule &Schedule::merge_weight_gradients(bool on) {
  return flag(merge_weight_gradients_, "merge_weight_gradients", on);
}
Schedule &Schedule::gather_upstream_in_gemms(bool on) {
  return flag(gather_upstream_in_gemms_, "gather_upstream_in_gemms", on);
}
Schedule &Schedule::bf16_boundary(bool on) { return flag(bf16_boundary_, "bf16_boundary", on); }
Schedule &Schedule::fused_attention(bool on) { return flag(fused_attention_, "fused_attention", on); }

Schedule &Schedule::recompute(bool on) { return flag(recompute_, "recompute", on); }

Schedule &Schedule::tile(const std::string &func, int m, int n, int k) {
  std::ostringstream c;
  c << "tile(" << quoted(func) << ", " << m << ", " << n << ", " << k << ")";
  std::string call = c.str();
  check_func_name(call, func);
  user_check(one_of(m, {64, 128, 256})) << call << ": tile_m " << m << " of " << func_label(func)
                                        << " is not supported: use 64, 128 or 256";
  user_check(one_of(n, {64, 128, 256})) << call << ": tile_n " << n << " of " << func_label(func)
                                        << " is not supported: use 64, 128 or 256";
  user_check(one_of(k, {32, 64})) << call << ": tile_k " << k << " of " << func_label(func)
                                  << " is not supported: use 32 or 64";
  Overrides patch;
  patch.tile_m = m;
  patch.tile_n = n;
  patch.tile_k = k;
  commit(call, "tile", func, patch);
  return *this;
}

Schedule &Schedule::stages(const std::string &func, int s) {
  std::string call = "stages(" + quoted(func) + ", " + std::to_string(s) + ")";
  check_func_name(call, func);
  // One stage cannot overlap the next tile's loads with this tile's math;
  // past 8 the returns vanish while shared memory runs out.
  user_check(s >= 2 && s <= 8) << call << ": " << s << " stages for " << func_label(func)
                               << " is not supported: use 2 to 8";
  Overrides patch;
  patch.stages = s;
  commit(call, "stages", func, patch);
  return *this;
}

Schedule &Schedule::warps(const std::string &func, int warps_m, int warps_n) {
  std::ostringstream c;
  c << "warps(" << quoted(func) << ", " << warps_m << ", " << warps_n << ")";
  std::string call = c.str();
  check_func_name(call, func);
  // 4 warps (one warpgroup) or 8 (two): what the Hopper kernels are built for.
  bool ok = warps_m >= 1 && warps_n >= 1 && warps_m <= 8 && warps_n <= 8 && one_of(warps_m * warps_n, {4, 8});
  user_check(ok) << call << ": warps " << warps_m << "x" << warps_n << " for " << func_label(func)
                 << " is not supported: use 4 or 8 warps in all (1x4, 2x2, 4x1, 1x8, 2x4, 4x2 or 8x1)";
  Overrides patch;
  patch.warps_m = warps_m;
  patch.warps_n = warps_n;
  commit(call, "warps", func, patch);
  return *this;
}

Schedule &Schedule::func_flag(std::optional<bool> Overrides::*field, const char *primitive, const std::string &func,
                              bool on) {
  std::string call = std::string(primitive) + "(" + quoted(func) + ", " + (on ? "true" : "false") + ")";
  check_func_name(call, func);
  Overrides patch;
  patch.*field = on;
  commit(call, primitive, func, patch);
  return *this;
}

Schedule &Schedule::fuse_epilogue(const std::string &func, bool fuse) {
  return func_flag(&Overrides::fuse_epilogue, "fuse_epilogue", func, fuse);
}

Schedule &Schedule::mma(const std::string &func, MmaKind kind) {
  std::string call = "mma(" + quoted(func) + ", " + mma_kind_name(kind) + ")";
  check_func_name(call, func);
  user_check(kind == MmaKind::mma_sync || kind == MmaKind::wgmma || kind == MmaKind::wgmma_ws)
      << "mma(" << static_cast<int>(kind) << "): unknown instruction: use MmaKind::mma_sync, wgmma or wgmma_ws";
  Overrides patch;
  patch.mma = kind;
  commit(call, "mma", func, patch);
  return *this;
}

Schedule &Schedule::raster(const std::string &func, int row_tiles) {
  std::string call = "raster(" + quoted(func) + ", " + std::to_string(row_tiles) + ")";
  check_func_name(call, func);
  user_check(row_tiles >= 1 && row_tiles <= 64)
      << call << ": " << row_tiles << " row tiles per band for " << func_label(func)
      << " is not supported: use 1 to 64 (1 walks the tiles row by row)";
  Overrides patch;
  patch.raster = row_tiles;
  commit(call, "raster", func, patch);
  return *this;
}

Schedule &Schedule::persistent(const std::string &func, bool on) {
  return func_flag(&Overrides::persistent, "persistent", func, on);
}

Schedule &Schedule::tma(const std::string &func, bool on) { return func_flag(&Overrides::tma, "tma", func, on); }

Schedule &Schedule::tma_store(const std::string &func, bool on) {
  return func_flag(&Overrides::tma_store, "tma_store", func, on);
}

Schedule &Schedule::narrow_tail(const std::string &func, bool on) {
  return func_flag(&Overrides::narrow_tail, "narrow_tail", func, on);
}

Schedule &Schedule::cluster(const std::string &func, int row_tiles) {
  std::string call = "cluster(" + quoted(func) + ", " + std::to_string(row_tiles) + ")";
  check_func_name(call, func);
  user_check(row_tiles == 1 || row_tiles == 2)
      << call << ": clusters of " << row_tiles << " row tiles are not supported: use 1 (none) or 2";
  Overrides patch;
  patch.cluster_m = row_tiles;
  commit(call, "cluster", func, patch);
  return *this;
}

Schedule &Schedule::fp8(const std::string &func, std::optional<Fp8Format> format) {
  std::string call = "fp8(" + quoted(func) + ", " + quoted(format ? fp8_format_name(*format) : "off") + ")";
  check_func_name(call, func);
  Overrides patch;
  patch.fp8 = format;
  commit(call, "fp8", func, patch);
  return *this;
}

FuncSchedule Schedule::apply(FuncSchedule base, const Overrides &o) {
  GemmTiling &t = base.tiling;
  t.tile_m = o.tile_m.value_or(t.tile_m);
  t.tile_n = o.tile_n.value_or(t.tile_n);
  t.tile_k = o.tile_k.value_or(t.tile_k);
  t.stages = o.stages.value_or(t.stages);
  t.warps_m = o.warps_m.value_or(t.warps_m);
  t.warps_n = o.warps_n.value_or(t.warps_n);
  t.mma = o.mma.value_or(t.mma);
  t.raster = o.raster.value_or(t.raster);
  t.persistent = o.persistent.value_or(t.persistent);
  t.tma = o.tma.value_or(t.tma);
  t.tma_store = o.tma_store.value_or(t.tma_store);
  t.cluster_m = o.cluster_m.value_or(t.cluster_m);
  t.narrow_tail = o.narrow_tail.value_or(t.narrow_tail);
  base.fuse_epilogue = o.fuse_epilogue.value_or(base.fuse_epilogue);
  if (o.fp8)
    base.fp8 = *o.fp8;
  return base;
}

FuncSchedule Schedule::for_func(const std::string &func) const {
  auto it = overrides_.find(func);
  if (it == overrides_.end())
    return default_;
  FuncSchedule f = apply(default_, it->second);
  const Overrides &o = it->second;
  f.tiling.named = {o.persistent.value_or(false), o.tma.value_or(false), o.tma_store.value_or(false),
                    o.cluster_m.value_or(1) > 1,  o.warps_m.has_value(), o.narrow_tail.value_or(false)};
  return f;
}

void Schedule::commit(const std::string &call, const std::string &primitive, const std::string &func,
                      const Overrides &patch) {
  // Work on a copy so that a call that fails its checks leaves *this as it
  // was; the copy leaves out the recorded calls, which only grow (copying
  // them made a file of n calls take n^2 / 2 string copies to replay).
  std::vector<std::string> calls = std::move(calls_);
  calls_.clear();
  Schedule next = *this;
  calls_ = std::move(calls);
  if (func == all_funcs) {
    next.default_ = apply(next.default_, patch);
  } else {
    Overrides &o = next.overrides_[func];
    auto merge = [](auto &field, const auto &value) {
      if (value)
        field = value;
    };
    merge(o.tile_m, patch.tile_m);
    merge(o.tile_n, patch.tile_n);
    merge(o.tile_k, patch.tile_k);
    merge(o.stages, patch.stages);
    merge(o.warps_m, patch.warps_m);
    merge(o.warps_n, patch.warps_n);
    merge(o.fuse_epilogue, patch.fuse_epilogue);
    merge(o.mma, patch.mma);
    merge(o.raster, patch.raster);
    merge(o.persistent, patch.persistent);
    merge(o.tma, patch.tma);
    merge(o.tma_store, patch.tma_store);
    merge(o.cluster_m, patch.cluster_m);
    merge(o.narrow_tail, patch.narrow_tail);
    merge(o.fp8, patch.fp8);
    if (next.named_by_.emplace(func, primitive).second)
      next.funcs_.push_back(func);
  }
  next.check_tilings(call, func);
  next.calls_ = std::move(calls_);
  next.calls_.push_back(call);
  *this = std::move(next);
}

// Tile, stages and warps are set by separate calls but constrain each other,
// so every call that changes one rechecks the combination of each Func it
// affects: a change to "*" reaches every Func that does not override it.
void Schedule::check_tilings(const std::string &call, const std::string &changed_func) const {
  std::vector<std::string> affected;
  if (changed_func == all_funcs) {
    affected.push_back(all_funcs);
    affected.insert(affected.end(), funcs_.begin(), funcs_.end());
  } else {
    affected.push_back(changed_func);
  }
  for (const std::string &f : affected) {
    GemmTiling t = for_func(f).tiling;
    std::string who = func_label(f);
    if (f != changed_func)
      who += " (it overrides part of the default)";
    if (t.mma == MmaKind::mma_sync) {
      // Tensor-core MMAs are 16 rows or columns wide: each warp needs a whole
      // number of them.
      user_check(t.tile_m % (t.warps_m * 16) == 0)
          << call << ": warps " << t.warps_m << "x" << t.warps_n << " do not fit tile " << t.tile_m << "x" << t.tile_n
          << "x" << t.tile_k << " of " << who << ": tile_m / warps_m = " << t.tile_m << " / " << t.warps_m << " = "
          << t.tile_m / t.warps_m << " rows per warp, not a multiple of 16: use warps_m <= " << t.tile_m / 16
          << " or tile_m >= " << std::max(64, t.warps_m * 16) << " (set warps before tiles when shrinking both)";
      user_check(t.tile_n % (t.warps_n * 16) == 0)
          << call << ": warps " << t.warps_m << "x" << t.warps_n << " do not fit tile " << t.tile_m << "x" << t.tile_n
          << "x" << t.tile_k << " of " << who << ": tile_n / warps_n = " << t.tile_n << " / " << t.warps_n << " = "
          << t.tile_n / t.warps_n << " columns per warp, not a multiple of 16: use warps_n <= " << t.tile_n / 16
          << " or tile_n >= " << std::max(64, t.warps_n * 16) << " (set warps before tiles when shrinking both)";
    } else {
      // wgmma lays its warps out itself (one warpgroup per 64 rows), so the
      // warps setting does not apply.
      // A warpgroup issues m64 wgmmas over 128-byte swizzled rows of 64 bf16.
      user_check(t.tile_k == 64 && (t.tile_m == 64 || t.tile_m == 128))
          << call << ": wgmma for " << who << " needs tile_k 64 and tile_m 64 or 128, but the tile is " << t.tile_m
          << "x" << t.tile_n << "x" << t.tile_k << ": use tile(\"" << f << "\", 128, " << t.tile_n
          << ", 64) (set the tile before mma(..., wgmma))";
      user_check(t.stages >= 3) << call << ": wgmma for " << who
                                << " keeps one group of MMAs in flight while refilling a stage: use stages >= 3";
    }
    int per_stage = t.shared_bytes() / t.stages;
    int fit = max_shared_bytes / per_stage;
    std::ostringstream fix;
    if (fit >= 2)
      fix << "use stages <= " << fit << " or a smaller tile (when changing both, call stages() first)";
    else
      fix << "use a smaller tile (tile_k 32, or smaller tile_m / tile_n)";
    user_check(t.shared_bytes() <= max_shared_bytes)
        << call << ": tile " << t.tile_m << "x" << t.tile_n << "x" << t.tile_k << " with " << t.stages << " stages of "
        << who << " needs " << t.shared_bytes() << " bytes of shared memory (" << t.stages << " x (" << t.tile_m << "x"
        << t.tile_k << " + " << t.tile_k << "x" << t.tile_n << ") x 2 bytes), more than the " << max_shared_bytes
        << " bytes (227 KiB) of a Hopper thread block: " << fix.str();
  }
}

} // namespace moeforge
