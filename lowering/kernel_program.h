// The kernel program: what a Pipeline becomes once a Schedule is applied. It
// is target-independent (the CUDA codegen and, later, the LLVM CPU backend
// read the same program) and small on purpose: a list of steps, each one
// kernel over tensors whose row layout is explicit.
//
// Routed tensors (indexed by a route's pair variable r) are a *format* the
// steps ask questions of, never a special case inside them:
//   pair    rows in pair order r = t * k + slot (T * k rows)
//   padded  rows sorted by expert, each expert padded to the block size
//           (position p; sorted_pair[p] = r, or -1 on padding rows)
// A GEMM tile walks padded positions p; how each operand row is found from p
// is its RowMap:
//   direct        row p (padded tensors) or m (dense GEMMs)
//   gather_pair   row sorted_pair[p] of a pair-order tensor
//   gather_token  row token(sorted_pair[p]) = sorted_pair[p] / k of a token tensor
//
// The backward pass adds two shapes of GEMM, both run by the same main loops
// once lowering has materialised their operands in the layouts those loops
// read (A[rows, k], B[k, n]):
//   transposed operands  A read as A(k, row) or B as B([e,] n, k): a
//                        TransposeStep writes A^T / B^T first
//   expert reductions    C[e, m, n] = sum over the routed rows p of expert e
//                        of A(p, m) * B(p, n) (the weight gradients): K is
//                        the expert's padded segment, A^T is stored with the
//                        padded rows last (padded_t) and B in padded order
#pragma once

#include <memory>
#include <optional>
#include <ostream>
#include <set>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "dsl/capacity.h"
#include "dsl/ir.h"
#include "schedules/schedule.h"

