// Shared device code of the ringcomm kernels: storage types, conversions that round (and treat
// NaN payloads) exactly as NumPy does, the counter-based hash of stochastic rounding, vector
// loads, and the grid-stride driver of elementwise kernels.
//
// Every kernel has a NumPy twin in ringcomm/ops/numpy.py that the GPU tests compare against bit
// for bit, so arithmetic goes through explicitly rounded intrinsics (no FMA contraction that
// NumPy does not do), and NaN/Inf handling follows NumPy's casts, not the hardware's.
//
// The scalar arithmetic also builds as host C++ (without __CUDACC__), and the kernels with a CPU
// stand-in for CUDA (tests/cuda_emulation.h), so both can be checked against NumPy on a
// machine without a GPU. The stand-in's float32 arithmetic is the GPU's: a NaN result is the
// canonical NaN 0x7fffffff, and subnormals are flushed when the kernels are built with -ftz=true
// (ringcomm compiles them with -ftz=false, ops/_kernel_cache.py).
//
// NaN payloads: conversions keep them as NumPy does. Arithmetic cannot (the GPU returns its
// canonical NaN, x86 the operand's payload), so where a NaN sum reaches a payload on the wire
// (the cast hop's words, an int8 block's scale) both sides write the quiet NaN 0x7fc00000
// instead; float results (sums, decoded values) are NaN on both, payload unspecified.
#pragma once

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#define RC_DEVICE 1
#define RC_FN __device__ __forceinline__
#else
#include <cmath>
#include <cstring>
#define RC_FN inline
#endif

