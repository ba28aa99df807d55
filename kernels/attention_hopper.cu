// kernels/attention_hopper.cu - the fast attention kernels the model uses on Hopper (sm_90a), their
// launchers, and the dispatch between them and attention.cu's reference kernels.
//
// The contract is attention.cu's (causal, grouped-query, bf16 in and out, fp32 lse in natural
// log, every offset 64-bit) for the shapes these kernels support: head dim 128, whole GQA
// groups, 16-byte aligned tensors with row strides of multiples of 8 elements, fewer than 2^31
// tokens per sequence, an sm_90 GPU (attention_hopper_applies). Every other call goes to
// attention.cu, which stays the readable reference and the test oracle.
//
// Kernels (namespace hopper). The first four have blocks of 384 threads: a producer warpgroup
// and two consumer warpgroups, consumer c owning rows (or keys) 64c..64c+63 of the block's 128.
//   forward_kernel      O and lse; a block: 128 query rows of one head, walking 128-key tiles.
//   dkdv_kernel<false>  dK and dV; a block: 128 keys of one KV head, walking every query head of
//                       its GQA group and their 64-row query tiles at or after its keys.
//   dq_kernel           dQ; a block: 128 query rows of one head, walking 64-key tiles.
//   dkdv_kernel<true>   the fused backward: dkdv_kernel<false>'s work, plus each step's part of
//                       dQ = dS K, added in fp32 to a workspace in a fixed order.
//   dq_convert_kernel   the fused backward's last step; a block: 64 query rows of one head,
//                       whose fp32 dQ sums it scales and rounds to bf16.
// Launchers: attention_forward_hopper (forward_kernel); attention_backward_hopper (delta given:
// dkdv_kernel<false> then dq_kernel, or, with a dQ workspace, dkdv_kernel<true> then
// dq_convert_kernel). attention_forward and attention_backward, at the end of the file, are the
// dispatch the model calls. Measurements and the tuning history: docs/attention.md.
//
// What makes them fast, compared with attention.cu's mma.sync kernels:
//
//  * wgmma: a warpgroup (4 warps, 128 threads) issues one 64 x N x 16 product at a time,
//    asynchronously, with both operands read by the tensor cores straight from shared memory
//    (or the left one from registers). No ldmatrix, no per-warp fragments of B.
//  * TMA: tiles are copied global -> shared by the TMA unit (cp.async.bulk.tensor), one
//    instruction per [rows x 64 columns] box, already in the 128-byte swizzled layout the wgmma
//    descriptors read. Rows past the end of a sequence come back as zeros (a 3-D tensor map
//    [batch][seq][columns]), so there is no bounds code in the loads.
//  * Warp specialization: warpgroup 0 is the producer (one thread issues the copies, gives
//    most of its registers to the others with setmaxnreg); warpgroups 1 and 2 compute, each on
//    its 64 rows. Stages of a shared-memory ring are handed over with mbarriers: "full" when
//    the TMA unit has written them, "empty" when both consumers are done with them. In the
//    forward, the dQ kernel and the deterministic dK/dV kernel the two consumers take turns
//    issuing products, so that one's elementwise work (softmax; dS) runs while the other's
//    products do (FlashAttention-3's "ping-pong").
//  * Transposes are free: a product that needs an operand with the other dimension contiguous
//    (V in O += P V; dO, Q in dV, dK; K in dQ) reads the same tile through an MN-major
//    descriptor (wgmma's transpose bit), so every tile is loaded once in one layout.
//  * Causal tiles on and below the diagonal only (per block; inside a block, the dQ kernel's and
//    the fused dK/dV kernel's consumers compute a tile that lies wholly after their rows masked
//    to zeros, since their turns or barriers need every step), mask arithmetic on edge tiles
//    only, and longest-first block order (blocks with the most tiles to walk start first,
//    so the last wave is short ones; in the forward, and in the backward from 16K tokens,
//    within each KV head, whose blocks run together).
//
// Forward, one block per 128 query rows of one head (consumer c owns rows 64c..64c+63):
//   S = Q K^T       wgmma m64n128k16, A = Q (registers, read from shared memory once per block),
//                   B = K tile (shared, K-major), 8 k-steps
//   P = exp(S - m)  online softmax in registers (the accumulator layout of S is the register
//                   A-operand layout of the next product, so P never leaves registers)
//   O += P V        wgmma m64n128k16, A = P (registers), B = V tile (shared, MN-major)
//   per key tile j a consumer issues S_j and O += P_{j-1} V_{j-1} together, in turn with the
//   other consumer; once S_j is done it computes its softmax while O += P_{j-1} V_{j-1} and the
//   other consumer's products run.
//
// Backward (delta = rowsum(dO * O) given), deterministic and without atomics as attention.cu:
//   dK/dV kernel, one block per 128 keys of one KV head (consumer c: keys 64c..), walking every
//   query head of the GQA group and its 64-row query tiles at or after the block's keys, its
//   consumers taking turns (S^T and dP^T, then dV and dK):
//     S^T = K Q^T, dP^T = V dO^T           (m64n64k16, both operands shared)
//     P^T = exp(S^T - lse), dS^T = P^T (dP^T - delta)
//     dV += P^T dO, dK += dS^T Q           (m64n128k16, A = registers, B = MN-major shared)
//   dQ kernel, one block per 128 query rows of one head, walking 64-key tiles, its consumers
//   taking turns as the forward's do:
//     S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K (K MN-major)
//   S and dP are computed in both kernels (7 products where 5 are counted): the price of no
//   atomics, and of no fp32 dQ accumulator (4 bytes per element of dQ) beside the bf16 tensors.
// Fused backward (--attention fused, and what --attention auto takes where the workspace fits:
//   an fp32 dQ workspace given): the dK/dV kernel also computes dQ = dS K per step and has the
//   TMA unit add it to the workspace (see the kernel); 5 products, 4 bytes per dQ element. Its
//   adds to each query tile go in a fixed order (by key tile), so it too is bit-reproducible.
//
// Block order of the backward. From 16K tokens the backward kernels take their blocks KV head
// by KV head, as the forward does, so that a tile one of the blocks running at once reads is
// read by the others while L2 still holds it (across the KV heads, blocks sharing a head's tiles
// drift apart over their long lives until long sequences become bound by DRAM:
// bench/schedule_sim.cpp models it). Below 16K one KV head's blocks are less than a wave: there
// they go key tile by key tile across the heads, longest first (KV_MAJOR_MIN_TILES).

// Shared tiles: a [R][128] bf16 tile is two [R][64] halves (one TMA box each) of 128-byte rows;
// the 16-byte chunk c of row r sits at chunk c ^ (r % 8) (the 128-byte swizzle), so eight rows
// fill all 32 banks. Every tile starts on 1024 bytes, where the swizzle pattern repeats.
//   K-major descriptor (the contiguous dimension is the k of the product): start address,
//     8-row groups 1024 bytes apart; the k-slice 16j..16j+15 starts at half (j / 4), byte 32 (j % 4).
//   MN-major descriptor (contiguous along n): k-rows 16j.. start at byte 16 * 128 * j; the
//     8-row groups along k are 1024 bytes apart; the second 64 columns of n are one half further.

#include <cuda.h>  // the CUtensorMap type; the driver function itself comes through the runtime
#include <cudaTypedefs.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <set>

#include "attention_hopper_ptx.cuh"
#include "attention_ptx.cuh"
#include "documents.cuh"
#include "kernels/attention.h"

// These kernels need sm_90a (wgmma, setmaxnreg, TMA). Device code for any other target gets
// kernels that trap, so that builds for other GPUs (make GPU_ARCH=..., sm_80 alone or beside
// sm_90a) still compile and link; the dispatch launches them only on an sm_90 GPU.
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HOPPER_STUB 1
#else
#define HOPPER_STUB 0
#endif

