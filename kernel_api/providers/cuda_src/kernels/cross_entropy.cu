// Cross-entropy over rows of logits against one class index per row, for f32 / f16 / bf16
// logits with f32 math. Self-contained (no toolkit headers) so NVRTC compiles it anywhere.
//
//   lse[r]  = log(sum_j exp(x[r, j]))
//   loss[r] = (1 - s) (lse - x[r, t]) + s (lse - mean_j x[r, j]) + z lse^2      (0 if t == ignore)
//   grad[r, j] = w[r] (p[r, j] (1 + 2 z lse) - s / V - (1 - s) [j == t])          (0 if t == ignore)
//
// with p = softmax(x), s the label smoothing, z the z-loss weight and w[r] the row's loss weight
// (grad_loss, one float per row or one for all: stride 0).
//
// One CTA per row. MODE 0 reads the row once: a running maximum and sum of exponentials (the
// sum rescaled when a pack raises the maximum), and the row's sum for the smoothing term.
// MODE 1 then reads the row again (from L2: a CTA's row was read just before, and with one
// 1024-thread CTA per SM the rows in flight fit in L2) and writes the gradient, which may
// replace the logits in place: each thread reads an element before it writes it, and only the
// thread that reads an element writes it. MODE 2 is that second pass alone, from a saved lse.
//
// Rows may start at any element: each row splits into scalar elements up to its first 16-byte
// boundary, 16-byte vectors, and a scalar tail. The gradient's row is written with 16-byte
// vectors when it sits at the same offset from a 16-byte boundary as the logits' row, else
// element by element.
//
// REDUCE 1 (sum) or 2 (mean) reduces the rows' losses in the same launch: `loss` is then a buffer
// {the loss, a row's weight in it, a 64-bit arrival counter (0 after the launch), the loss of each
// row}. Each CTA
// writes its row's loss, then counts itself in on the counter (`arrive`); the CTA that arrives last
// adds the rows' losses in a fixed order (in f64; the count of rows not ignored from the
// targets), so the result does not depend on which CTA finishes when, writes the loss and the
// weight (1 / the rows not ignored, at least 1, for a mean; 1 for a sum) and clears the counter. The counter carries this launch's tag (from %gridid, odd and below 2^31,
// so no fill pattern reads as current): the buffer needs no initialisation, a fresh one from the
// allocator serves, and CUDA graph replays differ.

namespace ka_ce {

typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;

#define CE_INF __int_as_float(0x7f800000)
#define CE_LOG2E 1.4426950408889634f

struct F32 {
  typedef float raw;
  static __device__ __forceinline__ float load(float v) { return v; }
  static __device__ __forceinline__ float store(float v) { return v; }
};

struct BF16 {
  typedef u16 raw;
  static __device__ __forceinline__ float load(u16 v) { return __uint_as_float(((unsigned)v) << 16); }
  static __device__ __forceinline__ u16 store(float v) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
    return r;
  }
};

struct F16 {
  typedef u16 raw;
  static __device__ __forceinline__ float load(u16 v) {
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(v));
    return r;
  }
  static __device__ __forceinline__ u16 store(float v) {
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
    return r;
  }
};

// 2^v: one MUFU.EX2 (flushes results below 2^-126 to zero, far under every dtype's resolution
// of a probability that sums with others to 1).
__device__ __forceinline__ float ex2(float v) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}

// Plain (coherent) 16-byte accesses: the gradient may overwrite the row being read.
__device__ __forceinline__ uint4 ld16(const void* p) {
  uint4 r;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ void st16(void* p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

template <class T, int VEC>
struct Pack {
  union {
    uint4 u;
    typename T::raw r[VEC];
  };
};

// (m, s) <- the pair for the union of the elements behind (m, s) and (m2, s2).
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float mn = fmaxf(m, m2);
  if (mn == -CE_INF) return;  // both empty (or all -inf): s stays 0
  s = s * ex2((m - mn) * CE_LOG2E) + s2 * ex2((m2 - mn) * CE_LOG2E);
  m = mn;
}

// One element into the running pair.
__device__ __forceinline__ void add_one(float& m, float& s, float& sx, float x) {
  if (x > m) {
    s = s * ex2((m - x) * CE_LOG2E);
    m = x;
  }
  if (m != -CE_INF) s += ex2((x - m) * CE_LOG2E);
  sx += x;
}

// The block's (max, sum of exp) and sum of x, in every thread.
template <int THREADS>
__device__ __forceinline__ void block_stats(float& m, float& s, float& sx, float* sm) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
    sx += __shfl_xor_sync(0xffffffffu, sx, o);
    merge(m, s, m2, s2);
  }
  if constexpr (THREADS > 32) {
    constexpr int WARPS = THREADS / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
      sm[warp] = m;
      sm[32 + warp] = s;
      sm[64 + warp] = sx;
    }
    __syncthreads();
    m = lane < WARPS ? sm[lane] : -CE_INF;
    s = lane < WARPS ? sm[32 + lane] : 0.f;
    sx = lane < WARPS ? sm[64 + lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
      const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
      sx += __shfl_xor_sync(0xffffffffu, sx, o);
      merge(m, s, m2, s2);
    }
  }
}

