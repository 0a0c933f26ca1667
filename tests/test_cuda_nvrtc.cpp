// NVRTC compilation without a GPU: the routing kernels compile for sm_90a
// (and the host sizes their chunks and picks their top-k kernel), ptxas'
// report parses, compile errors quote NVRTC, and the disk cache hits,
// and survives corruption.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "backends/cuda/codegen/compile_cache.h"
#include "backends/cuda/codegen/nvrtc_compiler.h"
#include "backends/cuda/codegen/ptxas_report.h"
#include "backends/cuda/codegen/tile_library.h"
#include "backends/cuda/runtime/routing_kernels.h"

using namespace moeforge;
using namespace moeforge::cuda;
namespace fs = std::filesystem;

namespace {

// A fresh directory, removed at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "moeforge-test-XXXXXX").string();
    path = ::mkdtemp(pattern.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// Sets an environment variable for the life of the object, then restores it.
struct ScopedEnv {
  std::string name;
  std::string old;
  bool had;
  ScopedEnv(std::string n, const std::string &value) : name(std::move(n)) {
    const char *v = std::getenv(name.c_str());
    had = v != nullptr;
    old = v ? v : "";
    ::setenv(name.c_str(), value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (had)
      ::setenv(name.c_str(), old.c_str(), 1);
    else
      ::unsetenv(name.c_str());
  }
};

const char *kSmallKernel = R"(
extern "C" __global__ void scale(float *x, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= a;
}
)";

} // namespace

TEST_CASE("cuda: NVRTC compiles the routing kernels for sm_90a without spills") {
  CompileOptions options = routing_compile_options("sm_90a");
  options.use_cache = false; // exercise NVRTC itself
  CompileResult r = compile_cuda(routing_kernels_source(), "routing_kernels.cu", options);
  MESSAGE("NVRTC " << nvrtc_version() << ", headers from '" << cuda_include_directory() << "'");
  CHECK_FALSE(r.from_cache);
  REQUIRE(r.cubin.size() > 4);
  CHECK(std::string(r.cubin.data(), 4) == "\x7f"
                                          "ELF");
  for (const std::string &name : routing_kernel_names()) {
    const ResourceReport *rep = r.resources_of(name);
    REQUIRE_MESSAGE(rep != nullptr, "ptxas reported nothing for " << name << "; log:\n" << r.log);
    MESSAGE(to_string(*rep));
    CHECK(rep->spill_store_bytes == 0);
    CHECK(rep->spill_load_bytes == 0);
    CHECK(rep->stack_frame_bytes == 0);
    CHECK(rep->registers > 0);
    // A block's threads (512 for the top-k and one-block kernels) must fit the 64K-register file.
    const bool topk = name.rfind("moe_topk_e", 0) == 0 || name.rfind("moe_one_block_e", 0) == 0;
    CHECK(rep->registers * (topk ? kRoutingTopkThreads : kRoutingThreads) <= 65536);
  }
  // The per-expert counters live in shared memory, as designed: one row per
  // chunk in the top-k and histogram kernels, one per warp in the scatter.
  for (int experts : {1, 64, 256})
    CHECK(r.resources_of(routing_topk_kernel(experts))->shared_bytes >= kMaxRoutingExperts * 4);
  CHECK(r.resources_of("moe_chunk_histogram")->shared_bytes >= kMaxRoutingExperts * 4);
  CHECK(r.resources_of("moe_scan_scatter")->shared_bytes >= kRoutingThreads / 32 * kMaxRoutingExperts * 4);
  // The one-block kernels keep the scatter's tables and every pair's expert
  // in shared memory, within the 48 KiB a block has without opting in.
  for (const char *name : {"moe_one_block_e32", "moe_one_block_e256"}) {
    CAPTURE(name);
    const int shared = r.resources_of(name)->shared_bytes;
    CHECK(shared >= kRoutingThreads / 32 * kMaxRoutingExperts * 4 + kRoutingOneBlockPairs * 8);
    CHECK(shared <= 48 * 1024);
  }
}

TEST_CASE("cuda: a few tokens route in one block, more in the top-k and scatter kernels") {
  struct Case {
    RoutingShape shape;
    bool one_block;
  };
  for (const Case &c : {
           Case{{1, 128, 8, 128}, true},    // qwen3moe decoding one token
           Case{{16, 128, 8, 128}, true},   // a warp per token: 16 in a block of 512 threads
           Case{{17, 128, 8, 128}, false},  //
           Case{{16, 8, 2, 128}, true},     // mixtral
           Case{{64, 8, 2, 128}, false},    //
           Case{{16, 256, 8, 64}, true},    //
           Case{{16, 256, 256, 64}, false}, // 4096 pairs: more than the shared experts hold
           Case{{0, 8, 2, 64}, true},       // no tokens: the tables are still written
           Case{{8192, 8, 2, 128}, false},  // training sizes
       }) {
    CAPTURE(c.shape.to_string());
    CHECK(routing_in_one_block(c.shape) == c.one_block);
  }
  RoutingShape capped{4, 8, 2, 64};
  capped.capacity = 1;
  CHECK_FALSE(routing_in_one_block(capped));
  RoutingShape grouped{4, 64, 4, 64};
  grouped.groups = 8;
  grouped.top_groups = 2;
  CHECK_FALSE(routing_in_one_block(grouped));
}

TEST_CASE("cuda: the tile library (device/tiles.cuh and its parts) compiles on its own for sm_90a") {
  // A translation unit of the library alone (the wgmma wrappers included),
  // as NVRTC receives it: what a generated kernel includes must compile
  // before any kernel uses it; templates are checked as far as they can be
  // without arguments. The routing kernels (device/routing_kernels.cuh) are
  // compiled whole above.
  CompileOptions options;
  options.arch = "sm_90a";
  options.use_cache = false;
  options.headers = moeforge::tile_library_headers();
  // The whole library, and each part alone with what it includes: a part
  // names every part it builds on.
  for (const NamedHeader &h : options.headers) {
    INFO(h.name);
    const std::string unit = "#include \"" + h.name + "\"\n";
    CompileResult r = compile_cuda(unit, "tiles_alone.cu", options);
    CHECK_FALSE(r.from_cache);
    REQUIRE(r.cubin.size() > 4);
    CHECK(std::string(r.cubin.data(), 4) == "\x7f"
                                            "ELF");
    // The wrappers went in where tiles/wgmma.cuh marks their place.
    CHECK(h.content.find("// MOEFORGE_WGMMA_INSTANCES") == std::string::npos);
    CHECK(h.content.find("// MOEFORGE_WGMMA_E4M3_INSTANCES") == std::string::npos);
    if (h.name == "moeforge_tiles_wgmma.cuh")
      CHECK(h.content.find("template <> struct Wgmma<256, 1, 0>") != std::string::npos);
    if (h.name == "moeforge_tiles_fp8.cuh")
      CHECK(h.content.find("template <> struct WgmmaE4m3<128>") != std::string::npos);
  }
  // The umbrella includes every part.
  for (const NamedHeader &h : options.headers)
    if (h.name != moeforge::kTileLibraryName)
      CHECK(options.headers.front().content.find("#include \"" + h.name + "\"") != std::string::npos);
}

TEST_CASE("cuda: routing chunks fill the GPU, and each E has its top-k kernel") {
  struct Case {
    RoutingShape shape;
    int64_t chunk, chunks;
  };
  for (const Case &c : {
           Case{{16384, 64, 1, 128}, 128, 128},  // mbpaper: P = 16384
           Case{{8192, 8, 2, 128}, 128, 128},    // mixtral-like: P = 16384
           Case{{16384, 64, 8, 128}, 1024, 128}, // fine64: P = 131072
           Case{{5000, 256, 8, 64}, 640, 63},    // E = 256: at most 64 chunks (the count table stays small)
           Case{{999, 128, 3, 64}, 128, 24},     // P = 2997: the chunk does not divide P
           Case{{1, 8, 2, 64}, 128, 1},          // P < one chunk
           Case{{0, 8, 2, 64}, 128, 0},          // no pairs, no chunks
       }) {
    CAPTURE(c.shape.to_string());
    const int64_t chunk = routing_chunk_pairs(c.shape);
    CHECK(chunk == c.chunk);
    CHECK((c.shape.pairs() + chunk - 1) / chunk == c.chunks);
  }
  // Any shape: whole quanta, at most kRoutingTargetChunks chunks, and not so
  // large that one fewer quantum would still keep within the target.
  for (int64_t tokens : {1, 77, 4096, 100000, 1000003})
    for (int experts : {1, 7, 64, 200, 256}) {
      RoutingShape s{tokens, experts, std::min(experts, 5), 128};
      CAPTURE(s.to_string());
      const int64_t chunk = routing_chunk_pairs(s),
                    target = std::min(kRoutingTargetChunks, kRoutingMaxChunkCounts / experts);
      CHECK(chunk % kRoutingChunkQuantum == 0);
      CHECK(chunk >= kRoutingChunkQuantum);
      CHECK((s.pairs() + chunk - 1) / chunk <= target);
      if (chunk > kRoutingChunkQuantum)
        CHECK((s.pairs() + chunk - kRoutingChunkQuantum - 1) / (chunk - kRoutingChunkQuantum) > target);
    }
  // The top-k counts the chunk's pairs itself when a block's share is light.
  CHECK(routing_fuses_counts({16384, 64, 1, 128}));  // 128 tokens a chunk: 1 pass of 128, k = 1
  CHECK(routing_fuses_counts({8192, 8, 2, 128}));    // 64 tokens a chunk: 1 pass, k = 2
  CHECK(routing_fuses_counts({16384, 64, 8, 128}));  // 128 tokens: 1 pass, k = 8
  CHECK(routing_fuses_counts({20000, 32, 1, 128}));  // 256 tokens: 2 passes, k = 1: 2 rounds
  CHECK(!routing_fuses_counts({40000, 64, 8, 128})); // 320 tokens: 3 passes, k = 8
  CHECK(!routing_fuses_counts({5000, 256, 8, 64}));  // 80 tokens, 16 a pass, k = 8
  CHECK(!routing_fuses_counts({40000, 64, 3, 128})); // 343 tokens: 3 passes, k = 3: 9 rounds
  CHECK(routing_topk_tokens_per_pass(64) == kRoutingTopkThreads / 4);
  CHECK(routing_topk_tokens_per_pass(256) == kRoutingTopkThreads / 32);
  CHECK(routing_topk_kernel(1) == "moe_topk_e32");
  CHECK(routing_topk_kernel(32) == "moe_topk_e32");
  CHECK(routing_topk_kernel(33) == "moe_topk_e64");
  CHECK(routing_topk_kernel(64) == "moe_topk_e64");
  CHECK(routing_topk_kernel(65) == "moe_topk_e128");
  CHECK(routing_topk_kernel(129) == "moe_topk_e256");
  CHECK(routing_topk_kernel(kMaxRoutingExperts) == "moe_topk_e256");
}

TEST_CASE("cuda: the ptxas report parser reads every field") {
  const std::string log = R"(ptxas info    : 40 bytes gmem, 64 bytes cmem[3]
ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due to program dependence on compiler-inserted WG.AR in divergent path in the function 'plain'
ptxas info    : Compiling entry function '_Z2k2Pfi' for 'sm_90a'
ptxas info    : Function properties for _Z2k2Pfi
ptxas         .     616 bytes stack frame, 912 bytes spill stores, 992 bytes spill loads
ptxas info    : Used 24 registers, used 1 barriers, 256 bytes smem, 360 bytes cmem[0], 8 bytes cmem[2]
ptxas info    : Compile time = 30.703 ms
ptxas info    : Function properties for helper
ptxas         .     64 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Compiling entry function 'plain' for 'sm_90a'
ptxas info    : Function properties for plain
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers
)";
  std::vector<ResourceReport> reps = parse_ptxas_report(log);
  REQUIRE(reps.size() == 2);
  const ResourceReport &a = reps[0];
  CHECK(a.kernel == "_Z2k2Pfi");
  CHECK(a.demangled == "k2(float*, int)");
  CHECK(a.registers == 24);
  CHECK(a.barriers == 1);
  CHECK(a.stack_frame_bytes == 616);
  CHECK(a.spill_store_bytes == 912);
  CHECK(a.spill_load_bytes == 992);
  CHECK(a.shared_bytes == 256);
  CHECK(a.constant_bytes == 368);
  // A device function's properties do not leak into the next kernel.
  const ResourceReport &b = reps[1];
  CHECK(b.kernel == "plain");
  CHECK(b.registers == 10);
  CHECK(b.spill_store_bytes == 0);
  CHECK(b.stack_frame_bytes == 0);
  CHECK(b.wgmma_serialized);
  CHECK(!a.wgmma_serialized);
  CHECK(find_report(reps, "k2(float*, int)") == &reps[0]);
  CHECK(find_report(reps, "absent") == nullptr);
  CHECK(parse_ptxas_report("").empty());
}

