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
//
// Nothing waits for the host. Where the counts of a sampled threshold decide what follows
// (which candidates the exact selection runs over, which halving DGC takes), select_scan
// computes that decision on the device into a SelectPlan, and the kernels after it read it
// there: they take the whole array (x, m) and a plan that may point them at the candidates
// instead, and loop over as many tiles as the plan's entries fill.
//
// select_compact does the exact path's first compaction (the candidates reaching the sampled
// threshold) in one pass: each tile publishes its count and reads the counts of the tiles
// before it (a decoupled look-back) instead of a counting pass and a scan before the writes.
#include "common.cuh"

namespace rc {

constexpr int SEL_BINS = 2048;                     // histogram of an 11-bit digit
constexpr int SEL_THREADS = 256;                   // count / write kernels
constexpr int SEL_WARPS = SEL_THREADS / 32;
constexpr int SEL_ITEMS = 16;
constexpr int SEL_TILE = SEL_THREADS * SEL_ITEMS;  // elements per tile
constexpr int SCAN_ITEMS = 8;
constexpr int MAX_LIMITS = 11;  // limits one count pass compares against
// Rows of sample_limits: the sampled threshold and its 8 halvings, then the non-finite keys
// (>= Inf) and every key.
constexpr int HALVINGS = 9;
constexpr int ROW_NONFINITE = 9;
constexpr int ROW_EVERY = 10;

// Radix-select state in device memory (8 words): the high bits of T decided so far, which bits
// those are, how many keys matching them still belong to the top k; once T is complete,
// lims[0] = T + 1 (keys above T) and lims[1] = T.
struct SelectState {
  u32 prefix;
  u32 mask;
  long long need;
  u32 lims[4];
};

// What select_scan decides from the counts of the sampled limits (device memory, 4 words of
// 8 bytes): the entries the exact selection goes on with (m >= 0: the first m candidates;
// -1: the whole array), and the classes a compaction writes (rows ja, jb of the limits; the
// first ka and kb keys of each).
struct SelectPlan {
  long long m;
  long long ka;
  long long kb;
  int ja;
  int jb;
};

// Modes of select_scan.
enum : int { SCAN_ROWS = 0, PLAN_PREFILTER = 1, PLAN_DGC = 2 };

// The entries a kernel runs over: x[0:m] (index i named ids[i], or i when ids is null), or the
// candidates the plan chose.
struct Entries {
  const float* x;
  const int* ids;
  i64 m;
};

RC_FN Entries entries(const float* x, const int* ids, i64 m, const float* cx, const int* cids,
                      const SelectPlan* src) {
  if (src != nullptr && src->m >= 0) return Entries{cx, cids, src->m};
  return Entries{x, ids, m};
}

RC_FN i64 tiles_of(i64 m) { return (m + SEL_TILE - 1) / SEL_TILE; }

// Thread threadIdx.x's entries of the tile at `base` of x[0:m] (0 past the end), every load
// issued before any is used: the tile's loads are in flight together.
RC_FN void load_tile(const float* x, i64 m, i64 base, float (&v)[SEL_ITEMS]) {
#pragma unroll
  for (int it = 0; it < SEL_ITEMS; ++it) {
    const i64 i = base + it * SEL_THREADS + threadIdx.x;
    v[it] = i < m ? x[i] : 0.0f;
  }
}

// The plan of a sampled selection, from the totals of select_count (every block computes the
// same one). PLAN_PREFILTER: the exact selection goes on with the keys >= the sampled threshold
// when at least k and at most cap (the candidates' room) of the m pass and not all do, else
// with the whole array; the compaction writes those candidates. PLAN_DGC: every non-finite
// key (up to k), then the earliest finite keys reaching the first halving that k keys reach
// (or any key).
RC_FN SelectPlan make_plan(int mode, const u32* totals, long long k, long long cap, i64 m) {
  SelectPlan p;
  if (mode == PLAN_PREFILTER) {
    const long long c = totals[0];
    const bool use = k <= c && c <= cap && c < m;
    p.m = use ? c : -1;
    p.ja = 0;
    p.jb = -1;
    p.ka = use ? c : 0;
    p.kb = 0;
    return p;
  }
  int h = ROW_EVERY;
  for (int j = HALVINGS - 1; j >= 0; --j) {
    if ((long long)totals[j] >= k) h = j;
  }
  const long long bad = (long long)totals[ROW_NONFINITE] < k ? totals[ROW_NONFINITE] : k;
  p.m = -1;
  p.ja = ROW_NONFINITE;
  p.jb = h;
  p.ka = bad;
  p.kb = k - bad;
  return p;
}

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

// Counts one key per lane of a warp into the block's shared histogram. All 32 lanes call it
// together (`valid` false past the end). With `aggregate`, the lanes whose keys share a digit
// add their number with one atomic: gradients crowd into a few exponent bins, where plain
// shared-memory atomics serialize up to 32 ways per warp. Integer sums, so both ways count the
// same.
struct HistCounter {
  u32* sh;
  u32 prefix;
  u32 mask;
  int shift;
  u32 digits;
  bool aggregate;
  RC_FN void operator()(bool valid, float v) const {
    const u32 key = mag_key(v);
    const bool hit = valid && (key & mask) == prefix;
    const u32 digit = (key >> shift) & digits;
    if (!aggregate) {
      if (hit) atomicAdd(&sh[digit], 1u);
      return;
    }
    if (__ballot_sync(FULL_MASK, hit) == 0) return;  // the whole warp, or none of it
    const u32 peers = __match_any_sync(FULL_MASK, hit ? digit : 0xffffffffu);
    if (hit && (int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&sh[digit], __popc(peers));
  }
};

// Run by one block of SEL_THREADS threads: find the digit of the k-th largest key from the
// histogram, fold it into the state, and clear the histogram for the next pass. In
// select_hist's last block the fences make the other blocks' atomics visible; the histogram is
// also read past the SM's L1 (volatile), where they are.
RC_FN void pick_digit(u32* hist, SelectState* st, int shift, int bits, long long k, int first) {
  constexpr int PER_THREAD = SEL_BINS / SEL_THREADS;
  __shared__ u32 warp_sums[32];
  const int nbins = 1 << bits;
  const long long need = first ? k : st->need;
  // Thread t owns PER_THREAD consecutive bins counted from the top: the scan runs from the
  // largest digit down.
  const int top = nbins - 1 - PER_THREAD * (int)threadIdx.x;
  u32 h[PER_THREAD];
  u32 sum = 0;
  const volatile u32* counted = hist;
#pragma unroll
  for (int q = 0; q < PER_THREAD; ++q) {
    h[q] = top - q >= 0 ? counted[top - q] : 0u;
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

// One block of SEL_THREADS threads: pick_digit after a select_hist pass.
__global__ void select_pick(u32* hist, SelectState* st, int shift, int bits, long long k,
                            int first) {
  pick_digit(hist, st, shift, bits, k, first);
}

// hist[d] += number of keys among the entries (x[off + i * stride], i < m; or the candidates
// the plan `src` chose, contiguous) that match the decided bits (none are decided when
// `first`; then st is not read) and whose digit (bits [shift, shift + bits)) is d. hist must
// be zero (select_pick leaves it so). vec bit 1: x may be read 4 at a time (stride 1, off 0,
// 16-byte aligned); bit 2: the candidates may. With `finished` (a zero counter; blockDim.x
// must be SEL_THREADS) the last block to finish runs select_pick's work itself, for the k-th
// largest key, and zeroes `finished` again: no select_pick launch.
// At most 32 registers (8 blocks an SM, the wave _rt.grid sizes): without a bound the last
// block's pick took sm_80 from 27 to 37 registers, and 6 blocks an SM.
__global__ void __launch_bounds__(SEL_THREADS, 8)
    select_hist(const float* x, i64 off, i64 stride, i64 m, const float* cx,
                const SelectPlan* src, SelectState* st, int shift, int bits, int first,
                u32* hist, int vec, int aggregate, long long k, u32* finished) {
  __shared__ u32 sh[SEL_BINS];
  const int nbins = 1 << bits;
  for (int b = threadIdx.x; b < nbins; b += blockDim.x) sh[b] = 0;
  __syncthreads();
  const bool cand = src != nullptr && src->m >= 0;
  const float* data = cand ? cx : x;
  const i64 n = cand ? src->m : m;
  const i64 at = cand ? 0 : off;
  const i64 step = cand ? 1 : stride;
  const bool quad = (vec & (cand ? 2 : 1)) != 0;
  const HistCounter count{sh, first ? 0u : st->prefix, first ? 0u : st->mask, shift,
                          (u32)(nbins - 1), aggregate != 0};
  // Warp-uniform loops (every lane runs every round) for the warp-wide counting.
  const i64 lane = threadIdx.x & 31;
  const i64 warp_first = global_thread() - lane;
  const i64 threads = thread_count();
  i64 done = 0;
  if (quad) {
    const i64 groups = n >> 2;
    for (i64 g0 = warp_first; g0 < groups; g0 += threads) {
      const bool in = g0 + lane < groups;
      Pack<float, 4> p;
      if (in) {
        p = load<4>(data + ((g0 + lane) << 2));
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) p.v[j] = 0.0f;
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) count(in, p.v[j]);
    }
    done = groups << 2;
  }
  for (i64 i0 = done + warp_first; i0 < n; i0 += threads) {
    const bool in = i0 + lane < n;
    count(in, in ? data[at + (i0 + lane) * step] : 0.0f);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < nbins; b += blockDim.x) {
    if (sh[b]) atomicAdd(&hist[b], sh[b]);
  }
  if (finished == nullptr) return;
  // The last block: every block's additions are in the histogram before its count of
  // `finished` (each thread's fence, then the barrier, then thread 0's atomic), so the block
  // that counts last sees them all.
  __shared__ u32 last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(finished, 1u) == gridDim.x - 1 ? 1u : 0u;
  __syncthreads();
  if (last == 0) return;
  __threadfence();
  pick_digit(hist, st, shift, bits, k, first);
  if (threadIdx.x == 0) *finished = 0;
}

// The sampled path's limits: the sampled threshold and its eight halvings (as float32, the
// way NumPy compares a float32 array with a Python float; NaN lets everything pass), then Inf
// (the non-finite class) and 0 (every key). Also zeroes the totals select_count adds to, when
// given.
__global__ void sample_limits(const SelectState* st, u32* lims, u32* totals) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    double thr = (double)ffrom(st->prefix);
    for (int h = 0; h < HALVINGS; ++h) {
      const float f = f64_to_f32(thr);
      lims[h] = isnan_f(f) ? 0u : mag_key(f);
      thr = dmul(thr, 0.5);
    }
    lims[ROW_NONFINITE] = 0x7f800000u;
    lims[ROW_EVERY] = 0u;
    if (totals != nullptr) {
      for (int j = 0; j < MAX_LIMITS; ++j) totals[j] = 0u;
    }
  }
}

// counts[j * ntiles + tile] = keys >= lims[j] in each tile of the entries (j < nthr <=
// MAX_LIMITS), and, when totals is given (zeroed by sample_limits), totals[j] their sum over
// the tiles. ntiles is the row length: at least the tiles of the entries; blocks take tiles
// blockIdx.x, blockIdx.x + gridDim.x, ...
__global__ void select_count(const float* x, i64 m, const float* cx, const SelectPlan* src,
                             const u32* lims, int nthr, u32* counts, i64 ntiles, u32* totals) {
  __shared__ u32 sh[MAX_LIMITS][SEL_WARPS];
  const Entries e = entries(x, nullptr, m, cx, nullptr, src);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  u32 lim[MAX_LIMITS];
#pragma unroll
  for (int j = 0; j < MAX_LIMITS; ++j) lim[j] = j < nthr ? lims[j] : 0xffffffffu;  // none reach
  const i64 tiles = tiles_of(e.m);
  for (i64 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const i64 base = tile * SEL_TILE;
    // Every load first, then the comparisons: the tile's loads are in flight together.
    float v[SEL_ITEMS];
    load_tile(e.x, e.m, base, v);
    u32 c[MAX_LIMITS];
#pragma unroll
    for (int j = 0; j < MAX_LIMITS; ++j) c[j] = 0;
#pragma unroll
    for (int it = 0; it < SEL_ITEMS; ++it) {
      if (base + it * SEL_THREADS + threadIdx.x < e.m) {
        const u32 key = mag_key(v[it]);
#pragma unroll
        for (int j = 0; j < MAX_LIMITS; ++j) c[j] += key >= lim[j] ? 1u : 0u;
      }
    }
#pragma unroll
    for (int j = 0; j < MAX_LIMITS; ++j) {
      for (int o = 16; o > 0; o >>= 1) c[j] += __shfl_xor_sync(FULL_MASK, c[j], o);
      if (lane == 0) sh[j][warp] = c[j];
    }
    __syncthreads();
    if ((int)threadIdx.x < nthr) {
      u32 s = 0;
      for (int w = 0; w < SEL_WARPS; ++w) s += sh[threadIdx.x][w];
      counts[threadIdx.x * ntiles + tile] = s;
      if (totals != nullptr) atomicAdd(&totals[threadIdx.x], s);
    }
    __syncthreads();  // sh is written again for the next tile
  }
}

// Turn rows of tile counts into exclusive offsets, in place, over the tiles of the entries
// (x's m, or the candidates `src` chose): block 0 scans row_a, block 1 (when launched) row_b.
// Only the rows a compaction uses are scanned. In the PLAN_ modes the rows come from the plan
// that every block computes from `totals` (see make_plan; k and cap are its arguments, the
// entries are x's m), and block 0 stores it in `plan` for the kernels after this one.
__global__ void select_scan(u32* counts, i64 ntiles, i64 m, const SelectPlan* src, int row_a,
                            int row_b, int mode, const u32* totals, long long k, long long cap,
                            SelectPlan* plan) {
  __shared__ u32 warp_sums[32];
  i64 count = m;
  if (mode != SCAN_ROWS) {
    const SelectPlan p = make_plan(mode, totals, k, cap, m);
    if (blockIdx.x == 0 && threadIdx.x == 0) *plan = p;
    row_a = p.ja;
    row_b = p.jb;
  } else if (src != nullptr && src->m >= 0) {
    count = src->m;
  }
  const i64 tiles = tiles_of(count);
  u32* row = counts + (blockIdx.x == 0 ? row_a : row_b) * ntiles;
  u32 carry = 0;
  for (i64 s = 0; s < tiles; s += (i64)blockDim.x * SCAN_ITEMS) {
    const i64 i0 = s + (i64)threadIdx.x * SCAN_ITEMS;
    u32 v[SCAN_ITEMS];
    u32 sum = 0;
#pragma unroll
    for (int q = 0; q < SCAN_ITEMS; ++q) {
      v[q] = i0 + q < tiles ? row[i0 + q] : 0u;
      sum += v[q];
    }
    u32 total;
    u32 run = carry + block_exclusive_sum(sum, warp_sums, total);
#pragma unroll
    for (int q = 0; q < SCAN_ITEMS; ++q) {
      if (i0 + q < tiles) row[i0 + q] = run;
      run += v[q];
    }
    carry += total;
  }
}

// Exclusive scan, in index order, of the per-(item, warp) counts of a tile (run by warp 0);
// returns the lane's inclusive sum (lane 31's is the tile's total).
RC_FN u32 scan_tile_counts(u32* counts) {
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
  return x;
}

// Write the selected entries of each tile in index order: the first ka keys >= lims[ja]
// (class A), and when jb >= 0 the first kb keys in [lims[jb], lims[ja]) (class B), kb being
// st->need when st is given; ja, jb, ka and kb come from `rows` when it is given. The entries
// are x[0:m] named by ids (i itself when null), or the candidates (cx, named by cids) that
// `src` chose. offsets are select_scan's rows; out_idx gets the names, out_val the values.
// At most 64 registers, so that 4 blocks fit an SM (sm_80 used 95 without a bound, sm_90 80
// with 3 blocks; 4 spill 8 bytes on sm_90): each block waits on its tile's loads, then on its
// scans, so more blocks keep more loads in flight.
__global__ void __launch_bounds__(SEL_THREADS, 4)
    select_write(const float* x, const int* ids, i64 m, const float* cx, const int* cids,
                 const SelectPlan* src, const SelectPlan* rows, const u32* lims, int ja, int jb,
                 long long ka, long long kb, const SelectState* st, const u32* offsets,
                 i64 ntiles, int* out_idx, float* out_val) {
  __shared__ u32 sa[SEL_ITEMS * SEL_WARPS];
  __shared__ u32 sb[SEL_ITEMS * SEL_WARPS];
  const Entries e = entries(x, ids, m, cx, cids, src);
  if (rows != nullptr) {
    ja = rows->ja;
    jb = rows->jb;
    ka = rows->ka;
    kb = rows->kb;
  }
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const u32 below = (1u << lane) - 1u;
  const u32 lim_a = lims[ja];
  const bool two = jb >= 0;
  const u32 lim_b = two ? lims[jb] : lim_a;  // class B is empty without one
  const long long take_b = !two ? 0 : (st != nullptr ? st->need : kb);
  // Nothing to write (a compaction of candidates the plan does not use): skip the reads.
  const i64 tiles = ka <= 0 && take_b <= 0 ? 0 : tiles_of(e.m);
  for (i64 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const i64 base = tile * SEL_TILE;
    float v[SEL_ITEMS];
    load_tile(e.x, e.m, base, v);
    // Pass 1: how many of each class in each 32-element row of the tile.
#pragma unroll
    for (int it = 0; it < SEL_ITEMS; ++it) {
      const bool in = base + it * SEL_THREADS + threadIdx.x < e.m;
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
    const long long a_tile = offsets[ja * ntiles + tile];
    const long long b_tile = two ? (long long)offsets[jb * ntiles + tile] - a_tile : 0;
#pragma unroll
    for (int it = 0; it < SEL_ITEMS; ++it) {
      const i64 i = base + it * SEL_THREADS + threadIdx.x;
      const bool in = i < e.m;
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
        out_idx[pos] = e.ids != nullptr ? e.ids[i] : (int)i;
        out_val[pos] = v[it];
      }
    }
    __syncthreads();  // sa and sb are written again for the next tile
  }
}

// ------------------------------------------------- the candidates' compaction in one pass
// A tile's state in select_compact's look-back (one u64 per tile, zero before the launch):
// the high word says what the low word holds, so one store publishes both.
constexpr u64 TILE_NONE = 0;    // nothing yet
constexpr u64 TILE_COUNT = 1;   // the tile's own count
constexpr u64 TILE_PREFIX = 2;  // the count of this tile and of every tile before it

RC_FN u64 load_state(const u64* p) { return *(const volatile u64*)p; }
RC_FN void store_state(u64* p, u64 what, u32 value) { *(volatile u64*)p = what << 32 | value; }

// The entries selected by the tiles before `tile` (all 32 lanes of a warp call it; every lane
// gets the sum). The lanes read the states of 32 tiles at a time, nearest first, wait until
// each has published something, and add the counts up to the nearest tile that published its
// prefix; without one, they go on with the 32 tiles before. Tile 0 always publishes its
// prefix, so the walk ends there at the latest.
RC_FN u32 look_back(const u64* states, i64 tile) {
  const int lane = threadIdx.x & 31;
  u32 before = 0;
  for (i64 end = tile - 1;; end -= 32) {
    const i64 t = end - lane;
    u64 w = t >= 0 ? load_state(states + t) : TILE_PREFIX << 32;  // before tile 0: none
    while (__ballot_sync(FULL_MASK, (w >> 32) == TILE_NONE) != 0) {
      if ((w >> 32) == TILE_NONE) w = load_state(states + t);
    }
    const u32 prefixes = __ballot_sync(FULL_MASK, (w >> 32) == TILE_PREFIX);
    const int stop = prefixes != 0 ? __ffs(prefixes) - 1 : 31;
    u32 v = lane <= stop ? (u32)w : 0u;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    before += v;
    if (prefixes != 0) return before;
  }
}

// The exact path's candidates in one pass over x[0:m] (select_count, select_scan and
// select_write of the keys >= lims[0] in one launch): the first `room` of them, in index order,
// into (out_idx, out_val), and the plan (PLAN_PREFILTER, as make_plan decides it from their
// count) into `plan`. One block of SEL_THREADS threads per tile; blocks take tiles in the
// order they start (next_tile), count their tile, publish the count, and find how many the
// tiles before them selected by looking back over the states those published (a decoupled
// look-back), so no pass over x counts first. states: a word per tile and next_tile, all zero
// (tests may start next_tile past tiles whose states they wrote). With `prefixes` 0 (tests)
// no tile but the first publishes its prefix: every look-back walks to tile 0.
__global__ void __launch_bounds__(SEL_THREADS, 4)
    select_compact(const float* x, i64 m, const u32* lims, long long room, long long k,
                   u64* states, u32* next_tile, int prefixes, SelectPlan* plan, int* out_idx,
                   float* out_val) {
  __shared__ u32 sa[SEL_ITEMS * SEL_WARPS];
  __shared__ u32 tile_at;
  __shared__ u32 before;
  if (threadIdx.x == 0) tile_at = atomicAdd(next_tile, 1u);
  __syncthreads();
  const i64 tile = tile_at;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const u32 lower = (1u << lane) - 1u;
  const u32 lim = lims[0];
  const i64 base = tile * SEL_TILE;
  float v[SEL_ITEMS];
  load_tile(x, m, base, v);
  // How many keys reach the limit in each 32-element row of the tile.
#pragma unroll
  for (int it = 0; it < SEL_ITEMS; ++it) {
    const bool in = base + it * SEL_THREADS + threadIdx.x < m;
    const u32 hit = __ballot_sync(FULL_MASK, in && mag_key(v[it]) >= lim);
    if (lane == 0) sa[it * SEL_WARPS + warp] = __popc(hit);
  }
  __syncthreads();
  if (warp == 0) {
    const u32 total = __shfl_sync(FULL_MASK, scan_tile_counts(sa), 31);
    u32 earlier = 0;
    if (tile == 0) {
      if (lane == 0) store_state(states, TILE_PREFIX, total);
    } else {
      if (lane == 0) store_state(states + tile, TILE_COUNT, total);
      earlier = look_back(states, tile);
      if (lane == 0 && prefixes != 0) store_state(states + tile, TILE_PREFIX, earlier + total);
    }
    if (lane == 0) {
      before = earlier;
      if (tile == tiles_of(m) - 1) {
        const u32 reached = earlier + total;
        *plan = make_plan(PLAN_PREFILTER, &reached, k, room, m);
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int it = 0; it < SEL_ITEMS; ++it) {
    const i64 i = base + it * SEL_THREADS + threadIdx.x;
    const bool is_a = i < m && mag_key(v[it]) >= lim;
    const u32 hit = __ballot_sync(FULL_MASK, is_a);
    const long long pos = (long long)before + sa[it * SEL_WARPS + warp] + __popc(hit & lower);
    if (is_a && pos < room) {
      out_idx[pos] = (int)i;
      out_val[pos] = v[it];
    }
  }
}

}  // namespace rc
