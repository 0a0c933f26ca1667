// The algebra in Python: Dim, Var, Input, Param, Func, Expr and its
// operators, sum, softmax, the element-wise ops, top_k and Route, combine,
// expert_sum, the auxiliary losses, Pipeline and grad. It mirrors the C++ API
// (dsl/moeforge.h); where C++ writes f(t, i) Python writes f[t, i], since a
// call cannot be assigned to:
//
//   h[r, j] = mf.gelu(mf.sum(i, x[route.token(r), i] * w1[route.expert(r), i, j]))
#include <nanobind/nanobind.h>
#include <nanobind/operators.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <sstream>
#include <type_traits>

#include "bind_checked.h"
#include "dsl/autodiff.h"
#include "dsl/error.h"
#include "dsl/losses.h"
#include "dsl/moeforge.h"

namespace moeforge::python {

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// f[t, i], f[t] and x[route.token(r), i]: the subscript as a list of indices.
std::vector<Index> indices(const nb::handle &key, const std::string &target) {
  std::vector<Index> out;
  auto one = [&](const nb::handle &item) {
    Index index(Var{});
    if (!nb::try_cast(item, index))
      throw UserError("'" + target + "' is indexed by Vars and route.token(r) / route.expert(r), got a " +
                      nb::cast<std::string>(nb::str(item.type())));
    out.push_back(index);
  };
  if (nb::isinstance<nb::tuple>(key))
    for (nb::handle item : nb::borrow<nb::tuple>(key))
      one(item);
  else
    one(key);
  return out;
}

template <typename T> std::string printed(const T &value) {
  std::ostringstream s;
  s << value;
  return s.str();
}

} // namespace