namespace hopper {

constexpr int THREADS = 384;                 // producer warpgroup + two consumer warpgroups
#if !HOPPER_STUB
constexpr int PRODUCER_REGS = 56, CONSUMER_REGS = 224;  // docs/attention.md: the split measured
// setmaxnreg moves registers within the block's pool, which is what it was launched with: at most
// 168 a thread for 384 threads (64K / 384, in multiples of 8), 64,512 in all. An increase past the
// pool waits forever, so the split must fit it, not the SM's 65,536.
constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8;
static_assert(128 * PRODUCER_REGS + 256 * CONSUMER_REGS <= THREADS * LAUNCH_REGS && PRODUCER_REGS % 8 == 0 &&
                  CONSUMER_REGS % 8 == 0,
              "setmaxnreg: the warpgroups' registers fit the block's launch pool, in multiples of 8");
#endif
constexpr int TILE = 128 * 128 * 2;          // bytes of a [128][128] bf16 tile
constexpr int HALF_TILE = TILE / 2;          // a [64][128] tile

// The two consumer warpgroups taking turns at issuing products (FlashAttention-3's "ping-pong"):
// consumer c waits at named barrier 2 + c until the other one has issued its products and
// arrived there. Both take `n` turns. Each barrier sees as many arrivals as syncs: consumer 1
// arrives once ahead (consumer 0 goes first) and not after its last turn.
// (`on` false: no turns, every call does nothing.)
struct Turns {
    int c;
    int64_t n;
    bool on;
    __device__ Turns(int consumer, int64_t n_turns, bool on_ = true) : c(consumer), n(n_turns), on(on_) {
        if (on && c == 1) named_arrive(2, 256);
    }
    __device__ void mine() const {
        if (on) named_barrier(2 + c, 256);
    }
    __device__ void yours(int64_t turn) const {  // after turn number `turn` (0 .. n - 1)
        if (on && (c == 0 || turn + 1 < n)) named_arrive(3 - c, 256);
    }
};

// Shared-memory writes of this thread become visible to the async proxy (wgmma, bulk copies).
__device__ inline void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// global[0..bytes) += shared[0..bytes), fp32, by the TMA unit (one bulk group per call).
__device__ inline void bulk_reduce_add(float* global, uint32_t shared, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 "cp.async.bulk.commit_group;\n" ::"l"(global), "r"(shared), "r"(bytes)
                 : "memory");
}
// Wait until this thread's bulk groups have completed.
__device__ inline void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// The fused backward's ordered adds: wait until a count in global memory equals `value` (acquire),
// and set it (release). The fence after the acquire orders the TMA unit's adds (async proxy)
// after it. Before the release, the adds' completion (cp.async.bulk.wait_group 0) already implies
// a generic-async proxy fence (PTX ISA, "Async proxy"); the explicit one is belt and braces.
// A wait that lasts WAIT_COUNT_LIMIT_NS means the order is broken (a bug, or a GPU that does not
// start blocks in grid order): trap, so the launch fails with an error instead of hanging.
constexpr uint64_t WAIT_COUNT_LIMIT_NS = 20ull * 1000 * 1000 * 1000;
__device__ inline uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}
__device__ inline void wait_count(const int* count, int value) {
    int seen;
    uint64_t since = 0;
    for (uint32_t polls = 0;; polls++) {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(count) : "memory");
        if (seen == value) break;
        __nanosleep(32);
        if ((polls & 1023) == 1023) {  // the timer every 1024 polls, off the common short waits
            const uint64_t now = global_timer_ns();
            if (since == 0) since = now;
            else if ((int64_t)(now - since) > (int64_t)WAIT_COUNT_LIMIT_NS) __trap();  // signed: a timer step back is no wait
        }
    }
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
__device__ inline void release_count(int* count, int value) {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(count), "r"(value) : "memory");
}
// Wait until at most N of this thread's bulk groups have not read their sources yet.
template <int N>
__device__ inline void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"); }

// The k-steps of the two product shapes used more than once, issued (the caller commits):
// acc (64 x 64) (+)= A B^T over d: A = 64 rows of a [128][128] tile, B = a [R][128] tile, K-major.
__device__ inline void product_64_ss(float* acc, uint32_t a_rows, uint32_t b_tile, int b_rows, bool onto_acc = false) {
#pragma unroll
    for (int k = 0; k < HD / 16; k++) wgmma_64_ss(acc, kmajor_desc(a_rows, k, 128), kmajor_desc(b_tile, k, b_rows), onto_acc || k > 0);
}
// acc (64 x 128) += P B: P = registers (64 x R, from to_a), B = a [R][128] tile read MN-major.
template <int R>
__device__ inline void product_128_rs(float* acc, const uint32_t* p, uint32_t b_tile) {
#pragma unroll
    for (int kc = 0; kc < R / 16; kc++) wgmma_128_rs<1>(acc, p + 4 * kc, mnmajor_desc(b_tile, kc, R), 1);
}

// The accumulator fragments of columns 16j..16j+15 -> the register A fragment of k-step j.
// (Thread layout of both: row g (+8), columns 2t, 2t+1 (+8); g = lane / 4, t = lane % 4.)
__device__ inline void to_a(uint32_t* a, const float* c, int j) {
    a[0] = pack_bf16(c[8 * j + 0], c[8 * j + 1]);
    a[1] = pack_bf16(c[8 * j + 2], c[8 * j + 3]);
    a[2] = pack_bf16(c[8 * j + 4], c[8 * j + 5]);
    a[3] = pack_bf16(c[8 * j + 6], c[8 * j + 7]);
}

// Which consumer warpgroup this thread is in (0 or 1), read from lane 0 so that the compiler
// knows it is the same across the warp: the shared addresses and descriptors built from it then
// live in uniform registers, instead of being moved there before every product.
__device__ inline int consumer_index() { return __shfl_sync(0xffffffffu, (int)threadIdx.x / 128, 0) - 1; }

// Swizzled tiles start on 1024 bytes.
__device__ inline uint32_t aligned_smem() {
    extern __shared__ unsigned char smem_raw[];
    return (smem_u32(smem_raw) + 1023) & ~1023u;
}

// Where a consumer thread's accumulator elements sit: rows r0 = 16 * warp + g and r0 + 8 of its
// warpgroup's 64; element e of column block j is (row e / 2, column 8j + 2t + (e & 1)).
struct Lane {
    int warp, g, t;
    __device__ Lane() {
        const int lane = threadIdx.x % 32;
        warp = (threadIdx.x % 128) / 32, g = lane / 4, t = lane % 4;
    }
    __device__ int row(int half) const { return warp * 16 + g + 8 * half; }
    __device__ int col(int j, int e) const { return 8 * j + 2 * t + (e & 1); }
};

// The register A operand of all 8 k-slices of 64 rows of a [R][128] K-major tile in its TMA
// layout (two [R][64] halves, 128-byte rows, 16-byte chunk c of row r at chunk c ^ (r % 8)):
// a[4 kc + i] holds row ln.row(i & 1), columns 16 kc + 8 (i / 2) + 2t and + 1, as to_a lays
// out an accumulator. `rows` is the first of the 64 rows, in the first half, on a multiple of
// 8 rows.
__device__ inline void load_a_kmajor(uint32_t* a, uint32_t rows, int R, const Lane& ln) {
#pragma unroll
    for (int kc = 0; kc < 8; kc++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int row = ln.row(i & 1), col = 16 * kc + 8 * (i / 2) + 2 * ln.t;
            const int byte = 2 * (col % 64);
            const uint32_t addr = rows + (col / 64) * R * 128 + row * 128 + (((byte / 16) ^ (row % 8)) * 16) + byte % 16;
            asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(a[4 * kc + i]) : "r"(addr));
        }
}

// Zero this thread's elements (row r, column x) of a 64 x 64 accumulator tile where x - r < lo,
// x - r > hi or x >= x_end: the causal mask and the sequence's end on the tiles that cross them.
// x - r is a compile-time constant per element plus one per thread (2t - 16 warp - g), so each
// test is one 32-bit compare with an immediate. Call it on those tiles only, in a branch of its
// own: interleaved with the exponentials, the compiler evaluates the tests (in 64 bits) on every
// tile, before the step's first product.
__device__ inline void zero_outside(float* acc, const Lane& ln, int64_t lo, int64_t hi, int64_t x_end) {
    const int lane_diff = 2 * ln.t - ln.row(0);                  // x - r, less the constant part
    const int lo_t = (int)max(min(lo, (int64_t)128), (int64_t)-128) - lane_diff;  // |x - r| < 64
    const int hi_t = (int)max(min(hi, (int64_t)128), (int64_t)-128) - lane_diff;
    const int end_t = (int)min(x_end, (int64_t)128) - 2 * ln.t;
#pragma unroll
    for (int jj = 0; jj < 8; jj++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int x = 8 * jj + (e & 1), diff = x - 8 * (e / 2);  // x and x - r, less the lane's part
            if (diff < lo_t || diff > hi_t || x >= end_t) acc[4 * jj + e] = 0.f;
        }
}

