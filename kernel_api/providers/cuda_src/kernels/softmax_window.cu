// Row softmax (forward and backward) for long rows in one persistent launch that reads each input
// from DRAM once. Compiled after softmax.cu (the interface, softmax_window.py, joins the two
// sources), whose conversions, edges, stores and reductions it uses.
//
// Every row is cut into parts of BV = U x THREADS 16-byte vectors (after the row's scalar head, as
// softmax.cu peels rows); part w (rows in order, parts in order within a row) is used twice. Step j
// of the launch does, in this order:
//   statistics of part j: its partial (forward: max and sum of exp(x - max); backward: sum(dy * y))
//     into the part's workspace slot behind a tag (nobody waits for it here);
//   the combination of row r where j = (r + 1) * bpr - 1 + delay, i.e. `delay` steps after the
//     row's last statistics: the row's partials in part order (deterministic), published in the
//     row's slot behind a tag;
//   output of part j - lag: wait for its row's tag, then write the output.
// CTA b takes steps b, b + grid, ... in order. With lag > bpr - 1 + delay every wait is for an
// earlier step, so a co-resident grid (a cooperative launch) always progresses. The interface
// makes the lag a whole number of grids: part w's output then runs on the CTA that took its
// statistics. With a lag of one grid that CTA still holds the part in its ring (the previous
// step's slot) and nothing is read twice; with longer lags the output re-reads the part, lag parts
// after its first read, from L2 (into registers, one step ahead). Either way DRAM moves each input
// once and each output once.
//
// Each thread copies its own vectors of a step's statistics part into a ring of NSLOT steps in
// shared memory with cp.async, PD steps ahead, and reads back only its own vectors: the loads stay
// in flight across the step's reductions and waits with no barrier for the ring. Tags carry this
// launch's tag (the host's epoch mixed with %gridid), so the workspace needs no initialisation and
// CUDA graph replays differ.
//
// Workspace: a 16-byte slot per part {tag, partial (, max)}, then a 16-byte slot per row {tag,
// a, b}.

#ifndef WN_MIN_BLOCKS
#define WN_MIN_BLOCKS 2  // CTAs per SM the launch bounds leave registers for
#endif
#ifndef WN_PEEKS
#define WN_PEEKS 0  // partials per thread the combination asks for at the top of its step
#endif
#ifndef WN_COMBINE_LATE
#define WN_COMBINE_LATE 0  // 1: the combination after the step's output, not before it
#endif
#ifndef WN_TIMEOUT_NS
#define WN_TIMEOUT_NS 30000000000ull  // a wait past 30 s is a bug (even under compute-sanitizer): trap, not hang
#endif

