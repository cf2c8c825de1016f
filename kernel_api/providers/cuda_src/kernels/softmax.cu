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

// KIND: what packed 16-bit math applies (max2_pack, scale_pack_bf16): 0 none, 1 bf16x2, 2 f16x2.
struct F32 {
  typedef float raw;
  enum { KIND = 0 };
  static __device__ __forceinline__ float load(float v) { return v; }
  static __device__ __forceinline__ float store(float v) { return v; }
};

struct BF16 {
  typedef u16 raw;
  enum { KIND = 1 };
  static __device__ __forceinline__ float load(u16 v) { return __uint_as_float(((unsigned)v) << 16); }
  static __device__ __forceinline__ u16 store(float v) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
    return r;
  }
};

struct F16 {
  typedef u16 raw;
  enum { KIND = 2 };
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

// A 16-byte pack (one vector in shared memory) to floats and back.
template <class T, int VEC>
__device__ __forceinline__ void unpack16(uint4 u, float (&f)[VEC]) {
  if constexpr (T::KIND == 1) {  // bf16 pairs: a shift and a mask per word, no 16-bit extracts
    static_assert(VEC == 8, "a 16-byte pack holds 8 bf16 values");
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  } else {
    Pack<T, VEC> p;
    p.u = u;
#pragma unroll
    for (int k = 0; k < VEC; ++k) f[k] = T::load(p.r[k]);
  }
}
template <class T, int VEC>
__device__ __forceinline__ uint4 pack16(const float (&f)[VEC]) {
  Pack<T, VEC> p;
#pragma unroll
  for (int k = 0; k < VEC; ++k) p.r[k] = T::store(f[k]);
  return p.u;
}

// Packed 16-bit math on a 16-byte pack (T::KIND 1: bf16, 2: f16): two values per instruction.
// The running maximum of the pack's values, two lanes at a time (max rounds nothing, so this is
// exact; a NaN loses to the other operand, as with fmaxf); `max2_init` is -inf in both lanes,
// `max2_value` the larger lane as a float.
template <class T>
__device__ __forceinline__ unsigned max2_init() {
  return T::KIND == 1 ? 0xFF80FF80u : 0xFC00FC00u;
}
template <class T>
__device__ __forceinline__ unsigned max2_pack(uint4 u, unsigned acc) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (T::KIND == 1)
      asm("max.bf16x2 %0, %0, %1;" : "+r"(acc) : "r"(w[i]));
    else
      asm("max.f16x2 %0, %0, %1;" : "+r"(acc) : "r"(w[i]));
  }
  return acc;
}
template <class T>
__device__ __forceinline__ float max2_value(unsigned acc) {
  return fmaxf(T::load((u16)(acc & 0xFFFFu)), T::load((u16)(acc >> 16)));
}
// bf16 values times a float scale, rounded once to bf16: the scale split into bf16 parts
// hi + lo, each value v to fma(v, hi, v * lo) (v * lo is 2^-8 of the product or less, so its
// own rounding is below the result's). sm_90 (mul.rn.bf16x2).
__device__ __forceinline__ void scale_split_bf16(float scale, unsigned& hi2, unsigned& lo2) {
  const u16 hi = BF16::store(scale);
  const u16 lo = BF16::store(scale - BF16::load(hi));
  hi2 = (unsigned)hi | ((unsigned)hi << 16);
  lo2 = (unsigned)lo | ((unsigned)lo << 16);
}
__device__ __forceinline__ uint4 scale_pack_bf16(uint4 u, unsigned hi2, unsigned lo2) {
  unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    unsigned t;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(t) : "r"(w[i]), "r"(lo2));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(w[i]) : "r"(w[i]), "r"(hi2), "r"(t));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

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