// This launch's tag: odd and below 2^31, different for every launch (%gridid).
__device__ __forceinline__ unsigned launch_tag() {
  u64 g;
  asm volatile("mov.u64 %0, %%gridid;" : "=l"(g));
  return ((((unsigned)g * 0x9E3779B1u) ^ (unsigned)(g >> 32)) | 1u) & 0x7FFFFFFFu;
}

// Counts the calling CTA in: the CTAs arrived so far, this one included. A counter that does
// not carry `tag` (another launch's, or a fill pattern) counts as none: the first CTAs to
// arrive set it to {tag, 1} with a CAS; once it carries the tag it keeps it until the last CTA
// clears it, so every later CTA adds itself with an atomicAdd, which the L2 serves at its rate
// (a CAS loop on one word would serialise thousands of CTAs, one round trip each).
__device__ __forceinline__ unsigned arrive(u64* counter, unsigned tag) {
  u64 seen = *reinterpret_cast<volatile u64*>(counter);
  for (;;) {
    if ((unsigned)(seen >> 32) == tag) return (unsigned)atomicAdd(counter, 1ull) + 1u;
    const u64 was = atomicCAS(counter, seen, ((u64)tag << 32) | 1u);
    if (was == seen) return 1u;
    seen = was;
  }
}

// The reduction's epilogue (module comment): `v` is this row's loss (0 when ignored), known to
// thread 0. Every thread of every CTA calls it.
template <class I, int THREADS, int REDUCE>
__device__ __forceinline__ void reduce_rows(float* buf, float v, const I* __restrict__ target, i64 rows,
                                            i64 ignore_index) {
  __shared__ int last;
  __shared__ double ssum[32];
  __shared__ int scount[32];
  const int t = threadIdx.x;
  u64* counter = reinterpret_cast<u64*>(buf + 2);
  float* parts = buf + 4;
  if (t == 0) {
    parts[blockIdx.x] = v;
    __threadfence();  // the row's loss before its arrival
    last = arrive(counter, launch_tag()) == gridDim.x;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  double s = 0.0;
  int count = 0;
  for (i64 r = t; r < rows; r += THREADS) {
    s += (double)__ldcg(parts + r);  // (from L2: other CTAs wrote them)
    if constexpr (REDUCE == 2) count += (i64)target[r] != ignore_index;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, o);
    count += __shfl_xor_sync(0xffffffffu, count, o);
  }
  constexpr int WARPS = THREADS / 32;
  const int lane = t & 31, warp = t >> 5;
  if (lane == 0) {
    ssum[warp] = s;
    scount[warp] = count;
  }
  __syncthreads();
  if (warp == 0) {
    s = lane < WARPS ? ssum[lane] : 0.0;
    count = lane < WARPS ? scount[lane] : 0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      s += __shfl_xor_sync(0xffffffffu, s, o);
      count += __shfl_xor_sync(0xffffffffu, count, o);
    }
    if (lane == 0) {
      buf[0] = REDUCE == 2 ? (float)(s / (double)count) : (float)s;  // (0 / 0: NaN, as torch's mean of nothing)
      buf[1] = REDUCE == 2 ? (float)(1.0 / (double)max(count, 1)) : 1.f;
      *counter = 0ull;
    }
  }
}