namespace ka_softmax {
namespace window {

typedef unsigned long long u64;

__device__ __forceinline__ unsigned launch_tag(i64 epoch) {
  u64 g;
  asm volatile("mov.u64 %0, %%gridid;" : "=l"(g));
  return (unsigned)epoch ^ ((unsigned)g * 0x9E3779B1u);
}
__device__ __forceinline__ u64 global_timer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A slot: 16 bytes, two 64-bit words {tag << 32 | bits of a, tag << 32 | bits of b}. Each word is
// written and read whole (64-bit accesses are single-copy atomic), so a reader that sees the
// current tag in both words has both values, with no fence on either side: a release store
// waits for the writer's copies still in flight (MEMBAR), and those are the prefetch that keeps
// DRAM busy. The tag of slot i: the launch's tag mixed with i, odd and below 2^31, so no fill
// pattern (zeros, ones, NaNs) and no other launch's or slot's value reads as current.
__device__ __forceinline__ unsigned slot_tag(unsigned launch, i64 i) {
  return ((launch ^ ((unsigned)i * 0x85EBCA6Bu) ^ (unsigned)((u64)i >> 32)) | 1u) & 0x7FFFFFFFu;
}
__device__ __forceinline__ void publish(u64* slot, unsigned tag, float a, float b) {
  const u64 hi = (u64)tag << 32;
  asm volatile("st.relaxed.gpu.global.v2.u64 [%0], {%1, %2};" ::"l"(slot), "l"(hi | __float_as_uint(a)),
               "l"(hi | __float_as_uint(b))
               : "memory");
}
struct Peek {
  u64 w0, w1;
};
__device__ __forceinline__ Peek peek(const u64* slot) {
  Peek v;
  asm volatile("ld.relaxed.gpu.global.v2.u64 {%0, %1}, [%2];" : "=l"(v.w0), "=l"(v.w1) : "l"(slot) : "memory");
  return v;
}
__device__ __forceinline__ bool current(const Peek& v, unsigned tag) {
  return (unsigned)(v.w0 >> 32) == tag && (unsigned)(v.w1 >> 32) == tag;
}
// The pair of `slot`, first peeked as `v`: polled again until both words carry `tag`
// (nanosleep between polls; trap after WN_TIMEOUT_NS, which only a bug can reach).
__device__ __forceinline__ float2 await_slot(const u64* slot, unsigned tag, Peek v) {
#ifdef WN_NO_WAIT  // (a diagnostic build: no waits, wrong results; docs/performance.md, "Softmax")
  if (false) {
#else
  if (!current(v, tag)) {
#endif
    const u64 t0 = global_timer();
    unsigned ns = 64;
    for (;;) {
      v = peek(slot);
      if (current(v, tag)) break;
      asm volatile("nanosleep.u32 %0;" ::"r"(ns));
      if (ns < 512) ns <<= 1;
      if (global_timer() - t0 > WN_TIMEOUT_NS) __trap();
    }
  }
  return make_float2(__uint_as_float((unsigned)v.w0), __uint_as_float((unsigned)v.w1));
}
__device__ __forceinline__ float2 await_slot(const u64* slot, unsigned tag) { return await_slot(slot, tag, peek(slot)); }

// The partials of row cr that a combination merges: each thread's first N (parts c = t,
// t + threads, ...) asked for early (`ask`, at the top of the step) so their L2 latency hides behind
// the statistics; `each` hands f every one of the thread's partials in part order, waiting where
// a peek was not current yet.
template <int N>
struct Peeks {
  Peek v[N > 0 ? N : 1];
  __device__ __forceinline__ void ask(const u64* part_slot, int cr, int bpr, int t, int threads) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int c = t + i * threads;
      if (cr >= 0 && c < bpr) v[i] = peek(part_slot + 2 * ((i64)cr * bpr + c));
    }
  }
  template <class F>
  __device__ __forceinline__ void each(const u64* part_slot, unsigned tag, int cr, int bpr, int t, int threads,
                                       F f) const {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int c = t + i * threads;
      if (c < bpr) {
        const int p = cr * bpr + c;
        f(await_slot(part_slot + 2 * (i64)p, slot_tag(tag, p), v[i]));
      }
    }
    for (int c = t + N * threads; c < bpr; c += threads) {
      const int p = cr * bpr + c;
      f(await_slot(part_slot + 2 * (i64)p, slot_tag(tag, p)));
    }
  }
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// n / d for 0 <= n < 2^31 by a multiply and a shift (Granlund-Montgomery): M = ceil(2^s / d) with
// s = 31 + ceil(log2 d), so n * M < 2^64 and the rounding error stays below one quotient step. The
// schedule divides step and part numbers by the parts per row several times a step; a 64-bit
// division is a ~100-instruction subroutine.
struct FastDiv {
  u64 m;
  int s;
  __device__ __forceinline__ explicit FastDiv(unsigned d) {
    const int l = d > 1 ? 32 - __clz(d - 1) : 0;
    s = 31 + l;
    m = ((1ull << s) + d - 1) / d;
  }
  __device__ __forceinline__ int div(int n) const { return (int)(((u64)(unsigned)n * m) >> s); }
};

// Part w of a row (r = w / bpr) whose vectors after its head number nvec: its index p in the
// row and its vectors [v0, v0 + n).
struct Part {
  int r, p, v0, n;
};
__device__ __forceinline__ Part part_of(int w, const FastDiv& bpr_div, int bpr, int bv, int nvec) {
  Part q;
  q.r = bpr_div.div(w);
  q.p = w - q.r * bpr;
  q.v0 = q.p * bv;
  const int rest = nvec - q.v0;
  q.n = rest <= 0 ? 0 : (rest < bv ? rest : bv);
  return q;
}

// A warp's (max, sum of exp(v - max)) from each lane's: the max first, then each lane's sum
// rescaled to it (one exp per lane), then the sums.
__device__ __forceinline__ float2 warp_stats(float m, float s) {
  const float wm = warp_max(m);
  s = m == -KA_INF ? 0.f : s * exp_shifted(m, wm);
  return make_float2(wm, warp_sum(s));
}

// The CTA's (max, sum) in thread 0 (the others return garbage): each warp's through red (one
// barrier), then warp 0 merges them in one order. red must not be written again before every
// thread of warp 0 has read it (the callers alternate arrays, or add a barrier).
template <int THREADS>
__device__ __forceinline__ float2 block_stats(float m, float s, float2* red) {
  float2 v = warp_stats(m, s);
  if constexpr (THREADS > 32) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
      v = lane < THREADS / 32 ? red[lane] : make_float2(-KA_INF, 0.f);
      v = warp_stats(v.x, v.y);
    }
  }
  return v;
}

