// Elementwise kernels of the dense ring and the error-feedback bookkeeping: dtype casts, the
// chunk reduction, the average's division, compensation (input + residual), and the sparse
// helpers (scatter-add of (index, value) pairs, the top-k residual). Twins: ops/numpy.py.
#include "common.cuh"

namespace rc {

// ------------------------------------------------------------------------------ copy
template <class D, class S> struct CopyF {
  D* out;
  const S* in;
  template <int V> RC_FN void apply(i64 i) const {
    const Pack<S, V> a = load<V>(in + i);
    Pack<D, V> r;
#pragma unroll
    for (int j = 0; j < V; ++j) r.v[j] = convert<D>(a.v[j]);
    store<V>(out + i, r);
  }
};

// out = in converted to D (NumPy's unsafe cast: overflow to Inf, NaN payloads as NumPy).
template <class D, class S>
__global__ void copy_kernel(D* out, const S* in, i64 n, int vec) {
  run_elementwise(CopyF<D, S>{out, in}, n, vec);
}

// ---------------------------------------------------------------------------- reduce
// The dtype a mixed pair is reduced in (np.result_type): a float32 partial sum plus a 16-bit
// contribution is a float32 addition.
template <class A, class B> struct Wider;
template <class A> struct Wider<A, A> { typedef A T; };
template <> struct Wider<float, half_t> { typedef float T; };
template <> struct Wider<half_t, float> { typedef float T; };
template <> struct Wider<float, bf16_t> { typedef float T; };
template <> struct Wider<bf16_t, float> { typedef float T; };

template <class Op, class A, class B, class O> struct ReduceF {
  O* out;
  const A* a;
  const B* b;
  template <int V> RC_FN void apply(i64 i) const {
    typedef typename Wider<A, B>::T T;
    typedef typename Num<T>::C C;
    const Pack<A, V> x = load<V>(a + i);
    const Pack<B, V> y = load<V>(b + i);
    Pack<O, V> r;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const C u = Num<T>::to(convert<T>(x.v[j]));
      const C w = Num<T>::to(convert<T>(y.v[j]));
      r.v[j] = convert<O>(Num<T>::from(Op::apply(u, w)));  // rounded to T once, then to O
    }
    store<V>(out + i, r);
  }
};

// out = a (op) b; out may alias a or b (each element is read before it is written).
template <class Op, class A, class B, class O>
__global__ void reduce_kernel(O* out, const A* a, const B* b, i64 n, int vec) {
  run_elementwise(ReduceF<Op, A, B, O>{out, a, b}, n, vec);
}

// ---------------------------------------------------------------------------- divide
template <class I, class O> struct DivideF {
  O* out;
  const I* in;
  double divisor;
  template <int V> RC_FN void apply(i64 i) const {
    // 16-bit floats divide in float32 (ops/numpy.py divide), the others in their own type.
    typedef typename Num<I>::C C;
    const C d = Cvt<C>::of(divisor);
    const Pack<I, V> x = load<V>(in + i);
    Pack<O, V> r;
#pragma unroll
    for (int j = 0; j < V; ++j) r.v[j] = convert<O>(quotient(Num<I>::to(x.v[j]), d));
    store<V>(out + i, r);
  }
  static RC_FN float quotient(float a, float b) { return fdiv(a, b); }
  static RC_FN double quotient(double a, double b) { return ddiv(a, b); }
};

template <class I, class O>
__global__ void divide_kernel(O* out, const I* in, double divisor, i64 n, int vec) {
  run_elementwise(DivideF<I, O>{out, in, divisor}, n, vec);
}

// ------------------------------------------------------------------------ compensate
template <class T> struct CompensateF {
  float* out;
  const T* x;
  const float* residual;
  template <int V> RC_FN void apply(i64 i) const {
    const Pack<T, V> a = load<V>(x + i);
    const Pack<float, V> r = load<V>(residual + i);
    Pack<float, V> o;
#pragma unroll
    for (int j = 0; j < V; ++j) o.v[j] = fadd(convert<float>(a.v[j]), r.v[j]);
    store<V>(out + i, o);
  }
};

// out = float32(x) + residual: the input of a compressed call with error feedback.
template <class T>
__global__ void compensate_kernel(float* out, const T* x, const float* residual, i64 n, int vec) {
  run_elementwise(CompensateF<T>{out, x, residual}, n, vec);
}