// Zero this thread's elements (key row r, query column x) of a 64 x 64 tile of the dK/dV kernel
// where query q0 + x is at or past key_end[r], the end of the key's document.
__device__ inline void zero_after_documents(float* acc, const Lane& ln, int64_t q0, const int64_t* key_end) {
#pragma unroll
    for (int jj = 0; jj < 8; jj++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            if (q0 + ln.col(jj, e) >= key_end[e / 2]) acc[4 * jj + e] = 0.f;
}
// Zero this thread's elements (query row r, key column x) of a 64 x 64 tile of the dQ kernel
// where key k0 + x is before first[r], the first key of the row's document.
__device__ inline void zero_before_documents(float* acc, const Lane& ln, int64_t k0, const int64_t* first) {
#pragma unroll
    for (int jj = 0; jj < 8; jj++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            if (k0 + ln.col(jj, e) < first[e / 2]) acc[4 * jj + e] = 0.f;
}

// A position in a ring of STAGES shared-memory stages: the stage, and the parity of the phase of
// its mbarriers that the consumers wait for. (Kept as it goes: a 64-bit division by 3 per step
// otherwise.)
template <int STAGES>
struct Ring {
    int stage = 0;
    uint32_t phase = 0;
    __device__ void next() {
        if (++stage == STAGES) stage = 0, phase ^= 1;
    }
};

// The order in which a dK/dV block walks its steps (query head of the GQA group, 64-row query
// tile at or after its keys). By heads: each head's tiles from the diagonal up, head after head.
// By tiles (the fused kernel): from the last query tile (of its keys' document) down to the
// diagonal, all heads of a tile in turn. Then every block walks the tiles it shares with the
// block of the key tile before in the same order and at the same step, the two diagonal tiles
// that only the block before has coming after all of them; so with the ordered adds, a block
// started with the one before never waits for it by more than one add. By heads, it waits two
// steps at every head's start.
template <bool BY_TILES>
struct Walk {
    int head = 0;
    int64_t qt;
    const int64_t first_qt, n_qt;
    const int group;
    __device__ Walk(int64_t first, int64_t n, int g) : qt(BY_TILES ? n - 1 : first), first_qt(first), n_qt(n), group(g) {}
    __device__ void next() {
        if (BY_TILES) {
            if (++head == group) head = 0, qt--;
        } else if (++qt == n_qt) {
            qt = first_qt, head++;
        }
    }
};

// =============================================================================================
// Forward.
struct FwdParams {
    bf16* out;
    float* lse;
    int64_t ldo, seq, n_q_tiles;
    int n_heads, batch, group;
    float scale_log2;
    AttentionDocs docs;  // packed documents (documents.cuh), or none: causal
};
constexpr int FWD_STAGES = 2;
static_assert(FWD_STAGES >= 2, "forward_kernel waits for tile j's V before it frees tile j-1's (wait_tiles_after)");
constexpr int FWD_SMEM = 1024 + TILE * (1 + 2 * FWD_STAGES) + 8 * (1 + 4 * FWD_STAGES);

// Online softmax of one 64 x 128 tile of scores (log2 units after scaling): where `masked` (the
// diagonal tile; with documents, a tile that starts before a row's document), masks the keys a
// row does not see (keys from key0, rows from row0, first[r] the first key of the thread's row r);
// updates the running max and sum, leaves P in `sc` and returns in `correction` the factor O must
// be rescaled by.
// Without documents (DOCS false) the masked tile is the diagonal one: the test is in the tile's
// own coordinates (consumer c's rows 64c..), as 32-bit compares.
template <bool DOCS>
__device__ inline void online_softmax(float* sc, float* row_max, float* row_sum, float* correction, bool masked,
                                      int c, int64_t key0, int64_t row0, const int64_t* first, const Lane& ln,
                                      float scale_log2) {
    if (masked) {
#pragma unroll
        for (int jj = 0; jj < 16; jj++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const bool hidden = DOCS ? !DocumentView::sees(row0 + ln.row(e / 2), first[e / 2], key0 + ln.col(jj, e))
                                         : ln.col(jj, e) > c * 64 + ln.row(e / 2);
                if (hidden) sc[4 * jj + e] = -INFINITY;
            }
    }
    float scaled_max[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {  // a quad of lanes holds a row
        float mx = -INFINITY;
#pragma unroll
        for (int jj = 0; jj < 16; jj++) mx = fmaxf(mx, fmaxf(sc[4 * jj + 2 * r], sc[4 * jj + 2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(row_max[r], mx * scale_log2);
        scaled_max[r] = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet
        correction[r] = exp2_fast(row_max[r] - scaled_max[r]);
        row_max[r] = m_new;
        row_sum[r] *= correction[r];
    }
#pragma unroll
    for (int jj = 0; jj < 16; jj++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float pr = exp2_fast(fmaf(sc[4 * jj + e], scale_log2, -scaled_max[e / 2]));
            sc[4 * jj + e] = pr;
            row_sum[e / 2] += pr;
        }
}
// P (64 x 128, fp32 accumulator layout) -> the register A operand of O += P V.
__device__ inline void pack_p(uint32_t* pa, const float* sc) {
#pragma unroll
    for (int kc = 0; kc < 8; kc++) to_a(pa + 4 * kc, sc, kc);
}
__device__ inline void rescale(float* o, const float* correction) {
    // Where no row of the warp has a new maximum (most steps, away from the diagonal) every
    // factor is exactly 1: skip the 64 multiplications, bit for bit the same.
    if (__all_sync(0xffffffffu, correction[0] == 1.f && correction[1] == 1.f)) return;
#pragma unroll
    for (int jj = 0; jj < 16; jj++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[4 * jj + e] *= correction[e / 2];
}

// The consumers take turns at the tensor cores (FlashAttention-3's "ping-pong"): at step j a
// consumer issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} together, then lets the other consumer
// issue its pair (named barriers 2 and 3), so that one consumer's softmax runs while the other's
// products do. Within a consumer, the softmax of S_j runs while O += P_{j-1} V_{j-1} does; P_j
// is packed into the registers P_{j-1} used once that product is done, so no second set of P
// registers is needed.
template <bool DOCS>
__global__ void __launch_bounds__(THREADS, 1)
    forward_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                   const __grid_constant__ CUtensorMap map_v, const FwdParams p) {
#if !HOPPER_STUB
    const uint32_t sQ = aligned_smem(), sK = sQ + TILE, sV = sK + FWD_STAGES * TILE;
    const uint32_t bars = sV + FWD_STAGES * TILE;
    const uint32_t q_full = bars;
    auto k_full = [&](int s) { return bars + 8 * (1 + s); };
    auto v_full = [&](int s) { return bars + 8 * (1 + FWD_STAGES + s); };
    auto k_empty = [&](int s) { return bars + 8 * (1 + 2 * FWD_STAGES + s); };
    auto v_empty = [&](int s) { return bars + 8 * (1 + 3 * FWD_STAGES + s); };

    // Block -> (query tile, head, batch): KV head by KV head (so the blocks running at once read
    // the same K and V, from L2), and within one the longest query tiles (most key tiles) first.
    const int64_t per_kv_head = p.n_q_tiles * p.group, outer = blockIdx.x / per_kv_head, inner = blockIdx.x % per_kv_head;
    const int n_kv_heads = p.n_heads / p.group;
    const int b = (int)(outer / n_kv_heads), kvh = (int)(outer % n_kv_heads);
    const int h = kvh * p.group + (int)(inner % p.group);
    const int64_t q_tile = p.n_q_tiles - 1 - inner / p.group;
    // Key tiles j0 .. q_tile: with documents, none before the block's first row's document.
    const DocumentView docs(DOCS ? p.docs : AttentionDocs{}, p.seq);
    const int64_t q0 = q_tile * 128, j0 = DOCS ? docs.first_key(b, q0) / 128 : 0, n_kv_tiles = q_tile + 1 - j0;

    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        for (int s = 0; s < FWD_STAGES; s++) {
            mbar_init(k_full(s), 1), mbar_init(v_full(s), 1);
            mbar_init(k_empty(s), 256), mbar_init(v_empty(s), 256);
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (threadIdx.x < 128) {  // producer
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            mbar_arrive_expect_tx(q_full, TILE);
            tma_tile(sQ, &map_q, q_full, h, q0, b, 128);
            for (int64_t j = 0; j < n_kv_tiles; j++) {
                const int s = (int)(j % FWD_STAGES);
                const uint32_t phase = (uint32_t)((j / FWD_STAGES - 1) & 1);
                if (j >= FWD_STAGES) mbar_wait(k_empty(s), phase);
                mbar_arrive_expect_tx(k_full(s), TILE);
                tma_tile(sK + s * TILE, &map_k, k_full(s), kvh, (j0 + j) * 128, b, 128);
                if (j >= FWD_STAGES) mbar_wait(v_empty(s), phase);
                mbar_arrive_expect_tx(v_full(s), TILE);
                tma_tile(sV + s * TILE, &map_v, v_full(s), kvh, (j0 + j) * 128, b, 128);
            }
        }
        return;
    }
    setmaxnreg_inc<CONSUMER_REGS>();

    const int c = consumer_index();  // consumer: rows 64c..64c+63 of the tile
    const Lane ln;
    const uint32_t q_rows = sQ + c * 64 * 128;  // this consumer's rows, in each half of Q
    // Step j walks key tile j0 + j. A row sees the keys from its document's first on (first[r]
    // for this thread's rows; 0 without documents), up to itself.
    const int64_t row0 = q0 + c * 64;
    int64_t first[2] = {0, 0};
    if (DOCS)
        for (int r = 0; r < 2; r++) first[r] = docs.first_key(b, min(row0 + ln.row(r), p.seq - 1));
    auto masked = [&](int64_t j) { return j == n_kv_tiles - 1 || (DOCS && (j0 + j) * 128 < first[1]); };
    float o[64], sc[64], row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f}, correction[2];
    uint32_t pa[32];
#pragma unroll
    for (int i = 0; i < 64; i++) o[i] = 0.f;
    mbar_wait(q_full, 0);
    // This consumer's rows of Q, the left operand of every S = Q K^T, go to registers once: the
    // products then read only K from shared memory (4 KB per k-step instead of 6), and shared
    // memory's traffic and energy per step drop by a fifth; the kernel runs at its power cap.
    uint32_t qa[32];
    load_a_kmajor(qa, q_rows, 128, ln);

    // S = Q K^T of stage s (64 rows x 128 keys), issued and committed.
    auto issue_s = [&](int s) {
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < HD / 16; k++) wgmma_128_rs<0>(sc, qa + 4 * k, kmajor_desc(sK + s * TILE, k, 128), k > 0);
        wgmma_commit();
    };
    const Turns turns(c, n_kv_tiles);  // one per key tile

    // Wait until tile j's V and tile j + 1's K have arrived: both are read by the products the
    // next turn issues. Called after the softmax of tile j, where the loop (a branch) also ends
    // the softmax's basic block: ptxas moves a wgmma wait to the top of its block, so the wait for
    // O += P V that follows must be in a block of its own, or the softmax would not overlap it.
    auto wait_tiles_after = [&](int64_t j) {
        if (j + 1 < n_kv_tiles) mbar_wait(k_full((int)((j + 1) % FWD_STAGES)), (uint32_t)(((j + 1) / FWD_STAGES) & 1));
        mbar_wait(v_full((int)(j % FWD_STAGES)), (uint32_t)((j / FWD_STAGES) & 1));
    };

    // Tile 0: S_0 alone.
    mbar_wait(k_full(0), 0);
    turns.mine();
    issue_s(0);
    turns.yours(0);
    wgmma_wait<0>();
    fence_regs<64>(sc);
    mbar_arrive(k_empty(0));
    online_softmax<DOCS>(sc, row_max, row_sum, correction, masked(0), c, j0 * 128, row0, first, ln, p.scale_log2);
    wait_tiles_after(0);
    pack_p(pa, sc);

    for (int64_t j = 1; j < n_kv_tiles; j++) {
        const int s = (int)(j % FWD_STAGES), sp = (int)((j - 1) % FWD_STAGES);  // stages of tiles j, j - 1
        turns.mine();
        issue_s(s);
        product_128_rs<128>(o, pa, sV + sp * TILE);  // O += P_{j-1} V_{j-1}: V read MN-major
        wgmma_commit();
        turns.yours(j);
        wgmma_wait<1>();  // S_j done
        fence_regs<64>(sc);
        mbar_arrive(k_empty(s));
        online_softmax<DOCS>(sc, row_max, row_sum, correction, masked(j), c, (j0 + j) * 128, row0, first, ln, p.scale_log2);
        wait_tiles_after(j);
        wgmma_wait<0>();  // O += P_{j-1} V_{j-1} done: O can be rescaled, P_j packed
        fence_regs<64>(o);
        mbar_arrive(v_empty(sp));
        rescale(o, correction);
        pack_p(pa, sc);
    }

    // The last tile's O += P V (its V has arrived: wait_tiles_after).
    const int s_last = (int)((n_kv_tiles - 1) % FWD_STAGES);
    fence_regs<64>(o);
    wgmma_fence();
    product_128_rs<128>(o, pa, sV + s_last * TILE);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs<64>(o);
    mbar_arrive(v_empty(s_last));

    const int64_t tok0 = (int64_t)b * p.seq;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
        const int64_t row = q0 + c * 64 + ln.row(r);
        if (row >= p.seq) continue;
        const float inv = 1.f / row_sum[r];
        bf16* orow = p.out + (tok0 + row) * p.ldo + (int64_t)h * HD;
#pragma unroll
        for (int jj = 0; jj < 16; jj++)
            *(__nv_bfloat162*)(orow + ln.col(jj, 0)) =
                __floats2bfloat162_rn(o[4 * jj + 2 * r] * inv, o[4 * jj + 2 * r + 1] * inv);
        if (ln.t == 0) p.lse[((int64_t)b * p.n_heads + h) * p.seq + row] = (row_max[r] + log2f(row_sum[r])) * LN2;
    }
#else
    __trap();
#endif
}

// =============================================================================================
// Backward.
struct BwdParams {
    const float *lse, *delta;
    bf16 *dq, *dk, *dv;
    int64_t lddq, lddk, lddv, seq, n_tiles;  // n_tiles: 128-row tiles of a sequence
    int n_heads, n_kv_heads, batch, group;
    float scale, scale_log2;
    bool accumulate_dkv;
    bool kv_major;    // the backward's blocks KV head by KV head (from 16K tokens; see KV_MAJOR_MIN_TILES)
    float* dq_accum;  // the fused backward's fp32 dQ sums, [batch][head][64-row tile][2][64][64],
                      // then an int count per tile (how many key tiles have added to it)
};
constexpr int BWD_STAGES = 3;
// The backward's blocks go KV head by KV head from this many 128-row tiles per sequence (16K
// tokens), where one KV head's dK/dV blocks about fill the GPU's 132 SMs; below it, tile by tile
// across the heads, longest first over all of them, since with fewer tiles KV head by KV head
// leaves the last wave to the last KV head's longest blocks. Long sequences need KV head by KV
// head for L2 (see the header); at 16K both orders run alike. (bench/schedule_sim.cpp: no order
// in chunks of key tiles does both.)
constexpr int64_t KV_MAJOR_MIN_TILES = 128;
constexpr int BQ = 64;  // query rows per step of the dK/dV kernel, key rows per step of dQ's

// ---- dK, dV (and, FUSED_DQ, dQ): one block per 128 keys of one KV head.
//
// FUSED_DQ (--attention fused): the block also adds this key tile's part of dQ = dS K into an
// fp32 accumulator (attention_dq_accum_floats), so S and dP are computed once: 5 products where
// the deterministic pair of kernels computes 7. Per step:
//   1. each consumer writes its 64 rows of dS^T (bf16) to a shared [128 keys][64 queries] tile
//      (double-buffered), with stmatrix;
//   2. the two consumers meet at a named barrier; consumer c issues dQ[:, 64c..64c+63] =
//      dS K[:, 64c..] over all 128 keys (m64n64k16, dS read MN-major from that tile, K
//      MN-major), then dV += P^T dO and dK += dS^T Q;
//   3. when dQ's part is done (dV, dK still running) it goes to the consumer's shared fp32 tile, and
//      an mbarrier tells warp 1 of the producer warpgroup, which has the TMA unit add it to
//      global memory (cp.reduce.async.bulk .add.f32) and frees the tile when it has been read.
// dq_convert_kernel then scales and rounds the sums to bf16. The adds to a query tile go in
// ascending key tile order (counts beside the sums, see warp 1), so the sums, and dQ, are
// bit-reproducible. The order could cost waiting, and the walk is chosen so that it does not
// (see Walk): the blocks of one KV head that run at once walk the query tiles from the last one
// down, all heads of a tile in turn, so a block reaches each tile it shares with the block
// before it at the same step as that block, one add behind it. (Walking head by head from the
// diagonal up, every head's first tiles would wait two steps for the block before.)
// The adds are issued by a producer warp, not by the consumers, so that a consumer's dK product
// runs while its dQ part is stored and added.
constexpr int DQ_ACC_TILE = BQ * 64 * 4;  // bytes of one consumer's 64 x 64 fp32 part of a step's dQ
// The fused backward's workspace: the fp32 sums, [batch][head][64-row query tile][2][64][64]
// (as BwdParams::dq_accum), then one int32 count per query tile (the order of the adds); the counts start here.
__host__ __device__ inline int64_t dq_sum_floats(int64_t batch, int64_t n_heads, int64_t n_query_tiles) {
    return batch * n_heads * n_query_tiles * (BQ * HD);
}
constexpr int DST_TILE = 128 * BQ * 2;    // bytes of a [128 keys][64 queries] bf16 tile of dS^T
template <bool FUSED_DQ>
constexpr int dkdv_smem() {
    return 1024 + 2 * TILE + BWD_STAGES * (2 * HALF_TILE + 2 * BQ * 4) + (FUSED_DQ ? 2 * DST_TILE + 2 * DQ_ACC_TILE : 0) +
           8 * (1 + 2 * BWD_STAGES + 4);
}
static_assert(dkdv_smem<true>() <= 227 * 1024, "the fused dK/dV/dQ kernel's shared memory exceeds the SM's");

// Without FUSED_DQ the consumers take turns (S^T and dP^T, then dV and dK). The turns serialize
// the path between one product and the next, so they help only while that path is short: masks
// on edge tiles only, descriptors built once per tile (see zero_outside and desc_bits). With
// FUSED_DQ the consumers do not take turns; they meet at a named barrier before dQ every step
// (docs/attention.md has the turns tried there, and the other variants not kept).
template <bool FUSED_DQ, bool DOCS = false>
__global__ void __launch_bounds__(THREADS, 1)
    dkdv_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_do,
                const __grid_constant__ CUtensorMap map_k, const __grid_constant__ CUtensorMap map_v,
                const BwdParams p, const AttentionDocs call_docs) {
#if !HOPPER_STUB
    const uint32_t sK = aligned_smem(), sV = sK + TILE, sQ = sV + TILE, sdO = sQ + BWD_STAGES * HALF_TILE;
    const uint32_t sdST = sdO + BWD_STAGES * HALF_TILE;          // FUSED_DQ: 2 x [128][64] bf16 dS^T
    const uint32_t sdQ = sdST + (FUSED_DQ ? 2 * DST_TILE : 0);   // FUSED_DQ: 2 x [64][64] fp32 dQ parts
    const uint32_t sStats = sdQ + (FUSED_DQ ? 2 * DQ_ACC_TILE : 0);  // [stage][lse * log2 e (64), -delta (64)]
    const uint32_t bars = sStats + BWD_STAGES * 2 * BQ * 4;
    const uint32_t kv_full = bars;
    auto full = [&](int s) { return bars + 8 * (1 + s); };
    auto empty = [&](int s) { return bars + 8 * (1 + BWD_STAGES + s); };
    auto dq_full = [&](int c) { return bars + 8 * (1 + 2 * BWD_STAGES + c); };   // FUSED_DQ: consumer c's part stored
    auto dq_empty = [&](int c) { return bars + 8 * (3 + 2 * BWD_STAGES + c); };  // FUSED_DQ: ... and read out
    extern __shared__ unsigned char smem_raw[];
    float* stats = (float*)(smem_raw + (sStats - smem_u32(smem_raw)));

    // Block -> (key tile, KV head, batch). Early key tiles first (they see the most queries):
    // KV head by KV head from 16K tokens (p.kv_major: the blocks running at once walk one KV
    // head's query tiles and share them in L2), else key tile by key tile across the heads.
    const int64_t chains = (int64_t)p.n_kv_heads * p.batch;
    const int64_t chain = p.kv_major ? blockIdx.x / p.n_tiles : blockIdx.x % chains;
    const int64_t k_tile = p.kv_major ? blockIdx.x % p.n_tiles : blockIdx.x / chains;
    constexpr bool BY_TILES = FUSED_DQ;  // the order of the steps (Walk)
    const int kvh = (int)(chain % p.n_kv_heads), b = (int)(chain / p.n_kv_heads);
    const int64_t k0 = k_tile * 128;
    const int64_t first_qt = k0 / BQ, n_qt = (p.seq + BQ - 1) / BQ;
    // The query tiles first_qt .. qt_end - 1: with documents, none after the block's last key's
    // document.
    const DocumentView docs(DOCS ? call_docs : AttentionDocs{}, p.seq);
    const int64_t qt_end = docs.on() ? (docs.doc_end(b, min(k0 + 127, p.seq - 1)) + BQ - 1) / BQ : n_qt;
    // One flat loop over (query head of the group, query tile), in the order of Walk.
    const int64_t n_steps = p.group * (qt_end - first_qt);

    if (threadIdx.x == 0) {
        mbar_init(kv_full, 1);
        for (int s = 0; s < BWD_STAGES; s++) mbar_init(full(s), 32), mbar_init(empty(s), 256);
        for (int c = 0; c < 2; c++) mbar_init(dq_full(c), 128), mbar_init(dq_empty(c), 1);
        mbar_init_fence();
    }
    __syncthreads();

    if (threadIdx.x < 128) {  // producer: warp 0 (lane 0 the copies, every lane lse and delta)
        setmaxnreg_dec<PRODUCER_REGS>();
        if (FUSED_DQ && threadIdx.x == 32) {  // warp 1: the TMA unit adds each stored dQ part
            // In a fixed order, so that dQ is bit-reproducible: the adds to one 64-row query
            // tile's sums go by ascending key tile. Each query tile has a count, after the sums in
            // the same workspace (cleared with them); this block waits until it equals its key
            // tile, adds, waits until its adds are performed, and counts on. No deadlock: the
            // block waited for (the key tile before, same batch and KV head) is earlier in the
            // grid (just before it KV head by KV head, n_kv_heads x batch before it tile by tile),
            // and blocks start in grid order, so it is running or done, and it waits only for
            // blocks earlier still. (Blocks starting in grid order is how the hardware behaves,
            // not a documented CUDA guarantee, hence wait_count's time limit; FlashAttention-3's
            // deterministic backward relies on it too, with a per-tile semaphore and its own
            // block order. With this grid order, descending key tiles would deadlock: the first
            // blocks would wait for blocks that cannot start until they finish.)
            // With documents a query tile's adders are the key tiles from the one holding its
            // first row's first key to the diagonal (a key tile reaches the tile unless its last
            // key's document ends before it, and then so do the tiles before it), so a block's
            // rank at a tile is its key tile less that first one. The first keys come from a
            // cursor that steps back a document at a time as the walk goes down: a binary
            // search per step, a chain of dependent loads, would hold up every add.)
            int* counts = (int*)(p.dq_accum + dq_sum_floats(p.batch, p.n_heads, n_qt));
            uint32_t parity = 0;
            Walk<BY_TILES> walk(first_qt, qt_end, p.group);
            FirstKeyWalkingDown first_key(docs, b, walk.qt * BQ);
            for (int64_t step = 0; step < n_steps; step++, walk.next(), parity ^= 1) {
                const int64_t tile = ((int64_t)b * p.n_heads + kvh * p.group + walk.head) * n_qt + walk.qt;
                float* dst = p.dq_accum + tile * (BQ * HD);
                int* count = counts + tile;
                const int rank = (int)(k_tile - (DOCS ? first_key(walk.qt * BQ) / 128 : 0));
                mbar_wait(dq_full(0), parity);
                wait_count(count, rank);
                bulk_reduce_add(dst, sdQ, DQ_ACC_TILE);
                mbar_wait(dq_full(1), parity);
                bulk_reduce_add(dst + BQ * 64, sdQ + DQ_ACC_TILE, DQ_ACC_TILE);
                bulk_wait_read<1>();
                mbar_arrive(dq_empty(0));
                bulk_wait_read<0>();
                mbar_arrive(dq_empty(1));
                bulk_wait_all();  // performed, not only read
                release_count(count, rank + 1);
            }
        }
        if (threadIdx.x < 32) {
            const int lane = threadIdx.x;
            if (lane == 0) {
                mbar_arrive_expect_tx(kv_full, 2 * TILE);
                tma_tile(sK, &map_k, kv_full, kvh, k0, b, 128);
                tma_tile(sV, &map_v, kv_full, kvh, k0, b, 128);
            }
            Walk<BY_TILES> walk(first_qt, qt_end, p.group);
            for (int64_t step = 0; step < n_steps; step++, walk.next()) {
                const int h = kvh * p.group + walk.head;
                const int64_t head_row = ((int64_t)b * p.n_heads + h) * p.seq, qt = walk.qt;
                const int s = (int)(step % BWD_STAGES);
                if (step >= BWD_STAGES) mbar_wait(empty(s), (uint32_t)((step / BWD_STAGES - 1) & 1));
                const int64_t q0 = qt * BQ;
                float* st = stats + s * 2 * BQ;
                for (int r = lane; r < BQ; r += 32) {
                    const bool valid = q0 + r < p.seq;
                    st[r] = valid ? p.lse[head_row + q0 + r] * LOG2E : 0.f;
                    st[BQ + r] = valid ? -p.delta[head_row + q0 + r] : 0.f;  // dP^T's accumulator starts there
                }
                if (lane == 0) {
                    mbar_arrive_expect_tx(full(s), 2 * HALF_TILE);
                    tma_tile(sQ + s * HALF_TILE, &map_q, full(s), h, q0, b, BQ);
                    tma_tile(sdO + s * HALF_TILE, &map_do, full(s), h, q0, b, BQ);
                } else {
                    mbar_arrive(full(s));
                }
            }
        }
        return;
    }
    setmaxnreg_inc<CONSUMER_REGS>();

    const int c = consumer_index();  // consumer: keys 64c..64c+63 of the tile
    const Lane ln;
    const uint32_t k_rows = sK + c * 64 * 128, v_rows = sV + c * 64 * 128;
    float dk[64], dv[64];
    uint32_t pa[16], dsa[16];
#pragma unroll
    for (int i = 0; i < 64; i++) dk[i] = 0.f, dv[i] = 0.f;
    mbar_wait(kv_full, 0);

    // Without FUSED_DQ the consumers take turns issuing products, as in the forward and the dQ
    // kernel: S^T and dP^T, then dV and dK. Both take the same number of turns, so both walk
    // every step (a tile whose queries all precede this consumer's keys is masked to zero).
    const Turns turns(c, 2 * n_steps, !FUSED_DQ);
    Ring<BWD_STAGES> ring;
    Walk<BY_TILES> walk(first_qt, qt_end, p.group);
    // With documents, this thread's keys are seen by the queries before key_end[r] only (the end
    // of the key's document).
    int64_t key_end[2] = {p.seq, p.seq};
    if (DOCS)
        for (int r = 0; r < 2; r++) key_end[r] = docs.doc_end(b, min(k0 + c * 64 + ln.row(r), p.seq - 1));
    for (int64_t step = 0; step < n_steps; step++, ring.next(), walk.next()) {
        const int s = ring.stage;
        const int64_t q0 = walk.qt * BQ;
        mbar_wait(full(s), ring.phase);
        const uint32_t q_tile = sQ + s * HALF_TILE, do_tile = sdO + s * HALF_TILE;
        const uint32_t dst_tile = sdST + (uint32_t)(step & 1) * DST_TILE;
        // This thread's queries' lse (times log2 e) into registers before the products: read
        // after a wgmma wait, each load would queue behind the products' shared-memory reads,
        // with the exponentials waiting on it.
        const float* lse2 = stats + s * 2 * BQ;
        const float* minus_delta = lse2 + BQ;
        float2 lse_r[8];
#pragma unroll
        for (int jj = 0; jj < 8; jj++) lse_r[jj] = *(const float2*)(lse2 + ln.col(jj, 0));
        // S^T = K Q^T and dP^T - delta = V dO^T - delta: 64 keys x 64 queries, two groups of
        // products, the second onto -delta (each query's, a column), so that dS^T = P^T (dP^T -
        // delta) is one multiplication in the exponentials' phase, where issue slots bind.
        float st[32], dpt[32];
#pragma unroll
        for (int jj = 0; jj < 8; jj++) {
            const float2 d = *(const float2*)(minus_delta + ln.col(jj, 0));
            dpt[4 * jj] = dpt[4 * jj + 2] = d.x, dpt[4 * jj + 1] = dpt[4 * jj + 3] = d.y;
        }
        // The dK/dV kernel fences -delta's registers so that both groups go out together:
        // unfenced, ptxas would add a wait for S^T before the second. The fused kernel waits for
        // S^T anyway (below) and leaves them unfenced, which schedules better there (ptxas then
        // notes the warpgroup arrive it adds; docs/attention.md).
        if (!FUSED_DQ) fence_regs<32>(dpt);
        turns.mine();
        wgmma_fence();
        product_64_ss(st, k_rows, q_tile, BQ);
        wgmma_commit();
        // The fused kernel issues dP^T only once S^T is done, which is faster there than issuing
        // both groups at once (docs/attention.md).
        if (FUSED_DQ) wgmma_wait<0>();
        product_64_ss(dpt, v_rows, do_tile, BQ, true);
        wgmma_commit();
        turns.yours(2 * step);

        // P^T = exp(scale s - lse) where the query sees the key, while dP^T is computed.
        wgmma_wait<1>();
        fence_regs<32>(st);
#pragma unroll
        for (int jj = 0; jj < 8; jj++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float lse = e & 1 ? lse_r[jj].y : lse_r[jj].x;
                st[4 * jj + e] = exp2_fast(fmaf(st[4 * jj + e], p.scale_log2, -lse));
            }
        // Zero where query q0 + x precedes key k0 + 64c + r, or is past the end; with documents,
        // where it is past the key's document.
        if (q0 < k0 + 128 || q0 + BQ > p.seq) zero_outside(st, ln, k0 + c * 64 - q0, BQ, p.seq - q0);
        if (DOCS && q0 + BQ > key_end[0]) zero_after_documents(st, ln, q0, key_end);
        // dS^T = P^T (dP^T - delta), the subtraction done by the product
        wgmma_wait<0>();
        fence_regs<32>(dpt);
#pragma unroll
        for (int jj = 0; jj < 8; jj++)
#pragma unroll
            for (int e = 0; e < 4; e++) dpt[4 * jj + e] *= st[4 * jj + e];
#pragma unroll
        for (int kc = 0; kc < 4; kc++) to_a(pa + 4 * kc, st, kc), to_a(dsa + 4 * kc, dpt, kc);

        if (FUSED_DQ) {  // this consumer's rows of dS^T into the shared tile (128-byte swizzle)
            // By stmatrix: 4 instructions instead of 16 4-byte stores, in the phase where both
            // consumers wait on issue slots. dsa[4 kc + i] is the 8 x 8 matrix of rows 16 warp +
            // 8 (i & 1), columns 16 kc + 8 (i / 2); lane l addresses row l % 8 of matrix l / 8, one
            // 16-byte chunk, at chunk ^ (row % 8) (8 rows, 8 chunks: no bank conflicts).
            const int lane = threadIdx.x % 32, m = lane / 8;
            const int row = c * 64 + ln.warp * 16 + 8 * (m & 1) + lane % 8;
#pragma unroll
            for (int kc = 0; kc < 4; kc++)
                stmatrix_x4(dst_tile + row * 128 + (((2 * kc + m / 2) ^ (row & 7)) << 4), dsa + 4 * kc);
            fence_proxy_async();
        }

        // dV += P^T dO, dK += dS^T Q: dO and Q read MN-major (queries are the k, d the n).
        fence_regs<64>(dv), fence_regs<64>(dk);
        if (!FUSED_DQ) {
            turns.mine();
            wgmma_fence();
            product_128_rs<BQ>(dv, pa, do_tile);
            product_128_rs<BQ>(dk, dsa, q_tile);
            wgmma_commit();
            turns.yours(2 * step + 1);
        } else {
            // dQ[:, 64c..64c+63] = dS K[:, 64c..] first, then dV and dK, so that dQ's epilogue
            // (store, hand-off to the adder warp) runs while both are computed.
            float dq[32] = {};
            named_barrier(1, 256);
            wgmma_fence();
            const uint32_t k_half = sK + c * (TILE / 2);
#pragma unroll
            for (int k = 0; k < 8; k++) wgmma_64_ss<1>(dq, mnmajor_desc(dst_tile, k, 128), mnmajor_desc(k_half, k, 128), k > 0);
            wgmma_commit();
            product_128_rs<BQ>(dv, pa, do_tile);
            product_128_rs<BQ>(dk, dsa, q_tile);
            wgmma_commit();
            wgmma_wait<1>();
            fence_regs<32>(dq);
            const uint32_t acc_tile = sdQ + c * DQ_ACC_TILE;
            // The part to this consumer's shared fp32 tile once its previous part has been read
            // out, and producer warp 1 told. Columns 8j..8j+7 of row r sit at block j ^ (r % 8),
            // so a warp's 8-byte stores hit all 32 banks (dq_convert_kernel undoes the swizzle).
            // (st_shared_v2: a float2 store through a C++ pointer compiles to two 4-byte stores.)
            if (step > 0) mbar_wait(dq_empty(c), (uint32_t)((step - 1) & 1));
#pragma unroll
            for (int jj = 0; jj < 8; jj++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    const int row = ln.row(r);
                    st_shared_v2(acc_tile + 4 * (row * 64 + ((jj ^ (row & 7)) << 3) + 2 * ln.t), dq[4 * jj + 2 * r], dq[4 * jj + 2 * r + 1]);
                }
            fence_proxy_async();
            mbar_arrive(dq_full(c));
        }
        wgmma_wait<0>();
        fence_regs<64>(dv), fence_regs<64>(dk);
        mbar_arrive(empty(s));
    }

    const int64_t tok0 = (int64_t)b * p.seq;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int64_t key = k0 + c * 64 + ln.row(r);
        if (key >= p.seq) continue;
        bf16* dkrow = p.dk + (tok0 + key) * p.lddk + (int64_t)kvh * HD;
        bf16* dvrow = p.dv + (tok0 + key) * p.lddv + (int64_t)kvh * HD;
#pragma unroll
        for (int jj = 0; jj < 16; jj++) {
            __nv_bfloat162* kp = (__nv_bfloat162*)(dkrow + ln.col(jj, 0));
            __nv_bfloat162* vp = (__nv_bfloat162*)(dvrow + ln.col(jj, 0));
            const float2 k_old = p.accumulate_dkv ? __bfloat1622float2(*kp) : make_float2(0.f, 0.f);
            const float2 v_old = p.accumulate_dkv ? __bfloat1622float2(*vp) : make_float2(0.f, 0.f);
            *kp = __floats2bfloat162_rn(k_old.x + dk[4 * jj + 2 * r] * p.scale, k_old.y + dk[4 * jj + 2 * r + 1] * p.scale);
            *vp = __floats2bfloat162_rn(v_old.x + dv[4 * jj + 2 * r], v_old.y + dv[4 * jj + 2 * r + 1]);
        }
    }
#else
    __trap();
#endif
}

// FUSED_DQ's last step: dq = scale * the fp32 sums, rounded to bf16. One block per 64 query rows
// of one head; a thread takes 8 consecutive columns (one swizzled 32-byte block) at a time.
__global__ void dq_convert_kernel(const BwdParams p, int64_t n_qt) {
#if !HOPPER_STUB
    const int64_t tile = blockIdx.x;  // ((b * n_heads + h) * n_qt + qt)
    const int64_t qt = tile % n_qt, bh = tile / n_qt;
    const int h = (int)(bh % p.n_heads), b = (int)(bh / p.n_heads);
    const float* acc = p.dq_accum + tile * (BQ * HD);
    for (int i = threadIdx.x; i < BQ * HD / 8; i += blockDim.x) {
        const int row = i / (HD / 8), blk = i % (HD / 8);  // columns 8 blk .. 8 blk + 7
        const int64_t q = qt * BQ + row;
        if (q >= p.seq) continue;
        const int half = blk / 8, j = blk % 8;
        const float4* src = (const float4*)(acc + half * (BQ * 64) + row * 64 + ((j ^ (row & 7)) << 3));
        const float4 x = src[0], y = src[1];
        uint4 packed;
        packed.x = pack_bf16(x.x * p.scale, x.y * p.scale), packed.y = pack_bf16(x.z * p.scale, x.w * p.scale);
        packed.z = pack_bf16(y.x * p.scale, y.y * p.scale), packed.w = pack_bf16(y.z * p.scale, y.w * p.scale);
        *(uint4*)(p.dq + ((int64_t)b * p.seq + q) * p.lddq + (int64_t)h * HD + 8 * blk) = packed;
    }
#else
    __trap();
#endif
}

// ---- dQ: one block per 128 query rows of one head.
constexpr int DQ_SMEM = 1024 + 2 * TILE + BWD_STAGES * 2 * HALF_TILE + 8 * (1 + 2 * BWD_STAGES);

template <bool DOCS>
__global__ void __launch_bounds__(THREADS, 1)
    dq_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_do,
              const __grid_constant__ CUtensorMap map_k, const __grid_constant__ CUtensorMap map_v, const BwdParams p,
              const AttentionDocs call_docs) {
#if !HOPPER_STUB
    const uint32_t sQ = aligned_smem(), sdO = sQ + TILE, sK = sdO + TILE, sV = sK + BWD_STAGES * HALF_TILE;
    const uint32_t bars = sV + BWD_STAGES * HALF_TILE;
    const uint32_t q_full = bars;
    auto full = [&](int s) { return bars + 8 * (1 + s); };
    auto empty = [&](int s) { return bars + 8 * (1 + BWD_STAGES + s); };

    // Block -> (query tile, head, batch), the longest query tiles first: KV head by KV head from
    // 16K tokens (p.kv_major: the blocks running at once share K and V in L2, as in the
    // forward), else query tile by query tile across the heads. outer: (batch, KV head); inner:
    // (rank of the query tile, head of the group).
    const int n_kv_heads = p.n_heads / p.group;
    const int64_t per_kv_head = p.n_tiles * p.group, per_tile = (int64_t)p.n_heads * p.batch;
    const int64_t rest = blockIdx.x % per_tile;
    const int64_t outer = p.kv_major ? blockIdx.x / per_kv_head : rest / p.group;
    const int64_t inner = p.kv_major ? blockIdx.x % per_kv_head : blockIdx.x / per_tile * p.group + rest % p.group;
    const int b = (int)(outer / n_kv_heads), kvh = (int)(outer % n_kv_heads);
    const int h = kvh * p.group + (int)(inner % p.group);
    const int64_t q_tile = p.n_tiles - 1 - inner / p.group;
    const int64_t q0 = q_tile * 128;
    // Key tiles kt0 .. n_kt - 1: with documents, none before the block's first row's document.
    const DocumentView docs(DOCS ? call_docs : AttentionDocs{}, p.seq);
    const int64_t kt0 = DOCS ? docs.first_key(b, q0) / BQ : 0, n_kt = min((q0 + 128) / BQ, (p.seq + BQ - 1) / BQ) - kt0;

    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        for (int s = 0; s < BWD_STAGES; s++) mbar_init(full(s), 1), mbar_init(empty(s), 256);
        mbar_init_fence();
    }
    __syncthreads();

    if (threadIdx.x < 128) {  // producer
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            mbar_arrive_expect_tx(q_full, 2 * TILE);
            tma_tile(sQ, &map_q, q_full, h, q0, b, 128);
            tma_tile(sdO, &map_do, q_full, h, q0, b, 128);
            for (int64_t kt = 0; kt < n_kt; kt++) {
                const int s = (int)(kt % BWD_STAGES);
                if (kt >= BWD_STAGES) mbar_wait(empty(s), (uint32_t)((kt / BWD_STAGES - 1) & 1));
                mbar_arrive_expect_tx(full(s), 2 * HALF_TILE);
                tma_tile(sK + s * HALF_TILE, &map_k, full(s), kvh, (kt0 + kt) * BQ, b, BQ);
                tma_tile(sV + s * HALF_TILE, &map_v, full(s), kvh, (kt0 + kt) * BQ, b, BQ);
            }
        }
        return;
    }
    setmaxnreg_inc<CONSUMER_REGS>();

    const int c = consumer_index();  // consumer: rows 64c..64c+63 of the tile
    const Lane ln;
    const uint32_t q_rows = sQ + c * 64 * 128, do_rows = sdO + c * 64 * 128;
    const int64_t head_row = ((int64_t)b * p.n_heads + h) * p.seq;
    float lse2[2], delta[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int64_t row = q0 + c * 64 + ln.row(r);
        lse2[r] = row < p.seq ? p.lse[head_row + row] * LOG2E : 0.f;
        delta[r] = row < p.seq ? p.delta[head_row + row] : 0.f;
    }
    // With documents, this thread's rows see keys from first[r] on (their documents' starts).
    int64_t first[2] = {0, 0};
    if (DOCS)
        for (int r = 0; r < 2; r++) first[r] = docs.first_key(b, min(q0 + c * 64 + ln.row(r), p.seq - 1));
    float dq[64];