// The step schedule (all numbers below 2^31: the interface refuses larger problems): step j
// combines row (j - delay + 1) / bpr - 1 when bpr divides j - delay + 1, and outputs part
// j - lag.
struct Schedule {
  int rows, parts, bpr, lag, delay;
  FastDiv bpr_div;
  __device__ __forceinline__ Schedule(i64 rows_, i64 bpr_, i64 lag_, i64 delay_)
      : rows((int)rows_), parts((int)(rows_ * bpr_)), bpr((int)bpr_), lag((int)lag_), delay((int)delay_),
        bpr_div((unsigned)bpr_) {}
  __device__ __forceinline__ int steps() const { return parts + lag; }
  __device__ __forceinline__ int combined_row(int j) const {
#ifdef WN_NO_COMBINE  // (a diagnostic build: no combinations, wrong results)
    return -1;
#endif
    const int k = j - delay + 1;
    if (k < bpr) return -1;
    const int q = bpr_div.div(k);
    return q * bpr == k && q <= rows ? q - 1 : -1;
  }
  __device__ __forceinline__ int output_part(int j) const { return j >= lag && j - lag < parts ? j - lag : -1; }
  __device__ __forceinline__ int row_of(int w) const { return bpr_div.div(w); }
};

// This thread's vectors of part w (of an operand at `base`, row stride ld): their number n in the
// part (the last part of a row may be short) and where they start.
template <class T, int VEC, int BV>
struct PartPtr {
  const typename T::raw* src;
  int n;
  __device__ __forceinline__ PartPtr(const typename T::raw* base, i64 ld, int w, const Schedule& sc, int cols) {
    const int r = sc.row_of(w);
    const typename T::raw* row = base + (i64)r * ld;
    const Span sp = row_span<T, VEC, true>(row, cols);
    const int p = w - r * sc.bpr;
    n = min(max(sp.nvec - p * BV, 0), BV);
    src = row + sp.head + (i64)p * BV * VEC;
  }
};

// Copies this thread's vectors of part w into dst (vector v of the part at dst[v]).
template <class T, int VEC, int U, int THREADS>
__device__ __forceinline__ void copy_part(uint4* dst, const typename T::raw* base, i64 ld, int w,
                                          const Schedule& sc, int cols, int t) {
  const PartPtr<T, VEC, U * THREADS> pp(base, ld, w, sc, cols);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int v = u * THREADS + t;
    if (v < pp.n) cp_async16(dst + v, pp.src + (i64)v * VEC);
  }
}

// Loads this thread's vectors of part w into registers (from L2: the statistics read them `lag`
// parts ago).
template <class T, int VEC, int U, int THREADS>
__device__ __forceinline__ void load_part(uint4 (&dst)[U], const typename T::raw* base, i64 ld, int w,
                                          const Schedule& sc, int cols, int t) {
  const PartPtr<T, VEC, U * THREADS> pp(base, ld, w, sc, cols);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int v = u * THREADS + t;
    if (v < pp.n) dst[u] = ld16(pp.src + (i64)v * VEC);
  }
}

// 16-bit outputs: exp(v - m) as one FFMA and an EX2, ex2(v * log2e + c) with c = -m * log2e (and, in
// the output, - log2 of the row's sum), instead of the exact subtraction first (FADD, FMUL): the
// rounding of c costs an absolute error of |c| * 2^-24 in the exponent, so the forms are taken
// only while |m| < FFMA_MAX_ABS (with log2 of a sum of at most 2^31 terms, |c| < 2^7: a relative
// error below 2^-17, 1/512 of a bf16 and 1/64 of an f16 output's unit in the last place). f32
// outputs, and 16-bit rows with larger maxima, keep the exact form.
#define FFMA_MAX_ABS 64.f
__device__ __forceinline__ float ex2_ftz(float a) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}
__device__ __forceinline__ float lg2_ftz(float a) {
  float r;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}

