// Row softmax (forward and backward) in two streaming launches, for long rows: every row is cut
// into parts of `bv` 16-byte vectors, one CTA per part, and no CTA ever waits for another.
// Compiled after softmax.cu (the interface, softmax_stream.py, joins the two sources), whose
// spans, conversions, loops, stores and reductions it uses.
//
//   1. *_stream_stats: each part's statistics into the workspace (forward: its (max, sum of
//      exp(x - max)) as a float2; backward: sum(dy * y) as a float), with softmax.cu's loops
//      (UNROLL x THREADS 16-byte loads in flight per CTA).
//   2. *_stream_out: each part combines its row's partials (every part of a row in the same
//      order, so all agree bit for bit), re-reads its vectors and writes the output. The
//      parts run in the reverse of the first launch's order and each part's vectors last to
//      first, so the data the first launch read last, which is still in L2, is read first.
//
// Against the one-read designs (a row staged in shared memory across a CTA group), this reads
// the input twice, the second time partly from L2, but both launches stream at the memory's
// rate with no group meetings and no waves: rows are peeled as in softmax.cu (part 0 of a row
// holds its scalar head and tail), and the workspace holds one partial per part.

namespace ka_softmax {
namespace stream {

// Part w of the grid: row r, its index p in the row, and its vectors [v0, v0 + n).
struct Part {
  i64 r;
  int p, v0, n;
};
__device__ __forceinline__ Part part_of(i64 w, i64 bpr, i64 bv, int nvec) {
  Part q;
  q.r = w / bpr;
  q.p = (int)(w - q.r * bpr);
  q.v0 = (int)(q.p * bv);
  const int rest = nvec - q.v0;
  q.n = rest <= 0 ? 0 : (rest < bv ? rest : (int)bv);
  return q;
}

}  // namespace stream

template <class T, int VEC, int UNROLL, int THREADS>
__global__ void __launch_bounds__(THREADS) fwd_stream_stats(const typename T::raw* __restrict__ x,
                                                            typename T::raw* __restrict__, i64 rows, i64 cols, i64 ldx,
                                                            i64, float2* __restrict__ ws, i64 bpr, i64 bv) {
  __shared__ float sm[64];
  const int t = threadIdx.x;
  const typename T::raw* xr = x + (i64)(blockIdx.x / bpr) * ldx;
  const Span sp = row_span<T, VEC, true>(xr, (int)cols);
  const stream::Part q = stream::part_of(blockIdx.x, bpr, bv, sp.nvec);
  float eh = -KA_INF, et = -KA_INF;
  if (q.p == 0) load_edges<T, VEC>(xr, sp, t, -KA_INF, eh, et);
  float m, s;
  online_stats<T, VEC, UNROLL, THREADS>(xr + sp.head + (i64)q.v0 * VEC, q.n, t, eh, et, m, s);
  const float part_max = block_max<THREADS>(m, sm);
  s = m == -KA_INF ? 0.f : s * exp_shifted(m, part_max);
  const float part_sum = block_sum<THREADS>(s, sm + 32);
  if (t == 0) ws[blockIdx.x] = make_float2(part_max, part_sum);
}

template <class T, int VEC, int UNROLL, int THREADS>
__global__ void __launch_bounds__(THREADS) fwd_stream_out(const typename T::raw* __restrict__ x,
                                                          typename T::raw* __restrict__ y, i64 rows, i64 cols, i64 ldx,
                                                          i64 ldy, const float2* __restrict__ ws, i64 bpr, i64 bv) {
  __shared__ float sm[64];
  const int t = threadIdx.x;
  const i64 w = (i64)gridDim.x - 1 - blockIdx.x;  // the first launch's last parts first
  const i64 r = w / bpr;
  float m = -KA_INF, s = 0.f;
  for (i64 j = t; j < bpr; j += THREADS) {
    const float2 v = ws[r * bpr + j];
    merge_stats(m, s, v.x, v.y);
  }
  const float row_max = block_max<THREADS>(m, sm);
  s = m == -KA_INF ? 0.f : s * exp_shifted(m, row_max);
  const float inv = 1.f / block_sum<THREADS>(s, sm + 32);  // (an all -inf row: inf, then NaN as torch)
  const typename T::raw* xr = x + r * ldx;
  typename T::raw* yr = y + r * ldy;
  const Span sp = row_span<T, VEC, true>(xr, (int)cols);
  const stream::Part q = stream::part_of(w, bpr, bv, sp.nvec);
  const i64 o = sp.head + (i64)q.v0 * VEC;
  write_scaled<T, VEC, UNROLL, THREADS, true>(xr + o, yr + o, q.n, t, row_max, inv);
  if (q.p == 0) {
    float eh, et;
    load_edges<T, VEC>(xr, sp, t, -KA_INF, eh, et);
    store_edges<T, VEC>(yr, sp, t, exp_shifted(eh, row_max) * inv, exp_shifted(et, row_max) * inv);
  }
}

template <class T, int VEC, int UNROLL, int THREADS>
__global__ void __launch_bounds__(THREADS) bwd_stream_stats(const typename T::raw* __restrict__ dy,
                                                            const typename T::raw* __restrict__ y,
                                                            typename T::raw* __restrict__, i64 rows, i64 cols, i64 lddy,
                                                            i64 ldy, i64, float* __restrict__ ws, i64 bpr, i64 bv) {
  __shared__ float sm[32];
  const int t = threadIdx.x;
  const i64 r = blockIdx.x / bpr;
  const typename T::raw* gr = dy + r * lddy;
  const typename T::raw* yr = y + r * ldy;
  const Span sp = row_span<T, VEC, true>(yr, (int)cols);
  const stream::Part q = stream::part_of(blockIdx.x, bpr, bv, sp.nvec);
  float dot = 0.f;
  if (q.p == 0) {
    float gh, gt, yh, yt;
    load_edges<T, VEC>(gr, sp, t, 0.f, gh, gt);
    load_edges<T, VEC>(yr, sp, t, 0.f, yh, yt);
    dot = gh * yh + gt * yt;
  }
  const i64 o = sp.head + (i64)q.v0 * VEC;
  dot += dot_stats<T, VEC, UNROLL, THREADS>(gr + o, yr + o, q.n, t);
  dot = block_sum<THREADS>(dot, sm);
  if (t == 0) ws[blockIdx.x] = dot;
}

template <class T, int VEC, int UNROLL, int THREADS>
__global__ void __launch_bounds__(THREADS) bwd_stream_out(const typename T::raw* __restrict__ dy,
                                                          const typename T::raw* __restrict__ y,
                                                          typename T::raw* __restrict__ dx, i64 rows, i64 cols,
                                                          i64 lddy, i64 ldy, i64 lddx, const float* __restrict__ ws,
                                                          i64 bpr, i64 bv) {
  __shared__ float sm[32];
  const int t = threadIdx.x;
  const i64 w = (i64)gridDim.x - 1 - blockIdx.x;
  const i64 r = w / bpr;
  float part = 0.f;
  for (i64 j = t; j < bpr; j += THREADS) part += ws[r * bpr + j];
  const float dot = block_sum<THREADS>(part, sm);
  const typename T::raw* gr = dy + r * lddy;
  const typename T::raw* yr = y + r * ldy;
  typename T::raw* dr = dx + r * lddx;
  const Span sp = row_span<T, VEC, true>(yr, (int)cols);
  const stream::Part q = stream::part_of(w, bpr, bv, sp.nvec);
  const i64 o = sp.head + (i64)q.v0 * VEC;
  write_grad<T, VEC, UNROLL, THREADS, true>(gr + o, yr + o, dr + o, q.n, t, dot);
  if (q.p == 0) {
    float gh, gt, yh, yt;
    load_edges<T, VEC>(gr, sp, t, 0.f, gh, gt);
    load_edges<T, VEC>(yr, sp, t, 0.f, yh, yt);
    store_edges<T, VEC>(dr, sp, t, yh * (gh - dot), yt * (gt - dot));
  }
}

}  // namespace ka_softmax
