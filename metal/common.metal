// Shared header of mlxkv's paged-attention kernels (the `header` of every
// mx.fast.metal_kernel in mlxkv/kernels.py). MLX prepends metal_stdlib,
// `using namespace metal` and its bfloat16_t / float16_t typedefs.
//
// The kernels are written in the subset of MSL that is also C++, so that
// tests/msl can compile the exact generated source with clang and run it.

// Running maxima start here rather than at -INFINITY, so that an empty
// partition's maximum minus another's is 0 or hugely negative, never
// -inf - -inf = NaN: exp() of anything this far below a real score is
// exactly 0. (MLX builds kernels without fast math since 2024, so exp() is
// the precise one and infinities would be reliable; NaN would not be.)
constant constexpr float MLXKV_NO_SCORE = -1e30f;
