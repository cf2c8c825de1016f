// Small-M GEMM for decode and prefill tails: out[M, N] = A[M, K] @ B[K, N], M <= 128,
// bf16 or f16 operands, f32 accumulation, sm_90 (thread-block clusters). Self-contained (no
// toolkit headers) so NVRTC compiles it anywhere.
//
// With M this small the work is bound by reading B (K x N) once from memory, so the design
// streams B and nothing else through global memory:
//
//  * Operands swapped for the tensor cores: out^T = B^T A^T. B^T is the mma's 16-row "A"
//    operand (16 output columns n per fragment) and A^T its 8-column "B" operand, so M pads to
//    a multiple of 8 (not 16) and MP (the template's padded M) picks the instance.
//  * A CTA owns BN columns of out (all MP rows) and one K range (split-K). B and A tiles go
//    global -> shared with 16-byte cp.async (zero-filled past N, K and M), STAGES deep; B's
//    loads carry an L2 evict-first hint (it is read exactly once). ldmatrix (.trans for a
//    row-major B) feeds mma.sync m16n8k16. Shared tiles are XOR-swizzled in 16-byte chunks
//    (chunk ^= row & 7) so cp.async stores and ldmatrix reads are free of bank conflicts.
//  * Split-K is reduced inside thread-block clusters of CLUSTER CTAs, deterministically and
//    without a workspace: the SPLIT CTAs of one tile sit in one cluster (SPLIT divides
//    CLUSTER), each parks its f32 partial tile in its own shared memory, and after a cluster
//    barrier each CTA sums a 1/SPLIT slice of the tile over all SPLIT partials in rank order
//    through distributed shared memory, converts, and stores 16 bytes per thread. The order
//    of the sum is fixed by SPLIT alone, so a given shape always gets bit-identical results.
//    CLUSTER is a template parameter: the interface launches clusters of 8 CTAs, or of 2
//    where the split is 2 (at N = 8192 clusters of 8 CTAs ran 10-40 % slower than clusters of
//    2 at the same split on an H200, while at split 1 and 4 clusters of 8 were as fast or
//    faster than smaller ones; docs/performance.md, "Small-M GEMM").
//
// Layouts: A row-major (K contiguous, lda), out row-major (N contiguous, ldo). B either
// K-major (B_KMAJOR: element (k, n) at B[n * ldb + k], i.e. B = W.t() for an nn.Linear weight
// W[N, K]) or N-major (element (k, n) at B[k * ldb + n]). The interface guarantees 16-byte
// alignment of every base pointer, leading dimension, batch stride and contiguous extent, so
// N and K are multiples of 8 and every 16-byte chunk is wholly inside or outside the matrix.
// Batches (L) run on gridDim.y. Every parameter is 64-bit (the launcher passes Python ints).