// Pairwise reductions of N values (N a power of two or not): log2(N) dependent steps instead of N,
// so a warp's chains leave room for the others (the loops below keep one chain per vector and
// join the vectors' results with these).
template <int N>
__device__ __forceinline__ float tree_sum(float (&h)[N]) {
#pragma unroll
  for (int w = 1; w < N; w <<= 1)
#pragma unroll
    for (int q = 0; q + w < N; q += 2 * w) h[q] += h[q + w];
  return h[0];
}
template <int N>
__device__ __forceinline__ float tree_max(float (&h)[N]) {
#pragma unroll
  for (int w = 1; w < N; w <<= 1)
#pragma unroll
    for (int q = 0; q + w < N; q += 2 * w) h[q] = fmaxf(h[q], h[q + w]);
  return h[0];
}
// A 16-byte pack of -inf values (what a missing vector counts as in a maximum).
template <class T>
__device__ __forceinline__ uint4 neg_inf_pack() {
  const unsigned w = T::KIND == 1 ? 0xFF80FF80u : (T::KIND == 2 ? 0xFC00FC00u : 0xFF800000u);
  return make_uint4(w, w, w, w);
}

}  // namespace window

// Forward. Ring: NSLOT steps x BV vectors of statistics parts (dynamic shared memory); the output
// reads the previous step's slot (a lag of one grid) or registers loaded from L2 a step ahead.
template <class T, int VEC, int U, int THREADS, int NSLOT, int PD>
__global__ void __launch_bounds__(THREADS, WN_MIN_BLOCKS) fwd_window(const typename T::raw* __restrict__ x,
                                                                     typename T::raw* __restrict__ y, i64 rows,
                                                                     i64 cols, i64 ldx, i64 ldy, void* __restrict__ ws,
                                                                     i64 bpr, i64 lag, i64 delay, i64 epoch) {
  typedef window::u64 u64;
  constexpr int BV = U * THREADS;
  extern __shared__ uint4 ring[];
  __shared__ float2 red[3][32];  // (statistics: alternating by step; the combination's)
  const int t = threadIdx.x;
  const unsigned tag = window::launch_tag(epoch);
  const window::Schedule sc(rows, bpr, lag, delay);
  u64* part_slot = static_cast<u64*>(ws);
  u64* row_slot = part_slot + 2 * (i64)sc.parts;
  const int steps = sc.steps(), G = gridDim.x, n_cols = (int)cols;
  auto issue = [&](int j, int slot) {  // step j's statistics copies into ring slot `slot`, one commit group
    if (j < sc.parts) window::copy_part<T, VEC, U, THREADS>(ring + slot * BV, x, ldx, j, sc, n_cols, t);
    window::cp_async_commit();
  };
  static_assert(PD >= 1 && NSLOT > PD, "the ring holds the steps in flight and the current one");
#pragma unroll
  for (int q = 0; q < PD; ++q) issue((int)blockIdx.x + q * G, q);
  // The output part's vectors of the next step are loaded at the end of this one (after this
  // step's output has used the registers), so their L2 latency hides behind a whole step.
  // With a lag of L whole grids and a ring of at least PD + 1 + L steps, the output part is the one
  // this CTA took the statistics of L steps ago, still in the ring: no second read at all.
  const int lag_steps = sc.lag / G;  // (this CTA's steps between a part's statistics and its output)
  const bool reuse = sc.lag % G == 0 && NSLOT >= PD + 1 + lag_steps;
  uint4 out_in[U];
  {
    const int w0 = sc.output_part(blockIdx.x);
    if (!reuse && w0 >= 0) window::load_part<T, VEC, U, THREADS>(out_in, x, ldx, w0, sc, n_cols, t);
  }
  int k = 0;
  for (int j = blockIdx.x; j < steps; j += G, ++k) {
    issue(j + PD * G, (k + PD) % NSLOT);
    const int w = sc.output_part(j);
    window::Peek row_peek;  // (the output's row result, asked for now: its latency hides behind the statistics)
    if (w >= 0) row_peek = window::peek(row_slot + 2 * (i64)sc.row_of(w));
    const int cr = sc.combined_row(j);  // (the row this step combines, or -1)
    window::Peeks<WN_PEEKS> partials;
    partials.ask(part_slot, cr, sc.bpr, t, THREADS);
    window::cp_async_wait<PD>();  // this thread's copies of step j have landed
    if (j < sc.parts) {  // statistics of part j
      const uint4* s = ring + (k % NSLOT) * BV;
      const int r = sc.row_of(j);
      const typename T::raw* xr = x + (i64)r * ldx;
      const Span sp = row_span<T, VEC, true>(xr, n_cols);
      const window::Part q = window::part_of(j, sc.bpr_div, sc.bpr, BV, sp.nvec);
      float eh = -KA_INF, et = -KA_INF;
      if (q.p == 0) load_edges<T, VEC>(xr, sp, t, -KA_INF, eh, et);
      uint4 raw[U];
#pragma unroll
      for (int u = 0; u < U; ++u) raw[u] = u * THREADS + t < q.n ? s[u * THREADS + t] : window::neg_inf_pack<T>();
      float m;
      float v[U][VEC];
      {
        float mu[U];  // (each vector's maximum, then a tree over the vectors)
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if constexpr (T::KIND != 0) {  // (16-bit: two values at a time, exact)
            mu[u] = max2_value<T>(max2_pack<T>(raw[u], max2_init<T>()));
          }
          unpack16<T, VEC>(raw[u], v[u]);
          if constexpr (T::KIND == 0) mu[u] = fmaxf(fmaxf(v[u][0], v[u][1]), fmaxf(v[u][2], v[u][3]));
        }
        m = fmaxf(window::tree_max<U>(mu), fmaxf(eh, et));
      }
      float sum = 0.f;
#ifdef WN_COPY_ONLY  // (a diagnostic build: no exps, wrong results)
      if (false) {
#else
      if (m != -KA_INF) {
#endif
        float su[U];  // (one chain per vector, then a tree over the vectors)
        if (T::KIND != 0 && fabsf(m) < FFMA_MAX_ABS) {
          const float c = -m * KA_LOG2E;
#pragma unroll
          for (int u = 0; u < U; ++u) {
            su[u] = 0.f;
#pragma unroll
            for (int e = 0; e < VEC; ++e) su[u] += window::ex2_ftz(fmaf(v[u][e], KA_LOG2E, c));
          }
        } else {
#pragma unroll
          for (int u = 0; u < U; ++u) {
            su[u] = 0.f;
#pragma unroll
            for (int e = 0; e < VEC; ++e) su[u] += exp_shifted(v[u][e], m);
          }
        }
        sum = window::tree_sum<U>(su) + (exp_shifted(eh, m) + exp_shifted(et, m));
      }
      const float2 part = window::block_stats<THREADS>(m, sum, red[k & 1]);
      if (t == 0) window::publish(part_slot + 2 * (i64)j, window::slot_tag(tag, j), part.x, part.y);
    }
    auto combine = [&]() {  // the row's partials, in part order
      if (cr < 0) return;
      float rm = -KA_INF, rs = 0.f;
      partials.each(part_slot, tag, cr, sc.bpr, t, THREADS, [&](float2 pv) { merge_stats(rm, rs, pv.x, pv.y); });
      const float2 row = window::block_stats<THREADS>(rm, rs, red[2]);  // (all -inf: 1 / 0, NaN as torch)
      if (t == 0) window::publish(row_slot + 2 * (i64)cr, window::slot_tag(tag, (i64)sc.parts + cr), row.x, 1.f / row.y);
      __syncthreads();  // (red[2] is read before the next combination writes it)
    };
    if (!WN_COMBINE_LATE) combine();
    if (w >= 0) {  // output of part w
      const int r = sc.row_of(w);
      const float2 st = window::await_slot(row_slot + 2 * (i64)r, window::slot_tag(tag, (i64)sc.parts + r), row_peek);
      const typename T::raw* xr = x + (i64)r * ldx;
      typename T::raw* yr = y + (i64)r * ldy;
      const Span sp = row_span<T, VEC, true>(xr, n_cols);
      const window::Part q = window::part_of(w, sc.bpr_div, sc.bpr, BV, sp.nvec);
      typename T::raw* yp = yr + sp.head + (i64)q.v0 * VEC;
      const bool ffma = T::KIND != 0 && fabsf(st.x) < FFMA_MAX_ABS;  // (uniform: the row's maximum)
      const float c0 = -st.x * KA_LOG2E + window::lg2_ftz(st.y);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = u * THREADS + t;
        if (c < q.n) {
          float f[VEC];
          unpack16<T, VEC>(reuse ? ring[((k + NSLOT - lag_steps) % NSLOT) * BV + c] : out_in[u], f);
#ifdef WN_COPY_ONLY
          if (true) {
#else
          if (ffma) {
#endif
#pragma unroll
            for (int e = 0; e < VEC; ++e) f[e] = window::ex2_ftz(fmaf(f[e], KA_LOG2E, c0));
          } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) f[e] = exp_shifted(f[e], st.x) * st.y;
          }
          store_vec<T, VEC>(yp + (i64)c * VEC, f);
        }
      }
      if (q.p == 0) {
        float eh, et;
        load_edges<T, VEC>(xr, sp, t, -KA_INF, eh, et);
        store_edges<T, VEC>(yr, sp, t, exp_shifted(eh, st.x) * st.y, exp_shifted(et, st.x) * st.y);
      }
    }
    if (WN_COMBINE_LATE) combine();
    const int wn = sc.output_part(j + G);
    if (!reuse && wn >= 0) window::load_part<T, VEC, U, THREADS>(out_in, x, ldx, wn, sc, n_cols, t);
  }
  window::cp_async_wait<0>();
}

