// Row softmax over the last dimension, forward and backward, for f32 / f16 / bf16 storage
// with f32 math. Self-contained (no toolkit headers) so NVRTC compiles it anywhere.
//
//   forward:  y = exp(x - max(x)) / sum(exp(x - max(x)))
//   backward: dx = y * (dy - sum(dy * y))
//
// Three ways to map a row onto the machine, chosen by the interface (softmax.py) from the row
// length:
//   *_warp   one warp per row, the row held in registers (short rows, <= 1024 elements);
//   *_block  one CTA per row, the row held in registers (up to 1024 threads x EPT elements);
//   *_looped one CTA per row of any length: a first pass computes the statistics (online
//            max/sum for the forward), a second pass re-reads the row and writes.
// Register-resident variants read each input once and write each output once.
// VEC is the elements per access: 16 bytes' worth when the operands are 16-byte aligned
// (the interface guarantees pointer, row stride and row length are multiples of VEC), else 1.
// Row strides are in elements; the outputs are contiguous but take a stride too.

namespace ka_softmax {

typedef unsigned short u16;
typedef long long i64;

#define KA_INF __int_as_float(0x7f800000)
#define KA_LOG2E 1.4426950408889634f

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

// 16-byte accesses. The cache hints are macros so that benchmarks can compare variants
// (benchmarks/softmax.py --sweep); the defaults are the measured best.
#ifndef KA_LD16
#define KA_LD16 "ld.global.nc.L1::no_allocate.v4.u32"
#endif
#ifndef KA_ST16
#define KA_ST16 "st.global.cs.v4.u32"
#endif
__device__ __forceinline__ uint4 ld16(const void* p) {
  uint4 r;
  asm(KA_LD16 " {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ void st16(void* p, uint4 v) {
  asm volatile(KA_ST16 " [%0], {%1, %2, %3, %4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// VEC raw elements; 16-byte packs move as one access.
template <class T, int VEC, bool WIDE = sizeof(typename T::raw) * VEC == 16>
struct Pack {
  typename T::raw r[VEC];
};
template <class T, int VEC>
struct Pack<T, VEC, true> {
  union {
    uint4 u;
    typename T::raw r[VEC];
  };
};

template <class T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack(const typename T::raw* p) {
  Pack<T, VEC> v;
  if constexpr (sizeof(typename T::raw) * VEC == 16) {
    v.u = ld16(p);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) v.r[k] = p[k];
  }
  return v;
}

// A thread's share of a row: NV packs, STRIDE packs apart. All loads are issued before any
// is converted, so that they are in flight together (converting right after each load would
// wait on it).
template <class T, int VEC, int NV, int STRIDE>
__device__ __forceinline__ void issue_row(const typename T::raw* __restrict__ p, int cols, int t,
                                          Pack<T, VEC> (&raw)[NV]) {
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = (j * STRIDE + t) * VEC;
    if (c < cols) raw[j] = load_pack<T, VEC>(p + c);
  }
}
template <class T, int VEC, int NV, int STRIDE>
__device__ __forceinline__ void convert_row(const Pack<T, VEC> (&raw)[NV], int cols, int t, float fill,
                                            float (&f)[NV][VEC]) {
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const bool ok = (j * STRIDE + t) * VEC < cols;
#pragma unroll
    for (int k = 0; k < VEC; ++k) f[j][k] = ok ? T::load(raw[j].r[k]) : fill;
  }
}

template <class T, int VEC>
__device__ __forceinline__ void store_vec(typename T::raw* p, const float (&f)[VEC]) {
  typedef typename T::raw R;
  if constexpr (sizeof(R) * VEC == 16) {
    union { uint4 u; R r[VEC]; } v;
#pragma unroll
    for (int k = 0; k < VEC; ++k) v.r[k] = T::store(f[k]);
    st16(p, v.u);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) p[k] = T::store(f[k]);
  }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block-wide reductions; each uses its own shared array so that consecutive reductions
// need only the one barrier inside.
template <int THREADS>
__device__ __forceinline__ float block_max(float v, float* sm) {
  v = warp_max(v);
  if constexpr (THREADS > 32) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) sm[warp] = v;
    __syncthreads();
    v = lane < THREADS / 32 ? sm[lane] : -KA_INF;
    v = warp_max(v);
  }
  return v;
}
template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float* sm) {
  v = warp_sum(v);
  if constexpr (THREADS > 32) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) sm[warp] = v;
    __syncthreads();
    v = lane < THREADS / 32 ? sm[lane] : 0.f;
    v = warp_sum(v);
  }
  return v;
}

// exp(v - m) with m the row maximum; v - m <= 0 so nothing overflows. A row of all -inf
// gives NaN, as torch.softmax does.
__device__ __forceinline__ float exp_shifted(float v, float m) { return exp2f((v - m) * KA_LOG2E); }

