// f64 GEMM on Hopper's FP64 tensor cores: out[M, N] = A[M, K] @ B[K, N] (per batch), sm_90
// (mma.sync m16n8k8 .f64). Self-contained (no toolkit headers) so NVRTC compiles it anywhere.
//
// Why this design (docs/performance.md, "f64 and f32 GEMM"): the CuTe DSL f64 kernel ran at 70 % of the DMMA
// pipe with its L1/shared-memory pipe 85 % busy (ncu, H200, 2048^3), from bank conflicts and
// 8-byte global->shared copies of K-major operands; cuBLAS's DGEMM (128x64x16 tiles, 4 warps,
// m16n8k8, 3 stages, 2 CTAs per SM) keeps shared memory 38 % busy at 91 %. Here:
//
//  * Every global->shared copy is a 16-byte cp.async along the operand's contiguous dimension
//    (K-major or M/N-major), so each warp instruction moves whole 128-byte lines; chunks past
//    M, N or K are zero-filled (src size 0 or 8 bytes, so odd extents need no padding copy).
//    Interior tiles copy without bounds checks, from a base pointer plus constant strides.
//  * Shared tiles are XOR-swizzled in 16-byte chunks (see swz) so that the 16-byte copies and
//    the 8-byte fragment loads (each straight into the DMMA's operand registers: no moves)
//    are free of bank conflicts; the fragment addresses are lane constants plus immediates.
//  * mma.sync m16n8k8 .f64 (as cuBLAS), a warp tile of 64 x 32 (128 x 64 / 2 x 2 warps).
//  * A multistage cp.async ring (STAGES), one __syncthreads per BK-deep k tile (16); with 128
//    threads and 2 CTAs per SM one CTA's barrier is hidden by the other's DMMAs.
//  * gemm_f64_ws (0.95-0.99x cuBLAS where the kernel above ran at 0.89x): the same
//    copies, swizzle and fragments, but a producer warpgroup issues the copies and the consumer
//    warps wait per ring slot on mbarriers instead of meeting at a block barrier every k tile.
//  * Stream-K over a last wave at most a quarter full (the Python side plans it):
//    its tiles' k ranges are split over the wave's CTAs, which store partial sums that
//    gemm_f64_split_reduce adds up in a fixed order. At 8192^3 the 32nd wave held 4 tiles on
//    132 SMs; split, the instances ran 1.4-2 % faster.
//  * Knobs measured against the defaults (none beat them by more
//    than 1 %): BK 32, MMA_K 16 (m16n8k16: half the DMMA instructions), and COPY_AT, where in
//    a k tile the next stage's copies issue.
//  * CTAs walk the (M tiles, N tiles) grid in groups of GROUP_M row tiles, so a wave's A and
//    B tiles stay in L2.
//
// Layouts: A_KMAJOR: A(m, k) at A[m * lda + k] (row-major) else A[k * lda + m]; B_KMAJOR:
// B(k, n) at B[n * ldb + k] (column-major) else B[k * ldb + n]; O_NMAJOR: out(m, n) at
// out[m * ldo + n] (row-major) else out[n * ldo + m]. The interface guarantees 16-byte aligned
// base pointers of A and B, even leading dimensions and batch strides (COPY8: 8-byte aligned
// bases, any leading dimension and batch stride); out_vec says whether
// out takes 16-byte stores (else 8-byte). Batches run on gridDim.y.

