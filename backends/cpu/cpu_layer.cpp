#include "backends/cpu/cpu_layer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <thread>

#include "dsl/error.h"
#include "lowering/lower.h"
#include "runtime/host_memory.h"
#include "runtime/layer_checks.h"

namespace moeforge::cpu {

CompiledCpuLayer compile_cpu_program(KernelProgram program, const std::string &what) {
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

CpuLayer::CpuLayer(const CompiledCpuLayer &layer, int64_t tokens)
    : layer_(layer), tokens_(tokens), shapes_(layer.program, tokens), threads_(cpu_threads()) {
  for (const auto &[r, shape] : shapes_.routings())
    routes_[r].shape = shape;
  size_t next = 0;
  for (const Step &s : layer_.program.steps)
    kernel_of_step_.push_back(std::holds_alternative<RoutingStep>(s) ? layer_.kernels.size() : next++);
  size_t bytes = 0;
  for (const TensorDecl &t : layer_.program.tensors)
    bytes += static_cast<size_t>(shapes_.elements(t)) * dtype_bytes(t.dtype);
  check_host_allocation(bytes, "the CPU backend's tensors of this layer at " + std::to_string(tokens) + " tokens");
  for (const TensorDecl &t : layer_.program.tensors)
    tensors_[t.name].assign(static_cast<size_t>(shapes_.elements(t)) * dtype_bytes(t.dtype), 0);
}

void CpuLayer::upload(const TensorMap &inputs) {
  for (const TensorDecl &t : layer_.program.tensors)
    if (t.is_input) {
      tensors_.at(t.name) = shapes_.encode_input(t, inputs);
      uploaded_.insert(t.name);
      forget_results_of(t.name);
    }
}

void CpuLayer::upload(const std::string &name, const HostTensor &value) {
  const TensorDecl *t = layer_.program.find(name);
  user_check(t != nullptr && t->is_input) << "'" << name << "' is not an Input or Param of this layer";
  tensors_.at(name) = shapes_.encode_input(*t, TensorMap{{name, value}});
  uploaded_.insert(name);
  forget_results_of(name);
}

void CpuLayer::upload_bytes(const std::string &name, const std::vector<uint8_t> &bytes) {
  const TensorDecl *t = layer_.program.find(name);
  user_check(t != nullptr && t->is_input) << "'" << name << "' is not an Input or Param of this layer";
  std::vector<uint8_t> &stored = tensors_.at(name);
  user_check(bytes.size() == stored.size())
      << "upload_bytes of '" << name << "': " << bytes.size() << " bytes given, the layer holds " << stored.size()
      << " (" << dtype_name(t->dtype) << " values of its shape)";
  stored = bytes;
  uploaded_.insert(name);
  forget_results_of(name);
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
    if (t.is_input)
      continue;
    std::vector<uint8_t> &buf = tensors_.at(t.name);
    for (size_t at = 0; at + dtype_bytes(t.dtype) <= buf.size(); at += dtype_bytes(t.dtype))
      t.dtype == DType::f32 ? (void)std::memcpy(&buf[at], &nan, 4) : (void)std::memcpy(&buf[at], &nan16, 2);
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
  const std::vector<uint8_t> &raw = tensors_.at(step.probs);
  std::vector<float> probs(static_cast<size_t>(st.shape.tokens * st.shape.experts));
  std::memcpy(probs.data(), raw.data(), probs.size() * sizeof(float));
  if (step.softmax) // step.probs holds the router's logits (lower.h, softmax_into_routing)
    softmax_rows(probs, st.shape.tokens, st.shape.experts);
  // The reference's rule (largest first, ties to the lower expert), then the
  // blocked format's tables: the same code the GPU routing is checked with.
  HostTopK top = top_k_on_host(st.shape, probs);
  st.tables = route_on_host(st.shape, top.expert, top.gate);
  st.padded_rows = st.tables.offsets.back();
  if (!step.gate_output.empty()) { // the chosen probabilities, pair order (gate_from_routing)
    std::vector<uint8_t> &gate = tensors_.at(step.gate_output);
    internal_check(gate.size() == top.gate.size() * sizeof(float))
        << "gate tensor '" << step.gate_output << "' holds " << gate.size() << " bytes for " << top.gate.size()
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
    std::memcpy(gate.data(), top.gate.data(), gate.size());
  }
}

void *CpuLayer::arg(const CpuArg &a) {
  switch (a.kind) {
  case CpuArg::Kind::tensor:
    return tensors_.at(a.name).data();
  case CpuArg::Kind::extent:
    return shapes_.dynamic_extent(a.name);
  case CpuArg::Kind::thread:
    return nullptr; // per call (call())
  case CpuArg::Kind::route: {
    RouteState &st = routes_.at(a.route);
    RoutingTables &t = st.tables;
    if (a.array == RoutingArray::num_tiles)
      return &t.num_tiles;
    if (a.array == RoutingArray::padded_rows)
      return &st.padded_rows;
    std::vector<int32_t> *v = routing_array(t, a.array);
    internal_check(v != nullptr) << "routing array '" << a.name << "' has no host table";
    internal_check(!v->empty()) << "routing array '" << a.name << "' of route '" << a.route->name
                                << "' read before the route ran";
    return v->data();
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
  std::vector<void *> args;
  for (size_t i = begin; i < end; ++i) {
    const Step &s = steps[i];
    if (auto *rs = std::get_if<RoutingStep>(&s)) {
      route(*rs);
      for (const std::string &w : step_outputs(s))
        computed_.insert(w);
      continue;
    }
    size_t k = kernel_of_step_[i];
    internal_check(k < kernels.size() && kernels[k].step == step_name(s) && k < jit.functions.size())
        << "compiled steps do not match the program at " << step_name(s);
    // Arguments are bound per call: the routing tables are rebuilt each run.
    args.clear();
    for (const CpuArg &a : kernels[k].args)
      args.push_back(arg(a));
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
  user_check(t.is_input || computed_.count(func))
      << "download(\"" << func << "\"): no step has computed '" << func << "' since the inputs it is made from "
      << "were last given (or the layer was poisoned): run the layer first (run(); a training layer's outputs "
      << "after forward(), its gradients after backward())";
  const std::vector<uint8_t> &bytes = tensors_.at(func);
  if (t.layout != RowLayout::padded)
    return shapes_.decode(t, bytes);
  auto route = routes_.find(t.route);
  user_check(route != routes_.end() && !route->second.tables.pair_pos.empty())
      << "download(\"" << func << "\") before run(): its rows are in the routing's order, which run() makes";
  const RoutingTables &tables = route->second.tables;
  return shapes_.decode(t, bytes, &tables.pair_pos);
}

int64_t CpuLayer::dropped_pairs(const std::string &route) const {
  for (const auto &[r, st] : routes_)
    if (r->name == route)
      return moeforge::dropped_pairs(st.shape, st.tables);
  user_error << "no route named '" << route << "' in this layer";
}

std::vector<uint8_t> CpuLayer::kept_pairs(const std::string &route) const {
  for (const auto &[r, st] : routes_)
    if (r->name == route) {
      std::vector<uint8_t> kept(st.tables.pair_pos.size());
      for (size_t p = 0; p < kept.size(); ++p)
        kept[p] = !st.shape.drops() || st.tables.pair_pos[p] != st.shape.drop_row();
      return kept;
    }
  user_error << "no route named '" << route << "' in this layer";
}

std::vector<int32_t> CpuLayer::routed_experts(const std::string &route) const {
  for (const auto &[r, st] : routes_)
    if (r->name == route)
      return st.tables.expert;
  user_error << "no route named '" << route << "' in this layer";
}

} // namespace moeforge::cpu