namespace moeforge {

// How a routed tensor's rows are stored (dense: not routed). pair: row r for
// pair r = t k + s (T k rows). padded: grouped by expert, each expert's
// segment padded to whole tiles (routing_format.h; max_padded_rows rows),
// pair r at pair_pos[r]. sorted: grouped by expert without the padding
// (T k rows), pair r at offsets_unpadded[e] + pair_pos[r] - offsets[e]
// (e = expert[r]): a tile's rows are still consecutive, so a GEMM loads
// them by TMA from the tile's sorted start, and the padding's E (block - 1)
// rows a tensor are not allocated. padded_t: a padded tensor transposed.
enum class RowLayout { dense, pair, padded, padded_t, sorted };
enum class RowMap { direct, gather_pair, gather_token };
const char *row_layout_name(RowLayout l);
const char *row_map_name(RowMap m);

// A tensor the program reads or writes: an Input/Param, a Func, or a tensor
// lowering introduced (a padded copy, an unfused accumulator).
struct TensorDecl {
  std::string name;
  DType dtype = DType::f32;
  std::vector<Dim> dims;
  // Of the first dim, for routed tensors; padded_t: the *last* dim holds the
  // padded rows (an expert reduction's transposed A operand).
  RowLayout layout = RowLayout::dense;
  const RoutingNode *route = nullptr; // set for pair / padded / sorted layouts
  bool is_input = false;              // an Input or Param, uploaded by the caller
  // The last dim is stored with a row stride rounded up to 8: an
  // intermediate whose last dim is dynamic (lowering/dynamic_rows.h), so
  // the CUDA GEMMs' 16-byte loads and wide stores stay aligned at any
  // count. Nothing reads the tail as a value. The CPU backend, which reads
  // element by element, keeps such rows dense (the storage is only larger).
  bool stride8 = false;
  // Elements between consecutive indices of the first dim; 0: dense. A
  // Param stored inside a larger tensor (BufferNode::outer_stride), and its
  // gradient, which is written into the same place of the larger tensor's
  // gradient. The memory between rows is never read or written.
  int64_t outer_stride = 0;
  // A padded tensor whose padding rows hold zeros (the element-wise kernel,
  // gather or GEMM epilogue that writes it zeroes them: padded_elementwise):
  // a GEMM may read its rows by TMA without the zero fill its cp.async
  // gathers give padding rows.
  bool zero_padding = false;
};

// The elements of one index of t's first dim: the product of its other
// extents (static where outer_stride is set). A tensor with an outer stride
// owns that many elements at each multiple of the stride.
inline int64_t elements_past_first(const TensorDecl &t) {
  int64_t n = 1;
  for (size_t i = 1; i < t.dims.size(); ++i)
    n *= t.dims[i].extent();
  return n;
}

// A further tensor a step writes at the same indices as its primary output;
// or, row_sum (element-wise steps only), at all but the last of them: the
// sum of `value` over the last index, a per-row reduction made from values
// the step has in registers anyway (merge_sibling_pointwise).
struct ExtraOutput {
  std::string output;
  Expr value;
  bool row_sum = false;
};

// C[rows, n] = epilogue(sum_k A[rows, k] * B_i[expert?, k, n] for each i).
struct GemmPlan; // lowering/gemm_plan.h

struct GemmStep {
  std::string name;
  std::string output; // tensor written
  RowMap out_rows = RowMap::direct;
  const RoutingNode *route = nullptr; // grouped over the route's tiles; null: dense
  Dim m, n, k;                        // m: the row Dim (dense) or the pairs Dim
  std::string a;
  RowMap a_rows = RowMap::direct;
  std::vector<std::string> b; // one per accumulator (two for SwiGLU)
  bool b_per_expert = false;  // B has a leading expert index: B[expert(r), k, n]
  // Operands stored the other way round (A[k, rows], B[expert?, n, k]);
  // materialize_transposes rewrites A^T reads, and B^T reads of mma.sync
  // GEMMs, to read a transposed copy. b_trans stays set for wgmma GEMMs,
  // whose main loops read B^T in place (and on the CPU).
  bool a_trans = false, b_trans = false;
  // An expert reduction (see above): the output is [E, m, n]; A and B are
  // routed tensors read by pair rows (a_rows, b_rows) until
  // materialize_transposes gives A^T (padded_t) and B in padded order.
  bool expert_k = false;
  RowMap b_rows = RowMap::direct;
  // An expert reduction for the Hopper loops, which read A and B in place
  // through their row maps (a_rows, b_rows: direct for a padded tensor)
  // instead of from a transposed A and a gathered B.
  bool operands_in_place = false;
  // The epilogue over accumulators: reads of the placeholder Funcs in
  // `accumulators` (named acc0, acc1, ...) and of per-row or per-element
  // tensors. Evaluated in fp32 and stored as the output's dtype.
  Expr epilogue;
  std::vector<FuncPtr> accumulators;
  Var row_var, col_var; // the output's index variables (rows, n)
  // More tensors the epilogue writes at the same (row, col): element-wise
  // consumers fused into the GEMM (fuse_elementwise_consumers). Each is
  // stored in its tensor's own row layout; values are over the accumulators
  // and per-element reads, as `epilogue`.
  using Extra = ExtraOutput;
  std::vector<Extra> extra;
  GemmTiling tiling;
  std::string func; // the Func whose schedule settings `tiling` holds (for messages)
  int block = 128;  // routing block (rows per padded segment)
  // One accumulator of a GEMM whose epilogue the schedule keeps apart
  // (fuse_epilogue false; split_unfused_epilogues): never merged back.
  bool unfused = false;
  // A second product summed into the same accumulator over a reduction of
  // its own: acc0 = A B + A2 B2 (Schedule::chain_summed_gemms: two GEMMs
  // whose outputs were only ever added, SwiGLU's input-gradient products
  // dH1 W1^T and dH3 W3^T, become one GEMM over both reductions, and the
  // sum is not a pass of its own). A2 and B2 are laid out as A and B are
  // (row maps, transposes, B's expert index); single-B GEMMs only.
  struct Chained {
    std::string a, b;
    Dim k;
  };
  std::optional<Chained> chained;
  // The output is a token tensor that each pair's row is added into, at row
  // token(r) (out_rows gather_token), with atomic adds into the output the
  // backend zeroes before the GEMM runs: a combine's sum over a token's
  // pairs taken in the epilogue (Schedule::atomic_combine).
  bool out_add = false;
  // out_add onto what an earlier step wrote to the output (a dense GEMM's
  // plain store: a backward's input gradient from the router, which the
  // experts' shares add onto), which the backend then does not zero.
  bool out_add_onto_written = false;
  // A routed GEMM that runs over a window of its route's tiles, a list the
  // runtime writes before each launch (CudaLayer::enqueue_window): an
  // expert-parallel rank's forward over one group of experts whose rows
  // have arrived while the next group's rows are still on their way.
  bool windowed = false;
  // How the CUDA target runs it (lowering/gemm_plan.h), set by plan_gemms:
  // lower() and lower_training() run it last, and the CUDA backend again on
  // the program it compiles, so the plan is of the step as compiled. Or,
  // where that target cannot run the step, why (a UserError's text, which
  // its code generator raises; the CPU backend reads neither).
  std::shared_ptr<const GemmPlan> plan;
  std::string plan_refusal;
  // Schedule::fp8 of `func`: every product's operands rounded to this format
  // by dsl/fp8.h's block rule (A, each B, a chained A2 and B2).
  std::optional<Fp8Format> fp8;
};

// out(vars) = body, one thread per element; sums over the pairs of a token
// (combine) are loops over the k slots, sums over an expert's pairs
// (expert_sum) loops over its segment of sorted_pair, reductions sum(i, ...)
// that are not GEMMs loops over i; a top-level softmax along one index
// becomes a row loop.
struct PointwiseStep {
  std::string name;
  std::string output;
  std::vector<Var> vars;
  Expr body;
  // Sibling element-wise definitions over the same indices, computed in the
  // same pass (merge_sibling_pointwise): inputs they share are read once.
  // Each value reads no output of the step.
  std::vector<ExtraOutput> extra;
  // (output, input): outputs the step may write over an input's bytes
  // (lowering/in_place.h). Backends compute every value of an element before
  // storing any, so this holds for them all; the memory plan gives the two
  // one offset, and kernels do not mark their pointers __restrict__.
  std::vector<std::pair<std::string, std::string>> in_place;
};

// The device routing: top-k over probs, counts, padded offsets, the stable
// permutation (sorted_pair, pair_pos) and the tile table.
struct RoutingStep {
  const RoutingNode *route;
  std::string probs; // f32 [T, E]: the scores top-k selects by
  int block = 128;
  // Set by softmax_into_routing: `probs` holds logits, and the routing takes
  // the row softmax itself (as a pointwise softmax step would) before
  // selecting, so the probabilities are never stored.
  bool softmax = false;
  // Set by gate_from_routing: a pair-order f32 tensor [pairs] the routing
  // writes with each pair's chosen score (the gate S(token(r), expert(r))),
  // in place of the pointwise step that read it back from `probs`.
  std::string gate_output;
  // Also set by gate_from_routing, for top_k(..., renormalize): gate_output
  // holds each chosen score divided by the sum of its token's k chosen
  // scores (added in slot order from 0, as the step route_sum computes it),
  // in place of the two pointwise steps that did so.
  bool renormalize = false;
  // Fixed expert capacity (dsl/capacity.h): 0 dropless; else each expert
  // keeps its C pairs of highest `priority` (Schedule::capacity for top_k,
  // the route's own for expert choice). A dropped pair r gets no padded row:
  // pair_pos[r] is the drop row (runtime/routing_host.h), and the sums over
  // a token's pairs skip it.
  double capacity_factor = 0;
  KeepPriority priority = KeepPriority::token_order;
  bool drops() const { return capacity_factor > 0; }
};

// dst[p, :] = src[row(sorted_pair[p]), :], zero on padding rows (blocked);
// row(r) = token(r) (rows = gather_token) or r (gather_pair).
struct GatherStep {
  std::string name;
  const RoutingNode *route;
  std::string src, dst;
  RowMap rows = RowMap::gather_token;
};

// dst = the transpose of src's last two dims (leading dims kept), or, for a
// routed source (route set), dst[c, p] = src[row(p), c] over every padded
// position p (zero on padding), row(p) given by `rows` as for GEMM operands.
struct TransposeStep {
  std::string name;
  std::string src, dst;
  const RoutingNode *route = nullptr;
  RowMap rows = RowMap::direct;
};

// out[r, c] = sum over u of softmax over u of (scale * sum over j of
// q[r, j] key[u, j]), times value[u, c]: an attention between projections,
// with u over the run-time token count (lowering/fuse_attention.h). The
// softmax is taken online, one pass over key and value per row: the
// [rows, T] scores, 4 GiB of f32 at T = 16384 with 32768 rows, are never
// stored. key and value are dense [T, F] rows. The step's rows are a
// route's padded slots where any of its row tensors (q, out, and the
// gradients' d_z, lse, delta) is padded (route set: a padded tensor's row
// is the slot, a pair-order tensor's sorted_pair[slot]; padding slots give
// zero rows), else q's own rows, all real (dense, or a route's pair order).
//
// Training (FlashAttention's backward) splits it in three parts, so that
// the probabilities are never stored either:
//   forward         out = z, and where lse is set each row's log-sum-exp
//                   (max + log sum exp(s - max)) of its scaled scores;
//   query_gradient  out = d_q[r] = sum_u ds(r, u) key[u], and delta[r] =
//                   sum_c d_z[r, c] z[r, c], where p(r, u) = exp(s - lse[r])
//                   is made again from the scores s and
//                   ds = p (d_z[r] . value[u] - delta[r]) scale;
//   key_gradient    out = d_key[u] = sum_r ds(r, u) q[r] and d_value[u] =
//                   sum_r p(r, u) d_z[r], over every row r, delta read.
// delta is the softmax gradient's row term sum_u p d_p, which equals
// d_z . z because z = p value.
struct AttentionStep {
  enum class Part { forward, query_gradient, key_gradient };
  Part part = Part::forward;
  std::string name;
  std::string output, q, key, value;
  double scale = 1;
  const RoutingNode *route = nullptr;
  std::string lse;     // forward: written where set; gradients: read
  std::string z, d_z;  // the gradients: the forward's output and its gradient
  std::string delta;   // query_gradient writes it, key_gradient reads it
  std::string d_value; // key_gradient's second output
};
// The step's row tensors (q, output, and the gradients' d_z, lse, delta;
// not the key-side outputs), those it walks by row.
std::vector<std::string> attention_row_tensors(const AttentionStep &a);

using Step = std::variant<RoutingStep, GatherStep, GemmStep, PointwiseStep, TransposeStep, AttentionStep>;

struct KernelProgram {
  std::vector<TensorDecl> tensors;
  std::vector<Step> steps;
  std::vector<std::string> outputs;
  std::vector<const RoutingNode *> routes;
  std::string schedule_name;
  bool reuse_memory = false; // Schedule::reuse_memory: the runtime places tensors by lifetime
  // Schedule::gradients_over_saved: a backward element-wise output may take
  // the bytes of a tensor the forward saved (lowering/in_place.h).
  bool gradients_over_saved = false;
  // Layer-wide choices the schedule named that lowering found nothing to
  // apply to, each "<primitive>(true) is not applied: <why>" (the program
  // runs without them; not_applied_choices prints them with the GEMMs').
  std::vector<std::string> not_applied;

