// Row softmax (forward and backward) for rows too long for one CTA, at DRAM bandwidth: a
// persistent, cooperatively launched grid whose CTAs are grouped, S CTAs per row, each
// staging its slice of the row in shared memory so that the input is read from DRAM once.
// Compiled after softmax.cu (the interface, softmax_rowgroup.py, joins the two sources),
// whose spans, conversions, stores, reductions and looped passes it uses. sm_90+ (TMA bulk
// copies, mbarriers).
//
// Grid: G groups of S CTAs (gridDim.x == G * S, at most what is co-resident: the launch is
// cooperative, so every CTA is resident and the spin-waits below always end). Group g takes
// rows g, g + G, g + 2G, ... (one "wave" per row); CTA `rank` of the group takes the
// rank-th of S balanced slices of the row's 16-byte vectors (rows are peeled: the head up to
// the first 16-byte boundary and the tail are scalars that rank 0 holds).
//
// Inside a CTA: one producer warp (one lane) copies each wave's slice into a ring of RING
// chunks of 16 KB in dynamic shared memory with cp.async.bulk (TMA), one full/empty mbarrier
// pair per chunk, running ahead into the next waves as far as the ring allows; RG_CONSUMERS
// threads compute. The first `cap` vectors of a slice are staged (cap: at most the ring);
// the rest of a slice too long for the ring (f32 backward of 4M columns) is read by the
// consumers themselves twice, statistics then output, the second read from L2.
//
// Per wave, the consumers
//   forward:  1a. each thread's max m_t over its staged vectors (as the chunks land);
//             1b. e = exp(x - m_t) written back over x in shared memory, s_t = sum(e)
//                 (one exp per element; e is rounded to the storage type, which the
//                 output is rounded to anyway);
//             the thread's (m, s) merged with its overflow's and edges' online (m, s),
//             reduced over the CTA, published; later combined over the group;
//             2.  y = e * exp(m_t - M) / total, from shared memory, each chunk released
//                 to the producer once read; overflow and edges recomputed from global.
//   backward: 1.  sum(dy * y) over the slice (staged: dy and y side by side in a chunk),
//             reduced, published; later combined; 2. dx = y * (dy - dot).
// With `ahead` (the host's choice when the ring holds three waves' chunks), wave w + 1's
// statistics are taken and published before waiting for wave w's group: the meeting's
// latency hides behind that work instead of stalling every wave.
//
// The group's CTAs meet through the global workspace: per CTA RG_SLOTS 16-byte slots (by
// wave, modulo RG_SLOTS), each a 64-bit tag and two floats. A CTA writes its partial, then
// release-stores the tag of (launch, wave); its peers acquire-load the tags of all S slots
// until each reads the current one (spinning with nanosleep). Tags carry a per-launch value
// (the host's epoch mixed with %gridid), so stale or uninitialised workspace never reads as
// current and no launch has to reset anything: the workspace may come fresh from any
// allocator. Four slots per CTA: a CTA publishes wave w + 4 (the slot of w) only after it
// has seen every peer's wave w + 2, which each peer publishes only after reading all of wave
// w (with `ahead`, a peer publishes w + 1 before it reads w; without, two would do).
// Every CTA of a group combines the S partials in the same order, so all agree bit for bit.
//
// RG_BULK_OUT builds add a storer warp: the consumers write each staged chunk's output over
// its input in shared memory and hand the chunk over (a `written` mbarrier per chunk); the
// storer's lane writes it to global memory with a TMA bulk store and, once the store has read
// the chunk, releases it to the producer. The consumers then go on to the next wave while the
// stores drain. (Every operand's rows start at one phase of 16 bytes, which the interface
// checks, so the output's slices are as aligned as the staged ones.)
//
// Compile-time parameters (the interface sets them per instance): RG_CONSUMERS compute
// threads (512, or 256 so that RG_MIN_BLOCKS = 2 CTAs, each with half the ring, share an SM
// within the register file) and RG_MIN_BLOCKS, the launch bounds' CTAs per SM. RG_TRACE
// (off by default; the code without it is unchanged) makes consumer thread 0 and the producer
// lane record %globaltimer stamps per CTA in a trace after the workspace slots: see
// "Per-phase trace" below and softmax_rowgroup.py's `read_trace`.

namespace ka_softmax {

typedef unsigned long long u64;

#ifndef RG_CONSUMERS
#define RG_CONSUMERS 512
#endif
#ifndef RG_MIN_BLOCKS
#define RG_MIN_BLOCKS 1
#endif
#ifndef RG_BULK_OUT
#define RG_BULK_OUT 0
#endif
#define RG_THREADS (RG_CONSUMERS + 32 + 32 * RG_BULK_OUT)
// Packed 16-bit math in the forward: the slice's max two values at a time, and (bf16, bulk
// build) the output as e times the scale two at a time (softmax.cu's max2_pack, scale_pack_bf16).
#ifndef RG_PACKED_MATH
#define RG_PACKED_MATH 0
#endif
// The upper half of the row groups starts this many ns late (with 4+ waves; `stagger_ns`, the
// forward's build): see run().
#ifndef RG_STAGGER_NS
#define RG_STAGGER_NS 0
#endif
// Values in flight per consumer thread in the passes over the ring (walk_chunks' BATCH; 0: each
// vector loaded, used and stored in turn behind a bound check, as before the batched walk): the
// forward's max, its exp, its bf16 packed output, its float output (-1: the rule in fwd_finish,
// FLOAT_OUT_BATCH) and the backward's passes. The defaults are the best of A/B runs against the
// plain walk on an H200 (each instance against its build from the previous source, alternating
// launches in one process); the macros are experiment switches.
#ifndef RG_BATCH_MAX
#define RG_BATCH_MAX 2
#endif
#ifndef RG_BATCH_EXP
#define RG_BATCH_EXP 2
#endif
#ifndef RG_BATCH_OUT_BF16
#define RG_BATCH_OUT_BF16 4
#endif
#ifndef RG_BATCH_OUT_FLOAT
#define RG_BATCH_OUT_FLOAT -1
#endif
#ifndef RG_BATCH_BWD
#define RG_BATCH_BWD 2
#endif
// Bulk stores a storer keeps in flight before it waits for the oldest to have read its chunk.
#define RG_STORES_IN_FLIGHT 4
#define RG_CHUNK_BYTES 16384
#define RG_CHUNK_U4 (RG_CHUNK_BYTES / 16)
#define RG_MAX_CHUNKS 16
// A chunk's vectors split evenly over the consumers (forward: CHUNK_U4, backward: half each
// for dy and y); the reductions' scratch holds one value per consumer warp, at most 32.
static_assert(RG_CONSUMERS % 32 == 0 && RG_CONSUMERS / 32 <= 32, "RG_CONSUMERS: whole warps, at most 32");
static_assert((RG_CHUNK_U4 / 2) % RG_CONSUMERS == 0, "RG_CONSUMERS must divide a backward chunk's vectors");
// A peer that has not published after this long means a broken launch (never a correct one:
// the CTAs are co-resident); trap instead of hanging. Generous for compute-sanitizer runs.
#ifndef RG_TIMEOUT_NS
#define RG_TIMEOUT_NS 30000000000ull
#endif

namespace rowgroup {

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(u64* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u64* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, unsigned parity) {
  const unsigned addr = smem_u32(bar);
  unsigned done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, u64* bar, u64 policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy)
      : "memory");
}

