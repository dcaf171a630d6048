// Top-k selection by magnitude: an exact radix select on the magnitude's bits, and an
// order-preserving compaction that writes the selected (int32 index, float32 value) pairs with
// ascending indices. Twins: ops/numpy.py topk and sample_threshold.
//
// Keys are |x|'s bits, which order like the magnitudes (NaN above Inf above every number).
// Three histogram passes (11, 10 and 10 bits, each over the keys that match the bits decided
// so far) find the k-th largest key T and how many keys equal to T belong to the top k; ties at
// T go to the lowest indices, so the result is deterministic. The compaction counts, per tile,
// the keys at or above each of a few limits, scans those counts, and writes every tile's
// selection in index order: all or the first kA keys of a class A (keys >= one limit), then
// the first kB keys of a class B (keys in [another limit, the first)). Exact top-k is
// A = keys > T, B = keys == T; DGC's approximate selection is A = the non-finite, B = the
// finite keys at or above the sampled threshold (or one of its halvings).
#include "common.cuh"

namespace rc {

constexpr int SEL_BINS = 2048;                     // histogram of an 11-bit digit
constexpr int SEL_THREADS = 256;                   // count / write kernels
constexpr int SEL_WARPS = SEL_THREADS / 32;
constexpr int SEL_ITEMS = 16;
constexpr int SEL_TILE = SEL_THREADS * SEL_ITEMS;  // elements per tile
constexpr int SCAN_ITEMS = 8;
constexpr int MAX_LIMITS = 11;  // limits one count pass compares against

// Radix-select state in device memory (8 words): the high bits of T decided so far, which bits
// those are, how many keys matching them still belong to the top k; once T is complete,
// lims[0] = T + 1 (keys above T) and lims[1] = T.
struct SelectState {
  u32 prefix;
  u32 mask;
  long long need;
  u32 lims[4];
};

// Exclusive prefix sum over the block (blockDim.x a multiple of 32); `total` gets the sum.
RC_FN u32 block_exclusive_sum(u32 v, u32* warp_sums, u32& total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  u32 x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const u32 y = __shfl_up_sync(FULL_MASK, x, o);
    if (lane >= o) x += y;
  }
  __syncthreads();  // warp_sums may still be read by a previous call
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    u32 w = lane < nwarps ? warp_sums[lane] : 0u;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const u32 y = __shfl_up_sync(FULL_MASK, w, o);
      if (lane >= o) w += y;
    }
    warp_sums[lane] = w;  // inclusive; lanes past the last warp hold the total
  }
  __syncthreads();
  total = warp_sums[31];
  return x - v + (warp ? warp_sums[warp - 1] : 0u);
}

struct HistCounter {
  u32* sh;
  u32 prefix;
  u32 mask;
  int shift;
  u32 digits;
  RC_FN void operator()(float v) const {
    const u32 key = mag_key(v);
    if ((key & mask) == prefix) atomicAdd(&sh[(key >> shift) & digits], 1u);
  }
};

// hist[d] += number of keys x[off + i * stride] (i < m) matching the decided bits whose digit
// (bits [shift, shift + bits)) is d. hist must be zero (select_pick leaves it so).
__global__ void select_hist(const float* x, i64 off, i64 stride, i64 m, const SelectState* st,
                            int shift, int bits, u32* hist, int vec) {
  __shared__ u32 sh[SEL_BINS];
  const int nbins = 1 << bits;
  for (int b = threadIdx.x; b < nbins; b += blockDim.x) sh[b] = 0;
  __syncthreads();
  const HistCounter count{sh, st->prefix, st->mask, shift, (u32)(nbins - 1)};
  i64 done = 0;
  if (vec) {  // stride 1, x 16-byte aligned
    const i64 groups = m >> 2;
    for (i64 g = global_thread(); g < groups; g += thread_count()) {
      const Pack<float, 4> p = load<4>(x + (g << 2));
#pragma unroll
      for (int j = 0; j < 4; ++j) count(p.v[j]);
    }
    done = groups << 2;
  }
  for (i64 i = done + global_thread(); i < m; i += thread_count()) count(x[off + i * stride]);
  __syncthreads();
  for (int b = threadIdx.x; b < nbins; b += blockDim.x) {
    if (sh[b]) atomicAdd(&hist[b], sh[b]);
  }
}