// A row as the vector loops see it: PEEL kernels take rows at any element alignment and split
// each into `head` scalar elements up to the first 16-byte boundary, `nvec` VEC-wide accesses
// from there, and `tail` scalar elements after them (head, tail < VEC). Without PEEL the
// interface guarantees 16-byte-aligned rows whose length VEC divides, so head = tail = 0.
struct Span {
  int head, nvec, tail;
};
template <class T, int VEC, bool PEEL>
__device__ __forceinline__ Span row_span(const void* row, int cols) {
  Span s;
  s.head = 0;
  if constexpr (PEEL) {
    const int mis = (int)(((unsigned long long)row & 15) / sizeof(typename T::raw));
    s.head = min((VEC - mis) & (VEC - 1), cols);
  }
  s.nvec = (cols - s.head) / VEC;
  s.tail = cols - s.head - s.nvec * VEC;
  return s;
}

// A thread's share of a row: NV packs, STRIDE packs apart, of the nvec packs from p. All loads
// are issued before any is converted, so that they are in flight together (converting right
// after each load would wait on it).
template <class T, int VEC, int NV, int STRIDE>
__device__ __forceinline__ void issue_row(const typename T::raw* __restrict__ p, int nvec, int t,
                                          Pack<T, VEC> (&raw)[NV]) {
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int v = j * STRIDE + t;
    if (v < nvec) raw[j] = load_pack<T, VEC>(p + (i64)v * VEC);
  }
}
template <class T, int VEC, int NV, int STRIDE>
__device__ __forceinline__ void convert_row(const Pack<T, VEC> (&raw)[NV], int nvec, int t, float fill,
                                            float (&f)[NV][VEC]) {
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const bool ok = j * STRIDE + t < nvec;
#pragma unroll
    for (int k = 0; k < VEC; ++k) f[j][k] = ok ? T::load(raw[j].r[k]) : fill;
  }
}