namespace ka_gemm_f64 {

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared; src_bytes < 16 zero-fills the rest without reading past src + src_bytes.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// 8 bytes (one element; the variant for operands 8-byte aligned only): cp.async takes 8-byte
// copies through L1 (.ca) only.
__device__ __forceinline__ void cp_async8(u32 dst, const void* src, u32 src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ double lds64(u32 addr) {
  double a;
  asm volatile("ld.shared.f64 %0, [%1];\n" : "=d"(a) : "r"(addr));
  return a;
}

// mbarriers of the warp-specialized kernel (shared::cta, one phase per ring pass).
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives on `bar` once every cp.async this thread issued so far has landed (the count set at
// init includes this arrival: .noinc).
__device__ __forceinline__ void cp_async_arrive(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  u32 done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// D = A(16x8) B(8x8) + D. a[v]: row g + 8 (v % 2), k t + 4 (v / 2); b[v]: k t + 4 v, column g;
// d[v]: row g + 8 (v / 2), column 2t + v % 2 (g = lane / 4, t = lane % 4).
__device__ __forceinline__ void dmma1688(double* d, const double* a, const double* b) {
  asm(  // not volatile: a pure function of its registers, so the compiler may schedule it
      "mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
      : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
}

// D = A(16x16) B(16x8) + D: the k8 fragments extended along k (a[v]: k t + 4 (v / 2); b[v]:
// k t + 4 v), half the instructions per flop.
__device__ __forceinline__ void dmma16816(double* d, const double* a, const double* b) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5, %6, %7, %8, %9, %10, %11}, "
      "{%12, %13, %14, %15}, {%0, %1, %2, %3};\n"
      : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
      : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]), "d"(b[0]),
        "d"(b[1]), "d"(b[2]), "d"(b[3]));
}

template <int MMA_K>
__device__ __forceinline__ void dmma(double* d, const double* a, const double* b) {
  if (MMA_K == 16)
    dmma16816(d, a, b);
  else
    dmma1688(d, a, b);
}

// Shared tiles, one per operand and ring slot, rows of 16-byte chunks:
//   K-major: a row per m (n), 16 k = 8 chunks;  chunk ^= 2 (row & 3)
//   M/N-major: a row per k, EXT m (n);          chunk ^= 2 (k & 3)
// A half-warp's fragment loads (rows g = 0..3 or 4..7, k t = 0..3, one 8-byte value each)
// then fall on 16 different 8-byte bank pairs: the XOR puts the four rows (k) into four
// different chunk pairs. The 16-byte copies write whole rows, conflict-free under any XOR.
template <int EXT, bool KMAJOR, int BK>
__device__ __forceinline__ u32 swz(int row, int col) {
  const int chunk = col >> 1;
  const int x = (row & 3) << 1;  // row: m/n (K-major) or k (M/N-major)
  return (u32)((row * (KMAJOR ? BK : EXT) + ((chunk ^ x) << 1) + (col & 1)) * 8);
}

// Per-thread copy plan of one operand tile: the thread's chunks are rows r0, r0 + STEP, ...
// (K-major: rows m/n, chunk kc; M/N-major: rows k, chunk at m/n mc), so global and shared
// addresses of chunk i are a base plus i times a stride.
template <int EXT, bool KMAJOR, int THREADS, int BK>
struct CopyPlan {
  static constexpr int PER_ROW = KMAJOR ? BK / 2 : EXT / 2;  // chunks per row
  // Threads that copy: whole rows' worth (a 96-wide M/N-major tile has 48 chunks per row, so
  // 96 of 128 threads copy it), each its chunks STEP rows apart.
  static constexpr int ACTIVE = THREADS / PER_ROW * PER_ROW;
  static constexpr int STEP = ACTIVE / PER_ROW;            // rows between a thread's chunks
  static constexpr int COUNT = EXT * BK / 2 / ACTIVE;      // chunks per copying thread
  static_assert(PER_ROW <= THREADS && (EXT * BK / 2) % ACTIVE == 0, "tile chunks must spread evenly");
  int r0, c0;  // first row, element offset in the row
  bool active;
  __device__ __forceinline__ CopyPlan(int tid) {
    r0 = tid / PER_ROW;
    c0 = (tid % PER_ROW) * 2;
    active = ACTIVE == THREADS || tid < ACTIVE;
  }
  // Byte offset of chunk i in the tile (STEP % 4 == 0 keeps the row XOR: a constant stride).
  __device__ __forceinline__ u32 dst(int i) const { return swz<EXT, KMAJOR, BK>(r0 + i * STEP, c0); }
};

