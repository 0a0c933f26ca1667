#include <iostream>

#include "tools/cli.h"

int main(int argc, char **argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    return moeforge::run_cli(args, std::cout, std::cerr);
  } catch (const std::exception &e) {
    std::cerr << "moeforge: internal error: " << e.what() << "\n";
    return 3;
  }
}