// The peeled elements of a row: thread t < head holds head element t and thread t < tail
// holds tail element t (``fill`` where it holds none). Needs at least VEC threads per row.
template <class T, int VEC>
__device__ __forceinline__ void load_edges(const typename T::raw* row, const Span& s, int t, float fill, float& h,
                                           float& e) {
  h = t < s.head ? T::load(row[t]) : fill;
  e = t < s.tail ? T::load(row[s.head + (i64)s.nvec * VEC + t]) : fill;
}
template <class T, int VEC>
__device__ __forceinline__ void store_edges(typename T::raw* row, const Span& s, int t, float h, float e) {
  if (t < s.head) row[t] = T::store(h);
  if (t < s.tail) row[s.head + (i64)s.nvec * VEC + t] = T::store(e);
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

// One CTA's row (blockIdx.x) of the backward's operands dy, y and dx, and y's span (the
// interface keeps the three at one phase of 16 bytes, so y's span cuts all three).
template <class T, int VEC, bool PEEL>
struct BackwardRow {
  const typename T::raw* g;
  const typename T::raw* y;
  typename T::raw* d;
  Span sp;
  __device__ __forceinline__ BackwardRow(const typename T::raw* dy, const typename T::raw* y_, typename T::raw* dx,
                                         i64 cols, i64 lddy, i64 ldy, i64 lddx)
      : g(dy + (i64)blockIdx.x * lddy), y(y_ + (i64)blockIdx.x * ldy), d(dx + (i64)blockIdx.x * lddx),
        sp(row_span<T, VEC, PEEL>(y, (int)cols)) {}
};

// The peeled head and tail of a backward row (dy's and y's; zeros where a thread holds none or
// nothing was loaded), their share of sum(dy * y), and their gradient.
template <class T, int VEC>
struct BackwardEdges {
  float gh = 0.f, gt = 0.f, yh = 0.f, yt = 0.f;
  __device__ __forceinline__ void load(const typename T::raw* gr, const typename T::raw* yr, const Span& s, int t) {
    load_edges<T, VEC>(gr, s, t, 0.f, gh, gt);
    load_edges<T, VEC>(yr, s, t, 0.f, yh, yt);
  }
  __device__ __forceinline__ float dot() const { return gh * yh + gt * yt; }
  __device__ __forceinline__ void store(typename T::raw* dr, const Span& s, int t, float dot) const {
    store_edges<T, VEC>(dr, s, t, yh * (gh - dot), yt * (gt - dot));
  }
};

// L2 eviction policies for loads with a cache hint: evict_first for data read for the last
// time, evict_last for data read again soon.
__device__ __forceinline__ unsigned long long l2_evict_first_policy() {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ unsigned long long l2_evict_last_policy() {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  return p;
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
// gives NaN, as torch.softmax does. ex2.approx.ftz: one MUFU.EX2, where exp2f's handling of
// subnormal results costs three more instructions per element (the forward's statistics
// were instruction-bound: +2-7 % on the H200's forwards); results below 2^-126 flush to zero, an error below
// 1.2e-38, under every dtype's output resolution there (an f32 output's subnormals aside).
__device__ __forceinline__ float exp_shifted(float v, float m) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"((v - m) * KA_LOG2E));
  return r;
}

// (m, s) merged with (m2, s2), both sums of exp(v - their max) (the long-row families' partials).
__device__ __forceinline__ void merge_stats(float& m, float& s, float m2, float s2) {
  if (m2 > m) {
    s = s * exp_shifted(m, m2) + s2;
    m = m2;
  } else if (m2 != -KA_INF) {
    s += s2 * exp_shifted(m2, m);
  }
}

// ---------------------------------------------------------------- register-resident rows
// THREADS_PER_ROW lanes share a row; each holds NV accesses of VEC elements (and, with PEEL,
// up to two peeled elements).
template <class T, int VEC, int NV, int THREADS_PER_ROW, int THREADS, bool PEEL>
__device__ __forceinline__ void fwd_row_regs(const typename T::raw* __restrict__ xr, typename T::raw* __restrict__ yr,
                                             int cols, int t, float* sm) {
  const Span sp = row_span<T, VEC, PEEL>(xr, cols);
  float v[NV][VEC];
  float eh = -KA_INF, et = -KA_INF;
  {
    Pack<T, VEC> raw[NV];
    issue_row<T, VEC, NV, THREADS_PER_ROW>(xr + sp.head, sp.nvec, t, raw);
    if constexpr (PEEL) load_edges<T, VEC>(xr, sp, t, -KA_INF, eh, et);
    convert_row<T, VEC, NV, THREADS_PER_ROW>(raw, sp.nvec, t, -KA_INF, v);
  }
  float m = fmaxf(eh, et);
#pragma unroll
  for (int j = 0; j < NV; ++j)
#pragma unroll
    for (int k = 0; k < VEC; ++k) m = fmaxf(m, v[j][k]);
  m = THREADS_PER_ROW == 32 ? warp_max(m) : block_max<THREADS>(m, sm);
  float s = 0.f;
  if constexpr (PEEL) {
    eh = exp_shifted(eh, m);
    et = exp_shifted(et, m);
    s = eh + et;
  }
#pragma unroll
  for (int j = 0; j < NV; ++j)
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      v[j][k] = exp_shifted(v[j][k], m);
      s += v[j][k];
    }
  s = THREADS_PER_ROW == 32 ? warp_sum(s) : block_sum<THREADS>(s, sm + 32);
  const float inv = 1.f / s;
  typename T::raw* yb = yr + sp.head;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = j * THREADS_PER_ROW + t;
    if (c < sp.nvec) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[j][k] *= inv;
      store_vec<T, VEC>(yb + (i64)c * VEC, v[j]);
    }
  }
  if constexpr (PEEL) store_edges<T, VEC>(yr, sp, t, eh * inv, et * inv);
}

