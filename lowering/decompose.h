// Decomposition: the first thing lowering does to each definition. A user's
// forward layer is usually already in the shapes the kernels run (a GEMM
// with an element-wise epilogue, an element-wise Func, a softmax), but the
// backward pass that autodiff derives is not: its contractions hide inside
// combines, multiply more than two factors, read weights transposed and sum
// over an expert's routed rows. decompose() splits such a definition into
// parts, each a new definition in one of the kernels' shapes:
//
//   operand    sum(k, (d_h(r, k) * gelu'(u(r, k))) * w1(expert(r), d, k))
//              -> a(r, k) = d_h(r, k) * gelu'(u(r, k))   (bf16, element-wise)
//                 sum(k, a(r, k) * w1(expert(r), d, k))  (a GEMM, B transposed)
//   contraction a GEMM-shaped sum inside a combine or beside another sum is
//              moved into its own Func (f32) and read back element-wise
//   reduction  a sum with one free index (a dot product per row) stays
//              inline: the element-wise kernels loop over it
//   invariant  a sum that does not depend on every index of its definition
//              (softmax's backward: d(t, e) = p(t, e) * (g(t, e) - sum(e',
//              p(t, e') g(t, e')))) becomes its own Func (f32) over the
//              indices it reads, made once per row instead of once per element
//   expert     expert_sum(route, e, A(r, i) * B(r, j)) keeps its form (an
//              expert reduction GEMM) once both sides are plain reads
//
// Operands that are equal up to renaming their indices are made once and
// shared (dX and dW1 both read d_h * gelu'(u)). With share_forward_sums, a
// sum that is the whole body of another definition (autodiff's saved
// pre-activation u(r, j) = sum(...)) is read from it instead of being
// computed again: the forward stores u and the backward reads it. Without
// it, the backward's copy is recomputed from the inputs.
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

#include "dsl/pipeline.h"

namespace moeforge {

class Decomposer {
public:
  Decomposer(const Pipeline &p, bool share_forward_sums);

  // The definitions to run for f, dependencies first; the last one has f's
  // name, indices and dtype. Parts made for earlier definitions (shared
  // operands, forward sums) are not repeated.
  std::vector<FuncPtr> decompose(const FuncPtr &f);

  // Funcs whose storage must be bf16 because a GEMM reads them as an operand
  // (an f32 intermediate autodiff made, such as d_o = gate * d_y).
  const std::vector<std::string> &bf16_operands() const { return bf16_operands_; }

  struct Split; // a sum's factors sorted onto the A and B sides

private:
  Expr rewrite_gemm_sums(const FuncNode &f, const Expr &body, std::vector<FuncPtr> &parts);
  Expr extract_sums(const FuncNode &f, const Expr &body, std::vector<FuncPtr> &parts);
  Expr plain_operands(const FuncNode &f, const Expr &sum, const Var &row, const Var &col, std::vector<FuncPtr> &parts);
  Expr expert_reduction(const FuncNode &f, std::vector<FuncPtr> &parts);
  Expr share_sums(const FuncNode &f, const Expr &body, std::vector<FuncPtr> &parts);
  Expr hoist_invariant_sums(const FuncNode &f, const Expr &body, std::vector<FuncPtr> &parts);
  // A read of a new (or already made, equal) definition name(args) = body.
  Expr part(const std::string &name, const std::vector<Var> &args, const Expr &body, DType t,
            std::vector<FuncPtr> &parts);
  void operand_dtype(const Expr &operand);
  bool needs_bf16_copy(const Access *a) const;

  const Pipeline &pipeline_;
  bool share_forward_sums_;
  std::map<std::string, FuncPtr> made_;       // canonical text of a part -> its definition
  std::map<const ExprNode *, FuncPtr> whole_; // a definition's whole body -> the definition
  std::vector<std::string> bf16_operands_;
  std::set<std::string> done_;
  int counter_ = 0;
  // The Func whose schedule settings the parts being made take: the one
  // being decomposed, or the one it was itself made for (FuncNode::schedule_of).
  std::string owner_;
};

} // namespace moeforge
