// A CPU stand-in for the CUDA features the kernels in kernels/ use, so that tests can run the
// kernels themselves on a machine without a GPU (tests/gpu_emulator.py builds them with it).
//
// A block's threads are fibers run one at a time by a scheduler in launch(): a
// thread runs until it reaches a barrier (__syncthreads, or a warp shuffle, ballot or match,
// which are barriers of the warp's 32 lanes here) and then yields. Blocks run one after another, so
// __shared__ variables can simply be static. A barrier that can never complete (threads of a
// block or warp taking different paths to it) aborts with a message instead of hanging: the
// emulator checks that every warp-level call is reached by all 32 lanes, as CUDA requires of
// FULL_MASK calls.
//
// Nothing on a GPU orders blocks, or the threads that leave a barrier: the blocks of a launch run
// in a shuffled order, and the threads of a block are resumed in a fresh shuffled order at every
// barrier (seeded by configure(), so a failing order can be replayed), so code that counts on an
// order shows it.
//
// Built with RC_EMU_CONCURRENT, a launch can run its blocks at once instead: configure()'s
// `workers` OS threads each take the next block of the shuffled order and run it to its end,
// with the block's own shared memory and fibers (thread_local), atomics that are atomic and
// fences that fence. Kernels whose blocks wait for one another (a look-back over earlier
// tiles, a last block that reads what the others added) then meet blocks still running, as on
// a GPU. What it cannot show: the orders are no longer replayable, x86's memory order is
// stronger than a GPU's (a missing fence goes unseen), and a block's threads still run one at
// a time between barriers, so a window inside a block (a thread that signals the others
// before its block's other threads are done) is seldom hit.
//
// float32 arithmetic is the GPU's, not the host's (kernels/common.cuh routes its float32 helpers
// here): a NaN result is the canonical NaN 0x7fffffff whatever the operands' payloads, and with
// flush-to-zero (kernels compiled with -ftz=true) subnormal inputs and results of additions,
// multiplications, divisions, min/max, comparisons, roundings and float/double conversions are
// zeros of their sign, as in the PTX NVRTC emits then (add.rn.ftz.f32, setp.*.ftz.f32, ...).
// float64 arithmetic is IEEE on both and is left to the host.
#pragma once

#include <ucontext.h>

#ifdef RC_EMU_CONCURRENT
#include <atomic>
#include <thread>
#define RC_EMU_TLS thread_local
#else
#define RC_EMU_TLS
#endif

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static RC_EMU_TLS
#define __launch_bounds__(...)

struct rc_dim3 {
  unsigned x = 0, y = 1, z = 1;
};
inline rc_dim3 gridDim, blockDim;
inline RC_EMU_TLS rc_dim3 blockIdx, threadIdx;

namespace rc_emu {

constexpr std::size_t STACK = 64 * 1024;

// ------------------------------------------------------------- the GPU's float32 arithmetic
inline bool ftz = false;  // set by configure(): whether the kernels flush subnormals

inline std::uint32_t f32_bits(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}
inline float f32_of(std::uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}
// A subnormal as the zero of its sign, when flushing.
inline float flush(float x) {
  const std::uint32_t b = f32_bits(x);
  return ftz && (b & 0x7f800000u) == 0 ? f32_of(b & 0x80000000u) : x;
}
// The result of a float32 instruction: NaN is canonical, a subnormal flushed when flushing.
inline float result(float r) { return std::isnan(r) ? f32_of(0x7fffffffu) : flush(r); }

inline float f32_add(float a, float b) { return result(flush(a) + flush(b)); }
inline float f32_sub(float a, float b) { return result(flush(a) - flush(b)); }
inline float f32_mul(float a, float b) { return result(flush(a) * flush(b)); }
inline float f32_div(float a, float b) { return result(flush(a) / flush(b)); }
inline float f32_rint(float x) { return result(std::rint(flush(x))); }
inline float f32_floor(float x) { return result(std::floor(flush(x))); }
// fmaxf / fminf: a NaN operand yields the other one; two NaNs the canonical NaN.
inline float f32_max(float a, float b) { return result(std::fmax(flush(a), flush(b))); }
inline float f32_min(float a, float b) { return result(std::fmin(flush(a), flush(b))); }
inline bool f32_le(float a, float b) { return flush(a) <= flush(b); }
inline float f32_from_f64(double x) { return result((float)x); }
inline double f64_from_f32(float x) { return (double)flush(x); }

// ------------------------------------------------------------------------------ ordering
inline RC_EMU_TLS std::uint64_t rng_state = 0x9e3779b97f4a7c15ull;
inline bool shuffled = true;
inline unsigned workers = 1;  // OS threads running a launch's blocks (RC_EMU_CONCURRENT)

inline std::uint64_t next_random() {  // splitmix64
  std::uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
inline void shuffle(std::vector<unsigned>& v) {
  if (!shuffled) return;
  for (std::size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[next_random() % i]);
}
// Arithmetic mode, the seed of the orders of the launches that follow, and how many blocks
// run at once (1 without RC_EMU_CONCURRENT).
inline void configure(bool flush_subnormals, std::uint64_t seed, bool shuffle_order,
                      unsigned concurrent_blocks) {
  ftz = flush_subnormals;
  rng_state = seed;
  shuffled = shuffle_order;
#ifdef RC_EMU_CONCURRENT
  workers = concurrent_blocks < 1 ? 1 : concurrent_blocks;
#else
  (void)concurrent_blocks;
#endif
}

#if defined(__x86_64__) && defined(__linux__)
// Switching fibers is most of the emulator's time: swap the callee-saved registers and the
// stack pointer (and the SSE/x87 control words) by hand, instead of swapcontext, which also
// saves the signal mask with a system call on every switch.
extern "C" void rc_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl rc_emu_switch
  .hidden rc_emu_switch
  .type rc_emu_switch, @function
rc_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size rc_emu_switch, .-rc_emu_switch
)");

struct Context {
  void* sp = nullptr;
};
inline void switch_to(Context& from, Context& to) { rc_emu_switch(&from.sp, to.sp); }
inline void start(Context& c, char* stack, std::size_t size, void (*fn)()) {
  auto top = reinterpret_cast<std::uintptr_t>(stack + size) & ~std::uintptr_t(15);
  auto* sp = reinterpret_cast<std::uint64_t*>(top);
  *--sp = 0;                                   // fn's return address: fn never returns
  *--sp = reinterpret_cast<std::uint64_t>(fn);  // where the first switch "returns" to
  for (int i = 0; i < 6; ++i) *--sp = 0;       // rbp, rbx, r12-r15
  std::uint32_t control[2];
  asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(control[0]), "=m"(control[1]));
  *--sp = (std::uint64_t)control[0] | ((std::uint64_t)(control[1] & 0xffff) << 32);
  c.sp = sp;
}
#else
struct Context {
  ucontext_t ctx;
};
inline void switch_to(Context& from, Context& to) { swapcontext(&from.ctx, &to.ctx); }
inline void start(Context& c, char* stack, std::size_t size, void (*fn)()) {
  getcontext(&c.ctx);
  c.ctx.uc_stack.ss_sp = stack;
  c.ctx.uc_stack.ss_size = size;
  c.ctx.uc_link = nullptr;
  makecontext(&c.ctx, fn, 0);
}
#endif

