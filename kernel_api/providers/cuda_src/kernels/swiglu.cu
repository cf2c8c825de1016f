// Gated activations of transformer MLPs, forward and backward, for f32 / f16 / bf16 storage with
// f32 math. Self-contained (no toolkit headers) so NVRTC compiles it anywhere.
//
//   forward:  out = act(g) * u
//   backward: du = dy * act(g),  dg = dy * u * act'(g)
//
// act is silu (SwiGLU), gelu with the tanh approximation, or gelu with erf (GeGLU).
// Operands are `rows` rows of `cols` elements, each operand with its own row stride (in
// elements); dense operands come as one row of every element. A CTA is TX x TY threads: TY rows
// at a time, TX threads along a row, each with UNROLL accesses of VEC elements in flight per
// operand; the grid strides over rows and columns. VEC is 16 bytes' worth when every operand's
// pointer and row stride are multiples of it (the interface guarantees that), else 1; the last
// cols % VEC elements of each row are finished element by element.

namespace ka_glu {

typedef unsigned short u16;
typedef long long i64;

// PRECISE: the activations' precise math (f32 outputs keep f32's precision; see activations).
struct F32 {
  typedef float raw;
  enum { PRECISE = 1 };
  static __device__ __forceinline__ float load(float v) { return v; }
  static __device__ __forceinline__ float store(float v) { return v; }
};

struct BF16 {
  typedef u16 raw;
  enum { PRECISE = 0 };
  static __device__ __forceinline__ float load(u16 v) { return __uint_as_float(((unsigned)v) << 16); }
  static __device__ __forceinline__ u16 store(float v) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
    return r;
  }
  static __device__ __forceinline__ void unpack2(unsigned w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xFFFF0000u);
  }
  static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

struct F16 {
  typedef u16 raw;
  enum { PRECISE = 0 };
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
  static __device__ __forceinline__ void unpack2(unsigned w, float& lo, float& hi) {
    lo = load((u16)(w & 0xFFFFu));
    hi = load((u16)(w >> 16));
  }
  static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

// The 16-byte access instructions; macros so that benchmarks/pointwise.py --sweep can compare
// cache hints (the defaults: the measured best).
#ifndef KA_GLU_LD16
#define KA_GLU_LD16 "ld.global.nc.L1::no_allocate.v4.u32"
#endif
#ifndef KA_GLU_ST16
#define KA_GLU_ST16 "st.global.v4.u32"
#endif

// One access of VEC elements: a 16-byte vector (ld.global.nc: the inputs are never written
// while the kernel runs, outputs overlap no input) or one element.
template <class T, int VEC>
struct Access {
  uint4 u;
  typename T::raw r;
};

template <class T, int VEC>
__device__ __forceinline__ void issue(const typename T::raw* p, Access<T, VEC>& a) {
  if constexpr (VEC * sizeof(typename T::raw) == 16) {
    asm(KA_GLU_LD16 " {%0, %1, %2, %3}, [%4];"
        : "=r"(a.u.x), "=r"(a.u.y), "=r"(a.u.z), "=r"(a.u.w) : "l"(p));
  } else {
    a.r = *p;
  }
}

template <class T, int VEC>
__device__ __forceinline__ void unpack(const Access<T, VEC>& a, float (&f)[VEC]) {
  if constexpr (VEC * sizeof(typename T::raw) == 16) {
    const unsigned w[4] = {a.u.x, a.u.y, a.u.z, a.u.w};
    if constexpr (sizeof(typename T::raw) == 4) {
#pragma unroll
      for (int i = 0; i < 4; ++i) f[i] = __uint_as_float(w[i]);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) T::unpack2(w[i], f[2 * i], f[2 * i + 1]);
    }
  } else {
    f[0] = T::load(a.r);
  }
}

template <class T, int VEC>
__device__ __forceinline__ void store(typename T::raw* p, const float (&f)[VEC]) {
  if constexpr (VEC * sizeof(typename T::raw) == 16) {
    unsigned w[4];
    if constexpr (sizeof(typename T::raw) == 4) {
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = __float_as_uint(f[i]);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = T::pack2(f[2 * i], f[2 * i + 1]);
    }
    asm volatile(KA_GLU_ST16 " [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
                 : "memory");
  } else {
    *p = T::store(f[0]);
  }
}