// ---------------------------------------------------------------- register-resident rows
// THREADS_PER_ROW lanes share a row; each holds NV accesses of VEC elements.
template <class T, int VEC, int NV, int THREADS_PER_ROW, int THREADS>
__device__ __forceinline__ void fwd_row_regs(const typename T::raw* __restrict__ xr, typename T::raw* __restrict__ yr,
                                             int cols, int t, float* sm) {
  float v[NV][VEC];
  {
    Pack<T, VEC> raw[NV];
    issue_row<T, VEC, NV, THREADS_PER_ROW>(xr, cols, t, raw);
    convert_row<T, VEC, NV, THREADS_PER_ROW>(raw, cols, t, -KA_INF, v);
  }
  float m = -KA_INF;
#pragma unroll
  for (int j = 0; j < NV; ++j)
#pragma unroll
    for (int k = 0; k < VEC; ++k) m = fmaxf(m, v[j][k]);
  m = THREADS_PER_ROW == 32 ? warp_max(m) : block_max<THREADS>(m, sm);
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < NV; ++j)
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      v[j][k] = exp_shifted(v[j][k], m);
      s += v[j][k];
    }
  s = THREADS_PER_ROW == 32 ? warp_sum(s) : block_sum<THREADS>(s, sm + 32);
  const float inv = 1.f / s;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = (j * THREADS_PER_ROW + t) * VEC;
    if (c < cols) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[j][k] *= inv;
      store_vec<T, VEC>(yr + c, v[j]);
    }
  }
}

template <class T, int VEC, int NV, int THREADS_PER_ROW, int THREADS>
__device__ __forceinline__ void bwd_row_regs(const typename T::raw* __restrict__ gr, const typename T::raw* __restrict__ yr,
                                             typename T::raw* __restrict__ dr, int cols, int t, float* sm) {
  float g[NV][VEC], y[NV][VEC];
  {
    Pack<T, VEC> rg[NV], ry[NV];
    issue_row<T, VEC, NV, THREADS_PER_ROW>(gr, cols, t, rg);
    issue_row<T, VEC, NV, THREADS_PER_ROW>(yr, cols, t, ry);
    convert_row<T, VEC, NV, THREADS_PER_ROW>(rg, cols, t, 0.f, g);
    convert_row<T, VEC, NV, THREADS_PER_ROW>(ry, cols, t, 0.f, y);
  }
  float dot = 0.f;
#pragma unroll
  for (int j = 0; j < NV; ++j)
#pragma unroll
    for (int k = 0; k < VEC; ++k) dot = fmaf(g[j][k], y[j][k], dot);
  dot = THREADS_PER_ROW == 32 ? warp_sum(dot) : block_sum<THREADS>(dot, sm);
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = (j * THREADS_PER_ROW + t) * VEC;
    if (c < cols) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) g[j][k] = y[j][k] * (g[j][k] - dot);
      store_vec<T, VEC>(dr + c, g[j]);
    }
  }
}

// One warp per row, WARPS rows per CTA.
template <class T, int VEC, int NV, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) fwd_warp(const typename T::raw* __restrict__ x, typename T::raw* __restrict__ y,
                                                       i64 rows, i64 cols, i64 ldx, i64 ldy) {
  const i64 row = (i64)blockIdx.x * WARPS + (threadIdx.x >> 5);
  if (row >= rows) return;
  fwd_row_regs<T, VEC, NV, 32, 32>(x + row * ldx, y + row * ldy, (int)cols, threadIdx.x & 31, nullptr);
}

template <class T, int VEC, int NV, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) bwd_warp(const typename T::raw* __restrict__ dy, const typename T::raw* __restrict__ y,
                                                       typename T::raw* __restrict__ dx, i64 rows, i64 cols, i64 lddy,
                                                       i64 ldy, i64 lddx) {
  const i64 row = (i64)blockIdx.x * WARPS + (threadIdx.x >> 5);
  if (row >= rows) return;
  bwd_row_regs<T, VEC, NV, 32, 32>(dy + row * lddy, y + row * ldy, dx + row * lddx, (int)cols, threadIdx.x & 31, nullptr);
}

// One CTA of THREADS per row.
template <class T, int VEC, int NV, int THREADS>
__global__ void __launch_bounds__(THREADS) fwd_block(const typename T::raw* __restrict__ x, typename T::raw* __restrict__ y,
                                                     i64 rows, i64 cols, i64 ldx, i64 ldy) {
  __shared__ float sm[64];
  const i64 row = blockIdx.x;
  fwd_row_regs<T, VEC, NV, THREADS, THREADS>(x + row * ldx, y + row * ldy, (int)cols, threadIdx.x, sm);
}

template <class T, int VEC, int NV, int THREADS>
__global__ void __launch_bounds__(THREADS) bwd_block(const typename T::raw* __restrict__ dy, const typename T::raw* __restrict__ y,
                                                     typename T::raw* __restrict__ dx, i64 rows, i64 cols, i64 lddy,
                                                     i64 ldy, i64 lddx) {
  __shared__ float sm[32];
  const i64 row = blockIdx.x;
  bwd_row_regs<T, VEC, NV, THREADS, THREADS>(dy + row * lddy, y + row * ldy, dx + row * lddx, (int)cols, threadIdx.x, sm);
}

