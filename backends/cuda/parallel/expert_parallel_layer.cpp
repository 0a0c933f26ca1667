#include "backends/cuda/parallel/expert_parallel_layer.h"

#include <algorithm>

#include "backends/cuda/device/expert_parallel_cuh.h"
#include "dsl/error.h"
#include "dsl/training.h"
#include "lowering/lower.h"
#include "runtime/routing_host.h"

namespace moeforge::cuda {

namespace {

constexpr int kRowThreads = 256;

// Whether a step in [begin, end) of `p` writes `name`.
bool written_in(const KernelProgram &p, const std::string &name, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const std::vector<std::string> out = step_outputs(p.steps[i]);
    if (std::find(out.begin(), out.end(), name) != out.end())
      return true;
  }
  return false;
}

const std::string &seed_of(const TrainingProgram &t, const std::string &output) {
  return t.seeds[t.output_index(output, "expert_parallel")];
}

size_t row_bytes(const KernelProgram &p, const std::string &name, int64_t width) {
  return static_cast<size_t>(width) * dtype_bytes(p.tensor(name).dtype);
}

// Splits the experts' forward for exchange_chunks rounds
// (CompiledExpertParallel::chunks): what does not read the received rows
// first, then the routed GEMMs that run round by round.
void plan_rounds(CompiledExpertParallel &c, TrainingProgram &e) {
  std::vector<std::string> received;
  for (const auto &x : c.split.dispatched)
    received.push_back(x.expert_side);
  KernelProgram &p = e.program;
  c.chunk_begin = defer_steps_reading(p, 0, e.forward_steps, received);
  c.chunk_end = c.chunk_begin;
  for (; c.chunk_end < e.forward_steps; ++c.chunk_end) {
    auto *g = std::get_if<GemmStep>(&p.steps[c.chunk_end]);
    if (!g || !g->route || g->route->name != c.split.route || g->expert_k)
      break;
    g->windowed = true;
  }
  user_check(c.chunk_end > c.chunk_begin)
      << "exchange_chunks(" << c.chunks << "): the experts' first step over the rows they receive, '"
      << (c.chunk_begin < e.forward_steps ? step_name(p.steps[c.chunk_begin]) : "none")
      << "', is not a GEMM over the route's tiles, the only step that runs over one group of experts at a time: "
      << "choose a schedule whose expert GEMMs read the received rows themselves (scattermoe's, say) or use "
      << "exchange_chunks(1)";
  c.return_per_chunk = c.chunk_end == e.forward_steps;
}

} // namespace

