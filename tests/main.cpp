#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdlib>

int main(int argc, char **argv) {
  // Where a driver is installed, NVRTC hands PTX to the driver's JIT, whose
  // on-disk cache (~/.nv/ComputeCache) then answers a kernel it has seen in
  // an earlier process without running ptxas, and so without ptxas' report
  // of registers and spills, which the tests check for every kernel. The
  // tests turn that cache off before any CUDA call, unless the environment
  // already says.
  setenv("CUDA_CACHE_DISABLE", "1", /*overwrite=*/0);
  return doctest::Context(argc, argv).run();
}
