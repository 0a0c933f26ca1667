#include "backends/cpu/codegen_llvm.h"

#include <functional>
#include <map>

#include <llvm/IR/IRBuilder.h>
#include <llvm/IR/Intrinsics.h>
#include <llvm/IR/LLVMContext.h>
#include <llvm/IR/Module.h>
#include <llvm/IR/Verifier.h>
#include <llvm/Support/raw_ostream.h>

#include "dsl/error.h"
#include "dsl/printer.h"

namespace moeforge::cpu {

LlvmModule::LlvmModule() = default;
LlvmModule::LlvmModule(LlvmModule &&) noexcept = default;
LlvmModule &LlvmModule::operator=(LlvmModule &&) noexcept = default;
LlvmModule::~LlvmModule() {
  module.reset(); // the module refers to its context: it goes first
  context.reset();
}

std::string LlvmModule::ir_text() const {
  std::string s;
  llvm::raw_string_ostream os(s);
  module->print(os, nullptr);
  return os.str();
}

namespace {

using llvm::Value;

std::string symbol_name(const std::string &step) {
  std::string out = "moeforge_";
  for (char c : step)
    out += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return out;
}

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

// ------------------------------------------------------------ GEMM

void emit_gemm(const KernelProgram &prog, const GemmStep &g, FunctionBuilder &fb) {
  auto &b = fb.b;
  // K and N may be dynamic (d_wr = x^T d_logits reduces over the tokens;
  // attention's scores q k^T have a column per token): the accumulators hold
  // one block of TN columns, the schedule's tile_n (or a static N below it).
  Value *N = fb.extent(g.n);
  const int nb = static_cast<int>(g.b.size());
  // Columns in blocks of the schedule's tile_n: the accumulators of one row
  // block stay in L1 while K streams through; the last block may be partial
  // (an untiled N such as 72 with tile_n 64).
  const int64_t TN = g.n.is_dynamic() ? g.tiling.tile_n : std::min<int64_t>(g.tiling.tile_n, g.n.extent());
  const TensorDecl &A = prog.tensor(g.a), &C = prog.tensor(g.output);
  std::vector<const TensorDecl *> B;
  for (const std::string &name : g.b)
    B.push_back(&prog.tensor(name));
  std::vector<Value *> acc;
  for (int i = 0; i < nb; ++i)
    acc.push_back(fb.alloca_f32(TN, "acc" + std::to_string(i)));
  internal_check(!g.b_trans || !g.expert_k) << "an expert reduction's B is never transposed";
  internal_check(!g.chained || (nb == 1 && !g.expert_k)) << "a chained product is for single-B GEMMs";
  // The B operands `update` reads: the GEMM's own, or its chained
  // product's while that one's loop is emitted (GemmStep::chained). A
  // transposed B has a loop of its own (a dot product per column, below).

  // One output row of C, stored at row `out_row`, the epilogue's row index
  // being `row_index`: N in blocks of TN; accumulate(n0, update) calls
  // update(i, b_row, a) once per k: acc_i[j] += a * B_i[b_row + j].
  using Update = std::function<void(int i, Value *b_row, Value *a)>;
  // p_row: the row in tile order, where a fused output in the padded layout
  // goes (a pair-order one goes to row_index, a sorted one to s_row: p_row
  // less the padding before the tile's expert; null where none is sorted).
  auto columns = [&](Value *out_row, Value *row_index, Value *p_row, Value *s_row,
                     const std::function<void(Value * n0, Value * width, const Update &)> &accumulate) {
    fb.for_loop(
        fb.c64(0), N, "n0",
        [&](Value *n0) {
          Value *width =
              b.CreateSelect(b.CreateICmpSLT(b.CreateSub(N, n0), fb.c64(TN)), b.CreateSub(N, n0), fb.c64(TN), "width");
          for (int i = 0; i < nb; ++i)
            fb.for_loop(fb.c64(0), width, "zero",
                        [&](Value *j) { b.CreateStore(fb.cf(0.0), b.CreateGEP(fb.f32(), acc[i], j)); });
          // acc[i][j] += a * B_i[b_row + j] for the columns of this block.
          accumulate(n0, width, [&](int i, Value *b_row, Value *a) {
            fb.for_loop(fb.c64(0), width, "j", [&](Value *j) {
              Value *slot = b.CreateGEP(fb.f32(), acc[i], j);
              // b_row: B[k, n0] (row-major [K, N]).
              Value *at = b.CreateAdd(b_row, j);
              Value *prod = b.CreateFMul(a, fb.load(*B[i], at));
              b.CreateStore(b.CreateFAdd(b.CreateLoad(fb.f32(), slot), prod), slot);
            });
          });
          // The epilogue, per element, in f32; stored as C's dtype.
          fb.for_loop(fb.c64(0), width, "epi", [&](Value *j) {
            ExprEmitter em(prog, fb, g.name);
            Value *col = b.CreateAdd(n0, j);
            em.vars[g.row_var.get()] = row_index;
            em.vars[g.col_var.get()] = col;
            for (int i = 0; i < nb; ++i)
              em.registers[g.accumulators[i].get()] = b.CreateLoad(fb.f32(), b.CreateGEP(fb.f32(), acc[i], j));
            Value *v = em.emit(g.epilogue);
            Value *at = b.CreateAdd(b.CreateMul(out_row, N), col);
            // out_add: the pair's share of its token's combine, rounded to
            // C's dtype at each addition as the GPU's atomic adds are.
            fb.store(C, at, g.out_add ? b.CreateFAdd(fb.load(C, at), v) : v);
            for (const GemmStep::Extra &x : g.extra) { // fused element-wise outputs
              const TensorDecl &t = prog.tensor(x.output);
              internal_check(t.layout != RowLayout::sorted || s_row) << g.name << ": '" << t.name << "' is sorted";
              // An expert reduction's further output (a second B's weight
              // gradient) is a matrix per expert, as its own output is.
              Value *at = g.expert_k                                  ? out_row
                          : !g.route || t.layout == RowLayout::padded ? p_row
                          : t.layout == RowLayout::sorted             ? s_row
                                                                      : row_index;
              fb.store(t, b.CreateAdd(b.CreateMul(at, N), col), em.emit(x.value));
            }
          });
        },
        TN);
  };

  if (g.expert_k) {
    // C[e, m, n] = sum over e's padded segment [offsets[e], offsets[e+1]) of
    // A^T[m, p] * B[p, n]; both operands are zero on padding rows, and an
    // expert with no rows gets zeros.
    const RoutingNode *rt = g.route;
    if (g.operands_in_place) {
      // A and B read where they are: row(p) of each through its row map,
      // padding rows (sorted_pair[p] < 0) skipped.
      Value *M = fb.extent(g.m);
      auto row_of = [&](RowMap m, Value *p, Value *r) -> Value * {
        return m == RowMap::direct ? p : m == RowMap::gather_pair ? r : b.CreateSDiv(r, fb.c64(rt->k));
      };
      // A or B stored sorted (lowering/sorted_rows.h): its rows without the
      // padding before expert e.
      const bool a_sorted = A.layout == RowLayout::sorted, b_sorted = B[0]->layout == RowLayout::sorted;
      internal_check(!b_sorted || g.b_rows == RowMap::direct) << g.name << ": a sorted B is read in tile order";
      for (const TensorDecl *bi : B) // two B operands (merge_weight_gradients) are stored alike
        internal_check((bi->layout == RowLayout::sorted) == b_sorted)
            << g.name << ": B operands '" << B[0]->name << "' and '" << bi->name << "' in different row layouts";
      internal_check(!a_sorted || g.a_rows == RowMap::direct) << g.name << ": a sorted A is read in tile order";
      // Experts in parallel: each writes its own C[e].
      fb.parallel_for(fb.c64(0), fb.c64(rt->expert_dim().extent()), "e", [&](Value *e) {
        Value *p0 = fb.route_at(rt, RoutingArray::offsets, e);
        Value *p1 = fb.route_at(rt, RoutingArray::offsets, b.CreateAdd(e, fb.c64(1)));
        Value *shift =
            a_sorted || b_sorted ? b.CreateSub(p0, fb.route_at(rt, RoutingArray::offsets_unpadded, e)) : nullptr;
        fb.for_loop(fb.c64(0), M, "m", [&](Value *m) {
          columns(b.CreateAdd(b.CreateMul(e, M), m), m, m, nullptr, [&](Value *n0, Value *, const Update &update) {
            fb.for_loop(p0, p1, "p", [&](Value *p) {
              Value *r = fb.route_at(rt, RoutingArray::sorted_pair, p);
              fb.if_then(b.CreateICmpSGE(r, fb.c64(0)), [&] {
                Value *a_row = a_sorted ? b.CreateSub(p, shift) : row_of(g.a_rows, p, r);
                Value *a = fb.load(A, b.CreateAdd(b.CreateMul(a_row, M), m));
                Value *b_row = b_sorted ? b.CreateSub(p, shift) : row_of(g.b_rows, p, r);
                for (int i = 0; i < nb; ++i)
                  update(i, b.CreateAdd(b.CreateMul(b_row, N), n0), a);
              });
            });
          });
        });
      });
      return;
    }
    internal_check(A.layout == RowLayout::padded_t && B[0]->layout == RowLayout::padded && nb == 1)
        << "step " << g.name << ": an expert reduction reads A^T (padded_t) and B (padded)";
    Value *stride = fb.max_padded_rows(rt), *M = fb.extent(g.m);
    fb.parallel_for(fb.c64(0), fb.c64(rt->expert_dim().extent()), "e", [&](Value *e) {
      Value *p0 = fb.route_at(rt, RoutingArray::offsets, e);
      Value *p1 = fb.route_at(rt, RoutingArray::offsets, b.CreateAdd(e, fb.c64(1)));
      fb.for_loop(fb.c64(0), M, "m", [&](Value *m) {
        Value *a_base = b.CreateMul(m, stride);
        columns(b.CreateAdd(b.CreateMul(e, M), m), m, m, nullptr, [&](Value *n0, Value *, const Update &update) {
          fb.for_loop(p0, p1, "p", [&](Value *p) {
            Value *a = fb.load(A, b.CreateAdd(a_base, p));
            update(0, b.CreateAdd(b.CreateMul(p, N), n0), a);
          });
        });
      });
    });
    return;
  }

  // The products summed into the accumulators: A B, then A2 B2 where chained.
  struct Product {
    const TensorDecl *a;
    std::vector<const TensorDecl *> b;
    Value *k;
  };
  std::vector<Product> products{{&A, B, fb.extent(g.k)}};
  if (g.chained)
    products.push_back({&prog.tensor(g.chained->a), {&prog.tensor(g.chained->b)}, fb.extent(g.chained->k)});
  // One output row: p is the row in tile order (padded position, or m when
  // dense), r the pair (or m), expert the B slice.
  // Tensors stored sorted (lowering/sorted_rows.h) that the GEMM reads as A
  // (or A2) or writes as a further output: row p of the tile order is row
  // p - offsets[e] + offsets_unpadded[e] there.
  bool any_sorted = A.layout == RowLayout::sorted || C.layout == RowLayout::sorted ||
                    (g.chained && prog.tensor(g.chained->a).layout == RowLayout::sorted);
  for (const GemmStep::Extra &x : g.extra)
    any_sorted |= prog.tensor(x.output).layout == RowLayout::sorted;
  internal_check(!any_sorted ||
                 (g.route && !g.expert_k && (A.layout != RowLayout::sorted || g.a_rows == RowMap::direct) &&
                  (C.layout != RowLayout::sorted || g.out_rows == RowMap::direct)))
      << g.name << ": tensors stored sorted are a routed GEMM's A in tile order or its outputs in tile order";
  auto row = [&](Value *p, Value *r, Value *expert) {
    Value *a_row = g.a_rows == RowMap::direct        ? p
                   : g.a_rows == RowMap::gather_pair ? r
                                                     : b.CreateSDiv(r, fb.c64(g.route->k));
    Value *out_row = g.out_rows == RowMap::direct         ? p
                     : g.out_rows == RowMap::gather_token ? b.CreateSDiv(r, fb.c64(g.route->k))
                                                          : r;
    Value *s_row = any_sorted ? b.CreateAdd(b.CreateSub(p, fb.route_at(g.route, RoutingArray::offsets, expert)),
                                            fb.route_at(g.route, RoutingArray::offsets_unpadded, expert))
                              : nullptr;
    if (C.layout == RowLayout::sorted)
      out_row = s_row;
    columns(out_row, r, p, s_row, [&](Value *n0, Value *width, const Update &update) {
      for (const Product &pr : products) {
        Value *K = pr.k;
        Value *a_base = b.CreateMul(pr.a->layout == RowLayout::sorted ? s_row : a_row, K);
        Value *b_base = g.b_per_expert ? b.CreateMul(expert, b.CreateMul(K, N)) : fb.c64(0);
        B = pr.b;
        if (g.b_trans) {
          // B read in place transposed ([N, K]): column n0 + j is a row of B,
          // contiguous in k. Each column is a dot product along k (its sum
          // in ascending k, as before), eight columns at a time so that
          // eight independent sums are in flight: one sum alone waits on
          // its previous add at every k, and k outermost over all columns
          // would touch `width` rows of B K apart at every step.
          constexpr int kCols = 8;
          Value *full = b.CreateMul(b.CreateSDiv(width, fb.c64(kCols)), fb.c64(kCols));
          // The sums live in scalar allocas, which mem2reg makes registers
          // (a slot of the accumulator array, indexed by j, stays memory).
          std::vector<Value *> sums;
          for (int u = 0; u < kCols; ++u)
            sums.push_back(fb.alloca_f32(1, "dot" + std::to_string(u)));
          auto dot = [&](Value *j0, int cols) {
            for (int i = 0; i < nb; ++i) {
              std::vector<Value *> slot, b_col;
              for (int u = 0; u < cols; ++u) {
                Value *j = b.CreateAdd(j0, fb.c64(u));
                slot.push_back(b.CreateGEP(fb.f32(), acc[i], j));
                b_col.push_back(b.CreateAdd(b_base, b.CreateMul(b.CreateAdd(n0, j), K)));
                b.CreateStore(b.CreateLoad(fb.f32(), slot[u]), sums[u]);
              }
              // Reassociation lets LLVM vectorize the sums along k (partial
              // sums per lane, added at the end): the order differs from a
              // plain loop's by rounding only, as the GPU's tiles do.
              llvm::IRBuilderBase::FastMathFlagGuard guard(b);
              llvm::FastMathFlags reassoc;
              reassoc.setAllowReassoc();
              b.setFastMathFlags(reassoc);
              fb.for_loop(fb.c64(0), K, "kt", [&](Value *kk) {
                Value *a = fb.load(*pr.a, b.CreateAdd(a_base, kk));
                for (int u = 0; u < cols; ++u) {
                  Value *prod = b.CreateFMul(a, fb.load(*B[i], b.CreateAdd(b_col[u], kk)));
                  b.CreateStore(b.CreateFAdd(b.CreateLoad(fb.f32(), sums[u]), prod), sums[u]);
                }
              });
              for (int u = 0; u < cols; ++u)
                b.CreateStore(b.CreateLoad(fb.f32(), sums[u]), slot[u]);
            }
          };
          fb.for_loop(
              fb.c64(0), full, "jt", [&](Value *j0) { dot(j0, kCols); }, kCols);
          fb.for_loop(full, width, "jr", [&](Value *j) { dot(j, 1); });
          continue;
        }
        fb.for_loop(fb.c64(0), K, "k", [&](Value *kk) {
          Value *a = fb.load(*pr.a, b.CreateAdd(a_base, kk));
          Value *b_row = b.CreateAdd(b_base, b.CreateAdd(b.CreateMul(kk, N), n0));
          for (int i = 0; i < nb; ++i)
            update(i, b_row, a);
        });
      }
    });
  };

  if (g.route) {
    // Grouped: the used tiles of the routing table, each one expert's rows,
    // in parallel (a pair's row lies in one tile). A GEMM that adds its rows
    // into their tokens' (out_add) zeroes the output first (unless it adds
    // onto what an earlier GEMM wrote there) and walks its tiles in order:
    // two pairs of one token lie in different tiles.
    const RoutingNode *rt = g.route;
    if (g.out_add && !g.out_add_onto_written) {
      internal_check(C.dims.size() == 2) << "step " << g.name << ": an added output is [tokens, n]";
      fb.for_loop(fb.c64(0), b.CreateMul(fb.extent(C.dims[0]), fb.extent(C.dims[1])), "z",
                  [&](Value *i) { fb.store(C, i, fb.cf(0.0)); });
    }
    auto tiles = [&](Value *end, const std::string &name, const std::function<void(Value *)> &body) {
      if (g.out_add)
        fb.for_loop(fb.c64(0), end, name, body);
      else
        fb.parallel_for(fb.c64(0), end, name, body);
    };
    tiles(fb.route_scalar(rt, RoutingArray::num_tiles), "tile", [&](Value *tile) {
      Value *expert = fb.route_at(rt, RoutingArray::tile_expert, tile);
      Value *p0 = fb.route_at(rt, RoutingArray::tile_row_start, tile);
      Value *rows = fb.route_at(rt, RoutingArray::tile_rows, tile);
      fb.for_loop(fb.c64(0), rows, "lr", [&](Value *lr) {
        Value *p = b.CreateAdd(p0, lr);
        Value *r = fb.route_at(rt, RoutingArray::sorted_pair, p);
        fb.if_then(b.CreateICmpSGE(r, fb.c64(0)), [&] { row(p, r, expert); }); // padding rows: nothing to do
      });
    });
  } else {
    fb.parallel_for(fb.c64(0), fb.extent(g.m), "m", [&](Value *m) { row(m, m, fb.c64(0)); });
  }
}

// ------------------------------------------------------------ element-wise

void emit_pointwise(const KernelProgram &prog, const PointwiseStep &s, FunctionBuilder &fb) {
  auto &b = fb.b;
  const TensorDecl &out = prog.tensor(s.output);
  const Softmax *softmax = s.body.as<Softmax>();
  ExprEmitter em(prog, fb, s.name);
  std::vector<Var> loop_vars;
  for (const Var &v : s.vars)
    if (!softmax || !v.same_as(softmax->var))
      loop_vars.push_back(v);

  auto store_to = [&](const TensorDecl &t, Value *value) {
    std::vector<Value *> idx;
    for (const Var &v : s.vars)
      idx.push_back(em.vars.at(v.get()));
    fb.store(t, fb.offset(t, idx), value);
  };
  auto store = [&](Value *value) { store_to(out, value); };
  // Row sums (ExtraOutput::row_sum) add up in a register each over the last
  // index's loop and are stored after it, at the other indices.
  std::vector<Value *> sums(s.extra.size(), nullptr);
  auto inner = [&] {
    if (!softmax) {
      // Every value first, then the stores (merged siblings read no output
      // of the step, so the order only matters for what may be reused).
      std::vector<Value *> values{em.emit(s.body)};
      for (const ExtraOutput &e : s.extra)
        values.push_back(em.emit(e.value));
      store(values[0]);
      for (size_t o = 0; o < s.extra.size(); ++o) {
        if (s.extra[o].row_sum)
          b.CreateStore(b.CreateFAdd(b.CreateLoad(fb.f32(), sums[o]), values[o + 1]), sums[o]);
        else
          store_to(prog.tensor(s.extra[o].output), values[o + 1]);
      }
      return;
    }
    // softmax along v: the row's max, the sum of exponentials, then the
    // normalised values (max-subtracted, as the reference).
    Value *mx = fb.alloca_f32(1, "row_max"), *sum = fb.alloca_f32(1, "row_sum");
    b.CreateStore(llvm::ConstantFP::getInfinity(fb.f32(), /*Negative=*/true), mx);
    b.CreateStore(fb.cf(0.0), sum);
    Value *n = fb.extent(softmax->var.dim());
    auto loop = [&](const std::function<void(Value *)> &each) {
      fb.for_loop(fb.c64(0), n, "sm", [&](Value *v) {
        em.vars[softmax->var.get()] = v;
        each(em.emit(softmax->body));
      });
    };
    loop([&](Value *x) {
      b.CreateStore(b.CreateBinaryIntrinsic(llvm::Intrinsic::maxnum, b.CreateLoad(fb.f32(), mx), x), mx);
    });
    loop([&](Value *x) {
      Value *e = b.CreateUnaryIntrinsic(llvm::Intrinsic::exp, b.CreateFSub(x, b.CreateLoad(fb.f32(), mx)));
      b.CreateStore(b.CreateFAdd(b.CreateLoad(fb.f32(), sum), e), sum);
    });
    loop([&](Value *x) {
      Value *e = b.CreateUnaryIntrinsic(llvm::Intrinsic::exp, b.CreateFSub(x, b.CreateLoad(fb.f32(), mx)));
      store(b.CreateFDiv(e, b.CreateLoad(fb.f32(), sum)));
    });
  };
  // Nested loops, the first index outermost (row-major stores).
  std::function<void(size_t)> nest = [&](size_t i) {
    if (i == loop_vars.size()) {
      inner();
      return;
    }
    const bool last = i + 1 == loop_vars.size();
    for (size_t o = 0; last && o < s.extra.size(); ++o)
      if (s.extra[o].row_sum) {
        sums[o] = fb.alloca_f32(1, s.extra[o].output + "_sum");
        b.CreateStore(fb.cf(0.0), sums[o]);
      }
    auto body = [&](Value *v) {
      em.vars[loop_vars[i].get()] = v;
      nest(i + 1);
    };
    // The outermost index splits over threads: each value writes its own
    // outputs, unless a row sum runs along that very index (one index only).
    const bool split = i == 0 && !(last && std::any_of(s.extra.begin(), s.extra.end(),
                                                       [](const ExtraOutput &e) { return e.row_sum; }));
    if (split)
      fb.parallel_for(fb.c64(0), fb.extent(loop_vars[i].dim()), loop_vars[i].name(), body);
    else
      fb.for_loop(fb.c64(0), fb.extent(loop_vars[i].dim()), loop_vars[i].name(), body);
    for (size_t o = 0; last && o < s.extra.size(); ++o)
      if (s.extra[o].row_sum) {
        const TensorDecl &t = prog.tensor(s.extra[o].output);
        std::vector<Value *> idx;
        for (size_t v = 0; v + 1 < s.vars.size(); ++v)
          idx.push_back(em.vars.at(s.vars[v].get()));
        fb.store(t, fb.offset(t, idx), b.CreateLoad(fb.f32(), sums[o]));
      }
  };
  nest(0);
}

// ------------------------------------------------------------ copies into the padded order

// The source row of padded position p whose pair is r (r >= 0): the token
// r / k, the pair r, or p itself (a padded source).
Value *source_row(FunctionBuilder &fb, const RoutingNode *route, RowMap rows, Value *p, Value *r) {
  switch (rows) {
  case RowMap::gather_token:
    return fb.b.CreateSDiv(r, fb.c64(route->k));
  case RowMap::gather_pair:
    return r;
  case RowMap::direct:
    return p;
  }
  return nullptr;
}

// dst[p, :] = src[row(p), :] for p < padded_rows, zero on padding rows (a
// dst stored sorted: at the pair's sorted row, no padding rows).
void emit_gather(const KernelProgram &prog, const GatherStep &s, FunctionBuilder &fb) {
  auto &b = fb.b;
  const TensorDecl &src = prog.tensor(s.src), &dst = prog.tensor(s.dst);
  const Dim &cols = src.dims[1];
  user_check(!cols.is_dynamic()) << "step " << s.name << ": the row length " << cols.name() << " of '" << s.src
                                 << "' must be static for the CPU backend";
  const int64_t n = cols.extent(), row_bytes = n * dtype_bytes(dst.dtype);
  const bool same = src.dtype == dst.dtype;
  internal_check(src.outer_stride == 0 && dst.outer_stride == 0)
      << "step " << s.name << ": a gather copies whole rows of dense tensors";
  // A copy stored sorted (lowering/sorted_rows.h) has no padding rows.
  const bool sorted = dst.layout == RowLayout::sorted;
  Value *gsrc = fb.tensor(s.src), *gdst = fb.tensor(s.dst);
  fb.parallel_for(fb.c64(0), fb.route_scalar(s.route, RoutingArray::padded_rows), "p", [&](Value *p) { // a row each
    Value *r = fb.route_at(s.route, RoutingArray::sorted_pair, p);
    Value *is_pad = b.CreateICmpSLT(r, fb.c64(0));
    if (!sorted)
      fb.if_then(is_pad, [&] {
        Value *to = b.CreateGEP(b.getInt8Ty(), gdst, b.CreateMul(p, fb.c64(row_bytes)));
        b.CreateMemSet(to, b.getInt8(0), row_bytes, llvm::MaybeAlign(2));
      });
    fb.if_then(b.CreateNot(is_pad), [&] {
      // Pair r's row in dst's layout: p in the padded order, its sorted row.
      Value *first = fb.offset(dst, {r, fb.c64(0)});
      Value *to = b.CreateGEP(b.getInt8Ty(), gdst, b.CreateMul(first, fb.c64(dtype_bytes(dst.dtype))));
      Value *row = source_row(fb, s.route, s.rows, p, r);
      if (same) {
        Value *from = b.CreateGEP(b.getInt8Ty(), gsrc, b.CreateMul(row, fb.c64(row_bytes)));
        b.CreateMemCpy(to, llvm::MaybeAlign(2), from, llvm::MaybeAlign(2), row_bytes);
        return;
      }
      // An operand copy that changes the storage type (f32 -> bf16).
      fb.for_loop(fb.c64(0), fb.c64(n), "c", [&](Value *c) {
        fb.store(dst, b.CreateAdd(first, c), fb.load(src, b.CreateAdd(b.CreateMul(row, fb.c64(n)), c)));
      });
    });
  });
}

// ------------------------------------------------------------ transposes

void emit_transpose(const KernelProgram &prog, const TransposeStep &s, FunctionBuilder &fb) {
  auto &b = fb.b;
  const TensorDecl &src = prog.tensor(s.src), &dst = prog.tensor(s.dst);
  if (s.route) {
    // dst[c, p] = src[row(p), c] over every padded position p < max_padded_rows,
    // zero past padded_rows and on padding rows: the expert reduction's K loop
    // reads whole padded segments.
    internal_check(dst.layout == RowLayout::padded_t && src.dims.size() == 2)
        << "step " << s.name << ": a routed transpose writes a padded_t copy of a 2-D tensor";
    Value *cols = fb.extent(src.dims[1]), *stride = fb.max_padded_rows(s.route);
    Value *used = fb.route_scalar(s.route, RoutingArray::padded_rows);
    fb.for_loop(fb.c64(0), stride, "p", [&](Value *p) {
      Value *in_use = b.CreateICmpSLT(p, used);
      Value *r = b.CreateSelect(in_use, fb.route_at(s.route, RoutingArray::sorted_pair, p), fb.c64(-1));
      Value *is_pad = b.CreateICmpSLT(r, fb.c64(0));
      fb.if_then(is_pad, [&] {
        fb.for_loop(fb.c64(0), cols, "c",
                    [&](Value *c) { fb.store(dst, b.CreateAdd(b.CreateMul(c, stride), p), fb.cf(0.0)); });
      });
      fb.if_then(b.CreateNot(is_pad), [&] {
        Value *from = b.CreateMul(source_row(fb, s.route, s.rows, p, r), cols);
        fb.for_loop(fb.c64(0), cols, "c", [&](Value *c) {
          fb.store(dst, b.CreateAdd(b.CreateMul(c, stride), p), fb.load(src, b.CreateAdd(from, c)));
        });
      });
    });
    return;
  }
  // Dense: [..., R, C] -> [..., C, R], the leading dims kept.
  const size_t n = src.dims.size();
  internal_check(n >= 2 && dst.dims.size() == n && dst.dims[n - 2].same_as(src.dims[n - 1]) &&
                 dst.dims[n - 1].same_as(src.dims[n - 2]))
      << "step " << s.name << ": '" << s.dst << "' is not the transpose of '" << s.src << "'";
  Value *lead = fb.c64(1);
  for (size_t i = 0; i + 2 < n; ++i)
    lead = b.CreateMul(lead, fb.extent(src.dims[i]));
  Value *R = fb.extent(src.dims[n - 2]), *C = fb.extent(src.dims[n - 1]);
  fb.for_loop(fb.c64(0), lead, "l", [&](Value *l) {
    Value *base = b.CreateMul(l, b.CreateMul(R, C));
    fb.for_loop(fb.c64(0), R, "r", [&](Value *r) {
      fb.for_loop(fb.c64(0), C, "c", [&](Value *c) {
        Value *from = b.CreateAdd(base, b.CreateAdd(b.CreateMul(r, C), c));
        Value *to = b.CreateAdd(base, b.CreateAdd(b.CreateMul(c, R), r));
        fb.store(dst, to, fb.load(src, from));
      });
    });
  });
}

void check_dtypes(const KernelProgram &prog, const std::string &step) {
  for (const TensorDecl &t : prog.tensors)
    user_check(t.dtype != DType::f16) << "step " << step << ": tensor '" << t.name
                                      << "' is f16, which the CPU backend does not support yet; use bf16 or f32";
}

} // namespace

LlvmModule generate_llvm(const KernelProgram &program) {
  LlvmModule m;
  m.context = std::make_unique<llvm::LLVMContext>();
  m.module = std::make_unique<llvm::Module>("moeforge_" + program.schedule_name, *m.context);
  for (const Step &step : program.steps) {
    if (std::holds_alternative<RoutingStep>(step) || std::holds_alternative<AttentionStep>(step))
      continue; // routing (runtime/routing_host.h) and attention (CpuLayer::attend) run on the host
    CpuKernel k;
    k.step = step_name(step);
    k.symbol = symbol_name(k.step);
    check_dtypes(program, k.step);
    FunctionBuilder fb(program, *m.module, k);
    if (auto *g = std::get_if<GemmStep>(&step))
      emit_gemm(program, *g, fb);
    else if (auto *p = std::get_if<PointwiseStep>(&step))
      emit_pointwise(program, *p, fb);
    else if (auto *t = std::get_if<TransposeStep>(&step))
      emit_transpose(program, *t, fb);
    else
      emit_gather(program, std::get<GatherStep>(step), fb);
    fb.finish();
    std::string msg;
    llvm::raw_string_ostream os(msg);
    internal_check(!llvm::verifyFunction(*fb.function(), &os))
        << "step " << k.step << ": the generated LLVM function is invalid: " << os.str();
    m.kernels.push_back(std::move(k));
  }
  return m;
}

} // namespace moeforge::cpu