CompiledExpertParallel compile_expert_parallel(const Pipeline &pipeline, const Schedule &spread,
                                               const std::string &arch) {
  const int ranks = spread.expert_parallel_ranks();
  const Schedule schedule = spread.on_one_rank(); // what each side runs under
  user_check(schedule.capacity() == 0)
      << "expert_parallel: a capacity factor with the experts spread over ranks is not built yet; train dropless "
      << "(no capacity) across ranks, or on one GPU with the capacity";
  CompiledExpertParallel c;
  c.split = split_expert_parallel(pipeline, ranks);
  const ExpertParallelSplit &s = c.split;

  // Each side takes the schedule's choices for the Funcs it holds.
  const Pipeline token_algebra = training_algebra(s.token_pipeline(), s.token_outputs).pipeline;
  check_vector_alignment(token_algebra);
  TrainingProgram t = lower_training(s.token_pipeline(), s.token_outputs, schedule.only_funcs_of(token_algebra));
  std::vector<std::string> returned, dispatched_gradients;
  for (const auto &x : s.returned)
    returned.push_back(x.token_side);
  for (const auto &x : s.dispatched)
    dispatched_gradients.push_back(seed_of(t, x.token_side));
  c.dispatch_end = defer_steps_reading(t.program, 0, t.forward_steps, returned);
  c.backward_split = defer_steps_reading(t.program, t.forward_steps, t.program.steps.size(), dispatched_gradients);
  for (const auto &x : s.dispatched)
    user_check(written_in(t.program, x.token_side, 0, c.dispatch_end))
        << "expert_parallel: the rows '" << x.token_side << "' that go to the experts need what the experts return";
  std::vector<std::string> returned_gradients;
  for (const auto &x : s.returned) {
    internal_check(written_in(t.program, t.gradient_of(x.token_side), t.forward_steps, c.backward_split))
        << "the gradient of the returned rows '" << x.token_side << "' waits for the experts' gradients";
    returned_gradients.push_back(t.gradient_of(x.token_side));
  }
  c.returned_gradients_end =
      defer_steps_not_needed_for(t.program, t.forward_steps, c.backward_split, returned_gradients);

  const Pipeline expert_algebra = training_algebra(s.expert_pipeline(), s.expert_outputs).pipeline;
  check_vector_alignment(expert_algebra);
  TrainingProgram e = lower_training(s.expert_pipeline(), s.expert_outputs, schedule.only_funcs_of(expert_algebra));
  std::vector<std::string> row_gradients;
  for (const auto &x : s.dispatched)
    row_gradients.push_back(e.gradient_of(x.expert_side));
  c.row_gradients_end = defer_steps_not_needed_for(e.program, e.forward_steps, e.program.steps.size(), row_gradients);
  c.chunks = spread.exchange_chunks();
  user_check(c.chunks <= s.local_experts)
      << "exchange_chunks(" << c.chunks << "): each round moves the rows of a group of a rank's experts, and this "
      << "layer has " << s.local_experts << " a rank (" << s.experts << " over " << ranks << "): use at most "
      << s.local_experts << " chunks";
  if (c.chunks > 1)
    plan_rounds(c, e);
  c.token.layer = compile_program(t.program, arch);
  c.token.training = std::move(t);
  c.experts.layer = compile_program(e.program, arch);
  c.experts.training = std::move(e);
  CompileOptions options;
  options.arch = arch;
  c.row_kernels = compile_cuda(kExpertParallelKernelsSource, "expert_parallel.cu", options);
  return c;
}

ExpertParallelLayer::ExpertParallelLayer(const Device &device, const CompiledExpertParallel &compiled,
                                         const Communicator &comm, int64_t tokens)
    : compiled_(compiled), comm_(comm), tokens_(tokens),
      pairs_(tokens * compiled.token.training.program.routing(compiled.token.training.program.routes.front()).route->k),
      token_(device, compiled.token.layer, tokens, compiled.token.training.forward_steps),
      experts_(device, compiled.experts.layer, comm.size() * pairs_, compiled.experts.training.forward_steps),
      exchange_(comm, ExpertPlacement(static_cast<int>(compiled.split.experts), comm.size())),
      module_(compiled.row_kernels.cubin, "expert parallel row kernels"), sm_count_(device.sm_count()) {
  user_check(comm.size() == compiled.split.ranks) << "expert parallel layer: compiled for " << compiled.split.ranks
                                                  << " ranks, given a communicator of " << comm.size();
  pack_ = module_.kernel("mf_ep_pack");
  unpack_ = module_.kernel("mf_ep_unpack");
  select_ = module_.kernel("mf_ep_select");
  // The widest row that crosses: a gradient's (f32) at most.
  size_t widest = 16;
  const KernelProgram &tp = compiled.token.training.program;
  for (const auto &x : compiled.split.dispatched)
    widest = std::max({widest, row_bytes(tp, x.token_side, x.width),
                       row_bytes(tp, seed_of(compiled.token.training, x.token_side), x.width)});
  for (const auto &x : compiled.split.returned)
    widest = std::max({widest, row_bytes(tp, x.token_side, x.width),
                       row_bytes(tp, compiled.token.training.gradient_of(x.token_side), x.width)});
  out_rows_ = DeviceBuffer(static_cast<size_t>(pairs_) * widest);
  back_rows_ = DeviceBuffer(static_cast<size_t>(pairs_) * widest);
  segment_end_ = DeviceBuffer(sizeof(int64_t) * comm.size() * compiled.split.local_experts);
  if (compiled.chunks > 1) {
    // A chunked forward holds every crossing's rows at once: rounds of one
    // tensor are still travelling while the next is packed.
    const size_t more = compiled.split.dispatched.size() + compiled.split.returned.size() - 2;
    for (size_t i = 0; i < more; ++i)
      rows_of_.emplace_back(static_cast<size_t>(pairs_) * widest);
    round_in_.resize(compiled.chunks);
    round_done_.resize(compiled.chunks);
  }
}