template <class T, int VEC, int NV, int THREADS_PER_ROW, int THREADS, bool PEEL>
__device__ __forceinline__ void bwd_row_regs(const typename T::raw* __restrict__ gr, const typename T::raw* __restrict__ yr,
                                             typename T::raw* __restrict__ dr, int cols, int t, float* sm) {
  const Span sp = row_span<T, VEC, PEEL>(yr, cols);
  float g[NV][VEC], y[NV][VEC];
  BackwardEdges<T, VEC> e;
  {
    Pack<T, VEC> rg[NV], ry[NV];
    issue_row<T, VEC, NV, THREADS_PER_ROW>(gr + sp.head, sp.nvec, t, rg);
    issue_row<T, VEC, NV, THREADS_PER_ROW>(yr + sp.head, sp.nvec, t, ry);
    if constexpr (PEEL) e.load(gr, yr, sp, t);
    convert_row<T, VEC, NV, THREADS_PER_ROW>(rg, sp.nvec, t, 0.f, g);
    convert_row<T, VEC, NV, THREADS_PER_ROW>(ry, sp.nvec, t, 0.f, y);
  }
  float dot = e.dot();
#pragma unroll
  for (int j = 0; j < NV; ++j)
#pragma unroll
    for (int k = 0; k < VEC; ++k) dot = fmaf(g[j][k], y[j][k], dot);
  dot = THREADS_PER_ROW == 32 ? warp_sum(dot) : block_sum<THREADS>(dot, sm);
  typename T::raw* db = dr + sp.head;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = j * THREADS_PER_ROW + t;
    if (c < sp.nvec) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) g[j][k] = y[j][k] * (g[j][k] - dot);
      store_vec<T, VEC>(db + (i64)c * VEC, g[j]);
    }
  }
  if constexpr (PEEL) e.store(dr, sp, t, dot);
}

// One warp per row, WARPS rows per CTA.
template <class T, int VEC, int NV, int WARPS, bool PEEL = false>
__global__ void __launch_bounds__(WARPS * 32) fwd_warp(const typename T::raw* __restrict__ x, typename T::raw* __restrict__ y,
                                                       i64 rows, i64 cols, i64 ldx, i64 ldy) {
  const i64 row = (i64)blockIdx.x * WARPS + (threadIdx.x >> 5);
  if (row >= rows) return;
  fwd_row_regs<T, VEC, NV, 32, 32, PEEL>(x + row * ldx, y + row * ldy, (int)cols, threadIdx.x & 31, nullptr);
}

template <class T, int VEC, int NV, int WARPS, bool PEEL = false>
__global__ void __launch_bounds__(WARPS * 32) bwd_warp(const typename T::raw* __restrict__ dy, const typename T::raw* __restrict__ y,
                                                       typename T::raw* __restrict__ dx, i64 rows, i64 cols, i64 lddy,
                                                       i64 ldy, i64 lddx) {
  const i64 row = (i64)blockIdx.x * WARPS + (threadIdx.x >> 5);
  if (row >= rows) return;
  bwd_row_regs<T, VEC, NV, 32, 32, PEEL>(dy + row * lddy, y + row * ldy, dx + row * lddx, (int)cols, threadIdx.x & 31,
                                         nullptr);
}

// One CTA of THREADS per row.
template <class T, int VEC, int NV, int THREADS, bool PEEL = false>
__global__ void __launch_bounds__(THREADS) fwd_block(const typename T::raw* __restrict__ x, typename T::raw* __restrict__ y,
                                                     i64 rows, i64 cols, i64 ldx, i64 ldy) {
  __shared__ float sm[64];
  const i64 row = blockIdx.x;
  fwd_row_regs<T, VEC, NV, THREADS, THREADS, PEEL>(x + row * ldx, y + row * ldy, (int)cols, threadIdx.x, sm);
}

template <class T, int VEC, int NV, int THREADS, bool PEEL = false>
__global__ void __launch_bounds__(THREADS) bwd_block(const typename T::raw* __restrict__ dy, const typename T::raw* __restrict__ y,
                                                     typename T::raw* __restrict__ dx, i64 rows, i64 cols, i64 lddy,
                                                     i64 ldy, i64 lddx) {
  __shared__ float sm[32];
  const i64 row = blockIdx.x;
  bwd_row_regs<T, VEC, NV, THREADS, THREADS, PEEL>(dy + row * lddy, y + row * ldy, dx + row * lddx, (int)cols, threadIdx.x,
                                                   sm);
}