// One block of SEL_THREADS threads: find the digit of the k-th largest key from the
// histogram, fold it into the state, and clear the histogram for the next pass.
__global__ void select_pick(u32* hist, SelectState* st, int shift, int bits, long long k,
                            int first) {
  constexpr int PER_THREAD = SEL_BINS / SEL_THREADS;
  __shared__ u32 warp_sums[32];
  const int nbins = 1 << bits;
  const long long need = first ? k : st->need;
  // Thread t owns PER_THREAD consecutive bins counted from the top: the scan runs from the
  // largest digit down.
  const int top = nbins - 1 - PER_THREAD * (int)threadIdx.x;
  u32 h[PER_THREAD];
  u32 sum = 0;
#pragma unroll
  for (int q = 0; q < PER_THREAD; ++q) {
    h[q] = top - q >= 0 ? hist[top - q] : 0u;
    sum += h[q];
  }
  u32 total;
  long long above = block_exclusive_sum(sum, warp_sums, total);
  int bin = -1;
#pragma unroll
  for (int q = 0; q < PER_THREAD; ++q) {
    if (bin < 0 && top - q >= 0 && above < need && need <= above + h[q]) bin = top - q;
    if (bin < 0) above += h[q];
  }
  if (bin >= 0) {  // exactly one thread: every thread read `need` before the scan's barriers
    const u32 prefix = (first ? 0u : st->prefix) | ((u32)bin << shift);
    st->prefix = prefix;
    st->mask = (first ? 0u : st->mask) | ((u32)(nbins - 1) << shift);
    st->need = need - above;
    if (shift == 0) {
      st->lims[0] = prefix + 1;
      st->lims[1] = prefix;
    }
  }
#pragma unroll
  for (int q = 0; q < PER_THREAD; ++q) {
    if (top - q >= 0) hist[top - q] = 0;
  }
}

// The sampled path's limits: the sampled threshold and its eight halvings (as float32, the
// way NumPy compares a float32 array with a Python float; NaN lets everything pass), then Inf
// (the non-finite class) and 0 (every key).
__global__ void sample_limits(const SelectState* st, u32* lims) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    double thr = (double)ffrom(st->prefix);
    for (int h = 0; h < 9; ++h) {
      const float f = f64_to_f32(thr);
      lims[h] = isnan_f(f) ? 0u : mag_key(f);
      thr = dmul(thr, 0.5);
    }
    lims[9] = 0x7f800000u;
    lims[10] = 0u;
  }
}

// counts[j * ntiles + tile] = keys >= lims[j] in the tile (j < nthr <= MAX_LIMITS), and
// totals[j] (zeroed by the caller) their sum over the tiles.
__global__ void select_count(const float* x, i64 m, const u32* lims, int nthr, u32* counts,
                             i64 ntiles, u32* totals) {
  __shared__ u32 sh[MAX_LIMITS][SEL_WARPS];
  const i64 base = (i64)blockIdx.x * SEL_TILE;
  u32 lim[MAX_LIMITS];
  u32 c[MAX_LIMITS];
#pragma unroll
  for (int j = 0; j < MAX_LIMITS; ++j) {
    lim[j] = j < nthr ? lims[j] : 0xffffffffu;  // no key reaches it
    c[j] = 0;
  }
#pragma unroll
  for (int it = 0; it < SEL_ITEMS; ++it) {
    const i64 i = base + it * SEL_THREADS + threadIdx.x;
    if (i < m) {
      const u32 key = mag_key(x[i]);
#pragma unroll
      for (int j = 0; j < MAX_LIMITS; ++j) c[j] += key >= lim[j] ? 1u : 0u;
    }
  }
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < MAX_LIMITS; ++j) {
    for (int o = 16; o > 0; o >>= 1) c[j] += __shfl_xor_sync(FULL_MASK, c[j], o);
    if (lane == 0) sh[j][warp] = c[j];
  }
  __syncthreads();
  if ((int)threadIdx.x < nthr) {
    u32 s = 0;
    for (int w = 0; w < SEL_WARPS; ++w) s += sh[threadIdx.x][w];
    counts[threadIdx.x * ntiles + blockIdx.x] = s;
    atomicAdd(&totals[threadIdx.x], s);
  }
}

// Turn rows of tile counts into exclusive offsets, in place: block 0 scans row_a, block 1
// (when launched) row_b. Only the rows a compaction uses are scanned.
__global__ void select_scan(u32* counts, i64 ntiles, int row_a, int row_b) {
  __shared__ u32 warp_sums[32];
  u32* row = counts + (blockIdx.x == 0 ? row_a : row_b) * ntiles;
  u32 carry = 0;
  for (i64 s = 0; s < ntiles; s += (i64)blockDim.x * SCAN_ITEMS) {
    const i64 i0 = s + (i64)threadIdx.x * SCAN_ITEMS;
    u32 v[SCAN_ITEMS];
    u32 sum = 0;
#pragma unroll
    for (int q = 0; q < SCAN_ITEMS; ++q) {
      v[q] = i0 + q < ntiles ? row[i0 + q] : 0u;
      sum += v[q];
    }
    u32 total;
    u32 run = carry + block_exclusive_sum(sum, warp_sums, total);
#pragma unroll
    for (int q = 0; q < SCAN_ITEMS; ++q) {
      if (i0 + q < ntiles) row[i0 + q] = run;
      run += v[q];
    }
    carry += total;
  }
}

