// What the CPU backend's code generator builds LLVM IR with: a step's
// function (arguments loaded once in its entry block, loops, loads and
// stores of the program's tensors) and the emitter of an expression as f32
// arithmetic over it. Private to backends/cpu (it brings LLVM's headers).
#pragma once

#include <functional>
#include <map>

#include <llvm/IR/IRBuilder.h>
#include <llvm/IR/Intrinsics.h>
#include <llvm/IR/LLVMContext.h>
#include <llvm/IR/Module.h>

#include "backends/cpu/cpu_kernel.h"
#include "dsl/error.h"
#include "dsl/printer.h"
#include "lowering/kernel_program.h"

namespace moeforge::cpu {

using llvm::Value;

// One step's function: the entry block holds the allocas and the loads of
// the arguments (so each is loaded once, whatever loop first asks for it);
// code goes into the blocks after it.
class FunctionBuilder {
public:
  FunctionBuilder(const KernelProgram &prog, llvm::Module &m, CpuKernel &k)
      : prog_(prog), kernel_(k), ctx_(m.getContext()), b(ctx_), entry_b_(ctx_) {
    auto *fty = llvm::FunctionType::get(llvm::Type::getVoidTy(ctx_), {ptr_ty()}, false);
    fn_ = llvm::Function::Create(fty, llvm::Function::ExternalLinkage, k.symbol, m);
    fn_->addFnAttr(llvm::Attribute::NoUnwind);
    args_ = fn_->getArg(0);
    args_->setName("args");
    entry_ = llvm::BasicBlock::Create(ctx_, "entry", fn_);
    entry_b_.SetInsertPoint(entry_);
    b.SetInsertPoint(llvm::BasicBlock::Create(ctx_, "body", fn_));
  }

  // Closes the entry block and returns from the current block.
  void finish() {
    entry_b_.CreateBr(&*std::next(fn_->begin()));
    b.CreateRetVoid();
  }

  llvm::Type *ptr_ty() { return llvm::PointerType::get(ctx_, 0); }
  llvm::Type *i64() { return b.getInt64Ty(); }
  llvm::Type *f32() { return b.getFloatTy(); }
  Value *c64(int64_t v) { return b.getInt64(static_cast<uint64_t>(v)); }
  Value *cf(double v) { return llvm::ConstantFP::get(f32(), v); }

  Value *tensor(const std::string &name) { return arg(CpuArg{CpuArg::Kind::tensor, name, nullptr}, "t_" + name); }
  Value *route(const RoutingNode *r, RoutingArray array) {
    const std::string name = routing_array_name(array);
    return arg(CpuArg{CpuArg::Kind::route, name, r, array}, r->name + "_" + name);
  }
  // A route scalar (num_tiles, padded_rows) as i64.
  Value *route_scalar(const RoutingNode *r, RoutingArray array) {
    const std::string name = routing_array_name(array);
    std::string key = "scalar:" + r->name + ":" + name;
    if (auto it = loaded_.find(key); it != loaded_.end())
      return it->second;
    Value *v = entry_b_.CreateSExt(entry_b_.CreateLoad(b.getInt32Ty(), route(r, array)), i64(), name);
    return loaded_[key] = v;
  }
  // route array[index] as i64.
  Value *route_at(const RoutingNode *r, RoutingArray array, Value *index) {
    Value *p = b.CreateGEP(b.getInt32Ty(), route(r, array), index);
    return b.CreateSExt(b.CreateLoad(b.getInt32Ty(), p), i64(), routing_array_name(array));
  }
  // A Dim's extent as i64; dynamic extents are arguments.
  Value *extent(const Dim &d) { return extent_of(d.get()); }
  // The rows of r's padded layout, max_padded_rows = (ceil(T * k / block) +
  // E) * block (runtime/routing_host.h): the row stride of a padded_t tensor.
  // A route that drops pairs at capacity bounds them by its kept pairs,
  // which the host computes: an argument.
  Value *max_padded_rows(const RoutingNode *r) {
    if (prog_.routing(r).drops())
      return named_extent(max_padded_rows_extent(r));
    int64_t block = 0;
    for (const Step &s : prog_.steps)
      if (auto *rs = std::get_if<RoutingStep>(&s); rs && rs->route == r)
        block = rs->block;
    internal_check(block > 0) << "route '" << r->name << "' has no routing step";
    Value *tiles = b.CreateAdd(b.CreateSDiv(b.CreateAdd(extent(r->pairs), c64(block - 1)), c64(block)),
                               c64(r->expert_dim().extent()));
    return b.CreateMul(tiles, c64(block), "max_padded_rows");
  }