// ---------------------------------------------------------------- rows of any length
// A CTA's statistics over the vectors [0, nvec) from xb (plus, with PEEL, the edges eh, et
// it holds), read in chunks of THREADS x UNROLL vectors: a running (max, sum) per thread,
// the sum rescaled when the max grows, so the row is read twice in all (statistics, then
// output) instead of three times. Returns the thread's (m, s).
template <class T, int VEC, int UNROLL, int THREADS>
__device__ __forceinline__ void online_stats(const typename T::raw* __restrict__ xb, int nvec, int t, float e0, float e1,
                                             float& m, float& s) {
  m = fmaxf(e0, e1);
  s = m == -KA_INF ? 0.f : exp_shifted(e0, m) + exp_shifted(e1, m);
  const int chunk = THREADS * UNROLL;  // vectors the CTA covers per iteration
  for (int off = 0; off < nvec; off += chunk) {
    const int rest = nvec - off < chunk ? nvec - off : chunk;
    float v[UNROLL][VEC];
    {
      Pack<T, VEC> raw[UNROLL];
      issue_row<T, VEC, UNROLL, THREADS>(xb + (i64)off * VEC, rest, t, raw);
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
}

// y = exp(x - row_max) * inv over the vectors [0, nvec) from xb / yb. REVERSE walks the chunks
// last to first: the statistics pass read them first to last, so the latest are likeliest
// still in L2.
template <class T, int VEC, int UNROLL, int THREADS, bool REVERSE = false>
__device__ __forceinline__ void write_scaled(const typename T::raw* __restrict__ xb, typename T::raw* __restrict__ yb,
                                             int nvec, int t, float row_max, float inv) {
  const int chunk = THREADS * UNROLL;
  const int chunks = (nvec + chunk - 1) / chunk;
  for (int i = 0; i < chunks; ++i) {
    const int off = (REVERSE ? chunks - 1 - i : i) * chunk;
    const int rest = nvec - off < chunk ? nvec - off : chunk;
    float v[UNROLL][VEC];
    {
      Pack<T, VEC> raw[UNROLL];
      issue_row<T, VEC, UNROLL, THREADS>(xb + (i64)off * VEC, rest, t, raw);
      convert_row<T, VEC, UNROLL, THREADS>(raw, rest, t, 0.f, v);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = u * THREADS + t;
      if (c < rest) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[u][k] = exp_shifted(v[u][k], row_max) * inv;
        store_vec<T, VEC>(yb + (i64)(off + c) * VEC, v[u]);
      }
    }
  }
}

// sum(dy * y) over the vectors [0, nvec) from gb / yb.
template <class T, int VEC, int UNROLL, int THREADS>
__device__ __forceinline__ float dot_stats(const typename T::raw* __restrict__ gb, const typename T::raw* __restrict__ yb,
                                           int nvec, int t) {
  const int chunk = THREADS * UNROLL;
  float dot = 0.f;
  for (int off = 0; off < nvec; off += chunk) {
    const int rest = nvec - off < chunk ? nvec - off : chunk;
    float g[UNROLL][VEC], w[UNROLL][VEC];
    {
      Pack<T, VEC> rg[UNROLL], ry[UNROLL];
      issue_row<T, VEC, UNROLL, THREADS>(gb + (i64)off * VEC, rest, t, rg);
      issue_row<T, VEC, UNROLL, THREADS>(yb + (i64)off * VEC, rest, t, ry);
      convert_row<T, VEC, UNROLL, THREADS>(rg, rest, t, 0.f, g);
      convert_row<T, VEC, UNROLL, THREADS>(ry, rest, t, 0.f, w);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int k = 0; k < VEC; ++k) dot = fmaf(g[u][k], w[u][k], dot);
  }
  return dot;
}

// dx = y * (dy - dot) over the vectors [0, nvec) (REVERSE: as in write_scaled).
template <class T, int VEC, int UNROLL, int THREADS, bool REVERSE = false>
__device__ __forceinline__ void write_grad(const typename T::raw* __restrict__ gb, const typename T::raw* __restrict__ yb,
                                           typename T::raw* __restrict__ db, int nvec, int t, float dot) {
  const int chunk = THREADS * UNROLL;
  const int chunks = (nvec + chunk - 1) / chunk;
  for (int i = 0; i < chunks; ++i) {
    const int off = (REVERSE ? chunks - 1 - i : i) * chunk;
    const int rest = nvec - off < chunk ? nvec - off : chunk;
    float g[UNROLL][VEC], w[UNROLL][VEC];
    {
      Pack<T, VEC> rg[UNROLL], ry[UNROLL];
      issue_row<T, VEC, UNROLL, THREADS>(gb + (i64)off * VEC, rest, t, rg);
      issue_row<T, VEC, UNROLL, THREADS>(yb + (i64)off * VEC, rest, t, ry);
      convert_row<T, VEC, UNROLL, THREADS>(rg, rest, t, 0.f, g);
      convert_row<T, VEC, UNROLL, THREADS>(ry, rest, t, 0.f, w);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = u * THREADS + t;
      if (c < rest) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) g[u][k] = w[u][k] * (g[u][k] - dot);
        store_vec<T, VEC>(db + (i64)(off + c) * VEC, g[u]);
      }
    }
  }
}