__device__ __forceinline__ bool mbar_test(u64* bar, unsigned parity) {
  unsigned done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ void bulk_store(void* dst, const void* src, unsigned bytes, u64 policy) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;" ::"l"(dst),
               "r"(smem_u32(src)), "r"(bytes), "l"(policy)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Wait until at most N bulk stores still have to read their shared memory (READ) or complete.
template <int N, bool READ>
__device__ __forceinline__ void bulk_wait() {
  if constexpr (READ)
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
  else
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// Consumer threads only (the producer warp never joins): barrier 1.
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(RG_CONSUMERS) : "memory"); }

__device__ __forceinline__ void st_release(u64* p, u64 v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 ld_acquire(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed(float* p, float v) {
  asm volatile("st.relaxed.gpu.global.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}
__device__ __forceinline__ float ld_relaxed(const float* p) {
  float v;
  asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u64 global_timer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The high 32 bits of this launch's tags: the host's epoch (a per-process counter) mixed
// with %gridid (a per-launch number of the context, so CUDA graph replays differ too).
__device__ __forceinline__ unsigned launch_tag(i64 epoch) {
  u64 g;
  asm volatile("mov.u64 %0, %%gridid;" : "=l"(g));
  return (unsigned)epoch ^ ((unsigned)g * 0x9E3779B1u);
}

// Workspace slot of CTA `cta` for wave `w`: {tag, a, b} in 16 bytes, RG_SLOTS per CTA.
#define RG_SLOTS 4
__device__ __forceinline__ u64* slot_of(u64* ws, i64 cta, i64 w) { return ws + (cta * RG_SLOTS + (w & (RG_SLOTS - 1))) * 2; }
__device__ __forceinline__ u64 tag_of(unsigned hi, i64 w) { return ((u64)hi << 32) | (unsigned)w; }

__device__ __forceinline__ void publish(u64* slot, u64 tag, float a, float b) {
  float* v = reinterpret_cast<float*>(slot + 1);
  st_relaxed(v, a);
  st_relaxed(v + 1, b);
  st_release(slot, tag);  // orders the two stores above before the tag
}

// ---- Per-phase trace (RG_TRACE builds only) ------------------------------------------------
// After the grid's slots (gridDim.x * RG_SLOTS 16-byte slots), RG_TRACE_WORDS 64-bit words per
// CTA: a head (TR_*) and, for each of the first RG_TRACE_WAVES waves, TW_* stamps. Stamps are
// %globaltimer nanoseconds; consumer thread 0 writes all but the producer lane's TR_ISSUE_FIRST,
// TR_PRODUCER_DONE and TW_ISSUED. The head's TR_HEADER word is written last: RG_TRACE_MAGIC in
// the high half, the waves this CTA processed in the low half.
#ifdef RG_TRACE
#ifndef RG_TRACE_WAVES
#define RG_TRACE_WAVES 16
#endif
#define RG_TRACE_HEAD 8
#define RG_TRACE_WORDS (RG_TRACE_HEAD + 4 * RG_TRACE_WAVES)
#define RG_TRACE_MAGIC 0x52475452u  // "RGTR"
enum { TR_HEADER, TR_ENTRY, TR_READY, TR_EXIT, TR_ISSUE_FIRST, TR_PRODUCER_DONE, TR_TAG, TR_SMID };
enum { TW_STATS, TW_MET, TW_STORED, TW_ISSUED };
#define RG_TRACE_ONLY(...) __VA_ARGS__
__device__ __forceinline__ u64* trace_of(u64* ws) {
  return ws + (u64)gridDim.x * RG_SLOTS * 2 + (u64)blockIdx.x * RG_TRACE_WORDS;
}
__device__ __forceinline__ void trace_wave(u64* tr, i64 w, int what) {
  if (w < RG_TRACE_WAVES) tr[RG_TRACE_HEAD + 4 * w + what] = global_timer();
}
__device__ __forceinline__ unsigned sm_id() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}
#else
#define RG_TRACE_ONLY(...)
#endif

__device__ __forceinline__ void wait_tag(const u64* slot, u64 tag) {
  if (ld_acquire(slot) == tag) return;
  const u64 t0 = global_timer();
  unsigned ns = 32;
  while (ld_acquire(slot) != tag) {
    asm volatile("nanosleep.u32 %0;" ::"r"(ns));
    if (ns < 256) ns <<= 1;
    if (global_timer() - t0 > RG_TIMEOUT_NS) __trap();
  }
}

// The sum of N values as a pairwise tree: log2(N) dependent adds instead of N.
template <int N>
__device__ __forceinline__ float tree_sum(const float (&f)[N]) {
  float h[N];
#pragma unroll
  for (int q = 0; q < N; ++q) h[q] = f[q];
#pragma unroll
  for (int w = 1; w < N; w <<= 1)
#pragma unroll
    for (int q = 0; q + w < N; q += 2 * w) h[q] += h[q + w];
  return h[0];
}

// (m, s) pairs: s = sum of exp(v - m) over some values. Merging keeps an empty pair
// (-inf, 0) from turning into NaN.
__device__ __forceinline__ void pair_merge(float& m, float& s, float m2, float s2) {
  const float M = fmaxf(m, m2);
  const float a = m == -KA_INF ? 0.f : s * exp_shifted(m, M);
  const float b = m2 == -KA_INF ? 0.f : s2 * exp_shifted(m2, M);
  m = M;
  s = a + b;
}
__device__ __forceinline__ void warp_pair(float& m, float& s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    pair_merge(m, s, m2, s2);
  }
}

// The CTA's (m, s) over the consumer threads' pairs; valid in every lane of warp 0.
__device__ __forceinline__ void cta_pair(float& m, float& s, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  warp_pair(m, s);
  if (lane == 0) {
    red[warp] = m;
    red[32 + warp] = s;
  }
  consumer_sync();
  if (warp == 0) {
    m = lane < RG_CONSUMERS / 32 ? red[lane] : -KA_INF;
    s = lane < RG_CONSUMERS / 32 ? red[32 + lane] : 0.f;
    warp_pair(m, s);
  }
}
// The CTA's sum over the consumer threads; valid in every lane of warp 0.
__device__ __forceinline__ float cta_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) red[warp] = v;
  consumer_sync();
  if (warp == 0) v = warp_sum(lane < RG_CONSUMERS / 32 ? red[lane] : 0.f);
  return v;
}

// A row's split: its span, this CTA's slice [v0, v0 + n) of the vectors, how many of them
// are staged (the first min(n, cap)) and in how many chunks of CV vectors.
struct RowSlice {
  Span sp;
  i64 v0;
  int n, staged, nch;
};
template <class T, int VEC>
__device__ __forceinline__ RowSlice row_slice(const typename T::raw* row, int cols, int S, int rank, int cap, int cv) {
  RowSlice s;
  s.sp = row_span<T, VEC, true>(row, cols);
  const i64 nv = s.sp.nvec;
  s.v0 = nv * rank / S;  // balanced: slices differ by at most one vector
  s.n = (int)(nv * (rank + 1) / S - s.v0);
  s.staged = min(s.n, cap);
  s.nch = (s.staged + cv - 1) / cv;
  return s;
}


// Launch arguments the host planned; a violation would deadlock the ring or the groups, so
// it traps (the interface never launches one).
__device__ __forceinline__ void check_plan(i64 S, i64 G, i64 cap, i64 ring, i64 ahead, int cv) {
  const i64 chunks = (cap + cv - 1) / cv;
  if (S < 1 || G < 1 || ring < 1 || ring > RG_MAX_CHUNKS || cap < 0 || chunks > ring || ahead < 0 || ahead > 1 ||
      (ahead && 2 * chunks > ring) || (i64)gridDim.x != S * G || blockDim.x != RG_THREADS)
    __trap();
}

__device__ __forceinline__ void init_ring(u64* full, u64* empty, u64* written, int ring) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < ring; ++i) {
      mbar_init(&full[i], 1);                                    // the producer's expect_tx arrival
      mbar_init(&empty[i], RG_BULK_OUT ? 1 : RG_CONSUMERS / 32);  // the storer, or one arrival per consumer warp
      if (RG_BULK_OUT) mbar_init(&written[i], RG_CONSUMERS / 32);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}

