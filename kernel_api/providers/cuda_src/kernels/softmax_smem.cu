// Row softmax (forward and backward) with one CTA per row and the whole row staged in shared
// memory: rows too long for one CTA's registers but short enough for its shared memory
// (4096x50257). Compiled after softmax.cu (the interface, softmax_smem.py, joins the two
// sources), whose spans, conversions, stores and reductions it uses.
//
// Each thread copies its share of the row's 16-byte vectors (vector j * THREADS + t) into
// shared memory with cp.async, in STAGES commit groups, and later reads back only the vectors
// it copied itself: no barrier guards the row buffer, and the statistics of stage s are taken
// while the later stages are still in flight. The row is read from DRAM once (the looped
// kernels read it twice); the output pass reads shared memory. Rows are peeled as in
// softmax.cu (scalar head and tail in registers); the interface sizes the dynamic shared
// memory from the row, so two CTAs share an SM when two rows fit, and one CTA's copies then
// overlap the other's output pass.

namespace ka_softmax {

// CTAs per SM the launch bounds promise: two of 512 threads (rows whose buffers two CTAs hold),
// one of 1024. Without it ptxas squeezed the 1024-thread f32 forward to 32 registers for a
// second CTA that its shared memory never lets in, and spilled.
#define SMEM_MIN_BLOCKS(threads) ((threads) <= 512 ? 2 : 1)

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Wait until at most `n` of this thread's commit groups are pending (n is a constant once the
// caller's stage loop is unrolled).
__device__ __forceinline__ void cp_async_wait(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
  }
}

// Copy this thread's vectors [0, nvec) of src (16-byte aligned) to buf, stage by stage:
// stage s holds the thread's vector slots [s * per_stage, (s + 1) * per_stage).
template <int THREADS, int STAGES>
__device__ __forceinline__ void stage_row(uint4* buf, const uint4* src, int nvec, int t, int per_stage) {
#pragma unroll
  for (int s = 0; s < STAGES; ++s) {
    for (int j = s * per_stage; j < (s + 1) * per_stage; ++j) {
      const int v = j * THREADS + t;
      if (v < nvec) cp_async16(buf + v, src + v);
    }
    cp_async_commit();
  }
}

// A row of nvec vectors over THREADS threads (vector j * THREADS + t is thread t's j-th) in
// STAGES commit groups: each thread's vectors, and how many of them one stage holds.
template <int THREADS, int STAGES>
struct StageSplit {
  int per_thread, per_stage;
  __device__ __forceinline__ explicit StageSplit(int nvec)
      : per_thread((nvec + THREADS - 1) / THREADS), per_stage((per_thread + STAGES - 1) / STAGES) {}
};

template <class T, int VEC, int THREADS, int STAGES>
__global__ void __launch_bounds__(THREADS, SMEM_MIN_BLOCKS(THREADS)) fwd_smem(const typename T::raw* __restrict__ x, typename T::raw* __restrict__ y,
                                                    i64 rows, i64 cols, i64 ldx, i64 ldy) {
  extern __shared__ uint4 buf[];
  __shared__ float sm[64];
  const typename T::raw* xr = x + (i64)blockIdx.x * ldx;
  typename T::raw* yr = y + (i64)blockIdx.x * ldy;
  const int t = threadIdx.x;
  const Span sp = row_span<T, VEC, true>(xr, (int)cols);
  const StageSplit<THREADS, STAGES> split(sp.nvec);
  const int per_thread = split.per_thread, per_stage = split.per_stage;
  stage_row<THREADS, STAGES>(buf, reinterpret_cast<const uint4*>(xr + sp.head), sp.nvec, t, per_stage);
  float eh, et;
  load_edges<T, VEC>(xr, sp, t, -KA_INF, eh, et);
  // Running (max, sum) over the stages as they land, as online_stats does over chunks.
  float m = fmaxf(eh, et);
  float s = m == -KA_INF ? 0.f : exp_shifted(eh, m) + exp_shifted(et, m);
#pragma unroll
  for (int st = 0; st < STAGES; ++st) {
    cp_async_wait(STAGES - 1 - st);
    const int j1 = min((st + 1) * per_stage, per_thread);
    float cm = m;
    for (int j = st * per_stage; j < j1; ++j) {
      const int v = j * THREADS + t;
      if (v < sp.nvec) {
        float f[VEC];
        unpack16<T, VEC>(buf[v], f);
#pragma unroll
        for (int k = 0; k < VEC; ++k) cm = fmaxf(cm, f[k]);
      }
    }
    if (cm > m) {
      s *= exp_shifted(m, cm);
      m = cm;
    }
    if (m != -KA_INF) {  // a thread that has seen only -inf contributes nothing (not NaN)
      for (int j = st * per_stage; j < j1; ++j) {
        const int v = j * THREADS + t;
        if (v < sp.nvec) {
          float f[VEC];
          unpack16<T, VEC>(buf[v], f);
#pragma unroll
          for (int k = 0; k < VEC; ++k) s += exp_shifted(f[k], m);
        }
      }
    }
  }
  const float row_max = block_max<THREADS>(m, sm);
  s = m == -KA_INF ? 0.f : s * exp_shifted(m, row_max);
  const float inv = 1.f / block_sum<THREADS>(s, sm + 32);
  typename T::raw* yb = yr + sp.head;
  for (int j = 0; j < per_thread; ++j) {
    const int v = j * THREADS + t;
    if (v < sp.nvec) {
      float f[VEC];
      unpack16<T, VEC>(buf[v], f);
#pragma unroll
      for (int k = 0; k < VEC; ++k) f[k] = exp_shifted(f[k], row_max) * inv;
      store_vec<T, VEC>(yb + (i64)v * VEC, f);
    }
  }
  store_edges<T, VEC>(yr, sp, t, exp_shifted(eh, row_max) * inv, exp_shifted(et, row_max) * inv);
}