void bind_algebra(nb::module_ &m) {
  nb::enum_<DType>(m, "DType", "Element types of tensors (storage; arithmetic is at least fp32).")
      .value("f32", DType::f32)
      .value("bf16", DType::bf16)
      .value("f16", DType::f16);
  m.attr("f32") = DType::f32;
  m.attr("bf16") = DType::bf16;
  m.attr("f16") = DType::f16;

  nb::class_<Dim>(m, "Dim", "A named extent; Dim.dynamic(name) is bound at run time (the token count).")
      .def(
          "__init__",
          [](Dim *d, const std::string &name, nb::handle extent) {
            check_user_name(name, "Dim");
            new (d) Dim(name, checked_integer(extent, INT64_MIN, INT64_MAX, "Dim('" + name + "', ...)", "extent"));
          },
          "name"_a, "extent"_a)
      .def_static(
          "dynamic",
          [](const std::string &name) {
            check_user_name(name, "Dim.dynamic");
            return Dim::dynamic(name);
          },
          "name"_a)
      .def_prop_ro("name", &Dim::name)
      .def_prop_ro("extent",
                   [](const Dim &d) -> nb::object {
                     if (d.is_dynamic())
                       return nb::none();
                     return nb::int_(d.extent());
                   })
      .def_prop_ro("is_dynamic", &Dim::is_dynamic)
      .def("__repr__", [](const Dim &d) {
        return "Dim('" + d.name() + "', " + (d.is_dynamic() ? std::string("dynamic") : std::to_string(d.extent())) +
               ")";
      });

  nb::class_<Var>(m, "Var", "An index variable ranging over a Dim.")
      .def(
          "__init__",
          [](Var *v, const std::string &name, const Dim &dim) {
            check_user_name(name, "Var");
            new (v) Var(name, dim);
          },
          "name"_a, "dim"_a)
      .def_prop_ro("name", &Var::name)
      .def_prop_ro("dim", &Var::dim)
      .def("__repr__", [](const Var &v) { return "Var('" + v.name() + "', " + v.dim().name() + ")"; });

  nb::class_<Index>(m, "Index", "A Var, or a route's token(r) / expert(r) of its pair variable r.")
      .def(nb::init_implicit<Var>())
      .def_prop_ro("dim", &Index::dim);

  nb::class_<Expr>(m, "Expr", "An expression of the algebra: numbers, accesses and the ops over them.")
      .def(nb::init_implicit<double>())
      .def(nb::self + nb::self)
      .def(nb::self - nb::self)
      .def(nb::self * nb::self)
      .def(nb::self / nb::self)
      .def(-nb::self)
      .def("__radd__", [](const Expr &a, double b) { return Expr(b) + a; })
      .def("__rsub__", [](const Expr &a, double b) { return Expr(b) - a; })
      .def("__rmul__", [](const Expr &a, double b) { return Expr(b) * a; })
      .def("__rtruediv__", [](const Expr &a, double b) { return Expr(b) / a; })
      .def_prop_ro("dtype", &Expr::dtype);

  auto buffer_getitem = [](const Buffer &b, nb::handle key) { return b(indices(key, b.name())); };
  nb::class_<Buffer>(m, "Buffer", "An Input or a Param: a tensor the layer reads.")
      .def("__getitem__", buffer_getitem)
      .def_prop_ro("name", &Buffer::name)
      .def_prop_ro("dims", &Buffer::dims)
      .def_prop_ro("dtype", &Buffer::dtype)
      .def_prop_ro("outer_stride", &Buffer::outer_stride);
  // Input and Param alike: the name checked, then the C++ constructor.
  auto buffer_init = [](auto tag, const char *kind) {
    using B = typename decltype(tag)::type;
    return [kind](B *b, const std::string &name, std::vector<Dim> dims, DType dtype) {
      check_user_name(name, kind);
      new (b) B(name, std::move(dims), dtype);
    };
  };
  nb::class_<Input, Buffer>(m, "Input", "An activation: gradients flow to it, it is not trained.")
      .def("__init__", buffer_init(std::type_identity<Input>{}, "Input"), "name"_a, "dims"_a, "dtype"_a = DType::bf16);
  nb::class_<Param, Buffer>(m, "Param",
                            "A trainable weight. outer_stride: elements between consecutive indices of its first "
                            "dim, for a weight stored inside a larger tensor (0: dense).")
      .def(
          "__init__",
          [](Param *p, const std::string &name, std::vector<Dim> dims, DType dtype, int64_t outer_stride) {
            check_user_name(name, "Param");
            if (outer_stride == 0)
              new (p) Param(name, std::move(dims), dtype);
            else
              new (p) Param(name, std::move(dims), dtype, outer_stride);
          },
          "name"_a, "dims"_a, "dtype"_a = DType::bf16, "outer_stride"_a = 0);

  // Copies share the definition (the algebra's nodes are immutable once
  // made), so a model holding a layer can be deep-copied (an EMA copy, a
  // frozen reference model).
  nb::class_<Func>(m, "Func", "A tensor defined by the algebra: f[t, i] = expression.")
      .def("__copy__", [](const Func &f) { return f; })
      .def(
          "__deepcopy__", [](const Func &f, nb::handle) { return f; }, "memo"_a)
      .def(
          "__init__",
          [](Func *f, const std::string &name) {
            check_user_name(name, "Func");
            new (f) Func(name);
          },
          "name"_a)
      .def(
          "__init__",
          [](Func *f, const std::string &name, DType dtype) {
            check_user_name(name, "Func");
            new (f) Func(name, dtype);
          },
          "name"_a, "dtype"_a)
      .def("__getitem__", [](const Func &f, nb::handle key) { return Expr(f(indices(key, f.name()))); })
      .def("__setitem__", [](const Func &f, nb::handle key, const Expr &body) { f(indices(key, f.name())) = body; })
      .def_prop_ro("name", &Func::name)
      .def_prop_ro("args", &Func::args)
      .def_prop_ro("dtype", &Func::dtype)
      .def_prop_ro("is_defined", &Func::is_defined)
      .def("__repr__", [](const Func &f) { return "Func('" + f.name() + "')"; });

  // The element-wise ops and reductions (dsl/ops.h).
  m.def("sum", nb::overload_cast<const Var &, const Expr &>(&moeforge::sum), "var"_a, "body"_a,
        "The sum of body over var.");
  m.def("softmax", &moeforge::softmax, "var"_a, "body"_a, "The softmax of body along var.");
  m.def("max", nb::overload_cast<const Expr &, const Expr &>(&moeforge::max), "a"_a, "b"_a);
  m.def("exp", nb::overload_cast<const Expr &>(&moeforge::exp), "a"_a);
  m.def("log", nb::overload_cast<const Expr &>(&moeforge::log), "a"_a);
  m.def("tanh", nb::overload_cast<const Expr &>(&moeforge::tanh), "a"_a);
  m.def("sigmoid", &moeforge::sigmoid, "a"_a);
  m.def("relu", &moeforge::relu, "a"_a);
  m.def("gelu", &moeforge::gelu, "a"_a);
  m.def("silu", &moeforge::silu, "a"_a);
  m.def("sqrt", nb::overload_cast<const Expr &>(&moeforge::sqrt), "a"_a);
  m.def("rsqrt", &moeforge::rsqrt, "a"_a);
  m.def("step", &moeforge::step, "a"_a, "1 where a > 0, else 0 (the derivative of relu).");
  m.def("index_eq", &moeforge::index_eq, "a"_a, "b"_a, "1 where two indices are equal, else 0.");
  m.def("extent", &moeforge::extent, "dim"_a, "A Dim's extent as a number (the token count at run time).");

  nb::class_<Route>(m, "Route", "The pairs a top_k chose: pair r routes token(r) to expert(r) with gate(r).")
      .def_prop_ro("pair", &Route::pair)
      .def("token", &Route::token, "r"_a)
      .def("expert", &Route::expert, "r"_a)
      .def("gate", &Route::gate, "r"_a)
      .def_prop_ro("gate_func", &Route::gate_func)
      .def_prop_ro("k", &Route::k)
      .def_prop_ro("name", &Route::name);
  m.def(
      "top_k",
      [](const Func &probs, const Var &expert, int k, bool renormalize, const std::string &name, int groups,
         int top_groups) {
        return top_k(probs, expert, k, TopKOptions{renormalize, name, groups, top_groups});
      },
      "probs"_a, "expert"_a, "k"_a, "renormalize"_a = false, "name"_a = "route", "groups"_a = 1, "top_groups"_a = 1,
      "Chooses the k largest probs along expert for each token (among the experts of the top_groups best of "
      "`groups` groups when groups > 1).");
  m.def("expert_choice", &moeforge::expert_choice, "probs"_a, "expert"_a, "capacity_factor"_a, "name"_a = "route",
        "Each expert takes its top ceil(capacity_factor * T / E) tokens by probs (expert-choice routing).");
  m.def("combine", &moeforge::combine, "route"_a, "token"_a, "body"_a, "Sums a per-pair body back to its tokens.");
  m.def("expert_sum", &moeforge::expert_sum, "route"_a, "expert"_a, "body"_a, "Sums a per-pair body into its experts.");

  m.def(
      "load_balancing_loss",
      [](const Route &route, const Func &probs, const Var &expert, const std::string &name, double coefficient) {
        return load_balancing_loss(route, probs, expert, AuxLossOptions{name, coefficient});
      },
      "route"_a, "probs"_a, "expert"_a, "name"_a = "", "coefficient"_a = 1.0,
      "Switch Transformer's load-balancing loss (a 0-D Func).");
  m.def(
      "z_loss",
      [](const Func &logits, const Var &expert, const std::string &name, double coefficient) {
        return z_loss(logits, expert, AuxLossOptions{name, coefficient});
      },
      "logits"_a, "expert"_a, "name"_a = "", "coefficient"_a = 1.0, "ST-MoE's router z-loss (a 0-D Func).");

  nb::class_<Pipeline>(m, "Pipeline", "A layer: every Func its outputs need, in order.")
      .def("__copy__", [](const Pipeline &p) { return p; })
      .def(
          "__deepcopy__", [](const Pipeline &p, nb::handle) { return p; }, "memo"_a)
      .def(nb::init<std::vector<Func>>(), "outputs"_a)
      .def_prop_ro("outputs", &Pipeline::outputs)
      .def_prop_ro("funcs", &Pipeline::funcs)
      .def_prop_ro("buffers",
                   [](const Pipeline &p) {
                     std::vector<std::string> names;
                     for (const BufferPtr &b : p.buffers())
                       names.push_back(b->name);
                     return names;
                   })
      .def_prop_ro(
          "buffer_decls",
          [](const Pipeline &p) {
            nb::list out;
            for (const BufferPtr &b : p.buffers()) {
              nb::list shape;
              for (const Dim &d : b->dims)
                shape.append(d.is_dynamic() ? nb::object(nb::none()) : nb::object(nb::int_(d.extent())));
              nb::dict d;
              d["name"] = b->name;
              d["kind"] = b->kind == BufferKind::input ? "input" : "param";
              d["shape"] = nb::tuple(shape);
              d["dtype"] = dtype_name(b->dtype);
              d["outer_stride"] = b->first_dim_stride();
              out.append(d);
            }
            return out;
          },
          "Each Input and Param: {name, kind ('input' or 'param'), shape (None: the token Dim), dtype, outer_stride "
          "(elements between indices of its first dim as stored)}.")
      .def("func", &Pipeline::func, "name"_a)
      .def("__str__", [](const Pipeline &p) { return printed(p); });

  nb::class_<Gradients>(m, "Gradients", "The gradient algebra of a pipeline's outputs (grad()).")
      .def_ro("seed", &Gradients::seed)
      .def_ro("seeds", &Gradients::seeds)
      .def_ro("of", &Gradients::of)
      .def_ro("pipeline", &Gradients::pipeline)
      .def("__getitem__", &Gradients::operator[], "name"_a);
  m.def(
      "grad",
      nb::overload_cast<const Pipeline &, const std::vector<Func> &, const std::vector<std::string> &>(&moeforge::grad),
      "pipeline"_a, "outputs"_a, "seed_names"_a = std::vector<std::string>{},
      "Differentiates outputs: each output's upstream gradient is an Input named seeds[k] ('d_y').");
}

} // namespace moeforge::python
