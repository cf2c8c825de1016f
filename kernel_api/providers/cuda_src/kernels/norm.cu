// Row norms over the last dimension: RMSNorm and LayerNorm, forward (optionally fused with the
// residual add) and backward, for f32 / f16 / bf16 rows with f32 statistics. The weight (and
// bias) may have another type than the rows (f32 weights under 16-bit rows). Self-contained
// (no toolkit headers) so NVRTC compiles it anywhere.
//
//   forward:  s = x (+ residual, written to s_out), y = (s - mean) * rstd * w (+ b)
//             RMSNorm: mean = 0, rstd = 1 / sqrt(mean(s^2) + eps)
//             LayerNorm: mean = mean(s), rstd = 1 / sqrt(mean((s - mean)^2) + eps)
//   backward: xhat = (x - mean) * rstd, g = dy * w,
//             dx = (g - mean(g) [LayerNorm only] - xhat * mean(g * xhat)) * rstd,
//             dw = sum over rows of dy * xhat, db = sum over rows of dy.
//
// How rows map onto the machine (the interface, norm.py, picks the strategy and NV):
//   *_reg    PER_WARP: one warp per row (short rows), else one CTA per row; the row held in
//            registers, NV vectors of VEC elements per thread, read once and written once.
//            The backward is persistent: each warp (CTA) walks rows u, u + units, ...,
//            loading the next row while it works on the current one, and keeps its sums of
//            dy * xhat (and dy) per column in registers, written at the end to its row of
//            the f32 workspace (units x cols per plane).
//   fwd_staged one CTA per row, the row copied into shared memory (cp.async) and read back at
//            each use instead of held in registers.
//   *_looped one CTA per row of any length; the row is read once per pass (statistics, then
//            the output), the backward's column sums kept in its workspace row.
//   reduce_cols sums the workspace's rows per column (a fixed order: deterministic) into
//            grad_weight (and grad_bias).
// VEC is the elements per access: 16 bytes' worth of the row type when every row operand is
// 16-byte aligned (pointers, row strides and the row length multiples of VEC), else 1.
// Every integer parameter is 64-bit; eps comes as the bits of a double.

namespace ka_norm {

typedef unsigned short u16;
typedef long long i64;

// pack2(lo, hi): two values in one 32-bit word (lo in the low half), as stored.
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
  static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
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
  static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

// ---- vector accesses ----------------------------------------------------------------------
// A stream (rows read once) is loaded past L1; the weights, read by every row, through it.
__device__ __forceinline__ uint4 ld16_stream(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// Asynchronous 16-byte copies from global to shared memory (sm_80+), in commit groups.
__device__ __forceinline__ unsigned smem_address(const void* p) {
  unsigned long long a;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
  return (unsigned)a;
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_address(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void st16(void* p, uint4 v) {
  // (no memory clobber: outputs are never read back by the kernels, so plain loads, the
  // weights', may be scheduled across the stores)
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// VEC raw elements of T; accesses of 16 bytes where VEC elements make whole 16-byte chunks
// (stores: a chunk is exactly 16 bytes, packed in registers and written by one instruction).
template <class T, int VEC, int BYTES = (int)sizeof(typename T::raw) * VEC>
struct Chunk {
  typedef typename T::raw R;
  static __device__ __forceinline__ void load(const R* p, float (&f)[VEC], bool stream) {
    if constexpr (BYTES >= 16 && BYTES % 16 == 0) {
      union {
        uint4 u[BYTES / 16];
        R r[VEC];
      } v;
#pragma unroll
      for (int i = 0; i < BYTES / 16; ++i)
        v.u[i] = stream ? ld16_stream(reinterpret_cast<const uint4*>(p) + i) : reinterpret_cast<const uint4*>(p)[i];
#pragma unroll
      for (int k = 0; k < VEC; ++k) f[k] = T::load(v.r[k]);
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) f[k] = T::load(p[k]);
    }
  }
  static __device__ __forceinline__ void store(R* p, const float (&f)[VEC]) {
    if constexpr (BYTES == 16) {
      unsigned w[4];
      if constexpr (sizeof(R) == 4) {
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = __float_as_uint(f[i]);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = T::pack2(f[2 * i], f[2 * i + 1]);
      }
      st16(p, make_uint4(w[0], w[1], w[2], w[3]));
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) p[k] = T::store(f[k]);
    }
  }
};

// VEC raw elements of T held as loaded (16-bit values stay packed), read out as floats.
template <class T, int VEC, int BYTES = (int)sizeof(typename T::raw) * VEC>
struct Raw {
  typedef typename T::raw R;
  static constexpr bool WIDE = BYTES >= 16 && BYTES % 16 == 0;
  union {
    uint4 u[WIDE ? BYTES / 16 : 1];
    R r[VEC];
  };
  __device__ __forceinline__ void load(const R* p, bool stream) {
    if constexpr (WIDE) {
#pragma unroll
      for (int i = 0; i < BYTES / 16; ++i)
        u[i] = stream ? ld16_stream(reinterpret_cast<const uint4*>(p) + i) : reinterpret_cast<const uint4*>(p)[i];
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) r[k] = p[k];
    }
  }
  __device__ __forceinline__ void zero() {
    if constexpr (WIDE) {
#pragma unroll
      for (int i = 0; i < BYTES / 16; ++i) u[i] = make_uint4(0u, 0u, 0u, 0u);
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) r[k] = R(0);
    }
  }
  __device__ __forceinline__ float get(int k) const { return T::load(r[k]); }
};

// ---- reductions ---------------------------------------------------------------------------
template <int N>
__device__ __forceinline__ void warp_sum(float (&v)[N]) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
  }
}

