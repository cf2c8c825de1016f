// Decode GEMM: out[M, N] = A[M, K] @ B[K, N] for M <= 16 rows, bf16 or f16 operands, f32
// accumulation, sm_90. Self-contained (no toolkit headers) so NVRTC compiles it anywhere.
//
// At M <= 16 the time is reading B (K x N) once, and a CTA reads as fast as it keeps bytes in
// flight. The split-K family (gemm_small_m.cu) cuts B into a grid of tiles x splits, so how
// many CTAs (and bytes in flight) an SM gets depends on the shape: at N = 8192 it runs one or
// two CTAs per SM and streams 10-15 % below cuBLAS. This kernel gives every SM the same work:
//
//  * Stream-K over a persistent grid of CTAS_PER_SM CTAs per SM. The work is the flat list of
//    (column tile, k-tile) steps, tile-major; CTA c takes steps [c*I/G, (c+1)*I/G). A CTA's
//    range may start and end inside a tile, so a tile's k-steps can come from several
//    consecutive CTAs ("segments").
//  * Every thread copies its share of each step with 16-byte cp.async (zero-filled past N, M
//    and K), STAGES deep, and the pipeline runs on across segment boundaries. B carries an L2
//    evict-first hint (read once). Shared tiles are XOR-swizzled in 16-byte chunks
//    (chunk ^= row & 7), so the copies and the ldmatrix reads are free of bank conflicts.
//    (Measured and dropped: a producer warp feeding a deep mbarrier ring, with 256-byte
//    cp.async.bulk row copies 0.7 TB/s, with cp.async 1.3-3.0 TB/s on the H200: the producers'
//    issue rate set the pace.)
//  * BN / 16 warps multiply with mma.sync m16n8k16 on the swapped operands (out^T = B^T A^T:
//    B^T is the 16-row operand, so M pads to 8 or 16, not 64).
//  * A segment that covers its whole tile stores the output directly. Otherwise it parks its
//    f32 partial in the workspace (two slots per CTA: its first and its last segment), and the
//    last segment to arrive at the tile's counter sums all of the tile's partials in CTA order
//    and stores. The order is fixed by the shape and grid, so results are bit-identical
//    whichever segment arrives last, and no CTA ever waits for another (no residency
//    assumption, no deadlock). Counters carry a per-launch tag (the host's epoch mixed with
//    %gridid) in their high word, so a stale or uninitialised workspace never counts, and the
//    finishing segment resets its counter to 0.
//
// Layouts: A row-major (K contiguous, lda), out row-major (N contiguous, ldo). B either K-major
// (B_KMAJOR: element (k, n) at B[n * ldb + k], i.e. B = W.t() for an nn.Linear weight W[N, K])
// or N-major (element (k, n) at B[k * ldb + n]). The interface guarantees 16-byte alignment of
// every base pointer, leading dimension, batch stride and contiguous extent (N and K multiples
// of 8), so every 16-byte chunk is wholly inside or outside the matrix. Every parameter is
// 64-bit (the launcher passes Python ints).