// The backward stages dy and y: the buffer holds dy's vectors, then y's (nvec apart).
template <class T, int VEC, int THREADS, int STAGES>
__global__ void __launch_bounds__(THREADS, SMEM_MIN_BLOCKS(THREADS)) bwd_smem(const typename T::raw* __restrict__ dy, const typename T::raw* __restrict__ y,
                                                    typename T::raw* __restrict__ dx, i64 rows, i64 cols, i64 lddy,
                                                    i64 ldy, i64 lddx) {
  extern __shared__ uint4 buf[];
  __shared__ float sm[32];
  const BackwardRow<T, VEC, true> row(dy, y, dx, cols, lddy, ldy, lddx);
  const typename T::raw* gr = row.g;
  const typename T::raw* yr = row.y;
  typename T::raw* dr = row.d;
  const int t = threadIdx.x;
  const Span sp = row.sp;
  const StageSplit<THREADS, STAGES> split(sp.nvec);
  const int per_thread = split.per_thread, per_stage = split.per_stage;
  uint4* gbuf = buf;
  uint4* ybuf = buf + sp.nvec;
  const uint4* gsrc = reinterpret_cast<const uint4*>(gr + sp.head);
  const uint4* ysrc = reinterpret_cast<const uint4*>(yr + sp.head);
#pragma unroll
  for (int st = 0; st < STAGES; ++st) {
    for (int j = st * per_stage; j < (st + 1) * per_stage; ++j) {
      const int v = j * THREADS + t;
      if (v < sp.nvec) {
        cp_async16(gbuf + v, gsrc + v);
        cp_async16(ybuf + v, ysrc + v);
      }
    }
    cp_async_commit();
  }
  BackwardEdges<T, VEC> e;
  e.load(gr, yr, sp, t);
  float dot = e.dot();
#pragma unroll
  for (int st = 0; st < STAGES; ++st) {
    cp_async_wait(STAGES - 1 - st);
    const int j1 = min((st + 1) * per_stage, per_thread);
    for (int j = st * per_stage; j < j1; ++j) {
      const int v = j * THREADS + t;
      if (v < sp.nvec) {
        float g[VEC], w[VEC];
        unpack16<T, VEC>(gbuf[v], g);
        unpack16<T, VEC>(ybuf[v], w);
#pragma unroll
        for (int k = 0; k < VEC; ++k) dot = fmaf(g[k], w[k], dot);
      }
    }
  }
  dot = block_sum<THREADS>(dot, sm);
  typename T::raw* db = dr + sp.head;
  for (int j = 0; j < per_thread; ++j) {
    const int v = j * THREADS + t;
    if (v < sp.nvec) {
      float g[VEC], w[VEC];
      unpack16<T, VEC>(gbuf[v], g);
      unpack16<T, VEC>(ybuf[v], w);
#pragma unroll
      for (int k = 0; k < VEC; ++k) g[k] = w[k] * (g[k] - dot);
      store_vec<T, VEC>(db + (i64)v * VEC, g);
    }
  }
  e.store(dr, sp, t, dot);
}

// The y-staged backward's (below) hinted loads: dy is read twice, so its first read asks L2 to
// keep it (evict_last) and its second, its last use, to drop it first; y is read once.
__device__ __forceinline__ uint4 ld16_policy(const void* p, unsigned long long policy) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p), "l"(policy));
  return r;
}
__device__ __forceinline__ void cp_async16_policy(void* smem, const void* gmem, unsigned long long policy) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "l"(policy)
               : "memory");
}

