// The host oracle of the device routing: a golden example, the MoE edge
// cases and a sweep, each checked against the format's definitions
// (verify_routing_tables), plus the top-k rule against the Eigen reference.
#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backends/reference/evaluate.h"
#include "dsl/error.h"
#include "examples/examples.h"
#include "runtime/routing_host.h"

using namespace moeforge;

namespace {

std::string joined(const std::vector<std::string> &v) {
  std::string s;
  for (const std::string &x : v)
    s += x + "\n";
  return s;
}

void check_tables(const RoutingShape &shape, const std::vector<int32_t> &expert) {
  CAPTURE(shape.to_string());
  RoutingTables t = route_on_host(shape, expert);
  std::vector<std::string> violations = verify_routing_tables(shape, t);
  CHECK_MESSAGE(violations.empty(), joined(violations));
}

std::vector<int32_t> random_experts(const RoutingShape &s, std::mt19937 &rng) {
  // Distinct experts per token, as top-k makes them.
  std::vector<int32_t> out, perm(s.experts);
  for (int64_t t = 0; t < s.tokens; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    out.insert(out.end(), perm.begin(), perm.begin() + s.k);
  }
  return out;
}

} // namespace

TEST_CASE("routing oracle on a worked example") {
  RoutingShape s{3, 3, 1, 2}; // T=3 E=3 k=1 block=2
  RoutingTables t = route_on_host(s, {2, 0, 2});
  CHECK(t.counts == std::vector<int32_t>{1, 0, 2});
  CHECK(t.offsets == std::vector<int32_t>{0, 2, 2, 4});
  CHECK(t.offsets_unpadded == std::vector<int32_t>{0, 1, 1, 3});
  CHECK(t.pair_pos == std::vector<int32_t>{2, 0, 3});
  // max_padded_rows = (ceil(3/2) + 3) * 2 = 10
  CHECK(t.sorted_pair == std::vector<int32_t>{1, -1, 0, 2, -1, -1, -1, -1, -1, -1});
  CHECK(t.num_tiles == 2);
  CHECK(t.tile_expert == std::vector<int32_t>{0, 2, -1, -1, -1});
  CHECK(t.tile_row_start == std::vector<int32_t>{0, 2, -1, -1, -1});
  CHECK(t.tile_rows == std::vector<int32_t>{1, 2, 0, 0, 0});
  CHECK(verify_routing_tables(s, t).empty());
}

TEST_CASE("routing tiles come pair-aligned") {
  // n = (3, 2, 1) tiles per expert (bs = 2): e0's pair, e1's pair, then the
  // tails of e0 and e2 together; tiles 2m, 2m + 1 are one expert's or two tails.
  RoutingShape s{10, 3, 1, 2};
  RoutingTables t = route_on_host(s, {0, 1, 0, 0, 1, 2, 0, 1, 0, 1});
  CHECK(t.num_tiles == 6);
  CHECK(std::vector<int32_t>(t.tile_expert.begin(), t.tile_expert.begin() + 6) ==
        std::vector<int32_t>{0, 0, 1, 1, 0, 2});
  CHECK(std::vector<int32_t>(t.tile_row_start.begin(), t.tile_row_start.begin() + 6) ==
        std::vector<int32_t>{0, 2, 6, 8, 4, 10});
  CHECK(std::vector<int32_t>(t.tile_rows.begin(), t.tile_rows.begin() + 6) == std::vector<int32_t>{2, 2, 2, 2, 1, 1});
  CHECK(verify_routing_tables(s, t).empty());
  // A tail without a partner comes last: n = (1, 2).
  RoutingShape s2{5, 2, 1, 2};
  RoutingTables t2 = route_on_host(s2, {1, 0, 1, 1, 1});
  CHECK(std::vector<int32_t>(t2.tile_row_start.begin(), t2.tile_row_start.begin() + 3) ==
        std::vector<int32_t>{2, 4, 0});
  // The row-order table of before is now a violation.
  std::swap(t.tile_row_start[3], t.tile_row_start[4]);
  std::swap(t.tile_expert[3], t.tile_expert[4]);
  std::swap(t.tile_rows[3], t.tile_rows[4]);
  CHECK(!verify_routing_tables(s, t).empty());
}

