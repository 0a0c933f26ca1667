// An MoE layer with its experts spread over ranks (one GPU each), trained
// with the same compiled kernels as on one GPU: the two sides of
// split_expert_parallel (lowering/expert_parallel_split.h) compiled as
// training programs, their rows moved between the ranks over NCCL
// (expert_exchange.h).
//
// A step on one rank, in stream order:
//   forward   token side up to the rows it sends (router, top-k, x_rows);
//             the per-expert counts cross (one host synchronisation: NCCL
//             takes its sizes from the host); x_rows go to their experts'
//             ranks; the expert side runs over the rows received (its
//             token count set to them, in memory made for the most a rank
//             can receive); its rows come back; the token side combines.
//   backward  token side up to the gradients of the returned rows
//             (gate * dy); they go to the experts; the expert side's
//             backward (its weights' gradients, the received rows'); those
//             come back; the token side's backward ends (d_x, the router).
// The backward reuses the forward's sizes: no synchronisation.
//
// Each rank holds the token side's Params whole (the router: its gradient is
// the rank's tokens' share, which a data-parallel all-reduce sums, as for any
// replicated weight) and its E / R experts' Params.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backends/cuda/parallel/expert_exchange.h"
#include "backends/cuda/runtime/layer.h"
#include "backends/cuda/runtime/training_layer.h"
#include "lowering/expert_parallel_split.h"

namespace moeforge::cuda {

struct CompiledExpertParallel {
  ExpertParallelSplit split;
  CompiledTraining token, experts;
  // Token forward steps [0, dispatch_end) write the rows that go out; the
  // rest read the rows that come back.
  size_t dispatch_end = 0;
  // Token backward steps [forward_steps, backward_split) do not need the
  // dispatched rows' gradients (the rest read them); of those, [forward_steps,
  // returned_gradients_end) make the returned rows' gradients (gate * dy) and
  // the others (the router's backward) can run while those rows travel.
  size_t backward_split = 0;
  size_t returned_gradients_end = 0;
  // Expert backward steps [forward_steps, row_gradients_end) make the
  // received rows' gradients; the rest (the weight gradients) can run while
  // those rows travel back.
  size_t row_gradients_end = 0;
  // Schedule::exchange_chunks: the forward's rows cross in `chunks` rounds,
  // each a group of every rank's experts (chunk_experts). Expert forward
  // steps [0, chunk_begin) do not read the received rows (the route over
  // them, from the counts alone); [chunk_begin, chunk_end) are routed GEMMs
  // that run once per round over that group's tiles (GemmStep::windowed);
  // the rest run once every round has arrived. With chunk_end the forward's
  // end, each round's results go back as soon as its GEMMs are done.
  int chunks = 1;
  size_t chunk_begin = 0, chunk_end = 0;
  bool return_per_chunk = false;
  CompileResult row_kernels; // device/expert_parallel.cuh
};

// Splits `pipeline` for the schedule's expert_parallel(ranks) and compiles
// both sides' training programs under the rest of it (the expert side keeps
// the Func names, so the schedule's choices for the expert GEMMs apply
// there). Needs no GPU.
CompiledExpertParallel compile_expert_parallel(const Pipeline &pipeline, const Schedule &schedule,
                                               const std::string &arch = "sm_90a");

class ExpertParallelLayer {
public:
  // Rank comm.rank() of comm.size() (the split's ranks), for `tokens` tokens
  // on every rank. The expert side holds memory for the most rows a rank can
  // receive: every rank's every pair. `compiled` and `comm` must outlive it.
  ExpertParallelLayer(const Device &device, const CompiledExpertParallel &compiled, const Communicator &comm,
                      int64_t tokens);

  // This rank's token Inputs ([tokens, ...]) and every Param: the token
  // side's whole; the experts' whole ([E, ...], this rank's rows taken) or
  // this rank's own ([E / R, ...]).
  void upload(const TensorMap &inputs);
  // Fills Input or Param `name` (an upstream gradient by its seed's name,
  // "d_y") with `pattern` repeated (benchmarks: realistic values without
  // gigabytes of host random numbers); an expert Param on its E / R rows.
  void upload_repeated(const std::string &name, const HostTensor &pattern);
  // The upstream gradient of forward output `output` for this rank's tokens.
  void upload_upstream_gradient(const std::string &output, const HostTensor &grad);
  // NaN over every intermediate and output of both sides (tests).
  void poison();
  // A collective: every rank calls it. Synchronises `stream` once.
  void forward(const Stream &stream);
  // A collective, after forward(); no host synchronisation. With overlap
  // (the default) the rows move on a second stream of the layer's own: the
  // gradients of the returned rows go out while the router's backward runs,
  // and the received rows' gradients come back while the experts' weight
  // gradients compute; `stream` waits for them where they are read.
  void backward(const Stream &stream);
  void overlap(bool on) { overlap_ = on; }