// The CTA's waves in order (rows group, group + G, ...), each staged chunk of each in ring
// order, as the producer fills the ring and the storer empties it: `on_row(r, s)` for row r's
// slice s, then `on_chunk(s, k, slot, parity)` for each of its chunks k, and `on_wave()` after
// the row. The slices follow `span` (rows `lds` apart): the forward's x, the backward's y. CV:
// vectors per chunk and array.
template <class T, int VEC, int CV, class R, class F, class W>
__device__ __forceinline__ void walk_waves(const typename T::raw* __restrict__ span, i64 lds, i64 rows, int cols, int S,
                                           int G, int cap, int ring, R&& on_row, F&& on_chunk, W&& on_wave) {
  const int rank = blockIdx.x % S, group = blockIdx.x / S;
  int sl = 0;
  unsigned ph = 0;
  for (i64 r = group; r < rows; r += G) {
    const RowSlice s = row_slice<T, VEC>(span + r * lds, cols, S, rank, cap, CV);
    on_row(r, s);
    for (int k = 0; k < s.nch; ++k) {
      on_chunk(s, k, sl, ph);
      if (++sl == ring) {
        sl = 0;
        ph ^= 1u;
      }
    }
    on_wave();
  }
}

// The producer: one lane copies every wave's staged vectors chunk by chunk into the ring,
// waiting for each chunk's previous contents to be released. Backward chunks hold CV
// vectors of dy, then CV of y.
template <class T, int VEC, bool BWD>
__device__ void produce(const typename T::raw* __restrict__ a, const typename T::raw* __restrict__ b, i64 rows,
                        int cols, i64 lda, i64 ldb, int S, int G, int cap, int ring, uint4* rbuf, u64* full,
                        u64* empty RG_TRACE_ONLY(, u64* tr)) {
  constexpr int CV = RG_CHUNK_U4 / (BWD ? 2 : 1);
  const u64 policy = l2_evict_first_policy();  // the staged loads are read once: first out of L2
  RG_TRACE_ONLY(i64 wave = 0; bool first = true;)
  const char* asrc = nullptr;
  const char* bsrc = nullptr;
  walk_waves<T, VEC, CV>(
      BWD ? b : a, BWD ? ldb : lda, rows, cols, S, G, cap, ring,  // (the backward's span is y's)
      [&](i64 r, const RowSlice& s) {
        const typename T::raw* ar = a + r * lda;
        const typename T::raw* br = BWD ? b + r * ldb : ar;
        asrc = reinterpret_cast<const char*>(ar + s.sp.head) + s.v0 * 16;
        bsrc = reinterpret_cast<const char*>(br + s.sp.head) + s.v0 * 16;
      },
      [&](const RowSlice& s, int k, int sl, unsigned ph) {
        mbar_wait(&empty[sl], ph ^ 1u);  // (the first pass through the ring finds every chunk free)
        const unsigned bytes = (unsigned)min(CV, s.staged - k * CV) * 16u;
        uint4* dst = rbuf + (i64)sl * RG_CHUNK_U4;
        mbar_expect_tx(&full[sl], BWD ? 2 * bytes : bytes);
        bulk_load(dst, asrc + (i64)k * CV * 16, bytes, &full[sl], policy);
        if constexpr (BWD) bulk_load(dst + CV, bsrc + (i64)k * CV * 16, bytes, &full[sl], policy);
        RG_TRACE_ONLY(if (first) {
          tr[TR_ISSUE_FIRST] = global_timer();
          first = false;
        })
      },
      [&]() { RG_TRACE_ONLY(trace_wave(tr, wave++, TW_ISSUED);) });
  RG_TRACE_ONLY(tr[TR_PRODUCER_DONE] = global_timer();)
}