// Sums over the CTA (every thread gets the same sums, added in one order); `red` holds 32 * N
// floats. Every thread of the CTA calls it. One barrier: the caller does not write `red` again
// before every thread has read it, so consecutive calls alternate between two buffers (a call's
// barrier is passed only once every thread has read the call before it).
template <int N>
__device__ __forceinline__ void block_sum(float (&v)[N], float* red) {
  warp_sum<N>(v);
  const int warps = blockDim.x >> 5;
  if (warps == 1) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) red[i * 32 + warp] = v[i];
  }
  __syncthreads();
  // every warp sums the warps' partials across its lanes (a butterfly: every lane gets the same
  // bits, since each step adds the same two values)
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = lane < warps ? red[i * 32 + lane] : 0.f;
  warp_sum<N>(v);
}

template <int N, bool PER_WARP>
__device__ __forceinline__ void row_sum(float (&v)[N], float* red) {
  if constexpr (PER_WARP)
    warp_sum<N>(v);
  else
    block_sum<N>(v, red);
}

__device__ __forceinline__ float eps_of(i64 bits) { return (float)__longlong_as_double(bits); }

// ---- forward, the row in registers --------------------------------------------------------
// PER_WARP CTAs hold 4 warps (norm_plan.WARPS_PER_CTA): their registers are not capped at 64.
template <class T, class W, int VEC, int NV, bool CENTRED, bool RESID, bool PER_WARP>
__global__ void __launch_bounds__(PER_WARP ? 128 : 1024) fwd_reg(const typename T::raw* __restrict__ x,
                                                const typename T::raw* __restrict__ res,
                                                const typename W::raw* __restrict__ w,
                                                const typename W::raw* __restrict__ b, typename T::raw* __restrict__ y,
                                                typename T::raw* __restrict__ s_out, i64 rows, i64 cols, i64 ld_x,
                                                i64 ld_r, i64 ld_y, i64 ld_s, i64 eps_bits) {
  __shared__ float red[64];
  const int lanes = PER_WARP ? 32 : (int)blockDim.x;
  const int t = PER_WARP ? (int)(threadIdx.x & 31) : (int)threadIdx.x;
  const i64 row = PER_WARP ? (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5) : (i64)blockIdx.x;
  if (row >= rows) return;  // (PER_WARP: a whole warp; else the whole CTA)
  const float inv_n = 1.f / (float)cols;
  float v[NV][VEC];
  float acc[1] = {0.f};
  {
    // every load issued before the first use of any
    Raw<T, VEC> xr[NV], rr[RESID ? NV : 1];
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const i64 c = ((i64)j * lanes + t) * VEC;
      if (c < cols) {
        xr[j].load(x + row * ld_x + c, true);
        if constexpr (RESID) rr[j].load(res + row * ld_r + c, true);
      } else {
        xr[j].zero();
        if constexpr (RESID) rr[j].zero();
      }
    }
#pragma unroll
    for (int j = 0; j < NV; ++j) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        v[j][k] = xr[j].get(k);
        if constexpr (RESID) v[j][k] += rr[j].get(k);
        acc[0] += CENTRED ? v[j][k] : v[j][k] * v[j][k];
      }
      if constexpr (RESID) {
        const i64 c = ((i64)j * lanes + t) * VEC;
        if (c < cols) Chunk<T, VEC>::store(s_out + row * ld_s + c, v[j]);
      }
    }
  }
  row_sum<1, PER_WARP>(acc, red);
  float mean = 0.f;
  if constexpr (CENTRED) {
    mean = acc[0] * inv_n;
    acc[0] = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      if (((i64)j * lanes + t) * VEC < cols) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float d = v[j][k] - mean;
          acc[0] += d * d;
        }
      }
    }
    row_sum<1, PER_WARP>(acc, red + 32);
  }
  const float rstd = rsqrtf(acc[0] * inv_n + eps_of(eps_bits));
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const i64 c = ((i64)j * lanes + t) * VEC;
    if (c < cols) {
      float wv[VEC], o[VEC];
      Chunk<W, VEC>::load(w + c, wv, false);
      if constexpr (CENTRED) {
        float bv[VEC];
        Chunk<W, VEC>::load(b + c, bv, false);
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = (v[j][k] - mean) * rstd * wv[k] + bv[k];
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = v[j][k] * rstd * wv[k];
      }
      Chunk<T, VEC>::store(y + row * ld_y + c, o);
    }
  }
}