// MODE 0: loss (and lse, unless lse_io is null); MODE 1: also the gradient; MODE 2: the
// gradient from lse_io. I: the class index type (long long or int). UNROLL vectors per thread
// are loaded before any is used, so that they are in flight together. REDUCE: see the module
// comment (MODE 0 and 1 only; lse_io null).
template <class T, class I, int VEC, int THREADS, int MODE, int REDUCE = 0, int UNROLL = 4>
__global__ void __launch_bounds__(THREADS) ce_rows(const typename T::raw* logits, i64 ldx, const I* __restrict__ target,
                                                   i64 cols, float* loss, float* lse_io, typename T::raw* grad,
                                                   i64 ldg, const float* __restrict__ grad_loss, i64 gl_stride,
                                                   i64 ignore_index, float smoothing, float z_loss) {
  static_assert(REDUCE == 0 || MODE != 2, "the backward writes no loss");
  typedef typename T::raw raw;
  __shared__ float sm[96];
  const i64 row = blockIdx.x;
  const raw* xr = logits + row * ldx;
  raw* gr = grad + row * ldg;
  const int t = threadIdx.x;
  const int n = (int)cols;
  const i64 tgt = (i64)target[row];

  if (tgt == ignore_index) {
    if constexpr (MODE != 2 && REDUCE == 0) {
      if (t == 0) {
        loss[row] = 0.f;
        if (lse_io) lse_io[row] = 0.f;
      }
    }
    if constexpr (MODE != 0) {  // a zero row: 16-byte stores between scalar edges
      const int gmis = (int)(((u64)gr & 15) / sizeof(raw));
      const int ghead = min((VEC - gmis) & (VEC - 1), n);
      const int gnvec = (n - ghead) / VEC;
      const int gtail0 = ghead + gnvec * VEC;
      if (t < ghead) gr[t] = T::store(0.f);
      if (gtail0 + t < n) gr[gtail0 + t] = T::store(0.f);
      uint4* gv = reinterpret_cast<uint4*>(gr + ghead);
      for (int v = t; v < gnvec; v += THREADS) st16(gv + v, make_uint4(0u, 0u, 0u, 0u));
    }
    if constexpr (REDUCE != 0) reduce_rows<I, THREADS, REDUCE>(loss, 0.f, target, gridDim.x, ignore_index);
    return;
  }

  const int mis = (int)(((u64)xr & 15) / sizeof(raw));
  const int head = min((VEC - mis) & (VEC - 1), n);
  const int nvec = (n - head) / VEC;
  const int tail0 = head + nvec * VEC;
  const int edges = head + (n - tail0);  // < 2 VEC <= THREADS
  const int edge = t < head ? t : tail0 + (t - head);  // this thread's scalar element, if t < edges
  const Pack<T, VEC>* xv = reinterpret_cast<const Pack<T, VEC>*>(xr + head);
  const bool in_range = tgt >= 0 && tgt < cols;

  float lse, row_loss = 0.f;
  if constexpr (MODE != 2) {
    const float xt = in_range ? T::load(xr[tgt]) : __int_as_float(0x7fffffff);  // read before any write
    float m = -CE_INF, s = 0.f, sx = 0.f;
    if (t < edges) add_one(m, s, sx, T::load(xr[edge]));
    for (int base = 0; base < nvec; base += THREADS * UNROLL) {
      Pack<T, VEC> p[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int v = base + u * THREADS + t;
        if (v < nvec) p[u].u = ld16(xv + v);
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int v = base + u * THREADS + t;
        if (v < nvec) {
          float f[VEC];
          float pm = -CE_INF;
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            f[k] = T::load(p[u].r[k]);
            pm = fmaxf(pm, f[k]);
            sx += f[k];
          }
          if (pm > m) {
            s = s * ex2((m - pm) * CE_LOG2E);
            m = pm;
          }
          if (m != -CE_INF) {
            const float ml = m * CE_LOG2E;
#pragma unroll
            for (int k = 0; k < VEC; ++k) s += ex2(fmaf(f[k], CE_LOG2E, -ml));
          }
        }
      }
    }
    block_stats<THREADS>(m, s, sx, sm);
    lse = m + logf(s);
    if (t == 0) {
      row_loss = (1.f - smoothing) * (lse - xt) + smoothing * (lse - sx / (float)n) + z_loss * lse * lse;
      if constexpr (REDUCE == 0) loss[row] = row_loss;
      if (lse_io) lse_io[row] = lse;
    }
  } else {
    lse = lse_io[row];
  }

  if constexpr (MODE != 0) {
    const float w = grad_loss[row * gl_stride];
    const float coef = w * (1.f + 2.f * z_loss * lse);
    const float sub = w * smoothing / (float)n;
    const float hit = w * (1.f - smoothing);
    const float l2 = lse * CE_LOG2E;
    if (t < edges) {
      const float x = T::load(xr[edge]);
      float g = ex2(fmaf(x, CE_LOG2E, -l2)) * coef - sub;
      if (edge == tgt) g -= hit;
      gr[edge] = T::store(g);
    }
    const bool vector_store = (((u64)gr ^ (u64)xr) & 15) == 0;
    raw* gh = gr + head;
    for (int base = 0; base < nvec; base += THREADS * UNROLL) {
      Pack<T, VEC> p[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int v = base + u * THREADS + t;
        if (v < nvec) p[u].u = ld16(xv + v);
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int v = base + u * THREADS + t;
        if (v < nvec) {
          const int j0 = head + v * VEC;
          Pack<T, VEC> o;
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            float g = ex2(fmaf(T::load(p[u].r[k]), CE_LOG2E, -l2)) * coef - sub;
            if (j0 + k == tgt) g -= hit;
            o.r[k] = T::store(g);
          }
          if (vector_store) {
            st16(gh + (i64)v * VEC, o.u);
          } else {
#pragma unroll
            for (int k = 0; k < VEC; ++k) gh[(i64)v * VEC + k] = o.r[k];
          }
        }
      }
    }
  }
  if constexpr (REDUCE != 0) reduce_rows<I, THREADS, REDUCE>(loss, row_loss, target, gridDim.x, ignore_index);
}

}  // namespace ka_ce