namespace rc {

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

// 16-bit floats are stored as their bits; arithmetic on them goes through float, as NumPy's and
// ml_dtypes' loops do.
struct half_t {
  u16 bits;
};
struct bf16_t {
  u16 bits;
};

// ------------------------------------------------------------------ rounded arithmetic
#ifdef RC_DEVICE
RC_FN u32 fbits(float x) { return __float_as_uint(x); }
RC_FN float ffrom(u32 b) { return __uint_as_float(b); }
RC_FN u64 dbits(double x) { return (u64)__double_as_longlong(x); }
RC_FN double dfrom(u64 b) { return __longlong_as_double((long long)b); }
RC_FN float fadd(float a, float b) { return __fadd_rn(a, b); }
RC_FN float fsub(float a, float b) { return __fsub_rn(a, b); }
RC_FN float fmul(float a, float b) { return __fmul_rn(a, b); }
RC_FN float fdiv(float a, float b) { return __fdiv_rn(a, b); }
RC_FN double dadd(double a, double b) { return __dadd_rn(a, b); }
RC_FN double dmul(double a, double b) { return __dmul_rn(a, b); }
RC_FN double ddiv(double a, double b) { return __ddiv_rn(a, b); }
RC_FN float d2f(double x) { return __double2float_rn(x); }
RC_FN float i2f(int x) { return __int2float_rn(x); }
RC_FN float ll2f(i64 x) { return __ll2float_rn(x); }
RC_FN double ll2d(i64 x) { return __ll2double_rn(x); }
RC_FN int d2i_rz(double x) { return __double2int_rz(x); }
RC_FN i64 d2ll_rz(double x) { return __double2ll_rz(x); }
RC_FN float rint_f(float x) { return rintf(x); }
RC_FN float floor_f(float x) { return floorf(x); }
RC_FN float fmax_f(float a, float b) { return fmaxf(a, b); }
RC_FN float fmin_f(float a, float b) { return fminf(a, b); }
RC_FN double f2d(float x) { return (double)x; }
RC_FN bool fle(float a, float b) { return a <= b; }
RC_FN bool fge(float a, float b) { return a >= b; }
#else
RC_FN u32 fbits(float x) { u32 b; std::memcpy(&b, &x, 4); return b; }
RC_FN float ffrom(u32 b) { float x; std::memcpy(&x, &b, 4); return x; }
RC_FN u64 dbits(double x) { u64 b; std::memcpy(&b, &x, 8); return b; }
RC_FN double dfrom(u64 b) { double x; std::memcpy(&x, &b, 8); return x; }
RC_FN double dadd(double a, double b) { return a + b; }
RC_FN double dmul(double a, double b) { return a * b; }
RC_FN double ddiv(double a, double b) { return a / b; }
RC_FN float i2f(int x) { return (float)x; }
RC_FN float ll2f(i64 x) { return (float)x; }
RC_FN double ll2d(i64 x) { return (double)x; }
RC_FN int d2i_rz(double x) { return (int)x; }
RC_FN i64 d2ll_rz(double x) { return (i64)x; }
#ifdef RC_EMULATE  // the GPU's float32 arithmetic, from tests/cuda_emulation.h
RC_FN float fadd(float a, float b) { return rc_emu::f32_add(a, b); }
RC_FN float fsub(float a, float b) { return rc_emu::f32_sub(a, b); }
RC_FN float fmul(float a, float b) { return rc_emu::f32_mul(a, b); }
RC_FN float fdiv(float a, float b) { return rc_emu::f32_div(a, b); }
RC_FN float d2f(double x) { return rc_emu::f32_from_f64(x); }
RC_FN double f2d(float x) { return rc_emu::f64_from_f32(x); }
RC_FN float rint_f(float x) { return rc_emu::f32_rint(x); }
RC_FN float floor_f(float x) { return rc_emu::f32_floor(x); }
RC_FN float fmax_f(float a, float b) { return rc_emu::f32_max(a, b); }
RC_FN float fmin_f(float a, float b) { return rc_emu::f32_min(a, b); }
RC_FN bool fle(float a, float b) { return rc_emu::f32_le(a, b); }
RC_FN bool fge(float a, float b) { return rc_emu::f32_le(b, a); }
#else  // plain host C++ (tests/kernels_host.cpp): IEEE arithmetic, as NumPy's
RC_FN float fadd(float a, float b) { return a + b; }
RC_FN float fsub(float a, float b) { return a - b; }
RC_FN float fmul(float a, float b) { return a * b; }
RC_FN float fdiv(float a, float b) { return a / b; }
RC_FN float d2f(double x) { return (float)x; }
RC_FN double f2d(float x) { return (double)x; }
RC_FN float rint_f(float x) { return std::rint(x); }
RC_FN float floor_f(float x) { return std::floor(x); }
RC_FN float fmax_f(float a, float b) { return std::fmax(a, b); }
RC_FN float fmin_f(float a, float b) { return std::fmin(a, b); }
RC_FN bool fle(float a, float b) { return a <= b; }
RC_FN bool fge(float a, float b) { return a >= b; }
#endif
#endif

// The quiet NaN that payload words carry for a NaN computed by arithmetic (see above). An
// enumerator, so that no variable of it lands in the module.
enum : u32 { QUIET_NAN = 0x7fc00000u };

RC_FN bool isnan_f(float x) { return (fbits(x) & 0x7fffffffu) > 0x7f800000u; }
// x, or the quiet NaN when x is a NaN of any payload.
RC_FN float quiet_nan_of(float x) { return isnan_f(x) ? ffrom(QUIET_NAN) : x; }
RC_FN bool finite_f(float x) { return (fbits(x) & 0x7f800000u) != 0x7f800000u; }
RC_FN bool isnan_d(double x) { return (dbits(x) & 0x7fffffffffffffffull) > 0x7ff0000000000000ull; }
RC_FN bool finite_d(double x) {
  return (dbits(x) & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}
RC_FN float abs_f(float x) { return ffrom(fbits(x) & 0x7fffffffu); }
RC_FN float finite_or_zero(float x) { return finite_f(x) ? x : 0.0f; }

// Round-half-to-even of an unsigned value shifted right by s (1 <= s <= 63).
RC_FN u64 shift_rne(u64 m, int s) {
  const u64 q = m >> s;
  const u64 rem = m & ((1ull << s) - 1);
  const u64 half = 1ull << (s - 1);
  return q + ((rem > half || (rem == half && (q & 1))) ? 1 : 0);
}

// ------------------------------------------------------------- float <-> half (NumPy)
// NumPy's conversions are IEEE round-to-nearest-even; a NaN keeps the top bits of its payload
// (made non-zero) instead of becoming the hardware's canonical NaN.
RC_FN u16 f32_to_f16(float f) {
  const u32 x = fbits(f);
  const u32 sign = (x >> 16) & 0x8000u;
  const u32 e = (x >> 23) & 0xffu;
  const u32 sig = x & 0x7fffffu;
  if (e == 0xffu) {
    if (sig == 0) return (u16)(sign | 0x7c00u);
    const u32 h = 0x7c00u | (sig >> 13);
    return (u16)(sign | (h == 0x7c00u ? 0x7c01u : h));
  }
  if (e >= 143) return (u16)(sign | 0x7c00u);  // >= 2^16: Inf
  if (e >= 113) {                               // normal half (rounding may carry into Inf)
    const u32 h = ((e - 112) << 10) | (sig >> 13);
    return (u16)(sign | (u32)shift_rne(((u64)h << 13) | (sig & 0x1fffu), 13));
  }
  if (e < 102) return (u16)sign;  // below 2^-25: rounds to zero
  // half subnormal: units of 2^-24; value = (2^23 + sig) * 2^(e - 150)
  return (u16)(sign | (u32)shift_rne(0x800000u | sig, 126 - (int)e));
}

RC_FN u16 f64_to_f16(double d) {
  const u64 x = dbits(d);
  const u32 sign = (u32)(x >> 48) & 0x8000u;
  const int e = (int)((x >> 52) & 0x7ff);
  const u64 sig = x & 0xfffffffffffffull;
  if (e == 0x7ff) {
    if (sig == 0) return (u16)(sign | 0x7c00u);
    const u32 h = 0x7c00u | (u32)(sig >> 42);
    return (u16)(sign | (h == 0x7c00u ? 0x7c01u : h));
  }
  if (e >= 1039) return (u16)(sign | 0x7c00u);
  if (e >= 1009) {
    const u64 h = ((u64)(e - 1008) << 10) | (sig >> 42);
    return (u16)(sign | (u32)shift_rne((h << 42) | (sig & ((1ull << 42) - 1)), 42));
  }
  if (e < 998) return (u16)sign;
  return (u16)(sign | (u32)shift_rne((1ull << 52) | sig, 1051 - e));
}

RC_FN float f16_to_f32(u16 h) {
  const u32 sign = (u32)(h & 0x8000u) << 16;
  const u32 e = h & 0x7c00u;
  const u32 sig = h & 0x3ffu;
  if (e == 0x7c00u) return ffrom(sign | 0x7f800000u | (sig << 13));  // Inf, NaN as is
  if (e == 0) return ffrom(sign | fbits(fmul((float)sig, 5.9604644775390625e-08f)));
  return ffrom(sign | (((u32)(h & 0x7fffu) << 13) + 0x38000000u));
}

RC_FN double f16_to_f64(u16 h) {
  if ((h & 0x7c00u) == 0x7c00u) {  // NumPy widens a half NaN without quieting it
    return dfrom(((u64)(h & 0x8000u) << 48) | 0x7ff0000000000000ull | ((u64)(h & 0x3ffu) << 42));
  }
  return (double)f16_to_f32(h);
}

// float <-> double as a C cast on x86 (NumPy's loops): a NaN is quieted, its payload kept.
RC_FN double f32_to_f64(float f) {
  const u32 x = fbits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    return dfrom(((u64)(x & 0x80000000u) << 32) | 0x7ff8000000000000ull |
                 ((u64)(x & 0x7fffffu) << 29));
  }
  return f2d(f);
}

RC_FN float f64_to_f32(double d) {
  const u64 x = dbits(d);
  if ((x & 0x7fffffffffffffffull) > 0x7ff0000000000000ull) {
    return ffrom((u32)((x >> 32) & 0x80000000u) | 0x7fc00000u | (u32)((x >> 29) & 0x7fffffu));
  }
  return d2f(d);
}

// ------------------------------------------------------------------ float <-> bfloat16
// Casts to the bfloat16 dtype (ml_dtypes): nearest-even, a NaN becomes the quiet NaN of its sign.
RC_FN u16 f32_to_bf16(float f) {
  const u32 x = fbits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x & 0x80000000u) ? 0xffc0u : 0x7fc0u);
  return (u16)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// The bf16 wire format of ops/numpy.py cast_encode: nearest-even; a NaN keeps its top bits.
