// Expert parallelism's row exchange (backends/cuda/parallel/expert_exchange.h): the
// placement of experts on ranks and the sizes of an exchange on the host;
// on GPUs, routed rows dispatched to the rank owning their expert over NCCL
// and given back to where they came from, on one rank and on two.
#include <doctest/doctest.h>

#if MOEFORGE_HAVE_NCCL

#include <cstring>
#include <exception>
#include <random>

#include "backends/cuda/parallel/expert_exchange.h"
#include "gpu_test.h"
#include "user_error.h"

using namespace moeforge;
using cuda::ExchangeSizes;
using cuda::ExpertPlacement;

namespace {

// One routed row as the tests move it: who sent it, its expert, its place in
// the sender's pair order, and a tag the owner of its expert stamps.
struct Row {
  int32_t src, expert, pair, tag;
};

// A rank's routed pairs: `pairs` experts, skewed or not, and its rows
// sorted by expert (stably, as the blocked routing format sorts them).
struct RankData {
  std::vector<int32_t> counts;
  std::vector<Row> sorted;
};

RankData make_rank(int rank, int experts, int pairs, bool skewed, int empty_expert, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> expert(pairs);
  for (int p = 0; p < pairs; ++p) {
    int e = skewed && rng() % 10 < 9 ? 0 : int(rng() % experts);
    expert[p] = e == empty_expert ? (e + 1) % experts : e;
  }
  RankData d;
  d.counts.assign(experts, 0);
  for (int e = 0; e < experts; ++e)
    for (int p = 0; p < pairs; ++p)
      if (expert[p] == e) {
        d.sorted.push_back({rank, e, p, -1});
        ++d.counts[e];
      }
  return d;
}

// What rank q receives: each source's rows for q's experts, source by source.
std::vector<Row> expected_recv(const ExpertPlacement &pl, const std::vector<RankData> &ranks, int q) {
  std::vector<Row> out;
  for (const RankData &s : ranks)
    for (const Row &r : s.sorted)
      if (pl.owner(r.expert) == q)
        out.push_back(r);
  return out;
}

bool same(const Row &a, const Row &b) {
  return a.src == b.src && a.expert == b.expert && a.pair == b.pair && a.tag == b.tag;
}

// Every rank on its own thread (as one process per GPU would run them):
// counts, dispatch, the owner stamps its rows, give_back. Returns per rank
// what it received and what came back.
struct Outcome {
  std::vector<Row> received, returned;
  ExchangeSizes sizes;
};

std::vector<Outcome> run_exchange(const std::vector<int> &devices, const std::vector<RankData> &ranks, int experts) {
  const int R = int(devices.size());
  ExpertPlacement pl(experts, R);
  std::vector<cuda::Communicator> comms = cuda::Communicator::for_devices(devices);
  std::vector<Outcome> out(R);
  cuda::on_each_rank(devices, [&](int r) {
    cuda::Stream stream;
    cuda::ExpertExchange ex(comms[r], pl);
    cuda::DeviceBuffer counts = cuda::DeviceBuffer::from(ranks[r].counts);
    std::vector<uint8_t> bytes(ranks[r].sorted.size() * sizeof(Row));
    std::memcpy(bytes.data(), ranks[r].sorted.data(), bytes.size());
    cuda::DeviceBuffer rows(std::max<size_t>(bytes.size(), 16));
    rows.upload(bytes);
    ExchangeSizes sizes = ex.exchange_counts(counts.ptr(), stream);
    cuda::DeviceBuffer recv(std::max<size_t>(size_t(sizes.total_recv()) * sizeof(Row), 16));
    recv.fill32(cuda::kPoisonNaN);
    ex.dispatch(rows.ptr(), recv.ptr(), sizeof(Row), sizes, stream);
    stream.synchronize();
    std::vector<Row> got(sizes.total_recv());
    std::vector<uint8_t> raw = recv.download<uint8_t>(got.size() * sizeof(Row));
    std::memcpy(got.data(), raw.data(), raw.size());
    // The owner stamps each row it holds, then gives them back.
    std::vector<Row> stamped = got;
    for (Row &row : stamped)
      row.tag = 1000 + r;
    std::vector<uint8_t> back_bytes(stamped.size() * sizeof(Row));
    std::memcpy(back_bytes.data(), stamped.data(), back_bytes.size());
    cuda::DeviceBuffer processed(std::max<size_t>(back_bytes.size(), 16));
    processed.upload(back_bytes);
    rows.fill32(cuda::kPoisonNaN);
    ex.give_back(processed.ptr(), rows.ptr(), sizeof(Row), sizes, stream);
    stream.synchronize();
    std::vector<Row> back(ranks[r].sorted.size());
    std::vector<uint8_t> braw = rows.download<uint8_t>(back.size() * sizeof(Row));
    std::memcpy(back.data(), braw.data(), braw.size());
    out[r] = {got, back, sizes};
  });
  return out;
}

void check_outcome(const ExpertPlacement &pl, const std::vector<RankData> &ranks, const std::vector<Outcome> &out) {
  for (int q = 0; q < pl.ranks(); ++q) {
    INFO("rank " << q);
    std::vector<Row> want = expected_recv(pl, ranks, q);
    REQUIRE(out[q].received.size() == want.size());
    int wrong = 0;
    for (size_t i = 0; i < want.size(); ++i)
      wrong += !same(out[q].received[i], want[i]);
    CHECK(wrong == 0);
    // Back home: every row in its place, stamped by its expert's owner.
    REQUIRE(out[q].returned.size() == ranks[q].sorted.size());
    wrong = 0;
    for (size_t i = 0; i < ranks[q].sorted.size(); ++i) {
      Row w = ranks[q].sorted[i];
      w.tag = 1000 + pl.owner(w.expert);
      wrong += !same(out[q].returned[i], w);
    }
    CHECK(wrong == 0);
  }
}

} // namespace

