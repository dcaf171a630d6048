// int8 block quantization (absmax per block, optional stochastic rounding) and the fused
// reduce-scatter hop: decode the received payload, add this rank's contribution, quantize
// again and write the requantization error, in one pass. Twins: ops/numpy.py int8_*.
//
// Payload: nb float32 scales (absmax / 127), then n int8 codes. A team of `team` lanes (a power
// of two <= 32) handles one block; lane `sub` owns the runs of 4 consecutive elements sub,
// sub + team, ... so loads are 16-byte and code stores 4-byte where aligned. Blocks of up to
// 4 * team * QREGS elements stay in registers between the absmax pass and the quantize pass;
// longer blocks are read twice.
#include "common.cuh"

namespace rc {

constexpr int QREGS = 4;

// Bits of the `vec` argument: which arrays may move 4 elements at a time (host-checked).
constexpr int VEC_F = 1;  // the float32 input (src, or own for a hop)
constexpr int VEC_Q = 2;  // the int8 codes, in and out
constexpr int VEC_E = 4;  // the error output

struct QuantArgs {
  unsigned char* payload;
  float* err;
  i64 n;
  int block;
  int team;
  u32 seed;
  u32 base;
  int vec;
};

// Elements in run r of a block of len (4, fewer at the end, <= 0 past it).
RC_FN int run_len(int len, int r) {
  const int c = len - 4 * r;
  return c < 4 ? c : 4;
}

struct EncodeSrc {
  const float* x;
  bool vec;
  RC_FN void begin(i64) {}
  RC_FN bool vectorized() const { return vec; }
  // A full run of 4 at an aligned element (vectorized() only): one unconditional load.
  RC_FN void load4_full(i64 i, float v[4]) const {
    const Pack<float, 4> p = load<4>(x + i);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = p.v[j];
  }
  RC_FN void load4(i64 i, int cnt, float v[4]) const {
    if (vec && cnt == 4) {
      const Pack<float, 4> p = load<4>(x + i);
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = p.v[j];
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = j < cnt ? x[i + j] : 0.0f;
    }
  }
};

// The hop's input: q * scale of the received payload plus this rank's own values, the sum
// rounded once in float32 (as ops/numpy.py int8_hop).
struct HopSrc {
  const float* scales;
  const signed char* q;
  const float* own;
  bool vec_f;
  bool vec_q;
  float scale;
  RC_FN void begin(i64 b) { scale = scales[b]; }
  RC_FN bool vectorized() const { return vec_f && vec_q; }
  RC_FN void load4_full(i64 i, float v[4]) const {
    const Pack<signed char, 4> c = load<4>(q + i);
    const Pack<float, 4> o = load<4>(own + i);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = fadd(fmul((float)c.v[j], scale), o.v[j]);
  }
  RC_FN void load4(i64 i, int cnt, float v[4]) const {
    Pack<signed char, 4> c;
    Pack<float, 4> o;
    if (cnt == 4 && vec_q) {
      c = load<4>(q + i);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) c.v[j] = j < cnt ? q[i + j] : 0;
    }
    if (cnt == 4 && vec_f) {
      o = load<4>(own + i);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) o.v[j] = j < cnt ? own[i + j] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = j < cnt ? fadd(fmul((float)c.v[j], scale), o.v[j]) : 0.0f;
  }
};

RC_FN void absmax_update(const float v[4], float& amax, int& nan) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    nan |= isnan_f(v[j]) ? 1 : 0;
    amax = fmax_f(amax, abs_f(v[j]));  // fmaxf skips a NaN; the flag keeps it
  }
}

// Quantize the run of 4 at element i; write its codes and, when ERR, its error. STOCH and ERR
// are the kernel's template arguments: each combination is compiled without the others' work.
template <bool STOCH, bool ERR>
RC_FN void emit(const float x[4], i64 i, int cnt, float inv, float scale, const QuantArgs& a,
                signed char* q) {
  Pack<signed char, 4> c;
  Pack<float, 4> e;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float t = int8_code(x[j], inv, STOCH, a.seed, a.base + (u32)(i + j));
    c.v[j] = (signed char)(int)t;
    // From t, not the code: a zero keeps x's sign (x = -0.0 leaves +0.0), as in the twins.
    if (ERR) e.v[j] = finite_or_zero(fsub(x[j], fmul(t, scale)));
  }
  if (cnt == 4 && (a.vec & VEC_Q)) {
    store<4>(q + i, c);
  } else {
    for (int j = 0; j < cnt; ++j) q[i + j] = c.v[j];
  }
  if (ERR) {
    if (cnt == 4 && (a.vec & VEC_E)) {
      store<4>(a.err + i, e);
    } else {
      for (int j = 0; j < cnt; ++j) a.err[i + j] = e.v[j];
    }
  }
}