RC_FN u16 f32_to_bf16_wire(float f) {
  const u32 x = fbits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x40u);
  return (u16)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

RC_FN float bf16_to_f32(u16 b) { return ffrom((u32)b << 16); }

// ------------------------------------------------------------------------ to integers
// A C cast on x86: out of range or NaN gives the "integer indefinite" value (the minimum).
RC_FN int d2i(double d) {
  return (d > -2147483649.0 && d < 2147483648.0) ? d2i_rz(d) : (int)0x80000000u;
}
RC_FN i64 d2ll(double d) {
  return (d >= -9223372036854775808.0 && d < 9223372036854775808.0)
             ? d2ll_rz(d)
             : (i64)0x8000000000000000ull;
}

// ------------------------------------------------------------------------ type traits
// Num<T>::C is the type arithmetic on T happens in; to/from convert between them, rounding once.
template <class T> struct Num;
template <> struct Num<half_t> {
  typedef float C;
  static RC_FN float to(half_t x) { return f16_to_f32(x.bits); }
  static RC_FN half_t from(float x) { half_t h; h.bits = f32_to_f16(x); return h; }
};
template <> struct Num<bf16_t> {
  typedef float C;
  static RC_FN float to(bf16_t x) { return bf16_to_f32(x.bits); }
  static RC_FN bf16_t from(float x) { bf16_t h; h.bits = f32_to_bf16(x); return h; }
};
template <> struct Num<float> {
  typedef float C;
  static RC_FN float to(float x) { return x; }
  static RC_FN float from(float x) { return x; }
};
template <> struct Num<double> {
  typedef double C;
  static RC_FN double to(double x) { return x; }
  static RC_FN double from(double x) { return x; }
};
template <> struct Num<int> {
  typedef int C;
  static RC_FN int to(int x) { return x; }
  static RC_FN int from(int x) { return x; }
};
template <> struct Num<long long> {
  typedef long long C;
  static RC_FN long long to(long long x) { return x; }
  static RC_FN long long from(long long x) { return x; }
};

