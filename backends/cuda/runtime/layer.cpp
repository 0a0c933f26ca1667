#include "backends/cuda/runtime/layer.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <future>
#include <thread>

#include "backends/cuda/codegen/tile_library.h"
#include "backends/cuda/runtime/launch_grid.h"
#include "backends/cuda/runtime/tensor_map.h"
#include "backends/cuda/runtime/timeline.h"
#include "dsl/error.h"
#include "lowering/gemm_plan.h"
#include "lowering/lower.h"
#include "runtime/layer_checks.h"

namespace moeforge::cuda {

CompiledLayer compile_layer(const Pipeline &pipeline, const Schedule &schedule, const std::string &arch) {
  check_vector_alignment(pipeline);
  return compile_program(lower(pipeline, schedule), arch);
}

CompiledLayer compile_program(KernelProgram program, const std::string &arch) {
  CompiledLayer c;
  c.program = std::move(program);
  plan_gemms(c.program); // of the program as compiled (a caller may have changed it since lowering)
  c.source = generate_cuda(c.program);
  CompileOptions options;
  options.arch = arch;
  options.headers = tile_library_headers();
  const std::vector<GeneratedKernel> &kernels = c.source.kernels;
  internal_check(!kernels.empty()) << "a kernel program with no kernels";
  if (c.source.timeline) {
    c.units.push_back(compile_cuda(c.source.source, "moeforge_" + c.program.schedule_name + ".cu", options));
    c.unit_of.assign(kernels.size(), 0);
    return c;
  }
  // NVRTC compiles a program on one thread: the kernels go side by side, a
  // few at a time, and the first failure (in kernel order) is the one told.
  // A unit's name is its kernel's, not the schedule's, so that the same
  // kernel under another schedule name is the same cache entry.
  c.units.resize(kernels.size());
  c.unit_of.resize(kernels.size());
  const char *threads = std::getenv("MOEFORGE_NVRTC_THREADS");
  const size_t most = threads && *threads ? std::strtoul(threads, nullptr, 10) : std::thread::hardware_concurrency();
  const size_t width = std::max<size_t>(1, std::min<size_t>(most, kernels.size()));
  auto unit = [&](size_t i) { return compile_cuda(c.source.unit(i), "moeforge_" + kernels[i].name + ".cu", options); };
  for (size_t i = 0; i < kernels.size(); ++i)
    c.unit_of[i] = i;
  if (width == 1) { // on this thread
    for (size_t i = 0; i < kernels.size(); ++i)
      c.units[i] = unit(i);
    return c;
  }
  for (size_t first = 0; first < kernels.size(); first += width) {
    std::vector<std::future<CompileResult>> running;
    for (size_t i = first; i < std::min(kernels.size(), first + width); ++i)
      running.push_back(std::async(std::launch::async, unit, i));
    for (size_t i = first; i < first + running.size(); ++i)
      c.units[i] = running[i - first].get();
  }
  return c;
}

const ResourceReport *CompiledLayer::resources_of(const std::string &kernel) const {
  for (const CompileResult &u : units)
    if (const ResourceReport *r = u.resources_of(kernel))
      return r;
  return nullptr;
}

CudaLayer::CudaLayer(const Device &device, const CompiledLayer &layer, int64_t tokens, size_t keep_across,
                     LayerMemory memory)
    : layer_(layer), tokens_(tokens), capacity_tokens_(tokens), shapes_(layer.program, tokens), routing_(device),
      score_check_(std::make_unique<RoutingScoreCheck>()), sm_count_(device.sm_count()), memory_(memory),
      keep_across_(keep_across) {
  for (const auto &[r, shape] : shapes_.routings())
    route_names_.push_back(r->name); // the order of plans_ (a map by the same keys)
  for (size_t u = 0; u < layer.units.size(); ++u)
    modules_.emplace_back(layer.units[u].cubin, "moeforge layer unit " + std::to_string(u));
  auto bytes = [&](const TensorDecl &t) { return static_cast<size_t>(shapes_.elements(t)) * dtype_bytes(t.dtype); };
  if (memory_ == LayerMemory::caller) {
    // No memory at all until place() and bind(); the launches are built at
    // the first run, when every address is known.
    for (const auto &[r, shape] : shapes_.routings()) {
      plans_[r] = std::make_unique<RoutingPlan>(RoutingPlan::unplaced(shape));
      padded_rows_[r] = 0;
    }
    plan_caller_memory();
    for (const TensorDecl &t : layer_.program.tensors)
      tensors_.emplace(t.name, DeviceBuffer::view(0, bytes(t)));
    return;
  }
  for (const auto &[r, shape] : shapes_.routings()) {
    auto plan = std::make_unique<RoutingPlan>(shape);
    padded_rows_[r] = plan->offsets.ptr() + sizeof(int32_t) * shape.experts;
    plans_[r] = std::move(plan);
  }
  if (layer_.program.reuse_memory) {
    plan_ = std::make_unique<MemoryPlan>(plan_memory(layer_.program, bytes, keep_across));
    arena_ = DeviceBuffer(plan_->arena_bytes);
  }
  for (const TensorDecl &t : layer_.program.tensors)
    tensors_.emplace(t.name, plan_ && !t.is_input
                                 ? DeviceBuffer::view(arena_.ptr() + plan_->offset.at(t.name), bytes(t))
                                 : DeviceBuffer(bytes(t)));
  build_launches();
  launches_stale_ = false;
}

void CudaLayer::plan_caller_memory() {
  CallerMemoryLayout l = caller_memory_layout(layer_.program, shapes_, keep_across_, RoutingPlan::table_bytes);
  step_plan_ = std::make_unique<StepMemoryPlan>(std::move(l.plan));
  saved_at_part_ = std::move(l.saved_at);
  table_offset_ = std::move(l.table_offset);
  saved_bytes_ = std::move(l.memory.saved);
}

CudaLayer::StepMemory CudaLayer::step_memory(int64_t tokens) const {
  user_check(memory_ == LayerMemory::caller) << "step_memory(): this layer holds memory of its own "
                                             << "(LayerMemory::owned); make it with LayerMemory::caller";
  return caller_memory_layout(layer_.program, ProgramShapes(layer_.program, tokens), keep_across_,
                              RoutingPlan::table_bytes)
      .memory;
}

std::optional<std::vector<SizeTerms>> CudaLayer::saved_terms() const {
  user_check(memory_ == LayerMemory::caller) << "saved_terms(): this layer holds memory of its own "
                                             << "(LayerMemory::owned); make it with LayerMemory::caller";
  return caller_saved_terms(layer_.program, shapes_, keep_across_, RoutingPlan::table_terms);
}

void CudaLayer::place(const SavedParts &saved, CUdeviceptr workspace) {
  user_check(memory_ == LayerMemory::caller) << "place(): this layer holds memory of its own (LayerMemory::owned)";
  check_saved_parts("place()", saved, saved_bytes_, kRegionAlignment);
  user_check(workspace % kRegionAlignment == 0)
      << "place(): the workspace must start at a 256-byte aligned address (got 0x" << std::hex << workspace << std::dec
      << ")";
  if (placed_ && saved == saved_at_ && workspace == workspace_at_)
    return;
  for (const auto &[name, at] : saved_at_part_)
    tensors_.at(name) = DeviceBuffer::view(saved[at.first] + at.second, tensors_.at(name).bytes());
  for (const auto &[name, at] : step_plan_->workspace.offset)
    tensors_.at(name) = DeviceBuffer::view(workspace ? workspace + at : 0, tensors_.at(name).bytes());
  for (const auto &[name, where] : step_plan_->in_output)
    tensors_.at(name) = DeviceBuffer::view(in_output_address(where), tensors_.at(name).bytes());
  for (auto &[r, plan] : plans_) {
    plan->place(saved.back() + table_offset_.at(r));
    padded_rows_[r] = plan->offsets.ptr() + sizeof(int32_t) * plan->shape.experts;
  }
  saved_at_ = saved;
  workspace_at_ = workspace;
  placed_ = true;
  ++bind_epoch_;
  if (!launches_stale_)
    refresh_addresses();
}

CUdeviceptr CudaLayer::in_output_address(const InOutput &where) const {
  const CUdeviceptr output = tensors_.at(where.output).ptr();
  return output ? output + where.offset : 0; // an output not bound yet: none until bind()
}

void CudaLayer::refresh_addresses() {
  for (TmaArg &a : tma_args_) {
    const DeviceBuffer &b = tensors_.at(a.tensor);
    *a.map = encode_bf16_tiles(b.ptr(), b.bytes(), a.rows, a.cols, a.tensor, a.matrix_stride);
  }
  for (Launch &l : launches_)
    if (!l.gen->zero_first.empty())
      l.zero = tensors_.at(l.gen->zero_first).ptr();
}

void CudaLayer::prepare(size_t begin, size_t end, const std::string &call) {
  internal_check(begin <= end && end <= layer_.program.steps.size()) << "step range out of bounds";
  check_uploaded(layer_.program, begin, end, uploaded_, call);
  if (memory_ == LayerMemory::owned)
    return;
  user_check(placed_) << call << ": this layer runs on caller memory: give it its memory with place(saved, "
                      << "workspace) first (again after set_tokens)";
  const auto &outs = layer_.program.outputs;
  for (size_t i = begin; i < end; ++i) {
    const std::vector<std::string> reads = step_reads(layer_.program.steps[i]),
                                   writes = step_outputs(layer_.program.steps[i]);
    for (const std::string &w : writes)
      user_check(std::find(outs.begin(), outs.end(), w) == outs.end() || tensors_.at(w).ptr() != 0)
          << call << ": output '" << w << "' has no memory: a layer on caller memory writes its outputs where "
          << "bind() points them; bind it first (again after set_tokens changed its size)";
    // An intermediate living in an output's memory needs that output bound
    // even where these steps do not write it (scratch before its first write).
    for (const std::vector<std::string> *names : {&reads, &writes})
      for (const std::string &t : *names)
        if (auto it = step_plan_->in_output.find(t); it != step_plan_->in_output.end()) {
          user_check(tensors_.at(it->second.output).ptr() != 0)
              << call << ": '" << t << "' lives in the memory of output '" << it->second.output
              << "' until that is written, and '" << it->second.output << "' has no memory: bind it first";
        }
  }
  const bool before = begin<keep_across_, after = end> keep_across_;
  const size_t need = std::max(before ? step_plan_->workspace_before : 0, after ? step_plan_->workspace_after : 0);
  user_check(need == 0 || workspace_at_ != 0)
      << call << ": these steps need " << need << " bytes of workspace and place() gave none";
  if (launches_stale_) {
    build_launches();
    launches_stale_ = false;
  }
}

void CudaLayer::build_launches() {
  launches_.clear();
  launch_of_.clear();
  tensor_maps_.clear();
  tma_args_.clear();
  size_t next_counter = 0;
  // Kernels are generated in step order, one per non-routing step.
  int next = 0;
  for (const Step &s : layer_.program.steps)
    launch_of_.push_back(std::holds_alternative<RoutingStep>(s) ? -1 : next++);
  for (size_t k = 0; k < layer_.source.kernels.size(); ++k) {
    const GeneratedKernel &g = layer_.source.kernels[k];
    // Every generated kernel starts with its wait (emit_common.h's kEntry).
    Launch l{modules_.at(layer_.unit_of.at(k)).kernel(g.name).launch_early(), &g, {}, {}, {}, 0, 0};
    for (const KernelArg &a : g.args) {
      switch (a.kind) {
      case KernelArg::Kind::tensor:
        l.args.push_back(tensors_.at(a.name).arg());
        break;
      case KernelArg::Kind::tma: {
        const DeviceBuffer &b = tensors_.at(a.name);
        // rows 0: one matrix of every row the buffer holds.
        const long long rows = a.rows ? a.rows : static_cast<long long>(b.bytes() / 2 / a.cols);
        tensor_maps_.push_back(encode_bf16_tiles(b.ptr(), b.bytes(), rows, a.cols, a.name, a.matrix_stride));
        tma_args_.push_back({a.name, rows, a.cols, a.matrix_stride, &tensor_maps_.back()});
        l.args.push_back(&tensor_maps_.back());
        break;
      }
      case KernelArg::Kind::extent:
        l.args.push_back(shapes_.dynamic_extent(a.name));
        break;
      case KernelArg::Kind::counter: // zero when made; each launch leaves it zero for the next
        if (next_counter == counters_.size()) {
          counters_.emplace_back(2 * sizeof(int32_t));
          counters_.back().fill32(0);
        }
        l.args.push_back(counters_[next_counter++].arg());
        break;
      case KernelArg::Kind::route: {
        RoutingPlan &plan = *plans_.at(a.route);
        if (a.array == RoutingArray::window) { // room for every tile the layer's capacity can have
          TileWindows &w = windows_[a.route];
          w.stride = static_cast<size_t>(plan.shape.max_tiles()) + 1;
          w.tiles.clear(); // windows listed for another token count are stale
          if (w.active.bytes() < sizeof(int32_t) * w.stride) {
            w.active = DeviceBuffer(sizeof(int32_t) * w.stride);
            w.active.fill32(0); // no tiles until a window is chosen
          }
          l.args.push_back(w.active.arg());
          break;
        }
        if (a.array == RoutingArray::padded_rows) {
          l.args.push_back(&padded_rows_.at(a.route));
          break;
        }
        DeviceBuffer *b = a.array == RoutingArray::num_tiles ? &plan.num_tiles : routing_array(plan, a.array);
        internal_check(b != nullptr) << "routing array '" << a.name << "' has no device table";
        l.args.push_back(b->arg());
        break;
      }
      }
    }
    l.block = Dim3{static_cast<unsigned>(g.threads), 1, 1};
    l.grid = launch_grid(g.grid, g.threads, grid_inputs(), g.name);
    if (!g.zero_first.empty()) {
      const DeviceBuffer &out = tensors_.at(g.zero_first);
      l.zero = out.ptr();
      l.zero_words = out.bytes() / 4;
    }
    if (g.shared_bytes > 48 * 1024)
      l.kernel.set_max_dynamic_shared_memory(g.shared_bytes);
    launches_.push_back(std::move(l));
  }
}

void CudaLayer::set_tokens(int64_t tokens) {
  if (memory_ == LayerMemory::caller) {
    user_check(tokens >= 1) << "set_tokens(" << tokens << "): a step runs at least one token (one of none has "
                            << "nothing to compute: skip it)";
    if (tokens == tokens_)
      return;
    tokens_ = capacity_tokens_ = tokens;
    shapes_ = ProgramShapes(layer_.program, tokens);
    for (auto &[r, plan] : plans_)
      plan->resize(shapes_.routing(r));
    plan_caller_memory();
    // Every intermediate waits for place(); an Input or output whose size
    // changed waits for its bind().
    const std::set<std::string> planned = [&] {
      std::set<std::string> names;
      for (const MemoryPlan *p : {&step_plan_->saved, &step_plan_->workspace})
        for (const auto &[name, at] : p->offset)
          names.insert(name);
      return names;
    }();
    for (const TensorDecl &t : layer_.program.tensors) {
      const size_t bytes = static_cast<size_t>(shapes_.elements(t)) * dtype_bytes(t.dtype);
      DeviceBuffer &b = tensors_.at(t.name);
      if (!planned.count(t.name) && b.bytes() == bytes)
        continue;
      b = DeviceBuffer::view(0, bytes);
      uploaded_.erase(t.name);
    }
    placed_ = false;
    launches_stale_ = true;
    ++bind_epoch_;
    return;
  }
  user_check(tokens >= 1 && tokens <= capacity_tokens_) << "set_tokens(" << tokens << "): the layer was made for 1 to "
                                                        << capacity_tokens_ << " tokens; make a layer for more";
  user_check(bind_epoch_ == 0) << "set_tokens: bind() moved a tensor to memory sized for " << tokens_
                               << " tokens; set the token count before binding";
  if (tokens == tokens_)
    return;
  tokens_ = tokens;
  shapes_ = ProgramShapes(layer_.program, tokens);
  for (auto &[r, plan] : plans_)
    plan->reshape(shapes_.routing(r));
  for (const TensorDecl &t : layer_.program.tensors) {
    if (!storage_.count(t.name))
      storage_.emplace(t.name, std::move(tensors_.at(t.name)));
    const size_t bytes = static_cast<size_t>(shapes_.elements(t)) * dtype_bytes(t.dtype);
    tensors_.at(t.name) = DeviceBuffer::view(storage_.at(t.name).ptr(), bytes);
  }
  // Grids, extents and TMA descriptors follow the count.
  build_launches();
}

CUdeviceptr CudaLayer::address(const std::string &name) {
  const TensorDecl *t = layer_.program.find(name);
  user_check(t != nullptr) << "'" << name << "' is not a tensor of the layer";
  if (t->is_input)
    uploaded_.insert(name);
  return tensors_.at(name).ptr();
}

const RoutingPlan &CudaLayer::routing_plan(const std::string &route) const { return *plans_.at(route_named(route)); }

void CudaLayer::upload(const TensorMap &inputs) {
  for (const TensorDecl &t : layer_.program.tensors)
    if (t.is_input) {
      check_writable_input(t.name, "upload");
      tensors_.at(t.name).upload(shapes_.encode_input(t, inputs));
      uploaded_.insert(t.name);
    }
}

void CudaLayer::upload(const std::string &name, const HostTensor &value) {
  const TensorDecl *t = layer_.program.find(name);
  user_check(t && t->is_input) << "'" << name << "' is not an Input or Param of the layer";
  check_writable_input(name, "upload");
  tensors_.at(name).upload(shapes_.encode_input(*t, TensorMap{{name, value}}));
  uploaded_.insert(name);
}

void CudaLayer::upload_bytes(const std::string &name, const std::vector<uint8_t> &bytes) {
  const TensorDecl *t = layer_.program.find(name);
  user_check(t && t->is_input) << "'" << name << "' is not an Input or Param of the layer";
  const TensorInfo i = info(name);
  user_check(i.contiguous && bytes.size() == i.bytes)
      << "upload_bytes of '" << name << "': " << bytes.size() << " bytes given, the layer holds " << i.bytes << " ("
      << dtype_name(i.dtype) << " values of its shape)";
  check_writable_input(name, "upload_bytes");
  tensors_.at(name).upload(bytes);
  uploaded_.insert(name);
}

void CudaLayer::upload_repeated(const std::string &name, const HostTensor &pattern) {
  const TensorDecl *found = layer_.program.find(name);
  user_check(found && found->is_input) << "'" << name << "' is not an Input or Param";
  const TensorDecl &t = *found;
  check_writable_input(name, "upload_repeated");
  uploaded_.insert(name);
  DeviceBuffer &b = tensors_.at(name);
  std::vector<uint8_t> bytes = encode_values(pattern.data, t.dtype);
  user_check(!bytes.empty() && bytes.size() <= b.bytes()) << "pattern for '" << name << "' is empty or too large";
  DeviceBuffer first(bytes.size());
  first.upload(bytes);
  // Device-to-device copies of the pattern fill the rest.
  for (size_t at = 0; at < b.bytes();) {
    size_t n = std::min(bytes.size(), b.bytes() - at);
    MOEFORGE_CU(cuMemcpyDtoD, b.ptr() + at, first.ptr(), n);
    at += n;
  }
  MOEFORGE_CU(cuCtxSynchronize);
}

void CudaLayer::poison() {
  // With caller memory, what has memory now: the placed regions and the
  // bound outputs.
  for (const TensorDecl &t : layer_.program.tensors) {
    if (t.is_input || tensors_.at(t.name).ptr() == 0)
      continue;
    if (t.outer_stride > 0) { // its rows only: what lies between them is another tensor's
      const size_t size = dtype_bytes(t.dtype);
      tensors_.at(t.name).fill32_rows(kPoisonNaN, t.outer_stride * size, elements_past_first(t) * size,
                                      t.dims[0].extent());
    } else {
      tensors_.at(t.name).fill32(kPoisonNaN);
    }
  }
  if (memory_ == LayerMemory::owned || placed_)
    for (auto &[r, plan] : plans_)
      plan->poison(kPoisonOnes);
}

void CudaLayer::check_writable_input(const std::string &name, const char *what) const {
  user_check(memory_ == LayerMemory::owned || tensors_.at(name).ptr() != 0)
      << what << " of '" << name << "': a layer on caller memory holds no memory of its own; bind() '" << name
      << "' to memory of yours first (again after set_tokens changed its size)";
}

void CudaLayer::check_readable(const std::string &name, const char *what) const {
  user_check(!plan_ || plan_->outlives_run(name))
      << "'" << name << "' shares its memory with other tensors under reuse_memory(true): its value is gone once "
      << "the steps that read it have run; " << what << " it from a layer compiled without reuse_memory";
  if (memory_ == LayerMemory::owned)
    return;
  user_check(!step_plan_->workspace.offset.count(name) && !step_plan_->in_output.count(name))
      << "'" << name << "' lives in the workspace the caller gives each step"
      << (step_plan_->in_output.count(name)
              ? " (in the memory of output '" + step_plan_->in_output.at(name).output + "')"
              : std::string())
      << ": its value is gone once the steps that read it have run; " << what
      << " outputs, gradients and what a forward saves";
  user_check(tensors_.at(name).ptr() != 0) << "'" << name << "' has no memory yet: bind() it (an output) or "
                                           << "place() the layer's memory (what a forward saves) first";
}

const RoutingNode *CudaLayer::route_named(const std::string &route) const {
  for (const auto &[node, plan] : plans_)
    if (node->name == route)
      return node;
  user_error << "no route named '" << route << "' in this layer";
}

void CudaLayer::set_tile_windows(const std::string &route, const std::vector<std::vector<int32_t>> &windows) {
  const RoutingNode *r = route_named(route);
  auto it = windows_.find(r);
  user_check(it != windows_.end()) << "set_tile_windows: no GEMM of route '" << route
                                   << "' runs over a window (GemmStep::windowed)";
  TileWindows &w = it->second;
  const int64_t max_tiles = plans_.at(r)->shape.max_tiles();
  std::vector<int32_t> all(w.stride * windows.size(), 0);
  w.tiles.clear();
  for (size_t i = 0; i < windows.size(); ++i) {
    internal_check(static_cast<int64_t>(windows[i].size()) <= max_tiles)
        << "tile window " << i << " lists " << windows[i].size() << " tiles; route '" << route << "' has at most "
        << max_tiles;
    all[i * w.stride] = static_cast<int32_t>(windows[i].size());
    std::copy(windows[i].begin(), windows[i].end(), all.begin() + i * w.stride + 1);
    w.tiles.push_back(static_cast<int64_t>(windows[i].size()));
  }
  if (w.all.bytes() < sizeof(int32_t) * all.size())
    w.all = DeviceBuffer(sizeof(int32_t) * all.size());
  if (!all.empty())
    w.all.upload(all);
}

void CudaLayer::enqueue_window(const Stream &stream, size_t begin, size_t end, size_t window) {
  for (const auto &[r, w] : windows_)
    user_check(window < w.tiles.size()) << "enqueue_window(" << window << "): route '" << r->name << "' has "
                                        << w.tiles.size() << " tile windows at " << tokens_
                                        << " tokens; list them with set_tile_windows() after set_tokens()";
  user_check(memory_ == LayerMemory::owned) << "enqueue_window(): tile windows run on a layer's own memory";
  check_routing_scores(stream, "enqueue_window()");
  prepare(begin, end, "enqueue_window()");
  for (auto &[r, w] : windows_)
    MOEFORGE_CU(cuMemcpyDtoDAsync, w.active.ptr(), w.all.ptr() + sizeof(int32_t) * w.stride * window,
                sizeof(int32_t) * (1 + w.tiles[window]), stream.handle());
  for (size_t i = begin; i < end; ++i)
    run_step(i, stream, static_cast<int64_t>(window));
}

GridInputs CudaLayer::grid_inputs() const {
  GridInputs in;
  in.extent = [this](const Dim &d) { return shapes_.extent(d); };
  in.routing = [this](const RoutingNode *r) -> const RoutingShape & { return plans_.at(r)->shape; };
  in.sm_count = sm_count_;
  return in;
}

void CudaLayer::run_step(size_t step, const Stream &stream, int64_t window) {
  if (auto *rs = std::get_if<RoutingStep>(&layer_.program.steps[step])) {
    // No generated kernel. Lowering may have given the routing the router's
    // softmax and the gate tensor to write (lower.h, softmax_into_routing and
    // gate_from_routing); otherwise the gates stay in the plan.
    CUdeviceptr gate = rs->gate_output.empty() ? 0 : tensors_.at(rs->gate_output).ptr();
    const auto index = std::distance(plans_.begin(), plans_.find(rs->route));
    NonFiniteSink sink{score_check_->first_bad(), score_check_->seen(), routing_route_tag(static_cast<int>(index))};
    routing_.run(tensors_.at(rs->probs).ptr(), *plans_.at(rs->route), stream, rs->softmax, gate, rs->renormalize, sink);
    return;
  }
  Launch &l = launches_.at(launch_of_.at(step));
  if (l.zero_words)
    MOEFORGE_CU(cuMemsetD32Async, l.zero, 0u, l.zero_words, stream.handle());
  Dim3 grid = l.grid;
  if (const GridShape &gs = l.gen->grid; gs.windowed) {
    internal_check(window >= 0) << "step '" << l.gen->step << "' runs over a tile window: enqueue it with "
                                << "enqueue_window()";
    GridInputs in = grid_inputs();
    in.window_tiles = windows_.at(gs.route).tiles.at(static_cast<size_t>(window));
    grid = launch_grid(gs, l.gen->threads, in, l.gen->name);
    if (grid.x == 0)
      return; // no tile of the route in this window
  }
  l.kernel.launch(grid, l.block, static_cast<unsigned>(l.gen->shared_bytes), stream, l.args.data());
}

void CudaLayer::enqueue(const Stream &stream) { enqueue(stream, 0, layer_.program.steps.size()); }

void CudaLayer::check_routing_scores(const Stream &stream, const std::string &call) {
  // A stream being captured cannot be waited for; the next call reports it.
  if (score_check_->raised() && !is_capturing(stream))
    score_check_->throw_if_raised(stream, route_names_, call);
}

void CudaLayer::enqueue(const Stream &stream, size_t begin, size_t end, const char *entry) {
  check_routing_scores(stream, entry);
  prepare(begin, end, entry);
  for (size_t i = begin; i < end; ++i)
    run_step(i, stream);
}

std::vector<std::pair<std::string, double>> CudaLayer::profile(const Stream &stream) {
  return profile(stream, 0, layer_.program.steps.size());
}

std::vector<std::pair<std::string, double>> CudaLayer::profile(const Stream &stream, size_t begin, size_t end) {
  const auto &steps = layer_.program.steps;
  check_routing_scores(stream, "profile()");
  prepare(begin, end, "profile()");
  std::vector<Event> marks(end - begin + 1);
  marks[0].record(stream);
  for (size_t i = begin; i < end; ++i) {
    run_step(i, stream);
    marks[i - begin + 1].record(stream);
  }
  marks.back().synchronize();
  check_routing_scores(stream, "profile()");
  std::vector<std::pair<std::string, double>> out;
  for (size_t i = begin; i < end; ++i)
    out.emplace_back(step_name(steps[i]), elapsed_ms(marks[i - begin], marks[i - begin + 1]));
  return out;
}

std::vector<std::string> CudaLayer::timeline(const Stream &stream) {
  std::vector<std::string> lines;
  if (!layer_.source.timeline)
    return lines;
  auto [stamps, bytes] = modules_.front().global("mf_timeline"); // one unit: the whole module
  const auto &steps = layer_.program.steps;
  prepare(0, steps.size(), "timeline()");
  for (size_t i = 0; i < steps.size(); ++i) {
    const bool gemm = std::holds_alternative<GemmStep>(steps[i]);
    if (gemm)
      MOEFORGE_CU(cuMemsetD8, stamps, 0, bytes);
    run_step(i, stream);
    if (!gemm)
      continue;
    stream.synchronize();
    std::vector<uint64_t> raw(bytes / sizeof(uint64_t));
    MOEFORGE_CU(cuMemcpyDtoH, raw.data(), stamps, bytes);
    const Launch &l = launches_.at(launch_of_.at(i));
    // Persistent blocks stamp per tile, beyond the grid's size.
    const int64_t slots = l.gen->grid.persistent ? kTimelineBlocks : l.grid.x;
    lines.push_back(format_timeline(l.gen->name, summarize_timeline(raw, slots)));
  }
  stream.synchronize();
  return lines;
}

HostTensor CudaLayer::download(const std::string &func) const {
  const TensorDecl &t = downloadable(layer_.program, func);
  check_readable(func, "download");
  std::vector<uint8_t> bytes = shapes_.drop_row_padding(t, tensors_.at(func).download<uint8_t>());
  if (t.layout != RowLayout::padded && t.layout != RowLayout::sorted)
    return shapes_.decode(t, bytes);
  const RoutingPlan &plan = *plans_.at(t.route);
  std::vector<int32_t> pos = plan.pair_pos.download<int32_t>();
  if (t.layout == RowLayout::sorted)
    pos = sorted_rows(plan.expert.download<int32_t>(pos.size()), pos,
                      plan.offsets.download<int32_t>(plan.shape.experts + 1),
                      plan.offsets_unpadded.download<int32_t>(plan.shape.experts + 1));
  return shapes_.decode(t, bytes, &pos);
}

CudaLayer::TensorInfo CudaLayer::info(const std::string &name) const {
  TensorInfo i = tensor_info(layer_.program, shapes_, name);
  // What copies move is the buffer, which owned memory keeps at the count
  // the layer was made for (set_tokens may run fewer).
  i.bytes = tensors_.at(name).bytes();
  return i;
}

namespace {
// A copy moves the tensor's own elements as one row-major block. bind
// (`span`) points the layer at memory laid out as it stores the tensor,
// which for a Param inside a larger tensor (outer_stride: transformers'
// gate_up_proj halves) is the span from its first element to its last, the
// other tensor's elements between; routed rows stored padded fit neither.
void check_copy(const CudaLayer::TensorInfo &info, const TensorDecl &t, size_t bytes, const char *what,
                bool span = false) {
  const std::string &name = t.name;
  user_check(info.contiguous || (span && t.outer_stride > 0))
      << "'" << name << "' is "
      << (t.outer_stride > 0 ? "stored inside a larger tensor (its first index " + std::to_string(t.outer_stride) +
                                   " elements apart), not as a row-major tensor: "
                             : "stored padded (routed rows grouped by expert) on the device, not as a row-major "
                               "tensor: ")
      << what << " needs a contiguous tensor; "
      << (t.outer_stride > 0 ? "bind() it inside the larger tensor instead" : "use download() for it");
  user_check(bytes == info.bytes) << what << " of '" << name << "': " << bytes << " bytes given, the layer holds "
                                  << info.bytes << " (" << dtype_name(info.dtype)
                                  << " values of its shape): convert the tensor to " << dtype_name(info.dtype)
                                  << " and that shape";
}
} // namespace

void CudaLayer::copy_in(const std::string &name, CUdeviceptr src, size_t bytes, const Stream &stream) {
  const TensorDecl *t = layer_.program.find(name);
  user_check(t && t->is_input) << "copy_in: '" << name << "' is not an Input or Param of the layer";
  check_copy(info(name), *t, bytes, "copy_in");
  check_writable_input(name, "copy_in");
  MOEFORGE_CU(cuMemcpyDtoDAsync, tensors_.at(name).ptr(), src, bytes, stream.handle());
  uploaded_.insert(name);
}

void CudaLayer::copy_out(const std::string &name, CUdeviceptr dst, size_t bytes, const Stream &stream) const {
  check_readable(name, "copy_out");
  check_copy(info(name), *layer_.program.find(name), bytes, "copy_out");
  MOEFORGE_CU(cuMemcpyDtoDAsync, dst, tensors_.at(name).ptr(), bytes, stream.handle());
}

void CudaLayer::bind(const std::string &name, CUdeviceptr ptr, size_t bytes) {
  const TensorDecl *t = layer_.program.find(name);
  const auto &outs = layer_.program.outputs;
  const bool output = std::find(outs.begin(), outs.end(), name) != outs.end();
  user_check(t && (t->is_input || output || (memory_ == LayerMemory::owned && (!plan_ || plan_->outlives_run(name)))))
      << "bind: '" << name << "' "
      << (!t                               ? "is not a tensor of the layer"
          : memory_ == LayerMemory::caller ? "is an intermediate, which place() gives memory"
                                           : "shares its memory with other tensors under reuse_memory(true)")
      << "; bind Inputs, Params, outputs and gradients";
  check_copy(info(name), *t, bytes, "bind", /*span=*/true);
  user_check(ptr % 16 == 0) << "bind: the memory for '" << name << "' is not 16-byte aligned (the kernels load 16 "
                            << "bytes at a time): give a tensor that starts at an aligned address";
  if (t->is_input)
    uploaded_.insert(name);
  if (tensors_.at(name).ptr() == ptr && tensors_.at(name).bytes() == bytes)
    return; // already there (a framework's allocator often hands back the same block)
  ++bind_epoch_;
  // Kernel arguments point at the DeviceBuffer's address field, which stays
  // where it is; what holds the address by value is refreshed.
  std::vector<std::string> moved{name};
  tensors_.at(name) = DeviceBuffer::view(ptr, bytes);
  if (step_plan_) // intermediates that live in this output's memory follow it
    for (const auto &[in, where] : step_plan_->in_output)
      if (where.output == name) {
        tensors_.at(in) = DeviceBuffer::view(in_output_address(where), tensors_.at(in).bytes());
        moved.push_back(in);
      }
  if (launches_stale_)
    return; // encoded when they are built
  for (const std::string &m : moved) {
    const DeviceBuffer &b = tensors_.at(m);
    for (TmaArg &a : tma_args_)
      if (a.tensor == m)
        *a.map = encode_bf16_tiles(b.ptr(), b.bytes(), a.rows, a.cols, m, a.matrix_stride);
    for (Launch &l : launches_)
      if (l.gen->zero_first == m)
        l.zero = b.ptr();
  }
}

uint64_t CudaLayer::signature(size_t begin, size_t end) const {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i, v >>= 8) {
      h ^= v & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<uint64_t>(tokens_));
  for (size_t i = begin; i < end; ++i) {
    const Step &s = layer_.program.steps[i];
    for (const std::vector<std::string> &names : {step_reads(s), step_outputs(s)})
      for (const std::string &n : names)
        if (auto t = tensors_.find(n); t != tensors_.end()) // not the names of registers or routing arrays
          mix(t->second.ptr());
  }
  for (const auto &[r, plan] : plans_)
    mix(plan->expert.ptr());
  return h;
}