#pragma unroll
    for (int i = 0; i < 64; i++) dq[i] = 0.f;
    mbar_wait(q_full, 0);

    // The consumers take turns issuing products, as in the forward: S and dP, then dQ += dS K.
    // Both take the same number of turns, so both walk every key tile (a tile whose keys all
    // follow this consumer's rows is masked to zero instead of skipped).
    const Turns turns(c, 2 * n_kt);  // two per key tile

    Ring<BWD_STAGES> ring;
    for (int64_t kt = 0; kt < n_kt; kt++, ring.next()) {
        const int s = ring.stage;
        const int64_t k0 = (kt0 + kt) * BQ;
        mbar_wait(full(s), ring.phase);
        const uint32_t k_tile = sK + s * HALF_TILE, v_tile = sV + s * HALF_TILE;
        float sc[32], dp[32];
#pragma unroll
        for (int i = 0; i < 32; i++) dp[i] = -delta[(i / 2) % 2];  // dP - delta, as in the dK/dV kernel
        fence_regs<32>(dp);
        turns.mine();
        wgmma_fence();
        product_64_ss(sc, q_rows, k_tile, BQ);
        wgmma_commit();
        product_64_ss(dp, do_rows, v_tile, BQ, true);
        wgmma_commit();
        turns.yours(2 * kt);
        wgmma_wait<1>();
        fence_regs<32>(sc);
#pragma unroll
        for (int jj = 0; jj < 8; jj++)
#pragma unroll
            for (int e = 0; e < 4; e++) sc[4 * jj + e] = exp2_fast(fmaf(sc[4 * jj + e], p.scale_log2, -lse2[e / 2]));
        // Zero where key k0 + x follows query row q0 + 64c + r, or (documents) is before its document.
        if (k0 + BQ - 1 > q0 + c * 64) zero_outside(sc, ln, -BQ, q0 + c * 64 - k0, BQ);
        if (DOCS && k0 < first[1]) zero_before_documents(sc, ln, k0, first);
        wgmma_wait<0>();
        fence_regs<32>(dp);
#pragma unroll
        for (int jj = 0; jj < 8; jj++)
#pragma unroll
            for (int e = 0; e < 4; e++) dp[4 * jj + e] *= sc[4 * jj + e];
        uint32_t dsa[16];
#pragma unroll
        for (int kc = 0; kc < 4; kc++) to_a(dsa + 4 * kc, dp, kc);
        // dQ += dS K: K read MN-major (keys are the k of this product, d its n).
        fence_regs<64>(dq);
        turns.mine();
        wgmma_fence();
        product_128_rs<BQ>(dq, dsa, k_tile);
        wgmma_commit();
        turns.yours(2 * kt + 1);
        wgmma_wait<0>();
        fence_regs<64>(dq);
        mbar_arrive(empty(s));
    }

    const int64_t tok0 = (int64_t)b * p.seq;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int64_t row = q0 + c * 64 + ln.row(r);
        if (row >= p.seq) continue;
        bf16* out = p.dq + (tok0 + row) * p.lddq + (int64_t)h * HD;