// ---- forward, the row staged in shared memory -------------------------------------------
// A CTA per row as fwd_reg's block rows, but the row's 16-byte chunks (NV per thread, and the
// residual's) are copied asynchronously into shared memory and read back at each use, each
// thread reading only its own chunks (no barrier): registers hold no row, so more CTAs, with
// more loads in flight, reside on an SM. Dynamic shared memory: NV x 16 bytes x threads (x2
// with the residual: norm_plan.stage_bytes).
template <class T, class W, int VEC, int NV, bool CENTRED, bool RESID>
__global__ void __launch_bounds__(1024) fwd_staged(const typename T::raw* __restrict__ x,
                                                   const typename T::raw* __restrict__ res,
                                                   const typename W::raw* __restrict__ w,
                                                   const typename W::raw* __restrict__ b,
                                                   typename T::raw* __restrict__ y, typename T::raw* __restrict__ s_out,
                                                   i64 rows, i64 cols, i64 ld_x, i64 ld_r, i64 ld_y, i64 ld_s,
                                                   i64 eps_bits) {
  static_assert(Raw<T, VEC>::WIDE, "the staged rows move 16-byte chunks");
  constexpr int CH = (int)sizeof(typename T::raw) * VEC / 16;
  extern __shared__ uint4 staged[];
  __shared__ float red[64];
  const int t = (int)threadIdx.x, lanes = (int)blockDim.x;
  const i64 row = blockIdx.x;
  const float inv_n = 1.f / (float)cols;
  auto slot = [&](int a, int j, int i) -> uint4* { return staged + (((a * NV + j) * CH + i) * lanes + t); };
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const i64 c = ((i64)j * lanes + t) * VEC;
    if (c < cols) {
      const char* xs = reinterpret_cast<const char*>(x + row * ld_x + c);
      const char* rs = RESID ? reinterpret_cast<const char*>(res + row * ld_r + c) : nullptr;
#pragma unroll
      for (int i = 0; i < CH; ++i) {
        cp_async16(slot(0, j, i), xs + 16 * i);
        if constexpr (RESID) cp_async16(slot(1, j, i), rs + 16 * i);
      }
    }
  }
  cp_async_commit();
  cp_async_wait<0>();
  // s = x (+ residual) of this thread's chunk j, in f32
  auto chunk = [&](int j, float (&f)[VEC]) {
    Raw<T, VEC> a;
#pragma unroll
    for (int i = 0; i < CH; ++i) a.u[i] = *slot(0, j, i);
#pragma unroll
    for (int k = 0; k < VEC; ++k) f[k] = a.get(k);
    if constexpr (RESID) {
      Raw<T, VEC> r;
#pragma unroll
      for (int i = 0; i < CH; ++i) r.u[i] = *slot(1, j, i);
#pragma unroll
      for (int k = 0; k < VEC; ++k) f[k] += r.get(k);
    }
  };
  float acc[1] = {0.f};
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const i64 c = ((i64)j * lanes + t) * VEC;
    if (c < cols) {
      float f[VEC];
      chunk(j, f);
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[0] += CENTRED ? f[k] : f[k] * f[k];
      if constexpr (RESID) Chunk<T, VEC>::store(s_out + row * ld_s + c, f);
    }
  }
  block_sum<1>(acc, red);
  float mean = 0.f;
  if constexpr (CENTRED) {
    mean = acc[0] * inv_n;
    acc[0] = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      if (((i64)j * lanes + t) * VEC < cols) {
        float f[VEC];
        chunk(j, f);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[0] += (f[k] - mean) * (f[k] - mean);
      }
    }
    block_sum<1>(acc, red + 32);
  }
  const float rstd = rsqrtf(acc[0] * inv_n + eps_of(eps_bits));
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const i64 c = ((i64)j * lanes + t) * VEC;
    if (c < cols) {
      float f[VEC], wv[VEC], o[VEC];
      chunk(j, f);
      Chunk<W, VEC>::load(w + c, wv, false);
      if constexpr (CENTRED) {
        float bv[VEC];
        Chunk<W, VEC>::load(b + c, bv, false);
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = (f[k] - mean) * rstd * wv[k] + bv[k];
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = f[k] * rstd * wv[k];
      }
      Chunk<T, VEC>::store(y + row * ld_y + c, o);
    }
  }
}

