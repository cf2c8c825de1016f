// Copy pipelines for benchmarks/stream_probe.py: how much of a plain copy's rate each way of staging
// a persistent CTA's parts in shared memory keeps (the long-row softmax's memory structure, without
// its math or its waits). Every kernel copies n 16-byte vectors from src to dst; a part is BV
// vectors, part w at src + w * BV; parts are dealt to the persistent CTAs as the window softmax
// deals its steps (CTA b: parts b, b + G, ...). Each thread also reads the vectors it staged for
// the "statistics" (a running xor, stored only when impossible), as the softmax reads its ring.

typedef unsigned long long u64;

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ unsigned fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

// The reference: a non-persistent copy, each thread 4 vectors (what torch's copy kernel does).
extern "C" __global__ void grid_copy(const uint4* __restrict__ src, uint4* __restrict__ dst, long long n) {
  const long long i0 = ((long long)blockIdx.x * blockDim.x) * 4 + threadIdx.x;
  uint4 v[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const long long i = i0 + (long long)u * blockDim.x;
    if (i < n) v[u] = src[i];
  }
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const long long i = i0 + (long long)u * blockDim.x;
    if (i < n) dst[i] = v[u];
  }
}

// Persistent, registers only: each thread loads its vectors of the next part while it stores
// those of the current one (no shared memory, no lag: the upper bound of a persistent copy).
template <int U, int THREADS>
__global__ void __launch_bounds__(THREADS, 2) reg_copy(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                                       int parts) {
  constexpr int BV = U * THREADS;
  const int t = threadIdx.x, G = gridDim.x;
  uint4 a[U];
  int j = blockIdx.x;
  if (j < parts) {
#pragma unroll
    for (int u = 0; u < U; ++u) a[u] = src[(long long)j * BV + u * THREADS + t];
  }
  for (; j < parts; j += G) {
    uint4 b[U];
    const int jn = j + G;
    if (jn < parts) {
#pragma unroll
      for (int u = 0; u < U; ++u) b[u] = src[(long long)jn * BV + u * THREADS + t];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) dst[(long long)j * BV + u * THREADS + t] = a[u];
#pragma unroll
    for (int u = 0; u < U; ++u) a[u] = b[u];
  }
}

