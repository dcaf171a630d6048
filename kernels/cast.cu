// fp16 / bf16 casts of float32 and their reduce-scatter hop (decode, add this rank's float32
// contribution, round again), each writing its rounding error in the same pass.
// Twins: ops/numpy.py cast_*. Payload: one 16-bit word per element.
#include "common.cuh"

namespace rc {

struct FmtF16 {
  static RC_FN u16 encode(float x) { return f32_to_f16(x); }
  static RC_FN float decode(u16 w) { return f16_to_f32(w); }
};
struct FmtBF16 {
  static RC_FN u16 encode(float x) { return f32_to_bf16_wire(x); }
  static RC_FN float decode(u16 w) { return bf16_to_f32(w); }
};

template <class F, int V>
RC_FN void round_words(const Pack<float, V>& x, u16* out, float* err, i64 i) {
  Pack<u16, V> w;
  Pack<float, V> e;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    w.v[j] = F::encode(x.v[j]);
    e.v[j] = finite_or_zero(fsub(x.v[j], F::decode(w.v[j])));
  }
  store<V>(out + i, w);
  if (err != nullptr) store<V>(err + i, e);
}

template <class F> struct CastEncodeF {
  u16* out;
  const float* src;
  float* err;
  template <int V> RC_FN void apply(i64 i) const {
    round_words<F, V>(load<V>(src + i), out, err, i);
  }
};

template <class F> struct CastHopF {
  u16* out;
  const u16* in;
  const float* own;
  float* err;
  template <int V> RC_FN void apply(i64 i) const {
    const Pack<u16, V> w = load<V>(in + i);
    const Pack<float, V> o = load<V>(own + i);
    Pack<float, V> acc;
    // A NaN sum goes out as the quiet NaN, whatever NaN the hardware's addition returned.
#pragma unroll
    for (int j = 0; j < V; ++j) acc.v[j] = quiet_nan_of(fadd(F::decode(w.v[j]), o.v[j]));
    round_words<F, V>(acc, out, err, i);
  }
};

template <class F> struct CastDecodeF {
  float* out;
  const u16* in;
  template <int V> RC_FN void apply(i64 i) const {
    const Pack<u16, V> w = load<V>(in + i);
    Pack<float, V> o;
#pragma unroll
    for (int j = 0; j < V; ++j) o.v[j] = F::decode(w.v[j]);
    store<V>(out + i, o);
  }
};

// out = round(src); err (nullable) = src - decode(out), 0 where not finite.
template <class F>
__global__ void cast_encode_kernel(u16* out, const float* src, float* err, i64 n, int vec) {
  run_elementwise(CastEncodeF<F>{out, src, err}, n, vec);
}

// out = round(decode(in) + own), a NaN sum as the quiet NaN; err (nullable) = the sum -
// decode(out). out may be in.
template <class F>
__global__ void cast_hop_kernel(u16* out, const u16* in, const float* own, float* err, i64 n,
                                int vec) {
  run_elementwise(CastHopF<F>{out, in, own, err}, n, vec);
}

template <class F> __global__ void cast_decode_kernel(float* out, const u16* in, i64 n, int vec) {
  run_elementwise(CastDecodeF<F>{out, in}, n, vec);
}

}  // namespace rc