// One CTA per row of any length, two passes over the row.
template <class T, int VEC, int UNROLL, int THREADS, bool PEEL = false>
__global__ void __launch_bounds__(THREADS) fwd_looped(const typename T::raw* __restrict__ x, typename T::raw* __restrict__ y,
                                                      i64 rows, i64 cols, i64 ldx, i64 ldy) {
  __shared__ float sm[64];
  const typename T::raw* xr = x + (i64)blockIdx.x * ldx;
  typename T::raw* yr = y + (i64)blockIdx.x * ldy;
  const int t = threadIdx.x;
  const Span sp = row_span<T, VEC, PEEL>(xr, (int)cols);
  float eh = -KA_INF, et = -KA_INF;
  if constexpr (PEEL) load_edges<T, VEC>(xr, sp, t, -KA_INF, eh, et);
  float m, s;
  online_stats<T, VEC, UNROLL, THREADS>(xr + sp.head, sp.nvec, t, eh, et, m, s);
  const float row_max = block_max<THREADS>(m, sm);
  s = m == -KA_INF ? 0.f : s * exp_shifted(m, row_max);
  const float inv = 1.f / block_sum<THREADS>(s, sm + 32);
  write_scaled<T, VEC, UNROLL, THREADS>(xr + sp.head, yr + sp.head, sp.nvec, t, row_max, inv);
  if constexpr (PEEL)
    store_edges<T, VEC>(yr, sp, t, exp_shifted(eh, row_max) * inv, exp_shifted(et, row_max) * inv);
}

template <class T, int VEC, int UNROLL, int THREADS, bool PEEL = false>
__global__ void __launch_bounds__(THREADS) bwd_looped(const typename T::raw* __restrict__ dy, const typename T::raw* __restrict__ y,
                                                      typename T::raw* __restrict__ dx, i64 rows, i64 cols, i64 lddy,
                                                      i64 ldy, i64 lddx) {
  __shared__ float sm[32];
  const BackwardRow<T, VEC, PEEL> row(dy, y, dx, cols, lddy, ldy, lddx);
  const typename T::raw* gr = row.g;
  const typename T::raw* yr = row.y;
  typename T::raw* dr = row.d;
  const int t = threadIdx.x;
  const Span sp = row.sp;
  BackwardEdges<T, VEC> e;
  if constexpr (PEEL) e.load(gr, yr, sp, t);
  float dot = e.dot() + dot_stats<T, VEC, UNROLL, THREADS>(gr + sp.head, yr + sp.head, sp.nvec, t);
  dot = block_sum<THREADS>(dot, sm);
  write_grad<T, VEC, UNROLL, THREADS>(gr + sp.head, yr + sp.head, dr + sp.head, sp.nvec, t, dot);
  if constexpr (PEEL) e.store(dr, sp, t, dot);
}

}  // namespace ka_softmax
