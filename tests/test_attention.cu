// tests/test_attention.cu - flash attention forward and backward against the float64 reference,
// for both kernel sets: kernels/attention.cu's (the reference kernels) and kernels/attention_hopper.cu's (the
// fast ones the model uses on Hopper, head dim 128): GQA, head dims 64 and 128, sequence lengths
// that are not multiples of the tiles, several sequences per call, q/k/v as column slices of one
// fused QKV buffer (as the model uses them), poisoned outputs. The fast kernels' fused backward
// (dQ added in fp32 inside the dK/dV kernel, --attention fused) runs the same cases, and both
// fast backwards run each in both block orders. Every backward gives the same bits twice; a
// broken order of the fused backward's adds fails its launch instead of hanging. Then one long
// sequence whose element offsets pass 2^31, checked on sampled rows and keys in float64.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <set>
#include <tuple>

#include "gpu_util.h"
#include "reference.h"

namespace {

struct Case {
    int B;
    int64_t S;
    int Hq, Hkv, d;
    bool reference;      // the reference kernels; else the dispatch's choice (the fast ones on Hopper)
    bool fused = false;  // the fast kernels' fused backward (an fp32 dQ workspace given)
    // The fast backward's block order: KV head by KV head, or tile by tile across the heads
    // (the default picks the first from 16K tokens, so these small cases would see only the second).
    enum Order { by_size, kv_major, tile_major } order = by_size;
    bool docs = false;  // packed documents (case_documents)
};

Case with_documents(Case c) {
    c.docs = true;
    return c;
}

std::string name(const Case& c) {
    const char* order[] = {"", " kv-major", " tile-major"};
    return std::string(c.reference ? "reference" : c.fused ? "fused" : "fast") + order[c.order] + " B" +
           std::to_string(c.B) + " S" + std::to_string(c.S) + " Hq" + std::to_string(c.Hq) + " Hkv" +
           std::to_string(c.Hkv) + " d" + std::to_string(c.d) + (c.docs ? " documents" : "");
}

// Packed documents of a case, fresh each run: in every sequence a document starts at 0, on the
// 64- and 128-token tile edges, at a random token followed by a one-token document, and at a few
// more random tokens. The starts in the call's flat order, and each token's first key (the
// reference's view of the same thing, found here by a scan of its own).
struct CaseDocuments {
    std::vector<int64_t> starts, first_key;
};
CaseDocuments case_documents(const Case& c, std::mt19937_64& rng) {
    CaseDocuments d;
    for (int b = 0; b < c.B; b++) {
        std::set<int64_t> st = {0};
        for (int64_t edge : {64, 128, 192, 256, 512})
            if (edge < c.S) st.insert(edge);
        if (c.S > 2) {
            const int64_t x = 1 + (int64_t)(rng() % (uint64_t)(c.S - 2));
            st.insert(x), st.insert(x + 1);
        }
        for (int k = 0; k < 3; k++) st.insert((int64_t)(rng() % (uint64_t)c.S));
        for (int64_t x : st) d.starts.push_back((int64_t)b * c.S + x);
        for (int64_t t = 0, first = 0; t < c.S; t++) {
            if (st.count(t)) first = t;
            d.first_key.push_back(first);
        }
    }
    return d;
}

bool hopper_gpu() {
    int dev = 0, major = 0, minor = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    return major == 9 && minor == 0;
}

// Select the kernels of a case, and make sure the fast case really runs the fast kernels where
// they exist (else both cases would test the reference twice). Restored at scope exit.
struct KernelChoice {
    KernelChoice(bool reference, const AttentionShape& sh) {
        attention_use_reference(reference);
        if (!reference && sh.head_dim == 128 && hopper_gpu()) EXPECT_TRUE(attention_uses_hopper(sh));
        if (reference) EXPECT_FALSE(attention_uses_hopper(sh));
    }
    ~KernelChoice() { attention_use_reference(false); }
};

// The backward as the dispatch runs it, with the fast kernels' blocks in the case's order: the
// dispatch's delta first, then attention_backward_hopper told the order.
void run_backward(const AttentionBackwardArgs& a, const AttentionShape& sh, Case::Order order) {
    if (order == Case::by_size || !attention_uses_hopper(sh)) return attention_backward(a, sh, 0);
    AttentionBackwardArgs given = a;
    if (a.out) attention_delta(a, sh, 0), given.out = nullptr;
    HopperBackwardOptions opt;
    opt.kv_major_from_tiles = order == Case::kv_major ? 1 : INT64_MAX;
    attention_backward_hopper(given, sh, 0, opt);
}

// A fused [T, (Hq + 2 Hkv) d] buffer on the device, and q, k, v as dense copies for the reference.
struct Qkv {
    int64_t T, ld, qd, kd;
    std::vector<double> fused, q, k, v;
    Qkv(const Case& c, std::mt19937_64& rng) {
        T = c.B * c.S;
        qd = (int64_t)c.Hq * c.d;
        kd = (int64_t)c.Hkv * c.d;
        ld = qd + 2 * kd;
        fused = rounded_bf16(random_normal(T * ld, rng));
        q = columns(fused, T, ld, 0, qd);
        k = columns(fused, T, ld, qd, kd);
        v = columns(fused, T, ld, qd + kd, kd);
    }
};

class AttentionCases : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionCases, ForwardAndBackwardMatchReference) {
    REQUIRE_GPU();
    const Case c = GetParam();
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(name(c) + " seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    Qkv in(c, rng);
    const int64_t T = in.T;
    auto dout = rounded_bf16(random_normal(T * in.qd, rng));

    const CaseDocuments docs = c.docs ? case_documents(c, rng) : CaseDocuments{};
    const int64_t* first_key = c.docs ? docs.first_key.data() : nullptr;
    std::vector<double> out_ref(T * in.qd), lse_ref((int64_t)c.B * c.Hq * c.S);
    ref::attention_forward(in.q.data(), in.k.data(), in.v.data(), out_ref.data(), lse_ref.data(), c.B, c.S, c.Hq,
                           c.Hkv, c.d, first_key);
    std::vector<double> dq_ref(T * in.qd), dk_ref(T * in.kd), dv_ref(T * in.kd);
    ref::attention_backward(in.q.data(), in.k.data(), in.v.data(), dout.data(), dq_ref.data(), dk_ref.data(),
                            dv_ref.data(), c.B, c.S, c.Hq, c.Hkv, c.d, first_key);
    DeviceBuffer<int64_t> doc_starts(docs.starts.size());
    if (c.docs)
        CUDA_CHECK(cudaMemcpy(doc_starts.ptr, docs.starts.data(), docs.starts.size() * 8, cudaMemcpyHostToDevice));
    const AttentionDocs call_docs = c.docs ? AttentionDocs{doc_starts.ptr, (int64_t)docs.starts.size()} : AttentionDocs{};

    DeviceBuffer<bf16> qkv(T * in.ld), out(T * in.qd), d_dout(T * in.qd), dqkv(T * in.ld);
    DeviceBuffer<float> lse((int64_t)c.B * c.Hq * c.S), delta((int64_t)c.B * c.Hq * c.S);
    upload(qkv, in.fused), upload(d_dout, dout);
    poison(out.ptr, T * in.qd), poison(lse.ptr, lse.n), poison(dqkv.ptr, T * in.ld);
    AttentionShape sh{c.B, c.S, c.Hq, c.Hkv, c.d};
    KernelChoice choice(c.reference, sh);
    const AttentionForwardArgs fa{.q = qkv, .k = qkv + in.qd, .v = qkv + in.qd + in.kd, .ldq = in.ld, .ldk = in.ld,
                                  .ldv = in.ld, .out = out, .ldo = in.qd, .lse = lse, .docs = call_docs};
    attention_forward(fa, sh, 0);
    AttentionBackwardArgs ba{.q = qkv, .k = qkv + in.qd, .v = qkv + in.qd + in.kd, .out = out, .dout = d_dout,
                             .ldq = in.ld, .ldk = in.ld, .ldv = in.ld, .ldo = in.qd, .lddo = in.qd, .lse = lse,
                             .dq = dqkv, .dk = dqkv + in.qd, .dv = dqkv + in.qd + in.kd, .lddq = in.ld,
                             .lddk = in.ld, .lddv = in.ld, .delta = delta, .docs = call_docs};
    DeviceBuffer<float> dq_accum(c.fused ? attention_dq_accum_floats(sh) : 0);
    if (c.fused) ba.dq_accum = dq_accum, poison(dq_accum.ptr, dq_accum.n);  // the kernel must clear it
    run_backward(ba, sh, c.order);

    EXPECT_LT(rel_error(download(out.ptr, T * in.qd), out_ref), TOL_BF16);
    EXPECT_LT(rel_error(download(lse.ptr, lse.n), lse_ref), TOL_FP32);
    auto dqkv_h = download(dqkv.ptr, T * in.ld);
    // With S = 1 the softmax is constant: dq and dk are exactly zero in float64, and the device's
    // must be zero up to bf16 rounding of the inputs (values of size 1).
    EXPECT_LT(rel_error_or_abs(columns(dqkv_h, T, in.ld, 0, in.qd), dq_ref, 1.0), TOL_BF16);
    EXPECT_LT(rel_error_or_abs(columns(dqkv_h, T, in.ld, in.qd, in.kd), dk_ref, 1.0), TOL_BF16);
    EXPECT_LT(rel_error(columns(dqkv_h, T, in.ld, in.qd + in.kd, in.kd), dv_ref), TOL_BF16);

    // accumulate_dkv (Untied Ulysses sums a KV group's head chunks in place): a second backward,
    // with d out halved, adds its dk, dv (half the first's) to the first's: 1.5x in all; dq is
    // written, not added: 0.5x.
    ba.accumulate_dkv = true;
    std::vector<double> half_dout(dout);
    for (double& x : half_dout) x *= 0.5;  // exact in bf16
    upload(d_dout, half_dout);
    run_backward(ba, sh, c.order);
    auto sum = download(dqkv.ptr, T * in.ld);
    std::vector<double> dq_half(dq_ref), dk_sum(dk_ref), dv_sum(dv_ref);
    for (double& x : dq_half) x *= 0.5;
    for (double& x : dk_sum) x *= 1.5;
    for (double& x : dv_sum) x *= 1.5;
    EXPECT_LT(rel_error_or_abs(columns(sum, T, in.ld, 0, in.qd), dq_half, 1.0), TOL_BF16);
    EXPECT_LT(rel_error_or_abs(columns(sum, T, in.ld, in.qd, in.kd), dk_sum, 1.0), TOL_BF16);
    EXPECT_LT(rel_error(columns(sum, T, in.ld, in.qd + in.kd, in.kd), dv_sum), TOL_BF16);
}

// Every shape with the reference kernels; those of head dim 128 also with the fast ones, with
// and without the fused backward.
std::vector<Case> both_kernels(std::vector<Case> shapes) {
    std::vector<Case> all;
    for (Case c : shapes) {
        c.reference = true, all.push_back(c);
        if (c.d != 128) continue;
        // The fast kernels, both backwards, each in both block orders.
        c.reference = false;
        for (bool fused : {false, true})
            for (Case::Order order : {Case::tile_major, Case::kv_major}) c.fused = fused, c.order = order, all.push_back(c);
    }
    return all;
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionCases,
                         ::testing::ValuesIn(both_kernels({
                             Case{1, 1, 2, 1, 64},        // a single token
                             Case{1, 1, 2, 1, 128},
                             Case{1, 64, 2, 2, 128},      // exactly one (half) tile, no GQA
                             Case{2, 130, 4, 2, 64},      // two sequences, ragged tail
                             Case{1, 200, 6, 2, 128},     // GQA group of 3
                             Case{1, 333, 8, 1, 64},      // all heads share one KV head
                             Case{3, 97, 3, 3, 128},      // odd everything
                             Case{2, 700, 4, 1, 128},     // many tiles, two sequences, group of 4
                             Case{1, 1000, 8, 2, 128},    // many tiles, ragged tail
                             // Packed documents, starts drawn fresh each run (case_documents).
                             with_documents(Case{1, 1, 2, 1, 128}),
                             with_documents(Case{2, 200, 4, 2, 64}),
                             with_documents(Case{1, 300, 6, 2, 128}),
                             with_documents(Case{3, 129, 2, 1, 128}),
                             with_documents(Case{1, 1000, 8, 2, 128}),
                         })));

// One sequence whose q, k, v are the first columns of a fused [S][ld] buffer: the forward, and
// the backward's arguments (the fused backward's workspace left to the caller).
AttentionBackwardArgs forward_one_sequence(const AttentionShape& sh, int64_t ld, bf16* qkv, bf16* out, bf16* dout,
                                           bf16* dqkv, float* lse, float* delta, AttentionDocs docs = {}) {
    const int64_t qd = (int64_t)sh.n_heads * sh.head_dim, kd = (int64_t)sh.n_kv_heads * sh.head_dim;
    const AttentionForwardArgs fa{.q = qkv, .k = qkv + qd, .v = qkv + qd + kd, .ldq = ld, .ldk = ld, .ldv = ld,
                                  .out = out, .ldo = qd, .lse = lse, .docs = docs};
    attention_forward(fa, sh, 0);
    return {.q = qkv, .k = qkv + qd, .v = qkv + qd + kd, .out = out, .dout = dout, .ldq = ld, .ldk = ld, .ldv = ld,
            .ldo = qd, .lddo = qd, .lse = lse, .dq = dqkv, .dk = dqkv + qd, .dv = dqkv + qd + kd, .lddq = ld,
            .lddk = ld, .lddv = ld, .delta = delta, .docs = docs};
}

// Every backward is bit-reproducible: the same inputs give the same bits, run after run. The fused
// backward's dQ is summed in fp32 by the TMA unit from many blocks, and fp32 addition is not
// associative, so only its fixed order of adds (by key tile) makes two runs agree to the last
// bit. The cases run many blocks over several waves (3B heads at 16K tokens: 1032 dK/dV blocks,
// about eight waves), where adds in any order would arrive in a different order from run to run.
// At 8K + 37 tokens (65 tiles) the blocks go tile by tile across the heads, at 16K + 37 (129
// tiles) KV head by KV head: both orders over several waves.
// Inputs drawn on the device.
// With documents (of 1 to 4,096 tokens, drawn from the seed), a query tile's adds start at the
// key tile of its first document start, not at 0.
using RepeatCase = std::tuple<bool, int64_t, bool>;  // fused, tokens, documents
class AttentionRepeat : public ::testing::TestWithParam<RepeatCase> {};

TEST_P(AttentionRepeat, BackwardGivesTheSameBitsTwice) {
    REQUIRE_GPU();
    const bool fused = std::get<0>(GetParam()), with_docs = std::get<2>(GetParam());
    const int64_t S = std::get<1>(GetParam());
    if (fused && !hopper_gpu()) GTEST_SKIP() << "the fused backward needs the fast kernels (sm_90)";
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(std::string(fused ? "fused" : "fast") + " S " + std::to_string(S) + (with_docs ? " documents" : "") +
                 " seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    std::vector<int64_t> starts = {0};
    while (with_docs && starts.back() + 4096 < S) starts.push_back(starts.back() + 1 + (int64_t)(rng() % 4096));
    DeviceBuffer<int64_t> doc_starts(starts.size());
    CUDA_CHECK(cudaMemcpy(doc_starts.ptr, starts.data(), starts.size() * 8, cudaMemcpyHostToDevice));
    const int Hq = 24, Hkv = 8, d = 128;
    const int64_t qd = Hq * d, kd = Hkv * d, ld = qd + 2 * kd;
    DeviceBuffer<bf16> qkv(S * ld), out(S * qd), dout(S * qd), dqkv(S * ld);
    DeviceBuffer<float> lse(Hq * S), delta(Hq * S), scratch(S * ld);
    init_normal(scratch, S * ld, 1.0f, seed, 0);
    convert_f32_to_bf16(qkv, scratch, S * ld, 0);
    init_normal(scratch, S * qd, 1.0f, seed + 1, 0);
    convert_f32_to_bf16(dout, scratch, S * qd, 0);
    AttentionShape sh{1, S, Hq, Hkv, d};
    KernelChoice choice(false, sh);
    const AttentionDocs docs = with_docs ? AttentionDocs{doc_starts.ptr, (int64_t)starts.size()} : AttentionDocs{};
    AttentionBackwardArgs ba = forward_one_sequence(sh, ld, qkv, out, dout, dqkv, lse, delta, docs);
    DeviceBuffer<float> dq_accum(fused ? attention_dq_accum_floats(sh) : 0);
    if (fused) ba.dq_accum = dq_accum;
    std::vector<std::vector<bf16>> runs;
    for (int r = 0; r < 3; r++) {
        poison(dqkv.ptr, dqkv.n);
        attention_backward(ba, sh, 0);
        runs.emplace_back(S * ld);
        CUDA_CHECK(cudaMemcpy(runs.back().data(), dqkv.ptr, S * ld * 2, cudaMemcpyDeviceToHost));
    }
    for (int r = 1; r < 3; r++) {
        int64_t differ = 0;
        for (int64_t i = 0; i < S * ld; i++) differ += memcmp(&runs[r][i], &runs[0][i], 2) != 0;
        EXPECT_EQ(differ, 0) << "run " << r << " differs from run 0 in " << differ << " of " << S * ld << " gradients";
    }
}

INSTANTIATE_TEST_SUITE_P(Kernels, AttentionRepeat,
                         ::testing::Combine(::testing::Values(false, true), ::testing::Values((int64_t)8192 + 37, (int64_t)16384 + 37),
                                            ::testing::Values(false, true)),
                         [](const ::testing::TestParamInfo<RepeatCase>& i) {
                             return std::string(std::get<0>(i.param) ? "fused_" : "fast_") +
                                    std::to_string(std::get<1>(i.param)) + (std::get<2>(i.param) ? "_documents" : "");
                         });

// The fused backward's ordered dQ adds wait on counts, relying on blocks starting in grid order
// (see kernels/attention_hopper.cu). If that ever breaks, the launch must fail with an error, not hang:
// with the counts started at a value the order never reaches, every wait times out (20 s) and
// traps. In a child process (a death test), since a trap ends the CUDA context.
void run_fused_backward_with_broken_order() {
    const auto start = std::chrono::steady_clock::now();
    const int64_t S = 1024;
    const int Hq = 3, Hkv = 1, d = 128;
    const int64_t qd = Hq * d, kd = Hkv * d, ld = qd + 2 * kd;
    DeviceBuffer<bf16> qkv(S * ld), out(S * qd), dout(S * qd), dqkv(S * ld);
    DeviceBuffer<float> lse(Hq * S), delta(Hq * S), scratch(S * ld);
    init_normal(scratch, S * ld, 1.0f, 1, 0);
    convert_f32_to_bf16(qkv, scratch, S * ld, 0);
    convert_f32_to_bf16(dout, scratch, S * qd, 0);
    AttentionShape sh{1, S, Hq, Hkv, d};
    AttentionBackwardArgs ba = forward_one_sequence(sh, ld, qkv, out, dout, dqkv, lse, delta);
    DeviceBuffer<float> dq_accum(attention_dq_accum_floats(sh));
    ba.dq_accum = dq_accum;
    attention_delta(ba, sh, 0);  // what the dispatch does first
    ba.out = nullptr;
    HopperBackwardOptions broken;
    broken.unreachable_dq_counts = true;
    cudaError_t e = cudaSuccess;
    try {
        attention_backward_hopper(ba, sh, 0, broken);
        e = cudaDeviceSynchronize();
    } catch (const Fatal& f) {
        fprintf(stderr, "%s\n", f.what());
        _exit(f.code);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    fprintf(stderr, "broken order: %s after %.0f s\n", e == cudaSuccess ? "finished" : cudaGetErrorString(e), seconds);
    _exit(e == cudaSuccess ? 0 : 1);
}

TEST(AttentionFusedOrder, ABrokenOrderFailsTheLaunchInsteadOfHanging) {
    REQUIRE_GPU();
    if (!hopper_gpu()) GTEST_SKIP() << "the fused backward needs the fast kernels (sm_90)";
    GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process, not a fork of one using CUDA
    // Exit code 1 and a CUDA error after the 20 s limit (not before: e.g. not a failure to start).
    EXPECT_EXIT(run_fused_backward_with_broken_order(), ::testing::ExitedWithCode(1),
                "broken order: [a-z].* after 2[0-9] s");
}

// Head counts that do not form GQA groups are refused (exit code 2) by both kernel sets, not
// run with a wrong group size.
TEST(AttentionShapes, BadHeadCountsAreUsageErrors) {
    REQUIRE_GPU();
    DeviceBuffer<bf16> qkv(64 * 3072), out(64 * 1024);
    DeviceBuffer<float> lse(64 * 8);
    for (bool reference : {true, false}) {
        attention_use_reference(reference);
        for (AttentionShape sh : {AttentionShape{1, 64, 6, 4, 128}, AttentionShape{1, 64, 2, 0, 128},
                                  AttentionShape{1, 64, 2, 4, 128}}) {
            const AttentionForwardArgs fa{.q = qkv, .k = qkv + 1024, .v = qkv + 2048, .ldq = 3072, .ldk = 3072,
                                          .ldv = 3072, .out = out, .ldo = 1024, .lse = lse};
            int code = -1;
            try {
                attention_forward(fa, sh, 0);
            } catch (const Fatal& f) {
                code = f.code;
            }
            EXPECT_EQ(code, EXIT_USAGE) << "Hq " << sh.n_heads << " Hkv " << sh.n_kv_heads;
        }
    }
    attention_use_reference(false);
}

// ---------------------------------------------------------------------------------------------
// A long sequence: 2^18 + 77 tokens in a fused buffer with a row stride of 9216 elements, so row
// offsets pass 2^31 elements (a 32-bit index would wrap). Checked in float64 on sampled query
// rows (output, lse, dq) and sampled keys (dk, dv), using the device's lse and delta = rowsum(dO*O)
// for the other rows (lse is itself checked on the sampled rows). TEST_ATTENTION_LONG_TOKENS=N
// runs it at N tokens instead (e.g. 1048653: 1M and a ragged tail; about 40 GB of GPU memory).
int64_t long_tokens() {
    const char* env = getenv("TEST_ATTENTION_LONG_TOKENS");
    if (!env) return (1 << 18) + 77;
    const int64_t n = atoll(env);
    if (n < (1 << 18) || n >= ((int64_t)1 << 31)) {
        ADD_FAILURE() << "TEST_ATTENTION_LONG_TOKENS must be in [2^18, 2^31), got '" << env << "'";
        return (1 << 18) + 77;
    }
    return n;
}

enum class Kernels { reference, fast, fused };
class AttentionLong : public ::testing::TestWithParam<Kernels> {};

// The long problem: its inputs on the host (the used columns only, densely, as float: the values
// are exact bf16), the device's outputs copied back, and float64 sums of its attention.
struct LongProblem {
    int64_t S;
    int Hq = 2, Hkv = 1, d = 128;
    int64_t qd = Hq * d, kd = Hkv * d, w = qd + 2 * kd;  // q | k | v columns used
    std::vector<float> in, dout, lse;                    // [S, w], [S, qd], [Hq, S]
    std::vector<float> out, grad;                        // the device's output [S, qd] and d q|k|v [S, w]
    const float* Q(int64_t t, int h) const { return &in[t * w + h * d]; }
    const float* K(int64_t t) const { return &in[t * w + qd]; }
    const float* V(int64_t t) const { return &in[t * w + qd + kd]; }
    const float* dO(int64_t t, int h) const { return &dout[t * qd + h * d]; }
    double dot(const float* a, const float* b) const {
        double s = 0;
        for (int c = 0; c < d; c++) s += (double)a[c] * b[c];
        return s;
    }
    double scale() const { return 1.0 / std::sqrt((double)d); }
};

// Fresh inputs through the kernels under test, in buffers with a row stride of `ld` elements.
LongProblem run_long(int64_t S, int64_t ld, bool reference, bool fused, std::mt19937_64& rng) {
    LongProblem p;
    p.S = S;
    const int64_t w = p.w, qd = p.qd;
    std::uniform_real_distribution<float> ud(-1.7f, 1.7f);
    std::vector<bf16> h_in(S * w), h_dout(S * qd);
    for (auto& x : h_in) x = __float2bfloat16(ud(rng));
    for (auto& x : h_dout) x = __float2bfloat16(ud(rng));
    DeviceBuffer<bf16> qkv(S * ld), out(S * qd), dout(S * qd), dqkv(S * ld);
    DeviceBuffer<float> lse(p.Hq * S), delta(p.Hq * S);
    CUDA_CHECK(cudaMemcpy2D(qkv.ptr, ld * 2, h_in.data(), w * 2, w * 2, S, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dout.ptr, h_dout.data(), S * qd * 2, cudaMemcpyHostToDevice));
    poison(out.ptr, out.n), poison(lse.ptr, lse.n), poison(dqkv.ptr, dqkv.n);
    AttentionShape sh{1, S, p.Hq, p.Hkv, p.d};
    KernelChoice choice(reference, sh);
    AttentionBackwardArgs ba = forward_one_sequence(sh, ld, qkv, out, dout, dqkv, lse, delta);
    DeviceBuffer<float> dq_accum(fused ? attention_dq_accum_floats(sh) : 0);
    if (fused) ba.dq_accum = dq_accum;
    attention_backward(ba, sh, 0);
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<bf16> h_out(S * qd), h_grad(S * w);
    p.lse.resize(p.Hq * S);
    CUDA_CHECK(cudaMemcpy(h_out.data(), out.ptr, S * qd * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy2D(h_grad.data(), w * 2, dqkv.ptr, ld * 2, w * 2, S, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(p.lse.data(), lse.ptr, p.Hq * S * 4, cudaMemcpyDeviceToHost));
    auto floats = [](const std::vector<bf16>& x) {
        std::vector<float> f(x.size());
        for (size_t i = 0; i < x.size(); i++) f[i] = __bfloat162float(x[i]);
        return f;
    };
    p.in = floats(h_in), p.dout = floats(h_dout), p.out = floats(h_out), p.grad = floats(h_grad);
    return p;
}

// Output, lse and dq of the sampled query rows, against float64 over every key before them.
void check_sampled_rows(const LongProblem& p, const std::vector<int64_t>& rows) {
    const int d = p.d;
    std::vector<double> got, want, got_lse, want_lse, got_dq, want_dq;
    for (int64_t i : rows)
        for (int h = 0; h < p.Hq; h++) {
            std::vector<double> s(i + 1);
            double m = -INFINITY, l = 0;
            for (int64_t j = 0; j <= i; j++) m = std::max(m, s[j] = p.scale() * p.dot(p.Q(i, h), p.K(j)));
            for (int64_t j = 0; j <= i; j++) l += std::exp(s[j] - m);
            const double lse_i = m + std::log(l);
            std::vector<double> o(d, 0.0), dq(d, 0.0);
            for (int64_t j = 0; j <= i; j++) {
                double pj = std::exp(s[j] - lse_i);
                for (int c = 0; c < d; c++) o[c] += pj * p.V(j)[c];
            }
            double delta_i = 0;
            for (int c = 0; c < d; c++) delta_i += o[c] * p.dO(i, h)[c];
            for (int64_t j = 0; j <= i; j++) {
                double ds = std::exp(s[j] - lse_i) * (p.dot(p.dO(i, h), p.V(j)) - delta_i);
                for (int c = 0; c < d; c++) dq[c] += p.scale() * ds * p.K(j)[c];
            }
            got_lse.push_back(p.lse[h * p.S + i]);
            want_lse.push_back(lse_i);
            for (int c = 0; c < d; c++) {
                got.push_back(p.out[i * p.qd + h * d + c]), want.push_back(o[c]);
                got_dq.push_back(p.grad[i * p.w + h * d + c]), want_dq.push_back(dq[c]);
            }
        }
    EXPECT_LT(rel_error(got, want), TOL_BF16);
    EXPECT_LT(rel_error(got_lse, want_lse), TOL_FP32);
    EXPECT_LT(rel_error(got_dq, want_dq), TOL_BF16);
}

// dK, dV of the sampled keys: sums over every later query of both heads of the GQA group, with
// the device's lse and delta = rowsum(dO * O) of the device's O (lse is checked on its own above).
void check_sampled_keys(const LongProblem& p, const std::vector<int64_t>& keys) {
    const int d = p.d;
    const int64_t S = p.S;
    std::vector<double> delta_h(p.Hq * S);
    for (int h = 0; h < p.Hq; h++)
        for (int64_t i = 0; i < S; i++) {
            double s = 0;
            for (int c = 0; c < d; c++) s += p.dO(i, h)[c] * p.out[i * p.qd + h * d + c];
            delta_h[h * S + i] = s;
        }
    std::vector<double> got_dk, want_dk, got_dv, want_dv;
    for (int64_t j : keys) {
        std::vector<double> dk(d, 0.0), dv(d, 0.0);
        for (int h = 0; h < p.Hq; h++)
            for (int64_t i = j; i < S; i++) {
                double pij = std::exp(p.scale() * p.dot(p.Q(i, h), p.K(j)) - (double)p.lse[h * S + i]);
                double ds = pij * (p.dot(p.dO(i, h), p.V(j)) - delta_h[h * S + i]);
                for (int c = 0; c < d; c++) {
                    dv[c] += pij * p.dO(i, h)[c];
                    dk[c] += p.scale() * ds * p.Q(i, h)[c];
                }
            }
        for (int c = 0; c < d; c++) {
            got_dk.push_back(p.grad[j * p.w + p.qd + c]), want_dk.push_back(dk[c]);
            got_dv.push_back(p.grad[j * p.w + p.qd + p.kd + c]), want_dv.push_back(dv[c]);
        }
    }
    EXPECT_LT(rel_error(got_dk, want_dk), TOL_BF16);
    EXPECT_LT(rel_error(got_dv, want_dv), TOL_BF16);
}

TEST_P(AttentionLong, SampledRowsAndKeysMatchFloat64) {
    REQUIRE_GPU();
    const bool reference = GetParam() == Kernels::reference, fused = GetParam() == Kernels::fused;
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(std::string(reference ? "reference" : fused ? "fused" : "fast") + " seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    const int64_t S = long_tokens(), ld = 9216;
    ASSERT_GT(S * ld, (int64_t)1 << 31);
    const LongProblem p = run_long(S, ld, reference, fused, rng);
    std::vector<int64_t> rows = {0, 1, 63, 64, 4097, S - 1};
    for (int k = 0; k < 2; k++) rows.push_back((int64_t)(rng() % S));
    check_sampled_rows(p, rows);
    check_sampled_keys(p, {0, S / 3, S - 100, S - 1});
}

INSTANTIATE_TEST_SUITE_P(Kernels, AttentionLong, ::testing::Values(Kernels::reference, Kernels::fast, Kernels::fused),
                         [](const ::testing::TestParamInfo<Kernels>& i) {
                             return i.param == Kernels::reference ? "reference" : i.param == Kernels::fast ? "fast" : "fused";
                         });

}  // namespace