#pragma unroll
        for (int jj = 0; jj < 16; jj++)
            *(__nv_bfloat162*)(out + ln.col(jj, 0)) =
                __floats2bfloat162_rn(dq[4 * jj + 2 * r] * p.scale, dq[4 * jj + 2 * r + 1] * p.scale);
    }
#else
    __trap();
#endif
}

// =============================================================================================
// Host side: tensor maps, eligibility, launches.

// cuTensorMapEncodeTiled is a driver function; get it through the runtime so that the binaries
// do not link libcuda (and start on machines without a driver).
PFN_cuTensorMapEncodeTiled_v12000 encode_function() {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
    if (!fn) {
        void* ptr = nullptr;
        cudaDriverEntryPointQueryResult found;
        CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &found));
        if (found != cudaDriverEntryPointSuccess || !ptr) runtime_error("attention: cuTensorMapEncodeTiled not found");
        fn = (PFN_cuTensorMapEncodeTiled_v12000)ptr;
    }
    return fn;
}

// The view [batch][seq][heads * 128] of rows `ld` elements apart, read in boxes of 64 columns
// x `rows` rows with the 128-byte swizzle. Rows past a sequence's end read as zeros.
CUtensorMap tensor_map(const bf16* base, int heads, int64_t ld, int64_t seq, int batch, int rows) {
    CUtensorMap map;
    const cuuint64_t dims[3] = {(cuuint64_t)heads * HD, (cuuint64_t)seq, (cuuint64_t)batch};
    const cuuint64_t strides[2] = {(cuuint64_t)ld * 2, (cuuint64_t)(seq * ld * 2)};
    const cuuint32_t box[3] = {64, (cuuint32_t)rows, 1}, elem_strides[3] = {1, 1, 1};
    const CUresult r = encode_function()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, (void*)base, dims, strides, box,
                                         elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                         CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) runtime_error("attention: cuTensorMapEncodeTiled failed (" + std::to_string((int)r) + ")");
    return map;
}

