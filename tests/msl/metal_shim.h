// The Metal Shading Language, as far as mlxkv's kernels use it, in C++14.
//
// A kernel's generated source (MLX's signature + header + body) compiles
// against this header with clang; runtime.cpp then runs it, one OS thread
// per Metal thread. It stands in for <metal_stdlib> and the prelude MLX
// prepends (bfloat16_t, float16_t, `using namespace metal`).
//
// Never include <cmath> here: its ::exp(double) makes exp(float) ambiguous
// next to `using namespace metal`.
#ifndef MLXKV_METAL_SHIM_H
#define MLXKV_METAL_SHIM_H

#include <stddef.h>
#include <stdint.h>

#include <type_traits>

#include "msl_abi.h"

// ---- address spaces: plain memory here -----------------------------------
// Threadgroup arrays are rewritten (harness.py) onto per-group storage from
// mlxkv_msl_tg_alloc before compiling, so what is left is pointer syntax.
#define device
#define constant
#define thread
#define threadgroup

// ---- scalar types ---------------------------------------------------------
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;
typedef __bf16 bfloat;
typedef half float16_t;
typedef bfloat bfloat16_t;

// ---- vector types: a class, so that MSL constructors work -----------------
// (ext_vector_type cannot express float4(x, y, z, w) or float4(half4)).
namespace mlxkv_msl {
template <typename T, int N>
struct vec_fields;
template <typename T>
struct vec_fields<T, 2> { T x, y; };
template <typename T>
struct vec_fields<T, 3> { T x, y, z; };
template <typename T>
struct vec_fields<T, 4> { T x, y, z, w; };
}  // namespace mlxkv_msl

template <typename T, int N>
struct vec;

namespace mlxkv_msl {
template <typename A>
struct components { static constexpr int value = 1; };
template <typename U, int M>
struct components<vec<U, M>> { static constexpr int value = M; };

constexpr int sum() { return 0; }
template <typename... R>
constexpr int sum(int a, R... r) { return a + sum(r...); }
}  // namespace mlxkv_msl

template <typename T, int N>
struct vec : mlxkv_msl::vec_fields<T, N> {
  vec() = default;
  vec(T s) {  // NOLINT: MSL converts a scalar to a vector implicitly
    for (int i = 0; i < N; i++) (*this)[i] = s;
  }
  // float4(x, y, z, w), float4(float2, z, w), ...: components in order.
  template <typename A, typename B, typename... R,
            typename = std::enable_if_t<mlxkv_msl::sum(
                mlxkv_msl::components<A>::value, mlxkv_msl::components<B>::value,
                mlxkv_msl::components<R>::value...) == N>>
  vec(const A& a, const B& b, const R&... r) {
    int i = 0;
    put(i, a, b, r...);
  }
  // float4(half4): an explicit conversion, as in MSL.
  template <typename U>
  explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; i++) (*this)[i] = T(o[i]);
  }

  T& operator[](int i) { return (&this->x)[i]; }
  const T& operator[](int i) const { return (&this->x)[i]; }

#define MLXKV_VEC_ASSIGN(op)                                     \
  vec& operator op##=(const vec& o) {                            \
    for (int i = 0; i < N; i++) (*this)[i] op## = o[i];          \
    return *this;                                                \
  }                                                              \
  vec& operator op##=(T s) {                                     \
    for (int i = 0; i < N; i++) (*this)[i] op## = s;             \
    return *this;                                                \
  }
  MLXKV_VEC_ASSIGN(+)
  MLXKV_VEC_ASSIGN(-)
  MLXKV_VEC_ASSIGN(*)
  MLXKV_VEC_ASSIGN(/)
#undef MLXKV_VEC_ASSIGN

 private:
  void put(int&) {}
  template <typename... R>
  void put(int& i, T s, const R&... r) {
    (*this)[i++] = s;
    put(i, r...);
  }
  template <typename U, int M, typename... R>
  void put(int& i, const vec<U, M>& v, const R&... r) {
    for (int k = 0; k < M; k++) (*this)[i++] = T(v[k]);
    put(i, r...);
  }
};