  Value *alloca_f32(int64_t n, const std::string &name) {
    return entry_b_.CreateAlloca(f32(), entry_b_.getInt64(n), name);
  }

  // for (i = begin; i < end; i += step) body(i)
  void for_loop(Value *begin, Value *end, const std::string &name, const std::function<void(Value *)> &body,
                int64_t step = 1) {
    llvm::BasicBlock *pre = b.GetInsertBlock();
    auto *head = llvm::BasicBlock::Create(ctx_, name + ".head", fn_);
    auto *loop = llvm::BasicBlock::Create(ctx_, name + ".body", fn_);
    auto *exit = llvm::BasicBlock::Create(ctx_, name + ".exit", fn_);
    b.CreateBr(head);
    b.SetInsertPoint(head);
    llvm::PHINode *i = b.CreatePHI(i64(), 2, name);
    i->addIncoming(begin, pre);
    b.CreateCondBr(b.CreateICmpSLT(i, end), loop, exit);
    b.SetInsertPoint(loop);
    body(i);
    Value *next = b.CreateAdd(i, c64(step), name + ".next", /*HasNUW=*/true, /*HasNSW=*/true);
    i->addIncoming(next, b.GetInsertBlock());
    b.CreateBr(head);
    b.SetInsertPoint(exit);
  }

  // for_loop over this call's part of [begin, end): the index-th of `count`
  // near-equal parts (the thread arguments); marks the kernel parallel. Only
  // for an outermost loop whose iterations write disjoint outputs.
  void parallel_for(Value *begin, Value *end, const std::string &name, const std::function<void(Value *)> &body) {
    Value *index = entry_b_.CreateLoad(i64(), arg(CpuArg{CpuArg::Kind::thread, "index", nullptr}, "thread"), "index");
    Value *count = entry_b_.CreateLoad(i64(), arg(CpuArg{CpuArg::Kind::thread, "count", nullptr}, "threads"), "count");
    kernel_.parallel = true;
    Value *n = b.CreateSub(end, begin);
    Value *lo = b.CreateAdd(begin, b.CreateSDiv(b.CreateMul(n, index), count));
    Value *hi = b.CreateAdd(begin, b.CreateSDiv(b.CreateMul(n, b.CreateAdd(index, c64(1))), count));
    for_loop(lo, hi, name, body);
  }

  void if_then(Value *cond, const std::function<void()> &then) {
    auto *yes = llvm::BasicBlock::Create(ctx_, "then", fn_);
    auto *done = llvm::BasicBlock::Create(ctx_, "endif", fn_);
    b.CreateCondBr(cond, yes, done);
    b.SetInsertPoint(yes);
    then();
    b.CreateBr(done);
    b.SetInsertPoint(done);
  }

  // Where element `offset` (row-major over t's dims) is stored: a tensor
  // with an outer stride (a Param inside a larger tensor, or its gradient)
  // has its first index `outer_stride` elements apart. Every load and store
  // goes through here, so no kernel needs to know.
  Value *stored_at(const TensorDecl &t, Value *offset) {
    if (t.outer_stride == 0)
      return offset;
    const int64_t inner = elements_past_first(t);
    return b.CreateAdd(b.CreateMul(b.CreateSDiv(offset, c64(inner)), c64(t.outer_stride)),
                       b.CreateSRem(offset, c64(inner)));
  }

  // Element `offset` of tensor t, as f32 (bf16 widened exactly).
  Value *load(const TensorDecl &t, Value *offset) {
    offset = stored_at(t, offset);
    Value *base = tensor(t.name);
    if (t.dtype == DType::f32)
      return b.CreateLoad(f32(), b.CreateGEP(f32(), base, offset));
    Value *bits = b.CreateLoad(b.getInt16Ty(), b.CreateGEP(b.getInt16Ty(), base, offset));
    Value *wide = b.CreateShl(b.CreateZExt(bits, b.getInt32Ty()), 16);
    return b.CreateBitCast(wide, f32());
  }

