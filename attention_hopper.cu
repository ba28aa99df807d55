// attention_hopper.cu - attention on Hopper's warpgroup tensor-core instructions (wgmma,
// sm_90a): forward, and the deterministic two-kernel backward (dK/dV per KV tile summing the
// GQA group, dQ per query tile). The same contract as attention.cu (causal, GQA, bf16 in and
// out, fp32 lse in natural log), head dim 128 only.
//
// Status (issue 9): correct, not yet fast, so the model does not use it. On an H200 the forward
// matches attention.cu's within 1e-3 (another tile size, so other rescaling points) and the
// backward matches it bit for bit (the same 16-wide reduction order); at 16K tokens, 3B shape,
// it runs at 138 / 94 TFLOP/s forward / backward against attention.cu's 231 / 140
// (`build/bench_attention_hopper --bench`). It is the base for the fast kernels: every product
// here waits for the one before, and V (forward), Q and dO (dK/dV), K (dQ) are transposed in
// shared memory with scalar stores; next come TMA loads, warp specialization (a producer warp,
// consumers overlapping softmax with the next product) and MN-major operands instead of the
// transposes.
//
// Forward block: 128 query rows of one head, two warpgroups (256 threads) of 64 rows each (the
// M of one wgmma). Keys in tiles of 128, double-buffered by cp.async:
//   S = Q K^T      wgmma m64n128k16, A = Q (shared), B = K tile (shared), 8 k steps over d
//   O += P V       wgmma m64n128k16, A = P (registers, the C layout of S), B = V^T (shared)
// Shared tiles are [rows][128] bf16 stored as two [rows][64] halves with the 128-byte swizzle:
// the 16-byte chunk c of row r sits at chunk c ^ (r % 8), so eight rows fill all 32 banks, and
// a wgmma descriptor (K-major, 8-row groups 1024 bytes apart) walks them directly.

#include <cstdint>
#include <cstdio>

#include "attention_ptx.cuh"
#include "llama.h"

namespace hopper {

constexpr int HD = 128, BQ = 128, BK = 128, THREADS = 256;

struct Params {
    const bf16 *q, *k, *v;
    bf16* out;
    float* lse;
    int64_t ldq, ldk, ldv, ldo, seq;
    int n_heads, group;
    float scale_log2;
};

// Byte offset of element (r, c) in a swizzled [R][128] tile (two [R][64] halves).
__device__ inline uint32_t sw(int r, int c, int R) {
    const int half = c >> 6, cc = c & 63;
    return (uint32_t)(half * R * 128 + r * 128 + ((((cc >> 3) ^ (r & 7))) << 4) + ((cc & 7) << 1));
}

// wgmma shared-memory descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ inline uint64_t desc(uint32_t addr) {
    uint64_t d = (uint64_t)((addr & 0x3FFFF) >> 4);
    d |= (uint64_t)1 << 16;            // leading byte offset: unused for swizzled K-major
    d |= (uint64_t)(1024 >> 4) << 32;  // stride byte offset
    d |= (uint64_t)1 << 62;            // 128-byte swizzle
    return d;
}
// The k-th 16-wide slice of a swizzled [R][128] tile starting at `base` (shared address).
__device__ inline uint64_t slice_desc(uint32_t base, int k, int R) {
    return desc(base + (uint32_t)((k >> 2) * R * 128 + (k & 3) * 32));
}

__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ inline void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ inline void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keep the compiler from moving accumulator reads and writes across the asynchronous products.
__device__ inline void fence_regs(float* r, int n) {
    for (int i = 0; i < n; i++) asm volatile("" : "+f"(r[i])::"memory");
}

// The wgmma forms used here (64 or 32 fp32 accumulator registers per thread).
__device__ inline void wgmma_ss(float* d, uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(scale_d));
}

__device__ inline void wgmma_rs(float* d, const uint32_t* a, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

__device__ inline void wgmma_ss64(float* d, uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(scale_d));
}