// -------------------------------------------------------------------- zero_nonfinite
template <class T> struct ZeroNonfiniteF {
  T* x;
  template <int V> RC_FN void apply(i64 i) const {
    Pack<T, V> a = load<V>(x + i);
    bool bad = false;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (!is_finite(Num<T>::to(a.v[j]))) {
        a.v[j] = Num<T>::from(0);
        bad = true;
      }
    }
    if (bad) store<V>(x + i, a);  // most groups are finite: leave their bytes alone
  }
  static RC_FN bool is_finite(float v) { return finite_f(v); }
  static RC_FN bool is_finite(double v) { return finite_d(v); }
};

template <class T> __global__ void zero_nonfinite_kernel(T* x, i64 n, int vec) {
  run_elementwise(ZeroNonfiniteF<T>{x}, n, vec);
}

// ------------------------------------------------------------------------- uniforms
__global__ void uniform_kernel(float* out, i64 n, u32 seed, u32 base) {
  for (i64 i = global_thread(); i < n; i += thread_count()) {
    out[i] = uniform01(seed, base + (u32)i);
  }
}

// ------------------------------------------------------------------- sparse helpers
// The index of topk_overflow_kernel's mark (ops/_topk_plan.py OVERFLOW).
enum : int { TOPK_OVERFLOW = -1 };

// out[idx[i]] += val[i]; the indices of one payload are unique, so no two threads collide.
// A payload whose first pair is topk_overflow_kernel's mark makes every entry of out NaN.
__global__ void scatter_add_kernel(float* out, i64 n, const int* idx, const float* val, i64 k) {
  if (idx[0] == TOPK_OVERFLOW) {
    for (i64 i = global_thread(); i < n; i += thread_count()) out[i] = ffrom(QUIET_NAN);
    return;
  }
  for (i64 i = global_thread(); i < k; i += thread_count()) {
    const int j = idx[i];
    out[j] = fadd(out[j], val[i]);
  }
}

// The sum of v over one block of OVERFLOW_THREADS threads, in every thread.
constexpr int OVERFLOW_THREADS = 256;
RC_FN i64 block_total(i64 v, i64* part) {
  part[threadIdx.x] = v;
  __syncthreads();
  i64 total = 0;
  for (int t = 0; t < OVERFLOW_THREADS; ++t) total += part[t];
  __syncthreads();  // part is free again
  return total;
}

// Marks a selection of k entries of x (n > k) that left non-finite entries behind: when all of
// its values are non-finite and x holds more than k NaN or Inf, its first pair becomes
// (TOPK_OVERFLOW, NaN). One block; x is read only in that rare case.
__global__ void topk_overflow_kernel(const float* x, i64 n, int* idx, float* val, i64 k) {
  __shared__ i64 part[OVERFLOW_THREADS];
  i64 finite = 0;
  for (i64 i = threadIdx.x; i < k && !finite; i += OVERFLOW_THREADS) finite = finite_f(val[i]);
  if (block_total(finite, part) > 0) return;
  i64 bad = 0;
  for (i64 i = threadIdx.x; i < n; i += OVERFLOW_THREADS) bad += finite_f(x[i]) ? 0 : 1;
  if (block_total(bad, part) > k && threadIdx.x == 0) {
    idx[0] = TOPK_OVERFLOW;
    val[0] = ffrom(QUIET_NAN);
  }
}

struct FiniteCopyF {
  float* out;
  const float* in;
  template <int V> RC_FN void apply(i64 i) const {
    Pack<float, V> a = load<V>(in + i);
#pragma unroll
    for (int j = 0; j < V; ++j) a.v[j] = finite_or_zero(a.v[j]);
    store<V>(out + i, a);
  }
};

// The top-k residual, first pass: error = acc with NaN/Inf as 0.
__global__ void finite_copy_kernel(float* error, const float* acc, i64 n, int vec) {
  run_elementwise(FiniteCopyF{error, acc}, n, vec);
}

// The top-k residual, second pass: the selected entries were sent, so nothing of them remains
// (the overflow mark is not an entry).
__global__ void scatter_zero_kernel(float* error, const int* idx, i64 k) {
  for (i64 i = global_thread(); i < k; i += thread_count()) {
    if (idx[i] != TOPK_OVERFLOW) error[idx[i]] = 0.0f;
  }
}

}  // namespace rc
