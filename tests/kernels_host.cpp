// The scalar arithmetic of kernels/common.cuh built as host code, behind a C interface that
// tests/test_kernels_host.py calls through ctypes and compares with ringcomm/ops/numpy.py.
// The loops mirror what each kernel computes per element (the kernels only add parallelism).
#include "common.cuh"

using namespace rc;

extern "C" {

void f32_to_f16_n(const float* x, u16* y, i64 n) {
  for (i64 i = 0; i < n; ++i) y[i] = f32_to_f16(x[i]);
}
void f64_to_f16_n(const double* x, u16* y, i64 n) {
  for (i64 i = 0; i < n; ++i) y[i] = f64_to_f16(x[i]);
}
void f16_to_f32_n(const u16* x, float* y, i64 n) {
  for (i64 i = 0; i < n; ++i) y[i] = f16_to_f32(x[i]);
}
void f16_to_f64_n(const u16* x, double* y, i64 n) {
  for (i64 i = 0; i < n; ++i) y[i] = f16_to_f64(x[i]);
}
void f32_to_f64_n(const float* x, double* y, i64 n) {
  for (i64 i = 0; i < n; ++i) y[i] = f32_to_f64(x[i]);
}
void f64_to_f32_n(const double* x, float* y, i64 n) {
  for (i64 i = 0; i < n; ++i) y[i] = f64_to_f32(x[i]);
}
void f32_to_bf16_wire_n(const float* x, u16* y, i64 n) {
  for (i64 i = 0; i < n; ++i) y[i] = f32_to_bf16_wire(x[i]);
}
void f64_to_i32_n(const double* x, int* y, i64 n) {
  for (i64 i = 0; i < n; ++i) y[i] = Cvt<int>::of(x[i]);
}
void f64_to_i64_n(const double* x, long long* y, i64 n) {
  for (i64 i = 0; i < n; ++i) y[i] = Cvt<long long>::of(x[i]);
}
void uniform_n(u32 seed, u32 base, float* y, i64 n) {
  for (i64 i = 0; i < n; ++i) y[i] = uniform01(seed, base + (u32)i);
}

// reduce_kernel<Op, half_t, half_t, half_t> and <Op, float, half_t, float>; op 0..3 = sum,
// min, max, prod.
static float apply(int op, float a, float b) {
  if (op == 0) return OpSum::apply(a, b);
  if (op == 1) return OpMin::apply(a, b);
  if (op == 2) return OpMax::apply(a, b);
  return OpProd::apply(a, b);
}
void reduce_f16_n(int op, const u16* a, const u16* b, u16* out, i64 n) {
  for (i64 i = 0; i < n; ++i) out[i] = f32_to_f16(apply(op, f16_to_f32(a[i]), f16_to_f32(b[i])));
}
void reduce_f32_f16_n(int op, const float* a, const u16* b, float* out, i64 n) {
  for (i64 i = 0; i < n; ++i) out[i] = apply(op, a[i], f16_to_f32(b[i]));
}
void divide_f32_to_f16_n(const float* x, double divisor, u16* out, i64 n) {
  for (i64 i = 0; i < n; ++i) out[i] = f32_to_f16(fdiv(x[i], Cvt<float>::of(divisor)));
}

// int8_encode_kernel / int8_hop_kernel, one block after another. `own` null: encode x.
void int8_quantize_n(const unsigned char* in, const float* own_or_x, unsigned char* payload,
                     float* err, i64 n, int block, int stochastic, u32 seed, u32 base) {
  const i64 nb = (n + block - 1) / block;
  float* scales = reinterpret_cast<float*>(payload);
  signed char* q = reinterpret_cast<signed char*>(payload + 4 * nb);
  const float* in_scales = reinterpret_cast<const float*>(in);
  const signed char* in_q = in ? reinterpret_cast<const signed char*>(in + 4 * nb) : nullptr;
  for (i64 b = 0; b < nb; ++b) {
    const i64 start = b * block;
    const i64 len = n - start < block ? n - start : block;
    float* v = new float[len];
    float amax = 0.0f;
    int nan = 0;
    for (i64 j = 0; j < len; ++j) {
      const i64 i = start + j;
      v[j] = in ? fadd(fmul((float)in_q[i], in_scales[b]), own_or_x[i]) : own_or_x[i];
      nan |= isnan_f(v[j]) ? 1 : 0;
      amax = fmax_f(amax, abs_f(v[j]));
    }
    float scale, inv;
    int8_params(nan ? ffrom(QUIET_NAN) : amax, scale, inv);
    scales[b] = scale;
    for (i64 j = 0; j < len; ++j) {
      const i64 i = start + j;
      q[i] = (signed char)(int)int8_code(v[j], inv, stochastic != 0, seed, base + (u32)i);
      if (err) err[i] = finite_or_zero(fsub(v[j], fmul((float)q[i], scale)));
    }
    delete[] v;
  }
}

// cast_encode_kernel / cast_hop_kernel (fmt 0: f16, 1: bf16). `in` null: encode.
void cast_round_n(int fmt, const u16* in, const float* own_or_x, u16* out, float* err, i64 n) {
  for (i64 i = 0; i < n; ++i) {
    float x = own_or_x[i];
    if (in) x = quiet_nan_of(fadd(fmt ? bf16_to_f32(in[i]) : f16_to_f32(in[i]), x));
    out[i] = fmt ? f32_to_bf16_wire(x) : f32_to_f16(x);
    if (err) err[i] = finite_or_zero(fsub(x, fmt ? bf16_to_f32(out[i]) : f16_to_f32(out[i])));
  }
}

}  // extern "C"