// Exclusive scan, in index order, of the per-(item, warp) counts of a tile (run by warp 0).
RC_FN void scan_tile_counts(u32* counts) {
  const int lane = threadIdx.x & 31;
  constexpr int PER_LANE = SEL_ITEMS * SEL_WARPS / 32;
  u32 v[PER_LANE];
  u32 sum = 0;
#pragma unroll
  for (int q = 0; q < PER_LANE; ++q) {
    v[q] = counts[lane * PER_LANE + q];
    sum += v[q];
  }
  u32 x = sum;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const u32 y = __shfl_up_sync(FULL_MASK, x, o);
    if (lane >= o) x += y;
  }
  u32 run = x - sum;
#pragma unroll
  for (int q = 0; q < PER_LANE; ++q) {
    counts[lane * PER_LANE + q] = run;
    run += v[q];
  }
}

// Write the selected entries of each tile in index order: the first ka keys >= lims[ja]
// (class A), and when jb >= 0 the first kb keys in [lims[jb], lims[ja]) (class B), kb being
// st->need when st is given. offsets are select_scan's rows; out_idx gets ids[i] (i itself
// when ids is null), out_val x[i].
__global__ void select_write(const float* x, const int* ids, i64 m, const u32* lims, int ja,
                             int jb, long long ka, long long kb, const SelectState* st,
                             const u32* offsets, i64 ntiles, int* out_idx, float* out_val) {
  __shared__ u32 sa[SEL_ITEMS * SEL_WARPS];
  __shared__ u32 sb[SEL_ITEMS * SEL_WARPS];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const u32 below = (1u << lane) - 1u;
  const i64 base = (i64)blockIdx.x * SEL_TILE;
  const u32 lim_a = lims[ja];
  const bool two = jb >= 0;
  const u32 lim_b = two ? lims[jb] : lim_a;  // class B is empty without one
  const long long take_b = !two ? 0 : (st != nullptr ? st->need : kb);
  float v[SEL_ITEMS];
#pragma unroll
  for (int it = 0; it < SEL_ITEMS; ++it) {
    const i64 i = base + it * SEL_THREADS + threadIdx.x;
    v[it] = i < m ? x[i] : 0.0f;
  }
  // Pass 1: how many of each class in each 32-element row of the tile.
#pragma unroll
  for (int it = 0; it < SEL_ITEMS; ++it) {
    const bool in = base + it * SEL_THREADS + threadIdx.x < m;
    const u32 key = mag_key(v[it]);
    const u32 a = __ballot_sync(FULL_MASK, in && key >= lim_a);
    const u32 b = __ballot_sync(FULL_MASK, in && key >= lim_b && key < lim_a);
    if (lane == 0) {
      sa[it * SEL_WARPS + warp] = __popc(a);
      sb[it * SEL_WARPS + warp] = __popc(b);
    }
  }
  __syncthreads();
  if (warp == 0) {
    scan_tile_counts(sa);
    scan_tile_counts(sb);
  }
  __syncthreads();
  // Pass 2: each selected element's place among all selected ones.
  const long long a_tile = offsets[ja * ntiles + blockIdx.x];
  const long long b_tile = two ? (long long)offsets[jb * ntiles + blockIdx.x] - a_tile : 0;
#pragma unroll
  for (int it = 0; it < SEL_ITEMS; ++it) {
    const i64 i = base + it * SEL_THREADS + threadIdx.x;
    const bool in = i < m;
    const u32 key = mag_key(v[it]);
    const bool is_a = in && key >= lim_a;
    const bool is_b = in && key >= lim_b && key < lim_a;
    const u32 a = __ballot_sync(FULL_MASK, is_a);
    const u32 b = __ballot_sync(FULL_MASK, is_b);
    const long long a_before = a_tile + sa[it * SEL_WARPS + warp] + __popc(a & below);
    const long long b_before = b_tile + sb[it * SEL_WARPS + warp] + __popc(b & below);
    if ((is_a && a_before < ka) || (is_b && b_before < take_b)) {
      const long long pos =
          (a_before < ka ? a_before : ka) + (b_before < take_b ? b_before : take_b);
      out_idx[pos] = ids != nullptr ? ids[i] : (int)i;
      out_val[pos] = v[it];
    }
  }
}

}  // namespace rc
