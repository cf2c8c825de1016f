// Decode attention (flash-decoding): out = softmax(q k^T * scale + causal mask) v for few queries
// (seqlen_q <= 16) against a long KV cache, f16 / bf16 operands, f32 softmax and accumulation.
// Self-contained (no toolkit headers) so NVRTC compiles it anywhere. The interface,
// attention_decode.py, picks the template (MW, CL, BK, STAGES, MIN_CTAS) and the launch.
//
// Work. One CTA takes one (batch, KV head, row block, key split). The rows of a KV head are its
// group's queries, row r = query i * group + head g (seqlen_q x group rows: one K/V read serves
// all of them); a row block is 16 * MW of them. The keys [0, sk) of the block's batch row are
// cut into CL splits of ceil(ceil(sk / BK) / CL) whole BK-key chunks each (computed here from
// the row's own length, so a short row's keys still spread over every split); the CL CTAs of
// one row block form a thread-block cluster (sm_90) and merge their partial results through
// distributed shared memory, so the launch needs no workspace and no second kernel (a
// recorded launch replays it as it is).
//
// Inside a CTA: 4 warps, MW along the rows (16 each: one m16 tensor-core tile) and KW = 4 / MW
// along the keys of each chunk. K and V chunks stream through a STAGES-deep cp.async ring of
// swizzled shared memory (16-byte copies, rows past the split zero-filled); each warp computes
// S = Q K^T for its 16 rows and BK / KW keys with mma.sync m16n8k16 (f32 accumulate), the
// online softmax in registers (exp2 with scale * log2 e folded in), and O += P V with P
// converted to the operand type in registers. Tensor cores even for a single row: the 16-row
// tile wastes MMA slots, but at 16 FLOP per byte of K+V the tensor cores run far below their
// rate while CUDA-core FMAs would need most of theirs to keep up with HBM.
//
// Epilogue: the KW warps' partials (row max m, sum l, unnormalised O) merge in shared memory
// (f32); with CL > 1, after a cluster barrier each CTA of the cluster takes a share of the
// rows' outputs and merges the CL CTAs' partials read through DSMEM (in rank order:
// deterministic), a second barrier keeping every CTA's shared memory alive until all have read.
// A row that sees no key (causal with seqlen_q > seqlen_k, or seqlen_k = 0) is written as 0.
//
// A KV cache of per-row lengths (seqlens_k non-null, dense layout): row b holds sk =
// seqlens_k[b] keys of the seqlen_k-key cache (clamped to [0, seqlen_k]: no read leaves the
// cache), read on the device, so one launch serves any lengths; the causal mask puts each row's
// last query at key sk - 1. Rows of different lengths make CTAs of different lengths, so with up
// to RANKED_ROWS rows the CTAs take the rows longest first (slot s of the grid's batch dimension
// serves the row of rank s by length, ties by index): CTAs start in index order, the long rows
// start in the first wave and short ones fill the last, which then ends together (the longest
// row last would leave one CTA streaming alone at the end).
//
// Variable length (cu_q and cu_k non-null): sequence b's queries are rows cu_q[b]..cu_q[b + 1]
// of the (total, heads, head_dim) operands, its keys cu_k[b]..cu_k[b + 1]; the grid is planned
// for the longest (seqlen_q, seqlen_k), and a row block or split past a sequence's end is empty.
//
// Every integer parameter is 64-bit; the scale comes as the bits of a double (scale * log2 e).

