#include "backends/cpu/cpu_layer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "dsl/error.h"
#include "lowering/lower.h"

namespace moeforge::cpu {

namespace {

void check_dtype(const TensorDecl &t) {
  user_check(t.dtype != DType::f16) << "tensor '" << t.name << "' is f16, which the CPU backend does not support yet";
}

} // namespace

CompiledCpuLayer compile_cpu_layer(const Pipeline &pipeline, const Schedule &schedule) {
  CompiledCpuLayer c;
  c.program = lower(pipeline, schedule);
  c.jit = jit_compile(generate_llvm(c.program), "schedule '" + schedule.name() + "'");
  return c;
}

std::string cpu_llvm_ir(const Pipeline &pipeline, const Schedule &schedule, bool optimised) {
  KernelProgram p = lower(pipeline, schedule);
  LlvmModule m = generate_llvm(p);
  if (optimised)
    optimise_module(m, "schedule '" + schedule.name() + "'");
  return m.ir_text();
}

CpuLayer::CpuLayer(const CompiledCpuLayer &layer, int64_t tokens) : layer_(layer), tokens_(tokens) {
  user_check(tokens >= 1) << "a layer needs at least one token (got " << tokens << ")";
  const KernelProgram &p = layer_.program;
  // The one dynamic extent is the token count: every dynamic Dim is bound to it.
  for (const TensorDecl &t : p.tensors)
    for (const Dim &d : t.dims)
      for (const DimNode *n = d.get(); n; n = n->base.get())
        if (!n->base && n->extent < 0)
          extents_[n->name] = tokens;
  for (const Step &s : p.steps)
    if (auto *rs = std::get_if<RoutingStep>(&s)) {
      RouteState &st = routes_[rs->route];
      st.shape.tokens = extent(rs->route->token_dim());
      st.shape.experts = static_cast<int>(rs->route->expert_dim().extent());
      st.shape.k = rs->route->k;
      st.shape.block = rs->block;
      st.shape.check();
    }
  for (const TensorDecl &t : p.tensors) {
    check_dtype(t);
    int64_t n = rows_of(t);
    for (size_t i = 1; i < t.dims.size(); ++i)
      n *= extent(t.dims[i]);
    tensors_[t.name].assign(static_cast<size_t>(std::max<int64_t>(n, 1)) * dtype_bytes(t.dtype), 0);
  }
}

int64_t CpuLayer::extent(const Dim &d) const {
  const DimNode *n = d.get();
  int64_t factor = 1;
  for (; n->base; n = n->base.get())
    factor *= n->factor;
  return factor * (n->extent >= 0 ? n->extent : extents_.at(n->name));
}

int64_t CpuLayer::rows_of(const TensorDecl &t) const {
  if (t.dims.empty())
    return 1;
  if (t.layout == RowLayout::padded)
    return routes_.at(t.route).shape.max_padded_rows();
  return extent(t.dims[0]);
}

void CpuLayer::upload(const TensorMap &inputs) {
  for (const TensorDecl &t : layer_.program.tensors) {
    if (!t.is_input)
      continue;
    auto it = inputs.find(t.name);
    user_check(it != inputs.end()) << "no tensor given for input '" << t.name << "'";
    const HostTensor &h = it->second;
    std::vector<int64_t> want;
    for (const Dim &d : t.dims)
      want.push_back(extent(d));
    user_check(h.shape == want) << "input '" << t.name << "' has the wrong shape for " << tokens_
                                << " tokens: give it the declared Dims";
    std::vector<uint8_t> &buf = tensors_.at(t.name);
    for (size_t i = 0; i < h.data.size(); ++i) {
      float f = static_cast<float>(h.data[i]);
      if (t.dtype == DType::f32) {
        std::memcpy(&buf[i * 4], &f, 4);
      } else {
        uint16_t b = bf16_bits(f);
        std::memcpy(&buf[i * 2], &b, 2);
      }
    }
  }
}

void CpuLayer::poison() {
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

void CpuLayer::route(const RoutingStep &step) {
  RouteState &st = routes_.at(step.route);
  const std::vector<uint8_t> &raw = tensors_.at(step.probs);
  std::vector<float> probs(static_cast<size_t>(st.shape.tokens * st.shape.experts));
  std::memcpy(probs.data(), raw.data(), probs.size() * sizeof(float));
  // The reference's rule (largest first, ties to the lower expert), then the
  // blocked format's tables: the same code the GPU routing is checked with.
  cuda::HostTopK top = cuda::top_k_on_host(st.shape, probs);
  st.tables = cuda::route_on_host(st.shape, top.expert);
  st.padded_rows = st.tables.offsets.back();
}

void *CpuLayer::arg(const CpuArg &a) {
  switch (a.kind) {
  case CpuArg::Kind::tensor:
    return tensors_.at(a.name).data();
  case CpuArg::Kind::extent:
    return &extents_.at(a.name);
  case CpuArg::Kind::route: {
    RouteState &st = routes_.at(a.route);
    cuda::RoutingTables &t = st.tables;
    if (a.name == "num_tiles")
      return &t.num_tiles;
    if (a.name == "padded_rows")
      return &st.padded_rows;
    std::vector<int32_t> *v = a.name == "expert"           ? &t.expert
                              : a.name == "pair_pos"       ? &t.pair_pos
                              : a.name == "sorted_pair"    ? &t.sorted_pair
                              : a.name == "tile_expert"    ? &t.tile_expert
                              : a.name == "tile_row_start" ? &t.tile_row_start
                              : a.name == "tile_rows"      ? &t.tile_rows
                                                           : nullptr;
    internal_check(v != nullptr) << "unknown routing array '" << a.name << "'";
    internal_check(!v->empty()) << "routing array '" << a.name << "' of route '" << a.route->name
                                << "' read before the route ran";
    return v->data();
  }
  }
  return nullptr;
}

void CpuLayer::run() {
  const JitProgram &jit = *layer_.jit;
  size_t next = 0;
  std::vector<void *> args;
  for (const Step &s : layer_.program.steps) {
    if (auto *rs = std::get_if<RoutingStep>(&s)) {
      route(*rs);
      continue;
    }
    internal_check(next < jit.kernels.size() && jit.kernels[next].step == step_name(s))
        << "compiled steps do not match the program at " << step_name(s);
    // Arguments are bound per call: the routing tables are rebuilt each run.
    args.clear();
    for (const CpuArg &a : jit.kernels[next].args)
      args.push_back(arg(a));
    jit.functions[next](args.data());
    ++next;
  }
}

HostTensor CpuLayer::download(const std::string &func) const {
  const TensorDecl &t = layer_.program.tensor(func);
  std::vector<int64_t> shape;
  for (const Dim &d : t.dims)
    shape.push_back(extent(d));
  HostTensor out(shape);
  int64_t row = 1;
  for (size_t i = 1; i < shape.size(); ++i)
    row *= shape[i];
  const std::vector<uint8_t> &buf = tensors_.at(func);
  auto value = [&](int64_t i) -> double {
    if (t.dtype == DType::f32) {
      float f;
      std::memcpy(&f, &buf[i * 4], 4);
      return f;
    }
    uint16_t b;
    std::memcpy(&b, &buf[i * 2], 2);
    return bf16_value(b);
  };
  if (t.layout != RowLayout::padded) {
    for (int64_t i = 0; i < out.size(); ++i)
      out.data[i] = value(i);
    return out;
  }
  const std::vector<int32_t> &pos = routes_.at(t.route).tables.pair_pos;
  user_check(!pos.empty()) << "download('" << func << "'): run the layer first (its rows are in routed order)";
  for (int64_t r = 0; r < shape[0]; ++r)
    for (int64_t c = 0; c < row; ++c)
      out.data[r * row + c] = value(pos[r] * row + c);
  return out;
}

std::vector<int32_t> CpuLayer::routed_experts(const std::string &route) const {
  for (const auto &[r, st] : routes_)
    if (r->name == route)
      return st.tables.expert;
  user_error << "no route named '" << route << "' in this layer";
}

} // namespace moeforge::cpu