#if RG_BULK_OUT
// The storer: one lane walks the waves' staged chunks as the producer does, and writes each
// chunk the consumers have handed over (`written`) to its place in the output with a TMA bulk
// store, releasing the chunk to the producer once the store has read it. Up to
// RG_STORES_IN_FLIGHT stores stay in flight; before waiting for a chunk that is not yet
// written it releases every chunk already stored, so the producer never waits on it.
// Backward chunks hold dx (over dy) first.
template <class T, int VEC, bool BWD>
__device__ void store_out(const typename T::raw* __restrict__ span, typename T::raw* __restrict__ out, i64 rows,
                          int cols, i64 lds, i64 ldo, int S, int G, int cap, int ring, uint4* rbuf, u64* written,
                          u64* empty) {
  constexpr int CV = RG_CHUNK_U4 / (BWD ? 2 : 1);
  const u64 policy = l2_evict_first_policy();  // the output is not read again here
  // The chunks stored but not yet released: np of them, from ring slot `oldest` on.
  int oldest = 0, np = 0;
  auto release_oldest = [&]() {
    mbar_arrive(&empty[oldest]);
    if (++oldest == ring) oldest = 0;
    --np;
  };
  char* dst = nullptr;
  walk_waves<T, VEC, CV>(
      span, lds, rows, cols, S, G, cap, ring,
      [&](i64 r, const RowSlice& s) { dst = reinterpret_cast<char*>(out + r * ldo + s.sp.head) + s.v0 * 16; },
      [&](const RowSlice& s, int k, int sl, unsigned ph) {
        if (!mbar_test(&written[sl], ph)) {
          bulk_wait<0, true>();
          while (np > 0) release_oldest();
          mbar_wait(&written[sl], ph);
        }
        const unsigned bytes = (unsigned)min(CV, s.staged - k * CV) * 16u;
        bulk_store(dst + (i64)k * CV * 16, rbuf + (i64)sl * RG_CHUNK_U4, bytes, policy);
        ++np;
        if (np > RG_STORES_IN_FLIGHT) {
          bulk_wait<RG_STORES_IN_FLIGHT, true>();
          release_oldest();
        }
      },
      []() {});
  bulk_wait<0, true>();
  while (np > 0) release_oldest();
  bulk_wait<0, false>();  // the writes done before the CTA exits
}
#endif

// Release the N chunks `sl` to the producer (or the storer) once every consumer warp is done
// with them.
template <bool WROTE, int N>
__device__ __forceinline__ void release(u64* empty, const int (&sl)[N]) {
  // The forward wrote e into the chunk (generic proxy); the producer's next copy writes it
  // through the async proxy. One fence covers every chunk of the step.
  if constexpr (WROTE) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncwarp();
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int g = 0; g < N; ++g) mbar_arrive(empty + sl[g]);
  }
}

// What the consumers share: the operands (forward: a = x, out = y; backward: a = dy, b = y,
// out = dx), the plan, this CTA's place in it, and the shared-memory ring and scratch.
template <class T>
struct Ctx {
  const typename T::raw* a;
  const typename T::raw* b;
  typename T::raw* out;
  i64 rows, lda, ldb, ldo;
  int cols, S, G, cap, ring, rank, group;
  u64* ws;
  unsigned hi;
  uint4* rbuf;
  u64* full;
  u64* empty;
  float* red;  // [2][64]: by wave parity, as two waves' reductions may be in flight
  float* bc;
  u64* written;  // (RG_BULK_OUT: the consumers hand each output chunk to the storer here)
};

// A wave between its statistics and its output: row, wave number, the ring position (and
// fill parity) of its first chunk and its chunk count (the output recomputes the slice,
// which saves registers), what the output needs again (forward: the thread's staged max
// and its edge elements; backward: the edges of dy, y), and the CTA's partial (warp 0).
struct Wave {
  i64 r, w;
  int slot, nch;
  unsigned phase;
  float ms, e0, e1, e2, e3;
  float ca, cb;
};

#ifdef RG_TRACE
// Every consumer has issued the wave's stores (the traced build's one extra barrier per wave).
template <class T>
__device__ __forceinline__ void trace_stored(const Ctx<T>& c, i64 w) {
  consumer_sync();
  if (threadIdx.x == 0) trace_wave(trace_of(c.ws), w, TW_STORED);
}
// Consumer thread 0's last words: exit time, launch tag, SM, then the head that marks the
// record complete.
template <class T>
__device__ __forceinline__ void trace_exit(const Ctx<T>& c) {
  if (threadIdx.x != 0) return;
  u64* tr = trace_of(c.ws);
  tr[TR_EXIT] = global_timer();
  tr[TR_TAG] = c.hi;
  tr[TR_SMID] = sm_id();
  const i64 waves = c.group < c.rows ? (c.rows - 1 - c.group) / c.G + 1 : 0;
  tr[TR_HEADER] = ((u64)RG_TRACE_MAGIC << 32) | (unsigned)waves;
}
#endif

__device__ __forceinline__ void advance(int& slot, unsigned& phase, int nch, int ring) {
  slot += nch;
  while (slot >= ring) {
    slot -= ring;
    phase ^= 1u;
  }
}

