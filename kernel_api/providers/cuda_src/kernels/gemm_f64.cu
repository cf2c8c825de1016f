// f64 GEMM on Hopper's FP64 tensor cores: out[M, N] = A[M, K] @ B[K, N] (per batch), sm_90
// (mma.sync m16n8k16 .f64). Self-contained (no toolkit headers) so NVRTC compiles it anywhere.
//
// Why this design (benchmarks/NOTES-f64.md): the CuTe DSL f64 kernel ran at 70 % of the DMMA
// pipe with its L1/shared-memory pipe 85 % busy (ncu, H200, 2048^3), from 8-byte fragment
// loads and 8-byte global->shared copies of K-major operands; cuBLAS's DGEMM
// (128x64x16 tiles, 4 warps, 3 stages, 2 CTAs per SM) keeps shared memory 38 % busy at 91 %.
// Here:
//
//  * Every global->shared copy is a 16-byte cp.async along the operand's contiguous dimension
//    (K-major or M/N-major), so each warp instruction moves whole 128-byte lines; chunks past
//    M, N or K are zero-filled (src size 0 or 8 bytes, so odd extents need no padding copy).
//  * The DMMA's k order is permuted: within each 16-deep k step, the instruction's k index
//    t + 4q (t = lane % 4, q = 0..3) is fed physical k 4t + q. The sum over k is the same, and
//    a lane's four A values of one row (and four B values of one column) are then 32
//    contiguous bytes: two 16-byte loads (LDS.128) from a K-major tile instead of four LDS.64.
//    M/N-major tiles are read with LDS.64 (the four k of a lane lie in four rows).
//  * Shared tiles are XOR-swizzled in 16-byte chunks, conflict-free for the 16-byte copies
//    and the fragment loads: K-major rows (16 f64 = 8 chunks) chunk ^= row & 7; M/N-major
//    rows (BM or BN f64) chunk ^= (k >> 1) & 6, which puts the 4 k rows a half-warp reads
//    into 4 different chunk pairs.
//  * A multistage cp.async ring (STAGES), one __syncthreads per 16-deep k tile; with 128
//    threads and 2 CTAs per SM one CTA's barrier is hidden by the other's DMMAs.
//  * CTAs walk the (M tiles, N tiles) grid in groups of GROUP_M row tiles, so a wave's A and
//    B tiles stay in L2.
//
// Layouts: A_KMAJOR: A(m, k) at A[m * lda + k] (row-major) else A[k * lda + m]; B_KMAJOR:
// B(k, n) at B[n * ldb + k] (column-major) else B[k * ldb + n]; O_NMAJOR: out(m, n) at
// out[m * ldo + n] (row-major) else out[n * ldo + m]. The interface guarantees 16-byte aligned
// base pointers of A and B, even leading dimensions and batch strides; out_vec says whether
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
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void lds128(u32 addr, double& a, double& b) {
  asm volatile("ld.shared.v2.f64 {%0, %1}, [%2];\n" : "=d"(a), "=d"(b) : "r"(addr));
}
__device__ __forceinline__ double lds64(u32 addr) {
  double a;
  asm volatile("ld.shared.f64 %0, [%1];\n" : "=d"(a) : "r"(addr));
  return a;
}

// D = A(16x16) B(16x8) + D. a[v]: row g + 8 (v % 2), k t + 4 (v / 2); b[v]: k t + 4 v, column g;
// d[v]: row g + 8 (v / 2), column 2t + v % 2 (g = lane / 4, t = lane % 4).
__device__ __forceinline__ void dmma16816(double* d, const double* a, const double* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5, %6, %7, %8, %9, %10, %11}, "
      "{%12, %13, %14, %15}, {%0, %1, %2, %3};\n"
      : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
      : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]), "d"(b[0]), "d"(b[1]),
        "d"(b[2]), "d"(b[3]));
}

// D = A(16x8) B(8x8) + D. a[v]: row g + 8 (v % 2), k t + 4 (v / 2); b[v]: k t + 4 v, column g;
// d as dmma16816.
__device__ __forceinline__ void dmma1688(double* d, const double* a, const double* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
      : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
}

