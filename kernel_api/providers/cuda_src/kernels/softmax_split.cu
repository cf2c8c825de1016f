// Row softmax (forward and backward) with each row split across the CTAs of a thread-block
// cluster (sm_90): for rows too long for one CTA's registers, and for few long rows, which one
// CTA per row would spread over few SMs. Compiled after softmax.cu (the interface,
// softmax_split.py, joins the two sources), whose loads, stores, spans and reductions it uses.
//
// CLUSTER CTAs share a row: CTA `rank` takes the rank-th of CLUSTER equal slices of the row's
// 16-byte vectors (every row is peeled: its head up to the first 16-byte boundary and its tail
// are scalar elements that rank 0 holds). Each CTA reduces its slice to a partial (forward:
// the slice's max m and sum of exp(x - m); backward: the slice's sum of dy * y), parks it in
// its shared memory, and after one cluster barrier reads every CTA's partial through
// distributed shared memory and combines them in rank order (deterministic). A second barrier
// keeps every CTA's shared memory alive until all have read it.
//
//   REGS = true:  the slice is held in registers (NV vectors per thread): one read, one write.
//   REGS = false: the slice is read twice (statistics, then output), in chunks of NV vectors
//                 per thread; the second read, last chunk first, mostly hits L2.

namespace ka_softmax {

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Word `i` of the float array at `local` in the shared memory of cluster CTA `rank`.
__device__ __forceinline__ float ld_cluster(const float* local, unsigned rank) {
  unsigned addr = (unsigned)__cvta_generic_to_shared(local), remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

// The slice [v0, v0 + n) of a row's nvec vectors that cluster CTA `rank` takes.
template <int CLUSTER>
__device__ __forceinline__ void slice(int nvec, unsigned rank, int& v0, int& n) {
  const int per = (nvec + CLUSTER - 1) / CLUSTER;
  v0 = min((int)rank * per, nvec);
  n = min(per, nvec - v0);
}

template <class T, int VEC, int NV, int THREADS, int CLUSTER, bool REGS>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS)
    fwd_split(const typename T::raw* __restrict__ x, typename T::raw* __restrict__ y, i64 rows, i64 cols, i64 ldx,
              i64 ldy) {
  __shared__ float sm[64];
  __shared__ float part[2];
  const i64 row = blockIdx.x / CLUSTER;
  const unsigned rank = cluster_rank();
  const int t = threadIdx.x;
  const typename T::raw* xr = x + row * ldx;
  typename T::raw* yr = y + row * ldy;
  const Span sp = row_span<T, VEC, true>(xr, (int)cols);
  int v0, n;
  slice<CLUSTER>(sp.nvec, rank, v0, n);
  const typename T::raw* xb = xr + sp.head + (i64)v0 * VEC;
  typename T::raw* yb = yr + sp.head + (i64)v0 * VEC;
  float eh = -KA_INF, et = -KA_INF;
  if (rank == 0) load_edges<T, VEC>(xr, sp, t, -KA_INF, eh, et);
  float m, s;
  float v[REGS ? NV : 1][VEC];
  if constexpr (REGS) {
    {
      Pack<T, VEC> raw[NV];
      issue_row<T, VEC, NV, THREADS>(xb, n, t, raw);
      convert_row<T, VEC, NV, THREADS>(raw, n, t, -KA_INF, v);
    }
    m = fmaxf(eh, et);
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
      for (int k = 0; k < VEC; ++k) m = fmaxf(m, v[j][k]);
    m = block_max<THREADS>(m, sm);
    s = 0.f;
    if (m != -KA_INF) {  // an empty or all -inf slice contributes (-inf, 0), not NaN
      s = exp_shifted(eh, m) + exp_shifted(et, m);
#pragma unroll
      for (int j = 0; j < NV; ++j)
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          v[j][k] = exp_shifted(v[j][k], m);
          s += v[j][k];
        }
    } else {
#pragma unroll
      for (int j = 0; j < NV; ++j)
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[j][k] = 0.f;
    }
    s = block_sum<THREADS>(s, sm + 32);
  } else {
    online_stats<T, VEC, NV, THREADS>(xb, n, t, eh, et, m, s);
    const float cta_max = block_max<THREADS>(m, sm);
    s = m == -KA_INF ? 0.f : s * exp_shifted(m, cta_max);
    s = block_sum<THREADS>(s, sm + 32);
    m = cta_max;
  }
  if (t == 0) {
    part[0] = m;
    part[1] = s;
  }
  cluster_sync();
  float row_max = -KA_INF;
#pragma unroll
  for (int r = 0; r < CLUSTER; ++r) row_max = fmaxf(row_max, ld_cluster(&part[0], r));
  float total = 0.f;
#pragma unroll
  for (int r = 0; r < CLUSTER; ++r) {
    const float mr = ld_cluster(&part[0], r), sr = ld_cluster(&part[1], r);
    if (mr != -KA_INF) total += sr * exp_shifted(mr, row_max);
  }
  // An all -inf row gives NaN, as torch.softmax does.
  const float inv = row_max == -KA_INF ? __int_as_float(0x7fc00000) : 1.f / total;
  if constexpr (REGS) {
    const float scale = exp_shifted(m, row_max) * inv;  // this slice's exps were taken against m
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int c = j * THREADS + t;
      if (c < n) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[j][k] *= scale;
        store_vec<T, VEC>(yb + (i64)c * VEC, v[j]);
      }
    }
  } else {
    write_scaled<T, VEC, NV, THREADS, true>(xb, yb, n, t, row_max, inv);
  }
  if (rank == 0) store_edges<T, VEC>(yr, sp, t, exp_shifted(eh, row_max) * inv, exp_shifted(et, row_max) * inv);
  cluster_sync();  // no CTA leaves while another may still read its partial
}

