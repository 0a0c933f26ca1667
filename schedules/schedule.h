// A Schedule says HOW a Pipeline is computed, never WHAT: the permutation
// strategy for the routed rows, the block size they are padded or grouped to,
// where the gate is applied, and per contraction the GEMM tiling, pipeline
// depth, warp layout and epilogue fusion. Lowering reads it; the algebra never
// sees it, so changing a schedule cannot change a result.
//
// A Schedule is data built by primitives. Each primitive first checks its
// preconditions, throwing a UserError that names the value, the Func and the
// fix, and then only records. Schedules are TRACED: every primitive call is
// kept in order, so a schedule prints as the calls that built it
// (`to_text()`), one per line, and replays from that text (`from_text()`).
// That text is what `save()` writes, what a bug report carries and what an
// autotuner searches over:
//
//     schedule("megablocks")
//     permutation(blocked)
//     block(128)
//     tile("*", 128, 128, 32)
//     tile("h", 64, 128, 32)
//
// Func names refer to the Pipeline's Funcs; "*" is the default for every
// contraction and a name's own settings override it field by field. Names are
// only resolved by `validate(pipeline)`, so one schedule can serve every
// layer whose Funcs it names.
#pragma once

#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "dsl/fp8.h"
#include "dsl/pipeline.h"

namespace moeforge {

// How the routed (token, expert) pairs reach the expert GEMMs.
enum class Permutation {
  blocked,   // sort by expert and copy into blocks padded per expert (MegaBlocks)
  scattered, // no copy: gathers and scatters are fused into the GEMM loads and stores (ScatterMoE)
};

// Where the gated combine's product gate(r) * o(r, i) is taken.
enum class GateFusion {
  combine,  // in the combine kernel that sums each token's pairs
  epilogue, // in the epilogue of the last expert GEMM, before its store
            // (a forward's choice: a training step's backward reads that
            // GEMM's output ungated, so there the gate stays in the combine)
};

// The tensor-core instruction a GEMM's main loop is built on.
enum class MmaKind {
  mma_sync, // warp-level mma.sync m16n8k16 (sm_80 and later)
  wgmma,    // Hopper warpgroup wgmma from shared memory (sm_90a): tile_k 64, one warpgroup per 64 rows
  wgmma_ws, // wgmma with one more, loading-only warpgroup and mbarrier-paced stages (warp specialised)
};

const char *mma_kind_name(MmaKind m);
const char *permutation_name(Permutation p);
const char *gate_fusion_name(GateFusion g);

// One GEMM's tiling: a thread block computes a tile_m x tile_n output tile,
// stepping through K tile_k at a time with `stages` shared-memory buffers in
// flight, its warps laid out warps_m x warps_n over the tile.
struct GemmTiling {
  int tile_m = 128, tile_n = 128, tile_k = 32, stages = 4, warps_m = 2, warps_n = 4;
  MmaKind mma = MmaKind::mma_sync;
  // Row tiles per band of the GEMM's block order (grouped rasterisation):
  // a wave of blocks covers this many row tiles across the column tiles.
  int raster = 8;
  // One block per SM walks the output tiles (wgmma_ws only): its producer
  // warpgroup loads the next tile while the consumers run this one's epilogue.
  bool persistent = false;
  // wgmma / wgmma_ws: dense B tiles (weights), and A rows in tile order, come
  // through TMA, one copy instruction per 64 x 64 box, instead of 16-byte
  // cp.async per thread.
  bool tma = false;
  // wgmma / wgmma_ws: a bf16 output stored in tile order (h in blocked or
  // scattered MoE layers, a dense layer's output) leaves through TMA: the
  // tile staged in shared memory (a block per tile: its idle ring;
  // persistent blocks and persistent clusters: a buffer past the ring),
  // then one copy per 64 x 64 box, instead of each thread storing its
  // accumulator fragments. Other outputs, and a cluster per pair of row
  // tiles (not persistent), are stored as before; the plan says so.
  bool tma_store = false;
  // Thread blocks per cluster along M (1 or 2; wgmma_ws with tma): two row
  // tiles of one expert share their B tiles, each block loading half and
  // multicasting it to both, which halves B's traffic from L2. The pair is
  // two consecutive routing tiles (block = tile_m: shared when one expert
  // holds both) or the two halves of one (block = 2 tile_m: always shared
  // when the second half holds rows).
  int cluster_m = 1;
  // wgmma_ws with one B operand: where the GEMM's last column tile holds
  // half the tile's columns or fewer (N % tile_n in (0, tile_n / 2]: fine64's
  // f = 1408 under 256-wide tiles, 128 of the last tile's 256; gptoss's
  // 2880, 64), that tile's wgmmas are the half- or quarter-width
  // instruction that covers its columns, so the tensor cores do not
  // multiply the zero-filled columns past N: 1/12 of such a GEMM's MMA work
  // at f = 1408, 3/48 at 2880. Measured no faster there (H100, 2026-12-06:
  // fine64's and gptoss's training steps within their spread of the
  // default's), so it is the tuner's to try, not the default's.
  bool narrow_tail = false;
  // Which of the choices above the schedule named for this Func itself (a
  // `"*"` default is not named): where one of those cannot apply to the
  // Func's GEMM, its plan says so and why (gemm_plan.h), rather than
  // dropping it unseen. Where a choice came from does not make two tilings
  // differ.
  struct Named {
    bool persistent = false, tma = false, tma_store = false, cluster = false;
    bool warps = false; // warps(func, ...): its layout, which only mma_sync takes
    bool narrow_tail = false;
    bool operator==(const Named &) const { return true; }
  };
  Named named = {};
  int threads() const { return warps_m * warps_n * 32; }
  // The A and B tiles of every stage, in bf16.
  // The ring of stages for `b_operands` B tiles beside the A tile, bf16: the
  // one formula the schedule's checks and the CUDA backend's plan share.
  int ring_bytes(int b_operands) const { return stages * (tile_m * tile_k + b_operands * tile_k * tile_n) * 2; }
  int shared_bytes() const { return ring_bytes(1); }
  bool operator==(const GemmTiling &) const = default;
};

// The schedule of one contraction (a Func whose body has a sum(...)).
struct FuncSchedule {
  GemmTiling tiling;
  // The element-wise ops around the contraction (activation, the SwiGLU
  // product) run in the GEMM's epilogue; false: a separate element-wise kernel.
  bool fuse_epilogue = true;
  // The contraction's operands rounded to this FP8 format in blocks with
  // power-of-two scales (dsl/fp8.h: 128 along the contracted index; across
  // it one row of an operand over the tokens or pairs, 128 of a weight), the
  // sum taken in f32 or wider. Unset: the operands as stored (bf16 or f32).
  std::optional<Fp8Format> fp8;
  bool operator==(const FuncSchedule &) const = default;
};

class Schedule {
public:
  // The Func name meaning "every contraction".
  static constexpr const char *all_funcs = "*";
  // Shared memory one thread block may use on Hopper (sm_90): 227 KiB.
  static constexpr int max_shared_bytes = 227 * 1024;