// Copy one operand tile of k tile `k0`: `src` is the operand, `mn0` the tile's first m (n).
// Threads past the plan's ACTIVE copy nothing.
// Interior tiles (FULL) copy without bounds checks; edge tiles zero-fill past mn_ext and K.
// COPY8: each 16-byte chunk as two 8-byte copies, for operands whose base or leading
// dimension is not 16-byte aligned (odd leading dimensions); the shared layout is the same.
template <int EXT, bool KMAJOR, int THREADS, int BK, bool FULL, bool COPY8>
__device__ __forceinline__ void load_tile(u32 dst, const double* __restrict__ src, i64 ld, int mn0, int mn_ext,
                                          int k0, int K, const CopyPlan<EXT, KMAJOR, THREADS, BK>& plan) {
  using P = CopyPlan<EXT, KMAJOR, THREADS, BK>;
  if (!plan.active) return;
  const int mn = KMAJOR ? mn0 + plan.r0 : mn0 + plan.c0;
  const int k = KMAJOR ? k0 + plan.c0 : k0 + plan.r0;
  const double* p = src + (KMAJOR ? (i64)mn * ld + k : (i64)k * ld + mn);
  const i64 step = (i64)P::STEP * ld;
#pragma unroll
  for (int i = 0; i < P::COUNT; ++i) {
    const u32 d = dst + plan.dst(i);
    if (FULL) {
      if (COPY8) {
        cp_async8(d, p + i * step, 8u);
        cp_async8(d + 8, p + i * step + 1, 8u);
      } else {
        cp_async16(d, p + i * step, 16u);
      }
    } else {
      int valid;
      if (KMAJOR)
        valid = (mn + i * P::STEP < mn_ext) ? min(max(K - k, 0), 2) : 0;
      else
        valid = (k + i * P::STEP < K) ? min(max(mn_ext - mn, 0), 2) : 0;
      if (COPY8) {  // (elements past the edge: zero-filled, nothing read)
        cp_async8(d, valid > 0 ? p + i * step : src, valid > 0 ? 8u : 0u);
        cp_async8(d + 8, valid > 1 ? p + i * step + 1 : src, valid > 1 ? 8u : 0u);
      } else {
        cp_async16(d, valid ? p + i * step : src, (u32)(valid * 8));
      }
    }
  }
}

// Byte offsets of a lane's fragment values within a tile, for fragment row (m or n)
// `row0` + 8 u (u = 0, 1, ... as an immediate) and k `kk` + t (kk = 0, 4, 8, 12): the
// lane-constant parts are computed once; the rest folds into the loads' immediates.
template <int EXT, bool KMAJOR, int BK>
struct FragPlan {
  static constexpr int VARS = KMAJOR ? BK / 4 : 2;
  u32 base;        // lane's offset for u = 0, kk = 0
  u32 var[VARS];   // K-major: by kk / 4 (the k chunk meets the row XOR); M/N-major: by u & 1
  __device__ __forceinline__ FragPlan(int row0, int t) {
    if (KMAJOR) {
      // row0 & 3 is the lane's g & 3 for every u (row0 + 8 u), so the XOR is lane-constant.
      base = (u32)(row0 * BK * 8);
#pragma unroll
      for (int q = 0; q < VARS; ++q) var[q] = swz<EXT, true, BK>(row0, 4 * q + t) - base;
    } else {
      base = (u32)(t * EXT * 8);  // k row t (kk adds 4 rows: the same k & 3)
#pragma unroll
      for (int q = 0; q < VARS; ++q) var[q] = swz<EXT, false, BK>(t, row0 + 8 * q) - base;
    }
  }
  __device__ __forceinline__ u32 at(int u, int kk) const {
    if (KMAJOR) return base + (u32)(u * 8 * BK * 8) + var[kk >> 2];
    return base + (u32)(kk * EXT * 8) + (u32)((u >> 1) * 16 * 8) + var[u & 1];
  }
};