// ---------------------------------------------------------------- rows of any length
// Pass 1 keeps a running (max, sum) per thread, rescaling the sum when the max grows, so the
// row is read twice in all (statistics, then output) instead of three times.
template <class T, int VEC, int UNROLL, int THREADS>
__global__ void __launch_bounds__(THREADS) fwd_looped(const typename T::raw* __restrict__ x, typename T::raw* __restrict__ y,
                                                      i64 rows, i64 cols, i64 ldx, i64 ldy) {
  __shared__ float sm[64];
  const typename T::raw* xr = x + (i64)blockIdx.x * ldx;
  typename T::raw* yr = y + (i64)blockIdx.x * ldy;
  const i64 chunk = (i64)THREADS * VEC * UNROLL;  // elements the CTA covers per iteration
  const int t = threadIdx.x;
  float m = -KA_INF, s = 0.f;
  for (i64 off = 0; off < cols; off += chunk) {
    const int rest = (int)(cols - off < chunk ? cols - off : chunk);  // elements left in this chunk
    float v[UNROLL][VEC];
    {
      Pack<T, VEC> raw[UNROLL];
      issue_row<T, VEC, UNROLL, THREADS>(xr + off, rest, t, raw);
      convert_row<T, VEC, UNROLL, THREADS>(raw, rest, t, -KA_INF, v);
    }
    float cm = m;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int k = 0; k < VEC; ++k) cm = fmaxf(cm, v[u][k]);
    if (cm > m) {
      s *= exp_shifted(m, cm);
      m = cm;
    }
    if (m != -KA_INF) {  // a thread that has seen only -inf contributes nothing (not NaN)
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
#pragma unroll
        for (int k = 0; k < VEC; ++k) s += exp_shifted(v[u][k], m);
    }
  }
  const float row_max = block_max<THREADS>(m, sm);
  s = m == -KA_INF ? 0.f : s * exp_shifted(m, row_max);
  const float inv = 1.f / block_sum<THREADS>(s, sm + 32);
  for (i64 off = 0; off < cols; off += chunk) {
    const int rest = (int)(cols - off < chunk ? cols - off : chunk);  // elements left in this chunk
    float v[UNROLL][VEC];
    {
      Pack<T, VEC> raw[UNROLL];
      issue_row<T, VEC, UNROLL, THREADS>(xr + off, rest, t, raw);
      convert_row<T, VEC, UNROLL, THREADS>(raw, rest, t, 0.f, v);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = (u * THREADS + t) * VEC;
      if (c < rest) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[u][k] = exp_shifted(v[u][k], row_max) * inv;
        store_vec<T, VEC>(yr + off + c, v[u]);
      }
    }
  }
}

template <class T, int VEC, int UNROLL, int THREADS>
__global__ void __launch_bounds__(THREADS) bwd_looped(const typename T::raw* __restrict__ dy, const typename T::raw* __restrict__ y,
                                                      typename T::raw* __restrict__ dx, i64 rows, i64 cols, i64 lddy,
                                                      i64 ldy, i64 lddx) {
  __shared__ float sm[32];
  const typename T::raw* gr = dy + (i64)blockIdx.x * lddy;
  const typename T::raw* yr = y + (i64)blockIdx.x * ldy;
  typename T::raw* dr = dx + (i64)blockIdx.x * lddx;
  const i64 chunk = (i64)THREADS * VEC * UNROLL;
  const int t = threadIdx.x;
  float dot = 0.f;
  for (i64 off = 0; off < cols; off += chunk) {
    const int rest = (int)(cols - off < chunk ? cols - off : chunk);  // elements left in this chunk
    float g[UNROLL][VEC], w[UNROLL][VEC];
    {
      Pack<T, VEC> rg[UNROLL], ry[UNROLL];
      issue_row<T, VEC, UNROLL, THREADS>(gr + off, rest, t, rg);
      issue_row<T, VEC, UNROLL, THREADS>(yr + off, rest, t, ry);
      convert_row<T, VEC, UNROLL, THREADS>(rg, rest, t, 0.f, g);
      convert_row<T, VEC, UNROLL, THREADS>(ry, rest, t, 0.f, w);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int k = 0; k < VEC; ++k) dot = fmaf(g[u][k], w[u][k], dot);
  }
  dot = block_sum<THREADS>(dot, sm);
  for (i64 off = 0; off < cols; off += chunk) {
    const int rest = (int)(cols - off < chunk ? cols - off : chunk);  // elements left in this chunk
    float g[UNROLL][VEC], w[UNROLL][VEC];
    {
      Pack<T, VEC> rg[UNROLL], ry[UNROLL];
      issue_row<T, VEC, UNROLL, THREADS>(gr + off, rest, t, rg);
      issue_row<T, VEC, UNROLL, THREADS>(yr + off, rest, t, ry);
      convert_row<T, VEC, UNROLL, THREADS>(rg, rest, t, 0.f, g);
      convert_row<T, VEC, UNROLL, THREADS>(ry, rest, t, 0.f, w);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = (u * THREADS + t) * VEC;
      if (c < rest) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) g[u][k] = w[u][k] * (g[u][k] - dot);
        store_vec<T, VEC>(dr + off + c, g[u]);
      }
    }
  }
}

}  // namespace ka_softmax