namespace ka_attn {

typedef long long i64;
typedef unsigned short u16;

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int RANKED_ROWS = 128;  // KV caches of per-row lengths up to this batch run longest first
#define NEG_INF (__int_as_float(0xff800000))

struct BF16 {
  static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  static __device__ __forceinline__ void mma(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

struct F16 {
  static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  static __device__ __forceinline__ void mma(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// 16 bytes from global to shared memory, bypassing L1; src_bytes 0 zero-fills the destination.
__device__ __forceinline__ void cp16(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ void ldsm4(unsigned addr, unsigned* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm4_t(unsigned addr, unsigned* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Byte offset of 16-byte chunk `c` of row `r` in a tile of rows of D 16-bit elements, the chunks
// of each row XOR-swizzled by the row's low 3 bits (conflict-free ldmatrix and cp.async).
template <int D>
__device__ __forceinline__ unsigned tile_off(int r, int c) {
  return (unsigned)(r * D * 2 + ((c ^ (r & 7)) << 4));
}

// ---- thread-block clusters (sm_90) -----------------------------------------------------------
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ unsigned cluster_map(const void* local, unsigned rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
  return remote;
}
__device__ __forceinline__ float ld_cluster_f32(unsigned addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ float4 ld_cluster_v4(unsigned addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
  return v;
}

struct Params {
  const u16* q;
  const u16* k;
  const u16* v;
  u16* out;
  const int* cu_q;
  const int* cu_k;
  const int* seqlens_k;
  i64 heads_kv, group, seqlen_q, seqlen_k, row_blocks, causal, scale_bits;
  i64 qb, qs, qh, kb, ks, kh, vb, vs, vh, ob, os, oh;
};

// BK keys per chunk, STAGES chunks in the ring.
template <class T, int D, int MW, int CL, int BK, int STAGES>
__device__ __forceinline__ void decode_body(const Params& p) {
  static_assert(BK % (16 * (WARPS / MW)) == 0 && STAGES >= 2, "whole 16-key tiles per warp; a ring");
  static_assert(16 * MW <= 2 * BK && 64 * (D + 8) * 4 <= STAGES * 2 * BK * D * 2,
                "Q fits a ring slot; the merge buffer fits the ring");
  constexpr int KW = WARPS / MW;           // warps along the keys of a chunk
  constexpr int NK = BK / KW;              // keys per warp per chunk
  constexpr int ROWS = 16 * MW;            // rows of the CTA's block
  constexpr int CHUNKS = D / 8;            // 16-byte chunks per K / V / Q row
  constexpr int TILE = BK * D * 2;         // bytes of one K (or V) chunk
  constexpr int LD = D + 8;                // f32 row stride of the merge buffers (conflict-free)
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float part_m[WARPS][ROWS];
  __shared__ float part_l[WARPS][ROWS];
  __shared__ float row_m[ROWS];
  __shared__ float row_l[ROWS];
  __shared__ float weight[CL][ROWS];
  __shared__ int ranked[RANKED_ROWS + 1];  // cached lengths, then the row this CTA serves

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int mw = warp / KW, kw = warp % KW;
  i64 x = blockIdx.x;
  const int split = (int)(x % CL);
  x /= CL;
  const i64 rb = x % p.row_blocks;
  x /= p.row_blocks;
  const i64 kvh = x % p.heads_kv;
  i64 b = x / p.heads_kv;
  i64 row_keys = -1;  // the row's cached length when the ranking read it
  const i64 batch = gridDim.x / ((i64)CL * p.row_blocks * p.heads_kv);
  if (p.seqlens_k != nullptr && p.cu_q == nullptr && batch <= RANKED_ROWS) {
    // the row of rank b by length, longest first (ties by index: a permutation of the rows)
    for (int r = tid; r < batch; r += THREADS) {
      ranked[r] = (int)min(max((i64)p.seqlens_k[r], (i64)0), p.seqlen_k);
    }
    __syncthreads();
    for (int r = tid; r < batch; r += THREADS) {
      const int mine = ranked[r];
      int rank = 0;
      for (int j = 0; j < batch; ++j) rank += (ranked[j] > mine) | ((ranked[j] == mine) & (j < r));
      if (rank == b) ranked[RANKED_ROWS] = r;
    }
    __syncthreads();
    b = ranked[RANKED_ROWS];
    row_keys = ranked[b];
  }
  // The sequence's first query and key (their offsets, in rows of q / k), and its lengths.
  i64 q0 = b, k0 = b, lq = p.seqlen_q, sk = p.seqlen_k;
  i64 qstep = p.qb, kstep = p.kb, vstep = p.vb, ostep = p.ob;
  if (p.cu_q != nullptr) {
    q0 = p.cu_q[b], k0 = p.cu_k[b];
    lq = p.cu_q[b + 1] - q0, sk = p.cu_k[b + 1] - k0;
    qstep = p.qs, kstep = p.ks, vstep = p.vs, ostep = p.os;
  } else if (p.seqlens_k != nullptr) {
    sk = row_keys >= 0 ? row_keys : min(max((i64)p.seqlens_k[b], (i64)0), p.seqlen_k);
  }
  const i64 rows_total = lq * p.group;
  const i64 row0 = rb * ROWS;
  if (row0 >= rows_total) return;  // (every CTA of the cluster: they share b and rb)
  const u16* qseq = p.q + q0 * qstep;
  u16* oseq = p.out + q0 * ostep;
  const i64 keys_per_split = ((sk + BK - 1) / BK + CL - 1) / CL * BK;  // whole chunks per split
  const i64 k_begin = min((i64)split * keys_per_split, sk);
  const i64 k_end = min(k_begin + keys_per_split, sk);
  const int n_chunks = (int)((k_end - k_begin + BK - 1) / BK);
  const float scale = (float)__longlong_as_double(p.scale_bits);

  const u16* kbase = p.k + k0 * kstep + kvh * p.kh;
  const u16* vbase = p.v + k0 * vstep + kvh * p.vh;
  const unsigned ring = smem_addr(smem);

  // K and V of chunk c into ring slot c % STAGES (keys past the split zero-filled).
  auto load_chunk = [&](int c) {
    if (c < n_chunks) {
      const unsigned slot = ring + (c % STAGES) * 2 * TILE;
      const i64 key0 = k_begin + (i64)c * BK;
#pragma unroll
      for (int i = 0; i < BK * CHUNKS / THREADS; ++i) {
        const int idx = tid + i * THREADS, r = idx / CHUNKS, ch = idx % CHUNKS;
        const i64 key = key0 + r;
        const bool in = key < k_end;
        const i64 kk = in ? key : 0;
        cp16(slot + tile_off<D>(r, ch), kbase + kk * p.ks + ch * 8, in ? 16 : 0);
        cp16(slot + TILE + tile_off<D>(r, ch), vbase + kk * p.vs + ch * 8, in ? 16 : 0);
      }
    }
    cp_commit();
  };

  // Q of the row block into the last ring slot (free until iteration 0 refills it).
  const unsigned qtile = ring + (STAGES - 1) * 2 * TILE;
  for (int idx = tid; idx < ROWS * CHUNKS; idx += THREADS) {
    const int r = idx / CHUNKS, ch = idx % CHUNKS;
    const i64 gr = row0 + r;
    const bool in = gr < rows_total;
    const i64 qi = in ? gr / p.group : 0, qg = in ? gr % p.group : 0;
    cp16(qtile + tile_off<D>(r, ch), qseq + qi * p.qs + (kvh * p.group + qg) * p.qh + ch * 8, in ? 16 : 0);
  }
#pragma unroll
  for (int c = 0; c < STAGES - 1; ++c) load_chunk(c);  // (Q joins chunk 0's group)

  // This thread's two rows (g and g + 8 of its warp's tile): the last key each sees.
  const int g = lane >> 2, q4 = lane & 3;
  i64 last[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const i64 gr = row0 + mw * 16 + g + 8 * h;
    last[h] = p.causal ? sk - lq + gr / p.group : sk - 1;
  }

  unsigned qa[D / 16][4];
  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};

  for (int c = 0; c < n_chunks; ++c) {
    cp_wait<STAGES - 2>();
    __syncthreads();
    if (c == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const int r = mw * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, ch = kk * 2 + (lane >> 4);
        ldsm4(qtile + tile_off<D>(r, ch), qa[kk]);
      }
      __syncthreads();  // every warp holds its Q before the slot is refilled
    }
    load_chunk(c + STAGES - 1);
    const unsigned kt = ring + (c % STAGES) * 2 * TILE, vt = kt + TILE;
    const int kr0 = kw * NK;  // the warp's first key row in the chunk

    // S = Q K^T for 16 rows x NK keys
    float s[NK / 8][4];
#pragma unroll
    for (int j = 0; j < NK / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < NK / 16; ++np) {
        unsigned bf[4];
        const int mat = lane >> 3;
        const int r = kr0 + np * 16 + (lane & 7) + (mat >> 1) * 8, ch = kk * 2 + (mat & 1);
        ldsm4(kt + tile_off<D>(r, ch), bf);
        T::mma(s[2 * np], qa[kk], bf[0], bf[1]);
        T::mma(s[2 * np + 1], qa[kk], bf[2], bf[3]);
      }
    }

    // online softmax (base 2), masked past each row's last key
    const i64 key0 = k_begin + (i64)c * BK + kr0;
    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int j = 0; j < NK / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const i64 key = key0 + j * 8 + q4 * 2 + (e & 1);
        const float val = key <= last[e >> 1] ? s[j][e] * scale : NEG_INF;
        s[j][e] = val;
        mx[e >> 1] = fmaxf(mx[e >> 1], val);
      }
    }
    float alpha[2], ref[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      const float mn = fmaxf(m[h], mx[h]);
      ref[h] = mn == NEG_INF ? 0.f : mn;
      alpha[h] = ex2(m[h] - ref[h]);
      m[h] = mn;
      l[h] *= alpha[h];
    }
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      o[j][0] *= alpha[0];
      o[j][1] *= alpha[0];
      o[j][2] *= alpha[1];
      o[j][3] *= alpha[1];
    }
#pragma unroll
    for (int j = 0; j < NK / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = ex2(s[j][e] - ref[e >> 1]);
        l[e >> 1] += s[j][e];
      }
    }

    // O += P V
#pragma unroll
    for (int ks = 0; ks < NK / 16; ++ks) {
      unsigned pa[4];
      pa[0] = T::pack2(s[2 * ks][0], s[2 * ks][1]);
      pa[1] = T::pack2(s[2 * ks][2], s[2 * ks][3]);
      pa[2] = T::pack2(s[2 * ks + 1][0], s[2 * ks + 1][1]);
      pa[3] = T::pack2(s[2 * ks + 1][2], s[2 * ks + 1][3]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        unsigned bf[4];
        const int mat = lane >> 3;
        const int r = kr0 + ks * 16 + (lane & 7) + (mat & 1) * 8, ch = dp * 2 + (mat >> 1);
        ldsm4_t(vt + tile_off<D>(r, ch), bf);
        T::mma(o[2 * dp], pa, bf[0], bf[1]);
        T::mma(o[2 * dp + 1], pa, bf[2], bf[3]);
      }
    }
  }

  // ---- merge the KW warps' partials of each row ----------------------------------------------
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
  cp_wait<0>();
  __syncthreads();  // the ring is free: it holds the merge buffer now
  float* red = reinterpret_cast<float*>(smem);  // [KW][ROWS][LD]
  if (q4 == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      part_m[kw][mw * 16 + g + 8 * h] = m[h];
      part_l[kw][mw * 16 + g + 8 * h] = l[h];
    }
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = mw * 16 + g + 8 * h;
    float best = NEG_INF;
#pragma unroll
    for (int w = 0; w < KW; ++w) best = fmaxf(best, part_m[w][r]);
    const float own = m[h] == NEG_INF ? 0.f : ex2(m[h] - best);
    float* dst = red + (kw * ROWS + r) * LD + q4 * 2;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      *reinterpret_cast<float2*>(dst + j * 8) = make_float2(o[j][2 * h] * own, o[j][2 * h + 1] * own);
    }
    if (kw == 0 && q4 == 0) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < KW; ++w) sum += part_m[w][r] == NEG_INF ? 0.f : part_l[w][r] * ex2(part_m[w][r] - best);
      row_m[r] = best;
      row_l[r] = sum;
    }
  }
  __syncthreads();
  const int valid = (int)min((i64)ROWS, rows_total - row0);  // rows of the block that exist
  if constexpr (KW > 1) {
    for (int idx = tid; idx < valid * (D / 4); idx += THREADS) {
      const int r = idx / (D / 4), c4 = idx % (D / 4);
      float4 acc = *reinterpret_cast<float4*>(red + r * LD + c4 * 4);
#pragma unroll
      for (int w = 1; w < KW; ++w) {
        const float4 add = *reinterpret_cast<float4*>(red + (w * ROWS + r) * LD + c4 * 4);
        acc.x += add.x, acc.y += add.y, acc.z += add.z, acc.w += add.w;
      }
      *reinterpret_cast<float4*>(red + r * LD + c4 * 4) = acc;
    }
  }

  // ---- merge the CL splits' partials and write out -------------------------------------------
  unsigned rank = 0;
  if constexpr (CL > 1) {
    cluster_sync();  // every CTA's partials are complete and visible to the cluster
    rank = (unsigned)split;
  } else {
    __syncthreads();
  }
  for (int r = tid; r < valid; r += THREADS) {
    float mc[CL], best = NEG_INF;
#pragma unroll
    for (int c = 0; c < CL; ++c) {
      mc[c] = CL > 1 ? ld_cluster_f32(cluster_map(&row_m[r], c)) : row_m[r];
      best = fmaxf(best, mc[c]);
    }
    float sum = 0.f;
#pragma unroll
    for (int c = 0; c < CL; ++c) {
      mc[c] = mc[c] == NEG_INF ? 0.f : ex2(mc[c] - best);
      sum += (CL > 1 ? ld_cluster_f32(cluster_map(&row_l[r], c)) : row_l[r]) * mc[c];
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
    for (int c = 0; c < CL; ++c) weight[c][r] = mc[c] * inv;
  }
  __syncthreads();
  // (each CTA of the cluster writes every CL-th 4-column piece of the valid rows)
  for (int idx = tid * CL + (int)rank; idx < valid * (D / 4); idx += THREADS * CL) {
    const int r = idx / (D / 4), c4 = idx % (D / 4);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int c = 0; c < CL; ++c) {
      float4 part;
      if constexpr (CL > 1) {
        part = ld_cluster_v4(cluster_map(red + r * LD + c4 * 4, c));
      } else {
        part = *reinterpret_cast<float4*>(red + r * LD + c4 * 4);
      }
      const float w = weight[c][r];
      acc.x += part.x * w, acc.y += part.y * w, acc.z += part.z * w, acc.w += part.w * w;
    }
    const i64 gr = row0 + r, i = gr / p.group, gh = gr % p.group;
    u16* dst = oseq + i * p.os + (kvh * p.group + gh) * p.oh + c4 * 4;
    *reinterpret_cast<uint2*>(dst) = make_uint2(T::pack2(acc.x, acc.y), T::pack2(acc.z, acc.w));
  }
  if constexpr (CL > 1) {
    cluster_sync();  // no CTA leaves while another may still read its shared memory
  }
}