// A warp's share of the block tile: FM x FN DMMA tiles whose fragments (A rows a_row0 + 16 i
// [+8], B columns b_row0 + 8 j) load from a ring slot's shared tiles, one MMA_K-deep k step
// at a time.
template <int BM, int BN, bool A_KMAJOR, bool B_KMAJOR, int BK, int MMA_K, int FM, int FN>
struct WarpMma {
  struct Frags {
    double a[FM][MMA_K / 2];
    double b[FN][MMA_K / 4];
  };
  FragPlan<BM, A_KMAJOR, BK> a_frag;
  FragPlan<BN, B_KMAJOR, BK> b_frag;
  __device__ __forceinline__ WarpMma(int a_row0, int b_row0, int t) : a_frag(a_row0, t), b_frag(b_row0, t) {}
  __device__ __forceinline__ void load(u32 a_base, u32 b_base, int k0, Frags& f) const {
#pragma unroll
    for (int j = 0; j < FN; ++j)
#pragma unroll
      for (int v = 0; v < MMA_K / 4; ++v) f.b[j][v] = lds64(b_base + b_frag.at(j, k0 + 4 * v));
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
      for (int v = 0; v < MMA_K / 2; ++v) f.a[i][v] = lds64(a_base + a_frag.at(2 * i + v % 2, k0 + 4 * (v / 2)));
  }
  __device__ __forceinline__ void mma(double (&acc)[FM][FN][4], const Frags& f) const {
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
      for (int j = 0; j < FN; ++j) dmma<MMA_K>(acc[i][j], f.a[i], f.b[j]);
  }
};