CUdeviceptr ExpertParallelLayer::packed_rows(size_t crossing) {
  return crossing == 0 ? out_rows_.ptr() : rows_of_.at(crossing - 1).ptr();
}

CUdeviceptr ExpertParallelLayer::returned_rows(size_t crossing) {
  return crossing == 0 ? back_rows_.ptr() : rows_of_.at(compiled_.split.dispatched.size() - 1 + crossing - 1).ptr();
}

bool ExpertParallelLayer::is_expert_param(const std::string &name) const {
  const auto &p = compiled_.split.expert_params;
  return std::find(p.begin(), p.end(), name) != p.end();
}

void ExpertParallelLayer::upload(const TensorMap &inputs) {
  const ExpertParallelSplit &s = compiled_.split;
  const TrainingProgram &t = compiled_.token.training;
  for (const TensorDecl &d : t.program.tensors) {
    const bool returned = std::any_of(s.returned.begin(), s.returned.end(),
                                      [&](const ExpertParallelSplit::Crossing &x) { return x.token_side == d.name; });
    if (!d.is_input || returned || t.is_seed(d.name))
      continue; // the exchange writes it, or upload_upstream_gradient
    auto it = inputs.find(d.name);
    user_check(it != inputs.end()) << "expert parallel layer: no tensor given for '" << d.name << "'";
    token_.upload(d.name, it->second);
  }
  for (const std::string &name : s.expert_params) {
    auto it = inputs.find(name);
    user_check(it != inputs.end()) << "expert parallel layer: no tensor given for '" << name << "'";
    const HostTensor &w = it->second;
    user_check(!w.shape.empty() && (w.shape[0] == s.experts || w.shape[0] == s.local_experts))
        << "expert parallel layer: '" << name << "' has " << (w.shape.empty() ? 0 : w.shape[0]) << " rows; give all "
        << s.experts << " experts' or this rank's " << s.local_experts;
    if (w.shape[0] == s.local_experts) {
      experts_.upload(name, w);
      continue;
    }
    HostTensor mine = w;
    mine.shape[0] = s.local_experts;
    const int64_t per = w.size() / w.shape[0];
    mine.data.assign(w.data.begin() + comm_.rank() * s.local_experts * per,
                     w.data.begin() + (comm_.rank() + 1) * s.local_experts * per);
    experts_.upload(name, mine);
  }
  forward_ran_ = false;
}

void ExpertParallelLayer::upload_repeated(const std::string &name, const HostTensor &pattern) {
  if (is_expert_param(name))
    experts_.upload_repeated(name, pattern);
  else
    token_.upload_repeated(name, pattern);
  forward_ran_ = false;
}

void ExpertParallelLayer::mark(const char *name, const Stream &stream) {
  if (!timing_)
    return;
  marks_.emplace_back(name, Event());
  marks_.back().second.record(stream);
}

std::vector<std::pair<std::string, double>> ExpertParallelLayer::phase_ms() const {
  std::vector<std::pair<std::string, double>> out;
  // Between the forward's end and the backward's start the host did other
  // things: not a phase.
  for (size_t i = 1; i < marks_.size(); ++i)
    if (marks_[i].first != "backward start")
      out.emplace_back(marks_[i].first, elapsed_ms(marks_[i - 1].second, marks_[i].second));
  return out;
}

void ExpertParallelLayer::upload_upstream_gradient(const std::string &output, const HostTensor &grad) {
  const TrainingProgram &t = compiled_.token.training;
  const size_t k = t.output_index(output, "upload_upstream_gradient()");
  for (const auto &x : compiled_.split.dispatched)
    user_check(x.token_side != output) << "'" << output << "' is the rows the experts read, not a layer output";
  token_.upload(t.seeds[k], grad);
}

void ExpertParallelLayer::poison() {
  token_.poison();
  experts_.poison();
  forward_ran_ = false;
}

