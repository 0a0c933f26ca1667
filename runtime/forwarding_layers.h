// The part of the backend interface (backend.h) that a backend answers by
// handing the call to its own layer class unchanged: uploads, downloads,
// the routing's choices, the outputs and gradients. A backend's layers
// derive from these and add what differs between backends (how a step runs
// and is timed, what keeps the compiled program alive, another token count),
// so that the forwarding is written once.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/backend.h"

namespace moeforge {

// Inner: the backend's forward layer (cpu::CpuLayer, cuda::CudaLayer).
template <typename Inner> class ForwardingLayer : public Layer {
public:
  int64_t tokens() const override { return inner().tokens(); }
  void upload(const TensorMap &inputs) override { inner().upload(inputs); }
  void upload(const std::string &name, const HostTensor &value) override { inner().upload(name, value); }
  void upload_bytes(const std::string &name, const std::vector<uint8_t> &bytes) override {
    inner().upload_bytes(name, bytes);
  }
  void poison() override { inner().poison(); }
  HostTensor download(const std::string &func) const override { return inner().download(func); }
  std::vector<int32_t> routed_experts(const std::string &route) const override { return inner().routed_experts(route); }
  int64_t dropped_pairs(const std::string &route) const override { return inner().dropped_pairs(route); }
  std::vector<uint8_t> kept_pairs(const std::string &route) const override { return inner().kept_pairs(route); }

protected:
  virtual Inner &inner() = 0;
  virtual const Inner &inner() const = 0;
};

// Inner: the backend's training layer (cpu::CpuTrainingLayer,
// cuda::TrainingLayer).
template <typename Inner> class ForwardingTrainingLayer : public TrainingLayer {
public:
  int64_t tokens() const override { return inner().layer().tokens(); }
  void upload(const TensorMap &inputs) override { inner().upload(inputs); }
  void upload(const std::string &name, const HostTensor &value) override { inner().upload(name, value); }
  using TrainingLayer::upload_upstream_gradient;
  void upload_upstream_gradient(const std::string &output, const HostTensor &grad) override {
    inner().upload_upstream_gradient(output, grad);
  }
  void poison() override { inner().poison(); }
  using TrainingLayer::output;
  HostTensor output(const std::string &name) const override { return inner().output(name); }
  HostTensor gradient(const std::string &name) const override { return inner().gradient(name); }
  HostTensor download(const std::string &func) const override { return inner().download(func); }
  std::vector<int32_t> routed_experts(const std::string &route) const override { return inner().routed_experts(route); }
  int64_t dropped_pairs(const std::string &route) const override { return inner().dropped_pairs(route); }
  std::vector<uint8_t> kept_pairs(const std::string &route) const override { return inner().kept_pairs(route); }
  int64_t saved_bytes() const override { return inner().saved_bytes(); }

protected:
  virtual Inner &inner() = 0;
  virtual const Inner &inner() const = 0;
};

} // namespace moeforge