// The one walk over a wave's staged chunks in the ring, from its first slot. Each thread's
// vectors of a chunk are loaded into registers, A per vector (the chunk holds A arrays of CV
// vectors: the backward's dy, then y), handed to `on_vector(x, v)` (x: the A values, v: the
// vector's index in the slice) and, if the pass writes, x[0] stored back. ARRIVE: wait for
// each chunk to land, the first pass over a wave; REWRITE: write each vector back (the
// forward's e); RELEASE: hand each chunk back to the producer after the last pass (WROTE: write
// each vector back first; FENCED: an earlier pass wrote into the chunk).
//
// The passes are latency-bound (4 consumer warps per scheduler; ncu's warp-state samples: each
// vector's load, math and store in series), so whole chunks take no per-vector bound check and
// up to BATCH values per thread are loaded before the first is used: the thread's vectors of
// one chunk, or of two chunks per step where one holds too few (then a release's fence is paid
// once per step). BATCH is the caller's: what its math leaves registers for.
enum WalkKind { REWRITE, ARRIVE, RELEASE, RELEASE_FENCED, RELEASE_WROTE };
template <int CV, int NC, WalkKind KIND, int A, int BATCH, class F>
__device__ __forceinline__ void walk_chunks(uint4* rbuf, u64* full, u64* empty, int ring, int slot,
                                            unsigned phase, int nch, int staged, F&& on_vector) {
  constexpr int VPT = CV / NC;
  constexpr bool WRITES = KIND == REWRITE || KIND == RELEASE_WROTE;
  constexpr bool RELEASES = KIND == RELEASE || KIND == RELEASE_FENCED || KIND == RELEASE_WROTE;
  constexpr bool FENCE = KIND == RELEASE_FENCED || KIND == RELEASE_WROTE;
  // chunks per step, and vectors of a chunk loaded together
  constexpr int STEP = KIND != ARRIVE && BATCH >= 2 * VPT * A ? BATCH / (VPT * A) : 1;  // (BATCH 0: none)
  constexpr int GROUP = VPT * A <= BATCH ? VPT : (BATCH / A > 0 ? BATCH / A : 1);
  static_assert(VPT % GROUP == 0, "a chunk's vectors in whole groups");
  const int t = threadIdx.x;
  auto next = [&]() {
    if (++slot == ring) {
      slot = 0;
      phase ^= 1u;
    }
  };
  int k = 0;
  for (; BATCH > 0 && k + STEP <= nch && (k + STEP) * CV <= staged; k += STEP) {  // whole chunks
    int sl[STEP];
    uint4* cb[STEP];
#pragma unroll
    for (int g = 0; g < STEP; ++g) {
      if constexpr (KIND == ARRIVE) mbar_wait(&full[slot], phase);
      sl[g] = slot;
      cb[g] = rbuf + (i64)slot * RG_CHUNK_U4;
      next();
    }
#pragma unroll
    for (int i0 = 0; i0 < VPT; i0 += GROUP) {
      uint4 x[STEP][GROUP][A];
#pragma unroll
      for (int g = 0; g < STEP; ++g)
#pragma unroll
        for (int i = 0; i < GROUP; ++i)
#pragma unroll
          for (int a = 0; a < A; ++a) x[g][i][a] = cb[g][a * CV + (i0 + i) * NC + t];
#pragma unroll
      for (int g = 0; g < STEP; ++g)
#pragma unroll
        for (int i = 0; i < GROUP; ++i) on_vector(x[g][i], (k + g) * CV + (i0 + i) * NC + t);
      if constexpr (WRITES) {
#pragma unroll
        for (int g = 0; g < STEP; ++g)
#pragma unroll
          for (int i = 0; i < GROUP; ++i) cb[g][(i0 + i) * NC + t] = x[g][i][0];
      }
    }
    if constexpr (RELEASES) release<FENCE>(empty, sl);
  }
  for (; k < nch; ++k) {  // the rest a chunk at a time, each vector checked
    if constexpr (KIND == ARRIVE) mbar_wait(&full[slot], phase);
    uint4* cb = rbuf + (i64)slot * RG_CHUNK_U4;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int v = k * CV + i * NC + t;
      if (v < staged) {
        uint4 x[A];
#pragma unroll
        for (int a = 0; a < A; ++a) x[a] = cb[a * CV + i * NC + t];
        on_vector(x, v);
        if constexpr (WRITES) cb[i * NC + t] = x[0];
      }
    }
    const int sl[1] = {slot};
    if constexpr (RELEASES) release<FENCE>(empty, sl);
    next();
  }
}