// Rows of one tensor move between the sides as 16-byte vectors, each in
// its side's storage type (the same on both: the split keeps the types).
size_t ExpertParallelLayer::crossing_bytes(const std::string &token_tensor, const std::string &expert_tensor,
                                           int64_t width) const {
  const size_t bytes = row_bytes(compiled_.token.training.program, token_tensor, width);
  internal_check(bytes == row_bytes(compiled_.experts.training.program, expert_tensor, width))
      << "'" << token_tensor << "' and '" << expert_tensor << "' differ in type";
  internal_check(bytes % 16 == 0) << "rows of " << bytes << " bytes cross the exchange in 16-byte vectors";
  return bytes;
}

void ExpertParallelLayer::launch_rows(const Kernel &kernel, CUdeviceptr from, CUdeviceptr to, size_t bytes, bool padded,
                                      const Stream &stream) {
  const RoutingPlan &r = token_.routing_plan(compiled_.split.route);
  CUdeviceptr expert = r.expert.ptr(), pos = r.pair_pos.ptr(), off = r.offsets.ptr(), unp = r.offsets_unpadded.ptr();
  long long pairs = pairs_;
  int vectors = static_cast<int>(bytes / 16);
  int padded_flag = padded ? 1 : 0;
  void *args[] = {&from, &to, &expert, &pos, &off, &unp, &pairs, &vectors, &padded_flag};
  const int64_t blocks = std::min<int64_t>((pairs_ * vectors + kRowThreads - 1) / kRowThreads, 8LL * sm_count_);
  kernel.launch({static_cast<unsigned>(std::max<int64_t>(blocks, 1))}, {kRowThreads}, 0, stream, args);
}

size_t ExpertParallelLayer::pack_rows(const std::string &token_tensor, const std::string &expert_tensor, int64_t width,
                                      CUdeviceptr to, const Stream &stream) {
  const size_t bytes = crossing_bytes(token_tensor, expert_tensor, width);
  const RowLayout layout = compiled_.token.training.program.tensor(token_tensor).layout;
  internal_check(layout != RowLayout::sorted) << "'" << token_tensor << "' crosses the exchange stored sorted";
  const bool padded = layout == RowLayout::padded;
  launch_rows(pack_, token_.address(token_tensor), to, bytes, padded, stream);
  return bytes;
}

void ExpertParallelLayer::send_to_experts(const std::string &token_tensor, const std::string &expert_tensor,
                                          int64_t width, const Stream &stream) {
  const size_t bytes = pack_rows(token_tensor, expert_tensor, width, out_rows_.ptr(), stream);
  exchange_.dispatch(out_rows_.ptr(), experts_.address(expert_tensor), bytes, sizes_, stream);
}

void ExpertParallelLayer::bring_back(const std::string &expert_tensor, const std::string &token_tensor, int64_t width,
                                     const Stream &stream) {
  const size_t bytes = crossing_bytes(token_tensor, expert_tensor, width);
  exchange_.give_back(experts_.address(expert_tensor), back_rows_.ptr(), bytes, sizes_, stream);
  launch_rows(unpack_, back_rows_.ptr(), token_.address(token_tensor), bytes, false, stream);
}

void ExpertParallelLayer::forward(const Stream &stream) {
  const CompiledExpertParallel &c = compiled_;
  marks_.clear();
  mark("start", stream);
  token_.enqueue(stream, 0, c.dispatch_end);
  mark("forward: token side to the rows out", stream);
  sizes_ = exchange_.exchange_counts(token_.routing_plan(c.split.route).counts.ptr(), stream);
  mark("forward: counts (host sync)", stream);
  received_ = sizes_.total_recv();
  if (received_ > 0)
    experts_.set_tokens(received_);

  if (c.chunks > 1) {
    forward_in_chunks(stream);
  } else {
    for (const auto &x : c.split.dispatched)
      send_to_experts(x.token_side, x.expert_side, x.width, stream);
    mark("forward: dispatch", stream);
    if (received_ > 0) {
      select_experts(stream);
      experts_.enqueue(stream, 0, c.experts.training.forward_steps);
    }
    mark("forward: experts", stream);
    for (const auto &x : c.split.returned)
      bring_back(x.expert_side, x.token_side, x.width, stream);
    mark("forward: return", stream);
  }
  token_.enqueue(stream, c.dispatch_end, c.token.training.forward_steps);
  mark("forward: combine", stream);
  forward_ran_ = true;
}