template <int FM, int FN>
__device__ __forceinline__ void zero_acc(double (&acc)[FM][FN][4]) {
#pragma unroll
  for (int i = 0; i < FM; ++i)
#pragma unroll
    for (int j = 0; j < FN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0;
}

// The output tile's grid position (grouped raster): GROUP_M row tiles per band, the band's
// tiles column by column, so a wave's A and B tiles stay in L2.
template <int BM, int BN, int GROUP_M>
__device__ __forceinline__ void tile_origin(int pid, int M, int N, int& m0, int& n0) {
  const int m_tiles = (M + BM - 1) / BM, n_tiles = (N + BN - 1) / BN;
  const int band = pid / (GROUP_M * n_tiles);
  const int first_m = band * GROUP_M;
  const int band_rows = min(m_tiles - first_m, GROUP_M);
  const int in_band = pid - band * GROUP_M * n_tiles;
  m0 = (first_m + in_band % band_rows) * BM;
  n0 = (in_band / band_rows) * BN;
}

// Epilogue: a warp's accumulators (FM x FN DMMA tiles from (wm0, wn0)); each lane owns (row g
// [+8], columns 2t, 2t + 1) of every 16x8 tile.
template <bool O_NMAJOR, int FM, int FN>
__device__ __forceinline__ void store_acc(const double (&acc)[FM][FN][4], double* __restrict__ out, int wm0, int wn0,
                                          int M, int N, i64 ldo, bool out_vec, int g, int t) {
#pragma unroll
  for (int i = 0; i < FM; ++i)
#pragma unroll
    for (int j = 0; j < FN; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = wm0 + 16 * i + 8 * h + g;
        const int n = wn0 + 8 * j + 2 * t;
        if (m >= M) continue;
        const double v0 = acc[i][j][2 * h], v1 = acc[i][j][2 * h + 1];
        if (O_NMAJOR) {
          double* p = out + (i64)m * ldo + n;
          if (out_vec && n + 1 < N) {
            asm volatile("st.global.v2.f64 [%0], {%1, %2};" ::"l"(p), "d"(v0), "d"(v1) : "memory");
          } else {
            if (n < N) p[0] = v0;
            if (n + 1 < N) p[1] = v1;
          }
        } else {
          if (n < N) out[(i64)n * ldo + m] = v0;
          if (n + 1 < N) out[(i64)(n + 1) * ldo + m] = v1;
        }
      }
}

template <bool A_KMAJOR, bool B_KMAJOR, bool O_NMAJOR, int BM, int BN, int WM, int WN, int STAGES, int MIN_CTAS,
          bool PREFETCH, int GROUP_M, int BK = 16, int MMA_K = 8, int COPY_AT = 0, bool COPY8 = false>
__global__ void __launch_bounds__(WM * WN * 32, MIN_CTAS)
    gemm_f64(const double* __restrict__ A, const double* __restrict__ B, double* __restrict__ out, i64 M_, i64 N_,
             i64 K_, i64 lda, i64 ldb, i64 ldo, i64 batch_a, i64 batch_b, i64 batch_o, i64 out_vec) {
  constexpr int THREADS = WM * WN * 32;
  constexpr int TM = BM / WM, TN = BN / WN;  // warp tile
  constexpr int FM = TM / 16, FN = TN / 8;   // DMMA tiles per warp
  constexpr int A_STAGE = BM * BK * 8, B_STAGE = BN * BK * 8;  // bytes
  static_assert(TM % 16 == 0 && TN % 8 == 0, "warp tile must be whole DMMA tiles");
  static_assert(A_KMAJOR || BM >= 16, "M-major rows need >= 8 chunks");
  static_assert(B_KMAJOR || BN >= 16, "N-major rows need >= 8 chunks");
  static_assert((MMA_K == 8 || MMA_K == 16) && BK % MMA_K == 0, "k tile must be whole DMMA steps");
  static_assert(!PREFETCH || BK == 2 * MMA_K, "the prefetching loop runs two steps per k tile");

  extern __shared__ __align__(128) unsigned char smem[];
  const u32 sA = smem_u32(smem);
  const u32 sB = sA + STAGES * A_STAGE;

  const int M = (int)M_, N = (int)N_, K = (int)K_;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp / WN, wn = warp % WN;

  int m0, n0;
  tile_origin<BM, BN, GROUP_M>(blockIdx.x, M, N, m0, n0);

  A += (i64)blockIdx.y * batch_a;
  B += (i64)blockIdx.y * batch_b;
  out += (i64)blockIdx.y * batch_o;

  double acc[FM][FN][4];
  zero_acc(acc);

  const CopyPlan<BM, A_KMAJOR, THREADS, BK> a_copy(tid);
  const CopyPlan<BN, B_KMAJOR, THREADS, BK> b_copy(tid);
  const bool interior_mn = m0 + BM <= M && n0 + BN <= N;
  const int ktiles = (K + BK - 1) / BK;
  const int full_ktiles = interior_mn ? K / BK : 0;  // k tiles copied without bounds checks
  auto load_stage = [&](int kt) {
    const int slot = kt % STAGES;
    if (kt < full_ktiles) {
      load_tile<BM, A_KMAJOR, THREADS, BK, true, COPY8>(sA + slot * A_STAGE, A, lda, m0, M, kt * BK, K, a_copy);
      load_tile<BN, B_KMAJOR, THREADS, BK, true, COPY8>(sB + slot * B_STAGE, B, ldb, n0, N, kt * BK, K, b_copy);
    } else {
      load_tile<BM, A_KMAJOR, THREADS, BK, false, COPY8>(sA + slot * A_STAGE, A, lda, m0, M, kt * BK, K, a_copy);
      load_tile<BN, B_KMAJOR, THREADS, BK, false, COPY8>(sB + slot * B_STAGE, B, ldb, n0, N, kt * BK, K, b_copy);
    }
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s);
    cp_async_commit();
  }

  // Fragment rows: A's m wm TM + g (+ 16 i + 8 h), B's n wn TN + g (+ 8 j).
  const WarpMma<BM, BN, A_KMAJOR, B_KMAJOR, BK, MMA_K, FM, FN> warp_mma(wm * TM + g, wn * TN + g, t);
  using Frags = typename decltype(warp_mma)::Frags;
  auto load_frags = [&](int slot, int k0, Frags& f) { warp_mma.load(sA + slot * A_STAGE, sB + slot * B_STAGE, k0, f); };
  auto mma_step = [&](const Frags& f) { warp_mma.mma(acc, f); };

  if (PREFETCH) {
    // The next step's fragments load while this step's DMMAs run: step 1 of a tile from the
    // same slot, step 0 of the next tile right after the barrier that makes it visible
    // (taken before the last step, whose fragments are already in registers, so the slot
    // the barrier frees is the current one).
    Frags f0, f1;
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (STAGES - 1 < ktiles) load_stage(STAGES - 1);
    cp_async_commit();
    if (ktiles > 0) load_frags(0, 0, f0);
    for (int kt = 0; kt < ktiles; ++kt) {
      load_frags(kt % STAGES, MMA_K, f1);
      mma_step(f0);
      if (kt + 1 < ktiles) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile kt + 1 landed; every thread holds tile kt's fragments
        if (kt + STAGES < ktiles) load_stage(kt + STAGES);
        cp_async_commit();
        load_frags((kt + 1) % STAGES, 0, f0);
      }
      mma_step(f1);
    }
  } else {
    // COPY_AT: where the next stage's copies issue within a k tile: 0 right after the barrier,
    // 1 after the first step's fragment loads (their latency under the copies' issue), 2 after
    // the first step's DMMAs.
    for (int kt = 0; kt < ktiles; ++kt) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // tile kt landed for every thread; slot (kt - 1) % STAGES is free
      auto issue_copies = [&]() {
        if (kt + STAGES - 1 < ktiles) load_stage(kt + STAGES - 1);
        cp_async_commit();
      };
      if (COPY_AT == 0) issue_copies();
#pragma unroll
      for (int k0 = 0; k0 < BK; k0 += MMA_K) {
        Frags f;
        load_frags(kt % STAGES, k0, f);
        if (k0 == 0 && COPY_AT == 1) issue_copies();
        mma_step(f);
        if (k0 == 0 && COPY_AT == 2) issue_copies();
      }
    }
  }
  cp_async_wait<0>();

  store_acc<O_NMAJOR, FM, FN>(acc, out, m0 + wm * TM, n0 + wn * TN, M, N, ldo, out_vec != 0, g, t);
}