// Forward statistics of wave P (P.r, P.w, P.slot, P.phase set): overflow and edges first
// (global loads, while the staged chunks land); 1a. the thread's max over its staged
// vectors; 1b. e = exp(x - max) in place and its sum; the CTA's (m, s) published.
template <class T, int VEC>
__device__ void fwd_stats(const Ctx<T>& c, Wave& P) {
  typedef typename T::raw R;
  constexpr int NC = RG_CONSUMERS, CV = RG_CHUNK_U4;
  const int t = threadIdx.x;
  const R* xr = c.a + P.r * c.lda;
  const RowSlice s = row_slice<T, VEC>(xr, c.cols, c.S, c.rank, c.cap, CV);
  P.nch = s.nch;
  const R* xb = xr + s.sp.head + s.v0 * VEC;
  P.e0 = P.e1 = -KA_INF;
  if (c.rank == 0) load_edges<T, VEC>(xr, s.sp, t, -KA_INF, P.e0, P.e1);
  float mo, so;
  online_stats<T, VEC, 2, NC>(xb + (i64)s.staged * VEC, s.n - s.staged, t, P.e0, P.e1, mo, so);
  float ms = -KA_INF;
#if RG_PACKED_MATH
  if constexpr (T::KIND != 0) {  // 16-bit values: their max two at a time, no conversions
    unsigned m2 = max2_init<T>();
    walk_chunks<CV, NC, ARRIVE, 1, RG_BATCH_MAX>(
        c.rbuf, c.full, c.empty, c.ring, P.slot, P.phase, s.nch, s.staged,
        [&](const uint4 (&x)[1], int) { m2 = max2_pack<T>(x[0], m2); });
    ms = max2_value<T>(m2);
  } else
#endif
    walk_chunks<CV, NC, ARRIVE, 1, RG_BATCH_MAX>(
        c.rbuf, c.full, c.empty, c.ring, P.slot, P.phase, s.nch, s.staged,
        [&](const uint4 (&x)[1], int) {
          float f[VEC];
          unpack16<T, VEC>(x[0], f);
#pragma unroll
          for (int q = 0; q < VEC; ++q) ms = fmaxf(ms, f[q]);
        });
  float ss = 0.f;
  if (ms != -KA_INF)  // (all -inf: nothing to store; the output pass writes zeros)
    walk_chunks<CV, NC, REWRITE, 1, RG_BATCH_EXP>(
        c.rbuf, c.full, c.empty, c.ring, P.slot, P.phase, s.nch, s.staged,
        [&](uint4 (&x)[1], int) {
          float f[VEC];
          unpack16<T, VEC>(x[0], f);
#pragma unroll
          for (int q = 0; q < VEC; ++q) f[q] = exp_shifted(f[q], ms);
          ss += tree_sum<VEC>(f);
          x[0] = pack16<T, VEC>(f);  // e in place
        });
  P.ms = ms;
  float m = ms, sum = ss;
  pair_merge(m, sum, mo, so);
  cta_pair(m, sum, c.red + (P.w & 1) * 64);
  RG_TRACE_ONLY(if (t == 0) trace_wave(trace_of(c.ws), P.w, TW_STATS);)
  P.ca = m;
  P.cb = sum;
  if (t == 0 && c.S > 1) publish(slot_of(c.ws, blockIdx.x, P.w), tag_of(c.hi, P.w), m, sum);
}

// Forward output of wave P: the group's (max, sum) (warp 0 waits for the S partials), then
// y from shared memory, releasing each chunk, and the overflow and edges from global.
template <class T, int VEC>
__device__ void fwd_finish(const Ctx<T>& c, const Wave& P) {
  typedef typename T::raw R;
  constexpr int NC = RG_CONSUMERS, CV = RG_CHUNK_U4;
  const int t = threadIdx.x, lane = t & 31;
  if ((t >> 5) == 0) {
    float m = P.ca, sum = P.cb;
    if (c.S > 1) {
      const u64 tag = tag_of(c.hi, P.w);
      m = -KA_INF;
      sum = 0.f;
      for (int p = lane; p < c.S; p += 32) {
        const u64* ps = slot_of(c.ws, (i64)c.group * c.S + p, P.w);
        wait_tag(ps, tag);
        const float* v = reinterpret_cast<const float*>(ps + 1);
        pair_merge(m, sum, ld_relaxed(v), ld_relaxed(v + 1));
      }
      warp_pair(m, sum);
    }
    if (lane == 0) {
      c.bc[0] = m;
      c.bc[1] = sum;
    }
  }
  consumer_sync();
  RG_TRACE_ONLY(if (t == 0) trace_wave(trace_of(c.ws), P.w, TW_MET);)
  const float row_max = c.bc[0];
  // An all -inf row gives NaN, as torch.softmax does.
  const float inv = row_max == -KA_INF ? __int_as_float(0x7fc00000) : 1.f / c.bc[1];
  const float ms = P.ms;
  const float scale = ms == -KA_INF ? 0.f * inv : exp_shifted(ms, row_max) * inv;
  const R* xr = c.a + P.r * c.lda;
  R* yr = c.out + P.r * c.ldo;
  const RowSlice s = row_slice<T, VEC>(xr, c.cols, c.S, c.rank, c.cap, CV);
  const i64 o = s.sp.head + s.v0 * VEC;
  auto y_of = [&](const uint4& e, float (&f)[VEC]) {
    if (ms != -KA_INF) {
      unpack16<T, VEC>(e, f);
    } else {
#pragma unroll
      for (int q = 0; q < VEC; ++q) f[q] = 0.f;
    }
#pragma unroll
    for (int q = 0; q < VEC; ++q) f[q] *= scale;
  };
  // Values in flight per thread in the float output passes: f32 with two vectors per chunk
  // takes two chunks per step (+1-7 %; its traced build, whose stamps take registers, one);
  // f16 (at 96 registers, where batches spill) and 4 vectors per chunk were as fast or faster
  // with the plain walk. (bf16 comes here only for a slice of -inf: 2, what keeps its traced
  // build without spills.)
#ifdef RG_TRACE
  constexpr int F32_OUT_BATCH = 2;
#else
  constexpr int F32_OUT_BATCH = 4;
#endif
  constexpr int FLOAT_OUT_BATCH = RG_BATCH_OUT_FLOAT >= 0 ? RG_BATCH_OUT_FLOAT
                                  : T::KIND == 1                ? 2
                                  : T::KIND == 0 && CV / NC <= 2 ? F32_OUT_BATCH
                                                                 : 0;
#if RG_BULK_OUT
  // y over e in the chunk, handed to the storer
#if RG_PACKED_MATH
  if (T::KIND == 1 && ms != -KA_INF) {  // bf16: e times the scale two at a time, rounded once
    unsigned hi2, lo2;
    scale_split_bf16(scale, hi2, lo2);
    walk_chunks<CV, NC, RELEASE_WROTE, 1, RG_BATCH_OUT_BF16>(
        c.rbuf, c.full, c.written, c.ring, P.slot, P.phase, s.nch, s.staged,
        [&](uint4 (&x)[1], int) { x[0] = scale_pack_bf16(x[0], hi2, lo2); });
  } else
#endif
    walk_chunks<CV, NC, RELEASE_WROTE, 1, FLOAT_OUT_BATCH>(
        c.rbuf, c.full, c.written, c.ring, P.slot, P.phase, s.nch, s.staged,
        [&](uint4 (&x)[1], int) {
          float f[VEC];
          y_of(x[0], f);
          x[0] = pack16<T, VEC>(f);
        });
#else
  walk_chunks<CV, NC, RELEASE_FENCED, 1, FLOAT_OUT_BATCH>(
      c.rbuf, c.full, c.empty, c.ring, P.slot, P.phase, s.nch, s.staged,
      [&](const uint4 (&x)[1], int v) {
        float f[VEC];
        y_of(x[0], f);
        store_vec<T, VEC>(yr + o + (i64)v * VEC, f);
      });
#endif
  const i64 oo = o + (i64)s.staged * VEC;
  write_scaled<T, VEC, 2, NC>(xr + oo, yr + oo, s.n - s.staged, t, row_max, inv);
  if (c.rank == 0) store_edges<T, VEC>(yr, s.sp, t, exp_shifted(P.e0, row_max) * inv, exp_shifted(P.e1, row_max) * inv);
  RG_TRACE_ONLY(trace_stored(c, P.w);)
}