struct Fiber {
  Context ctx;
  bool done = false;
  std::unique_ptr<char[]> stack;
};

struct Barrier {
  unsigned arrived = 0;
  unsigned long generation = 0;
};

inline RC_EMU_TLS Context scheduler;
inline RC_EMU_TLS std::vector<Fiber> fibers;
inline RC_EMU_TLS unsigned current = 0;
inline RC_EMU_TLS bool progress = false;
inline RC_EMU_TLS Barrier block_barrier;
inline RC_EMU_TLS std::vector<Barrier> warp_barriers;
inline RC_EMU_TLS std::vector<std::uint64_t> slots;
inline std::function<void()> body;  // the launch's kernel and arguments: every block runs it

inline void yield() { switch_to(fibers[current].ctx, scheduler); }

inline RC_EMU_TLS unsigned block_alive = 0;
inline RC_EMU_TLS std::vector<unsigned> warp_alive;

// Threads of [first, first + count) still running: the whole block, or one warp.
inline unsigned live(unsigned first, unsigned count) {
  return count == 32 ? warp_alive[first / 32] : block_alive;
}

// Arrive at barrier b of threads [first, first + count) and wait until all live ones have.
inline void wait(Barrier& b, unsigned first, unsigned count) {
  const unsigned long generation = b.generation;
  ++b.arrived;
  while (b.generation == generation) {
    if (b.arrived >= live(first, count)) {
      b.arrived = 0;
      ++b.generation;
      progress = true;
      return;
    }
    yield();
  }
}

inline void entry() {
  body();
  fibers[current].done = true;
  --block_alive;
  --warp_alive[current / 32];
  progress = true;
  switch_to(fibers[current].ctx, scheduler);  // never resumed
}

template <class T> T exchange(T v, unsigned source_lane) {
  static_assert(sizeof(T) <= sizeof(std::uint64_t), "warp exchange of a wide type");
  const unsigned t = threadIdx.x;
  const unsigned warp = t / 32;
  std::memcpy(&slots[t], &v, sizeof(T));
  wait(warp_barriers[warp], warp * 32, 32);
  T r;
  std::memcpy(&r, &slots[warp * 32 + source_lane], sizeof(T));
  wait(warp_barriers[warp], warp * 32, 32);
  return r;
}

// This OS thread's fibers and barriers for blocks of `block` threads.
inline void prepare(unsigned block) {
  fibers.resize(block);
  for (auto& f : fibers) {
    if (!f.stack) f.stack.reset(new char[STACK]);
  }
  warp_barriers.assign(block / 32, Barrier{});
  slots.assign(block, 0);
}

