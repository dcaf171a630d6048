// Low-rank products of PowerSGD on float32 matrices: the result P Q^T as a sum of outer
// products, and this rank's residual M - P Q^T. P^T (r x n) and Q^T (r x m) are row-major; the
// n x m matrix is row-major. Every product and every sum is rounded on its own, in k order, as
// ops/numpy.py computes them, so the result has the same bits on every rank and on the host.
// Twins: ops/numpy.py outer_sum, subtract_outer, and the *_parts and dense_runs below.
#include "common.cuh"

namespace rc {

// Element e of an n x m matrix, for P^T (r x n) and Q^T (r x m): (P Q^T)[e] summed in k order,
// and v - (P Q^T)[e] one outer product at a time (what every kernel below writes).
RC_FN float outer_at(const float* pt, const float* qt, i64 n, i64 m, i64 r, i64 e) {
  const i64 i = e / m, j = e - i * m;
  float acc = fmul(pt[i], qt[j]);
  for (i64 k = 1; k < r; ++k) acc = fadd(acc, fmul(pt[k * n + i], qt[k * m + j]));
  return acc;
}

RC_FN float minus_outer_at(float v, const float* pt, const float* qt, i64 n, i64 m, i64 r,
                           i64 e) {
  const i64 i = e / m, j = e - i * m;
  for (i64 k = 0; k < r; ++k) v = fsub(v, fmul(pt[k * n + i], qt[k * m + j]));
  return v;
}

// out = sum_k pt[k, :] (outer) qt[k, :]
__global__ void outer_sum_kernel(float* out, const float* pt, const float* qt, i64 n, i64 m,
                                 int r) {
  for (i64 e = global_thread(); e < n * m; e += thread_count()) {
    out[e] = outer_at(pt, qt, n, m, r, e);
  }
}

// mat -= pt[k, :] (outer) qt[k, :] for k = 0 .. r-1, in that order
__global__ void subtract_outer_kernel(float* mat, const float* pt, const float* qt, i64 n,
                                      i64 m, int r) {
  for (i64 e = global_thread(); e < n * m; e += thread_count()) {
    mat[e] = minus_outer_at(mat[e], pt, qt, n, m, r, e);
  }
}

// ------------------------------------------------------------ every tensor of a call at once
// PowerSGD's passes over all the low-rank tensors of a flat buffer in one launch, instead of one
// each. A tensor's row of `parts` (int64, PART_FIELDS of them): its offset in the flat buffer,
// rows n, cols m, rank r, and where its P^T (r x n) and Q^T (r x m) start in their buffers.
// The 1-D grid has per_part blocks for each tensor: block b serves tensor b / per_part, its
// threads striding over that tensor's elements. Twins: ops/numpy.py *_parts.
constexpr int PART_FIELDS = 6;

struct LowRankPart {
  i64 at, n, m, r, p, q;
};

RC_FN LowRankPart part_row(const i64* parts, int per_part) {
  const i64* row = parts + (i64)(blockIdx.x / per_part) * PART_FIELDS;
  return LowRankPart{row[0], row[1], row[2], row[3], row[4], row[5]};
}

RC_FN i64 part_first(int per_part) {
  return (i64)(blockIdx.x % per_part) * blockDim.x + threadIdx.x;
}

RC_FN i64 part_stride(int per_part) { return (i64)per_part * blockDim.x; }

// out[at:] = P Q^T of every tensor (as outer_sum_kernel)
__global__ void outer_sum_parts_kernel(float* out, const float* p, const float* q,
                                       const i64* parts, int per_part) {
  const LowRankPart t = part_row(parts, per_part);
  const float* pt = p + t.p;
  const float* qt = q + t.q;
  for (i64 e = part_first(per_part); e < t.n * t.m; e += part_stride(per_part)) {
    out[t.at + e] = outer_at(pt, qt, t.n, t.m, t.r, e);
  }
}

// mat[at:] -= P Q^T of every tensor, one outer product at a time (as subtract_outer_kernel)
__global__ void subtract_outer_parts_kernel(float* mat, const float* p, const float* q,
                                            const i64* parts, int per_part) {
  const LowRankPart t = part_row(parts, per_part);
  const float* pt = p + t.p;
  const float* qt = q + t.q;
  for (i64 e = part_first(per_part); e < t.n * t.m; e += part_stride(per_part)) {
    mat[t.at + e] = minus_outer_at(mat[t.at + e], pt, qt, t.n, t.m, t.r, e);
  }
}

// p[t.p] = NaN (the first entry of the tensor's P^T) where its matrix holds a NaN, an Inf or
// an entry above FLT_MAX / (n ranks r) in magnitude, past which Q (at most n ranks times the
// largest entry, P's entries being at most 1), the result (r times Q's largest) or the
// residual could overflow: such a tensor goes dense (several threads may write the mark, all
// the same bits). The bound is a double, the same division as the NumPy twin's.
__global__ void mark_dense_parts_kernel(const float* mat, float* p, const i64* parts,
                                        int per_part, int ranks) {
  const LowRankPart t = part_row(parts, per_part);
  const double limit = ddiv(3.4028234663852886e38, (double)t.n * (double)ranks * (double)t.r);
  for (i64 e = part_first(per_part); e < t.n * t.m; e += part_stride(per_part)) {
    const float x = mat[t.at + e];
    if (!(f2d(x < 0.0f ? -x : x) <= limit)) {
      p[t.p] = ffrom(QUIET_NAN);
      return;
    }
  }
}

// The dense tensors of a call, runs of them (int64, 3 per run: offset in src, offset in dst,
// length), one launch for all, per_part blocks a run. take: src's values are zero afterwards
// (they left for the wire); divisor > 0: dst = src / divisor (float32, as NumPy divides).
__global__ void dense_runs_kernel(float* dst, float* src, const i64* runs, int per_part,
                                  int take, float divisor) {
  const i64* run = runs + (i64)(blockIdx.x / per_part) * 3;
  const i64 from = run[0], to = run[1], len = run[2];
  for (i64 e = part_first(per_part); e < len; e += part_stride(per_part)) {
    const float v = src[from + e];
    dst[to + e] = divisor > 0.0f ? fdiv(v, divisor) : v;
    if (take) src[from + e] = 0.0f;
  }
}

}  // namespace rc