// Backward statistics of wave P: sum(dy * y) over the overflow, the edges and the staged
// chunks (dy's vectors, then y's), published.
template <class T, int VEC>
__device__ void bwd_stats(const Ctx<T>& c, Wave& P) {
  typedef typename T::raw R;
  constexpr int NC = RG_CONSUMERS, CV = RG_CHUNK_U4 / 2, VPT = CV / NC;
  static_assert(VPT >= 1, "a backward chunk holds at least one vector per consumer");
  const int t = threadIdx.x;
  const R* gr = c.a + P.r * c.lda;
  const R* yr = c.b + P.r * c.ldb;
  const RowSlice s = row_slice<T, VEC>(yr, c.cols, c.S, c.rank, c.cap, CV);
  P.nch = s.nch;
  const i64 oo = s.sp.head + (s.v0 + s.staged) * VEC;  // the overflow's first element
  P.e0 = P.e1 = P.e2 = P.e3 = 0.f;
  if (c.rank == 0) {
    load_edges<T, VEC>(gr, s.sp, t, 0.f, P.e0, P.e1);
    load_edges<T, VEC>(yr, s.sp, t, 0.f, P.e2, P.e3);
  }
  float dot = P.e0 * P.e2 + P.e1 * P.e3 + dot_stats<T, VEC, 2, NC>(gr + oo, yr + oo, s.n - s.staged, t);
  walk_chunks<CV, NC, ARRIVE, 2, RG_BATCH_BWD>(
      c.rbuf, c.full, c.empty, c.ring, P.slot, P.phase, s.nch, s.staged,
      [&](const uint4 (&x)[2], int) {
        float g[VEC], v[VEC];
        unpack16<T, VEC>(x[0], g);
        unpack16<T, VEC>(x[1], v);
#pragma unroll
        for (int q = 0; q < VEC; ++q) dot = fmaf(g[q], v[q], dot);
      });
  dot = cta_sum(dot, c.red + (P.w & 1) * 64);
  RG_TRACE_ONLY(if (t == 0) trace_wave(trace_of(c.ws), P.w, TW_STATS);)
  P.ca = dot;
  if (t == 0 && c.S > 1) publish(slot_of(c.ws, blockIdx.x, P.w), tag_of(c.hi, P.w), dot, 0.f);
}

// Backward output of wave P: the group's sum(dy * y), then dx = y * (dy - dot).
template <class T, int VEC>
__device__ void bwd_finish(const Ctx<T>& c, const Wave& P) {
  typedef typename T::raw R;
  constexpr int NC = RG_CONSUMERS, CV = RG_CHUNK_U4 / 2;
  const int t = threadIdx.x, lane = t & 31;
  if ((t >> 5) == 0) {
    float dot = P.ca;
    if (c.S > 1) {
      const u64 tag = tag_of(c.hi, P.w);
      float total = 0.f;
      for (int p = lane; p < c.S; p += 32) {
        const u64* ps = slot_of(c.ws, (i64)c.group * c.S + p, P.w);
        wait_tag(ps, tag);
        total += ld_relaxed(reinterpret_cast<const float*>(ps + 1));
      }
      dot = warp_sum(total);
    }
    if (lane == 0) c.bc[0] = dot;
  }
  consumer_sync();
  RG_TRACE_ONLY(if (t == 0) trace_wave(trace_of(c.ws), P.w, TW_MET);)
  const float dot = c.bc[0];
  const R* gr = c.a + P.r * c.lda;
  const R* yr = c.b + P.r * c.ldb;
  const RowSlice s = row_slice<T, VEC>(yr, c.cols, c.S, c.rank, c.cap, CV);
  R* dr = c.out + P.r * c.ldo;
  const i64 o = s.sp.head + s.v0 * VEC;
  auto dx_of = [&](const uint4 (&x)[2], float (&g)[VEC]) {
    float u[VEC];
    unpack16<T, VEC>(x[0], g);
    unpack16<T, VEC>(x[1], u);
#pragma unroll
    for (int q = 0; q < VEC; ++q) g[q] = u[q] * (g[q] - dot);
  };
#if RG_BULK_OUT
  // dx over dy in the chunk, handed to the storer
  walk_chunks<CV, NC, RELEASE_WROTE, 2, RG_BATCH_BWD>(
      c.rbuf, c.full, c.written, c.ring, P.slot, P.phase, s.nch, s.staged,
      [&](uint4 (&x)[2], int) {
        float g[VEC];
        dx_of(x, g);
        x[0] = pack16<T, VEC>(g);
      });
#else
  walk_chunks<CV, NC, RELEASE, 2, RG_BATCH_BWD>(
      c.rbuf, c.full, c.empty, c.ring, P.slot, P.phase, s.nch, s.staged,
      [&](const uint4 (&x)[2], int v) {
        float g[VEC];
        dx_of(x, g);
        store_vec<T, VEC>(dr + o + (i64)v * VEC, g);
      });
#endif
  const i64 oo = o + (i64)s.staged * VEC;
  write_grad<T, VEC, 2, NC>(gr + oo, yr + oo, dr + oo, s.n - s.staged, t, dot);
  if (c.rank == 0) store_edges<T, VEC>(dr, s.sp, t, P.e2 * (P.e0 - dot), P.e3 * (P.e1 - dot));
  RG_TRACE_ONLY(trace_stored(c, P.w);)
}