// Rows [row0, row0 + R) of a [*, ld] bf16 matrix (128 columns) into a swizzled [R][128] tile.
template <int R = 128>
__device__ inline void load_swizzled(uint32_t tile, const bf16* g, int64_t ld, int64_t row0, int64_t nrows) {
    for (int c = threadIdx.x; c < R * 16; c += THREADS) {
        const int r = c >> 4, col = (c & 15) * 8;
        const int64_t row = row0 + r;
        const bool valid = row < nrows;
        cp_async16(tile + sw(r, col, R), g + (valid ? row : 0) * ld + col, valid);
    }
}
// Rows of V into a plain [128][128 + 8] staging tile (transposed later).
constexpr int VLD = HD + 8;
template <int R = 128>
__device__ inline void load_plain(bf16* tile, const bf16* g, int64_t ld, int64_t row0, int64_t nrows) {
    for (int c = threadIdx.x; c < R * 16; c += THREADS) {
        const int r = c >> 4, col = (c & 15) * 8;
        const int64_t row = row0 + r;
        const bool valid = row < nrows;
        cp_async16(smem_u32(tile + r * VLD + col), g + (valid ? row : 0) * ld + col, valid);
    }
}
// A [R][128] staging tile -> its transpose [128][R], swizzled (R = 64 or 128 columns).
template <int R = 128>
__device__ inline void transpose_v(unsigned char* vt, const bf16* staging) {
    for (int c = threadIdx.x; c < R * 16; c += THREADS) {
        const int key = c >> 4, d0 = (c & 15) * 8;
        const uint4 chunk = *(const uint4*)(staging + key * VLD + d0);
        const bf16* e = (const bf16*)&chunk;
        for (int i = 0; i < 8; i++) *(bf16*)(vt + sw(d0 + i, key, 128)) = e[i];
    }
}
__device__ inline void load_vec(float* dst, const float* g, int64_t row0, int64_t nrows, int n) {
    for (int i = threadIdx.x; i < n; i += THREADS) dst[i] = row0 + i < nrows ? g[row0 + i] : 0.f;
}

constexpr int TILE_BYTES = 128 * 128 * 2;  // 32 KiB, a multiple of 1024
constexpr int STAGE_BYTES = 128 * VLD * 2;
constexpr int SMEM_BYTES = 1024 + TILE_BYTES /*Q*/ + 2 * TILE_BYTES /*K*/ + TILE_BYTES /*V^T*/ + 2 * STAGE_BYTES;