bool aligned16(const void* p) { return ((uintptr_t)p & 15) == 0; }

// The fused backward also bulk-adds into dq_accum and stores dq 16 bytes at a time.
bool fused_dq_aligned(const AttentionBackwardArgs& a) {
    return aligned16(a.dq_accum) && aligned16(a.dq) && a.lddq % 8 == 0;
}

// Launch a kernel with `smem` bytes of dynamic shared memory (the limit raised once per kernel).
template <typename Kernel, typename... Args>
void launch(Kernel kernel, int64_t blocks, int smem, cudaStream_t s, const Args&... args) {
    static std::set<const void*> configured;  // kernels of one signature share this instantiation
    if (!configured.count((const void*)kernel)) {
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        configured.insert((const void*)kernel);
    }
    kernel<<<(unsigned)blocks, THREADS, smem, s>>>(args...);
    CUDA_CHECK_LAUNCH();
}

}  // namespace hopper

// An sm_90 GPU. (One GPU per process, as everywhere in this program: the answer is cached.) A
// binary built for sm_90 without the "a" holds the trapping kernels: build Hopper code with
// compute_90a/sm_90a, as the Makefile does.
static bool hopper_device() {
    static int answer = -1;
    if (answer < 0) {
        int dev = 0, major = 0, minor = 0;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
        answer = major == 9 && minor == 0;
    }
    return answer == 1;
}