  // An empty schedule: blocked, block 128, gate in combine, default tiling.
  // `name` is a label (e.g. "megablocks") that prints and round-trips.
  explicit Schedule(std::string name = "custom");

  // ---- primitives: check, then record; chainable.
  Schedule &permutation(Permutation p);
  // Rows per block of routed pairs: 64, 128 or 256.
  Schedule &block(int rows);
  // Fixed expert capacity with dropping (GShard / Tutel): each expert takes
  // at most C = ceil(factor * T * k / E) of its pairs, first choices before
  // second ones, earlier tokens first, and the rest are dropped: they add
  // nothing to the combine or any gradient (dsl/capacity.h). The pairs
  // dropped are reported by the layer. Not calling it: dropless, the
  // default. Applies to every top_k route (expert choice has its own).
  Schedule &capacity(double factor);
  // Expert parallelism: the experts spread over `ranks` GPUs (E / ranks
  // each, ranks dividing E), each GPU routing its own tokens and moving the
  // routed rows to their expert's GPU and back over NCCL
  // (lowering/expert_parallel_split.h, backends/cuda/parallel/expert_parallel_layer.h).
  // 1, the default: one GPU. A layer whose schedule spreads its experts is
  // compiled by the expert-parallel entry point, not as one layer.
  Schedule &expert_parallel(int ranks);
  // The forward's rows cross to the experts in `chunks` rounds, each a
  // group of every rank's experts (E / R / chunks of them, as even as the
  // division allows), so that one group's rows travel
  // while the expert GEMMs of the group before run, and each group's
  // outputs start back as soon as they are made. 1, the default: one round.
  // Only an expert-parallel layer has rows to move (the one-layer entry
  // points refuse more than one chunk); the values do not depend on it.
  Schedule &exchange_chunks(int chunks);
  Schedule &gate(GateFusion g);
  // Training: whether the backward recomputes the routed activations it
  // reads instead of keeping the forward's copies: those made by element-wise
  // steps, gathers and the GEMMs that read the layer's inputs (the first
  // expert GEMM); outputs of GEMMs over other activations stay stored.
  // Less activation memory, more FLOPs (lowering/training.h).
  Schedule &recompute(bool on);
  // Training: the routed tensors lowering introduces between steps in f32
  // (the pre-activations the forward keeps for the backward, the backward's
  // per-pair gradients between its GEMMs and element-wise steps) are stored
  // in bf16 instead, as the layer's own activations are: half their memory
  // and their traffic, at bf16's rounding of each stored value (the GEMMs
  // still accumulate in f32).
  Schedule &bf16_activations(bool on);
  // Tensors share device memory by lifetime (runtime/memory_plan.h): a
  // tensor's bytes are reused once the steps that read it have run, so a
  // layer holds the working set of its busiest step instead of every
  // intermediate at once. Outputs, gradients and what a training forward
  // keeps for its backward are never reused; other intermediates cannot be
  // downloaded after a run (the GPU backend; the CPU backend ignores it).
  Schedule &reuse_memory(bool on);
  // Training: the per-expert weights' gradients (the expert reductions'
  // outputs, E x d x f each) stored in bf16, as the weights are: half the
  // step's memory for them and half their epilogues' bytes. The sums still
  // run in f32 and each gradient is rounded once. The router's gradient
  // stays f32 (its split-K slices add into it).
  Schedule &bf16_weight_gradients(bool on);
  // Element-wise results over routed pairs that GEMMs read (the backward's
  // per-pair gradients d_o, dH1, ...; the SwiGLU product) are stored in the
  // routing's sorted, padded row order, as a blocked layer's GEMM outputs
  // are, with zeros in the padding rows. The GEMMs reading them then load
  // consecutive rows: by TMA on Hopper (the expert reductions' operands
  // included) instead of gathering rows through cp.async. The element-wise
  // kernels write rows in that order (each pair's row at its padded
  // position) and zero the padding; the tensors grow by the padding rows.
  // The token rows an expert reduction gathers (x in dW1 = x^T dH1) are
  // copied once into that order too, for the backward's time: one more
  // T*k x d bf16 tensor, not kept past the reductions that read it.
  Schedule &padded_elementwise(bool on);
  // Under padded_elementwise, for the backward's memory: the token rows a
  // training backward's GEMMs read through the route (the upstream gradient
  // in the dH GEMM and dW2's reduction, x in the weight gradients dW1 = x^T
  // dH1, ...) are gathered inside those GEMMs (cp.async, zeros on padding
  // rows) instead of copied first into the padded order and read by TMA:
  // two T*k x d bf16 tensors fewer in the backward's workspace (qwen3moe:
  // 576 MiB each), for the gathered loads' time.
  Schedule &gather_in_gemms(bool on);
  // Under padded_elementwise, for the backward's memory: gather_in_gemms
  // for the upstream gradient's rows alone (the dH GEMM's A and dW2's
  // operand gathered by token from dy, the only per-pair copy at the
  // backward's fullest step: fine64 544 MiB), while x's copy for dW1 and
  // dW3, made and dropped away from that step, stays read by TMA.
  // gather_in_gemms(true) does this too.
  Schedule &gather_upstream_in_gemms(bool on);
  // Training, for the backward's memory: an element-wise output that
  // merging put in one kernel with outputs it does not need (SwiGLU's gated
  // h, which dW2 reads, beside the activation gradients made from dA) runs
  // as a kernel of its own wherever that lowers the backward's peak: it is
  // then made, read and freed before the tensors it had been live beside
  // exist (mixtral: one T*k x f bf16 tensor fewer, 476 MiB), for one more
  // read of the inputs it shares with them (lowering/split_for_memory.h).
  Schedule &split_pointwise_for_memory(bool on);
  // Training, for the backward's memory: an activation's gradient is
  // written over the saved activation it is made from, where the kernel
  // making it is that tensor's last reader (SwiGLU's dH1 and dH3 over the
  // two saved pre-activations, GeLU's dH over its pre-activation). The
  // saved region holds them anyway until the backward ends, so the
  // backward's workspace holds up to two T*k x f tensors fewer (mixtral:
  // 952 MiB); those saved tensors then stay in the padded order the
  // gradients take (up to E (block - 1) rows more each; sorted_saved takes
  // those back). A forward then serves one backward: a second backward of
  // it is refused (on caller memory, where the bytes are shared; run the
  // forward again).
  Schedule &gradients_over_saved(bool on);
  // Training, with gradients_over_saved: those saved tensors, and the
  // gradients written over them, stored grouped by expert without the
  // padding (T k rows, not T k + E (block - 1)); the GEMMs that read the
  // gradients load each tile's rows from its expert's unpadded start
  // (lowering/sorted_rows.h). The saved region a layer keeps between its
  // forward and its backward shrinks by the padding: 44 MiB at fine64, 180
  // at gpt-oss's 128 experts of f = 2880.
  Schedule &sorted_saved(bool on);
  // Training, with sorted_saved: a gathered copy of a token tensor that
  // only weight gradients read (x's rows for dW1 and dW3), stored grouped by
  // expert without the padding too, where each of those reductions' other
  // operand is stored so (lowering/sorted_rows.h). The reductions then run
  // over each expert's own rows, the rows of the next expert that the last
  // k-tile's box reads zeroed in shared memory before the tensor cores
  // read them. The backward's workspace loses the copy's padding: fine64
  // 544.5 -> 518 MiB, qwen3moe 576 -> 512 (then the input gradient's
  // per-pair rows are as large). On in the default: on an H100 (s60, 8
  // layers) it left the step's time unchanged (-0.2 / -0.1 %, fine64 /
  // qwen3moe) and fine64's reserved peak 0.7 GiB lower.
  Schedule &sorted_gathers(bool on);
  // Training: two weight gradients that reduce the same A over the same
  // rows with B operands stored alike (SwiGLU's dW1 = X^T dH1 and dW3 =
  // X^T dH3) as one expert reduction with two B operands: each tile holds
  // tile_n / 2 columns of each gradient, computed by one wgmma, so A's
  // stages are loaded once for both, there is one launch, and a width that
  // is an odd multiple of tile_n / 2 (fine64's f = 1408 under 256-wide
  // tiles) leaves no half-empty tile (lowering/merge_reductions.h). CUDA:
  // the warp-specialised loop with A and both B by TMA (elsewhere the
  // choice is reported without effect); the CPU backend runs the same
  // program. On in the default: fine64's step 5-6 % faster on an H100,
  // mixtral's and gpt-oss's level.
  Schedule &merge_weight_gradients(bool on);
  // Training: the layer's outputs that are not scalars (y), their upstream
  // gradients (dy) and the gradients of its Inputs (dx) are stored in bf16,
  // the dtype a bf16 model passes between its layers, instead of f32: the
  // model then neither converts them nor holds an f32 copy beside its own
  // (three T x d f32 tensors at the backward's fullest step). Each is summed
  // in f32 and rounded once. Where atomic_combine adds into one (its sum
  // taken by atomic adds) it stays f32, as do scalar losses and the Params'
  // gradients (bf16_weight_gradients decides those).
  Schedule &bf16_boundary(bool on);
  // A forward's attention between two contractions over the tokens,
  // softmax(u, c q(r) . key(u)) times value(u) (Mixture-of-Attention's, or
  // plain attention's), runs as one kernel that takes the softmax online
  // over key and value rows: the [rows, T] scores and probabilities are
  // never stored (4 GiB of f32 at T = 16384 with 32768 rows). Measured on an
  // H100 at 1.2-1.5x the unfused forward's time (T = 4096-16384), so it is
  // a choice for memory, off by default. Training keeps the unfused steps:
  // its backward reads the probabilities.
  Schedule &fused_attention(bool on);
  // Training: forward values that a GEMM's epilogue makes element-wise from
  // results it stores as well (SwiGLU's h = silu(h1) * h3 beside h1 and h3,
  // GeLU's h beside its pre-activation) are not kept for the backward but
  // made again there from those results, by the element-wise kernel that
  // already reads them: one T*k x f tensor less between the passes (all that
  // stays is the pre-activation), for one more write of it in the backward.
  Schedule &recompute_elementwise(bool on);
  // Training: the gate's gradient <dy(t), o(r)> taken as <dy(t) W2^T, h(r)>
  // (o = h W2 is linear in h), so the expert outputs o (T*k x d) are not
  // kept for the backward. The dH GEMM then reads the upstream gradient
  // unscaled (dy's rows, copied per pair or gathered inside the GEMM) and
  // stores dy W2^T; the gate's scale moves into the element-wise kernels
  // that read it, and the gate gradient is a row sum over f of h times that
  // product, computed beside the activation's backward. With
  // recompute_elementwise, dW2 reads the gate-scaled h made where h is made
  // again against dy's copy, so the per-pair d_o is not made either.
  Schedule &gate_gradient_from_dh(bool on);
  // Training: two GEMMs whose outputs are only ever added (the input
  // gradient's dH1 W1^T + dH3 W3^T under SwiGLU, each summed over a token's
  // pairs) run as one GEMM over both reductions, A B + A2 B2 into one
  // accumulator: one T*k x d tensor written and read instead of two, and
  // one tile epilogue for both. The CUDA backend takes it in the
  // warp-specialised loop with TMA operands (mma wgmma_ws, tma, and A in tile
  // order: padded_elementwise or the blocked permutation).
  Schedule &chain_summed_gemms(bool on);
  // The combine's sum over each token's k > 1 pairs is added into its output
  // by the epilogue of the GEMM that makes the pairs' rows, with atomic adds
  // into the output zeroed before it, instead of a kernel of its own that
  // reads every pair's row back: the T*k x d expert outputs are then neither
  // stored nor read again (fine64's forward holds 511 MiB instead of 1055).
  // What it costs: the order in which a token's pairs add up follows the
  // tiles' timing, so a result is not bitwise repeatable from run to run,
  // and a bf16 output accumulates in bf16 (each addition rounded, where the
  // combine kernel sums in f32 and rounds once); and time where the output
  // outgrows L2: a token's k adds come from k experts' tiles far apart in
  // the GEMM's walk, so each finds its line evicted (on an H100, fine64's
  // forward 5 % slower, mixtral's unchanged). Taken only where the GEMM's
  // own output is read by nothing but that combine (in a training forward,
  // where the backward does not read the expert outputs: the lean mode's
  // gate_gradient_from_dh on the wgmma loops); k = 1 combines are
  // plain stores anyway. A training backward's input gradient, the sum of
  // each token's pairs' rows and the router's share, is taken the same way:
  // the router's GEMM writes it and the experts' GEMM adds onto it (neither
  // the T*k x d rows nor the router's share is stored). Not with
  // expert_parallel, whose combine runs where the rows come back.
  Schedule &atomic_combine(bool on);
  // Training, for the backward's memory: atomic_combine's backward half
  // alone. The input gradient (each token's pairs' rows summed, plus the
  // router's share) is added up atomically from the experts' dX GEMM's
  // epilogue onto the router's share, so its T*k x d per-pair rows (fine64:
  // 544 MiB, the backward's largest tensor once dy is gathered) are never
  // stored, while the forward's combine stays a kernel (its atomic form is
  // what costs atomic_combine its time). The input gradient is then f32
  // (the adds' order follows the tiles' timing: not bitwise repeatable).
  // atomic_combine(true) does this too. Not with expert_parallel.
  Schedule &atomic_input_gradient(bool on);
  // m, n in {64, 128, 256}; k in {32, 64}.
  Schedule &tile(const std::string &func, int m, int n, int k);
  // 2 to 8 shared-memory stages.
  Schedule &stages(const std::string &func, int s);
  // warps_m * warps_n is 4 or 8, and each warp's share of the tile
  // (tile_m / warps_m, tile_n / warps_n) is a multiple of 16. Applies to
  // mma_sync; wgmma lays out one warpgroup per 64 rows by itself.
  Schedule &warps(const std::string &func, int warps_m, int warps_n);
  Schedule &fuse_epilogue(const std::string &func, bool fuse);
  // The tensor-core instruction; wgmma needs tile_k 64, tile_m 64 or 128 and
  // at least 3 stages.
  Schedule &mma(const std::string &func, MmaKind kind);
  // Row tiles per rasterisation band, 1 to 64 (1: plain row-major order).
  Schedule &raster(const std::string &func, int row_tiles);
  // Persistent blocks (GemmTiling::persistent); needs mma wgmma_ws.
  Schedule &persistent(const std::string &func, bool on);
  // TMA loads (GemmTiling::tma); used by wgmma and wgmma_ws GEMMs whose B is
  // a dense [K, N] matrix (per expert), ignored by mma_sync.
  Schedule &tma(const std::string &func, bool on);
  // Output tiles stored through TMA (GemmTiling::tma_store).
  Schedule &tma_store(const std::string &func, bool on);
  // The last column tile's wgmmas narrower where it holds half the tile's
  // columns or fewer (GemmTiling::narrow_tail).
  Schedule &narrow_tail(const std::string &func, bool on);
  // Row tiles per thread-block cluster (GemmTiling::cluster_m): 1 or 2.
  Schedule &cluster(const std::string &func, int row_tiles);
  // The contraction's operands in FP8 (FuncSchedule::fp8); nullopt: as
  // stored ("off" in text). "*" reaches every contraction, the router's
  // product included: name it with nullopt to keep it as it is.
  Schedule &fp8(const std::string &func, std::optional<Fp8Format> format);
  // The contractions whose operands are FP8, by Func name: what the
  // reference takes (EvalOptions::fp8) to round as the backends do.
  std::map<std::string, Fp8Format> fp8_funcs(const Pipeline &pipeline) const;