  // A token-side forward output ("y"). Synchronises.
  HostTensor output(const std::string &name) const;
  // The gradient of Input or Param `of`: a token Input's for this rank's
  // tokens, the router's share of this rank's tokens, an expert Param's for
  // this rank's experts ([E / R, ...]). Synchronises.
  HostTensor gradient(const std::string &of) const;
  // With timing on, forward() and backward() record an event between their
  // phases (token side, counts, dispatch, experts, return, ...), and
  // phase_ms() gives each phase's milliseconds of the last step after the
  // stream has synchronised: where a step's time goes, the exchange's share.
  void time_phases(bool on) { timing_ = on; }
  std::vector<std::pair<std::string, double>> phase_ms() const;
  // Rows this rank's experts computed in the last forward.
  int64_t received_rows() const { return received_; }
  const ExchangeSizes &sizes() const { return sizes_; }
  const CudaLayer &token_layer() const { return token_; }
  const CudaLayer &expert_layer() const { return experts_; }

private:
  // One tensor's rows from the token side (pair order, or the routing's
  // padded order) to the expert side's received rows on their experts'
  // ranks, and back: packed to the exchange's order and moved over NCCL.
  void send_to_experts(const std::string &token_tensor, const std::string &expert_tensor, int64_t width,
                       const Stream &stream);
  // The pack half of send_to_experts: one tensor's rows into `to` in the
  // exchange's order; returns the bytes of a row.
  size_t pack_rows(const std::string &token_tensor, const std::string &expert_tensor, int64_t width, CUdeviceptr to,
                   const Stream &stream);
  void bring_back(const std::string &expert_tensor, const std::string &token_tensor, int64_t width,
                  const Stream &stream);
  size_t crossing_bytes(const std::string &token_tensor, const std::string &expert_tensor, int64_t width) const;
  // mf_ep_pack or mf_ep_unpack over every pair's row.
  void launch_rows(const Kernel &kernel, CUdeviceptr from, CUdeviceptr to, size_t bytes, bool padded,
                   const Stream &stream);
  bool is_expert_param(const std::string &name) const;
  // Ends phase `name` (timing on): an event on `stream`.
  void mark(const char *name, const Stream &stream);

  const CompiledExpertParallel &compiled_;
  const Communicator &comm_;
  int64_t tokens_, pairs_;
  CudaLayer token_, experts_;
  ExpertExchange exchange_;
  Module module_;
  Kernel pack_, unpack_, select_;
  // The forward in exchange_chunks rounds: rows out and experts' GEMMs
  // round by round, each round's rows back as soon as they are made.
  void forward_in_chunks(const Stream &stream);
  // The selector of the received rows' local experts, from the counts.
  void select_experts(const Stream &stream);
  // The windows of the expert route's tiles, one per round: the tiles of
  // the round's experts, from the counts received.
  std::vector<std::vector<int32_t>> chunk_windows() const;
  // Every dispatched (returned) crossing's rows in the exchange's order
  // (the first in out_rows_ / back_rows_, the others in rows_of_); the
  // backward moves one tensor at a time through out_rows_ and back_rows_.
  CUdeviceptr packed_rows(size_t crossing);
  CUdeviceptr returned_rows(size_t crossing);

  DeviceBuffer out_rows_, back_rows_; // the exchange's order, widest row
  std::vector<DeviceBuffer> rows_of_; // more crossings' rows in a chunked forward
  DeviceBuffer segment_end_;          // int64 [R * E/R]
  ExchangeSizes sizes_;
  int64_t received_ = 0;
  bool forward_ran_ = false;
  bool timing_ = false;
  bool overlap_ = true;
  Stream moves_{
      Stream::HighPriority{}}; // the row moves beside the GEMMs: the backward's with overlap, the forward's rounds
  Event rows_out_ready_, rows_out_, rows_back_ready_, rows_back_; // the two streams' hand-offs
  std::vector<Event> round_in_, round_done_;                      // a chunked forward's, per round
  std::vector<std::pair<std::string, Event>> marks_;              // the step's phase ends, the first its start
  int sm_count_;
};

} // namespace moeforge::cuda