// Warp-specialized variant: a producer warpgroup issues every copy and signals each ring slot's
// arrival on an mbarrier (cp.async.mbarrier.arrive), and the WM x WN consumer warps (whole
// warpgroups) wait only for the slot they read and release it on a second mbarrier. No block-wide
// barrier per k tile and no copy instructions among the DMMAs; the producers hand their
// registers to the consumers (setmaxnreg), which keep the single-barrier kernel's budget.
// PREFETCH: a k step's fragments load while the previous step's DMMAs run, across tiles too.
// PRODUCER_REGS: the producers' registers (0: by CTAs per SM, below).
template <int CONSUMERS, int MIN_CTAS, int PRODUCER_REGS = 0>
struct WsRegs {
  static constexpr int THREADS = 128 + CONSUMERS;  // a producer warpgroup and the consumers
  static constexpr int LAUNCH = (65536 / (THREADS * MIN_CTAS)) & ~7;
  // the producers' registers: the fewest without spills (ptxas -v, sm_90a), the rest to the
  // consumers; a copy plan with rows of 48 or 96 chunks (96- or 192-wide M/N-major tiles)
  // needs more than the power-of-two tiles' plans
  static constexpr int PRODUCER = PRODUCER_REGS ? PRODUCER_REGS : MIN_CTAS == 1 ? 56 : MIN_CTAS == 2 ? 40 : 24;
  static constexpr int C = ((LAUNCH * THREADS - 128 * PRODUCER) / CONSUMERS) & ~7;
  static constexpr int CONSUMER = C > 248 ? 248 : C;
};

template <bool A_KMAJOR, bool B_KMAJOR, bool O_NMAJOR, int BM, int BN, int WM, int WN, int STAGES, int MIN_CTAS,
          bool PREFETCH, int GROUP_M, int BK = 16, int MMA_K = 8, int PRODUCER_REGS = 0, bool COPY8 = false>