  // ---- accessors
  const std::string &name() const { return name_; }
  Permutation permutation() const { return permutation_; }
  int block() const { return block_; }
  // 0 when dropless.
  double capacity() const { return capacity_; }
  int expert_parallel_ranks() const { return ranks_; }
  int exchange_chunks() const { return chunks_; }
  // A copy that runs on one GPU (without expert_parallel): each side of an
  // expert-parallel layer is compiled as one rank's layer under it.
  Schedule on_one_rank() const;
  GateFusion gate() const { return gate_; }
  bool recompute() const { return recompute_; }
  bool bf16_activations() const { return bf16_activations_; }
  bool reuse_memory() const { return reuse_memory_; }
  bool padded_elementwise() const { return padded_elementwise_; }
  bool recompute_elementwise() const { return recompute_elementwise_; }
  bool gate_gradient_from_dh() const { return gate_gradient_from_dh_; }
  bool chain_summed_gemms() const { return chain_summed_gemms_; }
  bool atomic_combine() const { return atomic_combine_; }
  bool atomic_input_gradient() const { return atomic_input_gradient_; }
  bool gather_in_gemms() const { return gather_in_gemms_; }
  bool split_pointwise_for_memory() const { return split_pointwise_for_memory_; }
  bool gradients_over_saved() const { return gradients_over_saved_; }
  bool sorted_saved() const { return sorted_saved_; }
  bool sorted_gathers() const { return sorted_gathers_; }
  bool merge_weight_gradients() const { return merge_weight_gradients_; }
  bool gather_upstream_in_gemms() const { return gather_upstream_in_gemms_; }
  bool bf16_boundary() const { return bf16_boundary_; }
  bool fused_attention() const { return fused_attention_; }
  bool bf16_weight_gradients() const { return bf16_weight_gradients_; }
  // The settings of `func`: the "*" default with func's own overrides on top.
  // A Func the schedule never named gets the default.
  FuncSchedule for_func(const std::string &func) const;
  // Funcs named by a primitive (not "*"), in the order first named.
  const std::vector<std::string> &funcs() const { return funcs_; }
  // The recorded primitive calls, one per element, as to_text() prints them.
  const std::vector<std::string> &calls() const { return calls_; }