TEST_CASE("expert exchange: experts in equal blocks per rank, and the sizes of an exchange") {
  ExpertPlacement pl(8, 2);
  CHECK(pl.local_experts() == 4);
  CHECK(pl.owner(3) == 0);
  CHECK(pl.owner(4) == 1);
  CHECK(pl.first_expert(1) == 4);
  CHECK_THROWS_WITH_AS(ExpertPlacement(6, 4), doctest::Contains("choose a rank count that divides the expert count"),
                       UserError);
  CHECK_THROWS_WITH_AS(ExpertPlacement(8, 0), doctest::Contains("give at least one rank"), UserError);
  // Rank 0 of 2 with 3, 0, 1, 2 pairs for experts 0-3 and 5, 1, 0, 0 for
  // experts 4-7; rank 0 received (for its experts 0, 1) 3, 0 from itself and
  // 7, 2 from rank 1.
  ExchangeSizes s = cuda::exchange_sizes(ExpertPlacement(4, 2), {3, 0, 5, 1}, {3, 0, 7, 2});
  CHECK(s.send_rows == std::vector<int64_t>{3, 6});
  CHECK(s.recv_rows == std::vector<int64_t>{3, 9});
  CHECK(s.total_send() == 9);
  CHECK(s.total_recv() == 12);
  CHECK_THROWS_WITH_AS(cuda::exchange_sizes(ExpertPlacement(4, 2), {3, -1, 5, 1}, {3, 0, 7, 2}),
                       doctest::Contains("this rank counts -1 rows for expert 1"), UserError);
  CHECK_THROWS_WITH_AS(cuda::exchange_sizes(ExpertPlacement(4, 2), {3, 0, 5, 1}, {3, 0, -7, 2}),
                       doctest::Contains("rank 1 sent a count of -7 rows for this rank's expert 0"), UserError);
}