#define MLXKV_VEC_BINARY(op)                                          \
  template <typename T, int N>                                        \
  vec<T, N> operator op(vec<T, N> a, const vec<T, N>& b) {            \
    return a op## = b;                                                \
  }                                                                   \
  template <typename T, int N>                                        \
  vec<T, N> operator op(vec<T, N> a, T s) {                           \
    return a op## = s;                                                \
  }                                                                   \
  template <typename T, int N>                                        \
  vec<T, N> operator op(T s, const vec<T, N>& b) {                    \
    return vec<T, N>(s) op## = b;                                     \
  }
MLXKV_VEC_BINARY(+)
MLXKV_VEC_BINARY(-)
MLXKV_VEC_BINARY(*)
MLXKV_VEC_BINARY(/)
#undef MLXKV_VEC_BINARY

template <typename T, int N>
vec<T, N> operator-(vec<T, N> a) {
  for (int i = 0; i < N; i++) a[i] = -a[i];
  return a;
}

#define MLXKV_VEC_TYPES(T) \
  typedef vec<T, 2> T##2;  \
  typedef vec<T, 3> T##3;  \
  typedef vec<T, 4> T##4;
MLXKV_VEC_TYPES(float)
MLXKV_VEC_TYPES(half)
MLXKV_VEC_TYPES(bfloat)
MLXKV_VEC_TYPES(int)
MLXKV_VEC_TYPES(uint)
MLXKV_VEC_TYPES(short)
MLXKV_VEC_TYPES(ushort)
MLXKV_VEC_TYPES(char)
MLXKV_VEC_TYPES(uchar)
MLXKV_VEC_TYPES(bool)
#undef MLXKV_VEC_TYPES

// ---- constants --------------------------------------------------------------
#define INFINITY (__builtin_huge_valf())
#define NAN (__builtin_nanf(""))
#define FLT_MAX 3.40282346638528859812e+38F
#define FLT_MIN 1.17549435082228750797e-38F
#define HALF_MAX ((half)65504.0f)

// The call site of a barrier or simd operation: all threads must meet at one.
#define MLXKV_SITE ((unsigned(__builtin_LINE()) << 10) ^ unsigned(__builtin_COLUMN()))

namespace metal {

// ---- maths ------------------------------------------------------------------
// float in hardware; half and bfloat through float, rounded back.
#define MLXKV_UNARY(name, f)                                                   \
  inline float name(float x) { return f(x); }                                 \
  inline half name(half x) { return half(f(float(x))); }                       \
  inline bfloat name(bfloat x) { return bfloat(f(float(x))); }                 \
  template <typename T, int N>                                                 \
  vec<T, N> name(vec<T, N> v) {                                                \
    for (int i = 0; i < N; i++) v[i] = name(v[i]);                             \
    return v;                                                                  \
  }
MLXKV_UNARY(exp, __builtin_expf)
MLXKV_UNARY(exp2, __builtin_exp2f)
MLXKV_UNARY(log, __builtin_logf)
MLXKV_UNARY(log2, __builtin_log2f)
MLXKV_UNARY(sqrt, __builtin_sqrtf)
MLXKV_UNARY(rsqrt, 1.0f / __builtin_sqrtf)
MLXKV_UNARY(fabs, __builtin_fabsf)
MLXKV_UNARY(floor, __builtin_floorf)
MLXKV_UNARY(ceil, __builtin_ceilf)
MLXKV_UNARY(round, __builtin_roundf)
MLXKV_UNARY(trunc, __builtin_truncf)
MLXKV_UNARY(tanh, __builtin_tanhf)
MLXKV_UNARY(sin, __builtin_sinf)
MLXKV_UNARY(cos, __builtin_cosf)
#undef MLXKV_UNARY

inline float pow(float x, float y) { return __builtin_powf(x, y); }
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline float fmax(float a, float b) { return __builtin_fmaxf(a, b); }
inline float fmin(float a, float b) { return __builtin_fminf(a, b); }
inline bool isnan(float x) { return __builtin_isnan(x); }
inline bool isinf(float x) { return __builtin_isinf(x); }

// max/min: MSL's fmax semantics for float; one type only, as in MSL.
inline float max(float a, float b) { return __builtin_fmaxf(a, b); }
inline float min(float a, float b) { return __builtin_fminf(a, b); }
template <typename T>
T max(T a, T b) { return a < b ? b : a; }
template <typename T>
T min(T a, T b) { return b < a ? b : a; }
template <typename T>
T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
inline int abs(int x) { return x < 0 ? -x : x; }
inline float abs(float x) { return __builtin_fabsf(x); }
inline half abs(half x) { return x < half(0) ? half(-x) : x; }
template <typename T>
T select(T a, T b, bool c) { return c ? b : a; }
template <typename T, int N>
T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = T(0);
  for (int i = 0; i < N; i++) s += a[i] * b[i];
  return s;
}
template <typename T, typename U>
T as_type(const U& x) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs equal sizes");
  T r;
  __builtin_memcpy(&r, &x, sizeof(T));
  return r;
}