  // A copy without the choices for Funcs that `pipeline` lacks: the
  // schedule of one part of a layer (an expert-parallel side, which holds
  // some of the layer's Funcs and compiles on its own).
  Schedule only_funcs_of(const Pipeline &pipeline) const;

  // Checks the schedule against a layer: every named Func exists and is a
  // contraction (check_names); for a contraction over routed pairs, tile_m
  // divides the block; persistent and cluster come with the loop they need
  // (wgmma_ws, and tma for cluster). Throws a UserError otherwise.
  void validate(const Pipeline &pipeline) const;
  // Only that every Func the schedule names exists and is a contraction
  // (what a backend that runs no kernels, the reference, can check).
  void check_names(const Pipeline &pipeline) const;

  // ---- text: the trace, replayable (schedule_text.cpp)
  // `schedule("<name>")` then one primitive call per line.
  std::string to_text() const;
  // Replays the calls in `text`; errors name `source_name` and the line.
  // Blank lines and '#' comments are skipped; the schedule("<name>") line is
  // optional (the name is then "custom").
  static Schedule from_text(const std::string &text, const std::string &source_name = "<text>");
  void save(const std::string &path) const;
  // Reads and replays a file written by save(); a UserError for a file
  // that is not text (a NUL byte) or larger than kMaxScheduleFileBytes.
  static Schedule load(const std::string &path);
  static constexpr size_t kMaxScheduleFileBytes = 16u << 20;

private:
  // A Func's settings that differ from "*"; unset fields follow the default.
  struct Overrides {
    std::optional<int> tile_m, tile_n, tile_k, stages, warps_m, warps_n;
    std::optional<bool> fuse_epilogue;
    std::optional<MmaKind> mma;
    std::optional<int> raster;
    std::optional<bool> persistent;
    std::optional<bool> tma;
    std::optional<bool> tma_store;
    std::optional<int> cluster_m;
    std::optional<bool> narrow_tail;
    std::optional<std::optional<Fp8Format>> fp8;
  };
  static FuncSchedule apply(FuncSchedule base, const Overrides &o);
  // A whole-layer on/off primitive: sets `field` and records the call.
  Schedule &flag(bool &field, const char *primitive, bool on);
  // A per-Func on/off primitive (persistent, tma, ...): sets `field` of
  // func's settings ("*": the default) and records the call.
  Schedule &func_flag(std::optional<bool> Overrides::*field, const char *primitive, const std::string &func, bool on);