// Conversions between the arithmetic types, as NumPy's casts do them.
template <class To> struct Cvt;
template <> struct Cvt<float> {
  static RC_FN float of(float x) { return x; }
  static RC_FN float of(double x) { return f64_to_f32(x); }
  static RC_FN float of(int x) { return i2f(x); }
  static RC_FN float of(long long x) { return ll2f(x); }
};
template <> struct Cvt<double> {
  static RC_FN double of(float x) { return f32_to_f64(x); }
  static RC_FN double of(double x) { return x; }
  static RC_FN double of(int x) { return (double)x; }
  static RC_FN double of(long long x) { return ll2d(x); }
};
template <> struct Cvt<int> {
  static RC_FN int of(float x) { return d2i((double)x); }
  static RC_FN int of(double x) { return d2i(x); }
  static RC_FN int of(int x) { return x; }
  static RC_FN int of(long long x) { return (int)(u32)(u64)x; }
};
template <> struct Cvt<long long> {
  static RC_FN long long of(float x) { return d2ll((double)x); }
  static RC_FN long long of(double x) { return d2ll(x); }
  static RC_FN long long of(int x) { return (long long)x; }
  static RC_FN long long of(long long x) { return x; }
};

template <class D, class S> struct Convert {
  static RC_FN D of(S s) { return Num<D>::from(Cvt<typename Num<D>::C>::of(Num<S>::to(s))); }
};
// NumPy converts between half and double directly (one rounding, NaN payload kept).
template <> struct Convert<half_t, double> {
  static RC_FN half_t of(double d) { half_t h; h.bits = f64_to_f16(d); return h; }
};
template <> struct Convert<double, half_t> {
  static RC_FN double of(half_t h) { return f16_to_f64(h.bits); }
};
// ml_dtypes casts bfloat16 to half through Eigen's half, which makes a NaN the quiet NaN.
template <> struct Convert<half_t, bf16_t> {
  static RC_FN half_t of(bf16_t b) {
    half_t h;
    h.bits = ((b.bits & 0x7fffu) > 0x7f80u) ? (u16)((b.bits & 0x8000u) | 0x7e00u)
                                             : f32_to_f16(bf16_to_f32(b.bits));
    return h;
  }
};
template <class D, class S> RC_FN D convert(S s) { return Convert<D, S>::of(s); }