  // Stores f32 `v` as t's dtype: bf16 rounds to nearest, ties to even, and a
  // NaN stays a quiet NaN (the GPU's __float2bfloat16_rn).
  void store(const TensorDecl &t, Value *offset, Value *v) {
    offset = stored_at(t, offset);
    Value *base = tensor(t.name);
    if (t.dtype == DType::f32) {
      b.CreateStore(v, b.CreateGEP(f32(), base, offset));
      return;
    }
    Value *u = b.CreateBitCast(v, b.getInt32Ty());
    Value *lsb = b.CreateAnd(b.CreateLShr(u, 16), 1);
    Value *rounded = b.CreateLShr(b.CreateAdd(u, b.CreateAdd(lsb, b.getInt32(0x7fff))), 16);
    Value *nan = b.CreateOr(b.CreateLShr(u, 16), 0x40);
    Value *bits = b.CreateSelect(b.CreateFCmpUNO(v, v), nan, rounded);
    b.CreateStore(b.CreateTrunc(bits, b.getInt16Ty()), b.CreateGEP(b.getInt16Ty(), base, offset));
  }

  // Row-major offset of t at `idx`; a padded tensor's first index is a pair
  // r, found at its padded row pair_pos[r]; a sorted one's at that row less
  // the padding before its expert, pair_pos[r] - offsets[e] +
  // offsets_unpadded[e] (e = expert[r]).
  Value *offset(const TensorDecl &t, const std::vector<Value *> &idx) {
    internal_check(idx.size() == t.dims.size())
        << "tensor '" << t.name << "' indexed with " << idx.size() << " indices";
    internal_check(t.layout != RowLayout::padded_t)
        << "tensor '" << t.name << "' is a transposed padded copy: only expert-reduction GEMMs read it";
    Value *off = c64(0);
    for (size_t i = 0; i < idx.size(); ++i) {
      Value *v = idx[i];
      if (i == 0 && t.layout == RowLayout::padded)
        v = route_at(t.route, RoutingArray::pair_pos, v);
      if (i == 0 && t.layout == RowLayout::sorted) {
        Value *e = route_at(t.route, RoutingArray::expert, v);
        v = b.CreateAdd(
            b.CreateSub(route_at(t.route, RoutingArray::pair_pos, v), route_at(t.route, RoutingArray::offsets, e)),
            route_at(t.route, RoutingArray::offsets_unpadded, e));
      }
      off = i == 0 ? v : b.CreateAdd(b.CreateMul(off, extent(t.dims[i])), v);
    }
    return off;
  }

  llvm::Function *function() { return fn_; }
  llvm::LLVMContext &context() { return ctx_; }

private:
  Value *arg(const CpuArg &a, const std::string &name) {
    size_t i = 0;
    for (; i < kernel_.args.size(); ++i)
      if (kernel_.args[i] == a)
        break;
    std::string key = "arg:" + std::to_string(i);
    if (auto it = loaded_.find(key); it != loaded_.end())
      return it->second;
    if (i == kernel_.args.size())
      kernel_.args.push_back(a);
    Value *slot = entry_b_.CreateConstGEP1_64(ptr_ty(), args_, i);
    return loaded_[key] = entry_b_.CreateLoad(ptr_ty(), slot, name);
  }

  Value *extent_of(const DimNode *n) {
    if (n->base)
      return b.CreateMul(extent_of(n->base.get()), c64(n->factor));
    if (n->extent >= 0)
      return c64(n->extent);
    std::string key = "extent:" + n->name;
    if (auto it = loaded_.find(key); it != loaded_.end())
      return it->second;
    Value *p = arg(CpuArg{CpuArg::Kind::extent, n->name, nullptr}, "ext_" + n->name);
    return loaded_[key] = entry_b_.CreateLoad(i64(), p, n->name);
  }

public:
  // A run-time extent by name (ProgramShapes binds it), loaded once.
  Value *named_extent(const std::string &name) {
    std::string key = "extent:" + name;
    if (auto it = loaded_.find(key); it != loaded_.end())
      return it->second;
    Value *p = arg(CpuArg{CpuArg::Kind::extent, name, nullptr}, "ext_" + name);
    return loaded_[key] = entry_b_.CreateLoad(i64(), p, name);
  }

private:
  const KernelProgram &prog_;
  CpuKernel &kernel_;
  llvm::LLVMContext &ctx_;

public:
  llvm::IRBuilder<> b; // the code being emitted

private:
  llvm::IRBuilder<> entry_b_;
  llvm::Function *fn_ = nullptr;
  llvm::Argument *args_ = nullptr;
  llvm::BasicBlock *entry_ = nullptr;
  std::map<std::string, Value *> loaded_;
};

// Emits an expression as f32 arithmetic. Index variables in scope and the
// accumulators (held in registers) are looked up by node.
class ExprEmitter {
public:
  ExprEmitter(const KernelProgram &prog, FunctionBuilder &fb, const std::string &step)
      : prog_(prog), fb_(fb), b(fb.b), step_(step) {}