TEST_CASE("routing: the pair-aligned tile order from the tile counts alone") {
  // n = (3, 2, 1): e0's pair, e1's pair, the tails of e0 and e2.
  std::vector<TileSlot> order = pair_aligned_tiles({3, 2, 1});
  std::vector<int32_t> experts, index;
  for (const TileSlot &t : order) {
    experts.push_back(t.expert);
    index.push_back(t.index);
  }
  CHECK(experts == std::vector<int32_t>{0, 0, 1, 1, 0, 2});
  CHECK(index == std::vector<int32_t>{0, 1, 0, 1, 2, 0});
  CHECK(pair_aligned_tiles({0, 0}).empty());
  // What the routing writes for random routes, experts with no pairs among them.
  std::mt19937 rng(5);
  for (int trial = 0; trial < 50; ++trial) {
    const int E = 1 + trial % 9, bs = 64;
    RoutingShape shape{1 + static_cast<int64_t>(rng() % 700), E, 1, bs};
    std::vector<int32_t> expert(shape.pairs());
    for (int32_t &e : expert)
      e = static_cast<int32_t>(rng() % E) / 2 * 2; // odd experts get nothing
    RoutingTables t = route_on_host(shape, expert);
    std::vector<int32_t> tiles_of(E);
    for (int e = 0; e < E; ++e)
      tiles_of[e] = (t.counts[e] + bs - 1) / bs;
    order = pair_aligned_tiles(tiles_of);
    REQUIRE(static_cast<int32_t>(order.size()) == t.num_tiles);
    for (size_t i = 0; i < order.size(); ++i) {
      CHECK(order[i].expert == t.tile_expert[i]);
      CHECK(t.offsets[order[i].expert] + order[i].index * bs == t.tile_row_start[i]);
    }
  }
}

TEST_CASE("routing oracle on the MoE edge cases") {
  std::mt19937 rng(7);
  SUBCASE("an expert with no pairs") {
    RoutingShape s{100, 4, 1, 64};
    std::vector<int32_t> e(100);
    for (int i = 0; i < 100; ++i)
      e[i] = i % 2 == 0 ? 0 : 3; // experts 1 and 2 empty
    check_tables(s, e);
    RoutingTables t = route_on_host(s, e);
    CHECK(t.counts[1] == 0);
    CHECK(t.offsets[1] == t.offsets[2]);
  }
  SUBCASE("every pair on one expert") {
    RoutingShape s{300, 8, 1, 128};
    check_tables(s, std::vector<int32_t>(300, 5));
    CHECK(route_on_host(s, std::vector<int32_t>(300, 5)).num_tiles == 3);
  }
  SUBCASE("k = E") {
    RoutingShape s{37, 6, 6, 64};
    check_tables(s, random_experts(s, rng));
  }
  SUBCASE("one token") {
    RoutingShape s{1, 8, 2, 256};
    check_tables(s, random_experts(s, rng));
  }
  SUBCASE("T not a multiple of the block") {
    RoutingShape s{1000, 16, 2, 128};
    check_tables(s, random_experts(s, rng));
  }
  SUBCASE("no tokens") {
    RoutingShape s{0, 8, 2, 64};
    RoutingTables t = route_on_host(s, {});
    CHECK(t.num_tiles == 0);
    CHECK(t.tile_expert == std::vector<int32_t>(8, -1));
    CHECK(verify_routing_tables(s, t).empty());
  }
  SUBCASE("256 experts") {
    RoutingShape s{513, 256, 8, 64};
    check_tables(s, random_experts(s, rng));
  }
}

TEST_CASE("routing oracle sweep over shapes") {
  std::mt19937 rng(11);
  for (int64_t T : {1, 2, 63, 64, 65, 200, 1031})
    for (int E : {1, 2, 7, 64})
      for (int k : {1, 2, 8})
        for (int bs : {1, 3, 64, 128}) {
          if (k > E)
            continue;
          RoutingShape s{T, E, k, bs};
          check_tables(s, random_experts(s, rng));
        }
}

TEST_CASE("routing: verify_routing_tables finds broken tables") {
  RoutingShape s{8, 2, 1, 4};
  std::vector<int32_t> e = {0, 1, 0, 0, 1, 1, 0, 1};
  RoutingTables good = route_on_host(s, e);
  REQUIRE(verify_routing_tables(s, good).empty());

  SUBCASE("unstable order within an expert") {
    RoutingTables t = good;
    std::swap(t.pair_pos[0], t.pair_pos[2]); // both expert 0
    std::swap(t.sorted_pair[t.pair_pos[0]], t.sorted_pair[t.pair_pos[2]]);
    std::string v = joined(verify_routing_tables(s, t));
    CHECK(v.find("pair_pos[0] = 1, expected 0 (expert 0, stable order)") != std::string::npos);
  }
  SUBCASE("a padding row not -1") {
    RoutingTables t = good;
    t.sorted_pair.back() = 3;
    CHECK(joined(verify_routing_tables(s, t)).find("at a padding row, expected -1") != std::string::npos);
  }
  SUBCASE("a tile's valid rows") {
    RoutingTables t = good;
    t.tile_rows[0] = 3;
    CHECK(joined(verify_routing_tables(s, t)).find("tile_rows[0] = 3, expected 4") != std::string::npos);
  }
  SUBCASE("a stale tile past num_tiles") {
    RoutingTables t = good;
    t.tile_expert.back() = 0;
    CHECK(joined(verify_routing_tables(s, t)).find("past num_tiles") != std::string::npos);
  }
}

