#include <doctest/doctest.h>
#include <sstream>
#include "tools/cli.h"
TEST_CASE("smoke: moe_mlp runs") {
  std::ostringstream out, err;
  CHECK(moeforge::run_cli({"run", "moe_mlp", "--check"}, out, err) == 0);
  MESSAGE(out.str());
}