TEST_CASE("cuda: a compile error quotes the NVRTC log and the failing line") {
  const std::string source = "extern \"C\" __global__ void broken(float *x) {\n"
                             "  x[0] = undefined_thing;\n"
                             "}\n";
  CompileOptions options;
  options.use_cache = false;
  try {
    compile_cuda(source, "broken.cu", options);
    FAIL("a broken source compiled");
  } catch (const CompileError &e) {
    std::string what = e.what();
    MESSAGE(what);
    // NVRTC's own line, e.g. broken.cu(2): error: identifier "undefined_thing" is undefined
    CHECK(what.find("broken.cu(2): error: identifier \"undefined_thing\" is undefined") != std::string::npos);
    CHECK(what.find("2 |   x[0] = undefined_thing;") != std::string::npos);
    CHECK(what.find("NVRTC could not compile 'broken.cu' for sm_90a") == 0);
    CHECK(e.log().find("undefined_thing") != std::string::npos);
  }
}

TEST_CASE("cuda: a compile error in an in-memory header quotes the header's line") {
  CompileOptions options;
  options.use_cache = false;
  options.headers = {{"tile.h", "#pragma once\ninline int twice(int v) { return v * nope; }\n"}};
  try {
    compile_cuda("#include \"tile.h\"\nextern \"C\" __global__ void k(int *x) { x[0] = twice(x[0]); }\n", "k.cu",
                 options);
    FAIL("a broken header compiled");
  } catch (const CompileError &e) {
    std::string what = e.what();
    CHECK(what.find("tile.h(2): error") != std::string::npos);
    CHECK(what.find("return v * nope;") != std::string::npos);
  }
}