__global__ void __launch_bounds__(WsRegs<WM * WN * 32, MIN_CTAS, PRODUCER_REGS>::THREADS, MIN_CTAS)
    gemm_f64_ws(const double* __restrict__ A, const double* __restrict__ B, double* __restrict__ out, i64 M_, i64 N_,
                i64 K_, i64 lda, i64 ldb, i64 ldo, i64 batch_a, i64 batch_b, i64 batch_o, i64 out_vec,
                double* __restrict__ partial, i64 tile_base, i64 splits) {
  constexpr int GROUP = 128;  // threads of a warpgroup: the producers
  constexpr int CONSUMERS = WM * WN * 32;
  using Regs = WsRegs<CONSUMERS, MIN_CTAS, PRODUCER_REGS>;
  constexpr int TM = BM / WM, TN = BN / WN;
  constexpr int FM = TM / 16, FN = TN / 8;
  constexpr int A_STAGE = BM * BK * 8, B_STAGE = BN * BK * 8;
  static_assert(CONSUMERS % GROUP == 0, "the consumers are whole warpgroups");
  static_assert(TM % 16 == 0 && TN % 8 == 0, "warp tile must be whole DMMA tiles");
  static_assert((MMA_K == 8 || MMA_K == 16) && BK % MMA_K == 0, "k tile must be whole DMMA steps");
  static_assert(!PREFETCH || (BK / MMA_K) % 2 == 0, "the prefetching loop alternates two fragment sets per tile");

  extern __shared__ __align__(128) unsigned char smem[];
  const u32 sA = smem_u32(smem);
  const u32 sB = sA + STAGES * A_STAGE;
  const u32 full = sB + STAGES * B_STAGE;  // STAGES mbarriers: slot landed
  const u32 empty = full + STAGES * 8;     // STAGES mbarriers: slot read by every consumer

  const int M = (int)M_, N = (int)N_, K = (int)K_;
  const int tid = threadIdx.x;
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + 8 * s, GROUP);
      mbar_init(empty + 8 * s, CONSUMERS);
    }
  }
  __syncthreads();

  // Stream-K over a last partial wave (splits > 0, one batch): CTA tile_base + u takes the k
  // range u % splits (of `splits` even parts) of tile tile_base + u / splits and stores its
  // partial sums to `partial`, which gemm_f64_split_reduce adds up in a fixed order. The
  // earlier CTAs each compute a whole tile, as without splits.
  const int all_ktiles = (K + BK - 1) / BK;
  const bool split_cta = splits > 0 && (i64)blockIdx.x >= tile_base;
  int tile = blockIdx.x, k_first = 0, ktiles = all_ktiles;
  if (split_cta) {
    const int unit = blockIdx.x - (int)tile_base, part = unit % (int)splits;
    tile = (int)tile_base + unit / (int)splits;
    k_first = (int)((i64)all_ktiles * part / splits);
    ktiles = (int)((i64)all_ktiles * (part + 1) / splits) - k_first;
  }
  int m0, n0;
  tile_origin<BM, BN, GROUP_M>(tile, M, N, m0, n0);
  A += (i64)blockIdx.y * batch_a;
  B += (i64)blockIdx.y * batch_b;
  out += (i64)blockIdx.y * batch_o;

  if (tid >= CONSUMERS) {  // producers: the last warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Regs::PRODUCER));
    const int ptid = tid - CONSUMERS;
    const CopyPlan<BM, A_KMAJOR, GROUP, BK> a_copy(ptid);
    const CopyPlan<BN, B_KMAJOR, GROUP, BK> b_copy(ptid);
    // The operands as seen from k_first (K shortened alike), so the loop needs no offset register.
    const i64 k_off = (i64)k_first * BK;
    A += A_KMAJOR ? k_off : k_off * lda;
    B += B_KMAJOR ? k_off : k_off * ldb;
    const int Kp = K - (int)k_off;
    const bool interior_mn = m0 + BM <= M && n0 + BN <= N;
    const int full_ktiles = interior_mn ? Kp / BK : 0;
    for (int kt = 0; kt < ktiles; ++kt) {
      const int slot = kt % STAGES;
      if (kt >= STAGES) mbar_wait(empty + 8 * slot, (u32)((kt / STAGES - 1) & 1));
      const u32 dA = sA + slot * A_STAGE, dB = sB + slot * B_STAGE;
      if (kt < full_ktiles) {
        load_tile<BM, A_KMAJOR, GROUP, BK, true, COPY8>(dA, A, lda, m0, M, kt * BK, Kp, a_copy);
        load_tile<BN, B_KMAJOR, GROUP, BK, true, COPY8>(dB, B, ldb, n0, N, kt * BK, Kp, b_copy);
      } else {
        load_tile<BM, A_KMAJOR, GROUP, BK, false, COPY8>(dA, A, lda, m0, M, kt * BK, Kp, a_copy);
        load_tile<BN, B_KMAJOR, GROUP, BK, false, COPY8>(dB, B, ldb, n0, N, kt * BK, Kp, b_copy);
      }
      cp_async_arrive(full + 8 * slot);
    }
    cp_async_wait<0>();  // no copy outlives its thread
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Regs::CONSUMER));
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp / WN, wn = warp % WN;
  double acc[FM][FN][4];
  zero_acc(acc);

  const WarpMma<BM, BN, A_KMAJOR, B_KMAJOR, BK, MMA_K, FM, FN> warp_mma(wm * TM + g, wn * TN + g, t);
  using Frags = typename decltype(warp_mma)::Frags;
  constexpr int STEPS = BK / MMA_K;
  auto base_a = [&](int kt) { return sA + (kt % STAGES) * A_STAGE; };
  auto base_b = [&](int kt) { return sB + (kt % STAGES) * B_STAGE; };
  auto wait_full = [&](int kt) { mbar_wait(full + 8 * (kt % STAGES), (u32)((kt / STAGES) & 1)); };
  if (PREFETCH) {
    Frags f[2];
    if (ktiles > 0) {
      wait_full(0);
      warp_mma.load(base_a(0), base_b(0), 0, f[0]);
    }
    for (int kt = 0; kt < ktiles; ++kt) {
#pragma unroll
      for (int s = 0; s < STEPS; ++s) {
        if (s + 1 < STEPS) {
          warp_mma.load(base_a(kt), base_b(kt), (s + 1) * MMA_K, f[(s + 1) & 1]);
        } else {
          mbar_arrive(empty + 8 * (kt % STAGES));  // every fragment of tile kt is loaded
          if (kt + 1 < ktiles) {
            wait_full(kt + 1);
            warp_mma.load(base_a(kt + 1), base_b(kt + 1), 0, f[(s + 1) & 1]);
          }
        }
        warp_mma.mma(acc, f[s & 1]);
      }
    }
  } else {
    for (int kt = 0; kt < ktiles; ++kt) {
      wait_full(kt);
#pragma unroll
      for (int s = 0; s < STEPS; ++s) {
        Frags f;
        warp_mma.load(base_a(kt), base_b(kt), s * MMA_K, f);
        if (s + 1 == STEPS) mbar_arrive(empty + 8 * (kt % STAGES));
        warp_mma.mma(acc, f);
      }
    }
  }
  // A stream-K CTA stores the whole tile's partial sums, laid out as out is (rows or columns of
  // the tile). Decided from the kernel's parameters here, so nothing extra stays live in the loop.
  const bool to_partial = splits > 0 && (i64)blockIdx.x >= tile_base;
  store_acc<O_NMAJOR, FM, FN>(acc, to_partial ? partial + ((i64)blockIdx.x - tile_base) * (BM * BN) : out,
                              (to_partial ? 0 : m0) + wm * TM, (to_partial ? 0 : n0) + wn * TN, to_partial ? BM : M,
                              to_partial ? BN : N, to_partial ? (O_NMAJOR ? BN : BM) : ldo, to_partial || out_vec != 0,
                              g, t);
}

