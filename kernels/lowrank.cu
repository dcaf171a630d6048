// Low-rank products of PowerSGD on float32 matrices: the result P Q^T as a sum of outer
// products, and this rank's residual M - P Q^T. P^T (r x n) and Q^T (r x m) are row-major; the
// n x m matrix is row-major. Every product and every sum is rounded on its own, in k order, as
// ops/numpy.py computes them, so the result has the same bits on every rank and on the host.
// Twins: ops/numpy.py outer_sum, subtract_outer.
#include "common.cuh"

namespace rc {

// out = sum_k pt[k, :] (outer) qt[k, :]
__global__ void outer_sum_kernel(float* out, const float* pt, const float* qt, i64 n, i64 m,
                                 int r) {
  const i64 total = n * m;
  for (i64 e = global_thread(); e < total; e += thread_count()) {
    const i64 i = e / m, j = e - i * m;
    float acc = fmul(pt[i], qt[j]);
    for (int k = 1; k < r; ++k) acc = fadd(acc, fmul(pt[k * n + i], qt[k * m + j]));
    out[e] = acc;
  }
}

// mat -= pt[k, :] (outer) qt[k, :] for k = 0 .. r-1, in that order
__global__ void subtract_outer_kernel(float* mat, const float* pt, const float* qt, i64 n,
                                      i64 m, int r) {
  const i64 total = n * m;
  for (i64 e = global_thread(); e < total; e += thread_count()) {
    const i64 i = e / m, j = e - i * m;
    float v = mat[e];
    for (int k = 0; k < r; ++k) v = fsub(v, fmul(pt[k * n + i], qt[k * m + j]));
    mat[e] = v;
  }
}

}  // namespace rc