  std::map<const VarNode *, Value *> vars;
  std::map<const FuncNode *, Value *> registers;

  Value *emit(const Expr &e) {
    switch (e.kind()) {
    case ExprKind::Const:
      return fb_.cf(e.as<Const>()->value);
    case ExprKind::Access:
      return access(*e.as<Access>());
    case ExprKind::Unary:
      return unary(*e.as<Unary>());
    case ExprKind::IndexEq: { // [a == b]: 1 where the two indices agree
      auto *n = e.as<IndexEq>();
      return b.CreateSelect(b.CreateICmpEQ(index(n->a), index(n->b)), fb_.cf(1.0), fb_.cf(0.0));
    }
    case ExprKind::Binary: {
      auto *n = e.as<Binary>();
      Value *x = emit(n->a), *y = emit(n->b);
      switch (n->op) {
      case BinaryOp::add:
        return b.CreateFAdd(x, y);
      case BinaryOp::sub:
        return b.CreateFSub(x, y);
      case BinaryOp::mul:
        return b.CreateFMul(x, y);
      case BinaryOp::div:
        return b.CreateFDiv(x, y);
      case BinaryOp::max:
        return b.CreateBinaryIntrinsic(llvm::Intrinsic::maxnum, x, y);
      }
      break;
    }
    case ExprKind::RouteSum:
      return route_sum(*e.as<RouteSum>());
    case ExprKind::Sum:
      return reduction(*e.as<Sum>());
    case ExprKind::Extent: // a dynamic extent is known only now
      return b.CreateSIToFP(fb_.extent(e.as<Extent>()->dim), fb_.f32());
    case ExprKind::Softmax:
      break; // only as a whole definition (emit_pointwise)
    }
    internal_check(false) << "step " << step_ << ": the CPU codegen cannot emit " << to_string(e)
                          << " here (lowering should have split it)";
  }

  Value *index(const Index &ix) {
    auto it = vars.find(ix.var.get());
    internal_check(it != vars.end()) << "step " << step_ << ": index variable " << ix.var.name() << " not in scope";
    switch (ix.field) {
    case RouteField::none:
      return it->second;
    case RouteField::token: // pairs are numbered r = t * k + slot
      return b.CreateSDiv(it->second, fb_.c64(ix.route->k));
    case RouteField::expert:
      return fb_.route_at(ix.route.get(), RoutingArray::expert, it->second);
    }
    return nullptr;
  }

private:
  Value *access(const Access &a) {
    if (a.func)
      if (auto it = registers.find(a.func.get()); it != registers.end())
        return it->second;
    const TensorDecl &t = prog_.tensor(a.target_name());
    std::vector<Value *> idx;
    for (const Index &ix : a.args)
      idx.push_back(index(ix));
    return fb_.load(t, fb_.offset(t, idx));
  }

  Value *call_libm(const char *name, Value *x) {
    llvm::Module *m = fb_.function()->getParent();
    auto callee = m->getOrInsertFunction(name, fb_.f32(), fb_.f32());
    return b.CreateCall(callee, {x});
  }
  Value *exp(Value *x) { return b.CreateUnaryIntrinsic(llvm::Intrinsic::exp, x); }
  Value *sigmoid(Value *x) { return b.CreateFDiv(fb_.cf(1.0), b.CreateFAdd(fb_.cf(1.0), exp(b.CreateFNeg(x)))); }

