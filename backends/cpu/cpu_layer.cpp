#include "backends/cpu/cpu_layer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <thread>

#include "backends/cpu/cpu_attention.h"
#include "backends/cpu/fp8_operands.h"
#include "dsl/error.h"
#include "lowering/lower.h"
#include "runtime/host_memory.h"
#include "runtime/layer_checks.h"

namespace moeforge::cpu {

CompiledCpuLayer compile_cpu_program(KernelProgram program, const std::string &what) {
  check_fp8_gemms(program);
  CompiledCpuLayer c;
  c.program = std::move(program);
  LlvmModule module = generate_llvm(c.program);
  c.kernels = module.kernels;
  c.jit = jit_compile(std::move(module), what);
  return c;
}

CompiledCpuLayer compile_cpu_layer(const Pipeline &pipeline, const Schedule &schedule) {
  return compile_cpu_program(lower(pipeline, schedule), "schedule '" + schedule.name() + "'");
}

std::string cpu_llvm_ir(const Pipeline &pipeline, const Schedule &schedule, bool optimised) {
  KernelProgram p = lower(pipeline, schedule);
  LlvmModule m = generate_llvm(p);
  if (optimised)
    optimise_module(m, "schedule '" + schedule.name() + "'");
  return m.ir_text();
}

int64_t cpu_threads() {
  if (const char *v = std::getenv("MOEFORGE_CPU_THREADS"); v && *v) {
    char *end = nullptr;
    long n = std::strtol(v, &end, 10);
    user_check(*end == '\0' && n >= 1 && n <= 1024)
        << "MOEFORGE_CPU_THREADS must be a whole number from 1 to 1024, got '" << v << "'";
    return n;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

namespace {
// Offsets into the caller's regions are multiples of kRegionAlignment (as
// on the GPU); the regions' own starts need 64 bytes, what host allocators
// give.
constexpr uintptr_t kBaseAlignment = 64;
} // namespace

CpuLayer::CpuLayer(const CompiledCpuLayer &layer, int64_t tokens, size_t keep_across, LayerMemory memory)
    : layer_(layer), tokens_(tokens), shapes_(layer.program, tokens), threads_(cpu_threads()),
      keep_across_(keep_across), memory_(memory) {
  size_t next = 0;
  for (const Step &s : layer_.program.steps)
    kernel_of_step_.push_back(std::holds_alternative<RoutingStep>(s) || std::holds_alternative<AttentionStep>(s)
                                  ? layer_.kernels.size()
                                  : next++);
  if (memory_ == LayerMemory::caller) {
    user_check(tokens >= 1) << "a layer on caller memory runs at least one token (a step of none has nothing to "
                            << "compute: skip it), got " << tokens;
    plan_caller_memory();
  }
  // What the layer holds itself: every tensor on owned memory; on caller
  // memory the Inputs, outputs and gradients until bound.
  auto owned = [&](const TensorDecl &t) { return memory_ == LayerMemory::owned || !step_plan_->places(t.name); };
  size_t bytes = 0;
  for (const TensorDecl &t : layer_.program.tensors)
    if (owned(t))
      bytes += static_cast<size_t>(shapes_.elements(t)) * dtype_bytes(t.dtype);
  for (const auto &[r, shape] : shapes_.routings())
    if (memory_ == LayerMemory::owned)
      bytes += routing_table_bytes(shape);
  check_host_allocation(bytes, "the CPU backend's tensors of this layer at " + std::to_string(tokens) + " tokens");
  for (const TensorDecl &t : layer_.program.tensors) {
    Buffer &b = tensors_[t.name];
    const size_t n = static_cast<size_t>(shapes_.elements(t)) * dtype_bytes(t.dtype);
    if (owned(t))
      b.hold(n);
    else
      b.bytes = n;
  }
  for (const auto &[r, shape] : shapes_.routings()) {
    RouteState &st = routes_[r];
    st.shape = shape;
    if (memory_ == LayerMemory::owned) {
      st.own.assign(routing_table_bytes(shape), 0);
      st.block = st.own.data();
    }
  }
}

void CpuLayer::plan_caller_memory() {
  CallerMemoryLayout l = caller_memory_layout(layer_.program, shapes_, keep_across_, routing_table_bytes);
  step_plan_ = std::make_unique<StepMemoryPlan>(std::move(l.plan));
  saved_at_part_ = std::move(l.saved_at);
  table_offset_ = std::move(l.table_offset);
  saved_bytes_ = std::move(l.memory.saved);
}

std::optional<std::vector<SizeTerms>> CpuLayer::saved_terms() const {
  user_check(memory_ == LayerMemory::caller) << "saved_terms(): this layer holds memory of its own "
                                             << "(LayerMemory::owned); make it with LayerMemory::caller";
  return caller_saved_terms(layer_.program, shapes_, keep_across_, [](const RoutingShape &s) {
    return routing_table_terms(s, static_cast<int64_t>(kRegionAlignment));
  });
}

StepMemory CpuLayer::step_memory(int64_t tokens) const {
  user_check(memory_ == LayerMemory::caller) << "step_memory(): this layer holds memory of its own "
                                             << "(LayerMemory::owned); make it with LayerMemory::caller";
  user_check(tokens >= 1) << "step_memory(" << tokens << "): a step runs at least one token";
  return caller_memory_layout(layer_.program, ProgramShapes(layer_.program, tokens), keep_across_, routing_table_bytes)
      .memory;
}

void CpuLayer::place(const SavedParts &saved, uint8_t *workspace) {
  user_check(memory_ == LayerMemory::caller) << "place(): this layer holds memory of its own (LayerMemory::owned)";
  check_saved_parts("place()", saved, saved_bytes_, kBaseAlignment);
  user_check(reinterpret_cast<uintptr_t>(workspace) % kBaseAlignment == 0)
      << "place(): the workspace must start at a 64-byte aligned address (got " << static_cast<const void *>(workspace)
      << ")";
  auto host = [](uint64_t address) { return reinterpret_cast<uint8_t *>(static_cast<uintptr_t>(address)); };
  for (const auto &[name, at] : saved_at_part_)
    tensors_.at(name).at = host(saved[at.first]) + at.second;
  for (const auto &[name, at] : step_plan_->workspace.offset)
    tensors_.at(name).at = workspace ? workspace + at : nullptr;
  // The tables there are the ones the forward that wrote this memory made:
  // a forward routes before any step reads them, and a training layer runs
  // a backward only on memory a recent forward wrote (forwards_in_flight.h).
  for (auto &[r, st] : routes_) {
    st.block = host(saved.back()) + table_offset_.at(r);
    st.routed = true;
  }
  saved_at_ = saved;
}

void CpuLayer::set_tokens(int64_t tokens) {
  user_check(memory_ == LayerMemory::caller)
      << "set_tokens: this layer holds memory of its own for " << tokens_ << " tokens; make a layer for "
      << "another count (with_tokens), or one on caller memory";
  user_check(tokens >= 1) << "set_tokens(" << tokens << "): a step runs at least one token (one of none has "
                          << "nothing to compute: skip it)";
  if (tokens == tokens_)
    return;
  tokens_ = tokens;
  shapes_ = ProgramShapes(layer_.program, tokens);
  for (auto &[r, st] : routes_) {
    st.shape = shapes_.routing(r);
    st.block = nullptr;
    st.routed = false;
  }
  plan_caller_memory();
  // Every intermediate waits for place(); an Input or output whose size
  // changed is the layer's own again, empty, until uploaded or bound.
  for (const TensorDecl &t : layer_.program.tensors) {
    Buffer &b = tensors_.at(t.name);
    const size_t n = static_cast<size_t>(shapes_.elements(t)) * dtype_bytes(t.dtype);
    if (step_plan_->places(t.name)) {
      b = Buffer{};
      b.bytes = n;
      continue;
    }
    if (b.bytes == n)
      continue;
    b.hold(n);
    uploaded_.erase(t.name);
  }
  computed_.clear();
  saved_at_.clear();
}

void CpuLayer::bind(const std::string &name, void *ptr, size_t bytes) {
  const TensorDecl *t = layer_.program.find(name);
  user_check(t != nullptr) << "bind: this layer holds no tensor '" << name << "'";
  user_check(!step_plan_ || !step_plan_->places(name))
      << "bind: '" << name << "' is an intermediate, placed in the saved memory or the workspace (place()); bind "
      << "an Input, Param, output or gradient";
  Buffer &b = tensors_.at(name);
  user_check(ptr != nullptr && bytes == b.bytes)
      << "bind('" << name << "'): " << bytes << " bytes at " << ptr << " given, the layer reads and writes " << b.bytes
      << " (" << dtype_name(t->dtype) << " values of its shape)";
  user_check(reinterpret_cast<uintptr_t>(ptr) % dtype_bytes(t->dtype) == 0)
      << "bind('" << name << "'): the address " << ptr << " is not aligned to its " << dtype_name(t->dtype)
      << " values";
  if (b.at == ptr)
    return;
  b.own.clear();
  b.own.shrink_to_fit();
  b.at = static_cast<uint8_t *>(ptr);
  if (t->is_input) {
    uploaded_.insert(name);
    forget_results_of(name);
  } else {
    computed_.erase(name);
  }
}

void CpuLayer::store_input(const std::string &name, const std::vector<uint8_t> &bytes) {
  Buffer &b = tensors_.at(name);
  internal_check(bytes.size() == b.bytes && b.at != nullptr)
      << "input '" << name << "': " << bytes.size() << " bytes for " << b.bytes;
  std::memcpy(b.at, bytes.data(), bytes.size());
  uploaded_.insert(name);
  forget_results_of(name);
}

void CpuLayer::upload(const TensorMap &inputs) {
  for (const TensorDecl &t : layer_.program.tensors)
    if (t.is_input)
      store_input(t.name, shapes_.encode_input(t, inputs));
}

void CpuLayer::upload(const std::string &name, const HostTensor &value) {
  const TensorDecl *t = layer_.program.find(name);
  user_check(t != nullptr && t->is_input) << "'" << name << "' is not an Input or Param of this layer";
  store_input(name, shapes_.encode_input(*t, TensorMap{{name, value}}));
}

void CpuLayer::upload_bytes(const std::string &name, const std::vector<uint8_t> &bytes) {
  const TensorDecl *t = layer_.program.find(name);
  user_check(t != nullptr && t->is_input) << "'" << name << "' is not an Input or Param of this layer";
  const size_t stored = tensors_.at(name).bytes;
  user_check(bytes.size() == stored) << "upload_bytes of '" << name << "': " << bytes.size()
                                     << " bytes given, the layer holds " << stored << " (" << dtype_name(t->dtype)
                                     << " values of its shape)";
  store_input(name, bytes);
}

void CpuLayer::forget_results_of(const std::string &input) {
  // The steps are in program order, so one pass finds every step that reads
  // the input or a result made from it. A routing step among them reorders
  // the rows every later step reads: all of those go too.
  std::set<std::string> stale{input};
  bool rerouted = false;
  for (const Step &s : layer_.program.steps) {
    bool reads_stale = rerouted;
    for (const std::string &r : step_reads(s))
      reads_stale = reads_stale || stale.count(r) > 0;
    if (!reads_stale)
      continue;
    rerouted = rerouted || std::holds_alternative<RoutingStep>(s);
    for (const std::string &w : step_outputs(s)) {
      stale.insert(w);
      computed_.erase(w);
    }
  }
}

void CpuLayer::poison() {
  computed_.clear();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const uint16_t nan16 = bf16_bits(nan);
  for (const TensorDecl &t : layer_.program.tensors) {
    Buffer &buf = tensors_.at(t.name);
    if (t.is_input || buf.at == nullptr) // on caller memory: what is placed now
      continue;
    const size_t size = dtype_bytes(t.dtype);
    // A tensor with an outer stride owns its rows only: what lies between
    // them is another tensor's (the other half of transformers' gate_up_proj).
    const size_t row = t.outer_stride > 0 ? elements_past_first(t) * size : buf.bytes;
    const size_t step = t.outer_stride > 0 ? t.outer_stride * size : buf.bytes;
    for (size_t start = 0; start < buf.bytes; start += step)
      for (size_t at = start; at + size <= start + row; at += size)
        t.dtype == DType::f32 ? (void)std::memcpy(buf.at + at, &nan, 4) : (void)std::memcpy(buf.at + at, &nan16, 2);
  }
}

namespace {

// Each row's softmax in place, as the generated pointwise softmax computes it
// (codegen_llvm.cpp, emit_pointwise: maxnum, then the sum of exp(x - max) in
// column order, then exp(x - max) / sum), so a routing that takes the softmax
// itself selects and gates exactly as one that read stored probabilities.
void softmax_rows(std::vector<float> &v, int64_t rows, int64_t cols) {
  for (int64_t t = 0; t < rows; ++t) {
    float *row = &v[static_cast<size_t>(t * cols)];
    float mx = -std::numeric_limits<float>::infinity(), sum = 0.0f;
    for (int64_t e = 0; e < cols; ++e)
      mx = std::fmax(mx, row[e]);
    for (int64_t e = 0; e < cols; ++e)
      sum += std::exp(row[e] - mx);
    for (int64_t e = 0; e < cols; ++e)
      row[e] = std::exp(row[e] - mx) / sum;
  }
}

} // namespace

void CpuLayer::route(const RoutingStep &step) {
  RouteState &st = routes_.at(step.route);
  user_check(st.block != nullptr) << "route '" << step.route->name << "': no saved memory placed for its tables "
                                  << "(place() first)";
  const Buffer &raw = tensors_.at(step.probs);
  user_check(raw.at != nullptr) << "'" << step.probs << "' has no memory: place() the saved memory and workspace first";
  std::vector<float> probs(static_cast<size_t>(st.shape.tokens * st.shape.experts));
  std::memcpy(probs.data(), raw.at, probs.size() * sizeof(float));
  if (step.softmax) // step.probs holds the router's logits (lower.h, softmax_into_routing)
    softmax_rows(probs, st.shape.tokens, st.shape.experts);
  // The reference's rule (largest first, ties to the lower expert), then the
  // blocked format's tables: the same code the GPU routing is checked with.
  HostTopK top = top_k_on_host(st.shape, probs);
  RoutingTables tables = route_on_host(st.shape, top.expert, top.gate);
  for (int a = 0; a < static_cast<int>(RoutingArray::num_tiles); ++a) {
    const std::vector<int32_t> &v = *routing_array(tables, static_cast<RoutingArray>(a));
    internal_check(static_cast<int64_t>(v.size()) == routing_array_elements(static_cast<RoutingArray>(a), st.shape))
        << "routing array '" << routing_array_name(static_cast<RoutingArray>(a)) << "' has " << v.size() << " elements";
    std::memcpy(st.array(static_cast<RoutingArray>(a)), v.data(), v.size() * sizeof(int32_t));
  }
  *st.array(RoutingArray::num_tiles) = tables.num_tiles;
  *st.array(RoutingArray::padded_rows) = tables.offsets.back();
  st.routed = true;
  if (!step.gate_output.empty()) { // the chosen probabilities, pair order (gate_from_routing)
    Buffer &gate = tensors_.at(step.gate_output);
    internal_check(gate.bytes == top.gate.size() * sizeof(float) && gate.at != nullptr)
        << "gate tensor '" << step.gate_output << "' holds " << gate.bytes << " bytes for " << top.gate.size()
        << " pairs";
    if (step.renormalize) // each token's chosen scores over their sum, added in slot order as route_sum adds
      for (int64_t t = 0; t < st.shape.tokens; ++t) {
        float *g = &top.gate[static_cast<size_t>(t * st.shape.k)];
        float total = 0.0f;
        for (int s = 0; s < st.shape.k; ++s)
          total += g[s];
        for (int s = 0; s < st.shape.k; ++s)
          g[s] /= total;
      }
    std::memcpy(gate.at, top.gate.data(), gate.bytes);
  }
}

void CpuLayer::attend(const AttentionStep &step) {
  AttentionMemory memory;
  memory.tensor = [&](const std::string &name) { return placed(name); };
  memory.elements = [&](const TensorDecl &t) { return shapes_.elements(t); };
  if (step.route) {
    const RouteState &st = routes_.at(step.route);
    internal_check(st.routed && st.block != nullptr) << step.name << ": its route has not run";
    memory.sorted_pair = st.array(RoutingArray::sorted_pair);
    memory.padded_rows = *st.array(RoutingArray::padded_rows);
  }
  run_attention(layer_.program, step, memory);
}

uint8_t *CpuLayer::placed(const std::string &name) {
  uint8_t *at = tensors_.at(name).at;
  user_check(at != nullptr) << "'" << name << "' has no memory: place() the saved memory and a workspace of "
                            << "step_memory()'s bytes first";
  return at;
}

void *CpuLayer::arg(const CpuArg &a) {
  switch (a.kind) {
  case CpuArg::Kind::tensor:
    return placed(a.name);
  case CpuArg::Kind::extent:
    return shapes_.dynamic_extent(a.name);
  case CpuArg::Kind::thread:
    return nullptr; // per call (call())
  case CpuArg::Kind::route: {
    RouteState &st = routes_.at(a.route);
    internal_check(a.array != RoutingArray::window) << "routing array '" << a.name << "' has no host table";
    internal_check(st.routed && st.block != nullptr)
        << "routing array '" << a.name << "' of route '" << a.route->name << "' read before the route ran";
    return st.array(a.array);
  }
  }
  return nullptr;
}

void CpuLayer::run(size_t begin, size_t end, const char *entry) {
  const std::vector<Step> &steps = layer_.program.steps;
  internal_check(begin <= end && end <= steps.size())
      << "steps [" << begin << ", " << end << ") of a program of " << steps.size();
  check_uploaded(layer_.program, begin, end, uploaded_, entry);
  const JitProgram &jit = *layer_.jit;
  const std::vector<CpuKernel> &kernels = layer_.kernels;
  if (step_plan_) // intermediates that live in an output's memory, wherever it is now
    for (const auto &[in, where] : step_plan_->in_output) {
      uint8_t *output = tensors_.at(where.output).at;
      tensors_.at(in).at = output ? output + where.offset : nullptr;
    }
  std::vector<void *> args;
  for (size_t i = begin; i < end; ++i) {
    const Step &s = steps[i];
    if (auto *rs = std::get_if<RoutingStep>(&s)) {
      route(*rs);
      for (const std::string &w : step_outputs(s))
        computed_.insert(w);
      continue;
    }
    if (auto *as = std::get_if<AttentionStep>(&s)) {
      attend(*as);
      for (const std::string &w : step_outputs(s))
        computed_.insert(w);
      continue;
    }
    size_t k = kernel_of_step_[i];
    internal_check(k < kernels.size() && kernels[k].step == step_name(s) && k < jit.functions.size())
        << "compiled steps do not match the program at " << step_name(s);
    // Arguments are bound per call: memory moves with place() and bind().
    // An FP8 GEMM reads its operands' rounded copies, made now from their
    // current values.
    std::map<std::string, std::vector<uint8_t>> rounded;
    if (const auto *g = std::get_if<GemmStep>(&s); g && g->fp8)
      for (const Fp8Operand &o : fp8_operands(*g)) {
        const TensorDecl &t = layer_.program.tensor(o.tensor);
        const size_t bytes = tensors_.at(o.tensor).bytes;
        if (!g->expert_k) {
          rounded[o.tensor] = fp8_rounded_copy(t, info(o.tensor).shape, placed(o.tensor), bytes, o.k_last, *g->fp8);
          continue;
        }
        const RouteState &st = routes_.at(g->route);
        const ExpertRows route{st.shape.experts, st.array(RoutingArray::counts), st.array(RoutingArray::offsets),
                               st.array(RoutingArray::offsets_unpadded), st.array(RoutingArray::sorted_pair)};
        rounded[o.tensor] = fp8_rounded_expert_copy(t, info(o.tensor).shape, placed(o.tensor), bytes,
                                                    o.tensor == g->a ? g->a_rows : g->b_rows, route, *g->fp8);
      }
    args.clear();
    size_t read_rounded = 0;
    for (const CpuArg &a : kernels[k].args) {
      auto copy = a.kind == CpuArg::Kind::tensor ? rounded.find(a.name) : rounded.end();
      read_rounded += copy != rounded.end();
      args.push_back(copy != rounded.end() ? copy->second.data() : arg(a));
    }
    internal_check(read_rounded == rounded.size())
        << step_name(s) << " reads " << read_rounded << " of its " << rounded.size() << " FP8 operands' copies";
    call(kernels[k], jit.functions[k], args);
    for (const std::string &w : step_outputs(s))
      computed_.insert(w);
  }
}

void CpuLayer::call(const CpuKernel &kernel, StepFunction f, std::vector<void *> &args) const {
  const int64_t threads = kernel.parallel ? threads_ : 1;
  // Each call's own index; the count shared. Thread arguments point at them.
  std::vector<int64_t> index(static_cast<size_t>(threads));
  std::vector<std::vector<void *>> per_thread(static_cast<size_t>(threads), args);
  for (int64_t t = 0; t < threads; ++t) {
    index[static_cast<size_t>(t)] = t;
    for (size_t a = 0; a < kernel.args.size(); ++a)
      if (kernel.args[a].kind == CpuArg::Kind::thread)
        per_thread[static_cast<size_t>(t)][a] = kernel.args[a].name == "index"
                                                    ? static_cast<void *>(&index[static_cast<size_t>(t)])
                                                    : const_cast<int64_t *>(&threads);
  }
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t)
    pool.emplace_back([&, t] { f(per_thread[static_cast<size_t>(t)].data()); });
  f(per_thread[0].data());
  for (std::thread &t : pool)
    t.join();
}

std::vector<std::pair<std::string, double>> CpuLayer::profile(size_t begin, size_t end, const char *entry) {
  std::vector<std::pair<std::string, double>> out;
  for (size_t i = begin; i < end; ++i) {
    auto start = std::chrono::steady_clock::now();
    run(i, i + 1, entry);
    out.emplace_back(step_name(layer_.program.steps[i]),
                     std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  return out;
}

HostTensor CpuLayer::download(const std::string &func) const {
  const TensorDecl &t = downloadable(layer_.program, func);
  user_check(!step_plan_ || !(step_plan_->workspace.offset.count(func) || step_plan_->in_output.count(func)))
      << "'" << func << "' lives in the workspace the caller gives each step: its value is gone once the steps "
      << "that read it have run; download outputs, gradients and what a forward saves";
  user_check(t.is_input || computed_.count(func))
      << "download(\"" << func << "\"): no step has computed '" << func << "' since the inputs it is made from "
      << "were last given (or the layer was poisoned): run the layer first (run(); a training layer's outputs "
      << "after forward(), its gradients after backward())";
  const Buffer &b = tensors_.at(func);
  user_check(b.at != nullptr) << "download(\"" << func << "\"): it has no memory yet: bind() it (an output) or "
                              << "place() the layer's memory (what a forward saves) first";
  const std::vector<uint8_t> bytes(b.at, b.at + b.bytes);
  if (t.layout != RowLayout::padded && t.layout != RowLayout::sorted)
    return shapes_.decode(t, bytes);
  auto route = routes_.find(t.route);
  user_check(route != routes_.end() && route->second.routed)
      << "download(\"" << func << "\") before run(): its rows are in the routing's order, which run() makes";
  const RouteState &st = route->second;
  const std::vector<int32_t> pair_pos = st.copy(RoutingArray::pair_pos);
  if (t.layout == RowLayout::padded)
    return shapes_.decode(t, bytes, &pair_pos);
  const std::vector<int32_t> rows = sorted_rows(st.copy(RoutingArray::expert), pair_pos, st.copy(RoutingArray::offsets),
                                                st.copy(RoutingArray::offsets_unpadded));
  return shapes_.decode(t, bytes, &rows);
}

const CpuLayer::RouteState &CpuLayer::routed(const std::string &route, const char *call) const {
  for (const auto &[r, st] : routes_)
    if (r->name == route) {
      user_check(st.routed) << call << "('" << route << "'): the route has not run (run the layer first)";
      return st;
    }
  user_error << "no route named '" << route << "' in this layer";
}

int64_t CpuLayer::dropped_pairs(const std::string &route) const {
  const RouteState &st = routed(route, "dropped_pairs");
  int64_t kept = 0;
  for (int32_t c : st.copy(RoutingArray::counts))
    kept += c;
  return st.shape.pairs() - kept;
}

std::vector<uint8_t> CpuLayer::kept_pairs(const std::string &route) const {
  const RouteState &st = routed(route, "kept_pairs");
  const std::vector<int32_t> pair_pos = st.copy(RoutingArray::pair_pos);
  std::vector<uint8_t> kept(pair_pos.size());
  for (size_t p = 0; p < kept.size(); ++p)
    kept[p] = !st.shape.drops() || pair_pos[p] != st.shape.drop_row();
  return kept;
}

std::vector<int32_t> CpuLayer::routed_experts(const std::string &route) const {
  return routed(route, "routed_experts").copy(RoutingArray::expert);
}

} // namespace moeforge::cpu