__global__ void __launch_bounds__(THREADS, 1) forward_kernel(Params p) {
    extern __shared__ unsigned char smem_raw[];
    // Swizzled tiles must start on 1024 bytes (the swizzle repeats every 8 rows of 128 bytes).
    unsigned char* smem = (unsigned char*)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    unsigned char* sQ = smem;
    unsigned char* sK = sQ + TILE_BYTES;           // [2]
    unsigned char* sVt = sK + 2 * TILE_BYTES;
    bf16* sV = (bf16*)(sVt + TILE_BYTES);          // [2][128][VLD]

    const int64_t q_tile = gridDim.x - 1 - blockIdx.x;  // longest rows first
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / p.group;
    const int64_t q0 = q_tile * BQ, tok0 = (int64_t)b * p.seq;
    const bf16* Q = p.q + tok0 * p.ldq + (int64_t)h * HD;
    const bf16* K = p.k + tok0 * p.ldk + (int64_t)kvh * HD;
    const bf16* V = p.v + tok0 * p.ldv + (int64_t)kvh * HD;
    const int wg = threadIdx.x / 128, lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    const int g = lane / 4, t = lane % 4;
    const int64_t n_tiles = min(q_tile + 1, (p.seq + BK - 1) / BK);

    load_swizzled(smem_u32(sQ), Q, p.ldq, q0, p.seq);
    load_swizzled(smem_u32(sK), K, p.ldk, 0, p.seq);
    load_plain(sV, V, p.ldv, 0, p.seq);
    cp_async_commit();

    float o[64], s[64];
    for (int i = 0; i < 64; i++) o[i] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
    const int64_t my_row[2] = {q0 + wg * 64 + warp * 16 + g, q0 + wg * 64 + warp * 16 + g + 8};
    const uint32_t q_base = smem_u32(sQ) + wg * 64 * 128;  // this warpgroup's 64 rows, in each half

    for (int64_t kt = 0; kt < n_tiles; kt++) {
        const int stage = kt & 1;
        if (kt + 1 < n_tiles) {
            load_swizzled(smem_u32(sK + (stage ^ 1) * TILE_BYTES), K, p.ldk, (kt + 1) * BK, p.seq);
            load_plain(sV + (stage ^ 1) * 128 * VLD, V, p.ldv, (kt + 1) * BK, p.seq);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        transpose_v(sVt, sV + stage * 128 * VLD);
        fence_proxy_async();  // ordinary and cp.async writes, then read by the tensor cores
        __syncthreads();

        // S = Q K^T: 64 rows x 128 keys per warpgroup.
        const uint32_t k_base = smem_u32(sK + stage * TILE_BYTES);
        fence_regs(s, 64);
        wgmma_fence();
        for (int k = 0; k < HD / 16; k++)
            wgmma_ss(s, slice_desc(q_base, k, 128), slice_desc(k_base, k, 128), k > 0);
        wgmma_commit();
        wgmma_wait0();
        fence_regs(s, 64);

        // Scale to log2 units, mask the future, online softmax (a quad of lanes holds a row).
        const int64_t k0 = kt * BK;
        const bool diagonal = k0 + BK > q0;
        float tile_max[2] = {row_max[0], row_max[1]};
        for (int j = 0; j < 16; j++)
            for (int e = 0; e < 4; e++) {
                float x = s[4 * j + e] * p.scale_log2;
                if (diagonal && k0 + 8 * j + 2 * t + (e & 1) > my_row[e / 2]) x = -INFINITY;
                s[4 * j + e] = x;
                tile_max[e / 2] = fmaxf(tile_max[e / 2], x);
            }
        for (int r = 0; r < 2; r++) {
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
            // A row with no visible key yet (past the sequence's end) keeps max -inf: use 0.
            const float m_new = tile_max[r] == -INFINITY ? 0.f : tile_max[r];
            const float correction = exp2f(row_max[r] - m_new);
            row_max[r] = m_new;
            row_sum[r] *= correction;
            for (int j = 0; j < 16; j++) o[4 * j + 2 * r] *= correction, o[4 * j + 2 * r + 1] *= correction;
        }
        uint32_t pa[32];
        for (int j = 0; j < 16; j++)
            for (int e = 0; e < 4; e++) {
                s[4 * j + e] = exp2f(s[4 * j + e] - row_max[e / 2]);
                row_sum[e / 2] += s[4 * j + e];
            }
        for (int kc = 0; kc < 8; kc++) {  // the C fragments of n-blocks 2kc, 2kc+1 = the A fragment of k step kc
            pa[4 * kc + 0] = pack_bf16(s[8 * kc + 0], s[8 * kc + 1]);
            pa[4 * kc + 1] = pack_bf16(s[8 * kc + 2], s[8 * kc + 3]);
            pa[4 * kc + 2] = pack_bf16(s[8 * kc + 4], s[8 * kc + 5]);
            pa[4 * kc + 3] = pack_bf16(s[8 * kc + 6], s[8 * kc + 7]);
        }

        // O += P V: A = P from registers, B = V^T (K-major over keys).
        const uint32_t v_base = smem_u32(sVt);
        fence_regs(o, 64);
        wgmma_fence();
        for (int kc = 0; kc < BK / 16; kc++) wgmma_rs(o, pa + 4 * kc, slice_desc(v_base, kc, 128));
        wgmma_commit();
        wgmma_wait0();
        fence_regs(o, 64);
        __syncthreads();  // every warpgroup is done with this stage and with V^T
    }

    for (int r = 0; r < 2; r++) {
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
        if (my_row[r] >= p.seq) continue;
        const float inv = 1.f / row_sum[r];
        bf16* orow = p.out + (tok0 + my_row[r]) * p.ldo + (int64_t)h * HD;
        for (int j = 0; j < 16; j++)
            *(__nv_bfloat162*)(orow + 8 * j + 2 * t) =
                __floats2bfloat162_rn(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
        if (t == 0)
            p.lse[((int64_t)b * p.n_heads + h) * p.seq + my_row[r]] = (row_max[r] + log2f(row_sum[r])) * LN2;
    }
}


// =============================================================================================
// Backward (given delta = rowsum(dO * O)), deterministic as in attention.cu: one block per KV
// tile computes dK and dV over every query head of its GQA group, one block per query tile
// computes dQ. All products are wgmma; operands that a product needs with the other dimension
// contiguous (Q and dO for dV, dK; K for dQ) are transposed in shared memory.
struct BwdParams {
    const bf16 *q, *k, *v, *dout;
    const float *lse, *delta;
    bf16 *dq, *dk, *dv;
    int64_t ldq, ldk, ldv, lddo, lddq, lddk, lddv, seq;
    int n_heads, group;
    float scale, scale_log2;
    bool accumulate_dkv;
};

// C fragments of an m64nN accumulator, columns 16kc..16kc+15 -> the A fragment of k step kc.
__device__ inline void to_a(uint32_t* a, const float* c, int kc) {
    a[0] = pack_bf16(c[8 * kc + 0], c[8 * kc + 1]);
    a[1] = pack_bf16(c[8 * kc + 2], c[8 * kc + 3]);
    a[2] = pack_bf16(c[8 * kc + 4], c[8 * kc + 5]);
    a[3] = pack_bf16(c[8 * kc + 6], c[8 * kc + 7]);
}

constexpr int QT = 64;  // query rows per step of the dK/dV kernel; key rows per step of dQ's
constexpr int DKDV_SMEM = 1024 + 2 * TILE_BYTES /*K, V*/ + 4 * (TILE_BYTES / 2) /*Q, dO, Q^T, dO^T*/ +
                          2 * QT * VLD * 2 /*staging*/ + 2 * QT * 4;

__global__ void __launch_bounds__(THREADS, 1) dkdv_kernel(BwdParams p) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = (unsigned char*)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    unsigned char* sK = smem;                        // [128][128]
    unsigned char* sV = sK + TILE_BYTES;             // [128][128]
    unsigned char* sQ = sV + TILE_BYTES;             // [64][128]
    unsigned char* sdO = sQ + TILE_BYTES / 2;        // [64][128]
    unsigned char* sQt = sdO + TILE_BYTES / 2;       // [128][64]
    unsigned char* sdOt = sQt + TILE_BYTES / 2;      // [128][64]
    bf16* stQ = (bf16*)(sdOt + TILE_BYTES / 2);      // [64][VLD]
    bf16* stdO = stQ + QT * VLD;                     // [64][VLD]
    float* sLse = (float*)(stdO + QT * VLD);         // [64]
    float* sDelta = sLse + QT;                       // [64]

    const int64_t k_tile = blockIdx.x;  // early key tiles see the most queries: first
    const int kvh = blockIdx.y, b = blockIdx.z;
    const int64_t k0 = k_tile * 128, tok0 = (int64_t)b * p.seq;
    const int wg = threadIdx.x / 128, lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    const int g = lane / 4, t = lane % 4;
    const int64_t my_key[2] = {k0 + wg * 64 + warp * 16 + g, k0 + wg * 64 + warp * 16 + g + 8};

    load_swizzled(smem_u32(sK), p.k + tok0 * p.ldk + (int64_t)kvh * HD, p.ldk, k0, p.seq);
    load_swizzled(smem_u32(sV), p.v + tok0 * p.ldv + (int64_t)kvh * HD, p.ldv, k0, p.seq);
    cp_async_commit();
    const uint32_t k_base = smem_u32(sK) + wg * 64 * 128, v_base = smem_u32(sV) + wg * 64 * 128;

    float dk[64], dv[64], st[32], dpt[32];
    for (int i = 0; i < 64; i++) dk[i] = 0.f, dv[i] = 0.f;
    const int64_t first_qt = k0 / QT, n_qt = (p.seq + QT - 1) / QT;
    for (int i = 0; i < p.group; i++) {
        const int h = kvh * p.group + i;
        const bf16* Q = p.q + tok0 * p.ldq + (int64_t)h * HD;
        const bf16* dO = p.dout + tok0 * p.lddo + (int64_t)h * HD;
        const int64_t head_row = ((int64_t)b * p.n_heads + h) * p.seq;
        for (int64_t qt = first_qt; qt < n_qt; qt++) {
            const int64_t q0 = qt * QT;
            __syncthreads();  // the previous step's readers are done
            load_swizzled<QT>(smem_u32(sQ), Q, p.ldq, q0, p.seq);
            load_swizzled<QT>(smem_u32(sdO), dO, p.lddo, q0, p.seq);
            load_plain<QT>(stQ, Q, p.ldq, q0, p.seq);
            load_plain<QT>(stdO, dO, p.lddo, q0, p.seq);
            cp_async_commit();
            load_vec(sLse, p.lse + head_row, q0, p.seq, QT);
            load_vec(sDelta, p.delta + head_row, q0, p.seq, QT);
            cp_async_wait<0>();
            __syncthreads();
            transpose_v<QT>(sQt, stQ);
            transpose_v<QT>(sdOt, stdO);
            fence_proxy_async();
            __syncthreads();

            // S^T = K Q^T and dP^T = V dO^T: 64 keys x 64 queries per warpgroup.
            fence_regs(st, 32), fence_regs(dpt, 32);
            wgmma_fence();
            for (int k = 0; k < HD / 16; k++)
                wgmma_ss64(st, slice_desc(k_base, k, 128), slice_desc(smem_u32(sQ), k, QT), k > 0);
            for (int k = 0; k < HD / 16; k++)
                wgmma_ss64(dpt, slice_desc(v_base, k, 128), slice_desc(smem_u32(sdO), k, QT), k > 0);
            wgmma_commit();
            wgmma_wait0();
            fence_regs(st, 32), fence_regs(dpt, 32);

            // P^T = exp(scale s - lse) where the query sees the key; dS^T = P^T (dP^T - delta).
            for (int j = 0; j < 8; j++)
                for (int e = 0; e < 4; e++) {
                    const int qi = 8 * j + 2 * t + (e & 1);
                    const int64_t query = q0 + qi;
                    const bool visible = query >= my_key[e / 2] && query < p.seq;
                    const float pr = visible ? exp2f(st[4 * j + e] * p.scale_log2 - sLse[qi] * LOG2E) : 0.f;
                    st[4 * j + e] = pr;
                    dpt[4 * j + e] = pr * (dpt[4 * j + e] - sDelta[qi]);
                }
            uint32_t pa[16], dsa[16];
            for (int kc = 0; kc < 4; kc++) to_a(pa + 4 * kc, st, kc), to_a(dsa + 4 * kc, dpt, kc);
            // dV += P^T dO and dK += dS^T Q (k = the 64 queries).
            fence_regs(dv, 64), fence_regs(dk, 64);
            wgmma_fence();
            for (int kc = 0; kc < 4; kc++) wgmma_rs(dv, pa + 4 * kc, slice_desc(smem_u32(sdOt), kc, 128));
            for (int kc = 0; kc < 4; kc++) wgmma_rs(dk, dsa + 4 * kc, slice_desc(smem_u32(sQt), kc, 128));
            wgmma_commit();
            wgmma_wait0();
            fence_regs(dv, 64), fence_regs(dk, 64);
        }
    }
    for (int r = 0; r < 2; r++) {
        if (my_key[r] >= p.seq) continue;
        bf16* dkrow = p.dk + (tok0 + my_key[r]) * p.lddk + (int64_t)kvh * HD;
        bf16* dvrow = p.dv + (tok0 + my_key[r]) * p.lddv + (int64_t)kvh * HD;
        for (int j = 0; j < 16; j++) {
            __nv_bfloat162* kp = (__nv_bfloat162*)(dkrow + 8 * j + 2 * t);
            __nv_bfloat162* vp = (__nv_bfloat162*)(dvrow + 8 * j + 2 * t);
            float2 k_old = p.accumulate_dkv ? __bfloat1622float2(*kp) : make_float2(0.f, 0.f);
            float2 v_old = p.accumulate_dkv ? __bfloat1622float2(*vp) : make_float2(0.f, 0.f);
            *kp = __floats2bfloat162_rn(k_old.x + dk[4 * j + 2 * r] * p.scale, k_old.y + dk[4 * j + 2 * r + 1] * p.scale);
            *vp = __floats2bfloat162_rn(v_old.x + dv[4 * j + 2 * r], v_old.y + dv[4 * j + 2 * r + 1]);
        }
    }
}

constexpr int DQ_SMEM = 1024 + 2 * TILE_BYTES /*Q, dO*/ + 3 * (TILE_BYTES / 2) /*K, V, K^T*/ + QT * VLD * 2 +
                        2 * 128 * 4;

__global__ void __launch_bounds__(THREADS, 1) dq_kernel(BwdParams p) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = (unsigned char*)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    unsigned char* sQ = smem;                        // [128][128]
    unsigned char* sdO = sQ + TILE_BYTES;            // [128][128]
    unsigned char* sK = sdO + TILE_BYTES;            // [64][128]
    unsigned char* sV = sK + TILE_BYTES / 2;         // [64][128]
    unsigned char* sKt = sV + TILE_BYTES / 2;        // [128][64]
    bf16* stK = (bf16*)(sKt + TILE_BYTES / 2);       // [64][VLD]
    float* sLse = (float*)(stK + QT * VLD);          // [128]
    float* sDelta = sLse + 128;                      // [128]

    const int64_t q_tile = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / p.group;
    const int64_t q0 = q_tile * 128, tok0 = (int64_t)b * p.seq;
    const int64_t head_row = ((int64_t)b * p.n_heads + h) * p.seq;
    const bf16* K = p.k + tok0 * p.ldk + (int64_t)kvh * HD;
    const bf16* V = p.v + tok0 * p.ldv + (int64_t)kvh * HD;
    const int wg = threadIdx.x / 128, lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    const int g = lane / 4, t = lane % 4;
    const int rloc[2] = {wg * 64 + warp * 16 + g, wg * 64 + warp * 16 + g + 8};

    load_swizzled(smem_u32(sQ), p.q + tok0 * p.ldq + (int64_t)h * HD, p.ldq, q0, p.seq);
    load_swizzled(smem_u32(sdO), p.dout + tok0 * p.lddo + (int64_t)h * HD, p.lddo, q0, p.seq);
    cp_async_commit();
    load_vec(sLse, p.lse + head_row, q0, p.seq, 128);
    load_vec(sDelta, p.delta + head_row, q0, p.seq, 128);
    const uint32_t q_base = smem_u32(sQ) + wg * 64 * 128, do_base = smem_u32(sdO) + wg * 64 * 128;

    float dq[64], s[32], dp[32];
    for (int i = 0; i < 64; i++) dq[i] = 0.f;
    const int64_t n_kt = min((q0 + 128 + QT - 1) / QT, (p.seq + QT - 1) / QT);
    for (int64_t kt = 0; kt < n_kt; kt++) {
        const int64_t k0 = kt * QT;
        __syncthreads();
        load_swizzled<QT>(smem_u32(sK), K, p.ldk, k0, p.seq);
        load_swizzled<QT>(smem_u32(sV), V, p.ldv, k0, p.seq);
        load_plain<QT>(stK, K, p.ldk, k0, p.seq);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        transpose_v<QT>(sKt, stK);
        fence_proxy_async();
        __syncthreads();

        fence_regs(s, 32), fence_regs(dp, 32);
        wgmma_fence();
        for (int k = 0; k < HD / 16; k++)
            wgmma_ss64(s, slice_desc(q_base, k, 128), slice_desc(smem_u32(sK), k, QT), k > 0);
        for (int k = 0; k < HD / 16; k++)
            wgmma_ss64(dp, slice_desc(do_base, k, 128), slice_desc(smem_u32(sV), k, QT), k > 0);
        wgmma_commit();
        wgmma_wait0();
        fence_regs(s, 32), fence_regs(dp, 32);
        for (int j = 0; j < 8; j++)
            for (int e = 0; e < 4; e++) {
                const int64_t key = k0 + 8 * j + 2 * t + (e & 1), query = q0 + rloc[e / 2];
                const bool visible = key <= query && key < p.seq;
                const float pr = visible ? exp2f(s[4 * j + e] * p.scale_log2 - sLse[rloc[e / 2]] * LOG2E) : 0.f;
                dp[4 * j + e] = pr * (dp[4 * j + e] - sDelta[rloc[e / 2]]);
            }
        uint32_t dsa[16];
        for (int kc = 0; kc < 4; kc++) to_a(dsa + 4 * kc, dp, kc);
        fence_regs(dq, 64);
        wgmma_fence();
        for (int kc = 0; kc < 4; kc++) wgmma_rs(dq, dsa + 4 * kc, slice_desc(smem_u32(sKt), kc, 128));
        wgmma_commit();
        wgmma_wait0();
        fence_regs(dq, 64);
    }
    for (int r = 0; r < 2; r++) {
        const int64_t query = q0 + rloc[r];
        if (query >= p.seq) continue;
        bf16* row = p.dq + (tok0 + query) * p.lddq + (int64_t)h * HD;
        for (int j = 0; j < 16; j++)
            *(__nv_bfloat162*)(row + 8 * j + 2 * t) =
                __floats2bfloat162_rn(dq[4 * j + 2 * r] * p.scale, dq[4 * j + 2 * r + 1] * p.scale);
    }
}

}  // namespace hopper

