// kernels/attention.cu - flash attention, forward and backward: causal, grouped-query (GQA), bf16 in
// and out, fp32 accumulation, fp32 log-sum-exp saved for the backward. Head dim 64 or 128.
//
// Why it never needs an S x S matrix (FlashAttention, Dao et al. 2022; FA2 work split, 2023):
// the softmax of a row can be computed in pieces. Walking the keys in tiles and keeping for each
// query row the running maximum m and the running sum l of exp(s - m), the output is rescaled
// by exp(m_old - m_new) whenever the maximum grows, and divided by l at the end. Memory is
// O(S * d) per head; the S x S scores exist only one 64 x 64 tile at a time, in registers.
//
// The backward recomputes the probabilities P = exp(s - lse) tile by tile from the saved
// log-sum-exp (lse), so it needs only q, k, v, out, dout and lse:
//     dV = P^T dO          dP = dO V^T          dS = P * (dP - delta),  delta = rowsum(dO * O)
//     dQ = scale * dS K    dK = scale * dS^T Q
// It is split in two kernels so that no two blocks write the same output (deterministic, no
// atomics): one block per KV tile computes dK and dV, summing over every query head of its GQA
// group inside the kernel; one block per query tile computes dQ. The price is computing S and
// dP twice (attention_hopper.cu, the fast kernels, pays it too).
//
// Tensor cores through mma.sync m16n8k16 (bf16 in, fp32 accumulate), operands from shared
// memory via ldmatrix, global -> shared copies via cp.async, double-buffered. Every row index
// and offset is 64-bit: a 5M-token sequence times a row stride of 5120 overflows 32 bits.
//
// Fragment layout of mma.m16n8k16 (lane = 4 * g + t, g = lane / 4, t = lane % 4):
//   A (16 x 16, row-major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16 x 8, "col"):      b0 = (k = 2t..2t+1, n = g), b1 = (k = 2t+8.., n = g)
//   C (16 x 8, fp32):       c0, c1 = (g, 2t..2t+1), c2, c3 = (g+8, 2t..2t+1)
// So the C fragments of two neighbouring 8-column tiles are exactly the A fragment of a 16-wide
// k step: the probabilities P never leave registers between S = Q K^T and O += P V.
#include <algorithm>

#include "attention_ptx.cuh"
#include "documents.cuh"
#include "kernels/attention.h"