namespace ka_gemm_small_m {

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;


__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ u64 evict_first_policy() {
  u64 policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// 16 bytes global -> shared; src_bytes 0 zero-fills the chunk without reading src.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async16_hint(u32 dst, const void* src, u32 src_bytes, u64 policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes), "l"(policy)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2(u32 addr, u32& r0, u32& r1) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}

// DT: 0 = bf16, 1 = f16.
template <int DT>
__device__ __forceinline__ void mma16816(float* d, const u32* a, const u32* b) {
  if (DT == 0) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// Two f32 -> one 32-bit word of two 16-bit values, lo at the lower address (round to nearest even).
template <int DT>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  if (DT == 0) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// The shared::cluster address of the same offset in CTA `rank` of this cluster.
__device__ __forceinline__ u32 map_rank(u32 addr, u32 rank) {
  u32 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ float4 ld_cluster_f4(u32 addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ void st_global16(void* p, u32 a, u32 b, u32 c, u32 d) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// Shared memory the instance needs (dynamic): the operand pipeline, reused for the f32
// partial tile [MP][BN + 4] (padding keeps 16-byte rows and conflict-free fragment stores).
template <int MP, int BN, int BK, int STAGES>
struct SmemPlan {
  static constexpr int kPipe = STAGES * (BN + MP) * BK * 2;
  static constexpr int kPartial = MP * (BN + 4) * 4;
  static constexpr int kBytes = kPipe > kPartial ? kPipe : kPartial;
};

template <int DT, bool B_KMAJOR, int MP, int BN, int BK, int STAGES, int WN, int WM, int MIN_CTAS, int CLUSTER>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(WN * WM * 32, MIN_CTAS)
    gemm_small_m(const u16* __restrict__ A, const u16* __restrict__ B, u16* __restrict__ out, i64 M_, i64 N_,
                 i64 K_, i64 lda, i64 ldb, i64 ldo, i64 batch_a, i64 batch_b, i64 batch_o, i64 split_,
                 i64 tiles_) {
  constexpr int THREADS = WN * WM * 32;
  constexpr int TN = BN / WN;  // n rows of B^T per warp
  constexpr int TM = MP / WM;  // m columns per warp
  constexpr int FN = TN / 16;  // mma row fragments per warp
  constexpr int FM = TM / 8;   // mma column fragments per warp
  constexpr int KCH = BK / 8;  // 16-byte chunks per k extent of a tile
  constexpr int NCH = BN / 8;  // 16-byte chunks per n extent of a tile
  constexpr int B_STAGE = BN * BK;  // elements
  constexpr int A_STAGE = MP * BK;
  constexpr int B_CHUNKS = BN * BK / 8;
  constexpr int A_CHUNKS = MP * BK / 8;
  constexpr int PS = BN + 4;  // partial-tile row stride (floats)
  static_assert(TN % 16 == 0 && TM % 8 == 0, "warp tile must be whole mma fragments");
  static_assert(BK % 16 == 0 && KCH >= 8 && (B_KMAJOR || NCH >= 8), "swizzled rows need >= 8 chunks");
  static_assert(B_CHUNKS % THREADS == 0, "B tile chunks must spread evenly over the threads");
  static_assert(THREADS % (B_KMAJOR ? KCH : NCH) == 0, "a thread's B chunks must share one k (n) offset");

  extern __shared__ __align__(128) unsigned char smem[];
  u16* sB = reinterpret_cast<u16*>(smem);
  u16* sA = sB + STAGES * B_STAGE;
  const u32 sB_u32 = smem_u32(sB);
  const u32 sA_u32 = smem_u32(sA);

  const int M = (int)M_, N = (int)N_, K = (int)K_;
  const int split = (int)split_, tiles = (int)tiles_;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wn = warp % WN;
  const int wm = warp / WN;

  const int w = blockIdx.x;  // work item: tile w / split, K part w % split
  const int tile = w / split;
  const int part = w - tile * split;
  const bool active = tile < tiles;  // grid.x is padded to whole clusters
  const int n0 = tile * BN;

  A += (i64)blockIdx.y * batch_a;
  B += (i64)blockIdx.y * batch_b;
  out += (i64)blockIdx.y * batch_o;

  float acc[FN][FM][4];
#pragma unroll
  for (int i = 0; i < FN; ++i)
#pragma unroll
    for (int j = 0; j < FM; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  if (active) {
    const int ktiles = (K + BK - 1) / BK;
    const int kt_begin = (int)(((i64)part * ktiles) / split);
    const int kt_end = (int)(((i64)(part + 1) * ktiles) / split);
    const int nk = kt_end - kt_begin;
    const u64 policy = evict_first_policy();

    // Per-thread load coordinates (fixed across k tiles: only the k offset moves).
    // B, K-major: chunk c -> row n = c / KCH, k chunk c % KCH. N-major: k row c / NCH, n chunk c % NCH.
    constexpr int B_PER = B_CHUNKS / THREADS;
    constexpr int ROWS_STEP = THREADS / (B_KMAJOR ? KCH : NCH);  // rows between a thread's chunks
    const int b_row0 = tid / (B_KMAJOR ? KCH : NCH);
    const int b_col = tid % (B_KMAJOR ? KCH : NCH);

    auto load_stage = [&](int kt, int slot) {
      const int k0 = kt * BK;
      const u32 sb = sB_u32 + (u32)(slot * B_STAGE * 2);
#pragma unroll
      for (int i = 0; i < B_PER; ++i) {
        const int r = b_row0 + i * ROWS_STEP;
        const u32 dst = sb + (u32)((r * (B_KMAJOR ? BK : BN) + ((b_col ^ (r & 7)) * 8)) * 2);
        if (B_KMAJOR) {
          const int n = n0 + r, k = k0 + b_col * 8;
          const bool ok = n < N && k < K;
          const u16* src = ok ? B + (i64)n * ldb + k : B;
          cp_async16_hint(dst, src, ok ? 16u : 0u, policy);
        } else {
          const int k = k0 + r, n = n0 + b_col * 8;
          const bool ok = k < K && n < N;
          const u16* src = ok ? B + (i64)k * ldb + n : B;
          cp_async16_hint(dst, src, ok ? 16u : 0u, policy);
        }
      }
      const u32 sa = sA_u32 + (u32)(slot * A_STAGE * 2);
#pragma unroll
      for (int i = 0; i < (A_CHUNKS + THREADS - 1) / THREADS; ++i) {
        const int c = tid + i * THREADS;
        if (A_CHUNKS % THREADS == 0 || c < A_CHUNKS) {
          const int m = c / KCH, kc = c % KCH;
          const int k = k0 + kc * 8;
          const bool ok = m < M && k < K;
          const u16* src = ok ? A + (i64)m * lda + k : A;
          cp_async16(sa + (u32)((m * BK + ((kc ^ (m & 7)) * 8)) * 2), src, ok ? 16u : 0u);
        }
      }
    };

    // Per-lane ldmatrix coordinates. Fragment rows start at multiples of 8, so a lane's row
    // & 7 is lane & 7 and its swizzle term is the same for every fragment.
    const int l7 = lane & 7;
    const int lhi = lane >> 4;       // 0 for lanes 0-15, 1 for 16-31
    const int lmid = (lane >> 3) & 1;  // 8x8 matrix 1 and 3 of an x4
    // B^T fragments (mma A operand, 16 n x 16 k): matrices (n0-7,k0-7) (n8-15,k0-7) (n0-7,k8-15) (n8-15,k8-15).
    u32 b_off[FN];  // byte offset within a stage, for kk = 0 (the chunk term is added per kk)
#pragma unroll
    for (int i = 0; i < FN; ++i) {
      if (B_KMAJOR) {
        const int row = wn * TN + i * 16 + l7 + lmid * 8;
        b_off[i] = (u32)(row * BK * 2);
      } else {
        const int krow = l7 + lhi * 8;
        b_off[i] = (u32)(krow * BN * 2);
      }
    }
    // A^T fragments (mma B operand, 16 k x 8 m), two m8 tiles per x4: (m0-7,k0-7) (m0-7,k8-15) (m8-15,k0-7) (m8-15,k8-15).
    u32 a_off[(FM + 1) / 2];
#pragma unroll
    for (int j = 0; j < (FM + 1) / 2; ++j) {
      const int row = wm * TM + j * 16 + l7 + ((FM % 2 == 1 && 2 * j + 1 == FM) ? 0 : lhi * 8);
      a_off[j] = (u32)(row * BK * 2);
    }

    auto compute_stage = [&](int slot) {
      const u32 sb = sB_u32 + (u32)(slot * B_STAGE * 2);
      const u32 sa = sA_u32 + (u32)(slot * A_STAGE * 2);
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        u32 bf[FN][4];
        u32 af[FM][2];
#pragma unroll
        for (int i = 0; i < FN; ++i) {
          if (B_KMAJOR) {
            const int chunk = (kk * 2 + lhi) ^ l7;
            ldsm_x4(sb + b_off[i] + (u32)(chunk * 16), bf[i][0], bf[i][1], bf[i][2], bf[i][3]);
          } else {
            const int chunk = ((wn * TN + i * 16) / 8 + lmid) ^ l7;
            ldsm_x4_trans(sb + b_off[i] + (u32)(kk * 16 * BN * 2) + (u32)(chunk * 16), bf[i][0], bf[i][1], bf[i][2],
                          bf[i][3]);
          }
        }
        const int achunk = (kk * 2 + lmid) ^ l7;
#pragma unroll
        for (int j = 0; j < FM / 2; ++j)
          ldsm_x4(sa + a_off[j] + (u32)(achunk * 16), af[2 * j][0], af[2 * j][1], af[2 * j + 1][0], af[2 * j + 1][1]);
        if (FM % 2 == 1) ldsm_x2(sa + a_off[FM / 2] + (u32)(achunk * 16), af[FM - 1][0], af[FM - 1][1]);
#pragma unroll
        for (int i = 0; i < FN; ++i)
#pragma unroll
          for (int j = 0; j < FM; ++j) mma16816<DT>(acc[i][j], bf[i], af[j]);
      }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < nk) load_stage(kt_begin + s, s);
      cp_async_commit();
    }
    for (int i = 0; i < nk; ++i) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();
      const int pre = i + STAGES - 1;  // refills the slot computed in the previous iteration
      if (pre < nk) load_stage(kt_begin + pre, pre % STAGES);
      cp_async_commit();
      compute_stage(i % STAGES);
    }
    cp_async_wait<0>();
  }
  __syncthreads();  // every warp is done reading the pipeline: reuse it for the partial tile

  float* P = reinterpret_cast<float*>(smem);
  if (active) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < FN; ++i)
#pragma unroll
      for (int j = 0; j < FM; ++j) {
        const int n = wn * TN + i * 16 + g;
        const int m = wm * TM + j * 8 + 2 * t;
        P[m * PS + n] = acc[i][j][0];
        P[(m + 1) * PS + n] = acc[i][j][1];
        P[m * PS + n + 8] = acc[i][j][2];
        P[(m + 1) * PS + n + 8] = acc[i][j][3];
      }
  }
  // All partial tiles of the cluster are written (and every CTA of it has started) past this.
  if (split > 1) {
    cluster_sync();
  } else {
    __syncthreads();
  }

  if (active) {
    const int rows = M < MP ? M : MP;
    const int chunks = rows * NCH;  // 8 outputs each
    const u32 p_u32 = smem_u32(P);
    const u32 base_rank = cluster_rank() - (u32)part;
    for (int c = part * THREADS + tid; c < chunks; c += split * THREADS) {
      const int m = c / NCH, nc = c - m * NCH;
      const int n = n0 + nc * 8;
      if (n < N) {
        const u32 off = p_u32 + (u32)((m * PS + nc * 8) * 4);
        float4 lo, hi;
        if (split > 1) {
          // Every partial's loads in flight at once (one remote round trip, not `split`), then
          // the sum in rank order: the same bits whichever CTA computes it.
          float4 plo[CLUSTER], phi[CLUSTER];
#pragma unroll
          for (int q = 0; q < CLUSTER; ++q) {
            if (q < split) {
              const u32 src = map_rank(off, base_rank + (u32)q);
              plo[q] = ld_cluster_f4(src);
              phi[q] = ld_cluster_f4(src + 16);
            }
          }
          lo = plo[0];
          hi = phi[0];
#pragma unroll
          for (int q = 1; q < CLUSTER; ++q) {
            if (q < split) {
              lo.x += plo[q].x; lo.y += plo[q].y; lo.z += plo[q].z; lo.w += plo[q].w;
              hi.x += phi[q].x; hi.y += phi[q].y; hi.z += phi[q].z; hi.w += phi[q].w;
            }
          }
        } else {
          lo = *reinterpret_cast<const float4*>(P + m * PS + nc * 8);
          hi = *reinterpret_cast<const float4*>(P + m * PS + nc * 8 + 4);
        }
        st_global16(out + (i64)m * ldo + n, pack2<DT>(lo.x, lo.y), pack2<DT>(lo.z, lo.w), pack2<DT>(hi.x, hi.y),
                    pack2<DT>(hi.z, hi.w));
      }
    }
  }
  // No CTA may leave (releasing its shared memory) while another still reads it.
  if (split > 1) cluster_sync();
}

}  // namespace ka_gemm_small_m