// Backward. Ring: NSLOT steps x {statistics dy, y} x BV vectors; the output reads dy and y as the
// forward reads x.
template <class T, int VEC, int U, int THREADS, int NSLOT, int PD>
__global__ void __launch_bounds__(THREADS, WN_MIN_BLOCKS) bwd_window(const typename T::raw* __restrict__ dy,
                                                                     const typename T::raw* __restrict__ y,
                                                                     typename T::raw* __restrict__ dx, i64 rows,
                                                                     i64 cols, i64 lddy, i64 ldy, i64 lddx,
                                                                     void* __restrict__ ws, i64 bpr, i64 lag,
                                                                     i64 delay, i64 epoch) {
  typedef window::u64 u64;
  constexpr int BV = U * THREADS;
  extern __shared__ uint4 ring[];
  __shared__ float red[3][32];  // (statistics: alternating by step; the combination's)
  const int t = threadIdx.x;
  const unsigned tag = window::launch_tag(epoch);
  const window::Schedule sc(rows, bpr, lag, delay);
  u64* part_slot = static_cast<u64*>(ws);
  u64* row_slot = part_slot + 2 * (i64)sc.parts;
  const int steps = sc.steps(), G = gridDim.x, n_cols = (int)cols;
  auto issue = [&](int j, int slot) {
    if (j < sc.parts) {
      uint4* s = ring + slot * 2 * BV;
      window::copy_part<T, VEC, U, THREADS>(s, dy, lddy, j, sc, n_cols, t);
      window::copy_part<T, VEC, U, THREADS>(s + BV, y, ldy, j, sc, n_cols, t);
    }
    window::cp_async_commit();
  };
  static_assert(PD >= 1 && NSLOT > PD, "the ring holds the steps in flight and the current one");
#pragma unroll
  for (int q = 0; q < PD; ++q) issue((int)blockIdx.x + q * G, q);
  const int lag_steps = sc.lag / G;  // (as the forward's)
  const bool reuse = sc.lag % G == 0 && NSLOT >= PD + 1 + lag_steps;
  uint4 out_g[U], out_y[U];  // (the next step's output vectors, as the forward's)
  {
    const int w0 = sc.output_part(blockIdx.x);
    if (!reuse && w0 >= 0) {
      window::load_part<T, VEC, U, THREADS>(out_g, dy, lddy, w0, sc, n_cols, t);
      window::load_part<T, VEC, U, THREADS>(out_y, y, ldy, w0, sc, n_cols, t);
    }
  }
  int k = 0;
  for (int j = blockIdx.x; j < steps; j += G, ++k) {
    issue(j + PD * G, (k + PD) % NSLOT);
    const int w = sc.output_part(j);
    window::Peek row_peek;
    if (w >= 0) row_peek = window::peek(row_slot + 2 * (i64)sc.row_of(w));
    const int cr = sc.combined_row(j);
    window::Peeks<WN_PEEKS> partials;
    partials.ask(part_slot, cr, sc.bpr, t, THREADS);
    window::cp_async_wait<PD>();
    if (j < sc.parts) {  // statistics of part j
      const uint4* s = ring + (k % NSLOT) * 2 * BV;
      const int r = sc.row_of(j);
      const typename T::raw* gr = dy + (i64)r * lddy;
      const typename T::raw* yr = y + (i64)r * ldy;
      const Span sp = row_span<T, VEC, true>(yr, n_cols);  // (dy's rows at y's phase: the interface's rule)
      const window::Part q = window::part_of(j, sc.bpr_div, sc.bpr, BV, sp.nvec);
      float dot = 0.f;
      if (q.p == 0) {
        BackwardEdges<T, VEC> e;
        e.load(gr, yr, sp, t);
        dot = e.dot();
      }
      float du[U];  // (one chain per vector, then a tree over the vectors)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = u * THREADS + t;
        du[u] = 0.f;
        if (c < q.n) {
          float g[VEC], v[VEC];
          unpack16<T, VEC>(s[c], g);
          unpack16<T, VEC>(s[BV + c], v);
#pragma unroll
          for (int e = 0; e < VEC; ++e) du[u] = fmaf(g[e], v[e], du[u]);
        }
      }
      dot = block_sum<THREADS>(dot + window::tree_sum<U>(du), red[k & 1]);
      if (t == 0) window::publish(part_slot + 2 * (i64)j, window::slot_tag(tag, j), dot, 0.f);
    }
    auto combine = [&]() {  // the row's partials, in part order
      if (cr < 0) return;
      float part = 0.f;
      partials.each(part_slot, tag, cr, sc.bpr, t, THREADS, [&](float2 pv) { part += pv.x; });
      const float total = block_sum<THREADS>(part, red[2]);
      if (t == 0) window::publish(row_slot + 2 * (i64)cr, window::slot_tag(tag, (i64)sc.parts + cr), total, 0.f);
      __syncthreads();
    };
    if (!WN_COMBINE_LATE) combine();
    if (w >= 0) {  // output of part w
      const int r = sc.row_of(w);
      const float dot = window::await_slot(row_slot + 2 * (i64)r, window::slot_tag(tag, (i64)sc.parts + r), row_peek).x;
      const typename T::raw* gr = dy + (i64)r * lddy;
      const typename T::raw* yr = y + (i64)r * ldy;
      typename T::raw* dr = dx + (i64)r * lddx;
      const Span sp = row_span<T, VEC, true>(yr, n_cols);
      const window::Part q = window::part_of(w, sc.bpr_div, sc.bpr, BV, sp.nvec);
      typename T::raw* dp = dr + sp.head + (i64)q.v0 * VEC;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = u * THREADS + t;
        if (c < q.n) {
          float g[VEC], v[VEC];
          const uint4* so = ring + ((k + NSLOT - lag_steps) % NSLOT) * 2 * BV;
          unpack16<T, VEC>(reuse ? so[c] : out_g[u], g);
          unpack16<T, VEC>(reuse ? so[BV + c] : out_y[u], v);
#pragma unroll
          for (int e = 0; e < VEC; ++e) g[e] = v[e] * (g[e] - dot);
          store_vec<T, VEC>(dp + (i64)c * VEC, g);
        }
      }
      if (q.p == 0) {
        BackwardEdges<T, VEC> e;
        e.load(gr, yr, sp, t);
        e.store(dr, sp, t, dot);
      }
    }
    if (WN_COMBINE_LATE) combine();
    const int wn = sc.output_part(j + G);
    if (!reuse && wn >= 0) {
      window::load_part<T, VEC, U, THREADS>(out_g, dy, lddy, wn, sc, n_cols, t);
      window::load_part<T, VEC, U, THREADS>(out_y, y, ldy, wn, sc, n_cols, t);
    }
  }
  window::cp_async_wait<0>();
}

}  // namespace ka_softmax