// Run block b to its end on this OS thread (prepare() first); `order` holds 0..block-1.
inline void run_block(unsigned b, unsigned block, std::vector<unsigned>& order) {
  blockIdx.x = b;
  block_barrier = Barrier{};
  block_alive = block;
  warp_alive.assign(block / 32, 32);
  for (auto& f : fibers) {
    start(f.ctx, f.stack.get(), STACK, entry);
    f.done = false;
  }
  unsigned remaining = block;
  while (remaining) {  // one sweep: every live thread runs up to its next barrier
    progress = false;
    shuffle(order);
    for (const unsigned t : order) {
      if (fibers[t].done) continue;
      current = t;
      threadIdx.x = t;
      switch_to(scheduler, fibers[t].ctx);
      remaining -= fibers[t].done ? 1 : 0;
    }
    if (remaining && !progress) {
      std::fprintf(stderr, "emulated kernel deadlocked in block %u: threads wait at a "
                   "barrier that not all of them reach\n", b);
      std::abort();
    }
  }
}

template <class... P, class... A>
void launch(void (*kernel)(P...), unsigned grid, unsigned block, A... args) {
  if (block == 0 || block % 32 != 0 || block > 1024) {
    std::fprintf(stderr, "emulated launch: block size %u is not a multiple of 32 up to 1024\n",
                 block);
    std::abort();
  }
  gridDim.x = grid;
  blockDim.x = block;
  body = [&] { kernel(args...); };
  std::vector<unsigned> blocks(grid), order(block);
  std::iota(blocks.begin(), blocks.end(), 0u);
  std::iota(order.begin(), order.end(), 0u);
  shuffle(blocks);
#ifdef RC_EMU_CONCURRENT
  if (workers > 1) {
    std::atomic<unsigned> next{0};
    const std::uint64_t seed = next_random();
    std::vector<std::thread> pool;
    for (unsigned w = 0; w < workers; ++w) {
      pool.emplace_back([&, w] {
        rng_state = seed + 0x9e3779b97f4a7c15ull * (w + 1);
        prepare(block);
        std::vector<unsigned> mine(order);
        for (unsigned i; (i = next.fetch_add(1)) < grid;) run_block(blocks[i], block, mine);
      });
    }
    for (auto& t : pool) t.join();
    return;
  }
#endif
  prepare(block);
  for (const unsigned b : blocks) run_block(b, block, order);
}

}  // namespace rc_emu

inline void __syncthreads() { rc_emu::wait(rc_emu::block_barrier, 0, blockDim.x); }
#ifdef RC_EMU_CONCURRENT
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
#else
inline void __threadfence() {}  // blocks run one after another: nothing to order
#endif

template <class T> T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
  const unsigned lane = threadIdx.x & 31;
  unsigned source = lane ^ (unsigned)mask;
  if (source / width != lane / width) source = lane;  // outside its segment: own value
  return rc_emu::exchange(v, source);
}

template <class T> T __shfl_sync(unsigned, T v, int source, int width = 32) {
  const unsigned lane = threadIdx.x & 31;
  return rc_emu::exchange(v, lane / width * width + (unsigned)source % width);
}

template <class T> T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
  const unsigned lane = threadIdx.x & 31;
  return rc_emu::exchange(v, (lane % width) >= delta ? lane - delta : lane);
}

inline unsigned __ballot_sync(unsigned, int predicate) {
  const unsigned lane = threadIdx.x & 31;
  const unsigned first = threadIdx.x - lane;
  std::uint64_t flag = predicate ? 1 : 0;
  rc_emu::slots[threadIdx.x] = flag;
  rc_emu::wait(rc_emu::warp_barriers[first / 32], first, 32);
  unsigned bits = 0;
  for (unsigned l = 0; l < 32; ++l) bits |= (rc_emu::slots[first + l] ? 1u : 0u) << l;
  rc_emu::wait(rc_emu::warp_barriers[first / 32], first, 32);
  return bits;
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }

// The lanes of the warp whose `value` equals this lane's (a barrier of the warp, as a ballot).
inline unsigned __match_any_sync(unsigned, unsigned value) {
  const unsigned lane = threadIdx.x & 31;
  const unsigned first = threadIdx.x - lane;
  rc_emu::slots[threadIdx.x] = value;
  rc_emu::wait(rc_emu::warp_barriers[first / 32], first, 32);
  unsigned bits = 0;
  for (unsigned l = 0; l < 32; ++l) bits |= (rc_emu::slots[first + l] == value ? 1u : 0u) << l;
  rc_emu::wait(rc_emu::warp_barriers[first / 32], first, 32);
  return bits;
}

inline void rc_emu_check_aligned(const void* p, std::size_t align) {
  if (reinterpret_cast<std::uintptr_t>(p) % align) {
    std::fprintf(stderr, "emulated kernel: misaligned %zu-byte vector access at %p (block %u, "
                 "thread %u)\n", align, p, blockIdx.x, threadIdx.x);
    std::abort();
  }
}

inline unsigned atomicAdd(unsigned* p, unsigned v) {
#ifdef RC_EMU_CONCURRENT
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
#else
  const unsigned old = *p;  // one OS thread: no race to guard
  *p = old + v;
  return old;
#endif
}