// ---- forward, any row length: a CTA per row, a pass per statistic -------------------------
template <class T, int VEC, bool RESID>
__device__ __forceinline__ void load_sum(const typename T::raw* x, const typename T::raw* res, i64 c, float (&v)[VEC]) {
  Chunk<T, VEC>::load(x + c, v, true);
  if constexpr (RESID) {
    float r[VEC];
    Chunk<T, VEC>::load(res + c, r, true);
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] += r[k];
  }
}

template <class T, class W, int VEC, bool CENTRED, bool RESID>
__global__ void __launch_bounds__(1024) fwd_looped(const typename T::raw* __restrict__ x,
                                                   const typename T::raw* __restrict__ res,
                                                   const typename W::raw* __restrict__ w,
                                                   const typename W::raw* __restrict__ b,
                                                   typename T::raw* __restrict__ y, typename T::raw* __restrict__ s_out,
                                                   i64 rows, i64 cols, i64 ld_x, i64 ld_r, i64 ld_y, i64 ld_s,
                                                   i64 eps_bits) {
  __shared__ float red[64];
  const i64 row = blockIdx.x;
  const i64 step = (i64)blockDim.x * VEC;
  const float inv_n = 1.f / (float)cols;
  const typename T::raw* xr = x + row * ld_x;
  const typename T::raw* rr = RESID ? res + row * ld_r : nullptr;
  float acc[1] = {0.f};
  for (i64 c = (i64)threadIdx.x * VEC; c < cols; c += step) {
    float v[VEC];
    load_sum<T, VEC, RESID>(xr, rr, c, v);
    if constexpr (RESID) Chunk<T, VEC>::store(s_out + row * ld_s + c, v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[0] += CENTRED ? v[k] : v[k] * v[k];
  }
  block_sum<1>(acc, red);
  float mean = 0.f;
  if constexpr (CENTRED) {
    mean = acc[0] * inv_n;
    acc[0] = 0.f;
    for (i64 c = (i64)threadIdx.x * VEC; c < cols; c += step) {
      float v[VEC];
      load_sum<T, VEC, RESID>(xr, rr, c, v);
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[0] += (v[k] - mean) * (v[k] - mean);
    }
    block_sum<1>(acc, red + 32);
  }
  const float rstd = rsqrtf(acc[0] * inv_n + eps_of(eps_bits));
  for (i64 c = (i64)threadIdx.x * VEC; c < cols; c += step) {
    float v[VEC], wv[VEC], o[VEC];
    load_sum<T, VEC, RESID>(xr, rr, c, v);
    Chunk<W, VEC>::load(w + c, wv, false);
    if constexpr (CENTRED) {
      float bv[VEC];
      Chunk<W, VEC>::load(b + c, bv, false);
#pragma unroll
      for (int k = 0; k < VEC; ++k) o[k] = (v[k] - mean) * rstd * wv[k] + bv[k];
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) o[k] = v[k] * rstd * wv[k];
    }
    Chunk<T, VEC>::store(y + row * ld_y + c, o);
  }
}

