// Schedules in Python: the presets, the text form (what `moeforge` schedule
// files hold) and the primitives, chainable as in C++:
//
//   s = mf.scattermoe().tile("h", 128, 128, 64).stages("h", 4).recompute(True)
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <climits>
#include <optional>
#include <string>

#include "bind_checked.h"
#include "lowering/choices_without_effect.h"
#include "lowering/default_schedule.h"
#include "lowering/training.h"
#include "schedules/presets.h"
#include "schedules/schedule.h"

namespace moeforge::python {

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// A primitive's int argument: a Python int past C++'s int is named with its
// bound (the primitive then checks its own range).
int as_int(nb::handle v, const std::string &call, const std::string &arg) {
  return static_cast<int>(checked_integer(v, INT32_MIN, INT32_MAX, call, arg));
}

} // namespace

void bind_schedule(nb::module_ &m) {
  constexpr auto chain = nb::rv_policy::reference_internal;
  nb::enum_<Permutation>(m, "Permutation", "How routed rows reach the expert GEMMs.")
      .value("blocked", Permutation::blocked, "sorted by expert, copied into blocks padded per expert (MegaBlocks)")
      .value("scattered", Permutation::scattered, "gathered and scattered inside the GEMMs (ScatterMoE)");
  nb::enum_<GateFusion>(m, "GateFusion", "Where gate(r) * o(r, i) is taken.")
      .value("combine", GateFusion::combine)
      .value("epilogue", GateFusion::epilogue);
  nb::enum_<MmaKind>(m, "MmaKind", "The tensor-core instruction a GEMM's main loop is built on.")
      .value("mma_sync", MmaKind::mma_sync)
      .value("wgmma", MmaKind::wgmma)
      .value("wgmma_ws", MmaKind::wgmma_ws);
  nb::class_<Schedule>(m, "Schedule", "How a layer is computed: permutation, blocks, tiles, fusion, memory.")
      .def("__copy__", [](const Schedule &s) { return s; })
      .def(
          "__deepcopy__", [](const Schedule &s, nb::handle) { return s; }, "memo"_a)
      .def(nb::init<std::string>(), "name"_a = "custom")
      .def_prop_ro("name", &Schedule::name)
      .def_static(
          "from_text",
          [](const std::string &text, const std::string &source_name) {
            Schedule s = Schedule::from_text(text, source_name);
            // As the CLI refuses an empty file: a text of no primitive is
            // never the schedule someone meant to pass.
            user_check(!s.calls().empty() || s.name() != "custom")
                << source_name << ": the text holds no primitive (only blank lines or comments): write at least "
                << "schedule(\"<name>\") and the primitives to apply, or use moeforge.preset(name)";
            return s;
          },
          "text"_a, "source_name"_a = "<text>",
          "Replays a schedule's text (one primitive call per line, as to_text() prints).")
      .def_static("load", &Schedule::load, "path"_a)
      .def("save", &Schedule::save, "path"_a)
      .def("to_text", &Schedule::to_text)
      .def("validate", &Schedule::validate, "pipeline"_a, "Checks the schedule against a layer (UserError if not).")
      .def("permutation", nb::overload_cast<Permutation>(&Schedule::permutation), "permutation"_a, chain)
      .def("gate", nb::overload_cast<GateFusion>(&Schedule::gate), "fusion"_a, chain)
      .def("mma", nb::overload_cast<const std::string &, MmaKind>(&Schedule::mma), "func"_a, "kind"_a, chain)
      .def(
          "block",
          [](Schedule &s, nb::handle rows) -> Schedule & { return s.block(as_int(rows, "block(...)", "rows")); },
          "rows"_a, chain)
      .def("capacity", nb::overload_cast<double>(&Schedule::capacity), "factor"_a, chain)
      .def("recompute", nb::overload_cast<bool>(&Schedule::recompute), "on"_a = true, chain)
      .def("bf16_activations", nb::overload_cast<bool>(&Schedule::bf16_activations), "on"_a = true, chain)
      .def("reuse_memory", nb::overload_cast<bool>(&Schedule::reuse_memory), "on"_a = true, chain)
      .def("bf16_weight_gradients", nb::overload_cast<bool>(&Schedule::bf16_weight_gradients), "on"_a = true, chain)
      .def("padded_elementwise", nb::overload_cast<bool>(&Schedule::padded_elementwise), "on"_a = true, chain)
      .def("recompute_elementwise", nb::overload_cast<bool>(&Schedule::recompute_elementwise), "on"_a = true, chain)
      .def("gate_gradient_from_dh", nb::overload_cast<bool>(&Schedule::gate_gradient_from_dh), "on"_a = true, chain)
      .def("chain_summed_gemms", nb::overload_cast<bool>(&Schedule::chain_summed_gemms), "on"_a = true, chain)
      .def("atomic_combine", nb::overload_cast<bool>(&Schedule::atomic_combine), "on"_a = true, chain)
      .def("atomic_input_gradient", nb::overload_cast<bool>(&Schedule::atomic_input_gradient), "on"_a = true, chain)
      .def("gather_in_gemms", nb::overload_cast<bool>(&Schedule::gather_in_gemms), "on"_a = true, chain)
      .def("split_pointwise_for_memory", nb::overload_cast<bool>(&Schedule::split_pointwise_for_memory), "on"_a = true,
           chain)
      .def("gradients_over_saved", nb::overload_cast<bool>(&Schedule::gradients_over_saved), "on"_a = true, chain)
      .def("sorted_saved", nb::overload_cast<bool>(&Schedule::sorted_saved), "on"_a = true, chain)
      .def("sorted_gathers", nb::overload_cast<bool>(&Schedule::sorted_gathers), "on"_a = true, chain)
      .def("merge_weight_gradients", nb::overload_cast<bool>(&Schedule::merge_weight_gradients), "on"_a = true, chain)
      .def("gather_upstream_in_gemms", nb::overload_cast<bool>(&Schedule::gather_upstream_in_gemms), "on"_a = true,
           chain)
      .def("bf16_boundary", nb::overload_cast<bool>(&Schedule::bf16_boundary), "on"_a = true, chain)
      .def("fused_attention", nb::overload_cast<bool>(&Schedule::fused_attention), "on"_a = true, chain)
      .def(
          "tile",
          [](Schedule &s, const std::string &f, nb::handle m, nb::handle n, nb::handle k) -> Schedule & {
            const std::string call = "tile(\"" + f + "\", ...)";
            return s.tile(f, as_int(m, call, "m"), as_int(n, call, "n"), as_int(k, call, "k"));
          },
          "func"_a, "m"_a, "n"_a, "k"_a, chain)
      .def(
          "stages",
          [](Schedule &s, const std::string &f, nb::handle n) -> Schedule & {
            return s.stages(f, as_int(n, "stages(\"" + f + "\", ...)", "stages"));
          },
          "func"_a, "stages"_a, chain)
      .def(
          "warps",
          [](Schedule &s, const std::string &f, nb::handle wm, nb::handle wn) -> Schedule & {
            const std::string call = "warps(\"" + f + "\", ...)";
            return s.warps(f, as_int(wm, call, "warps_m"), as_int(wn, call, "warps_n"));
          },
          "func"_a, "warps_m"_a, "warps_n"_a, chain)
      .def("fuse_epilogue", nb::overload_cast<const std::string &, bool>(&Schedule::fuse_epilogue), "func"_a,
           "fuse"_a = true, chain)
      .def(
          "raster",
          [](Schedule &s, const std::string &f, nb::handle n) -> Schedule & {
            return s.raster(f, as_int(n, "raster(\"" + f + "\", ...)", "row_tiles"));
          },
          "func"_a, "row_tiles"_a, chain)
      .def("persistent", nb::overload_cast<const std::string &, bool>(&Schedule::persistent), "func"_a, "on"_a = true,
           chain)
      .def("tma", nb::overload_cast<const std::string &, bool>(&Schedule::tma), "func"_a, "on"_a = true, chain)
      .def("narrow_tail", nb::overload_cast<const std::string &, bool>(&Schedule::narrow_tail), "func"_a, "on"_a = true,
           chain)
      .def("tma_store", nb::overload_cast<const std::string &, bool>(&Schedule::tma_store), "func"_a, "on"_a = true,
           chain)
      .def(
          "fp8",
          [](Schedule &s, const std::string &f, std::optional<std::string> format) -> Schedule & {
            return s.fp8(f, format && *format != "off" ? std::optional<Fp8Format>(parse_fp8_format(*format))
                                                       : std::nullopt);
          },
          "func"_a, "format"_a = "e4m3",
          "The contraction's operands rounded to FP8 (\"e4m3\" or \"e5m2\") in blocks with power-of-two scales "
          "(128 along the sum; one row of a token operand, 128 of a weight); None or \"off\": as stored.",
          chain)
      .def(
          "cluster",
          [](Schedule &s, const std::string &f, nb::handle n) -> Schedule & {
            return s.cluster(f, as_int(n, "cluster(\"" + f + "\", ...)", "row_tiles"));
          },
          "func"_a, "row_tiles"_a, chain)
      .def("__str__", &Schedule::to_text)
      .def("__repr__", [](const Schedule &s) { return "<moeforge.Schedule '" + s.name() + "'>"; });
  m.def("megablocks", &megablocks, "MegaBlocks: rows sorted by expert and padded into blocks.");
  m.def("scattermoe", &scattermoe, "ScatterMoE: gathers and scatters fused into the GEMMs.");
  m.def("preset_names", &preset_names);
  m.def("preset", &preset, "name"_a, "A schedule preset by name (UserError listing them otherwise).");
  m.def(
      "default_schedule",
      [](const Pipeline &pipeline, std::optional<std::vector<Func>> outputs) {
        return default_schedule(pipeline, outputs.value_or(std::vector<Func>{}));
      },
      "pipeline"_a, "outputs"_a = nb::none(),
      "The schedule a layer runs when none is named: the fastest hand-written training schedule's choices "
      "(tuned_wide, lean memory) made by rule for this layer's GEMMs; for the training step of `outputs`, or "
      "the forward alone without them.");
  m.def(
      "not_applied",
      [](const Pipeline &pipeline, const Schedule &schedule, std::optional<std::vector<Func>> outputs) {
        return choices_not_taken(pipeline, schedule, outputs.value_or(std::vector<Func>{}));
      },
      "pipeline"_a, "schedule"_a, "outputs"_a = nb::none(),
      "The choices `schedule` made that this layer's program does not take, one line each with why (a Func's GEMM "
      "that cannot use them, a layer-wide choice that changes nothing here); empty when every choice applies. With "
      "`outputs`, the training step's program (forward and backward of those Funcs), else the forward's.");
  m.def(
      "output_dtypes",
      [](const Pipeline &pipeline, const std::vector<Func> &outputs, const Schedule &schedule) {
        const TrainingProgram t = lower_training(pipeline, outputs, schedule);
        std::vector<std::string> names;
        for (const std::string &o : t.outputs)
          names.push_back(dtype_name(t.program.tensor(o).dtype));
        return names;
      },
      "pipeline"_a, "outputs"_a, "schedule"_a,
      "The dtype ('bf16', 'f32') the training step stores each of `outputs` in, as the schedule decides "
      "(bf16_boundary); a Func's own dtype is its value's, f32 for sums.");
}

} // namespace moeforge::python