  Value *unary(const Unary &u) {
    Value *x = emit(u.a);
    switch (u.op) {
    case UnaryOp::neg:
      return b.CreateFNeg(x);
    case UnaryOp::exp:
      return exp(x);
    case UnaryOp::log:
      return b.CreateUnaryIntrinsic(llvm::Intrinsic::log, x);
    case UnaryOp::tanh:
      return call_libm("tanhf", x);
    case UnaryOp::sigmoid:
      return sigmoid(x);
    case UnaryOp::relu:
      return b.CreateBinaryIntrinsic(llvm::Intrinsic::maxnum, x, fb_.cf(0.0));
    case UnaryOp::gelu: {
      // The tanh form, as the reference and the GPU compute it.
      Value *x3 = b.CreateFMul(b.CreateFMul(x, x), x);
      Value *inner = b.CreateFMul(fb_.cf(0.7978845608028654), b.CreateFAdd(x, b.CreateFMul(fb_.cf(0.044715), x3)));
      Value *t = call_libm("tanhf", inner);
      return b.CreateFMul(b.CreateFMul(fb_.cf(0.5), x), b.CreateFAdd(fb_.cf(1.0), t));
    }
    case UnaryOp::silu:
      return b.CreateFMul(x, sigmoid(x));
    case UnaryOp::step: // x > 0 ? 1 : 0 (the derivative of relu and max)
      return b.CreateSelect(b.CreateFCmpOGT(x, fb_.cf(0.0)), fb_.cf(1.0), fb_.cf(0.0));
    case UnaryOp::sqrt:
      return b.CreateUnaryIntrinsic(llvm::Intrinsic::sqrt, x);
    case UnaryOp::rsqrt:
      return b.CreateFDiv(fb_.cf(1.0), b.CreateUnaryIntrinsic(llvm::Intrinsic::sqrt, x));
    }
    internal_check(false) << "step " << step_ << ": unknown unary op";
  }

  // sum(i, body) with at most one free index left (lowering keeps GEMM-shaped
  // sums out of element-wise steps): a loop over i, in order, in f32.
  Value *reduction(const Sum &s) {
    Value *acc = fb_.alloca_f32(1, "sum_" + s.var.name());
    b.CreateStore(fb_.cf(0.0), acc);
    fb_.for_loop(fb_.c64(0), fb_.extent(s.var.dim()), s.var.name(), [&](Value *i) {
      vars[s.var.get()] = i;
      b.CreateStore(b.CreateFAdd(b.CreateLoad(fb_.f32(), acc), emit(s.body)), acc);
    });
    vars.erase(s.var.get());
    return b.CreateLoad(fb_.f32(), acc);
  }

  Value *route_sum(const RouteSum &s) {
    Value *acc = fb_.alloca_f32(1, s.field == RouteField::token ? "combine" : "expert_sum");
    b.CreateStore(fb_.cf(0.0), acc);
    Value *target = vars.at(s.target.get());
    const Var &pair = s.route->pair;
    auto add = [&](Value *r) {
      vars[pair.get()] = r;
      b.CreateStore(b.CreateFAdd(b.CreateLoad(fb_.f32(), acc), emit(s.body)), acc);
      vars.erase(pair.get());
    };
    if (s.field == RouteField::token) {
      // A token's pairs are the k consecutive rows t * k + slot: a fixed
      // loop, deterministic, in slot order.
      int k = s.route->k;
      const RoutingNode *route = s.route.get();
      const bool drops = prog_.routing(route).drops();
      fb_.for_loop(fb_.c64(0), fb_.c64(k), "slot", [&](Value *slot) {
        Value *r = b.CreateAdd(b.CreateMul(target, fb_.c64(k)), slot);
        if (!drops)
          return add(r);
        // A pair dropped at capacity sits at the drop row (routing_host.h):
        // its term is discarded by a select, not multiplied by 0, as its
        // values may be anything (a row no kernel wrote).
        Value *before = b.CreateLoad(fb_.f32(), acc);
        add(r);
        Value *dropped = b.CreateICmpEQ(fb_.route_at(route, RoutingArray::pair_pos, r),
                                        b.CreateSub(fb_.max_padded_rows(route), fb_.c64(1)));
        b.CreateStore(b.CreateSelect(dropped, before, b.CreateLoad(fb_.f32(), acc)), acc);
      });
    } else {
      // An expert's pairs are the first counts[e] rows of its padded segment,
      // in pair order (the sort is stable).
      Value *p0 = fb_.route_at(s.route.get(), RoutingArray::offsets, target);
      Value *p1 = b.CreateAdd(p0, fb_.route_at(s.route.get(), RoutingArray::counts, target));
      fb_.for_loop(p0, p1, "seg", [&](Value *p) { add(fb_.route_at(s.route.get(), RoutingArray::sorted_pair, p)); });
    }
    return b.CreateLoad(fb_.f32(), acc);
  }

  const KernelProgram &prog_;
  FunctionBuilder &fb_;
  llvm::IRBuilder<> &b;
  std::string step_;
};

} // namespace moeforge::cpu