namespace {

constexpr int THREADS = 128;  // 4 warps; each warp owns 16 rows of the block's tile
constexpr int PAD = 8;        // shared rows padded by 16 bytes: ldmatrix reads conflict-free

// ---------------------------------------------------------------------------------------------
// PTX wrappers (the shared ones in attention_ptx.cuh).
__device__ inline void cp_async4(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(valid ? 4 : 0));
}
__device__ inline void ldmatrix_x4(uint32_t r[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}
__device__ inline void ldmatrix_x4_trans(uint32_t r[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

// c += a * b, one m16n8k16 tensor-core product.
__device__ inline void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---------------------------------------------------------------------------------------------
// Operand loads from shared memory tiles with row stride LDS (elements).
//
// A operand: 16 rows starting at `rows`, 16 columns starting at `col`.
template <int LDS>
__device__ inline void load_a(uint32_t a[4], const bf16* tile, int rows, int col, int lane) {
    ldmatrix_x4(a, tile + (rows + lane % 16) * LDS + col + (lane / 16) * 8);
}
// B operands of two neighbouring n-tiles when the tile is stored [n][k] (e.g. K for Q K^T):
// rows n0..n0+15, k columns k0..k0+15. b[0], b[1] for n0..n0+7; b[2], b[3] for n0+8..n0+15.
template <int LDS>
__device__ inline void load_b_nk(uint32_t b[4], const bf16* tile, int n0, int k0, int lane) {
    ldmatrix_x4(b, tile + (n0 + lane % 8 + (lane / 16) * 8) * LDS + k0 + ((lane / 8) & 1) * 8);
}
// B operands of two neighbouring n-tiles when the tile is stored [k][n] (e.g. V for P V):
// k rows k0..k0+15, n columns n0..n0+15, transposed on load.
template <int LDS>
__device__ inline void load_b_kn(uint32_t b[4], const bf16* tile, int k0, int n0, int lane) {
    ldmatrix_x4_trans(b, tile + (k0 + lane % 8 + ((lane / 8) & 1) * 8) * LDS + n0 + (lane / 16) * 8);
}

// Copy rows [row0, row0 + ROWS) of a row-major bf16 matrix (HD columns, row stride ld) into a
// shared tile; rows at or past `nrows` are zero-filled.
template <int ROWS, int HD>
__device__ inline void load_tile(bf16* tile, const bf16* g, int64_t ld, int64_t row0,
                                 int64_t nrows) {
    constexpr int CHUNKS = HD / 8, LDS = HD + PAD;
    for (int c = threadIdx.x; c < ROWS * CHUNKS; c += THREADS) {
        int r = c / CHUNKS, col = (c % CHUNKS) * 8;
        int64_t row = row0 + r;
        bool valid = row < nrows;
        cp_async16(tile + r * LDS + col, g + (valid ? row : 0) * ld + col, valid);
    }
}
// Copy `n` floats starting at row0 (fewer when past nrows: zero-filled).
template <int N>
__device__ inline void load_vec(float* dst, const float* g, int64_t row0, int64_t nrows) {
    for (int i = threadIdx.x; i < N; i += THREADS) {
        bool valid = row0 + i < nrows;
        cp_async4(dst + i, g + (valid ? row0 + i : 0), valid);
    }
}

struct Params {
    const bf16 *q, *k, *v, *o, *dout;  // o: the forward's output, read by the backward
    bf16* out;                         // the forward writes here
    int64_t ldq, ldk, ldv, ldo, lddo;
    float* lse;
    float* delta;
    bf16 *dq, *dk, *dv;
    int64_t lddq, lddk, lddv;
    int64_t seq;
    int n_heads, group;  // group = Hq / Hkv query heads per KV head
    float scale;         // 1 / sqrt(d)
    float scale_log2;    // scale * log2(e): exp(x * scale) = exp2(x * scale_log2)
    bool accumulate_dkv; // dk, dv += (in fp32, stored bf16) instead of =
    AttentionDocs docs;  // packed documents (documents.cuh), or none: causal
};


// =============================================================================================
// Forward. Block: 64 query rows of one head of one sequence; keys walked in tiles of 64.
constexpr int FWD_Q = 64, FWD_K = 64;

template <int HD>
__global__ void __launch_bounds__(THREADS) attention_forward_kernel(Params p) {
    constexpr int LDS = HD + PAD;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16* sQ = (bf16*)smem;              // [FWD_Q][LDS]
    bf16* sK = sQ + FWD_Q * LDS;         // [2][FWD_K][LDS]
    bf16* sV = sK + 2 * FWD_K * LDS;     // [2][FWD_K][LDS]

    // Causal tiles near the end of the sequence have the most keys: schedule them first.
    const int64_t q_tile = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / p.group;
    const int64_t q0 = q_tile * FWD_Q, tok0 = (int64_t)b * p.seq;
    const bf16* Q = p.q + tok0 * p.ldq + (int64_t)h * HD;
    const bf16* K = p.k + tok0 * p.ldk + (int64_t)kvh * HD;
    const bf16* V = p.v + tok0 * p.ldv + (int64_t)kvh * HD;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

    // Keys first_key(q0) .. q0 + FWD_Q - 1 are visible to some row of this tile.
    const DocumentView docs(p.docs, p.seq);
    const int64_t kt_begin = docs.first_key(b, q0) / FWD_K;
    const int64_t n_tiles = min((q0 + FWD_Q + FWD_K - 1) / FWD_K, (p.seq + FWD_K - 1) / FWD_K);
    load_tile<FWD_Q, HD>(sQ, Q, p.ldq, q0, p.seq);
    load_tile<FWD_K, HD>(sK, K, p.ldk, kt_begin * FWD_K, p.seq);
    load_tile<FWD_K, HD>(sV, V, p.ldv, kt_begin * FWD_K, p.seq);
    cp_async_commit();

    uint32_t qf[HD / 16][4];            // this warp's 16 query rows, as A fragments
    float o[HD / 8][4] = {};            // output accumulator, 16 x HD
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};  // rows g, g + 8
    const int64_t my_row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
    const int64_t my_first[2] = {docs.first_key(b, min(my_row[0], p.seq - 1)), docs.first_key(b, min(my_row[1], p.seq - 1))};

    for (int64_t kt = kt_begin; kt < n_tiles; kt++) {
        const int stage = (kt - kt_begin) & 1;
        if (kt + 1 < n_tiles) {  // prefetch the next K, V tile into the other stage
            load_tile<FWD_K, HD>(sK + (stage ^ 1) * FWD_K * LDS, K, p.ldk, (kt + 1) * FWD_K, p.seq);
            load_tile<FWD_K, HD>(sV + (stage ^ 1) * FWD_K * LDS, V, p.ldv, (kt + 1) * FWD_K, p.seq);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (kt == kt_begin)
            for (int kk = 0; kk < HD / 16; kk++) load_a<LDS>(qf[kk], sQ, warp * 16, kk * 16, lane);
        const bf16* sKs = sK + stage * FWD_K * LDS;
        const bf16* sVs = sV + stage * FWD_K * LDS;

        // S = Q K^T for 16 rows x 64 keys.
        float s[FWD_K / 8][4] = {};
        for (int kk = 0; kk < HD / 16; kk++)
            for (int nt = 0; nt < FWD_K / 8; nt += 2) {
                uint32_t bk[4];
                load_b_nk<LDS>(bk, sKs, nt * 8, kk * 16, lane);
                mma(s[nt], qf[kk], bk[0], bk[1]);
                mma(s[nt + 1], qf[kk], bk[2], bk[3]);
            }

        // Scale into log2 units, mask the future (only tiles that reach the diagonal) and, with
        // documents, the keys before a row's document.
        const int64_t k0 = kt * FWD_K;
        const bool masked = k0 + FWD_K > q0 || k0 < my_first[1];
        float tile_max[2] = {row_max[0], row_max[1]};
        for (int nt = 0; nt < FWD_K / 8; nt++)
            for (int e = 0; e < 4; e++) {
                float x = s[nt][e] * p.scale_log2;
                if (masked && !DocumentView::sees(my_row[e / 2], my_first[e / 2], k0 + nt * 8 + 2 * t + (e & 1)))
                    x = -INFINITY;
                s[nt][e] = x;
                tile_max[e / 2] = fmaxf(tile_max[e / 2], x);
            }
        // Online softmax: the four lanes of a quad hold one row between them. A row that has seen
        // no key yet (its document starts later) keeps max -inf; 0 stands in for it below.
        for (int r = 0; r < 2; r++) {
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
            float correction = exp2f(row_max[r] - (tile_max[r] == -INFINITY ? 0.f : tile_max[r]));  // 0 on the first tile
            row_max[r] = tile_max[r];
            row_sum[r] *= correction;
            for (int dt = 0; dt < HD / 8; dt++) {
                o[dt][2 * r] *= correction;
                o[dt][2 * r + 1] *= correction;
            }
        }
        for (int nt = 0; nt < FWD_K / 8; nt++)
            for (int e = 0; e < 4; e++) {
                s[nt][e] = exp2f(s[nt][e] - (row_max[e / 2] == -INFINITY ? 0.f : row_max[e / 2]));
                row_sum[e / 2] += s[nt][e];
            }

        // O += P V, P straight from registers (C layout of two n-tiles = A layout of one k step).
        for (int kc = 0; kc < FWD_K / 16; kc++) {
            uint32_t pa[4] = {pack_bf16(s[2 * kc][0], s[2 * kc][1]),
                              pack_bf16(s[2 * kc][2], s[2 * kc][3]),
                              pack_bf16(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                              pack_bf16(s[2 * kc + 1][2], s[2 * kc + 1][3])};
            for (int dt = 0; dt < HD / 8; dt += 2) {
                uint32_t bv[4];
                load_b_kn<LDS>(bv, sVs, kc * 16, dt * 8, lane);
                mma(o[dt], pa, bv[0], bv[1]);
                mma(o[dt + 1], pa, bv[2], bv[3]);
            }
        }
        __syncthreads();  // everyone is done with this stage before it is refilled
    }

    // Normalize, write the output rows and the log-sum-exp (natural log).
    for (int r = 0; r < 2; r++) {
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
        if (my_row[r] >= p.seq) continue;
        float inv = 1.f / row_sum[r];
        bf16* orow = p.out + (tok0 + my_row[r]) * p.ldo + (int64_t)h * HD;
        for (int dt = 0; dt < HD / 8; dt++)
            *(__nv_bfloat162*)(orow + dt * 8 + 2 * t) =
                __floats2bfloat162_rn(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
        if (t == 0)
            p.lse[((int64_t)b * p.n_heads + h) * p.seq + my_row[r]] =
                (row_max[r] + log2f(row_sum[r])) * LN2;
    }
}

// =============================================================================================
// Backward, step 1: delta = rowsum(dO * O) per (token, head). One warp per (token, head).
template <int HD>
__global__ void attention_delta_kernel(Params p, int64_t T) {
    int64_t idx = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (idx >= T * p.n_heads) return;
    int64_t tok = idx / p.n_heads;
    int h = (int)(idx % p.n_heads);
    float acc = 0.f;
    for (int c = lane * 2; c < HD; c += 64) {
        float2 o = __bfloat1622float2(*(const __nv_bfloat162*)(p.o + tok * p.ldo + h * HD + c));
        float2 d = __bfloat1622float2(*(const __nv_bfloat162*)(p.dout + tok * p.lddo + h * HD + c));
        acc += o.x * d.x + o.y * d.y;
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) {
        int64_t b = tok / p.seq, i = tok % p.seq;
        p.delta[(b * p.n_heads + h) * p.seq + i] = acc;
    }
}

// =============================================================================================
// Backward, step 2: dK and dV. Block: 64 keys of one KV head (16 per warp); walks every query
// head of the GQA group and, for each, the query tiles (32 rows) at or after its first key.
constexpr int KV_K = 64, KV_Q = 32;

template <int HD>
__global__ void __launch_bounds__(THREADS) attention_backward_dkdv_kernel(Params p) {
    constexpr int LDS = HD + PAD;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16* sK = (bf16*)smem;                 // [KV_K][LDS]
    bf16* sV = sK + KV_K * LDS;             // [KV_K][LDS]
    bf16* sQ = sV + KV_K * LDS;             // [2][KV_Q][LDS]
    bf16* sdO = sQ + 2 * KV_Q * LDS;        // [2][KV_Q][LDS]
    float* sLse = (float*)(sdO + 2 * KV_Q * LDS);  // [2][KV_Q] natural-log lse
    float* sDelta = sLse + 2 * KV_Q;                // [2][KV_Q]
    int64_t* sFirst = (int64_t*)(sDelta + 2 * KV_Q);  // [2][KV_Q] each query's first key (documents)

    const int64_t k_tile = blockIdx.x;  // early key tiles see the most queries: first
    const int kvh = blockIdx.y, b = blockIdx.z;
    const int64_t k0 = k_tile * KV_K, tok0 = (int64_t)b * p.seq;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

    load_tile<KV_K, HD>(sK, p.k + tok0 * p.ldk + (int64_t)kvh * HD, p.ldk, k0, p.seq);
    load_tile<KV_K, HD>(sV, p.v + tok0 * p.ldv + (int64_t)kvh * HD, p.ldv, k0, p.seq);

    // Iteration i: query head kvh * group + i / n_qt, query tile first_qt + i % n_qt: the queries
    // from the block's first key to the end of its last key's document.
    const DocumentView docs(p.docs, p.seq);
    const int64_t rows_end = docs.doc_end(b, min(k0 + KV_K, p.seq) - 1);
    const int64_t first_qt = k0 / KV_Q, n_qt = (rows_end + KV_Q - 1) / KV_Q - first_qt;
    const int64_t n_iter = n_qt * p.group;
    auto issue_loads = [&](int64_t it, int stage) {
        int h = kvh * p.group + (int)(it / n_qt);
        int64_t qs = (first_qt + it % n_qt) * KV_Q;
        int64_t head_row = ((int64_t)b * p.n_heads + h) * p.seq;
        load_tile<KV_Q, HD>(sQ + stage * KV_Q * LDS, p.q + tok0 * p.ldq + (int64_t)h * HD, p.ldq, qs, p.seq);
        load_tile<KV_Q, HD>(sdO + stage * KV_Q * LDS, p.dout + tok0 * p.lddo + (int64_t)h * HD, p.lddo, qs, p.seq);
        load_vec<KV_Q>(sLse + stage * KV_Q, p.lse + head_row, qs, p.seq);
        load_vec<KV_Q>(sDelta + stage * KV_Q, p.delta + head_row, qs, p.seq);
        for (int i = threadIdx.x; i < KV_Q; i += THREADS) sFirst[stage * KV_Q + i] = docs.first_key(b, min(qs + i, p.seq - 1));
        cp_async_commit();
    };
    issue_loads(0, 0);

    float dk[HD / 8][4] = {}, dv[HD / 8][4] = {};
    const int64_t my_key[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};

    for (int64_t it = 0; it < n_iter; it++) {
        const int stage = it & 1;
        if (it + 1 < n_iter) {
            issue_loads(it + 1, stage ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const bf16* q = sQ + stage * KV_Q * LDS;
        const bf16* dO = sdO + stage * KV_Q * LDS;
        const float* lse = sLse + stage * KV_Q;
        const float* delta = sDelta + stage * KV_Q;
        const int64_t* first = sFirst + stage * KV_Q;
        const int64_t qs = (first_qt + it % n_qt) * KV_Q;

        // S^T = K Q^T and dP^T = V dO^T, 16 keys x 32 queries per warp.
        float st[KV_Q / 8][4] = {}, dpt[KV_Q / 8][4] = {};
        for (int kk = 0; kk < HD / 16; kk++) {
            uint32_t ka[4], va[4];
            load_a<LDS>(ka, sK, warp * 16, kk * 16, lane);
            load_a<LDS>(va, sV, warp * 16, kk * 16, lane);
            for (int nt = 0; nt < KV_Q / 8; nt += 2) {
                uint32_t bq[4], bd[4];
                load_b_nk<LDS>(bq, q, nt * 8, kk * 16, lane);
                load_b_nk<LDS>(bd, dO, nt * 8, kk * 16, lane);
                mma(st[nt], ka, bq[0], bq[1]);
                mma(st[nt + 1], ka, bq[2], bq[3]);
                mma(dpt[nt], va, bd[0], bd[1]);
                mma(dpt[nt + 1], va, bd[2], bd[3]);
            }
        }
        // P^T = exp(scale s - lse) where the query may see the key; dS^T = P^T (dP^T - delta).
        for (int nt = 0; nt < KV_Q / 8; nt++)
            for (int e = 0; e < 4; e++) {
                int qi = nt * 8 + 2 * t + (e & 1);
                int64_t query = qs + qi;
                bool visible = query < p.seq && DocumentView::sees(query, first[qi], my_key[e / 2]);
                float pr = visible ? exp2f(st[nt][e] * p.scale_log2 - lse[qi] * LOG2E) : 0.f;
                st[nt][e] = pr;
                dpt[nt][e] = pr * (dpt[nt][e] - delta[qi]);
            }
        // dV += P^T dO and dK += dS^T Q (k = the 32 queries, two k steps).
        for (int kc = 0; kc < KV_Q / 16; kc++) {
            uint32_t pa[4] = {pack_bf16(st[2 * kc][0], st[2 * kc][1]),
                              pack_bf16(st[2 * kc][2], st[2 * kc][3]),
                              pack_bf16(st[2 * kc + 1][0], st[2 * kc + 1][1]),
                              pack_bf16(st[2 * kc + 1][2], st[2 * kc + 1][3])};
            uint32_t dsa[4] = {pack_bf16(dpt[2 * kc][0], dpt[2 * kc][1]),
                               pack_bf16(dpt[2 * kc][2], dpt[2 * kc][3]),
                               pack_bf16(dpt[2 * kc + 1][0], dpt[2 * kc + 1][1]),
                               pack_bf16(dpt[2 * kc + 1][2], dpt[2 * kc + 1][3])};
            for (int dt = 0; dt < HD / 8; dt += 2) {
                uint32_t bd[4], bq[4];
                load_b_kn<LDS>(bd, dO, kc * 16, dt * 8, lane);
                load_b_kn<LDS>(bq, q, kc * 16, dt * 8, lane);
                mma(dv[dt], pa, bd[0], bd[1]);
                mma(dv[dt + 1], pa, bd[2], bd[3]);
                mma(dk[dt], dsa, bq[0], bq[1]);
                mma(dk[dt + 1], dsa, bq[2], bq[3]);
            }
        }
        __syncthreads();
    }

    for (int r = 0; r < 2; r++) {
        if (my_key[r] >= p.seq) continue;
        bf16* dkrow = p.dk + (tok0 + my_key[r]) * p.lddk + (int64_t)kvh * HD;
        bf16* dvrow = p.dv + (tok0 + my_key[r]) * p.lddv + (int64_t)kvh * HD;
        for (int dt = 0; dt < HD / 8; dt++) {
            __nv_bfloat162* dkp = (__nv_bfloat162*)(dkrow + dt * 8 + 2 * t);
            __nv_bfloat162* dvp = (__nv_bfloat162*)(dvrow + dt * 8 + 2 * t);
            float2 k_old = p.accumulate_dkv ? __bfloat1622float2(*dkp) : make_float2(0.f, 0.f);
            float2 v_old = p.accumulate_dkv ? __bfloat1622float2(*dvp) : make_float2(0.f, 0.f);
            *dkp = __floats2bfloat162_rn(k_old.x + dk[dt][2 * r] * p.scale, k_old.y + dk[dt][2 * r + 1] * p.scale);
            *dvp = __floats2bfloat162_rn(v_old.x + dv[dt][2 * r], v_old.y + dv[dt][2 * r + 1]);
        }
    }
}

// =============================================================================================
// Backward, step 3: dQ. Block: 64 query rows of one head (16 per warp); walks key tiles of 32.
constexpr int DQ_Q = 64, DQ_K = 32;

template <int HD>
__global__ void __launch_bounds__(THREADS) attention_backward_dq_kernel(Params p) {
    constexpr int LDS = HD + PAD;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16* sQ = (bf16*)smem;              // [DQ_Q][LDS]
    bf16* sdO = sQ + DQ_Q * LDS;         // [DQ_Q][LDS]
    bf16* sK = sdO + DQ_Q * LDS;         // [2][DQ_K][LDS]
    bf16* sV = sK + 2 * DQ_K * LDS;      // [2][DQ_K][LDS]

    const int64_t q_tile = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / p.group;
    const int64_t q0 = q_tile * DQ_Q, tok0 = (int64_t)b * p.seq;
    const bf16* K = p.k + tok0 * p.ldk + (int64_t)kvh * HD;
    const bf16* V = p.v + tok0 * p.ldv + (int64_t)kvh * HD;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

    load_tile<DQ_Q, HD>(sQ, p.q + tok0 * p.ldq + (int64_t)h * HD, p.ldq, q0, p.seq);
    load_tile<DQ_Q, HD>(sdO, p.dout + tok0 * p.lddo + (int64_t)h * HD, p.lddo, q0, p.seq);
    const DocumentView docs(p.docs, p.seq);
    const int64_t kt_begin = docs.first_key(b, q0) / DQ_K;  // keys from the first row's document on
    load_tile<DQ_K, HD>(sK, K, p.ldk, kt_begin * DQ_K, p.seq);
    load_tile<DQ_K, HD>(sV, V, p.ldv, kt_begin * DQ_K, p.seq);
    cp_async_commit();

    const int64_t my_row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
    const int64_t my_first[2] = {docs.first_key(b, min(my_row[0], p.seq - 1)), docs.first_key(b, min(my_row[1], p.seq - 1))};
    float lse2[2], delta[2];  // per row: lse in log2 units, delta
    const int64_t head_row = ((int64_t)b * p.n_heads + h) * p.seq;
    for (int r = 0; r < 2; r++) {
        bool valid = my_row[r] < p.seq;
        lse2[r] = valid ? p.lse[head_row + my_row[r]] * LOG2E : 0.f;
        delta[r] = valid ? p.delta[head_row + my_row[r]] : 0.f;
    }

    const int64_t n_tiles = min((q0 + DQ_Q + DQ_K - 1) / DQ_K, (p.seq + DQ_K - 1) / DQ_K);
    float dq[HD / 8][4] = {};
    for (int64_t kt = kt_begin; kt < n_tiles; kt++) {
        const int stage = (kt - kt_begin) & 1;
        if (kt + 1 < n_tiles) {
            load_tile<DQ_K, HD>(sK + (stage ^ 1) * DQ_K * LDS, K, p.ldk, (kt + 1) * DQ_K, p.seq);
            load_tile<DQ_K, HD>(sV + (stage ^ 1) * DQ_K * LDS, V, p.ldv, (kt + 1) * DQ_K, p.seq);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const bf16* sKs = sK + stage * DQ_K * LDS;
        const bf16* sVs = sV + stage * DQ_K * LDS;

        // S = Q K^T and dP = dO V^T, 16 rows x 32 keys per warp.
        float s[DQ_K / 8][4] = {}, dp[DQ_K / 8][4] = {};
        for (int kk = 0; kk < HD / 16; kk++) {
            uint32_t qa[4], da[4];
            load_a<LDS>(qa, sQ, warp * 16, kk * 16, lane);
            load_a<LDS>(da, sdO, warp * 16, kk * 16, lane);
            for (int nt = 0; nt < DQ_K / 8; nt += 2) {
                uint32_t bk[4], bv[4];
                load_b_nk<LDS>(bk, sKs, nt * 8, kk * 16, lane);
                load_b_nk<LDS>(bv, sVs, nt * 8, kk * 16, lane);
                mma(s[nt], qa, bk[0], bk[1]);
                mma(s[nt + 1], qa, bk[2], bk[3]);
                mma(dp[nt], da, bv[0], bv[1]);
                mma(dp[nt + 1], da, bv[2], bv[3]);
            }
        }
        // dS = P (dP - delta), P = exp(scale s - lse) for visible keys.
        const int64_t k0 = kt * DQ_K;
        for (int nt = 0; nt < DQ_K / 8; nt++)
            for (int e = 0; e < 4; e++) {
                int64_t key = k0 + nt * 8 + 2 * t + (e & 1);
                bool visible = DocumentView::sees(my_row[e / 2], my_first[e / 2], key);
                float pr = visible ? exp2f(s[nt][e] * p.scale_log2 - lse2[e / 2]) : 0.f;
                dp[nt][e] = pr * (dp[nt][e] - delta[e / 2]);
            }
        // dQ += dS K (k = the 32 keys, two k steps).
        for (int kc = 0; kc < DQ_K / 16; kc++) {
            uint32_t dsa[4] = {pack_bf16(dp[2 * kc][0], dp[2 * kc][1]),
                               pack_bf16(dp[2 * kc][2], dp[2 * kc][3]),
                               pack_bf16(dp[2 * kc + 1][0], dp[2 * kc + 1][1]),
                               pack_bf16(dp[2 * kc + 1][2], dp[2 * kc + 1][3])};
            for (int dt = 0; dt < HD / 8; dt += 2) {
                uint32_t bk[4];
                load_b_kn<LDS>(bk, sKs, kc * 16, dt * 8, lane);
                mma(dq[dt], dsa, bk[0], bk[1]);
                mma(dq[dt + 1], dsa, bk[2], bk[3]);
            }
        }
        __syncthreads();
    }

    for (int r = 0; r < 2; r++) {
        if (my_row[r] >= p.seq) continue;
        bf16* dqrow = p.dq + (tok0 + my_row[r]) * p.lddq + (int64_t)h * HD;
        for (int dt = 0; dt < HD / 8; dt++)
            *(__nv_bfloat162*)(dqrow + dt * 8 + 2 * t) =
                __floats2bfloat162_rn(dq[dt][2 * r] * p.scale, dq[dt][2 * r + 1] * p.scale);
    }
}

// =============================================================================================
// Launchers.
template <int HD>
constexpr int forward_smem() { return (FWD_Q + 4 * FWD_K) * (HD + PAD) * 2; }
template <int HD>
constexpr int dkdv_smem() { return (2 * KV_K + 4 * KV_Q) * (HD + PAD) * 2 + 4 * KV_Q * 4 + 2 * KV_Q * 8; }
template <int HD>
constexpr int dq_smem() { return (2 * DQ_Q + 4 * DQ_K) * (HD + PAD) * 2; }

void check_shape(const AttentionShape& sh) {
    if (sh.head_dim != 64 && sh.head_dim != 128)
        usage_error("attention: head_dim must be 64 or 128, got " + std::to_string(sh.head_dim));
    if (sh.n_kv_heads <= 0 || sh.n_heads % sh.n_kv_heads != 0)
        usage_error("attention: query heads must be a multiple of KV heads");
}

Params make_params(const AttentionShape& sh) {
    Params p{};
    p.seq = sh.seq;
    p.n_heads = sh.n_heads;
    p.group = sh.n_heads / sh.n_kv_heads;
    p.scale = 1.0f / std::sqrt((float)sh.head_dim);
    p.scale_log2 = p.scale * LOG2E;
    return p;
}

template <int HD>
void launch_forward(const Params& p, const AttentionShape& sh, cudaStream_t s) {
    static bool configured = false;
    if (!configured) {
        CUDA_CHECK(cudaFuncSetAttribute(attention_forward_kernel<HD>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, forward_smem<HD>()));
        configured = true;
    }
    dim3 grid((unsigned)((sh.seq + FWD_Q - 1) / FWD_Q), sh.n_heads, sh.batch);
    attention_forward_kernel<HD><<<grid, THREADS, forward_smem<HD>(), s>>>(p);
    CUDA_CHECK_LAUNCH();
}

template <int HD>
void launch_backward(const Params& p, const AttentionShape& sh, cudaStream_t s) {
    static bool configured = false;
    if (!configured) {
        CUDA_CHECK(cudaFuncSetAttribute(attention_backward_dkdv_kernel<HD>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, dkdv_smem<HD>()));
        CUDA_CHECK(cudaFuncSetAttribute(attention_backward_dq_kernel<HD>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, dq_smem<HD>()));
        configured = true;
    }
    const int64_t T = (int64_t)sh.batch * sh.seq;
    if (p.o) {  // otherwise the caller computed delta (Ulysses: on the token-sharded side)
        attention_delta_kernel<HD><<<(unsigned)((T * sh.n_heads + 7) / 8), 256, 0, s>>>(p, T);
        CUDA_CHECK_LAUNCH();
    }
    dim3 grid_kv((unsigned)((sh.seq + KV_K - 1) / KV_K), sh.n_kv_heads, sh.batch);
    attention_backward_dkdv_kernel<HD><<<grid_kv, THREADS, dkdv_smem<HD>(), s>>>(p);
    CUDA_CHECK_LAUNCH();
    dim3 grid_q((unsigned)((sh.seq + DQ_Q - 1) / DQ_Q), sh.n_heads, sh.batch);
    attention_backward_dq_kernel<HD><<<grid_q, THREADS, dq_smem<HD>(), s>>>(p);
    CUDA_CHECK_LAUNCH();
}

}  // namespace

void attention_forward_reference(const AttentionForwardArgs& a, const AttentionShape& sh, cudaStream_t s) {
    check_shape(sh);
    if (sh.seq == 0 || sh.batch == 0) return;
    Params p = make_params(sh);
    p.q = a.q, p.k = a.k, p.v = a.v, p.out = a.out;
    p.ldq = a.ldq, p.ldk = a.ldk, p.ldv = a.ldv, p.ldo = a.ldo;
    p.lse = a.lse;
    p.docs = a.docs;
    if (sh.head_dim == 64) launch_forward<64>(p, sh, s);
    else launch_forward<128>(p, sh, s);
}

void attention_backward_reference(const AttentionBackwardArgs& a, const AttentionShape& sh, cudaStream_t s) {
    check_shape(sh);
    if (sh.seq == 0 || sh.batch == 0) return;
    Params p = make_params(sh);
    p.q = a.q, p.k = a.k, p.v = a.v, p.o = a.out, p.dout = a.dout;
    p.ldq = a.ldq, p.ldk = a.ldk, p.ldv = a.ldv, p.ldo = a.ldo, p.lddo = a.lddo;
    p.lse = (float*)a.lse;
    p.delta = a.delta;
    p.dq = a.dq, p.dk = a.dk, p.dv = a.dv;
    p.lddq = a.lddq, p.lddk = a.lddk, p.lddv = a.lddv;
    p.accumulate_dkv = a.accumulate_dkv;
    p.docs = a.docs;
    if (sh.head_dim == 64) launch_backward<64>(p, sh, s);
    else launch_backward<128>(p, sh, s);
}

void attention_delta(const AttentionBackwardArgs& a, const AttentionShape& sh, cudaStream_t s) {
    check_shape(sh);
    const int64_t T = (int64_t)sh.batch * sh.seq;
    if (T == 0) return;
    Params p = make_params(sh);
    p.o = a.out, p.dout = a.dout, p.ldo = a.ldo, p.lddo = a.lddo, p.delta = a.delta;
    if (sh.head_dim == 64) attention_delta_kernel<64><<<(unsigned)((T * sh.n_heads + 7) / 8), 256, 0, s>>>(p, T);
    else attention_delta_kernel<128><<<(unsigned)((T * sh.n_heads + 7) / 8), 256, 0, s>>>(p, T);
    CUDA_CHECK_LAUNCH();
}

double attention_forward_flops(const AttentionShape& sh) {
    double S = (double)sh.seq;
    return 4.0 * S * S * sh.head_dim * sh.n_heads / 2.0 * sh.batch;
}