  // Applies `patch` to func's settings ("*": the default) in a copy, rechecks
  // every tiling it affects and only then records `call` and commits.
  void commit(const std::string &call, const std::string &primitive, const std::string &func, const Overrides &patch);
  void check_tilings(const std::string &call, const std::string &changed_func) const;

  std::string name_;
  Permutation permutation_ = Permutation::blocked;
  int block_ = 128;
  double capacity_ = 0;
  int ranks_ = 1;
  int chunks_ = 1;
  GateFusion gate_ = GateFusion::combine;
  bool recompute_ = false;
  bool bf16_activations_ = false;
  bool reuse_memory_ = false;
  bool bf16_weight_gradients_ = false;
  bool padded_elementwise_ = false;
  bool recompute_elementwise_ = false;
  bool gate_gradient_from_dh_ = false;
  bool chain_summed_gemms_ = false;
  bool atomic_combine_ = false;
  bool atomic_input_gradient_ = false;
  bool gather_in_gemms_ = false;
  bool split_pointwise_for_memory_ = false;
  bool gradients_over_saved_ = false;
  bool sorted_saved_ = false;
  bool sorted_gathers_ = false;
  bool merge_weight_gradients_ = false;
  bool gather_upstream_in_gemms_ = false;
  bool bf16_boundary_ = false;
  bool fused_attention_ = false;
  FuncSchedule default_;
  std::map<std::string, Overrides> overrides_;
  std::vector<std::string> funcs_;
  std::map<std::string, std::string> named_by_; // func -> first primitive naming it
  std::vector<std::string> calls_;
};

// The CUDA backend's requirement (checked by its compile entry points):
// every static dimension a contraction reads from an Input or Param is a
// multiple of 8 (16-byte vectors). UserError naming the dimension otherwise.
void check_vector_alignment(const Pipeline &pipeline);

// Prints to_text().
std::ostream &operator<<(std::ostream &os, const Schedule &s);

} // namespace moeforge