// Whether the Hopper kernels can run this call: head dim 128, whole GQA groups, an sm_90 device,
// the alignment TMA needs (16-byte base addresses and row strides), sequences within TMA's
// 32-bit rows and 2^40-byte strides, a grid within 2^31 blocks.
static bool attention_hopper_applies(const AttentionShape& sh, std::initializer_list<const void*> ptrs,
                                     std::initializer_list<int64_t> lds) {
    // Shapes the reference rejects go there, for its error message.
    if (sh.head_dim != 128 || sh.n_kv_heads <= 0 || sh.n_heads % sh.n_kv_heads != 0) return false;
    if (sh.seq >= ((int64_t)1 << 31) || !hopper_device()) return false;
    for (const void* p : ptrs)
        if (!hopper::aligned16(p)) return false;
    for (int64_t ld : lds)  // TMA: row strides of 16-byte multiples, below 2^40 bytes per sequence
        if (ld % 8 != 0 || (double)sh.seq * ld * 2 >= 1e12) return false;
    const int64_t tiles = (sh.seq + 63) / 64;  // blocks of the largest grid (dq_convert_kernel's)
    return tiles * sh.n_heads * sh.batch < ((int64_t)1 << 31);
}

void attention_forward_hopper(const AttentionForwardArgs& a, const AttentionShape& sh, cudaStream_t s) {
    if (!attention_hopper_applies(sh, {a.q, a.k, a.v}, {a.ldq, a.ldk, a.ldv}))
        usage_error("attention_forward_hopper: needs head dim 128, sm_90, 16-byte aligned q, k, v");
    if (sh.seq == 0 || sh.batch == 0) return;
    using namespace hopper;
    FwdParams p{};
    p.out = a.out, p.lse = a.lse, p.ldo = a.ldo, p.seq = sh.seq, p.n_q_tiles = (sh.seq + 127) / 128;
    p.n_heads = sh.n_heads, p.batch = sh.batch, p.group = sh.n_heads / sh.n_kv_heads;
    p.scale_log2 = (1.0f / sqrtf((float)sh.head_dim)) * LOG2E;
    p.docs = a.docs;
    const CUtensorMap mq = tensor_map(a.q, sh.n_heads, a.ldq, sh.seq, sh.batch, 128);
    const CUtensorMap mk = tensor_map(a.k, sh.n_kv_heads, a.ldk, sh.seq, sh.batch, 128);
    const CUtensorMap mv = tensor_map(a.v, sh.n_kv_heads, a.ldv, sh.seq, sh.batch, 128);
    const int64_t blocks = p.n_q_tiles * sh.n_heads * sh.batch;
    if (a.docs.start) launch(forward_kernel<true>, blocks, FWD_SMEM, s, mq, mk, mv, p);
    else launch(forward_kernel<false>, blocks, FWD_SMEM, s, mq, mk, mv, p);
}

