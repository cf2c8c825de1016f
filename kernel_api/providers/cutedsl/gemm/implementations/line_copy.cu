// Copy of lines (rows of a row-major operand, columns of a column-major one) between buffers
// of any element alignment: what Sm90RealignedGemm stages into and out of its padded,
// 16-byte aligned workspace copies. Self-contained (no toolkit headers) so NVRTC compiles it
// anywhere.
//
// Why not torch's copy_ or cudaMemcpy2DAsync: with a misaligned side neither vectorises, and
// both ran at 1.4-2.4 TB/s on the H200 (docs/performance.md, "Realigned GEMM"), where a copy can run at
// about 4. Here every destination store is a whole aligned 16-byte vector except at the two
// ends of a line; its 16 source bytes sit at some byte offset from a 16-byte boundary, so a
// thread reads the two aligned vectors that hold them (the second one is its neighbour's
// first: L1 serves it) and funnel-shifts them into place. No read leaves the line but the
// head of a line's first vector, which shares its 16-byte granule with the line's first byte
// (allocations start 16-byte aligned). The partial vectors at the ends of a line, and a last
// whole one whose second source vector would end past the line (the last line of an
// allocation whose size is no multiple of 16), are copied element by element.
//
// Grid: units of destination vectors of one line, a warp's or a CTA's (warp units let a CTA
// take several short lines); each thread takes UNROLL vectors of its unit, all loads before
// all stores.

namespace ka_line_copy {

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

constexpr int THREADS = 256;

template <int ELEM>
struct Bits;
template <>
struct Bits<2> {
  typedef unsigned short type;
};
template <>
struct Bits<4> {
  typedef u32 type;
};

__device__ __forceinline__ uint4 load16(const char* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void store16(char* p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// Bytes [k, k + 16) of the 32 bytes lo:hi (k in 0..15). The word offset k / 4 is one value per
// line, so the switch does not diverge within a line.
__device__ __forceinline__ uint4 funnel(uint4 lo, uint4 hi, int k) {
  const u32 w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  const u32 r = (u32)(k & 3) * 8;
  u32 o[4];
  switch (k >> 2) {
#define KA_FUNNEL_CASE(Q)                                                   \
  case Q:                                                                   \
    _Pragma("unroll") for (int i = 0; i < 4; ++i) o[i] = __funnelshift_r(w[i + Q], w[i + Q + 1], r); \
    break;
    KA_FUNNEL_CASE(0)
    KA_FUNNEL_CASE(1)
    KA_FUNNEL_CASE(2)
    default:
    KA_FUNNEL_CASE(3)
#undef KA_FUNNEL_CASE
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// The elements of line bytes [x0, x0 + 16) inside [0, width), one at a time: all loads before
// all stores, so the up to 8 loads share one memory latency (a loop of load-store pairs waited
// for each in turn, and every line has two such vectors).
template <int ELEM>
__device__ __forceinline__ void copy_partial(const char* s, char* d, i64 x0, i64 width) {
  typedef typename Bits<ELEM>::type T;
  constexpr int N = 16 / ELEM;
  T e[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const i64 x = x0 + i * ELEM;
    if (x >= 0 && x < width) e[i] = *(const T*)(s + x);
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const i64 x = x0 + i * ELEM;
    if (x >= 0 && x < width) *(T*)(d + x) = e[i];
  }
}

// ELEM: the element size in bytes (2 or 4; every address and pitch is a multiple of it).
// GROUP: threads per unit of work (whole warps of the CTA), UNROLL: vectors per thread. width: bytes per line;
// pitches and batch strides in bytes (a source pitch may be 0 or smaller than a line: an
// expanded operand). A unit is GROUP x UNROLL destination vectors of one line, upl units per
// line (its vectors at any destination alignment); thread t of a unit takes vectors t,
// t + GROUP, ... The line's geometry (one division) is worked out once per thread. Warp
// units keep short lines from leaving most of a CTA idle.
template <int ELEM, int GROUP, int UNROLL>
__global__ void __launch_bounds__(THREADS) line_copy(const char* __restrict__ src, char* __restrict__ dst, i64 width,
                                                   i64 lines, i64 src_pitch, i64 dst_pitch, i64 src_batch,
                                                   i64 dst_batch, i64 upl, i64 units) {
  static_assert(THREADS % GROUP == 0 && GROUP % 32 == 0, "units are whole warps of a CTA");
  constexpr int UNIT = GROUP * UNROLL;
  const u64 unit = (u64)blockIdx.x * (THREADS / GROUP) + threadIdx.x / GROUP;
  if (unit >= (u64)units) return;
  const int t = threadIdx.x % GROUP;
  u64 line_all;
  if ((unit >> 32) == 0 && ((u64)upl >> 32) == 0)
    line_all = (u32)unit / (u32)upl;  // the common case: a 32-bit division
  else
    line_all = unit / (u64)upl;
  const i64 seg = (i64)(unit - line_all * (u64)upl);
  i64 batch = 0, line = (i64)line_all;
  if (line >= lines) {
    batch = line / lines;
    line -= batch * lines;
  }
  const char* const s = src + batch * src_batch + line * src_pitch;
  char* const d = dst + batch * dst_batch + line * dst_pitch;
  const i64 head = (i64)((u64)d & 15);  // bytes of the line's first aligned destination vector before the line
  const int k = (int)((u64)(s - head) & 15);  // offset of every vector's source from a 16-byte boundary
  const char* const s_aligned = s - head - k;  // the aligned vector holding vector 0's first source byte
  char* const d0 = d - head;

  const i64 c0 = seg * UNIT + t;  // the thread's first vector; then every GROUP-th
  // Bytes from vector c0's start to the line's end (capped: only small values matter). Vector
  // c0 + GROUP u is whole and its source vectors end inside the line (the last granule of a
  // line may be the last of an allocation whose size is no multiple of 16) when
  // 16 GROUP u + need <= rem.
  const int rem = (int)min(head + width - (c0 << 4), (i64)(1 << 30));
  const int need = k ? 32 - k : 16;
  const bool first_ok = c0 > 0 || head == 0;  // vector 0 is partial unless the line is aligned
  const char* const p = s_aligned + (c0 << 4);
  char* const q = d0 + (c0 << 4);
  uint4 v[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    if ((u > 0 || first_ok) && 16 * GROUP * u + need <= rem) {
      v[u] = load16(p + 16 * GROUP * u);
      if (k) v[u] = funnel(v[u], load16(p + 16 * GROUP * u + 16), k);
    }
  }
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    if ((u > 0 || first_ok) && 16 * GROUP * u + need <= rem) {
      store16(q + 16 * GROUP * u, v[u]);
    } else if (16 * GROUP * u < rem) {  // a partial vector at an end of the line: element by element
      copy_partial<ELEM>(s, d, ((c0 + GROUP * u) << 4) - head, width);
    }
  }
}

}  // namespace ka_line_copy