// ---------------------------------------------------------------- activations
// The activations' math, all through the logistic sigmoid s(x) = 1 / (1 + exp(-x)):
//   silu(g)      = g s(g),          silu'      = s (1 + g (1 - s))
//   gelu_tanh(g) = g s(y),          gelu_tanh' = s (1 + g (1 - s) y'),
//   with y = 2k (g + c g^3), y' = 2k (1 + 3c g^2)   (0.5 (1 + tanh(x)) = s(2x): no 1 - t^2 to cancel)
//   gelu(g)      = g Phi(g),        gelu'      = Phi + g phi(g)      (erf)
// f32 operands (PRECISE) take expf and IEEE divisions: their outputs keep f32's precision.
// 16-bit operands take ex2.approx and rcp.approx (__expf, __fdividef; relative error about
// 2^-21): five instructions a sigmoid where expf and a division take about twenty, which keeps
// the backward's instruction count under what streaming its five operands leaves room for.
// KA_GLU_FAST 0 gives 16-bit operands the precise forms too (for comparisons).
#ifndef KA_GLU_FAST
#define KA_GLU_FAST 1
#endif

enum { SILU = 0, GELU_TANH = 1, GELU_ERF = 2 };

#define KA_GELU_2K 1.5957691216057308f  // 2 sqrt(2 / pi)
#define KA_GELU_C 0.044715f
#define KA_INV_SQRT2 0.7071067811865476f
#define KA_INV_SQRT_2PI 0.3989422804014327f

// s(x); exp overflowing to inf gives 0, the limit (rcp.approx of inf is 0 too).
template <bool PRECISE>
__device__ __forceinline__ float sigmoid(float x) {
  if constexpr (PRECISE) return 1.f / (1.f + expf(-x));
  return __fdividef(1.f, 1.f + __expf(-x));
}

template <int ACT, bool P>
__device__ __forceinline__ float activation(float g) {
  if constexpr (ACT == SILU) {
    return g * sigmoid<P>(g);
  } else if constexpr (ACT == GELU_TANH) {
    return g * sigmoid<P>(KA_GELU_2K * g * fmaf(KA_GELU_C, g * g, 1.f));
  } else {
    return 0.5f * g * (1.f + erff(g * KA_INV_SQRT2));
  }
}

// act(g) and act'(g)
template <int ACT, bool P>
__device__ __forceinline__ void activation_grad(float g, float& a, float& da) {
  if constexpr (ACT == SILU) {
    const float s = sigmoid<P>(g);
    a = g * s;
    da = s * fmaf(g, 1.f - s, 1.f);
  } else if constexpr (ACT == GELU_TANH) {
    const float g2 = g * g;
    const float s = sigmoid<P>(KA_GELU_2K * g * fmaf(KA_GELU_C, g2, 1.f));
    a = g * s;
    da = s * fmaf(g * (1.f - s), KA_GELU_2K * fmaf(3.f * KA_GELU_C, g2, 1.f), 1.f);
  } else {
    const float e = 0.5f * (1.f + erff(g * KA_INV_SQRT2));
    a = g * e;
    da = e + g * KA_INV_SQRT_2PI * (P ? expf(-0.5f * g * g) : __expf(-0.5f * g * g));
  }
}

