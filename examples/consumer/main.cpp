// A program built against an installed moeforge (see CMakeLists.txt): a small
// GeLU-MLP MoE layer written in the algebra, compiled under a schedule preset
// for the LLVM CPU backend (where moeforge was built with it) and checked
// against the Eigen reference. Prints the largest error; exits 1 when it is
// beyond the tolerance, 2 on an error.
#include <moeforge/moeforge.h>

#include <cmath>
#include <cstdint>
#include <exception>
#include <iostream>
#include <memory>
#include <random>
#include <string>

using namespace moeforge;

int main() {
  try {
    const int64_t tokens = 96, d = 64, f = 128, experts = 8;
    const int k = 2;

    // The layer: router GEMM, softmax, top-k routing, two expert contractions
    // with a GeLU between them, and the gated combine back to the tokens.
    Dim T = Dim::dynamic("T"), D("D", d), F("F", f), E("E", experts);
    Var t("t", T), e("e", E), i("i", D), j("j", F);
    Input x("x", {T, D});
    Param wr("wr", {D, E}), w1("w1", {E, D, F}), w2("w2", {E, F, D});

    Func logits("logits", DType::f32), probs("probs", DType::f32);
    logits(t, e) = sum(i, x(t, i) * wr(i, e));
    probs(t, e) = softmax(e, logits(t, e));
    Route route = top_k(probs, e, k);
    Var r = route.pair();

    Func h("h"), o("o"), y("y");
    h(r, j) = gelu(sum(i, x(route.token(r), i) * w1(route.expert(r), i, j)));
    o(r, i) = sum(j, h(r, j) * w2(route.expert(r), j, i));
    y(t, i) = combine(route, t, route.gate(r) * o(r, i));
    Pipeline layer({y});
    std::cout << layer;

    // Inputs: one tensor per Input and Param (bf16-exact values, so every
    // backend reads the same numbers), weights scaled by their fan-in.
    std::mt19937_64 rng(2024);
    const double sd = 1.0 / std::sqrt(double(d)), sf = 1.0 / std::sqrt(double(f));
    TensorMap inputs;
    inputs["x"] = random_tensor({tokens, d}, rng);
    inputs["wr"] = random_tensor({d, experts}, rng, -sd, sd);
    inputs["w1"] = random_tensor({experts, d, f}, rng, -sd, sd);
    inputs["w2"] = random_tensor({experts, f, d}, rng, -sf, sf);

    // The oracle: the Eigen reference in float64.
    EvalResult ref = evaluate(layer, inputs, Precision::f64);

    // How it is computed: ScatterMoE's schedule (gather and scatter inside the
    // GEMMs, the gate in the last GEMM's epilogue).
    Schedule schedule = scattermoe();
    std::string backend;
    HostTensor got;
#ifdef MOEFORGE_HAVE_CPU_BACKEND
    // Any backend this program links, by name ("cpu", or "cuda" where
    // moeforge::cuda is linked and a GPU is present): one interface.
    std::unique_ptr<Backend> cpu = make_backend("cpu");
    std::unique_ptr<Layer> compiled = cpu->layer(layer, schedule, tokens);
    compiled->upload(inputs);
    compiled->run();
    got = compiled->download("y");
    backend = cpu->description() + ", schedule '" + schedule.name() + "'";
#else
    // Built without the CPU backend: the reference in float32 against float64.
    (void)schedule;
    got = evaluate(layer, inputs, Precision::f32)["y"];
    backend = "reference (f32; moeforge was built without the CPU backend)";
#endif

    const double tolerance = 1e-2;
    double err = max_normalized_error(got, ref["y"]);
    bool pass = err <= tolerance;
    std::cout << "backend   " << backend << "\n"
              << "check     y max |ours - ref| / max |ref| = " << err << " (tolerance " << tolerance
              << "): " << (pass ? "PASS" : "FAIL") << "\n";
    return pass ? 0 : 1;
  } catch (const std::exception &ex) {
    std::cerr << "consumer: " << ex.what() << "\n";
    return 2;
  }
}