// The kernels' parameters, one per launch parameter (a recorded launch passes each as its own).
#define KA_ATTN_PARAMS                                                                                   \
  const u16 *q, const u16 *k, const u16 *v, u16 *out, const int *cu_q, const int *cu_k,                 \
      const int *seqlens_k, i64 heads_kv, i64 group, i64 seqlen_q, i64 seqlen_k, i64 row_blocks,          \
      i64 causal, i64 scale_bits, i64 qb, i64 qs, i64 qh, i64 kb, i64 ks, i64 kh, i64 vb, i64 vs, i64 vh,  \
      i64 ob, i64 os, i64 oh
#define KA_ATTN_ARGS                                                                                    \
  Params{q, k, v, out, cu_q, cu_k, seqlens_k, heads_kv, group, seqlen_q, seqlen_k, \
         row_blocks, causal, scale_bits, qb, qs, qh, kb, ks, kh, vb, vs, vh, ob, os, oh}

// One CTA per (batch, KV head, row block): the keys in one split. MIN_CTAS: the CTAs an SM must
// hold (registers capped to fit them).
template <class T, int D, int MW, int BK, int STAGES, int MIN_CTAS>
__global__ void __launch_bounds__(THREADS, MIN_CTAS) decode(KA_ATTN_PARAMS) {
  decode_body<T, D, MW, 1, BK, STAGES>(KA_ATTN_ARGS);
}

// CL CTAs per (batch, KV head, row block), one cluster: the keys in CL splits.
template <class T, int D, int MW, int CL, int BK, int STAGES, int MIN_CTAS>
__global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(THREADS, MIN_CTAS) decode_split(KA_ATTN_PARAMS) {
  decode_body<T, D, MW, CL, BK, STAGES>(KA_ATTN_ARGS);
}

}  // namespace ka_attn
