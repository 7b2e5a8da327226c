// Shared header of mlxkv's paged-attention kernels (the `header` of every
// mx.fast.metal_kernel in mlxkv/kernels.py). MLX prepends metal_stdlib,
// `using namespace metal` and its bfloat16_t / float16_t typedefs.
//
// The kernels are written in the subset of MSL that is also C++, so that
// tests/msl can compile the exact generated source with clang and run it.

// Running maxima start here rather than at -INFINITY: Metal compiles with
// fast math by default, under which infinities are not reliable. exp() of
// anything this far below a real score is exactly 0.
constant constexpr float MLXKV_NO_SCORE = -1e30f;