  const TensorDecl &tensor(const std::string &name) const;
  // The routing step of route r (internal error when there is none).
  const RoutingStep &routing(const RoutingNode *r) const;
  TensorDecl *find(const std::string &name);
  const TensorDecl *find(const std::string &name) const;
};

std::ostream &operator<<(std::ostream &os, const KernelProgram &p);

// The run-time extent a generated kernel takes for a route that drops pairs
// at capacity: its max_padded_rows (runtime/routing_host.h), which depends
// on the capacity the host computes from T, so kernels read it as an
// argument (ProgramShapes binds it) rather than computing it from T.
inline std::string max_padded_rows_extent(const RoutingNode *r) { return r->name + ".max_padded_rows"; }
// A placeholder tensor read by lowered expressions: an accumulator or an
// intermediate that lowering introduced. Never defined; only its name and
// indices are read.
FuncPtr placeholder(const std::string &name, std::vector<Var> args, DType t);
// A read of tensor `name` at `args`, as the lowered steps write one (steps
// use only a read's name, dtype and indices).
Expr tensor_read(const std::string &name, DType dtype, std::vector<Index> args);

// Whether e reads anything at index variable v: a read at v, token(v) or
// expert(v), an [a == b] over v, a sum over v's route. Reads of `registers`
// (a GEMM's accumulators, which are not loads) do not count.
bool uses_var(const Expr &e, const Var &v, const std::vector<FuncPtr> &registers = {});

// The Func whose schedule settings a GEMM takes and whose name its messages
// give: GemmStep::func, or its output where lowering made the step.
inline const std::string &func_of(const GemmStep &g) { return g.func.empty() ? g.output : g.func; }

// Whether a GEMM's primary output is its one accumulator as it is
// (acc0(row, col)): no epilogue around the sum.
bool stores_plain_accumulator(const GemmStep &g);
std::string step_name(const Step &s);
// An element-wise step's name from what it writes, in order
// ("pointwise_" + output, then "_" + each extra output's name).
std::string pointwise_name(const PointwiseStep &s);
// The tensors a step reads (each read once per mention) and the one it
// writes (empty for a routing step, which writes its route's tables).
std::vector<std::string> step_reads(const Step &s);
// Whether `name` is one of the program's outputs (the caller's tensors).
bool is_output(const KernelProgram &p, const std::string &name);
// How many times the program's steps read tensor `name` (step_reads').
int reads_of(const KernelProgram &p, const std::string &name);
// Whether no step reads tensor `name` and the caller does not ask for it
// (a fused output nobody reads is then not stored).
bool unwanted(const KernelProgram &p, const std::string &name);
// Removes tensor `name`'s declaration, if the program has one (a pass that
// took its step away).
void erase_tensor(KernelProgram &p, const std::string &name);
std::string step_output(const Step &s);
// Every tensor a step writes: step_output's, then a GEMM's or an element-wise
// step's extra outputs or a routing step's gate_output.
std::vector<std::string> step_outputs(const Step &s);
// The index of the step that writes `name` (step_outputs'); -1 for an input.
long step_writing(const KernelProgram &p, const std::string &name);
// Schedule::bf16_boundary: the tensors `names` (a layer's outputs, its
// Inputs' gradients) stored in bf16 where they are f32 matrices, so that a
// bf16 model reads them without a conversion of its own; not where a GEMM
// adds into one (atomic_combine: its f32 sum is the output, and bf16
// atomics would round every pair's share).
void store_in_bf16(KernelProgram &p, std::set<std::string> names);

// Moves the steps of [begin, end) that read any of `late` (or what such a
// step writes) after the others, each group in its own order, and returns
// where the moved steps start (end when none moved). What a step needs is
// written by a step before it in either group, so the program stays valid;
// a runtime runs [begin, split) before `late` is ready and the rest after
// (an expert-parallel layer's token side: its rows go out before the
// experts' results come back).
size_t defer_steps_reading(KernelProgram &p, size_t begin, size_t end, const std::vector<std::string> &late);

// Moves the steps of [begin, end) that no step writing `targets` needs
// (directly or through other steps of the range) after those that are
// needed, each group in its own order, and returns where the moved steps
// start. A runtime can hand `targets` on (to another stream, another GPU)
// while the moved steps run: an expert-parallel rank's experts send back
// their received rows' gradients while their weight gradients compute.
size_t defer_steps_not_needed_for(KernelProgram &p, size_t begin, size_t end, const std::vector<std::string> &targets);

// Whether no step reads the rows of `tensor` that belong to pairs route r
// drops at capacity: a padded tensor of r (a dropped pair's row is the drop
// row, which lowering lets nothing read), or a pair-order one that is not a
// program output and is read only inside r's combines and expert sums, by
// r's routed GEMMs, gathers and transposes (which walk the kept pairs).
// An element-wise step writing only such tensors may skip dropped pairs.
bool dropped_rows_unread(const KernelProgram &p, const std::string &tensor, const RoutingNode *r);

} // namespace moeforge
