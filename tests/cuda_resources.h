// Shared by the CUDA tests that compile without a GPU: ptxas' resource report
// of every generated kernel is within what one SM gives a block, and one
// kernel's source.
#pragma once

#include <doctest/doctest.h>

#include <string>

#include "backends/cuda/runtime/layer.h"

namespace moeforge::testing {

// No spills or stack, registers and shared memory within an SM's budget;
// with `whole_wgmma`, no kernel whose wgmmas ptxas serialised (a
// performance loss it reports as warning C7520: some kernels at the tests'
// small shapes have it, where K is a k-tile or two).
inline void check_resources(const cuda::CompiledLayer &c, const std::string &what, bool whole_wgmma = false) {
  REQUIRE(!c.source.kernels.empty());
  for (const GeneratedKernel &k : c.source.kernels) {
    INFO(what << ": kernel " << k.name);
    const cuda::ResourceReport *r = c.resources_of(k.name);
    REQUIRE(r != nullptr);
    CHECK(r->spill_store_bytes == 0);
    CHECK(r->spill_load_bytes == 0);
    CHECK(r->stack_frame_bytes == 0);
    if (whole_wgmma)
      CHECK(!r->wgmma_serialized);
    CHECK(r->registers > 0);
    CHECK(r->registers <= 255);
    // An SM sub-partition holds 16384 registers and takes every fourth warp
    // of a block, allocated in steps of 8 registers a thread: 9 warps of 224
    // registers (21504 on one partition) do not launch though 9 x 32 x 224 is
    // under the SM's 65536.
    const int warps = (k.threads + 31) / 32, per_partition = (warps + 3) / 4;
    CHECK(per_partition * 32 * ((r->registers + 7) / 8 * 8) <= 16384);
    CHECK(k.shared_bytes + r->shared_bytes <= Schedule::max_shared_bytes);
  }
}

// The source of one generated kernel, from its signature to the next kernel.
inline std::string kernel_source(const cuda::CompiledLayer &c, const std::string &name) {
  const std::string &src = c.source.source;
  size_t at = src.find(" " + name + "(\n");
  REQUIRE(at != std::string::npos);
  return src.substr(at, src.find("extern \"C\"", at) - at);
}

} // namespace moeforge::testing