// ----------------------------------------------------------------- reduction ops
// The ops of the dense reduction, on each arithmetic type (Num<T>::C).
struct OpSum {
  static RC_FN float apply(float a, float b) { return fadd(a, b); }
  static RC_FN double apply(double a, double b) { return dadd(a, b); }
  static RC_FN int apply(int a, int b) { return (int)((u32)a + (u32)b); }  // wraps, as NumPy
  static RC_FN i64 apply(i64 a, i64 b) { return (i64)((u64)a + (u64)b); }
};
struct OpProd {
  static RC_FN float apply(float a, float b) { return fmul(a, b); }
  static RC_FN double apply(double a, double b) { return dmul(a, b); }
  static RC_FN int apply(int a, int b) { return (int)((u32)a * (u32)b); }
  static RC_FN i64 apply(i64 a, i64 b) { return (i64)((u64)a * (u64)b); }
};
// NumPy's minimum/maximum: a NaN in either operand propagates.
struct OpMin {
  static RC_FN float apply(float a, float b) { return (fle(a, b) || isnan_f(a)) ? a : b; }
  static RC_FN double apply(double a, double b) { return (a <= b || isnan_d(a)) ? a : b; }
  static RC_FN int apply(int a, int b) { return a <= b ? a : b; }
  static RC_FN i64 apply(i64 a, i64 b) { return a <= b ? a : b; }
};
struct OpMax {
  static RC_FN float apply(float a, float b) { return (fge(a, b) || isnan_f(a)) ? a : b; }
  static RC_FN double apply(double a, double b) { return (a >= b || isnan_d(a)) ? a : b; }
  static RC_FN int apply(int a, int b) { return a >= b ? a : b; }
  static RC_FN i64 apply(i64 a, i64 b) { return a >= b ? a : b; }
};

// ------------------------------------------------------------ stochastic rounding hash
// Counter-based uniform in [0, 1) of element `index`; ops/numpy.py uniform() is its twin.
RC_FN float uniform01(u32 seed, u32 index) {
  u32 h = index * 0x9E3779B1u + seed;
  h ^= h >> 16;
  h *= 0x7FEB352Du;
  h ^= h >> 15;
  h *= 0x846CA68Bu;
  h ^= h >> 16;
  return (float)(h >> 8) * (1.0f / 16777216.0f);
}