// Byte offset of element (row, col) in a swizzled tile whose rows are CONTIG f64 long.
// K-major tiles: row = m or n, col = k (CONTIG = 16). M/N-major: row = k, col = m or n.
// The XOR terms make the fragment loads of MMA_K-deep steps conflict-free (see load_frag).
template <int CONTIG, bool KMAJOR, int MMA_K>
__device__ __forceinline__ u32 swz(int row, int col) {
  const int chunk = col >> 1;
  int s;
  if (KMAJOR)  // k16: a quarter-warp reads rows g, g + 1 at chunks 2t + p; k8: at chunks 4 step + t
    s = MMA_K == 16 ? (row & 7) : (((row & 1) << 2) | ((row >> 1) & 3));
  else  // a half-warp reads k rows 4t + q (k16) or 8 step + 2t + p (k8), 4 m/n pairs each
    s = MMA_K == 16 ? ((row >> 1) & 6) : (row & 6);
  return (u32)((row * CONTIG + ((chunk ^ s) << 1) + (col & 1)) * 8);
}

// Copy one operand tile (ROWS x COLS in the M/N x K sense) of k tile `k0` into shared memory.
// KMAJOR: global rows are m (or n), 16 k each; else global rows are k, EXT m (or n) each.
// `mn0`: the tile's first m (n); `mn_ext`, `K`: the operand's extents.
template <int EXT, bool KMAJOR, int THREADS, int MMA_K>
__device__ __forceinline__ void load_tile(u32 dst, const double* __restrict__ src, i64 ld, int mn0, int mn_ext,
                                          int k0, int K, int tid) {
  constexpr int BK = 16;
  constexpr int CHUNKS = EXT * BK / 2;
  static_assert(CHUNKS % THREADS == 0, "tile chunks must spread evenly over the threads");
#pragma unroll
  for (int i = 0; i < CHUNKS / THREADS; ++i) {
    const int c = tid + i * THREADS;
    if (KMAJOR) {
      const int r = c >> 3, kc = (c & 7) << 1;  // row r, k pair kc
      const int mn = mn0 + r, k = k0 + kc;
      const int valid = (mn < mn_ext) ? min(max(K - k, 0), 2) : 0;
      const double* p = valid ? src + (i64)mn * ld + k : src;
      cp_async16(dst + swz<BK, true, MMA_K>(r, kc), p, (u32)(valid * 8));
    } else {
      constexpr int PER_ROW = EXT / 2;
      const int r = c / PER_ROW, mc = (c % PER_ROW) << 1;  // k row r, m/n pair mc
      const int k = k0 + r, mn = mn0 + mc;
      const int valid = (k < K) ? min(max(mn_ext - mn, 0), 2) : 0;
      const double* p = valid ? src + (i64)k * ld + mn : src;
      cp_async16(dst + swz<EXT, false, MMA_K>(r, mc), p, (u32)(valid * 8));
    }
  }
}

// A lane's values of one operand row (m or n) for one MMA_K-deep step at k offset k0 of the
// tile. k16: physical k 4t .. 4t + 3, fed to the DMMA as its k t, t + 4, t + 8, t + 12;
// k8: physical k 2t, 2t + 1 as its k t, t + 4. K-major tiles: 16-byte loads of adjacent k.
template <int EXT, bool KMAJOR, int MMA_K>
__device__ __forceinline__ void load_frag(u32 base, int row, int k0, int t, double* v) {
  constexpr int PER = MMA_K / 4;  // values per lane and row
  if (KMAJOR) {
#pragma unroll
    for (int p = 0; p < PER; p += 2) lds128(base + swz<16, true, MMA_K>(row, k0 + PER * t + p), v[p], v[p + 1]);
  } else {
#pragma unroll
    for (int q = 0; q < PER; ++q) v[q] = lds64(base + swz<EXT, false, MMA_K>(k0 + PER * t + q, row));
  }
}

template <bool A_KMAJOR, bool B_KMAJOR, bool O_NMAJOR, int BM, int BN, int WM, int WN, int STAGES, int MIN_CTAS,
          int MMA_K, int GROUP_M>