TEST_CASE("cuda: in-memory headers and options reach NVRTC") {
  CompileOptions options;
  options.use_cache = false;
  options.headers = {{"scale.h", "#pragma once\n#define SCALE_OF(x) ((x) * FACTOR)\n"}};
  options.extra_options = {"-DFACTOR=3"};
  options.line_info = true;
  options.fast_math = true;
  CompileResult r = compile_cuda("#include \"scale.h\"\n#include <cuda_bf16.h>\n"
                                 "extern \"C\" __global__ void k(__nv_bfloat16 *x) {"
                                 " x[0] = __float2bfloat16(SCALE_OF(1.0f)); }\n",
                                 "k.cu", options);
  CHECK(r.resources_of("k") != nullptr);
  std::vector<std::string> opts = nvrtc_options(options);
  CHECK(std::find(opts.begin(), opts.end(), "--ptxas-options=-v") != opts.end());
  CHECK(std::find(opts.begin(), opts.end(), "-lineinfo") != opts.end());
  CHECK(std::find(opts.begin(), opts.end(), "--use_fast_math") != opts.end());
}

TEST_CASE("cuda: the compile cache hits the second time and survives a corrupt entry") {
  TempDir dir;
  ScopedEnv env("MOEFORGE_CACHE_DIR", dir.path.string());
  CHECK(CompileCache::default_directory() == dir.path);

  // doctest re-runs this body once per SUBCASE. Seen on the H200 machine's
  // NVRTC: compiling code whose PTX it already assembled in this process
  // leaves the log (and so the ptxas report) empty, even from a new source
  // text; a per-run global variable makes each run's PTX new.
  static int run = 0;
  const std::string source =
      std::string(kSmallKernel) + "__device__ int moeforge_test_run = " + std::to_string(run++) + ";\n";
  CompileResult first = compile_cuda(source, "scale.cu");
  CHECK_FALSE(first.from_cache);
  fs::path entry = dir.path / "nvrtc" / (first.cache_key + ".cubin-entry");
  REQUIRE(fs::exists(entry));

  CompileResult second = compile_cuda(source, "scale.cu");
  CHECK(second.from_cache);
  CHECK(second.cubin == first.cubin);
  CHECK(second.log == first.log);
  // Not REQUIRE: a fatal failure before this test's SUBCASEs makes doctest
  // re-run it without end.
  INFO("NVRTC log: " << first.log);
  CHECK(first.resources_of("scale") != nullptr);
  CHECK(second.resources_of("scale") != nullptr);
  if (first.resources_of("scale") && second.resources_of("scale"))
    CHECK(second.resources_of("scale")->registers == first.resources_of("scale")->registers);

  // Anything that changes the output changes the key.
  CompileOptions other;
  other.extra_options = {"-DUNUSED=1"};
  CompileResult third = compile_cuda(source, "scale.cu", other);
  CHECK_FALSE(third.from_cache);
  CHECK(third.cache_key != first.cache_key);

  SUBCASE("flipped byte in the cubin") {
    std::fstream f(entry, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    char c = 0;
    f.seekg(100);
    f.get(c);
    f.seekp(100);
    f.put(static_cast<char>(c ^ 0x5a));
  }
  SUBCASE("truncated") { fs::resize_file(entry, fs::file_size(entry) / 2); }
  SUBCASE("garbage") {
    std::ofstream f(entry, std::ios::binary | std::ios::trunc);
    f << "not a cache entry";
  }
  SUBCASE("empty") { std::ofstream f(entry, std::ios::binary | std::ios::trunc); }

  CompileResult recompiled = compile_cuda(source, "scale.cu");
  CHECK_FALSE(recompiled.from_cache);
  CHECK(recompiled.cubin == first.cubin);
  // ... and the recompile repaired the entry.
  CHECK(compile_cuda(source, "scale.cu").from_cache);
}

TEST_CASE("cuda: the cache directory follows MOEFORGE_CACHE_DIR then XDG_CACHE_HOME then HOME") {
  ScopedEnv home("HOME", "/home/someone");
  {
    ScopedEnv cache("MOEFORGE_CACHE_DIR", "/tmp/mf-cache");
    CHECK(CompileCache::default_directory() == fs::path("/tmp/mf-cache"));
  }
  ScopedEnv cache("MOEFORGE_CACHE_DIR", "");
  {
    ScopedEnv xdg("XDG_CACHE_HOME", "/tmp/xdg");
    CHECK(CompileCache::default_directory() == fs::path("/tmp/xdg/moeforge"));
  }
  ScopedEnv xdg("XDG_CACHE_HOME", "");
  CHECK(CompileCache::default_directory() == fs::path("/home/someone/.cache/moeforge"));
}

TEST_CASE("cuda: cache keys separate fields") {
  CHECK_FALSE(CacheKey::of({"ab", "c"}) == CacheKey::of({"a", "bc"}));
  CHECK(CacheKey::of({"ab", "c"}) == CacheKey::of({"ab", "c"}));
  CHECK(CacheKey::of({"x"}).hex().size() == 16);
}
