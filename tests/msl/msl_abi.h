// What the runtime (runtime.cpp) and a compiled kernel (metal_shim.h plus
// the generated source) agree on: the builtin values of one Metal thread,
// the kernel's entry point, and the runtime's hooks.
#ifndef MLXKV_MSL_ABI_H
#define MLXKV_MSL_ABI_H

#include <stddef.h>

struct MlxkvBuiltins {
  unsigned thread_position_in_grid[3];
  unsigned threads_per_grid[3];
  unsigned threadgroup_position_in_grid[3];
  unsigned threadgroups_per_grid[3];
  unsigned thread_position_in_threadgroup[3];
  unsigned threads_per_threadgroup[3];           // this (maybe partial) group
  unsigned dispatch_threads_per_threadgroup[3];  // as dispatched
  unsigned thread_index_in_threadgroup;
  unsigned thread_index_in_simdgroup;
  unsigned simdgroup_index_in_threadgroup;
  unsigned simdgroups_per_threadgroup;
  unsigned threads_per_simdgroup;
  unsigned quadgroup_index_in_threadgroup;
  unsigned thread_index_in_quadgroup;
};

extern "C" {
// Generated per kernel: calls the kernel for one thread.
void mlxkv_msl_entry(void* const* buffers, const MlxkvBuiltins* builtins);

// Provided by the runtime. `site` identifies the call's source position.
void mlxkv_msl_barrier(unsigned site);
void mlxkv_msl_simd_exchange(const void* value, unsigned size, void* lanes,
                             unsigned* active, unsigned* lane, unsigned site);
void* mlxkv_msl_tg_alloc(size_t bytes, size_t align);
}

#endif
