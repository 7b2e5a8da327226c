// Shared header of mlxkv's paged-attention kernels (the `header` of every
// mx.fast.metal_kernel in mlxkv/kernels.py). MLX prepends metal_stdlib,
// `using namespace metal` and its bfloat16_t / float16_t typedefs.
//
// The kernels are written in the subset of MSL that is also C++, so that
// tests/msl can compile the exact generated source with clang and run it.

// Running maxima start here rather than at -INFINITY, so that an empty
// partition's maximum minus another's is 0 or hugely negative, never
// -inf - -inf = NaN: exp2() of anything this far below a real score is
// exactly 0, fast or precise. (NaN would not be reliable either way.)
constant constexpr float MLXKV_NO_SCORE = -1e30f;

// Scores are kept in log2 units: queries are pre-scaled by scale * log2(e)
// (and sinks by log2(e)), so each softmax term is one exp2 rather than an
// exp, whose argument the hardware multiplies by log2(e) anyway. Running
// maxima and sums, and the partials' maxima, are in those units; the
// reduce (paged_reduce.metal) merges them with exp2 too.
constant constexpr float MLXKV_LOG2E = 1.4426950408889634f;

// Loops over a lane's elements, a group's heads or an iteration's tokens have constant
// trip counts: unrolled in full, as MLX's steel kernels ask (STEEL_PRAGMA_UNROLL), so their
// arrays stay in registers rather than thread memory whatever the compiler's heuristics.
#define MLXKV_UNROLL _Pragma("clang loop unroll(full)")

// ---- quantized pools ---------------------------------------------------------
// A quantized pool holds each K or V row as MLX's affine quantization along
// the head dim, as mx.quantize lays out [blocks, kv heads, BS, D]: packed
// uint32 [..., D * BITS / 32] (element i in bits BITS*i.. of the row, little
// endian), scales and biases [..., D / group] in the activation dtype;
// value = scale * q + bias. Kernels of these pools are built with
// MLXKV_QUANTIZED defined and take BITS (8 or 4) as a template constant.

// Bits NBITS of a row's packed bytes from bit `bit0`, in x (then y, for 64 bits).
// The sizes a lane's slice has: whole aligned words or halves of one, one
// load each; at head dim 96 (12 or 24 bits) the bytes that hold them.
template <int NBITS>
inline uint2 mlxkv_packed_bits(const device uchar* row, int bit0) {
  if (NBITS == 64) {
    return *(const device uint2*)(row + bit0 / 8);
  }
  if (NBITS == 32) {
    return uint2(*(const device uint*)(row + bit0 / 8), 0u);
  }
  if (NBITS == 16) {
    return uint2(uint(*(const device ushort*)(row + bit0 / 8)), 0u);
  }
  if (NBITS == 8) {
    return uint2(uint(row[bit0 / 8]), 0u);
  }
  uint x = 0;
  for (int i = 0; i * 8 < bit0 % 8 + NBITS; i++) {
    x |= uint(row[bit0 / 8 + i]) << (8 * i);
  }
  return uint2(x >> (bit0 % 8), 0u);
}

// Quantized element k (k * BITS < 64) of bits w.
template <int BITS>
inline float mlxkv_quant(uint2 w, int k) {
  const uint word = k * BITS < 32 ? w.x : w.y;
  return float((word >> ((k * BITS) % 32)) & ((1u << BITS) - 1u));
}

// A lane's E consecutive elements of pool row `row`, from element d0 (head dim
// D, `group` elements per scale), dequantized into out.
template <typename T, int D, int E, int BITS>
inline void mlxkv_dequantize(thread float* out, const device uint32_t* packed, const device T* scales,
                             const device T* biases, size_t row, int d0, int group) {
  const device uchar* bytes = (const device uchar*)packed + row * (D * BITS / 8);
  const uint2 w = mlxkv_packed_bits<E * BITS>(bytes, d0 * BITS);
  const size_t groups = size_t(row) * (D / group);
  if (32 % E == 0) {  // the slice lies in one group (groups are 32 or 64 elements)
    const float s = float(scales[groups + d0 / group]);
    const float b = float(biases[groups + d0 / group]);
    for (int e = 0; e < E; e++) {
      out[e] = s * mlxkv_quant<BITS>(w, e) + b;
    }
  } else {
    for (int e = 0; e < E; e++) {
      const size_t at = groups + (d0 + e) / group;
      out[e] = float(scales[at]) * mlxkv_quant<BITS>(w, e) + float(biases[at]);
    }
  }
}

// The 128 / BITS elements of a 16-byte chunk of packed words, from element d
// of pool row `row`, dequantized into out. A chunk lies in one group (16 or
// 32 elements; groups are 32 or 64).
template <typename T, int D, int BITS>
inline void mlxkv_dequantize_chunk(threadgroup float* out, const device uint32_t* packed,
                                   const device T* scales, const device T* biases, size_t row, int d,
                                   int group) {
  // Four contiguous word loads, which the compiler merges into one 16-byte load.
  const device uint32_t* src = packed + row * (D * BITS / 32) + d * BITS / 32;
  uint w[4];
  for (int i = 0; i < 4; i++) {
    w[i] = src[i];
  }
  const size_t at = row * (D / group) + d / group;
  const float s = float(scales[at]);
  const float b = float(biases[at]);
  for (int k = 0; k < 128 / BITS; k++) {
    out[k] = s * float((w[k * BITS / 32] >> ((k * BITS) % 32)) & ((1u << BITS) - 1u)) + b;
  }
}