// Same arguments as attention_forward (head dim 128 only).
void attention_forward_hopper(const AttentionForwardArgs& a, const AttentionShape& sh, cudaStream_t s) {
    if (sh.head_dim != 128) usage_error("attention_forward_hopper: head dim 128 only");
    if (sh.seq == 0 || sh.batch == 0) return;
    hopper::Params p{};
    p.q = a.q, p.k = a.k, p.v = a.v, p.out = a.out, p.lse = a.lse;
    p.ldq = a.ldq, p.ldk = a.ldk, p.ldv = a.ldv, p.ldo = a.ldo, p.seq = sh.seq;
    p.n_heads = sh.n_heads, p.group = sh.n_heads / sh.n_kv_heads;
    p.scale_log2 = (1.0f / sqrtf((float)sh.head_dim)) * LOG2E;
    static bool configured = false;
    if (!configured) {
        CUDA_CHECK(cudaFuncSetAttribute(hopper::forward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        hopper::SMEM_BYTES));
        configured = true;
    }
    dim3 grid((unsigned)((sh.seq + hopper::BQ - 1) / hopper::BQ), sh.n_heads, sh.batch);
    hopper::forward_kernel<<<grid, hopper::THREADS, hopper::SMEM_BYTES, s>>>(p);
    CUDA_CHECK_LAUNCH();
}