// ---- backward, the row in registers, persistent over rows ---------------------------------
// At most 512 threads (up to 128 registers each). A thread keeps its slice of the current
// row's x and dy as loaded (16-bit values stay packed), and later rows' loads are in flight
// while it works on one: STAGES 0 holds the next row's slice in registers; STAGES >= 2 copies
// the next STAGES - 1 rows' slices asynchronously into a ring of shared memory (dynamic:
// STAGES x 2 x NV x 16-byte chunks per thread; 16-byte vectors only), each thread reading back
// only its own chunks. The weight slice is loaded once. The column sums of dy * xhat (and dy)
// stay in f32 registers until the end.
// ws: PLANES x units x cols floats (plane 0: sums of dy * xhat, plane 1: sums of dy).
template <class T, class W, int VEC, int NV, bool CENTRED, bool PER_WARP, int STAGES>
__global__ void __launch_bounds__(512) bwd_reg(const typename T::raw* __restrict__ dy,
                                               const typename T::raw* __restrict__ x,
                                               const typename W::raw* __restrict__ w, typename T::raw* __restrict__ dx,
                                               float* __restrict__ ws, i64 rows, i64 cols, i64 ld_dy, i64 ld_x,
                                               i64 ld_dx, i64 eps_bits) {
  __shared__ float red[2 * 96];  // two buffers of block_sum<3>, alternating
  int call = 0;
  const int lanes = PER_WARP ? 32 : (int)blockDim.x;
  const int t = PER_WARP ? (int)(threadIdx.x & 31) : (int)threadIdx.x;
  const i64 unit = PER_WARP ? (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5) : (i64)blockIdx.x;
  const i64 units = PER_WARP ? (i64)gridDim.x * (blockDim.x >> 5) : (i64)gridDim.x;
  const float inv_n = 1.f / (float)cols;
  const float eps = eps_of(eps_bits);
  Raw<W, VEC> wr[NV];
  float dw[NV][VEC], db[CENTRED ? NV : 1][VEC];
  bool in[NV];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const i64 c = ((i64)j * lanes + t) * VEC;
    in[j] = c < cols;
    if (in[j])
      wr[j].load(w + c, false);
    else
      wr[j].zero();
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      dw[j][k] = 0.f;
      if constexpr (CENTRED) db[j][k] = 0.f;
    }
  }
  Raw<T, VEC> xn[STAGES == 0 ? NV : 1], gn[STAGES == 0 ? NV : 1];  // STAGES 0: the next row's slices
  auto fetch = [&](i64 row) {
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const i64 c = ((i64)j * lanes + t) * VEC;
      if (in[j]) {
        xn[j].load(x + row * ld_x + c, true);
        gn[j].load(dy + row * ld_dy + c, true);
      } else {
        xn[j].zero();
        gn[j].zero();
      }
    }
  };
  // STAGES >= 2: slot (stage, array, j, chunk) of this thread
  constexpr int CH = Raw<T, VEC>::WIDE ? (int)sizeof(typename T::raw) * VEC / 16 : 1;
  extern __shared__ uint4 ring[];
  auto slot = [&](int stage, int a, int j, int i) -> uint4* {
    return ring + ((((stage * 2 + a) * NV + j) * CH + i) * (int)blockDim.x + (int)threadIdx.x);
  };
  auto issue = [&](i64 row, int stage) {
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      if (in[j]) {
        const i64 c = ((i64)j * lanes + t) * VEC;
        const char* xs = reinterpret_cast<const char*>(x + row * ld_x + c);
        const char* gs = reinterpret_cast<const char*>(dy + row * ld_dy + c);
#pragma unroll
        for (int i = 0; i < CH; ++i) {
          cp_async16(slot(stage, 0, j, i), xs + 16 * i);
          cp_async16(slot(stage, 1, j, i), gs + 16 * i);
        }
      }
    }
  };
  if constexpr (STAGES == 0) {
    if (unit < rows) fetch(unit);
  } else {
    static_assert(STAGES == 0 || Raw<T, VEC>::WIDE, "the shared-memory ring moves 16-byte chunks");
#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p) {
      if (unit + p * units < rows) issue(unit + p * units, p);
      cp_async_commit();
    }
  }
  int it = 0;
  for (i64 row = unit; row < rows; row += units, ++it) {
    Raw<T, VEC> xc[STAGES == 0 ? NV : 1], gc[STAGES == 0 ? NV : 1];
    int stage = 0;
    if constexpr (STAGES == 0) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        xc[j] = xn[j];
        gc[j] = gn[j];
      }
      if (row + units < rows) fetch(row + units);
    } else {
      const i64 ahead = row + (i64)(STAGES - 1) * units;
      if (ahead < rows) issue(ahead, (it + STAGES - 1) % STAGES);
      cp_async_commit();
      cp_async_wait<STAGES - 1>();  // this row's group (committed STAGES - 1 groups ago) has landed
      stage = it % STAGES;
    }
    // this thread's slice j of the row's x and dy (STAGES >= 2: read back from the ring at each
    // use rather than held in registers across the reduction)
    auto slice = [&](int j, Raw<T, VEC>& xa, Raw<T, VEC>& ga) {
      if constexpr (STAGES == 0) {
        xa = xc[j];
        ga = gc[j];
      } else if (in[j]) {
#pragma unroll
        for (int i = 0; i < CH; ++i) {
          xa.u[i] = *slot(stage, 0, j, i);
          ga.u[i] = *slot(stage, 1, j, i);
        }
      } else {
        xa.zero();
        ga.zero();
      }
    };
    // One reduction per row for RMSNorm: sum(x^2) and sum(g * x), g = dy * w (mean(g * xhat) is
    // rstd * mean(g * x)). LayerNorm: the mean, then sum((x - mean)^2), sum(g) and
    // sum(g * (x - mean)) together (the variance two-pass, as the forward's).
    float mean = 0.f;
    if constexpr (CENTRED) {
      float m[1] = {0.f};
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        Raw<T, VEC> xa, ga;
        slice(j, xa, ga);
#pragma unroll
        for (int k = 0; k < VEC; ++k) m[0] += xa.get(k);
      }
      row_sum<1, PER_WARP>(m, red + 96 * (call++ & 1));
      mean = m[0] * inv_n;
    }
    float s3[CENTRED ? 3 : 2] = {};  // sum((x - mean)^2), sum(g * (x - mean)) [, sum(g)]
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      if (CENTRED && !in[j]) continue;  // (x - mean is not 0 past the row)
      Raw<T, VEC> xa, ga;
      slice(j, xa, ga);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float d = xa.get(k) - mean, g = ga.get(k) * wr[j].get(k);
        s3[0] += d * d;
        s3[1] += g * d;
        if constexpr (CENTRED) s3[2] += g;
      }
    }
    row_sum<CENTRED ? 3 : 2, PER_WARP>(s3, red + 96 * (call++ & 1));
    const float rstd = rsqrtf(s3[0] * inv_n + eps);
    const float c1 = s3[1] * inv_n * rstd, c2 = CENTRED ? s3[2] * inv_n : 0.f;  // mean(g * xhat), mean(g)
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      if (in[j]) {
        Raw<T, VEC> xa, ga;
        slice(j, xa, ga);
        float o[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float xh = (xa.get(k) - mean) * rstd, d = ga.get(k);
          dw[j][k] += d * xh;
          if constexpr (CENTRED) db[j][k] += d;
          o[k] = (d * wr[j].get(k) - c2 - xh * c1) * rstd;
        }
        Chunk<T, VEC>::store(dx + row * ld_dx + ((i64)j * lanes + t) * VEC, o);
      }
    }
  }
  // this unit's column sums (zeros for a unit without rows: the reduction reads every unit)
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    if (in[j]) {
      const i64 c = ((i64)j * lanes + t) * VEC;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        ws[unit * cols + c + k] = dw[j][k];
        if constexpr (CENTRED) ws[(units + unit) * cols + c + k] = db[j][k];
      }
    }
  }
}