// The window softmax's structure: each thread cp.async-copies its vectors of part j + PD * G into
// a ring of NSLOT parts, waits for part j's, reads them (the statistics), optionally meets the
// CTA at a barrier (SYNC, as the softmax's block reduction does), and stores part j - LAG * G from
// the ring (LAG 0: the part just read; the softmax's lag of one grid is LAG 1).
template <int U, int THREADS, int NSLOT, int PD, int LAG, int SYNC>
__global__ void __launch_bounds__(THREADS, 2) ring_copy(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                                        int parts, unsigned* sink) {
  static_assert(NSLOT >= PD + 1 + LAG, "the ring holds the copies in flight, the current part and the lagged ones");
  constexpr int BV = U * THREADS;
  extern __shared__ uint4 ring[];
  __shared__ unsigned red[THREADS / 32];
  const int t = threadIdx.x, G = gridDim.x;
  const int steps = parts + LAG * G;
  auto issue = [&](int j, int slot) {
    if (j < parts) {
#pragma unroll
      for (int u = 0; u < U; ++u) cp_async16(ring + slot * BV + u * THREADS + t, src + (long long)j * BV + u * THREADS + t);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int q = 0; q < PD; ++q) issue((int)blockIdx.x + q * G, q);
  unsigned acc = 0;
  int k = 0;
  for (int j = blockIdx.x; j < steps; j += G, ++k) {
    issue(j + PD * G, (k + PD) % NSLOT);
    cp_async_wait<PD>();
    if (j < parts) {
      const uint4* s = ring + (k % NSLOT) * BV;
#pragma unroll
      for (int u = 0; u < U; ++u) acc ^= fold(s[u * THREADS + t]);
      if (SYNC) {
        acc ^= __shfl_xor_sync(0xffffffffu, acc, 16);
        if ((t & 31) == 0) red[t >> 5] = acc;
        __syncthreads();
        acc ^= red[(t >> 5) ^ 1];
      }
    }
    const int w = j - LAG * G;
    if (w >= 0 && w < parts) {
      const uint4* s = ring + ((k + NSLOT - LAG) % NSLOT) * BV;
#pragma unroll
      for (int u = 0; u < U; ++u) dst[(long long)w * BV + u * THREADS + t] = s[u * THREADS + t];
    }
  }
  cp_async_wait<0>();
  if (acc == 0x9E3779B9u && t == 1023) sink[0] = acc;  // (never: keeps the reads)
}

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(u64* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect(u64* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_load(void* smem, const void* gmem, unsigned bytes, u64* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(smem)),
               "l"(gmem), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
__device__ __forceinline__ void bulk_store(void* gmem, const void* smem, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem), "r"(smem_addr(smem)),
               "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
__device__ __forceinline__ void bulk_store_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// TMA bulk copies: thread 0 loads part j + PD * G into the ring with one bulk copy on the slot's
// mbarrier; every thread waits on it, reads its vectors, and the part j - LAG * G goes out either
// through each thread's stores (BULK_OUT 0) or, rewritten in place (the softmax's output is
// computed), as one bulk store by thread 0 (BULK_OUT 1). A barrier per step frees the slot the
// next load refills (and orders the in-place writes before the bulk store).
template <int U, int THREADS, int NSLOT, int PD, int LAG, int BULK_OUT>
__global__ void __launch_bounds__(THREADS, 2) bulk_copy(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                                        int parts, unsigned* sink) {
  static_assert(NSLOT >= PD + 1 + LAG, "the ring holds the copies in flight, the current part and the lagged ones");
  constexpr int BV = U * THREADS;
  constexpr unsigned BYTES = BV * 16;
  extern __shared__ uint4 ring[];
  __shared__ __align__(8) u64 full[NSLOT];
  const int t = threadIdx.x, G = gridDim.x;
  const int steps = parts + LAG * G;
  if (t == 0) {
    for (int s = 0; s < NSLOT; ++s) mbar_init(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int j, int slot) {  // (thread 0)
    if (j < parts) {
      mbar_expect(&full[slot], BYTES);
      bulk_load(ring + slot * BV, src + (long long)j * BV, BYTES, &full[slot]);
    }
  };
  if (t == 0) {
    for (int q = 0; q < PD; ++q) issue((int)blockIdx.x + q * G, q);
  }
  unsigned acc = 0;
  int k = 0;
  for (int j = blockIdx.x; j < steps; j += G, ++k) {
    if (t == 0) {
      if (BULK_OUT) bulk_store_wait_read();  // (the slot refilled next may still be going out)
      issue(j + PD * G, (k + PD) % NSLOT);
    }
    if (j < parts) {
      mbar_wait(&full[k % NSLOT], (k / NSLOT) & 1);
      const uint4* s = ring + (k % NSLOT) * BV;
#pragma unroll
      for (int u = 0; u < U; ++u) acc ^= fold(s[u * THREADS + t]);
    }
    const int w = j - LAG * G;
    if (w >= 0 && w < parts) {
      uint4* s = ring + ((k + NSLOT - LAG) % NSLOT) * BV;
      if (BULK_OUT) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          uint4 v = s[u * THREADS + t];
          v.x ^= acc & 0u;  // (the output "computed" in place)
          s[u * THREADS + t] = v;
        }
        fence_async_smem();
        __syncthreads();
        if (t == 0) bulk_store(dst + (long long)w * BV, s, BYTES);
      } else {
#pragma unroll
        for (int u = 0; u < U; ++u) dst[(long long)w * BV + u * THREADS + t] = s[u * THREADS + t];
      }
    }
    __syncthreads();  // (every thread is done with the slots of this step before the next refill)
  }
  if (BULK_OUT && t == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  if (acc == 0x9E3779B9u && t == 1023) sink[0] = acc;
}
