// Rotary position embedding of queries and keys (transformers' rotate_half convention), forward
// and backward, for f32 / f16 / bf16 storage with f32 math, q and k in one launch.
// Self-contained (no toolkit headers) so NVRTC compiles it anywhere.
//
// With x1, x2 (c1, c2; s1, s2) the halves of a head's (cos's; sin's) last dimension:
//   forward:  o1 = x1 c1 - x2 s1,  o2 = x2 c2 + x1 s2       (x cos + rotate_half(x) sin)
//   backward: o1 = x1 c1 + x2 s2,  o2 = x2 c2 - x1 s1       (its transpose)
//
// A work item is (batch b, position s, head group, vector j of the first half): it reads cos and
// sin at (b, s) once and rotates the vectors j of both halves of HPT heads, numbered q's heads
// first, then k's, with every head's loads issued before any store. Every operand is addressed
// through its own (batch, head, seq) strides in elements (cos and sin: batch stride 0 when
// broadcast), so transposed views are read in place. VEC is 16 bytes' worth when every pointer,
// stride and half head dimension is a multiple of it (the interface guarantees that), else 1.

namespace ka_rope {

typedef unsigned short u16;
typedef long long i64;

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

// VEC raw elements: one 16-byte load (ld.global.nc: inputs are not written while the kernel
// runs; outputs overlap no input) or one element. Kept raw until used (16 bytes in 4 registers,
// not VEC floats), so a thread holds its heads' loads and the tables in few registers.
template <class T, int VEC, bool WIDE = VEC * sizeof(typename T::raw) == 16>
struct Raw {
  typename T::raw r;
  __device__ __forceinline__ void load(const typename T::raw* p) { r = *p; }
  __device__ __forceinline__ float get(int) const { return T::load(r); }
};
template <class T, int VEC>
struct Raw<T, VEC, true> {
  unsigned w[4];
  __device__ __forceinline__ void load(const typename T::raw* p) {
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
  }
  // element e as a float (e a compile-time constant after unrolling)
  __device__ __forceinline__ float get(int e) const {
    if constexpr (sizeof(typename T::raw) == 4) {
      return __uint_as_float(w[e]);
    } else {
      float lo, hi;
      T::unpack2(w[e / 2], lo, hi);
      return (e & 1) ? hi : lo;
    }
  }
};

template <class T, int VEC>
__device__ __forceinline__ void store_vec(typename T::raw* p, const float (&f)[VEC]) {
  if constexpr (VEC * sizeof(typename T::raw) == 16) {
    unsigned w[4];
    if constexpr (sizeof(typename T::raw) == 4) {
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = __float_as_uint(f[i]);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = T::pack2(f[2 * i], f[2 * i + 1]);
    }
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
                 : "memory");
  } else {
    *p = T::store(f[0]);
  }
}

template <class T, int VEC, int HPT, bool BACKWARD>
__global__ void __launch_bounds__(256) rope(const typename T::raw* __restrict__ q, const typename T::raw* __restrict__ k,
                                            const typename T::raw* __restrict__ cos, const typename T::raw* __restrict__ sin,
                                            typename T::raw* __restrict__ qo, typename T::raw* __restrict__ ko,
                                            i64 items, i64 seq, i64 heads_q, i64 heads_k, i64 groups, i64 nj, i64 half,
                                            i64 q_b, i64 q_h, i64 q_s, i64 k_b, i64 k_h, i64 k_s, i64 c_b, i64 c_s,
                                            i64 s_b, i64 s_s, i64 qo_b, i64 qo_h, i64 qo_s, i64 ko_b, i64 ko_h, i64 ko_s) {
  // (items < 2^31: the interface checks it, so the index arithmetic is 32-bit)
  const unsigned n = (unsigned)items, S = (unsigned)seq, G = (unsigned)groups, NJ = (unsigned)nj;
  const int hq = (int)heads_q, hall = (int)(heads_q + heads_k);
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const unsigned j = i % NJ, rest = i / NJ;
    const unsigned g = rest % G, bs = rest / G;
    const unsigned s = bs % S, b = bs / S;
    const i64 col = (i64)j * VEC;
    Raw<T, VEC> c1, c2, s1, s2;
    {
      const typename T::raw* cp = cos + b * c_b + s * c_s + col;
      const typename T::raw* sp = sin + b * s_b + s * s_s + col;
      c1.load(cp);
      c2.load(cp + half);
      s1.load(sp);
      s2.load(sp + half);
    }
    Raw<T, VEC> x1[HPT], x2[HPT];
    typename T::raw* dst[HPT];
#pragma unroll
    for (int u = 0; u < HPT; ++u) {
      const int h = (int)g * HPT + u;
      dst[u] = nullptr;
      if (h < hall) {
        const typename T::raw* src;
        if (h < hq) {
          src = q + b * q_b + h * q_h + s * q_s + col;
          dst[u] = qo + b * qo_b + h * qo_h + s * qo_s + col;
        } else {
          const int hk = h - hq;
          src = k + b * k_b + hk * k_h + s * k_s + col;
          dst[u] = ko + b * ko_b + hk * ko_h + s * ko_s + col;
        }
        x1[u].load(src);
        x2[u].load(src + half);
      }
    }
#pragma unroll
    for (int u = 0; u < HPT; ++u) {
      if (dst[u] == nullptr) continue;
      float o1[VEC], o2[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float a = x1[u].get(e), z = x2[u].get(e);
        if constexpr (BACKWARD) {
          o1[e] = fmaf(a, c1.get(e), z * s2.get(e));
          o2[e] = fmaf(z, c2.get(e), -a * s1.get(e));
        } else {
          o1[e] = fmaf(a, c1.get(e), -z * s1.get(e));
          o2[e] = fmaf(z, c2.get(e), a * s2.get(e));
        }
      }
      store_vec<T, VEC>(dst[u], o1);
      store_vec<T, VEC>(dst[u] + half, o2);
    }
  }
}

}  // namespace ka_rope
