// A Pipeline is the graph reachable from a layer's output Funcs: its Inputs
// and Params, its routes and its definitions in dependency order. Backends
// evaluate or compile a Pipeline; schedules refer to its Funcs by name.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "dsl/ir.h"

namespace moeforge {

class Pipeline {
public:
  // One step of the pipeline in dependency order: a definition or a routing.
  struct Step {
    FuncPtr func;     // set for a definition
    RoutingPtr route; // set for a top_k routing
  };

  explicit Pipeline(std::vector<Func> outputs);

  const std::vector<Func> &outputs() const { return outputs_; }
  const std::vector<Step> &steps() const { return steps_; }
  // Every Func, dependencies first.
  std::vector<Func> funcs() const;
  // Inputs and Params in order of first use.
  const std::vector<BufferPtr> &buffers() const { return buffers_; }
  const std::vector<RoutingPtr> &routes() const { return routes_; }
  // Every Dim that a buffer, a definition or a route uses, in first-seen order.
  const std::vector<Dim> &dims() const { return dims_; }
  // Looks a Func up by name; throws a UserError listing the names otherwise.
  Func func(const std::string &name) const;
  BufferPtr buffer(const std::string &name) const;

  // The whole layer as readable math: dims, buffers, then each step.
  void print(std::ostream &os) const;

private:
  std::vector<Func> outputs_;
  std::vector<Step> steps_;
  std::vector<BufferPtr> buffers_;
  std::vector<RoutingPtr> routes_;
  std::vector<Dim> dims_;
};

std::ostream &operator<<(std::ostream &os, const Pipeline &p);

} // namespace moeforge
