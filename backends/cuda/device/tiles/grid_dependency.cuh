// moeforge's tile library, part 'grid_dependency' (backends/cuda/device/tiles.cuh includes
// every part; NVRTC sees this one as "moeforge_tiles_grid_dependency.cuh"; the routing
// kernels' source starts with it too).
// Programmatic dependent launch (sm_90): the runtime launches moeforge's kernels with
// programmatic stream serialisation (Kernel::launch_early), so the GPU may schedule a
// kernel's blocks while the kernel before it in the stream is still running, instead of
// after it has finished and its memory is flushed: the next kernel's launch and block
// dispatch overlap the one before. At decoding sizes a layer is a chain of kernels of a
// few microseconds each, with ~2 us between two of them (a fifth of qwen3moe's forward at
// one token on an H100).
#pragma once

namespace mf {

// The first statement of every kernel launched early: waits until the grid before it in
// the stream has finished and its writes are visible (a no-op for a kernel launched the
// ordinary way), then lets the grid after it be scheduled, whose blocks in turn wait here
// for this one. Nothing before it may read what an earlier kernel wrote, or write what an
// earlier kernel reads.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory");
#endif
}

} // namespace mf
