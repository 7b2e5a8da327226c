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
// A quantized pool holds each K or V row as one record of RW 32-bit words
// (mlxkv/kv_format.py), pages [blocks, kv heads, BS, RW]: MLX's affine
// quantization along the head dim, its packed words D * BITS / 32 (element i
// in bits BITS*i.. of the row, little endian), then D / QG scales, then D / QG
// biases, in the activation dtype T; value = scale * q + bias. Kernels of these
// pools are built with MLXKV_QUANTIZED defined and take BITS (8 or 4) and QG
// (the quantization group, 32 or 64) as template constants.
//
// A row's words, scales and biases are one span, and so are consecutive rows
// of a block: the threadgroup copies the visible rows of a span of 16 or 32 as
// they are to threadgroup memory, 16 bytes a thread, and each lane dequantizes
// its slice from there. 16 rows of any record width start a 64-byte segment
// (16 * RW * 4 bytes), so every simdgroup load covers whole segments but at a
// span's ends.

// Words of a row's record.
template <typename T, int D, int BITS, int QG>
constexpr int mlxkv_record_words() {
  return (D * BITS / 8 + 2 * (D / QG) * int(sizeof(T))) / 4;
}

// Rows r0..r1 - 1 of a span of K records and of V records (k_src, v_src: the
// span's first row) to k_dst and v_dst at the same offsets, thread `tid` of
// `threads` taking 16-byte chunks: from the 64-byte segment that holds row r0's
// first byte to the one that holds row r1's last (within the span: its rows
// fill whole segments). K's chunks then V's, one index, so the threadgroup's
// loads are each 32 lanes' contiguous 512 bytes.
template <int RW>
inline void mlxkv_copy_records(threadgroup uint32_t* k_dst, threadgroup uint32_t* v_dst,
                               const device uint32_t* k_src, const device uint32_t* v_src, int r0, int r1,
                               int tid, int threads) {
  const int c0 = r0 * RW / 16 * 4;  // chunks of 4 words; a segment is 16
  const int n = (r1 * RW + 15) / 16 * 4 - c0;
  for (int c = tid; c < 2 * n; c += threads) {
    const bool is_v = c >= n;
    const int w = (c0 + (is_v ? c - n : c)) * 4;
    const device uint32_t* src = (is_v ? v_src : k_src) + w;
    threadgroup uint32_t* dst = (is_v ? v_dst : k_dst) + w;
    // Four contiguous word loads, which the compiler merges into one 16-byte load.
    uint32_t x[4];
    for (int i = 0; i < 4; i++) {
      x[i] = src[i];
    }
    for (int i = 0; i < 4; i++) {
      dst[i] = x[i];
    }
  }
}

// Bits NBITS of a record in threadgroup memory from bit `bit0`, in x (then y, for
// 64 bits). The sizes a lane's slice has: whole words (a record starts on one),
// halves or bytes of one; at head dim 96 (12 or 24 bits) the bytes that hold them.
template <int NBITS>
inline uint2 mlxkv_packed_bits(const threadgroup uint32_t* rec, int bit0) {
  if (NBITS == 64) {
    return uint2(rec[bit0 / 32], rec[bit0 / 32 + 1]);
  }
  if (NBITS == 32) {
    return uint2(rec[bit0 / 32], 0u);
  }
  const threadgroup uchar* bytes = (const threadgroup uchar*)rec;
  if (NBITS == 16) {
    return uint2(uint(*(const threadgroup ushort*)(bytes + bit0 / 8)), 0u);
  }
  if (NBITS == 8) {
    return uint2(uint(bytes[bit0 / 8]), 0u);
  }
  uint x = 0;
  for (int i = 0; i * 8 < bit0 % 8 + NBITS; i++) {
    x |= uint(bytes[bit0 / 8 + i]) << (8 * i);
  }
  return uint2(x >> (bit0 % 8), 0u);
}

// Quantized element k (k * BITS < 64) of bits w.
template <int BITS>
inline float mlxkv_quant(uint2 w, int k) {
  const uint word = k * BITS < 32 ? w.x : w.y;
  return float((word >> ((k * BITS) % 32)) & ((1u << BITS) - 1u));
}

// A lane's E consecutive elements, from element d0, of the record `rec` (in
// threadgroup memory), dequantized into out.
template <typename T, int D, int E, int BITS, int QG>
inline void mlxkv_dequantize(thread float* out, const threadgroup uint32_t* rec, int d0) {
  const uint2 w = mlxkv_packed_bits<E * BITS>(rec, d0 * BITS);
  const threadgroup T* scales = (const threadgroup T*)(rec + D * BITS / 32);
  const threadgroup T* biases = scales + D / QG;
  if (32 % E == 0) {  // the slice lies in one group (groups are 32 or 64 elements)
    const float s = float(scales[d0 / QG]);
    const float b = float(biases[d0 / QG]);
    for (int e = 0; e < E; e++) {
      out[e] = s * mlxkv_quant<BITS>(w, e) + b;
    }
  } else {
    for (int e = 0; e < E; e++) {
      out[e] = float(scales[(d0 + e) / QG]) * mlxkv_quant<BITS>(w, e) + float(biases[(d0 + e) / QG]);
    }
  }
}
