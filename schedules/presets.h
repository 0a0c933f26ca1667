// Named schedules that reproduce the anchors we measure against, and the one
// way a command line picks a schedule (a preset name or a saved file).
#pragma once

#include <string>
#include <vector>

#include "schedules/schedule.h"

namespace moeforge {

// MegaBlocks: routed rows sorted by expert and padded into blocks of 128,
// GEMM tiles 128x128x32 with 4 stages and 2x4 warps, activations fused into
// the GEMM epilogues, the gate applied in the combine.
Schedule megablocks();

// ScatterMoE: no padded copy; rows are gathered and scattered inside the GEMM
// loads and stores (blocks of 128 index the tiles), same tiling, and the gate
// applied in the last GEMM's epilogue.
Schedule scattermoe();

// Names of every preset, for listings and error messages.
std::vector<std::string> preset_names();

// The named preset; an unknown name is a UserError listing the presets.
Schedule preset(const std::string &name);

// A preset name, else the path of a schedule file written by Schedule::save.
Schedule schedule_from_arg(const std::string &arg);

} // namespace moeforge