namespace ka_gemm_decode {

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ u64 l2_policy_first() {
  u64 p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ u64 l2_policy_last() {
  u64 p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  return p;
}

// 16 bytes global -> shared; src_bytes 0 zero-fills the chunk without reading src.
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

__device__ __forceinline__ void st_global16(void* p, u32 a, u32 b, u32 c, u32 d) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
// Partials bypass L1 both ways: other SMs write and read them.
__device__ __forceinline__ void st_cg_f4(float* p, float4 v) {
  asm volatile("st.global.cg.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}
__device__ __forceinline__ void st_cg_f32(float* p, float v) {
  asm volatile("st.global.cg.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}
__device__ __forceinline__ float4 ld_cg_f4(const float* p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(p)
               : "memory");
  return v;
}
__device__ __forceinline__ u64 ld_relaxed_u64(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u64 cas_acq_rel_u64(u64* p, u64 expected, u64 desired) {
  u64 old;
  asm volatile("atom.acq_rel.gpu.global.cas.b64 %0, [%1], %2, %3;" : "=l"(old) : "l"(p), "l"(expected), "l"(desired)
               : "memory");
  return old;
}
__device__ __forceinline__ void st_relaxed_u64(u64* p, u64 v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// This launch's counter tag: the host's epoch (a per-process counter) mixed with %gridid (a
// per-launch number of the context, so CUDA graph replays differ too); never 0, the reset value.
__device__ __forceinline__ u32 launch_tag(i64 epoch) {
  u64 g;
  asm volatile("mov.u64 %0, %%gridid;" : "=l"(g));
  const u32 t = (u32)epoch ^ ((u32)g * 0x9E3779B1u);
  return t ? t : 1u;
}

// Count one arrival at a tile's counter; returns the arrivals of this launch so far.
__device__ __forceinline__ u32 arrive_at(u64* counter, u32 tag) {
  u64 old = ld_relaxed_u64(counter);
  for (;;) {
    const u64 want = (u32)(old >> 32) == tag ? old + 1 : (((u64)tag << 32) | 1u);
    const u64 seen = cas_acq_rel_u64(counter, old, want);
    if (seen == old) return (u32)want;
    old = seen;
  }
}


// The CTA whose step range holds step i, for ranges [c*I/G, (c+1)*I/G) with I >= G.
__device__ __forceinline__ i64 cta_of(i64 i, i64 I, i64 G) { return ((i + 1) * G - 1) / I; }
__device__ __forceinline__ i64 begin_of(i64 c, i64 I, i64 G) { return c * I / G; }

// Shared-memory plan (bytes): the ring of stages (B, then A) and the staged f32 result tile.
template <int MP, int BN, int BK, int STAGES>
struct Plan {
  static constexpr int kB = BN * BK * 2;
  static constexpr int kA = MP * BK * 2;
  static constexpr int kStage = kB + kA;
  static constexpr int kPartialStride = BN + 4;  // floats per row of the staged tile
  static constexpr int kPartial = MP * kPartialStride * 4;
  static constexpr int kBytes = STAGES * kStage + kPartial + 16;  // + the hand-off flags
};

template <int DT, bool B_KMAJOR, int MP, int BN, int BK, int STAGES, int CTAS_PER_SM>
__global__ void __launch_bounds__(BN / 16 * 32, CTAS_PER_SM)
    gemm_decode(const u16* __restrict__ A, const u16* __restrict__ B, u16* __restrict__ out, i64 M_, i64 N_, i64 K_,
                i64 lda, i64 ldb, i64 ldo, i64 batch_a, i64 batch_b, i64 batch_o, i64 L, u64* __restrict__ ws,
                i64 epoch) {
  using P = Plan<MP, BN, BK, STAGES>;
  constexpr int W = BN / 16;          // warps, 16 output columns each
  constexpr int T = W * 32;           // threads
  constexpr int FM = MP / 8;          // mma column fragments (8 rows of out each)
  constexpr int NCH = BN / 8;         // 16-byte chunks along n
  constexpr int KCH = BK / 8;         // 16-byte chunks along k
  constexpr int PS = P::kPartialStride;
  static_assert(BN % 16 == 0 && MP % 8 == 0 && MP <= 16 && BK % 16 == 0, "tile shape");
  static_assert(KCH >= 8 && (B_KMAJOR || NCH >= 8), "swizzled rows need >= 8 chunks");
  static_assert((BN * BK / 8) % T == 0, "B's chunks spread evenly over the threads");

  extern __shared__ __align__(128) unsigned char smem[];
  const u32 ring = smem_u32(smem);
  float* stage_out = reinterpret_cast<float*>(smem + STAGES * P::kStage);
  int* last_flag = reinterpret_cast<int*>(smem + STAGES * P::kStage + P::kPartial);

  const int M = (int)M_, N = (int)N_, K = (int)K_;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const i64 NT = (N + BN - 1) / BN;
  const i64 KT = (K + BK - 1) / BK;
  const i64 I = NT * L * KT;
  const i64 G = gridDim.x;
  const i64 c = blockIdx.x;
  const i64 first = begin_of(c, I, G), last = begin_of(c + 1, I, G);
  const int rows = M < MP ? M : MP;
  const u64 stream_b = l2_policy_first(), keep_a = l2_policy_last();

  // The next step to load, as (batch l, column tile nt, k-tile kt): advanced one step at a time
  // (no 64-bit division per step).
  i64 ld_l, ld_nt, ld_kt;
  {
    const i64 tile = first / KT;
    ld_kt = first - tile * KT;
    ld_l = tile / NT;
    ld_nt = tile - ld_l * NT;
  }
  // Copies of the next step into ring slot `slot`: B then A, 16-byte chunks, zero-filled outside.
  auto load_step = [&](int slot) {
    const i64 l = ld_l;
    const int n0 = (int)ld_nt * BN, k0 = (int)ld_kt * BK;
    if (++ld_kt == KT) {
      ld_kt = 0;
      if (++ld_nt == NT) {
        ld_nt = 0;
        ++ld_l;
      }
    }
    const u32 sB = ring + slot * P::kStage, sA = sB + P::kB;
    const u16* Bl = B + l * batch_b;
#pragma unroll
    for (int i = 0; i < BN * BK / 8 / T; ++i) {
      const int x = tid + i * T;
      if (B_KMAJOR) {
        const int r = x / KCH, q = x % KCH, n = n0 + r, k = k0 + q * 8;
        const bool ok = n < N && k < K;
        cp_async16_hint(sB + (r * KCH + (q ^ (r & 7))) * 16, ok ? Bl + (i64)n * ldb + k : Bl, ok ? 16u : 0u, stream_b);
      } else {
        const int r = x / NCH, q = x % NCH, k = k0 + r, n = n0 + q * 8;
        const bool ok = n < N && k < K;
        cp_async16_hint(sB + (r * NCH + (q ^ (r & 7))) * 16, ok ? Bl + (i64)k * ldb + n : Bl, ok ? 16u : 0u, stream_b);
      }
    }
    const u16* Al = A + l * batch_a;
#pragma unroll
    for (int i = 0; i < (MP * KCH + T - 1) / T; ++i) {
      const int x = tid + i * T;
      if ((MP * KCH) % T == 0 || x < MP * KCH) {
        const int m = x / KCH, q = x % KCH, k = k0 + q * 8;
        const bool ok = m < M && k < K;
        cp_async16_hint(sA + (m * KCH + (q ^ (m & 7))) * 16, ok ? Al + (i64)m * lda + k : Al, ok ? 16u : 0u, keep_a);
      }
    }
  };

  // ldmatrix lane coordinates. Fragment rows start at multiples of 8, so a lane's row & 7 is
  // lane & 7 and its swizzle term is the same for every fragment.
  const int l7 = lane & 7, lhi = lane >> 4, lmid = (lane >> 3) & 1;
  // B^T fragment (16 n x 16 k): matrices (n0-7,k0-7) (n8-15,k0-7) (n0-7,k8-15) (n8-15,k8-15).
  const u32 b_row = B_KMAJOR ? (u32)((warp * 16 + l7 + lmid * 8) * BK * 2) : (u32)((l7 + lhi * 8) * BN * 2);
  // A^T fragments (16 k x 8 m), two m8 tiles per x4: (m0-7,k0-7) (m0-7,k8-15) (m8-15,k0-7) (m8-15,k8-15).
  const u32 a_row = (u32)((l7 + (FM == 2 ? lhi * 8 : 0)) * BK * 2);

  u32* wsu = reinterpret_cast<u32*>(ws);
  u64* counters = ws;
  float* partials = reinterpret_cast<float*>(wsu + ((NT * L * 2 + 3) & ~(i64)3));  // 16-byte aligned
  const u32 tag = launch_tag(epoch);

  float acc[FM][4], first_acc[FM][4];
#pragma unroll
  for (int j = 0; j < FM; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = first_acc[j][e] = 0.f;
  bool pub_first = false, pub_last = false, last_is_first = false;
  i64 first_tile = 0;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (first + s < last) load_step(s);
    cp_async_commit();
  }
  i64 seg_begin = first;
  i64 tile = first / KT;             // the tile of step `it`
  i64 tile_end = (tile + 1) * KT;    // its first step past the end
  int slot = 0;
  for (i64 it = first; it < last; ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    {
      const i64 pre = it + STAGES - 1;  // refills the slot computed in the previous step
      if (pre < last) load_step((slot + STAGES - 1) % STAGES);
      cp_async_commit();
    }
    const u32 sB = ring + slot * P::kStage, sA = sB + P::kB;
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      u32 bf[4], af[FM][2];
      if (B_KMAJOR) {
        ldsm_x4(sB + b_row + (u32)((((kk * 2 + lhi) ^ l7)) * 16), bf[0], bf[1], bf[2], bf[3]);
      } else {
        ldsm_x4_trans(sB + b_row + (u32)(kk * 16 * BN * 2) + (u32)(((warp * 2 + lmid) ^ l7) * 16), bf[0], bf[1],
                      bf[2], bf[3]);
      }
      const u32 achunk = (u32)(((kk * 2 + lmid) ^ l7) * 16);
      if (FM == 2)
        ldsm_x4(sA + a_row + achunk, af[0][0], af[0][1], af[FM - 1][0], af[FM - 1][1]);
      else
        ldsm_x2(sA + a_row + achunk, af[0][0], af[0][1]);
#pragma unroll
      for (int j = 0; j < FM; ++j) mma16816<DT>(acc[j], bf, af[j]);
    }
    if (++slot == STAGES) slot = 0;

    if (it + 1 != last && it + 1 != tile_end) continue;  // the segment goes on

    // ---- the segment [seg_begin, it] of `tile` is done ------------------------------------------
    const i64 tile_begin = tile_end - KT;
    const bool whole = seg_begin == tile_begin && it + 1 == tile_end;
    const bool own_first = seg_begin == first;
    const i64 seg_tile = tile;
    seg_begin = it + 1;
    ++tile;
    tile_end += KT;
    if (!whole) {
      // A partial is parked only after the last step (no copies in flight then, so the
      // fences before the hand-off wait for nothing): the first in registers, the last in acc.
      if (own_first && it + 1 != last) {
#pragma unroll
        for (int j = 0; j < FM; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            first_acc[j][e] = acc[j][e];
            acc[j][e] = 0.f;
          }
      }
      if (own_first) {
        pub_first = true;
        first_tile = seg_tile;
      } else {
        pub_last = true;  // a partial that is not the CTA's first ends its range
      }
      if (own_first && it + 1 == last) last_is_first = true;
      continue;
    }
    {  // a whole tile: stage it as [m][n] f32, store 16 bytes per thread
      const int g = lane >> 2, t = lane & 3;
#pragma unroll
      for (int j = 0; j < FM; ++j) {
        const int n = warp * 16 + g, m = j * 8 + 2 * t;
        stage_out[m * PS + n] = acc[j][0];
        stage_out[(m + 1) * PS + n] = acc[j][1];
        stage_out[m * PS + n + 8] = acc[j][2];
        stage_out[(m + 1) * PS + n + 8] = acc[j][3];
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
      }
    }
    __syncthreads();
    const i64 l = seg_tile / NT, nt = seg_tile - l * NT;
    const int n0 = (int)nt * BN;
    u16* out_l = out + l * batch_o;
    for (int x = tid; x < rows * NCH; x += T) {
      const int m = x / NCH, q = x - m * NCH, n = n0 + q * 8;
      if (n < N) {
        const float4 lo = *reinterpret_cast<const float4*>(stage_out + m * PS + q * 8);
        const float4 hi = *reinterpret_cast<const float4*>(stage_out + m * PS + q * 8 + 4);
        st_global16(out_l + (i64)m * ldo + n, pack2<DT>(lo.x, lo.y), pack2<DT>(lo.z, lo.w), pack2<DT>(hi.x, hi.y),
                    pack2<DT>(hi.z, hi.w));
      }
    }
    __syncthreads();  // stage_out is read before the next whole tile writes it
  }
  cp_async_wait<0>();
  if (!pub_first && !pub_last) return;

  // ---- hand-off: park the partials (slot 0: the first segment, slot 1: the last), count them
  // at their tiles' counters; a tile's last arrival sums all its partials in CTA order. -----------
  const int g = lane >> 2, t = lane & 3;
  auto park = [&](const float (&v)[FM][4], int s) {
    float* dst = partials + (c * 2 + s) * (MP * BN);
#pragma unroll
    for (int j = 0; j < FM; ++j) {
      const int n = warp * 16 + g, m = j * 8 + 2 * t;
      st_cg_f32(dst + m * BN + n, v[j][0]);
      st_cg_f32(dst + (m + 1) * BN + n, v[j][1]);
      st_cg_f32(dst + m * BN + n + 8, v[j][2]);
      st_cg_f32(dst + (m + 1) * BN + n + 8, v[j][3]);
    }
  };
  if (pub_first) {
    if (last_is_first)
      park(acc, 0);
    else
      park(first_acc, 0);
  }
  if (pub_last) park(acc, 1);
  __threadfence();
  __syncthreads();
  const i64 last_tile = (last - 1) / KT;
  if (tid == 0) {
    for (int s = 0; s < 2; ++s) {
      int finish = 0;
      if (s == 0 ? pub_first : pub_last) {
        const i64 tl = s == 0 ? first_tile : last_tile;
        const i64 c_first = cta_of(tl * KT, I, G), c_last = cta_of(tl * KT + KT - 1, I, G);
        const u32 arrived = arrive_at(counters + tl, tag);
        finish = arrived == (u32)(c_last - c_first + 1);
        if (finish) st_relaxed_u64(counters + tl, 0);  // every arrival of this launch is in
      }
      last_flag[s] = finish;
    }
  }
  __syncthreads();
  for (int s = 0; s < 2; ++s) {
    if (!last_flag[s]) continue;
    __threadfence();
    const i64 tl = s == 0 ? first_tile : last_tile, tile_begin = tl * KT;
    const i64 c_first = cta_of(tile_begin, I, G), c_last = cta_of(tile_begin + KT - 1, I, G);
    const i64 l = tl / NT, nt = tl - l * NT;
    const int n0 = (int)nt * BN;
    u16* out_l = out + l * batch_o;
    for (int x = tid; x < rows * NCH; x += T) {
      const int m = x / NCH, q = x - m * NCH, n = n0 + q * 8;
      if (n >= N) continue;
      float4 lo = make_float4(0.f, 0.f, 0.f, 0.f), hi = lo;
      for (i64 p = c_first; p <= c_last; ++p) {
        // CTA p's segment of this tile is its first (slot 0) unless p began in an earlier tile.
        const float* src = partials + (p * 2 + (begin_of(p, I, G) < tile_begin ? 1 : 0)) * (MP * BN) + m * BN + q * 8;
        const float4 a = ld_cg_f4(src), b = ld_cg_f4(src + 4);
        lo.x += a.x; lo.y += a.y; lo.z += a.z; lo.w += a.w;
        hi.x += b.x; hi.y += b.y; hi.z += b.z; hi.w += b.w;
      }
      st_global16(out_l + (i64)m * ldo + n, pack2<DT>(lo.x, lo.y), pack2<DT>(lo.z, lo.w), pack2<DT>(hi.x, hi.y),
                  pack2<DT>(hi.z, hi.w));
    }
  }
}

}  // namespace ka_gemm_decode