template <bool STOCH, bool ERR, class Src> RC_FN void quantize_blocks(Src src, const QuantArgs& a) {
  const i64 nb = (a.n + a.block - 1) / a.block;
  float* scales = reinterpret_cast<float*>(a.payload);
  signed char* q = reinterpret_cast<signed char*>(a.payload + 4 * nb);
  const int lane = threadIdx.x & 31;
  const int sub = lane & (a.team - 1);
  const int per_warp = 32 / a.team;
  const i64 warps = thread_count() >> 5;
  // The loop bound is the same for the whole warp, so every lane reaches the shuffles.
  for (i64 b0 = (global_thread() >> 5) * per_warp; b0 < nb; b0 += warps * per_warp) {
    const i64 b = b0 + lane / a.team;
    const i64 start = b * a.block;
    const int len = b < nb ? (int)(a.n - start < a.block ? a.n - start : a.block) : 0;
    const int runs = (len + 3) >> 2;
    if (len > 0) src.begin(b);
    float v[QREGS][4];
    float amax = 0.0f;
    int nan = 0;
    // A block the team holds whole in registers, every run full and aligned: its loads carry
    // no condition, so all are in flight before the first is used (the general path below
    // waits for each before deciding on the next). The same values either way.
    const bool whole = len == 4 * QREGS * a.team && src.vectorized();
    if (whole) {
#pragma unroll
      for (int j = 0; j < QREGS; ++j) src.load4_full(start + 4 * (j * a.team + sub), v[j]);
#pragma unroll
      for (int j = 0; j < QREGS; ++j) absmax_update(v[j], amax, nan);
    } else {
#pragma unroll
      for (int j = 0; j < QREGS; ++j) {
        const int r = j * a.team + sub;
        src.load4(start + 4 * r, r < runs ? run_len(len, r) : 0, v[j]);
        absmax_update(v[j], amax, nan);
      }
      for (int r = QREGS * a.team + sub; r < runs; r += a.team) {
        float t[4];
        src.load4(start + 4 * r, run_len(len, r), t);
        absmax_update(t, amax, nan);
      }
    }
    for (int o = a.team >> 1; o > 0; o >>= 1) {
      amax = fmax_f(amax, __shfl_xor_sync(FULL_MASK, amax, o, a.team));
      nan |= __shfl_xor_sync(FULL_MASK, nan, o, a.team);
    }
    float scale, inv;
    int8_params(nan ? ffrom(QUIET_NAN) : amax, scale, inv);
    if (len > 0 && sub == 0) scales[b] = scale;
    if (whole) {
#pragma unroll
      for (int j = 0; j < QREGS; ++j)
        emit<STOCH, ERR>(v[j], start + 4 * (j * a.team + sub), 4, inv, scale, a, q);
      continue;
    }
#pragma unroll
    for (int j = 0; j < QREGS; ++j) {
      const int r = j * a.team + sub;
      if (r < runs) emit<STOCH, ERR>(v[j], start + 4 * r, run_len(len, r), inv, scale, a, q);
    }
    for (int r = QREGS * a.team + sub; r < runs; r += a.team) {
      float t[4];
      src.load4(start + 4 * r, run_len(len, r), t);
      emit<STOCH, ERR>(t, start + 4 * r, run_len(len, r), inv, scale, a, q);
    }
  }
}

// Quantize float32 x[0:n] into payload; with ERR, err receives x - decode(payload) (it is
// ignored without). STOCH: stochastic rounding with the uniforms of (seed, base + i).
template <bool STOCH, bool ERR>
__global__ void int8_encode_kernel(const float* x, unsigned char* payload, float* err, i64 n,
                                   int block, int team, u32 seed, u32 base, int vec) {
  const QuantArgs a{payload, err, n, block, team, seed, base, vec};
  quantize_blocks<STOCH, ERR>(EncodeSrc{x, (vec & VEC_F) != 0}, a);
}

// One reduce-scatter hop: payload = quantize(decode(in) + own); with ERR, err receives the
// requantization error. `in` and `payload` must not overlap (the host copies `in` first).
template <bool STOCH, bool ERR>
__global__ void int8_hop_kernel(const unsigned char* in, const float* own, unsigned char* payload,
                                float* err, i64 n, int block, int team, u32 seed, u32 base,
                                int vec) {
  const i64 nb = (n + block - 1) / block;
  const QuantArgs a{payload, err, n, block, team, seed, base, vec};
  const HopSrc src{reinterpret_cast<const float*>(in),
                   reinterpret_cast<const signed char*>(in + 4 * nb), own,
                   (vec & VEC_F) != 0, (vec & VEC_Q) != 0, 0.0f};
  quantize_blocks<STOCH, ERR>(src, a);
}

// out[i] = q[i] * scale[block of i].
__global__ void int8_decode_kernel(const unsigned char* payload, float* out, i64 n, int block,
                                   int team, int vec) {
  const i64 nb = (n + block - 1) / block;
  const float* scales = reinterpret_cast<const float*>(payload);
  const signed char* q = reinterpret_cast<const signed char*>(payload + 4 * nb);
  const int lane = threadIdx.x & 31;
  const int sub = lane & (team - 1);
  const int per_warp = 32 / team;
  const i64 warps = thread_count() >> 5;
  for (i64 b0 = (global_thread() >> 5) * per_warp; b0 < nb; b0 += warps * per_warp) {
    const i64 b = b0 + lane / team;
    if (b >= nb) continue;
    const i64 start = b * block;
    const int len = (int)(n - start < block ? n - start : block);
    const float scale = scales[b];
    for (int r = sub; 4 * r < len; r += team) {
      const i64 i = start + 4 * r;
      const int cnt = run_len(len, r);
      Pack<signed char, 4> c;
      if (cnt == 4 && (vec & VEC_Q)) {
        c = load<4>(q + i);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) c.v[j] = j < cnt ? q[i + j] : 0;
      }
      Pack<float, 4> o;
#pragma unroll
      for (int j = 0; j < 4; ++j) o.v[j] = fmul((float)c.v[j], scale);
      if (cnt == 4 && (vec & VEC_F)) {
        store<4>(out + i, o);
      } else {
        for (int j = 0; j < cnt; ++j) out[i + j] = o.v[j];
      }
    }
  }
}

}  // namespace rc