void ExpertParallelLayer::select_experts(const Stream &stream) {
  // Each received row's local expert: the segments (source rank, local
  // expert) in the order they arrived.
  std::vector<int64_t> ends(sizes_.recv_counts.size());
  int64_t at = 0;
  for (size_t i = 0; i < ends.size(); ++i)
    ends[i] = at += sizes_.recv_counts[i];
  segment_end_.upload(ends);
  CUdeviceptr select = experts_.address(compiled_.split.selector), segments = segment_end_.ptr();
  int n_segments = static_cast<int>(ends.size()), local = static_cast<int>(compiled_.split.local_experts);
  long long rows = received_;
  void *args[] = {&select, &segments, &n_segments, &local, &rows};
  const int64_t blocks = std::min<int64_t>((received_ * local + kRowThreads - 1) / kRowThreads, 8LL * sm_count_);
  select_.launch({static_cast<unsigned>(blocks)}, {kRowThreads}, 0, stream, args);
}

std::vector<std::vector<int32_t>> ExpertParallelLayer::chunk_windows() const {
  const int local = static_cast<int>(compiled_.split.local_experts), R = comm_.size();
  const int bs = experts_.routing_plan(compiled_.split.route).shape.block;
  // The expert route's tiles, as the device routing will lay them out from
  // the rows each local expert receives.
  std::vector<int32_t> tiles_of(local, 0);
  for (int j = 0; j < local; ++j) {
    int64_t rows = 0;
    for (int q = 0; q < R; ++q)
      rows += sizes_.recv_counts[q * local + j];
    tiles_of[j] = static_cast<int32_t>((rows + bs - 1) / bs);
  }
  const std::vector<TileSlot> order = pair_aligned_tiles(tiles_of);
  std::vector<std::vector<int32_t>> windows(compiled_.chunks);
  for (int ch = 0; ch < compiled_.chunks; ++ch) {
    const ExpertGroup g = chunk_experts(local, compiled_.chunks, ch);
    for (size_t i = 0; i < order.size(); ++i)
      if (order[i].expert >= g.first && order[i].expert < g.end)
        windows[ch].push_back(static_cast<int32_t>(i));
  }
  return windows;
}

void ExpertParallelLayer::forward_in_chunks(const Stream &stream) {
  const CompiledExpertParallel &c = compiled_;
  const ExpertParallelSplit &s = c.split;
  const int local = static_cast<int>(s.local_experts);
  std::vector<size_t> out_bytes, back_bytes;
  for (size_t i = 0; i < s.dispatched.size(); ++i) {
    const auto &x = s.dispatched[i];
    out_bytes.push_back(pack_rows(x.token_side, x.expert_side, x.width, packed_rows(i), stream));
  }
  for (const auto &x : s.returned)
    back_bytes.push_back(crossing_bytes(x.token_side, x.expert_side, x.width));
  if (received_ > 0) {
    select_experts(stream);
    experts_.set_tile_windows(s.route, chunk_windows());
    experts_.enqueue(stream, 0, c.chunk_begin); // the route over the rows to come
  }
  // Round by round on the second stream: every round's rows go out at once
  // (each arrives under the GEMMs of the rounds before it), and a round's
  // results start back once its GEMMs are done. Every rank posts its NCCL
  // calls in the same order: all rounds out, then all back.
  rows_out_ready_.record(stream);
  moves_.wait(rows_out_ready_);
  for (int ch = 0; ch < c.chunks; ++ch) {
    const ExpertGroup g = chunk_experts(local, c.chunks, ch);
    for (size_t i = 0; i < s.dispatched.size(); ++i)
      exchange_.dispatch(packed_rows(i), experts_.address(s.dispatched[i].expert_side), out_bytes[i], sizes_, g,
                         moves_);
    round_in_[ch].record(moves_);
  }
  for (int ch = 0; ch < c.chunks; ++ch) {
    stream.wait(round_in_[ch]);
    if (received_ > 0)
      experts_.enqueue_window(stream, c.chunk_begin, c.chunk_end, static_cast<size_t>(ch));
    if (!c.return_per_chunk)
      continue;
    round_done_[ch].record(stream);
    moves_.wait(round_done_[ch]);
    const ExpertGroup g = chunk_experts(local, c.chunks, ch);
    for (size_t i = 0; i < s.returned.size(); ++i)
      exchange_.give_back(experts_.address(s.returned[i].expert_side), returned_rows(i), back_bytes[i], sizes_, g,
                          moves_);
  }
  mark("forward: rows out, experts, rows back (in rounds)", stream);
  if (c.return_per_chunk) {
    rows_back_.record(moves_);
    stream.wait(rows_back_);
  } else {
    if (received_ > 0)
      experts_.enqueue(stream, c.chunk_end, c.experts.training.forward_steps);
    for (size_t i = 0; i < s.returned.size(); ++i)
      exchange_.give_back(experts_.address(s.returned[i].expert_side), returned_rows(i), back_bytes[i], sizes_, stream);
  }
  for (size_t i = 0; i < s.returned.size(); ++i)
    launch_rows(unpack_, returned_rows(i), token_.address(s.returned[i].token_side), back_bytes[i], false, stream);
  mark("forward: return", stream);
}