// Backward with delta given (a.out == nullptr): the dK/dV kernel, then the dQ kernel; with
// a.dq_accum, the fused dK/dV/dQ kernel, then the conversion of its fp32 dQ sums (opt.parts: which).
void attention_backward_hopper(const AttentionBackwardArgs& a, const AttentionShape& sh, cudaStream_t s,
                               const HopperBackwardOptions& opt) {
    if (a.out != nullptr || !attention_hopper_applies(sh, {a.q, a.k, a.v, a.dout}, {a.ldq, a.ldk, a.ldv, a.lddo}))
        usage_error("attention_backward_hopper: needs delta given, head dim 128, sm_90, 16-byte aligned inputs");
    if (a.dq_accum && !hopper::fused_dq_aligned(a))
        usage_error("attention_backward_hopper: the fused backward needs 16-byte aligned dq and dq_accum, lddq % 8 == 0");
    if (sh.seq == 0 || sh.batch == 0) return;
    using namespace hopper;
    BwdParams p{};
    p.lse = a.lse, p.delta = a.delta, p.dq = a.dq, p.dk = a.dk, p.dv = a.dv;
    p.lddq = a.lddq, p.lddk = a.lddk, p.lddv = a.lddv, p.seq = sh.seq, p.n_tiles = (sh.seq + 127) / 128;
    p.n_heads = sh.n_heads, p.n_kv_heads = sh.n_kv_heads, p.batch = sh.batch, p.group = sh.n_heads / sh.n_kv_heads;
    p.scale = 1.0f / sqrtf((float)sh.head_dim), p.scale_log2 = p.scale * LOG2E;
    p.accumulate_dkv = a.accumulate_dkv, p.dq_accum = a.dq_accum;
    p.kv_major = p.n_tiles >= (opt.kv_major_from_tiles > 0 ? opt.kv_major_from_tiles : KV_MAJOR_MIN_TILES);
    if (opt.parts & 1) {  // dK, dV: 64-row query tiles stream past 128 keys.
        const CUtensorMap mq = tensor_map(a.q, sh.n_heads, a.ldq, sh.seq, sh.batch, BQ);
        const CUtensorMap mdo = tensor_map(a.dout, sh.n_heads, a.lddo, sh.seq, sh.batch, BQ);
        const CUtensorMap mk = tensor_map(a.k, sh.n_kv_heads, a.ldk, sh.seq, sh.batch, 128);
        const CUtensorMap mv = tensor_map(a.v, sh.n_kv_heads, a.ldv, sh.seq, sh.batch, 128);
        const int64_t blocks = p.n_tiles * sh.n_kv_heads * sh.batch;
        if (a.dq_accum) {
            CUDA_CHECK(cudaMemsetAsync(a.dq_accum, 0, attention_dq_accum_floats(sh) * sizeof(float), s));
            if (opt.unreachable_dq_counts) {  // every count -1
                const int64_t n_qt = (sh.seq + BQ - 1) / BQ, sums = dq_sum_floats(sh.batch, sh.n_heads, n_qt);
                CUDA_CHECK(cudaMemsetAsync(a.dq_accum + sums, 0xFF, sh.batch * sh.n_heads * n_qt * sizeof(int), s));
            }
            if (a.docs.start) launch(dkdv_kernel<true, true>, blocks, dkdv_smem<true>(), s, mq, mdo, mk, mv, p, a.docs);
            else launch(dkdv_kernel<true>, blocks, dkdv_smem<true>(), s, mq, mdo, mk, mv, p, a.docs);
        } else {
            if (a.docs.start) launch(dkdv_kernel<false, true>, blocks, dkdv_smem<false>(), s, mq, mdo, mk, mv, p, a.docs);
            else launch(dkdv_kernel<false>, blocks, dkdv_smem<false>(), s, mq, mdo, mk, mv, p, a.docs);
        }
    }
    if ((opt.parts & 2) && a.dq_accum) {  // dQ from the fused kernel's fp32 sums
        const int64_t n_qt = (sh.seq + BQ - 1) / BQ;
        dq_convert_kernel<<<(unsigned)(n_qt * sh.n_heads * sh.batch), 256, 0, s>>>(p, n_qt);
        CUDA_CHECK_LAUNCH();
    } else if (opt.parts & 2) {  // dQ: 64-key tiles stream past 128 query rows.
        const CUtensorMap mq = tensor_map(a.q, sh.n_heads, a.ldq, sh.seq, sh.batch, 128);
        const CUtensorMap mdo = tensor_map(a.dout, sh.n_heads, a.lddo, sh.seq, sh.batch, 128);
        const CUtensorMap mk = tensor_map(a.k, sh.n_kv_heads, a.ldk, sh.seq, sh.batch, BQ);
        const CUtensorMap mv = tensor_map(a.v, sh.n_kv_heads, a.ldv, sh.seq, sh.batch, BQ);
        const int64_t blocks = p.n_tiles * sh.n_heads * sh.batch;
        if (a.docs.start) launch(dq_kernel<true>, blocks, DQ_SMEM, s, mq, mdo, mk, mv, p, a.docs);
        else launch(dq_kernel<false>, blocks, DQ_SMEM, s, mq, mdo, mk, mv, p, a.docs);
    }
}

// The fp32 sums, then one int32 count per 64-row query tile (the order of the adds).
int64_t attention_dq_accum_floats(const AttentionShape& sh) {
    const int64_t n_qt = (sh.seq + hopper::BQ - 1) / hopper::BQ;
    return hopper::dq_sum_floats(sh.batch, sh.n_heads, n_qt) + (int64_t)sh.batch * sh.n_heads * n_qt;
}

// =============================================================================================
// The dispatch the model calls.
static bool use_reference = false;
void attention_use_reference(bool on) { use_reference = on; }

// For 16-byte aligned inputs with row strides of multiples of 8 elements (the model's buffers).
bool attention_uses_hopper(const AttentionShape& sh) {
    return !use_reference && sh.head_dim == 128 && sh.n_kv_heads > 0 && sh.n_heads % sh.n_kv_heads == 0 &&
           sh.seq < ((int64_t)1 << 31) && hopper_device();
}

void attention_forward(const AttentionForwardArgs& a, const AttentionShape& sh, cudaStream_t s) {
    if (!use_reference && attention_hopper_applies(sh, {a.q, a.k, a.v}, {a.ldq, a.ldk, a.ldv}))
        attention_forward_hopper(a, sh, s);
    else
        attention_forward_reference(a, sh, s);
}

void attention_backward(const AttentionBackwardArgs& a, const AttentionShape& sh, cudaStream_t s) {
    if (use_reference || !attention_hopper_applies(sh, {a.q, a.k, a.v, a.dout}, {a.ldq, a.ldk, a.ldv, a.lddo}))
        return attention_backward_reference(a, sh, s);
    AttentionBackwardArgs given = a;
    // For a fused backward the alignments of dq and dq_accum do not allow (never the model's
    // buffers), the two-kernel backward runs instead.
    if (a.dq_accum && !hopper::fused_dq_aligned(a)) given.dq_accum = nullptr;
    if (a.out) {  // delta = rowsum(dout * out) first (Ulysses computes it on the token side)
        attention_delta(a, sh, s);
        given.out = nullptr;
    }
    attention_backward_hopper(given, sh, s);
}