// ---------------------------------------------------------------- kernels
template <class T, int VEC, int ACT, int UNROLL>
__global__ void __launch_bounds__(256) glu_fwd(const typename T::raw* __restrict__ gate,
                                               const typename T::raw* __restrict__ up, typename T::raw* __restrict__ out,
                                               i64 rows, i64 cols, i64 ldg, i64 ldu, i64 ldo) {
  const i64 nvec = cols / VEC;
  const int tail = (int)(cols - nvec * VEC);
  const i64 col_step = (i64)gridDim.x * blockDim.x * UNROLL;
  for (i64 r = (i64)blockIdx.y * blockDim.y + threadIdx.y; r < rows; r += (i64)gridDim.y * blockDim.y) {
    const typename T::raw* gr = gate + r * ldg;
    const typename T::raw* ur = up + r * ldu;
    typename T::raw* orow = out + r * ldo;
    for (i64 c0 = (i64)blockIdx.x * blockDim.x * UNROLL + threadIdx.x; c0 < nvec; c0 += col_step) {
      Access<T, VEC> ag[UNROLL], au[UNROLL];
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) {
        const i64 c = c0 + (i64)k * blockDim.x;
        if (c < nvec) {
          issue<T, VEC>(gr + c * VEC, ag[k]);
          issue<T, VEC>(ur + c * VEC, au[k]);
        }
      }
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) {
        const i64 c = c0 + (i64)k * blockDim.x;
        if (c < nvec) {
          float g[VEC], u[VEC];
          unpack<T, VEC>(ag[k], g);
          unpack<T, VEC>(au[k], u);
#pragma unroll
          for (int e = 0; e < VEC; ++e) g[e] = activation<ACT, (bool)T::PRECISE || !KA_GLU_FAST>(g[e]) * u[e];
          store<T, VEC>(orow + c * VEC, g);
        }
      }
    }
    if (VEC > 1 && blockIdx.x == 0 && (int)threadIdx.x < tail) {
      const i64 c = nvec * VEC + threadIdx.x;
      orow[c] = T::store(activation<ACT, (bool)T::PRECISE || !KA_GLU_FAST>(T::load(gr[c])) * T::load(ur[c]));
    }
  }
}

template <class T, int VEC, int ACT, int UNROLL>
__global__ void __launch_bounds__(256) glu_bwd(const typename T::raw* __restrict__ dy,
                                               const typename T::raw* __restrict__ gate,
                                               const typename T::raw* __restrict__ up, typename T::raw* __restrict__ dg,
                                               typename T::raw* __restrict__ du, i64 rows, i64 cols, i64 lddy, i64 ldg,
                                               i64 ldu, i64 lddg, i64 lddu) {
  const i64 nvec = cols / VEC;
  const int tail = (int)(cols - nvec * VEC);
  const i64 col_step = (i64)gridDim.x * blockDim.x * UNROLL;
  for (i64 r = (i64)blockIdx.y * blockDim.y + threadIdx.y; r < rows; r += (i64)gridDim.y * blockDim.y) {
    const typename T::raw* yr = dy + r * lddy;
    const typename T::raw* gr = gate + r * ldg;
    const typename T::raw* ur = up + r * ldu;
    typename T::raw* dgr = dg + r * lddg;
    typename T::raw* dur = du + r * lddu;
    for (i64 c0 = (i64)blockIdx.x * blockDim.x * UNROLL + threadIdx.x; c0 < nvec; c0 += col_step) {
      Access<T, VEC> ay[UNROLL], ag[UNROLL], au[UNROLL];
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) {
        const i64 c = c0 + (i64)k * blockDim.x;
        if (c < nvec) {
          issue<T, VEC>(yr + c * VEC, ay[k]);
          issue<T, VEC>(gr + c * VEC, ag[k]);
          issue<T, VEC>(ur + c * VEC, au[k]);
        }
      }
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) {
        const i64 c = c0 + (i64)k * blockDim.x;
        if (c < nvec) {
          float y[VEC], g[VEC], u[VEC];
          unpack<T, VEC>(ay[k], y);
          unpack<T, VEC>(ag[k], g);
          unpack<T, VEC>(au[k], u);
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            float a, da;
            activation_grad<ACT, (bool)T::PRECISE || !KA_GLU_FAST>(g[e], a, da);
            g[e] = y[e] * u[e] * da;
            u[e] = y[e] * a;
          }
          store<T, VEC>(dgr + c * VEC, g);
          store<T, VEC>(dur + c * VEC, u);
        }
      }
    }
    if (VEC > 1 && blockIdx.x == 0 && (int)threadIdx.x < tail) {
      const i64 c = nvec * VEC + threadIdx.x;
      float a, da;
      const float y = T::load(yr[c]);
      activation_grad<ACT, (bool)T::PRECISE || !KA_GLU_FAST>(T::load(gr[c]), a, da);
      dgr[c] = T::store(y * T::load(ur[c]) * da);
      dur[c] = T::store(y * a);
    }
  }
}

}  // namespace ka_glu