std::vector<int32_t> CudaLayer::routed_experts(const std::string &route) const {
  const RoutingPlan &plan = *plans_.at(route_named(route));
  user_check(memory_ == LayerMemory::owned || placed_) << "routed_experts: the routing tables live in the saved "
                                                       << "memory place() gives, and none is placed";
  return plan.expert.download<int32_t>(plan.shape.pairs());
}

void CudaLayer::copy_routed_experts(const std::string &route, CUdeviceptr dst, size_t bytes,
                                    const Stream &stream) const {
  const RoutingPlan &plan = *plans_.at(route_named(route));
  user_check(memory_ == LayerMemory::owned || placed_) << "copy_routed_experts: the routing tables live in the "
                                                       << "saved memory place() gives, and none is placed";
  const size_t want = sizeof(int32_t) * static_cast<size_t>(plan.shape.pairs());
  user_check(bytes == want) << "copy_routed_experts of route '" << route << "': " << bytes << " bytes given; its "
                            << plan.shape.pairs() << " pairs take " << want << " (int32 each)";
  MOEFORGE_CU(cuMemcpyDtoDAsync, dst, plan.expert.ptr(), bytes, stream.handle());
}

std::vector<uint8_t> CudaLayer::kept_pairs(const std::string &route) const {
  for (const auto &[r, plan] : plans_)
    if (r->name == route) {
      std::vector<uint8_t> kept(static_cast<size_t>(plan->shape.pairs()), 1);
      if (plan->shape.drops()) {
        const std::vector<int32_t> pos = plan->pair_pos.download<int32_t>(kept.size());
        for (size_t p = 0; p < kept.size(); ++p)
          kept[p] = pos[p] != plan->shape.drop_row();
      }
      return kept;
    }
  user_error << "no route named '" << route << "' in this layer";
}

int64_t CudaLayer::dropped_pairs(const std::string &route) const {
  for (const auto &[r, plan] : plans_)
    if (r->name == route) {
      if (!plan->shape.drops())
        return 0;
      int64_t kept = 0;
      for (int32_t c : plan->counts.download<int32_t>(plan->shape.experts))
        kept += c;
      return plan->shape.pairs() - kept;
    }
  user_error << "no route named '" << route << "' in this layer";
}

size_t CudaLayer::activation_bytes() const {
  if (plan_)
    return plan_->arena_bytes;
  if (memory_ == LayerMemory::caller) {
    const StepMemory m = step_memory(tokens_);
    return m.saved_bytes() + std::max(m.workspace_before, m.workspace_after);
  }
  size_t n = 0;
  for (const TensorDecl &t : layer_.program.tensors)
    if (!t.is_input)
      n += tensors_.at(t.name).bytes();
  return n;
}

} // namespace moeforge::cuda