// Backward with delta given (a.out == nullptr), head dim 128: dk/dv kernel, then dq kernel.
void attention_backward_hopper(const AttentionBackwardArgs& a, const AttentionShape& sh, cudaStream_t s) {
    if (sh.head_dim != 128 || a.out != nullptr) usage_error("attention_backward_hopper: head dim 128, delta given");
    if (sh.seq == 0 || sh.batch == 0) return;
    hopper::BwdParams p{};
    p.q = a.q, p.k = a.k, p.v = a.v, p.dout = a.dout, p.lse = a.lse, p.delta = a.delta;
    p.dq = a.dq, p.dk = a.dk, p.dv = a.dv;
    p.ldq = a.ldq, p.ldk = a.ldk, p.ldv = a.ldv, p.lddo = a.lddo, p.lddq = a.lddq, p.lddk = a.lddk, p.lddv = a.lddv;
    p.seq = sh.seq, p.n_heads = sh.n_heads, p.group = sh.n_heads / sh.n_kv_heads;
    p.scale = 1.0f / sqrtf((float)sh.head_dim), p.scale_log2 = p.scale * LOG2E;
    p.accumulate_dkv = a.accumulate_dkv;
    static bool configured = false;
    if (!configured) {
        CUDA_CHECK(cudaFuncSetAttribute(hopper::dkdv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        hopper::DKDV_SMEM));
        CUDA_CHECK(cudaFuncSetAttribute(hopper::dq_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, hopper::DQ_SMEM));
        configured = true;
    }
    dim3 grid_kv((unsigned)((sh.seq + 127) / 128), sh.n_kv_heads, sh.batch);
    hopper::dkdv_kernel<<<grid_kv, hopper::THREADS, hopper::DKDV_SMEM, s>>>(p);
    CUDA_CHECK_LAUNCH();
    dim3 grid_q((unsigned)((sh.seq + 127) / 128), sh.n_heads, sh.batch);
    hopper::dq_kernel<<<grid_q, hopper::THREADS, hopper::DQ_SMEM, s>>>(p);
    CUDA_CHECK_LAUNCH();
}