__global__ void __launch_bounds__(WM * WN * 32, MIN_CTAS)
    gemm_f64(const double* __restrict__ A, const double* __restrict__ B, double* __restrict__ out, i64 M_, i64 N_,
             i64 K_, i64 lda, i64 ldb, i64 ldo, i64 batch_a, i64 batch_b, i64 batch_o, i64 out_vec) {
  constexpr int THREADS = WM * WN * 32;
  constexpr int BK = 16;
  constexpr int TM = BM / WM, TN = BN / WN;  // warp tile
  constexpr int FM = TM / 16, FN = TN / 8;   // DMMA tiles per warp
  constexpr int A_STAGE = BM * BK * 8, B_STAGE = BN * BK * 8;  // bytes
  static_assert(TM % 16 == 0 && TN % 8 == 0, "warp tile must be whole DMMA tiles");
  static_assert(A_KMAJOR || BM >= 16, "M-major rows need >= 8 chunks");
  static_assert(B_KMAJOR || BN >= 16, "N-major rows need >= 8 chunks");

  extern __shared__ __align__(128) unsigned char smem[];
  const u32 sA = smem_u32(smem);
  const u32 sB = sA + STAGES * A_STAGE;

  const int M = (int)M_, N = (int)N_, K = (int)K_;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp / WN, wn = warp % WN;

  // Grouped raster: GROUP_M row tiles per band, the band's tiles column by column.
  const int m_tiles = (M + BM - 1) / BM, n_tiles = (N + BN - 1) / BN;
  const int pid = blockIdx.x;
  const int band = pid / (GROUP_M * n_tiles);
  const int first_m = band * GROUP_M;
  const int band_rows = min(m_tiles - first_m, GROUP_M);
  const int in_band = pid - band * GROUP_M * n_tiles;
  const int m0 = (first_m + in_band % band_rows) * BM;
  const int n0 = (in_band / band_rows) * BN;

  A += (i64)blockIdx.y * batch_a;
  B += (i64)blockIdx.y * batch_b;
  out += (i64)blockIdx.y * batch_o;

  double acc[FM][FN][4];
#pragma unroll
  for (int i = 0; i < FM; ++i)
#pragma unroll
    for (int j = 0; j < FN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0;

  const int ktiles = (K + BK - 1) / BK;
  auto load_stage = [&](int kt) {
    const int slot = kt % STAGES;
    load_tile<BM, A_KMAJOR, THREADS, MMA_K>(sA + slot * A_STAGE, A, lda, m0, M, kt * BK, K, tid);
    load_tile<BN, B_KMAJOR, THREADS, MMA_K>(sB + slot * B_STAGE, B, ldb, n0, N, kt * BK, K, tid);
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s);
    cp_async_commit();
  }

  const int a_row = wm * TM + g;  // + 16 i + 8 h
  const int b_row = wn * TN + g;  // + 8 j
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile kt landed for every thread; slot (kt - 1) % STAGES is free
    if (kt + STAGES - 1 < ktiles) load_stage(kt + STAGES - 1);
    cp_async_commit();

    const int slot = kt % STAGES;
    const u32 a_base = sA + slot * A_STAGE, b_base = sB + slot * B_STAGE;
    constexpr int PER = MMA_K / 4;
#pragma unroll
    for (int k0 = 0; k0 < BK; k0 += MMA_K) {
      double fb[FN][PER];
#pragma unroll
      for (int j = 0; j < FN; ++j) load_frag<BN, B_KMAJOR, MMA_K>(b_base, b_row + 8 * j, k0, t, fb[j]);
#pragma unroll
      for (int i = 0; i < FM; ++i) {
        double lo[PER], hi[PER], fa[2 * PER];
        load_frag<BM, A_KMAJOR, MMA_K>(a_base, a_row + 16 * i, k0, t, lo);
        load_frag<BM, A_KMAJOR, MMA_K>(a_base, a_row + 16 * i + 8, k0, t, hi);
#pragma unroll
        for (int q = 0; q < PER; ++q) {
          fa[2 * q] = lo[q];
          fa[2 * q + 1] = hi[q];
        }
#pragma unroll
        for (int j = 0; j < FN; ++j) {
          if (MMA_K == 16)
            dmma16816(acc[i][j], fa, fb[j]);
          else
            dmma1688(acc[i][j], fa, fb[j]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // Epilogue: each lane owns (row g [+8], columns 2t, 2t + 1) of every 16x8 tile.
#pragma unroll
  for (int i = 0; i < FM; ++i)
#pragma unroll
    for (int j = 0; j < FN; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = m0 + wm * TM + 16 * i + 8 * h + g;
        const int n = n0 + wn * TN + 8 * j + 2 * t;
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

}  // namespace ka_gemm_f64