// ------------------------------------------------------------------------ int8 codes
// A block's scale (absmax / 127, written to the payload) and the factor its codes are computed
// with: 127 / absmax, or 0 for a block that cannot be quantized (absmax zero, so small that
// 127 / absmax overflows, Inf, or NaN); such a block decodes to 0 or, for Inf/NaN, to NaN.
// A NaN block's scale is the quiet NaN 0x7fc00000 (ops/numpy.py writes the same), not what a
// division of the NaN gives (the GPU's canonical NaN).
RC_FN void int8_params(float absmax, float& scale, float& inv) {
  const float qmax = 127.0f;
  const float fmax = 3.40282346638528859812e+38f;
  scale = isnan_f(absmax) ? ffrom(QUIET_NAN) : fdiv(absmax, qmax);
  inv = (fge(absmax, fdiv(qmax, fmax)) && fle(absmax, fmax)) ? fdiv(qmax, absmax) : 0.0f;
}

// The int8 code of x, as a float: rint(x * inv), or with stochastic rounding
// floor(x * inv + u) clipped to [-127, 127], u the uniform of element `index`.
RC_FN float int8_code(float x, float inv, bool stochastic, u32 seed, u32 index) {
  float t = fmul(x, inv);
  if (isnan_f(t)) t = 0.0f;  // Inf * 0 or NaN * 0 in a block that cannot be quantized
  if (!stochastic) return rint_f(t);  // |x * inv| <= 127 (1 + 2^-22): never rounds past 127
  t = floor_f(fadd(t, uniform01(seed, index)));
  return fmin_f(fmax_f(t, -127.0f), 127.0f);
}

// Magnitude as an ordered key: |x|'s bits, which order like the magnitudes, with Inf above
// every number and NaN above Inf (as NumPy's partitions rank them).
RC_FN u32 mag_key(float x) { return fbits(x) & 0x7fffffffu; }

// ------------------------------------------------------------------ vectorised access
// Groups of 4 elements move as one load/store of up to 16 bytes where the caller has checked
// the alignment; partial groups and unaligned arrays go element by element.
template <class T, int V>
struct alignas(sizeof(T) * V < 16 ? sizeof(T) * V : 16) Pack {
  T v[V];
};

#ifdef RC_EMULATE  // a GPU faults on a misaligned vector access; make the emulator do so too
#define RC_CHECK_ALIGNED(p, T, V) rc_emu_check_aligned(p, alignof(Pack<T, V>))
#else
#define RC_CHECK_ALIGNED(p, T, V)
#endif

template <int V, class T> RC_FN Pack<T, V> load(const T* p) {
  RC_CHECK_ALIGNED(p, T, V);
  return *reinterpret_cast<const Pack<T, V>*>(p);
}
template <int V, class T> RC_FN void store(T* p, const Pack<T, V>& x) {
  RC_CHECK_ALIGNED(p, T, V);
  *reinterpret_cast<Pack<T, V>*>(p) = x;
}

#if defined(RC_DEVICE) || defined(RC_EMULATE)  // RC_EMULATE: tests/cuda_emulation.h
enum : unsigned { FULL_MASK = 0xffffffffu };

RC_FN i64 global_thread() { return (i64)blockIdx.x * blockDim.x + threadIdx.x; }
RC_FN i64 thread_count() { return (i64)gridDim.x * blockDim.x; }

// Grid-stride loop over n elements calling f.template apply<4>(i) on aligned groups of 4
// (when `vec`) and f.template apply<1>(i) on the rest: coalesced, and one launch fits any n.
template <class F> RC_FN void run_elementwise(const F& f, i64 n, int vec) {
  const i64 tid = global_thread();
  const i64 step = thread_count();
  i64 done = 0;
  if (vec) {
    const i64 groups = n >> 2;
    for (i64 g = tid; g < groups; g += step) f.template apply<4>(g << 2);
    done = groups << 2;
  }
  for (i64 i = done + tid; i < n; i += step) f.template apply<1>(i);
}
#endif

}  // namespace rc