// out's tiles tile_base + blockIdx.x from the `splits` partial tiles of each (gemm_f64_ws with
// splits), summed in split order (deterministic); blockIdx.y picks 256 of the tile's elements.
template <bool O_NMAJOR, int BM, int BN, int GROUP_M>
__global__ void __launch_bounds__(256)
    gemm_f64_split_reduce(const double* __restrict__ partial, double* __restrict__ out, i64 M_, i64 N_, i64 ldo,
                          i64 tile_base, i64 splits) {
  constexpr int FAST = O_NMAJOR ? BN : BM;  // the contiguous extent, in the partials and in out
  static_assert((BM * BN) % 256 == 0, "a tile is whole blocks of 256 elements");
  const int M = (int)M_, N = (int)N_;
  int m0, n0;
  tile_origin<BM, BN, GROUP_M>((int)tile_base + blockIdx.x, M, N, m0, n0);
  const int e = blockIdx.y * 256 + threadIdx.x;
  const int m = m0 + (O_NMAJOR ? e / FAST : e % FAST), n = n0 + (O_NMAJOR ? e % FAST : e / FAST);
  if (m >= M || n >= N) return;
  const double* p = partial + (i64)blockIdx.x * splits * (BM * BN) + e;
  double sum = 0.0;
  for (int s = 0; s < (int)splits; ++s) sum += p[(i64)s * (BM * BN)];
  out[O_NMAJOR ? (i64)m * ldo + n : (i64)n * ldo + m] = sum;
}

}  // namespace ka_gemm_f64