// The consumers' waves. With `ahead`, wave w + 1's statistics are taken and published
// before waiting for wave w's group, so the meeting's latency hides behind that work (the
// ring then holds two waves' chunks: the host allows it only when three fit).
template <class T, int VEC, bool BWD>
__device__ void consume(const Ctx<T>& c, bool ahead) {
  int slot = 0;
  unsigned phase = 0;
  Wave P, N;
  P.r = c.group;
  P.w = 0;
  P.slot = slot;
  P.phase = phase;
  if (P.r >= c.rows) return;  // (the host makes G <= rows)
  if constexpr (BWD) bwd_stats<T, VEC>(c, P); else fwd_stats<T, VEC>(c, P);
  advance(slot, phase, P.nch, c.ring);
  for (;;) {
    const bool more = P.r + c.G < c.rows;
    if (more) {
      N.r = P.r + c.G;
      N.w = P.w + 1;
      N.slot = slot;
      N.phase = phase;
    }
    if (more && ahead) {
      if constexpr (BWD) bwd_stats<T, VEC>(c, N); else fwd_stats<T, VEC>(c, N);
      advance(slot, phase, N.nch, c.ring);
    }
    if constexpr (BWD) bwd_finish<T, VEC>(c, P); else fwd_finish<T, VEC>(c, P);
    if (!more) break;
    if (!ahead) {
      if constexpr (BWD) bwd_stats<T, VEC>(c, N); else fwd_stats<T, VEC>(c, N);
      advance(slot, phase, N.nch, c.ring);
    }
    P = N;
  }
}

}  // namespace rowgroup

// The dynamic shared memory: the ring of `ring` chunks.
extern __shared__ __align__(128) uint4 rg_ring[];

namespace rowgroup {
// One CTA's whole run, either direction: the ring, the producer warp, the consumers' waves.
// `a`, `b`: the forward's x (twice) or the backward's dy and y; `out`: y or dx.
template <class T, int VEC, bool BWD>
__device__ __forceinline__ void run(const typename T::raw* __restrict__ a, const typename T::raw* __restrict__ b,
                                    typename T::raw* __restrict__ out, i64 rows, i64 cols, i64 lda, i64 ldb,
                                    i64 ldo, u64* ws, i64 epoch, i64 S, i64 G, i64 cap, i64 ring, i64 ahead) {
  __shared__ __align__(8) u64 full[RG_MAX_CHUNKS], empty[RG_MAX_CHUNKS];
#if RG_BULK_OUT
  __shared__ __align__(8) u64 written[RG_MAX_CHUNKS];
#else
  u64* const written = nullptr;
#endif
  __shared__ float red[128];
  __shared__ float bc[2];
  RG_TRACE_ONLY(u64* const tr = trace_of(ws); if (threadIdx.x == 0) tr[TR_ENTRY] = global_timer();)
  check_plan(S, G, cap, ring, ahead, BWD ? RG_CHUNK_U4 / 2 : RG_CHUNK_U4);
  init_ring(full, empty, written, (int)ring);
#if RG_STAGGER_NS
  // The upper half of the row groups starts RG_STAGGER_NS late when there are 4+ waves: the
  // groups' load/store phases then fall less on the others' meetings and normalisation, when
  // they move no bytes (forwards 3-5 % faster; a lone wave would only wait).
  if (G > 1 && rows >= 4 * G && (i64)blockIdx.x / S >= (G + 1) / 2) {
    const u64 t0 = global_timer();
    while (global_timer() - t0 < (u64)RG_STAGGER_NS) asm volatile("nanosleep.u32 %0;" ::"r"(256u));
  }
#endif
  RG_TRACE_ONLY(if (threadIdx.x == 0) tr[TR_READY] = global_timer();)
  if (threadIdx.x >= RG_CONSUMERS) {
    if (threadIdx.x == RG_CONSUMERS)
      produce<T, VEC, BWD>(a, b, rows, (int)cols, lda, ldb, (int)S, (int)G, (int)cap, (int)ring, rg_ring, full,
                           empty RG_TRACE_ONLY(, tr));
#if RG_BULK_OUT
    // the storer: the slices follow the forward's x, the backward's y (their peeled spans)
    if (threadIdx.x == RG_CONSUMERS + 32)
      store_out<T, VEC, BWD>(BWD ? b : a, out, rows, (int)cols, BWD ? ldb : lda, ldo, (int)S, (int)G, (int)cap,
                             (int)ring, rg_ring, written, empty);
#endif
    return;
  }
  const Ctx<T> c{a, b, out, rows, lda, ldb, ldo, (int)cols, (int)S, (int)G, (int)cap, (int)ring,
                 (int)(blockIdx.x % S), (int)(blockIdx.x / S), ws, launch_tag(epoch), rg_ring, full, empty, red, bc,
                 written};
  consume<T, VEC, BWD>(c, ahead != 0);
  RG_TRACE_ONLY(trace_exit(c);)
}
}  // namespace rowgroup

template <class T, int VEC>
__global__ void __launch_bounds__(RG_THREADS, RG_MIN_BLOCKS)
    fwd_rowgroup(const typename T::raw* __restrict__ x, typename T::raw* __restrict__ y, i64 rows, i64 cols, i64 ldx,
                 i64 ldy, u64* ws, i64 epoch, i64 S, i64 G, i64 cap, i64 ring, i64 ahead) {
  rowgroup::run<T, VEC, false>(x, x, y, rows, cols, ldx, ldx, ldy, ws, epoch, S, G, cap, ring, ahead);
}

template <class T, int VEC>
__global__ void __launch_bounds__(RG_THREADS, RG_MIN_BLOCKS)
    bwd_rowgroup(const typename T::raw* __restrict__ dy, const typename T::raw* __restrict__ y,
                 typename T::raw* __restrict__ dx, i64 rows, i64 cols, i64 lddy, i64 ldy, i64 lddx, u64* ws, i64 epoch,
                 i64 S, i64 G, i64 cap, i64 ring, i64 ahead) {
  rowgroup::run<T, VEC, true>(dy, y, dx, rows, cols, lddy, ldy, lddx, ws, epoch, S, G, cap, ring, ahead);
}

}  // namespace ka_softmax