// The backward for rows whose dy and y do not both fit shared memory but y alone does (f32 rows
// of 29K-58K elements, 16-bit rows of 58K-116K): y is staged as the forward stages x, dy is
// read from global memory twice -- for the dot product as y's stages land, and again in the
// output pass, which L2 serves (the first read asked L2 to keep it). DRAM traffic stays one
// read of y and dy and one write of dx; the looped kernels read both rows twice.
template <class T, int VEC, int THREADS, int STAGES>
__global__ void __launch_bounds__(THREADS, SMEM_MIN_BLOCKS(THREADS)) bwd_smem_y(const typename T::raw* __restrict__ dy, const typename T::raw* __restrict__ y,
                                                      typename T::raw* __restrict__ dx, i64 rows, i64 cols, i64 lddy,
                                                      i64 ldy, i64 lddx) {
  extern __shared__ uint4 buf[];
  __shared__ float sm[32];
  const BackwardRow<T, VEC, true> row(dy, y, dx, cols, lddy, ldy, lddx);
  const typename T::raw* gr = row.g;
  const typename T::raw* yr = row.y;
  typename T::raw* dr = row.d;
  const int t = threadIdx.x;
  const Span sp = row.sp;
  const StageSplit<THREADS, STAGES> split(sp.nvec);
  const int per_thread = split.per_thread, per_stage = split.per_stage;
  const unsigned long long keep = l2_evict_last_policy(), drop = l2_evict_first_policy();
  const uint4* ysrc = reinterpret_cast<const uint4*>(yr + sp.head);
  const uint4* gsrc = reinterpret_cast<const uint4*>(gr + sp.head);
#pragma unroll
  for (int st = 0; st < STAGES; ++st) {
    for (int j = st * per_stage; j < (st + 1) * per_stage; ++j) {
      const int v = j * THREADS + t;
      if (v < sp.nvec) cp_async16_policy(buf + v, ysrc + v, drop);
    }
    cp_async_commit();
  }
  BackwardEdges<T, VEC> e;
  e.load(gr, yr, sp, t);
  float dot = e.dot();
  // dy in batches of DY_BATCH vectors, all issued before any is used (in flight together).
  constexpr int DY_BATCH = 4;
#pragma unroll
  for (int st = 0; st < STAGES; ++st) {
    const int j1 = min((st + 1) * per_stage, per_thread);
    for (int j0 = st * per_stage; j0 < j1; j0 += DY_BATCH) {
      uint4 g[DY_BATCH];
#pragma unroll
      for (int b = 0; b < DY_BATCH; ++b) {
        const int v = (j0 + b) * THREADS + t;
        if (j0 + b < j1 && v < sp.nvec) g[b] = ld16_policy(gsrc + v, keep);
      }
      if (j0 == st * per_stage) cp_async_wait(STAGES - 1 - st);  // y's stage st has landed
#pragma unroll
      for (int b = 0; b < DY_BATCH; ++b) {
        const int v = (j0 + b) * THREADS + t;
        if (j0 + b < j1 && v < sp.nvec) {
          float gf[VEC], w[VEC];
          unpack16<T, VEC>(g[b], gf);
          unpack16<T, VEC>(buf[v], w);
#pragma unroll
          for (int k = 0; k < VEC; ++k) dot = fmaf(gf[k], w[k], dot);
        }
      }
    }
    if (st * per_stage >= j1) cp_async_wait(STAGES - 1 - st);  // an empty stage still retires its group
  }
  dot = block_sum<THREADS>(dot, sm);
  typename T::raw* db = dr + sp.head;
  for (int j0 = 0; j0 < per_thread; j0 += DY_BATCH) {
    uint4 g[DY_BATCH];
#pragma unroll
    for (int b = 0; b < DY_BATCH; ++b) {
      const int v = (j0 + b) * THREADS + t;
      if (j0 + b < per_thread && v < sp.nvec) g[b] = ld16_policy(gsrc + v, drop);
    }
#pragma unroll
    for (int b = 0; b < DY_BATCH; ++b) {
      const int v = (j0 + b) * THREADS + t;
      if (j0 + b < per_thread && v < sp.nvec) {
        float gf[VEC], w[VEC];
        unpack16<T, VEC>(g[b], gf);
        unpack16<T, VEC>(buf[v], w);
#pragma unroll
        for (int k = 0; k < VEC; ++k) gf[k] = w[k] * (gf[k] - dot);
        store_vec<T, VEC>(db + (i64)v * VEC, gf);
      }
    }
  }
  e.store(dr, sp, t, dot);
}

}  // namespace ka_softmax