void ExpertParallelLayer::backward(const Stream &stream) {
  user_check(forward_ran_) << "expert parallel layer: backward() before forward()";
  const CompiledExpertParallel &c = compiled_;
  const TrainingProgram &tt = c.token.training, &et = c.experts.training;
  // Without overlap the rows move on `stream` itself, in step order.
  const Stream &comm = overlap_ ? moves_ : stream;
  mark("backward start", stream);
  token_.enqueue(stream, tt.forward_steps, c.returned_gradients_end);
  mark("backward: token side to the rows out", stream);
  if (overlap_) {
    rows_out_ready_.record(stream);
    comm.wait(rows_out_ready_);
  }
  // The returned rows' gradients (gate * dy) go to the experts as theirs.
  for (const auto &x : c.split.returned)
    send_to_experts(tt.gradient_of(x.token_side), seed_of(et, x.expert_side), x.width, comm);
  if (!overlap_)
    mark("backward: dispatch", stream);
  // The router's backward, while the rows go out.
  token_.enqueue(stream, c.returned_gradients_end, c.backward_split);
  mark("backward: router", stream);
  if (overlap_) {
    rows_out_.record(comm);
    stream.wait(rows_out_);
    mark("backward: dispatch (waiting)", stream);
  }
  if (received_ > 0) {
    experts_.enqueue(stream, et.forward_steps, c.row_gradients_end);
  } else {
    // No rows: this rank's experts' weight gradients are zero, as one GPU's.
    for (const std::string &w : c.split.expert_params)
      MOEFORGE_CU(cuMemsetD8Async, experts_.address(et.gradient_of(w)), 0, experts_.info(et.gradient_of(w)).bytes,
                  stream.handle());
  }
  mark("backward: experts' row gradients", stream);
  if (overlap_) {
    rows_back_ready_.record(stream);
    comm.wait(rows_back_ready_);
  }
  // The received rows' gradients come back as the dispatched rows'.
  for (const auto &x : c.split.dispatched)
    bring_back(et.gradient_of(x.expert_side), seed_of(tt, x.token_side), x.width, comm);
  if (!overlap_)
    mark("backward: return", stream);
  // The experts' weight gradients, while the rows go back.
  if (received_ > 0)
    experts_.enqueue(stream, c.row_gradients_end, et.program.steps.size());
  mark("backward: experts' weight gradients", stream);
  if (overlap_) {
    rows_back_.record(comm);
    stream.wait(rows_back_);
    mark("backward: return (waiting)", stream);
  }
  token_.enqueue(stream, c.backward_split, tt.program.steps.size());
  mark("backward: token side", stream);
}

HostTensor ExpertParallelLayer::output(const std::string &name) const { return token_.download(name); }

HostTensor ExpertParallelLayer::gradient(const std::string &of) const {
  if (is_expert_param(of))
    return experts_.download(compiled_.experts.training.gradient_of(of));
  return token_.download(compiled_.token.training.gradient_of(of));
}

} // namespace moeforge::cuda