TEST_CASE("expert exchange: a chunked exchange's rounds are groups of experts, each in its place") {
  // Groups as even as the division allows, covering every expert once.
  CHECK(cuda::chunk_experts(4, 2, 0).first == 0);
  CHECK(cuda::chunk_experts(4, 2, 0).end == 2);
  CHECK(cuda::chunk_experts(4, 2, 1).first == 2);
  CHECK(cuda::chunk_experts(4, 2, 1).end == 4);
  for (int local : {1, 3, 7, 32})
    for (int chunks = 1; chunks <= local; ++chunks) {
      int next = 0;
      for (int c = 0; c < chunks; ++c) {
        const cuda::ExpertGroup g = cuda::chunk_experts(local, chunks, c);
        CHECK(g.first == next);
        CHECK(g.end - g.first >= local / chunks);
        CHECK(g.end - g.first <= local / chunks + 1);
        next = g.end;
      }
      CHECK(next == local);
    }
  // Rank 0 of 2, two experts a rank: it sends 3, 0 to its own experts 0, 1
  // and 5, 1 to rank 1's; it receives 3, 0 from itself and 7, 2 from rank 1.
  const ExpertPlacement pl(4, 2);
  ExchangeSizes s = cuda::exchange_sizes(pl, {3, 0, 5, 1}, {3, 0, 7, 2});
  cuda::ExchangeSlices first = cuda::exchange_slices(s, pl, {0, 1}), second = cuda::exchange_slices(s, pl, {1, 2});
  // Round 0 (local expert 0 of each rank): rows 0-2 to rank 0, 3-7 to rank 1;
  // from rank 0 rows 0-2, from rank 1 rows 3-9 of the receive buffer.
  CHECK(first.send_at == std::vector<int64_t>{0, 3});
  CHECK(first.send_rows == std::vector<int64_t>{3, 5});
  CHECK(first.recv_at == std::vector<int64_t>{0, 3});
  CHECK(first.recv_rows == std::vector<int64_t>{0 + 3, 7});
  // Round 1 (local expert 1): nothing to rank 0, row 8 to rank 1; from rank 1
  // rows 10-11.
  CHECK(second.send_at == std::vector<int64_t>{3, 8});
  CHECK(second.send_rows == std::vector<int64_t>{0, 1});
  CHECK(second.recv_at == std::vector<int64_t>{3, 10});
  CHECK(second.recv_rows == std::vector<int64_t>{0, 2});
  // All rounds together are the whole exchange.
  cuda::ExchangeSlices all = cuda::exchange_slices(s, pl, {0, 2});
  CHECK(all.send_rows == s.send_rows);
  CHECK(all.recv_rows == s.recv_rows);
  CHECK(all.send_at == std::vector<int64_t>{0, 3});
  CHECK(all.recv_at == std::vector<int64_t>{0, 3});
}

// GPU tests skip, visibly, where NCCL does not load.
#define MOEFORGE_REQUIRE_NCCL()                                                                                        \
  do {                                                                                                                 \
    MOEFORGE_REQUIRE_GPU();                                                                                            \
    std::string moeforge_no_nccl;                                                                                      \
    if (!cuda::nccl_available(&moeforge_no_nccl)) {                                                                    \
      MESSAGE("SKIPPED (no GPU): NCCL is not usable: " << moeforge_no_nccl);                                           \
      return;                                                                                                          \
    }                                                                                                                  \
  } while (0)

TEST_SUITE("gpu") {
  TEST_CASE("expert exchange: one rank sends its rows to itself and takes them back") {
    MOEFORGE_REQUIRE_NCCL();
    std::vector<RankData> ranks{make_rank(0, 8, 777, false, 5, 1)};
    std::vector<Outcome> out = run_exchange({0}, ranks, 8);
    check_outcome(ExpertPlacement(8, 1), ranks, out);
    CHECK(out[0].sizes.total_recv() == 777);
  }

  TEST_CASE("expert exchange: two GPUs, uniform and skewed routing, an expert nobody chose") {
    MOEFORGE_REQUIRE_NCCL();
    int count = 0;
    MOEFORGE_CU(cuDeviceGetCount, &count);
    if (count < 2) {
      MESSAGE("SKIPPED (no GPU): needs two GPUs, found " << count);
      return;
    }
    // Rank 0 uniform, rank 1 sending nine tenths of its rows to expert 0;
    // expert 5 (rank 1's) chosen by neither.
    std::vector<RankData> ranks{make_rank(0, 8, 1000, false, 5, 2), make_rank(1, 8, 1300, true, 5, 3)};
    std::vector<Outcome> out = run_exchange({0, 1}, ranks, 8);
    check_outcome(ExpertPlacement(8, 2), ranks, out);
    CHECK(out[0].sizes.recv_rows[1] > out[1].sizes.recv_rows[1]); // the skew lands on rank 0
  }
}

#endif // MOEFORGE_HAVE_NCCL
