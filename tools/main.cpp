#include <iostream>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "tools/cli.h"

int main(int argc, char **argv) {
#if defined(__GLIBC__)
  // The reference evaluates a routed layer one expert at a time and
  // allocates (and frees) a slice of each weight per expert: tens of MB
  // each. glibc serves those with fresh mmaps, which the kernel zeroes page
  // by page on every use; at real sizes that is most of `run --check`'s time.
  // From the heap, and not trimmed back below 1 GiB, freed slices are reused.
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
#endif
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    return moeforge::run_cli(args, std::cout, std::cerr);
  } catch (const std::exception &e) {
    std::cerr << "moeforge: internal error: " << e.what() << "\n";
    return 3;
  }
}