template <class T, int VEC, int NV, int THREADS, int CLUSTER, bool REGS>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS)
    bwd_split(const typename T::raw* __restrict__ dy, const typename T::raw* __restrict__ y,
              typename T::raw* __restrict__ dx, i64 rows, i64 cols, i64 lddy, i64 ldy, i64 lddx) {
  __shared__ float sm[32];
  __shared__ float part[1];
  const i64 row = blockIdx.x / CLUSTER;
  const unsigned rank = cluster_rank();
  const int t = threadIdx.x;
  const typename T::raw* gr = dy + row * lddy;
  const typename T::raw* yr = y + row * ldy;
  typename T::raw* dr = dx + row * lddx;
  const Span sp = row_span<T, VEC, true>(yr, (int)cols);
  int v0, n;
  slice<CLUSTER>(sp.nvec, rank, v0, n);
  const i64 o = sp.head + (i64)v0 * VEC;
  float gh = 0.f, gt = 0.f, yh = 0.f, yt = 0.f;
  if (rank == 0) {
    load_edges<T, VEC>(gr, sp, t, 0.f, gh, gt);
    load_edges<T, VEC>(yr, sp, t, 0.f, yh, yt);
  }
  float dot = gh * yh + gt * yt;
  float g[REGS ? NV : 1][VEC], w[REGS ? NV : 1][VEC];
  if constexpr (REGS) {
    {
      Pack<T, VEC> rg[NV], ry[NV];
      issue_row<T, VEC, NV, THREADS>(gr + o, n, t, rg);
      issue_row<T, VEC, NV, THREADS>(yr + o, n, t, ry);
      convert_row<T, VEC, NV, THREADS>(rg, n, t, 0.f, g);
      convert_row<T, VEC, NV, THREADS>(ry, n, t, 0.f, w);
    }
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
      for (int k = 0; k < VEC; ++k) dot = fmaf(g[j][k], w[j][k], dot);
  } else {
    dot += dot_stats<T, VEC, NV, THREADS>(gr + o, yr + o, n, t);
  }
  dot = block_sum<THREADS>(dot, sm);
  if (t == 0) part[0] = dot;
  cluster_sync();
  dot = 0.f;
#pragma unroll
  for (int r = 0; r < CLUSTER; ++r) dot += ld_cluster(&part[0], r);
  if constexpr (REGS) {
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int c = j * THREADS + t;
      if (c < n) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) g[j][k] = w[j][k] * (g[j][k] - dot);
        store_vec<T, VEC>(dr + o + (i64)c * VEC, g[j]);
      }
    }
  } else {
    write_grad<T, VEC, NV, THREADS, true>(gr + o, yr + o, dr + o, n, t, dot);
  }
  if (rank == 0) store_edges<T, VEC>(dr, sp, t, yh * (gh - dot), yt * (gt - dot));
  cluster_sync();  // no CTA leaves while another may still read its partial
}

}  // namespace ka_softmax