namespace fast {
using metal::cos;
using metal::exp;
using metal::exp2;
using metal::log;
using metal::log2;
using metal::max;
using metal::min;
using metal::pow;
using metal::rsqrt;
using metal::sin;
using metal::sqrt;
using metal::tanh;
}  // namespace fast
namespace precise {
using metal::cos;
using metal::exp;
using metal::exp2;
using metal::log;
using metal::log2;
using metal::max;
using metal::min;
using metal::pow;
using metal::rsqrt;
using metal::sin;
using metal::sqrt;
using metal::tanh;
}  // namespace precise

// ---- synchronisation --------------------------------------------------------
enum class mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
inline mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(unsigned(a) | unsigned(b));
}

inline void threadgroup_barrier(mem_flags, unsigned site = MLXKV_SITE) {
  mlxkv_msl_barrier(site);
}

// ---- simdgroup operations: every active lane's value, gathered ---------------
// Built for instruction counts (tests/msl/ops.py, -DMLXKV_MSL_OPS) they stay
// out of line, so that the lane exchange they emulate (a few instructions on
// a GPU, hundreds here) is not counted as the kernel's own.
#if defined(MLXKV_MSL_OPS)
#define MLXKV_SIMD_OP __attribute__((noinline))
#else
#define MLXKV_SIMD_OP
#endif
template <typename T>
struct simd_lanes {
  T v[32];
  unsigned active;  // bit i: lane i takes part (lanes that returned do not)
  unsigned lane;    // the calling lane
  bool has(unsigned i) const { return i < 32 && ((active >> i) & 1u); }
};

template <typename T>
MLXKV_SIMD_OP simd_lanes<T> simd_gather(const T& x, unsigned site) {
  static_assert(sizeof(T) <= 16, "simd operands are at most 16 bytes");
  unsigned char raw[32][16];
  simd_lanes<T> r;
  mlxkv_msl_simd_exchange(&x, sizeof(T), raw, &r.active, &r.lane, site);
  for (int i = 0; i < 32; i++) __builtin_memcpy(&r.v[i], raw[i], sizeof(T));
  return r;
}

inline void simdgroup_barrier(mem_flags, unsigned site = MLXKV_SITE) {
  simd_gather(0, site);
}