// ---- backward, any row length: persistent CTAs, a pass per statistic ----------------------
// The CTA's column sums live in its workspace rows (each column owned by one thread).
template <class T, class W, int VEC, bool CENTRED>
__global__ void __launch_bounds__(512) bwd_looped(const typename T::raw* __restrict__ dy,
                                                   const typename T::raw* __restrict__ x,
                                                   const typename W::raw* __restrict__ w,
                                                   typename T::raw* __restrict__ dx, float* __restrict__ ws, i64 rows,
                                                   i64 cols, i64 ld_dy, i64 ld_x, i64 ld_dx, i64 eps_bits) {
  __shared__ float red[2 * 64];  // two buffers of block_sum<2>, alternating
  int call = 0;
  const i64 unit = blockIdx.x, units = gridDim.x;
  const i64 step = (i64)blockDim.x * VEC;
  const float inv_n = 1.f / (float)cols;
  const float eps = eps_of(eps_bits);
  float* dw = ws + unit * cols;
  float* db = ws + (units + unit) * cols;
  for (i64 c = (i64)threadIdx.x * VEC; c < cols; c += step) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      dw[c + k] = 0.f;
      if constexpr (CENTRED) db[c + k] = 0.f;
    }
  }
  for (i64 row = unit; row < rows; row += units) {
    const typename T::raw* xr = x + row * ld_x;
    const typename T::raw* gr = dy + row * ld_dy;
    float acc[1] = {0.f};
    for (i64 c = (i64)threadIdx.x * VEC; c < cols; c += step) {
      float v[VEC];
      Chunk<T, VEC>::load(xr + c, v, true);
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[0] += CENTRED ? v[k] : v[k] * v[k];
    }
    block_sum<1>(acc, red + 64 * (call++ & 1));
    float mean = 0.f;
    if constexpr (CENTRED) {
      mean = acc[0] * inv_n;
      acc[0] = 0.f;
      for (i64 c = (i64)threadIdx.x * VEC; c < cols; c += step) {
        float v[VEC];
        Chunk<T, VEC>::load(xr + c, v, true);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[0] += (v[k] - mean) * (v[k] - mean);
      }
      block_sum<1>(acc, red + 64 * (call++ & 1));
    }
    const float rstd = rsqrtf(acc[0] * inv_n + eps);
    float s2[2] = {0.f, 0.f};
    for (i64 c = (i64)threadIdx.x * VEC; c < cols; c += step) {
      float v[VEC], g[VEC], wv[VEC];
      Chunk<T, VEC>::load(xr + c, v, true);
      Chunk<T, VEC>::load(gr + c, g, true);
      Chunk<W, VEC>::load(w + c, wv, false);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float xh = (v[k] - mean) * rstd, gw = g[k] * wv[k];
        s2[0] += gw * xh;
        s2[1] += gw;
      }
    }
    block_sum<2>(s2, red + 64 * (call++ & 1));
    const float c1 = s2[0] * inv_n, c2 = CENTRED ? s2[1] * inv_n : 0.f;
    for (i64 c = (i64)threadIdx.x * VEC; c < cols; c += step) {
      float v[VEC], g[VEC], wv[VEC], o[VEC];
      Chunk<T, VEC>::load(xr + c, v, true);
      Chunk<T, VEC>::load(gr + c, g, true);
      Chunk<W, VEC>::load(w + c, wv, false);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float xh = (v[k] - mean) * rstd;
        o[k] = (g[k] * wv[k] - c2 - xh * c1) * rstd;
        dw[c + k] += g[k] * xh;
        if constexpr (CENTRED) db[c + k] += g[k];
      }
      Chunk<T, VEC>::store(dx + row * ld_dx + c, o);
    }
  }
}

