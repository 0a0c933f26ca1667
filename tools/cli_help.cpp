#include "tools/cli_help.h"

#include <map>

namespace moeforge {

namespace {

// The shape flags every command but list takes (ExampleShape's defaults).
#define MOEFORGE_SHAPE_FLAGS                                                                                           \
  "  --tokens N      tokens T (default 256)\n"                                                                         \
  "  --experts E     experts (default 8)\n"                                                                            \
  "  --topk K        experts per token (default 2)\n"                                                                  \
  "  --d D           model width (default 64)\n"                                                                       \
  "  --f F           expert (or MLP) hidden width (default 128)\n"

#define MOEFORGE_CAPACITY_FLAG                                                                                         \
  "  --capacity F    a fixed expert capacity with dropping (GShard): each expert takes at most\n"                      \
  "                  ceil(F * T * k / E) pairs, first choices first; the rest are dropped and\n"                       \
  "                  counted (default: dropless)\n"

#define MOEFORGE_SCHEDULE_FLAG                                                                                         \
  "  --schedule S    a preset (megablocks, scattermoe), a schedule file, default (tuned_wide's\n"                      \
  "                  choices made for this layer) or auto (run, train and tune: what `moeforge\n"                      \
  "                  tune` cached for this layer on this GPU, else default);\n"                                        \
  "                  default auto (emit: megablocks)\n"

const std::map<std::string, const char *> kHelp = {
    {"list", "moeforge list\n"
             "  Names every example layer with a line on what it computes.\n"},
    {"print", "moeforge print <example> [shape flags]\n"
              "  Prints the example's algebra: its Dims, Inputs, Params and every definition.\n\n" MOEFORGE_SHAPE_FLAGS
              "\nexamples:\n"
              "  moeforge print swiglu_moe\n"
              "  moeforge print moe_mlp --experts 64 --topk 8\n"},
    {"run",
     "moeforge run <example> [shape flags] [--seed S] [--precision f32|f64] [--schedule S]\n"
     "                       [--capacity F] [--backend reference|cpu|cuda] [--ranks N] [--check | --check=full]\n"
     "  Runs the example's forward on random inputs and prints each output's shape,\n"
     "  checksum and time; --check compares every output with the float64 reference.\n\n" MOEFORGE_SHAPE_FLAGS
     "  --seed S        the inputs' random seed (default 1)\n"
     "  --precision P   the reference's arithmetic, f32 or f64 (default f32; f64 runs the reference "
     "only)\n" MOEFORGE_SCHEDULE_FLAG MOEFORGE_CAPACITY_FLAG
     "  --backend B     reference, cpu or cuda (default: the GPU when there is one, else the CPU\n"
     "                  backend, else the reference)\n"
     "  --ranks N       expert parallelism: the experts spread over GPUs 0..N-1 (E / N each), each\n"
     "                  GPU on --tokens / N tokens; prints each rank's rows and time\n"
     "  --check         compare with the float64 reference (tolerance 1e-2) on 64 tokens drawn at\n"
     "                  random, with their routing, where each token's rows depend on it alone\n"
     "  --check=full    compare every token\n"
     "\nexamples:\n"
     "  moeforge run moe_mlp --check\n"
     "  moeforge run moe_mlp --capacity 1.0 --check\n"
     "  moeforge run swiglu_moe --tokens 4096 --d 1024 --f 2048 --schedule scattermoe --backend cuda\n"},
    {"train", "moeforge train <example> [shape flags] [--seed S] [--schedule S] [--capacity F] [--recompute]\n"
              "                         [--aux] [--backend cpu|cuda] [--ranks N] [--check]\n"
              "  One training step (forward, then backward with a random upstream gradient) on a\n"
              "  compiled backend: times, what the forward keeps for the backward, and with --check\n"
              "  every output and gradient against the float64 reference of grad().\n\n" MOEFORGE_SHAPE_FLAGS
              "  --k K           the same as --topk\n"
              "  --seed S        the inputs' random seed (default 1)\n" MOEFORGE_SCHEDULE_FLAG MOEFORGE_CAPACITY_FLAG
              "  --recompute     the backward recomputes activations instead of keeping them\n"
              "  --aux           with the example's auxiliary losses (load balancing, z-loss) as outputs\n"
              "  --backend B     cpu or cuda (default: the GPU when there is one, else the CPU backend)\n"
              "  --ranks N       expert parallelism: the experts spread over GPUs 0..N-1 (E / N each),\n"
              "                  each GPU training on --tokens / N tokens, rows moved over NCCL; prints\n"
              "                  each rank's rows and times (default 1: one GPU, the unsplit layer)\n"
              "  --check         compare with the float64 reference (tolerance 2e-2, or what one bf16\n"
              "                  rounding of every input moves a value by, where that is more)\n"
              "\nexamples:\n"
              "  moeforge train moe_mlp --check\n"
              "  moeforge train swiglu_moe --aux --recompute --check\n"
              "  moeforge train swiglu_moe --tokens 4096 --d 1024 --f 2048 --ranks 2 --check\n"},
    {"emit",
     "moeforge emit <example> [shape flags] [--schedule S] --ir | --passes | --cuda | --llvm | --plan |\n"
     "                        --memory [--train]\n"
     "  Prints what the layer compiles to: the lowered kernel program (--ir), the program after\n"
     "  each lowering pass (--passes), the generated CUDA C++ (--cuda), the CPU backend's LLVM IR\n"
     "  (--llvm), each GEMM's plan (--plan), or the memory it takes at --tokens (--memory: what a\n"
     "  forward keeps for its backward, and each entry point's workspace with the tensors at its\n"
     "  fullest step); --train: the training step's (with --ir, --cuda, --plan or --memory).\n\n" MOEFORGE_SHAPE_FLAGS
         MOEFORGE_SCHEDULE_FLAG "\nexamples:\n"
     "  moeforge emit moe_mlp --ir\n"
     "  moeforge emit swiglu_moe --schedule scattermoe --plan --train\n"
     "  moeforge emit swiglu_moe --tokens 16384 --d 2048 --f 768 --experts 128 --topk 8 --schedule default\n"
     "                --memory --train\n"},
    {"tune",
     "moeforge tune <example> [shape flags] [--schedule S] [--train] [--budget-seconds N] [--seed S]\n"
     "  Searches tiles, stages, persistent blocks, TMA stores, clusters and raster bands around\n"
     "  the schedule given, timing whole layers on the GPU within the budget; prints the best as a schedule\n"
     "  file and keeps it in the tuned-schedule cache.\n\n" MOEFORGE_SHAPE_FLAGS MOEFORGE_SCHEDULE_FLAG
     "  --train         tune the training step (forward and backward), not the forward\n"
     "  --budget-seconds N  how long to search, 1 to 86400 (default 120)\n"
     "  --seed S        the inputs' random seed (default 1)\n"
     "\nexamples:\n"
     "  moeforge tune moe_mlp --tokens 16384 --d 1024 --f 4096 --experts 64 --topk 1 > mbpaper.sched\n"
     "  moeforge run moe_mlp --tokens 16384 --d 1024 --f 4096 --experts 64 --topk 1 --schedule mbpaper.sched\n"},
};

#undef MOEFORGE_SHAPE_FLAGS
#undef MOEFORGE_SCHEDULE_FLAG

} // namespace

const char *command_help(const std::string &command) {
  auto it = kHelp.find(command);
  return it == kHelp.end() ? nullptr : it->second;
}

} // namespace moeforge