// Reductions run in lane order.
template <typename T>
MLXKV_SIMD_OP T simd_sum(T x, unsigned site = MLXKV_SITE) {
  simd_lanes<T> a = simd_gather(x, site);
  T s = T(0);
  for (unsigned i = 0; i < 32; i++)
    if (a.has(i)) s += a.v[i];
  return s;
}
template <typename T>
MLXKV_SIMD_OP T simd_product(T x, unsigned site = MLXKV_SITE) {
  simd_lanes<T> a = simd_gather(x, site);
  T s = T(1);
  for (unsigned i = 0; i < 32; i++)
    if (a.has(i)) s *= a.v[i];
  return s;
}
template <typename T>
MLXKV_SIMD_OP T simd_max(T x, unsigned site = MLXKV_SITE) {
  simd_lanes<T> a = simd_gather(x, site);
  for (unsigned i = 0; i < 32; i++)
    if (a.has(i)) x = max(x, a.v[i]);
  return x;
}
template <typename T>
MLXKV_SIMD_OP T simd_min(T x, unsigned site = MLXKV_SITE) {
  simd_lanes<T> a = simd_gather(x, site);
  for (unsigned i = 0; i < 32; i++)
    if (a.has(i)) x = min(x, a.v[i]);
  return x;
}
template <typename T>
MLXKV_SIMD_OP T simd_prefix_exclusive_sum(T x, unsigned site = MLXKV_SITE) {
  simd_lanes<T> a = simd_gather(x, site);
  T s = T(0);
  for (unsigned i = 0; i < a.lane; i++)
    if (a.has(i)) s += a.v[i];
  return s;
}
template <typename T>
MLXKV_SIMD_OP T simd_prefix_inclusive_sum(T x, unsigned site = MLXKV_SITE) {
  return simd_prefix_exclusive_sum(x, site) + x;
}
// Shuffles read another lane's value; from an inactive or out-of-range lane
// they return the caller's own (undefined in MSL).
template <typename T>
MLXKV_SIMD_OP T simd_shuffle(T x, ushort from, unsigned site = MLXKV_SITE) {
  simd_lanes<T> a = simd_gather(x, site);
  return a.has(from) ? a.v[from] : x;
}
template <typename T>
MLXKV_SIMD_OP T simd_broadcast(T x, ushort from, unsigned site = MLXKV_SITE) {
  return simd_shuffle(x, from, site);
}
template <typename T>
MLXKV_SIMD_OP T simd_broadcast_first(T x, unsigned site = MLXKV_SITE) {
  simd_lanes<T> a = simd_gather(x, site);
  for (unsigned i = 0; i < 32; i++)
    if (a.has(i)) return a.v[i];
  return x;
}
template <typename T>
MLXKV_SIMD_OP T simd_shuffle_xor(T x, ushort mask, unsigned site = MLXKV_SITE) {
  simd_lanes<T> a = simd_gather(x, site);
  unsigned from = a.lane ^ mask;
  return a.has(from) ? a.v[from] : x;
}
template <typename T>
MLXKV_SIMD_OP T simd_shuffle_down(T x, ushort delta, unsigned site = MLXKV_SITE) {
  simd_lanes<T> a = simd_gather(x, site);
  unsigned from = a.lane + delta;
  return a.has(from) ? a.v[from] : x;
}
template <typename T>
MLXKV_SIMD_OP T simd_shuffle_up(T x, ushort delta, unsigned site = MLXKV_SITE) {
  simd_lanes<T> a = simd_gather(x, site);
  return a.lane >= delta && a.has(a.lane - delta) ? a.v[a.lane - delta] : x;
}
inline bool simd_all(bool x, unsigned site = MLXKV_SITE) {
  simd_lanes<bool> a = simd_gather(x, site);
  for (unsigned i = 0; i < 32; i++)
    if (a.has(i) && !a.v[i]) return false;
  return true;
}
inline bool simd_any(bool x, unsigned site = MLXKV_SITE) {
  simd_lanes<bool> a = simd_gather(x, site);
  for (unsigned i = 0; i < 32; i++)
    if (a.has(i) && a.v[i]) return true;
  return false;
}

}  // namespace metal

using namespace metal;

#endif