TEST_CASE("routing shape errors name the field") {
  auto message = [](RoutingShape s) {
    try {
      s.check();
    } catch (const moeforge::UserError &e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(message({10, 300, 2, 64}) ==
        "routing with E = 300 experts: the routing of the compiled backends (CPU and CUDA) supports 1 to 256");
  CHECK(message({10, 8, 9, 64}) == "routing with k = 9 of E = 8 experts: k must be between 1 and E");
  CHECK(message({10, 8, 2, 0}) == "routing with block size 0: it must be positive (64, 128 or 256)");
  CHECK_THROWS_WITH_AS(route_on_host({2, 4, 1, 64}, {0, 4}), "route_on_host: expert id 4 is outside 0..3",
                       moeforge::UserError);
}

TEST_CASE("routing: host top-k breaks ties toward the lower expert") {
  RoutingShape s{2, 5, 3, 64};
  std::vector<float> probs = {0.1f, 0.3f, 0.1f, 0.3f, 0.2f, //
                              0.2f, 0.2f, 0.2f, 0.2f, 0.2f};
  HostTopK k = top_k_on_host(s, probs);
  CHECK(k.expert == std::vector<int32_t>{1, 3, 4, 0, 1, 2});
  CHECK(k.gate == std::vector<float>{0.3f, 0.3f, 0.2f, 0.2f, 0.2f, 0.2f});
}

TEST_CASE("routing: host top-k routes exactly like the Eigen reference") {
  moeforge::ExampleShape shape;
  shape.tokens = 97;
  shape.experts = 16;
  shape.topk = 4;
  moeforge::Example ex = moeforge::make_example("moe_mlp", shape);
  moeforge::EvalResult res = moeforge::evaluate(ex.pipeline, ex.random_inputs(shape, 3), moeforge::Precision::f32);
  const moeforge::HostTensor &p = res["probs"];
  REQUIRE(p.shape == std::vector<int64_t>{97, 16});
  std::vector<float> probs(p.data.begin(), p.data.end()); // f32 values, exact
  HostTopK k = top_k_on_host({97, 16, 4, 64}, probs);
  CHECK(k.expert == res.routes.at(ex.route).expert);
}

TEST_CASE("routing format: every array's extent is what the host tables hold, names distinct") {
  std::mt19937 rng(7);
  for (int64_t capacity : {-1, 20}) {
    RoutingShape s;
    s.tokens = 100;
    s.experts = 8;
    s.k = 2;
    s.block = 64;
    s.capacity = capacity;
    std::vector<int32_t> expert(static_cast<size_t>(s.pairs()));
    for (int32_t &e : expert)
      e = static_cast<int32_t>(rng() % 8);
    RoutingTables t = route_on_host(s, expert);
    const RoutingArray all[] = {RoutingArray::expert,           RoutingArray::counts,         RoutingArray::offsets,
                                RoutingArray::offsets_unpadded, RoutingArray::pair_pos,       RoutingArray::sorted_pair,
                                RoutingArray::tile_expert,      RoutingArray::tile_row_start, RoutingArray::tile_rows,
                                RoutingArray::num_tiles,        RoutingArray::padded_rows,    RoutingArray::window};
    std::vector<std::string> names;
    for (RoutingArray a : all) {
      INFO(routing_array_name(a) << ", capacity " << capacity);
      names.push_back(routing_array_name(a));
      CHECK(routing_array_elements(a, s) >= 1);
      if (const std::vector<int32_t> *v = routing_array(t, a))
        CHECK(static_cast<int64_t>(v->size()) == routing_array_elements(a, s));
      else // the scalars and the CUDA layer's tile windows
        CHECK((a == RoutingArray::num_tiles || a == RoutingArray::padded_rows || a == RoutingArray::window));
    }
    std::sort(names.begin(), names.end());
    CHECK(std::adjacent_find(names.begin(), names.end()) == names.end());
  }
}