// ---- the column sums over the units: grad_weight (plane 0) and grad_bias (plane 1) -------
// CTAs of 512 threads (norm_plan.REDUCE_THREADS): 32 columns (lane) x 16 unit groups (warp),
// combined in shared memory in a fixed order (deterministic). A thread's loads are unrolled so
// that several are in flight: the workspace is read from L2, where latency, not bandwidth,
// bounds a loop of one load at a time. grid: (ceil(cols / 32), planes).
template <class W>
__global__ void __launch_bounds__(512) reduce_cols(const float* __restrict__ ws, typename W::raw* __restrict__ gw,
                                                   typename W::raw* __restrict__ gb, i64 units, i64 cols) {
  constexpr int GROUPS = 16;
  __shared__ float part[GROUPS][33];
  const int lane = threadIdx.x & 31, group = threadIdx.x >> 5;
  const i64 c = (i64)blockIdx.x * 32 + lane;
  const float* plane = ws + (i64)blockIdx.y * units * cols;
  float s = 0.f;
  if (c < cols) {
#pragma unroll 8
    for (i64 u = group; u < units; u += GROUPS) s += plane[u * cols + c];
  }
  part[group][lane] = s;
  __syncthreads();
  if (group == 0 && c < cols) {
#pragma unroll
    for (int g = 1; g < GROUPS; ++g) s += part[g][lane];
    (blockIdx.y == 0 ? gw : gb)[c] = W::store(s);
  }
}

}  // namespace ka_norm
