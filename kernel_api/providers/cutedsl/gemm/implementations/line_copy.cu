// Copy of lines (rows of a row-major operand, columns of a column-major one) between buffers
// of any element alignment: what Sm90RealignedGemm stages into and out of its padded,
// 16-byte aligned workspace copies. Self-contained (no toolkit headers) so NVRTC compiles it
// anywhere.
//
// Why not torch's copy_ or cudaMemcpy2DAsync: with a misaligned side neither vectorises, and
// both ran at 1.4-2.4 TB/s on the H200 (benchmarks/NOTES-realign.md), where a copy can run at
// about 4. Here every destination store is a whole aligned 16-byte vector except at the two
// ends of a line; its 16 source bytes sit at some byte offset from a 16-byte boundary, so a
// thread reads the two aligned vectors that hold them (the second one is its neighbour's
// first: L1 serves it) and funnel-shifts them into place. No read leaves the line but the
// head of a line's first vector, which shares its 16-byte granule with the line's first byte
// (allocations start 16-byte aligned). The partial vectors at the ends of a line, and a last
// whole one whose second source vector would end past the line (the last line of an
// allocation whose size is no multiple of 16), are copied element by element.
//
// Grid: units of UNIT_SLOTS destination vectors of one line, one per warp (a CTA takes
// several short lines; a long line spans CTAs); each thread takes UNROLL vectors of its
// warp's unit, all loads before all stores.

namespace ka_line_copy {

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

constexpr int THREADS = 256;
constexpr int UNROLL = 4;
constexpr int UNIT_SLOTS = 32 * UNROLL;  // destination vectors per warp

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

// ELEM: the element size in bytes (2 or 4; every address and pitch is a multiple of it).
// width: bytes per line; pitches and batch strides in bytes (a source pitch may be 0 or
// smaller than a line: an expanded operand). The work is units of UNIT_SLOTS destination
// vectors, upl units per line (a line's vectors at any destination alignment), one unit per
// warp: the line's geometry (one division) is worked out once per thread for its UNROLL
// vectors, and short lines do not leave most of a CTA idle.
template <int ELEM>
__global__ void __launch_bounds__(THREADS) line_copy(const char* __restrict__ src, char* __restrict__ dst, i64 width,
                                                   i64 lines, i64 src_pitch, i64 dst_pitch, i64 src_batch,
                                                   i64 dst_batch, i64 upl, i64 units) {
  const u64 unit = (u64)blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5);
  if (unit >= (u64)units) return;
  const int lane = threadIdx.x & 31;
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

  const i64 c0 = seg * UNIT_SLOTS + lane;
  uint4 v[UNROLL];
  bool full[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const i64 c = c0 + u * 32;
    // whole, and (k > 0) its second aligned source vector ends inside the line: the last
    // granule of a line may be the last of an allocation whose size is no multiple of 16
    full[u] = (c > 0 || head == 0) && ((c + 1) << 4) <= head + width && (k == 0 || (c << 4) + 32 - head - k <= width);
    if (full[u]) {
      const char* p = s_aligned + (c << 4);
      v[u] = load16(p);
      if (k) v[u] = funnel(v[u], load16(p + 16), k);
    }
  }
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const i64 c = c0 + u * 32;
    if (full[u]) {
      store16(d0 + (c << 4), v[u]);
    } else {  // a partial vector at an end of the line, or a slot past it: element by element
      const i64 lo = max((c << 4) - head, (i64)0), hi = min(((c + 1) << 4) - head, width);
      for (i64 x = lo; x < hi; x += ELEM) {
        if (ELEM == 4)
          *(u32*)(d + x) = *(const u32*)(s + x);
        else
          *(unsigned short*)(d + x) = *(const unsigned short*)(s + x);
      }
    }
  }
}

}  // namespace ka_line_copy
