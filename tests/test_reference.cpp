// tests/test_reference.cpp - checks of the float64 CPU reference (tests/reference.h), the oracle
// of every GPU test. Two kinds of checks:
//   * every backward against central finite differences (the whole model: every parameter
//     element of a small config, tied and untied);
//   * values fixed independently of the implementation (hand-computed numbers, a direct softmax,
//     a token-by-token decoder written HF-style in this file), because a gradient check passes for
//     any self-consistent model, including one that slices q/k/v or gate/up wrongly.
// Inputs are fresh random numbers every run; the seed is printed with each failure and
// REF_TEST_SEED=<seed> replays it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "../infra/common.h"
#include "../kernels/documents.cuh"
#include "reference.h"
#include "test_util.h"

namespace {

const double kPi = 3.14159265358979323846;
const double kStep = 1e-5;   // finite-difference step: at 1e-6 rounding error dominates
const double kFdTol = 1e-7;  // ||analytic - numeric|| / ||numeric||; observed <= 2e-9

uint64_t test_seed() {
    if (const char* s = std::getenv("REF_TEST_SEED")) return std::strtoull(s, nullptr, 10);
    return fresh_seed();
}

// Declares `rng`, seeded freshly, and attaches the seed to every failure of the current scope.
#define SEEDED_RNG(rng)                                                 \
    const uint64_t rng##_seed = test_seed();                            \
    SCOPED_TRACE(::testing::Message() << "REF_TEST_SEED=" << rng##_seed); \
    std::mt19937_64 rng(rng##_seed)

double dot(const std::vector<double>& a, const std::vector<double>& b) {
    double s = 0;
    for (size_t i = 0; i < a.size(); i++) s += a[i] * b[i];
    return s;
}

// Central differences of f() with respect to x[0..n-1]; x is restored. The actual distance
// between the two perturbed values is used, not 2h, since x +- h is rounded.
std::vector<double> numeric_grad(const std::function<double()>& f, double* x, int64_t n,
                                 double h = kStep) {
    std::vector<double> g(n);
    for (int64_t i = 0; i < n; i++) {
        const double x0 = x[i];
        const double xp = x0 + h, xm = x0 - h;
        x[i] = xp;
        const double fp = f();
        x[i] = xm;
        const double fm = f();
        x[i] = x0;
        g[i] = (fp - fm) / (xp - xm);
    }
    return g;
}

std::vector<double> numeric_grad(const std::function<double()>& f, std::vector<double>& x) {
    return numeric_grad(f, x.data(), (int64_t)x.size());
}

std::vector<int32_t> random_ints(int64_t n, int32_t hi, std::mt19937_64& rng) {
    std::uniform_int_distribution<int32_t> dist(0, hi - 1);
    std::vector<int32_t> v(n);
    for (auto& x : v) x = dist(rng);
    return v;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

TEST(RefRmsNorm, ForwardHandValues) {
    // Token 0: x = (3, 4), mean(x^2) = 12.5, eps = 0.  Token 1: x = (1, 0), mean = 0.5.
    const std::vector<double> x = {3, 4, 1, 0}, w = {1, 2};
    std::vector<double> y(4), rstd(2);
    ref::rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), 2, 2, 0.0);
    EXPECT_NEAR(rstd[0], 1 / std::sqrt(12.5), 1e-15);
    EXPECT_NEAR(y[0], 3 / std::sqrt(12.5), 1e-15);
    EXPECT_NEAR(y[1], 8 / std::sqrt(12.5), 1e-15);
    EXPECT_NEAR(y[2], 1 / std::sqrt(0.5), 1e-15);
    EXPECT_EQ(y[3], 0.0);
    // eps is added to the mean square, inside the square root.
    ref::rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), 2, 2, 1.0);
    EXPECT_NEAR(rstd[0], 1 / std::sqrt(13.5), 1e-15);
    EXPECT_NEAR(rstd[1], 1 / std::sqrt(1.5), 1e-15);
}

TEST(RefRmsNorm, GradientsMatchFiniteDifferences) {
    SEEDED_RNG(rng);
    const int64_t T = 5;
    const int D = 13;
    const double eps = 1e-5;
    auto x = random_normal(T * D, rng), w = random_normal(D, rng), dy = random_normal(T * D, rng);
    std::vector<double> y(T * D), rstd(T);
    auto loss = [&] {  // the scalar whose gradient backward computes: <y, dy>
        ref::rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), T, D, eps);
        return dot(y, dy);
    };
    loss();
    std::vector<double> dx(T * D, NAN);          // must be overwritten
    const auto dw_before = random_normal(D, rng);  // must be accumulated into
    auto dw = dw_before;
    ref::rmsnorm_backward(dy.data(), x.data(), w.data(), rstd.data(), dx.data(), dw.data(), T, D);
    for (int i = 0; i < D; i++) dw[i] -= dw_before[i];
    EXPECT_LT(rel_error(dx, numeric_grad(loss, x)), kFdTol);
    EXPECT_LT(rel_error(dw, numeric_grad(loss, w)), kFdTol);
}

// ---------------------------------------------------------------------------------------------
// RoPE

// A model small enough for a finite-difference check of every parameter. head_dim 8 gives four
// frequencies; original_max_pos 512 puts them in all three llama3 regimes (see the test below).
// qwen3: the Qwen3 family (per-head norms of q and k), with its eps and RoPE theta.
LlamaConfig fd_config(bool tied, bool qwen3 = false) {
    LlamaConfig c;
    c.name = std::string(qwen3 ? "fd-qwen3-" : "fd-") + (tied ? "tied" : "untied");
    if (qwen3) c.family = Family::QWEN3, c.norm_eps = 1e-6, c.rope_theta = 1e6;
    c.dim = 16;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = 8;
    c.ffn_dim = 24;
    c.vocab = 32;
    c.rope_scaling = {true, 8.0, 1.0, 4.0, 512};
    c.tied_embeddings = tied;
    return c;
}

TEST(RefRope, InvFreqLlama32HandValues) {
    const LlamaConfig c = config_by_name("llama3.2-3b");  // theta 500000, d 128, factor 32, 8192
    const auto inv = ref::rope_inv_freq(c);
    ASSERT_EQ(inv.size(), 64u);
    // i = 0: wavelength 2 pi < 8192/4, high frequency, unchanged.
    EXPECT_EQ(inv[0], 1.0);
    // i = 20: wavelength 2 pi 500000^(40/128) ~ 378 < 2048, unchanged.
    EXPECT_NEAR(inv[20] / std::pow(500000.0, -40.0 / 128), 1.0, 1e-14);
    // i = 63: wavelength ~ 2.6e6 > 8192, low frequency, divided by the factor 32.
    EXPECT_NEAR(inv[63] / (std::pow(500000.0, -126.0 / 128) / 32), 1.0, 1e-14);
    // i = 31: wavelength ~ 3620, between 2048 and 8192: blended.
    const double base = std::pow(500000.0, -62.0 / 128), wavelen = 2 * kPi / base;
    ASSERT_GT(wavelen, 2048.0);
    ASSERT_LT(wavelen, 8192.0);
    const double smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0);
    EXPECT_NEAR(inv[31] / ((1 - smooth) * base / 32 + smooth * base), 1.0, 1e-14);
    // Llama 3.1 8B divides its low frequencies by 8, not 32.
    const auto inv8b = ref::rope_inv_freq(config_by_name("llama3.1-8b"));
    EXPECT_NEAR(inv8b[63] / (std::pow(500000.0, -126.0 / 128) / 8), 1.0, 1e-14);
}

TEST(RefRope, InvFreqUnscaledWhenDisabled) {
    LlamaConfig c = config_by_name("llama3.2-3b");
    c.rope_scaling.enabled = false;
    c.rope_theta = 10000.0;
    const auto inv = ref::rope_inv_freq(c);
    for (int i = 0; i < 64; i++) EXPECT_NEAR(inv[i] / std::pow(10000.0, -2.0 * i / 128), 1, 1e-14);
}

// Two independent implementations (this reference and the GPU side's infra/common.h) must agree.
TEST(RefRope, InvFreqAgreesWithCommonH) {
    auto configs = known_configs();
    configs.push_back(fd_config(true));
    LlamaConfig unscaled = configs[0];
    unscaled.rope_scaling.enabled = false;
    configs.push_back(unscaled);
    for (const auto& c : configs) {
        SCOPED_TRACE(c.name);
        const auto a = ref::rope_inv_freq(c), b = ::rope_inv_freq(c);
        ASSERT_EQ(a.size(), b.size());
        for (size_t i = 0; i < a.size(); i++) EXPECT_NEAR(a[i] / b[i], 1.0, 1e-12) << "i=" << i;
    }
}

TEST(RefRope, FdConfigCoversAllRopeRegimes) {
    const LlamaConfig c = fd_config(true);
    const auto inv = ref::rope_inv_freq(c);
    int unchanged = 0, scaled = 0, blended = 0;
    for (int i = 0; i < c.head_dim / 2; i++) {
        const double base = std::pow(c.rope_theta, -2.0 * i / c.head_dim);
        if (std::fabs(inv[i] - base) < 1e-15 * base) unchanged++;
        else if (std::fabs(inv[i] - base / 8) < 1e-15 * base) scaled++;
        else if (inv[i] > base / 8 && inv[i] < base) blended++;
    }
    EXPECT_GE(unchanged, 1);
    EXPECT_GE(scaled, 1);
    EXPECT_GE(blended, 1);
    EXPECT_EQ(unchanged + scaled + blended, c.head_dim / 2);
}

// Rotate-half layout: x[i] pairs with x[i + head_dim/2] (not the interleaved x[2i], x[2i+1]).
TEST(RefRope, RotatesPairsHalfApart) {
    const std::vector<double> inv = {1.0, 0.5};  // head_dim 4
    std::vector<double> x = {1, 2, 3, 4,   // position 0: unchanged
                             0, 1, 0, 0,   // position 1: pair 1 by angle 0.5
                             1, 0, 0, 1};  // position 2: pair 0 by angle 2, pair 1 by angle 1
    ref::rope_apply(x.data(), 3, 3, 1, 4, 4, inv, false);
    const double c05 = std::cos(0.5), s05 = std::sin(0.5);
    const double c1 = std::cos(1.0), s1 = std::sin(1.0), c2 = std::cos(2.0), s2 = std::sin(2.0);
    const std::vector<double> expect = {1,  2,   3,  4,     // x1 = x[i], x2 = x[i + 2]:
                                        0,  c05, 0,  s05,   // (x1 c - x2 s, x2 c + x1 s)
                                        c2, -s1, s2, c1};
    for (size_t i = 0; i < x.size(); i++) EXPECT_NEAR(x[i], expect[i], 1e-15) << "i=" << i;
}

TEST(RefRope, InverseIsAdjointAndPreservesNorms) {
    SEEDED_RNG(rng);
    const auto inv = ref::rope_inv_freq(fd_config(true));
    const int64_t T = 10, S = 5, stride = 3 * 8 + 5;  // 3 heads of 8, then 5 columns left alone
    const auto x = random_normal(T * stride, rng), y = random_normal(T * stride, rng);
    auto rx = x, ry_inv = y;
    ref::rope_apply(rx.data(), T, S, 3, 8, stride, inv, false);
    ref::rope_apply(ry_inv.data(), T, S, 3, 8, stride, inv, true);
    // <R x, y> = <x, R^-1 y>: the inverse rotation is the adjoint, so it is the backward.
    EXPECT_NEAR(dot(rx, y), dot(x, ry_inv), 1e-12 * std::sqrt(dot(x, x) * dot(y, y)));
    for (int64_t t = 0; t < T; t++) {
        for (int h = 0; h < 3; h++) {  // a rotation keeps each head's norm
            double n0 = 0, n1 = 0;
            for (int i = 0; i < 8; i++) {
                n0 += x[t * stride + h * 8 + i] * x[t * stride + h * 8 + i];
                n1 += rx[t * stride + h * 8 + i] * rx[t * stride + h * 8 + i];
            }
            EXPECT_NEAR(n1, n0, 1e-12 * n0);
        }
        for (int64_t i = 24; i < stride; i++) EXPECT_EQ(rx[t * stride + i], x[t * stride + i]);
    }
    auto back = rx;  // R^-1 R = identity
    ref::rope_apply(back.data(), T, S, 3, 8, stride, inv, true);
    EXPECT_LT(rel_error(back, x), 1e-14);
    // Position is t % S: token t and token t + S rotate identical inputs identically.
    auto twice = std::vector<double>(2 * S * stride);
    for (int64_t n = 0; n < S * stride; n++) twice[n] = twice[n + S * stride] = x[n];
    ref::rope_apply(twice.data(), 2 * S, S, 3, 8, stride, inv, false);
    for (int64_t n = 0; n < S * stride; n++) EXPECT_EQ(twice[n], twice[n + S * stride]);
}

// ---------------------------------------------------------------------------------------------
// Attention

struct AttnCase {
    int B;
    int64_t S;
    int Hq, Hkv, d;
    std::vector<double> q, k, v;
    int64_t T() const { return B * S; }
    AttnCase(int B_, int64_t S_, int Hq_, int Hkv_, int d_, std::mt19937_64& rng)
        : B(B_), S(S_), Hq(Hq_), Hkv(Hkv_), d(d_) {
        q = random_normal(T() * Hq * d, rng);
        k = random_normal(T() * Hkv * d, rng);
        v = random_normal(T() * Hkv * d, rng);
    }
    std::vector<double> forward(std::vector<double>* lse = nullptr) const {
        std::vector<double> out(T() * Hq * d);
        if (lse) lse->assign(B * Hq * S, NAN);
        ref::attention_forward(q.data(), k.data(), v.data(), out.data(),
                               lse ? lse->data() : nullptr, B, S, Hq, Hkv, d);
        return out;
    }
};

TEST(RefAttention, SingleTokenReturnsV) {
    SEEDED_RNG(rng);
    AttnCase a(3, 1, 4, 2, 5, rng);
    std::vector<double> lse;
    const auto out = a.forward(&lse);
    for (int64_t t = 0; t < a.T(); t++)
        for (int h = 0; h < 4; h++) {
            const int g = h / 2;  // query heads 0,1 read KV head 0; 2,3 read KV head 1
            double s = 0;
            for (int c = 0; c < 5; c++) {
                EXPECT_NEAR(out[t * 20 + h * 5 + c], a.v[t * 10 + g * 5 + c], 1e-15);
                s += a.q[t * 20 + h * 5 + c] * a.k[t * 10 + g * 5 + c];
            }
            EXPECT_NEAR(lse[t * 4 + h], s / std::sqrt(5.0), 1e-14);  // lse [B, Hq, S=1]
        }
}

// Every row against a direct masked softmax; this also proves causality and that attention
// never crosses sequences, since only keys 0..i of the row's own sequence enter here.
TEST(RefAttention, RowsMatchDirectSoftmax) {
    SEEDED_RNG(rng);
    AttnCase a(2, 7, 4, 2, 5, rng);
    std::vector<double> lse;
    const auto out = a.forward(&lse);
    const int qd = 20, kvd = 10, d = 5;
    for (int b = 0; b < 2; b++)
        for (int h = 0; h < 4; h++)
            for (int64_t i = 0; i < 7; i++) {
                const int g = h / 2;
                std::vector<double> e(i + 1);
                double sum = 0;
                for (int64_t j = 0; j <= i; j++) {
                    double s = 0;
                    for (int c = 0; c < d; c++)
                        s += a.q[(b * 7 + i) * qd + h * d + c] * a.k[(b * 7 + j) * kvd + g * d + c];
                    e[j] = std::exp(s / std::sqrt(5.0));
                    sum += e[j];
                }
                EXPECT_NEAR(lse[(b * 4 + h) * 7 + i], std::log(sum), 1e-13);
                for (int c = 0; c < d; c++) {
                    double expect = 0, lo = INFINITY, hi = -INFINITY;
                    for (int64_t j = 0; j <= i; j++) {
                        const double vj = a.v[(b * 7 + j) * kvd + g * d + c];
                        expect += e[j] / sum * vj;
                        lo = std::min(lo, vj);
                        hi = std::max(hi, vj);
                    }
                    const double o = out[(b * 7 + i) * qd + h * d + c];
                    EXPECT_NEAR(o, expect, 1e-13);
                    EXPECT_GE(o, lo - 1e-13);  // a convex combination of the visible values
                    EXPECT_LE(o, hi + 1e-13);
                }
            }
}

TEST(RefAttention, LargeScoresStayFinite) {
    SEEDED_RNG(rng);
    AttnCase a(1, 6, 2, 1, 4, rng);
    for (auto& x : a.q) x *= 1e3;  // scores ~ 1e6: a naive exp() overflows
    std::vector<double> lse;
    const auto out = a.forward(&lse);
    for (double x : out) EXPECT_TRUE(std::isfinite(x));
    for (double x : lse) EXPECT_TRUE(std::isfinite(x));
}

TEST(RefAttention, GradientsMatchFiniteDifferences) {
    SEEDED_RNG(rng);
    AttnCase a(2, 7, 4, 2, 5, rng);  // odd sizes, GQA with 2 query heads per KV head
    const auto dout = random_normal(a.T() * a.Hq * a.d, rng);
    auto loss = [&] { return dot(a.forward(), dout); };
    std::vector<double> dq(a.q.size(), NAN), dk(a.k.size(), NAN), dv(a.v.size(), NAN);
    ref::attention_backward(a.q.data(), a.k.data(), a.v.data(), dout.data(), dq.data(), dk.data(),
                            dv.data(), a.B, a.S, a.Hq, a.Hkv, a.d);
    EXPECT_LT(rel_error(dq, numeric_grad(loss, a.q)), kFdTol);
    EXPECT_LT(rel_error(dk, numeric_grad(loss, a.k)), kFdTol);
    EXPECT_LT(rel_error(dv, numeric_grad(loss, a.v)), kFdTol);
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

TEST(RefSwiglu, HandValues) {
    // gate (1, 0, -2) | up (2, 3, 0.5); silu(g) = g * sigmoid(g).
    const std::vector<double> h13 = {1, 0, -2, 2, 3, 0.5};
    std::vector<double> act(3);
    ref::swiglu_forward(h13.data(), act.data(), 1, 3);
    EXPECT_NEAR(act[0], 0.7310585786300049 * 2, 1e-15);
    EXPECT_EQ(act[1], 0.0);
    EXPECT_NEAR(act[2], -2 * 0.11920292202211755 * 0.5, 1e-15);
}

TEST(RefSwiglu, GradientMatchesFiniteDifferences) {
    SEEDED_RNG(rng);
    const int64_t T = 3;
    const int F = 5;
    auto h13 = random_normal(T * 2 * F, rng, 3.0);
    const auto dact = random_normal(T * F, rng);
    auto loss = [&] {
        std::vector<double> act(T * F);
        ref::swiglu_forward(h13.data(), act.data(), T, F);
        return dot(act, dact);
    };
    std::vector<double> dh13(T * 2 * F, NAN);
    ref::swiglu_backward(dact.data(), h13.data(), dh13.data(), T, F);
    EXPECT_LT(rel_error(dh13, numeric_grad(loss, h13)), kFdTol);
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy

TEST(RefCrossEntropy, UniformLogitsGiveLogV) {
    const int64_t T = 4;
    const int V = 11;
    const std::vector<double> logits(T * V, 2.5);
    const std::vector<int32_t> targets = {3, -1, 0, 10};
    EXPECT_NEAR(ref::cross_entropy(logits.data(), targets.data(), nullptr, T, V), std::log(11.0),
                1e-14);
}

TEST(RefCrossEntropy, HandValues) {
    // Two classes, logits (0, ln 3): p = (1/4, 3/4). Target 1 costs ln(4/3), target 0 ln 4.
    // The third token is ignored, however extreme its logits.
    const std::vector<double> logits = {0, std::log(3.0), 0, std::log(3.0), 1e300, -1e300};
    const std::vector<int32_t> targets = {1, 0, -1};
    std::vector<double> dl(6, NAN);
    const double loss = ref::cross_entropy(logits.data(), targets.data(), dl.data(), 3, 2);
    EXPECT_NEAR(loss, (std::log(4.0 / 3) + std::log(4.0)) / 2, 1e-15);
    // (softmax - onehot) / 2 counted tokens
    EXPECT_NEAR(dl[0], 0.25 / 2, 1e-15);
    EXPECT_NEAR(dl[1], (0.75 - 1) / 2, 1e-15);
    EXPECT_NEAR(dl[2], (0.25 - 1) / 2, 1e-15);
    EXPECT_NEAR(dl[3], 0.75 / 2, 1e-15);
    EXPECT_EQ(dl[4], 0.0);
    EXPECT_EQ(dl[5], 0.0);
}

TEST(RefCrossEntropy, GradientMatchesFiniteDifferencesWithIgnoredTargets) {
    SEEDED_RNG(rng);
    const int64_t T = 6;
    const int V = 7;
    auto logits = random_normal(T * V, rng, 2.0);
    auto targets = random_ints(T, V, rng);
    targets[1] = targets[4] = -1;
    auto loss = [&] { return ref::cross_entropy(logits.data(), targets.data(), nullptr, T, V); };
    std::vector<double> dl(T * V, NAN);
    EXPECT_EQ(ref::cross_entropy(logits.data(), targets.data(), dl.data(), T, V), loss());
    EXPECT_LT(rel_error(dl, numeric_grad(loss, logits)), kFdTol);
    for (int c = 0; c < V; c++) EXPECT_EQ(dl[1 * V + c], 0.0);
    for (int c = 0; c < V; c++) EXPECT_EQ(dl[4 * V + c], 0.0);
}

// No counted token: the loss is defined as 0 with a zero gradient (HF would give 0/0 = NaN).
TEST(RefCrossEntropy, AllIgnoredGivesZeroAndBadTargetThrows) {
    const std::vector<double> logits = {1, 2, 3, 4};
    std::vector<int32_t> targets = {-1, -1};
    std::vector<double> dl(4, NAN);
    EXPECT_EQ(ref::cross_entropy(logits.data(), targets.data(), dl.data(), 2, 2), 0.0);
    for (double g : dl) EXPECT_EQ(g, 0.0);
    targets[0] = 2;
    EXPECT_THROW(ref::cross_entropy(logits.data(), targets.data(), nullptr, 2, 2),
                 std::out_of_range);
}

// ---------------------------------------------------------------------------------------------
// Linear

TEST(RefLinear, HandValues) {
    // W [out 3, in 2] row-major; y = x W^T.
    const std::vector<double> x = {1, 2}, W = {1, 0, 0, 1, 3, 4};
    std::vector<double> y(3);
    ref::linear_forward(x.data(), W.data(), y.data(), 1, 2, 3);
    EXPECT_EQ(y, (std::vector<double>{1, 2, 11}));
}

TEST(RefLinear, GradientsMatchFiniteDifferences) {
    SEEDED_RNG(rng);
    const int64_t T = 4;
    const int in = 5, out = 3;
    auto x = random_normal(T * in, rng), W = random_normal(out * in, rng);
    const auto dy = random_normal(T * out, rng);
    auto loss = [&] {
        std::vector<double> y(T * out);
        ref::linear_forward(x.data(), W.data(), y.data(), T, in, out);
        return dot(y, dy);
    };
    std::vector<double> dx(T * in, NAN);
    const auto dW_before = random_normal(out * in, rng);
    auto dW = dW_before;
    ref::linear_backward(dy.data(), x.data(), W.data(), dx.data(), dW.data(), T, in, out);
    for (size_t i = 0; i < dW.size(); i++) dW[i] -= dW_before[i];
    EXPECT_LT(rel_error(dx, numeric_grad(loss, x)), kFdTol);
    EXPECT_LT(rel_error(dW, numeric_grad(loss, W)), kFdTol);
}

// ---------------------------------------------------------------------------------------------
// AdamW

TEST(RefAdamW, HandComputedSteps) {
    // Step 1 with decay, grad_scale 2: g = (1, 0). lr 0.1, betas (0.9, 0.999), eps 1e-8, wd 0.01.
    //   element 0: p = 1 * (1 - 0.001) = 0.999, m = 0.1, v = 0.001, bias corrections 0.1, 0.001:
    //              p = 0.999 - (0.1 / 0.1) * 0.1 / (sqrt(0.001) / sqrt(0.001) + 1e-8)
    //   element 1: zero gradient: only the decay, p = 3 * 0.999.
    std::vector<double> p = {1, 3}, g = {0.5, 0}, m = {0, 0}, v = {0, 0};
    ref::adamw_step(p.data(), g.data(), m.data(), v.data(), 2, 0.1, 0.9, 0.999, 1e-8, 0.01, true,
                    1, 2.0);
    EXPECT_NEAR(p[0], 0.999 - 0.1 / (1 + 1e-8), 1e-15);
    EXPECT_NEAR(m[0], 0.1, 1e-16);
    EXPECT_NEAR(v[0], 0.001, 1e-18);
    EXPECT_NEAR(p[1], 2.997, 1e-15);
    EXPECT_EQ(m[1], 0.0);
    EXPECT_EQ(v[1], 0.0);

    // Step 3 without decay from m = 0.05, v = 0.002, g = -1:
    //   m = 0.045 - 0.1 = -0.055, v = 0.001998 + 0.001 = 0.002998,
    //   bias corrections 1 - 0.9^3 = 0.271, 1 - 0.999^3 = 0.002997001.
    p = {2};
    g = {-1};
    m = {0.05};
    v = {0.002};
    ref::adamw_step(p.data(), g.data(), m.data(), v.data(), 1, 0.1, 0.9, 0.999, 1e-8, 0.01, false,
                    3, 1.0);
    EXPECT_NEAR(m[0], -0.055, 1e-15);
    EXPECT_NEAR(v[0], 0.002998, 1e-15);
    EXPECT_NEAR(p[0],
                2 - (0.1 / 0.271) * -0.055 / (std::sqrt(0.002998) / std::sqrt(0.002997001) + 1e-8),
                1e-12);
}

// Adam's first step (m = v = 0, eps = 0) moves every parameter by exactly lr against its
// gradient's sign, whatever the gradient's size.
TEST(RefAdamW, FirstStepMovesByLr) {
    SEEDED_RNG(rng);
    const int n = 16;
    const auto p0 = random_normal(n, rng), g = random_normal(n, rng, 10.0);
    auto p = p0;
    std::vector<double> m(n, 0), v(n, 0);
    ref::adamw_step(p.data(), g.data(), m.data(), v.data(), n, 0.01, 0.9, 0.95, 0.0, 0.1, false, 1,
                    0.3);
    for (int i = 0; i < n; i++) EXPECT_NEAR(p[i], p0[i] - 0.01 * (g[i] > 0 ? 1 : -1), 1e-15);
}

// ---------------------------------------------------------------------------------------------
// The whole model

// Weights of a useful scale: matrices ~ scale/sqrt(fan_in) so activations stay O(1), norm gains
// near 1. The alignment padding gets garbage, which the model must never read.
std::vector<double> random_params(const LlamaConfig& c, std::mt19937_64& rng, double scale = 1.0) {
    const ParamLayout lay = param_layout(c);
    auto p = random_normal(lay.total, rng, 1e3);
    for (const auto& t : lay.tensors) {
        const bool gain = t.rows == 1;  // the norms' gains: attention, MLP, final, (Qwen3) q and k
        const double stddev = t.kind == P_EMBED ? scale : scale / std::sqrt((double)t.cols);
        const auto r = random_normal(t.numel(), rng, gain ? 0.2 : stddev);
        for (int64_t i = 0; i < t.numel(); i++) p[t.offset + i] = gain ? 1 + r[i] : r[i];
    }
    return p;
}

struct Batch {
    int B;
    int64_t S;
    std::vector<int32_t> tokens, targets;
};

// Random tokens and targets, about one target in four ignored (never the first).
Batch random_batch(const LlamaConfig& c, int B, int64_t S, std::mt19937_64& rng) {
    Batch b{B, S, random_ints(B * S, c.vocab, rng), random_ints(B * S, c.vocab, rng)};
    std::bernoulli_distribution ignore(0.25);
    for (int64_t t = 1; t < B * S; t++)
        if (ignore(rng)) b.targets[t] = -1;
    return b;
}

double loss_of(const LlamaConfig& c, const std::vector<double>& p, const Batch& b) {
    return ref::model_loss(c, p.data(), b.tokens.data(), b.targets.data(), b.B, b.S);
}

void check_model_gradients(bool tied, bool qwen3 = false) {
    SEEDED_RNG(rng);
    const LlamaConfig c = fd_config(tied, qwen3);
    const ParamLayout lay = param_layout(c);
    auto params = random_params(c, rng);
    const Batch b = random_batch(c, 2, 5, rng);
    std::vector<double> grads(lay.total, NAN);  // everything must be overwritten
    const double loss = ref::model_forward_backward(c, params.data(), b.tokens.data(),
                                                    b.targets.data(), b.B, b.S, grads.data());
    EXPECT_EQ(loss, loss_of(c, params, b));

    std::vector<bool> is_param(lay.total, false);
    for (const auto& t : lay.tensors) {
        SCOPED_TRACE(::testing::Message() << param_kind_name(t.kind) << " layer " << t.layer);
        for (int64_t i = 0; i < t.numel(); i++) is_param[t.offset + i] = true;
        const std::vector<double> analytic(grads.begin() + t.offset,
                                           grads.begin() + t.offset + t.numel());
        auto loss = [&] { return loss_of(c, params, b); };
        const auto numeric = numeric_grad(loss, params.data() + t.offset, t.numel());
        EXPECT_LT(rel_error(analytic, numeric), kFdTol);
    }
    for (int64_t n = 0; n < lay.total; n++) {
        if (!is_param[n]) {
            ASSERT_EQ(grads[n], 0.0) << "padding element " << n;
        }
    }
}

TEST(RefModel, EveryGradientMatchesFiniteDifferencesTied) { check_model_gradients(true); }
TEST(RefModel, EveryGradientMatchesFiniteDifferencesUntied) { check_model_gradients(false); }
TEST(RefModel, EveryGradientMatchesFiniteDifferencesQwen3) { check_model_gradients(false, true); }

// A second forward pass, written token by token like decoding with a KV cache, in the words of
// HF's LlamaForCausalLM (rotate_half, repeat_kv, act_fn(gate_proj(x)) * up_proj(x)). It shares
// only the parameter layout with reference.cpp, so it catches what the gradient check cannot:
// q/k/v or gate/up slices swapped, a wrong GQA head mapping, RoPE layout, the tied head.
std::vector<double> decode_logits(const LlamaConfig& c, const std::vector<double>& P,
                                  const Batch& batch) {
    const ParamLayout lay = param_layout(c);
    const int D = c.dim, F = c.ffn_dim, d = c.head_dim, V = c.vocab;
    const int qd = (int)c.q_dim(), kvd = (int)c.kv_dim(), n_rep = c.n_heads / c.n_kv_heads;
    auto at = [&](ParamKind k, int l = -1) { return P.data() + lay.find(k, l).offset; };
    auto matvec = [](const double* W, int rows, int cols, const std::vector<double>& x) {
        std::vector<double> y(rows, 0.0);
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < cols; i++) y[r] += W[(int64_t)r * cols + i] * x[i];
        return y;
    };
    auto rmsnorm = [&](const std::vector<double>& x, const double* w) {
        double ms = 0;
        for (double e : x) ms += e * e / x.size();
        std::vector<double> y(x.size());
        for (size_t i = 0; i < x.size(); i++) y[i] = w[i] * (x[i] / std::sqrt(ms + c.norm_eps));
        return y;
    };
    const auto inv = ref::rope_inv_freq(c);
    // HF's apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, cos = cos(cat(freqs, freqs)).
    auto apply_rotary = [&](std::vector<double>& x, int64_t pos) {
        for (size_t h = 0; h < x.size() / d; h++) {
            std::vector<double> head(x.begin() + h * d, x.begin() + (h + 1) * d);
            for (int i = 0; i < d; i++) {
                const double angle = pos * inv[i % (d / 2)];
                const double rot_half = i < d / 2 ? -head[i + d / 2] : head[i - d / 2];
                x[h * d + i] = head[i] * std::cos(angle) + rot_half * std::sin(angle);
            }
        }
    };
    std::vector<double> logits;
    for (int b = 0; b < batch.B; b++) {
        std::vector<std::vector<std::vector<double>>> kcache(c.n_layers), vcache(c.n_layers);
        for (int64_t s = 0; s < batch.S; s++) {
            const int32_t tok = batch.tokens[b * batch.S + s];
            std::vector<double> x(at(P_EMBED) + (int64_t)tok * D, at(P_EMBED) + (tok + 1) * D);
            for (int l = 0; l < c.n_layers; l++) {
                const auto xn = rmsnorm(x, at(P_ATTN_NORM, l));
                const double* wqkv = at(P_WQKV, l);
                auto q = matvec(wqkv, qd, D, xn);                              // q_proj
                auto k = matvec(wqkv + (int64_t)qd * D, kvd, D, xn);           // k_proj
                const auto v = matvec(wqkv + (int64_t)(qd + kvd) * D, kvd, D, xn);  // v_proj
                if (c.qk_norm()) {  // Qwen3Attention: q_norm, k_norm on each head, before the rotary
                    for (std::vector<double>* x : {&q, &k})
                        for (size_t h = 0; h < x->size() / d; h++) {
                            const std::vector<double> head(x->begin() + h * d, x->begin() + (h + 1) * d);
                            const auto y = rmsnorm(head, at(x == &q ? P_Q_NORM : P_K_NORM, l));
                            std::copy(y.begin(), y.end(), x->begin() + h * d);
                        }
                }
                apply_rotary(q, s);
                apply_rotary(k, s);
                kcache[l].push_back(k);
                vcache[l].push_back(v);
                std::vector<double> o(qd, 0.0);
                for (int h = 0; h < c.n_heads; h++) {
                    const int kvh = h / n_rep;  // repeat_kv
                    std::vector<double> w(s + 1);
                    double sum = 0;
                    for (int64_t j = 0; j <= s; j++) {
                        const double* kj = kcache[l][j].data() + kvh * d;
                        double score = 0;
                        for (int i = 0; i < d; i++) score += q[h * d + i] * kj[i];
                        w[j] = std::exp(score / std::sqrt((double)d));
                        sum += w[j];
                    }
                    for (int64_t j = 0; j <= s; j++) {
                        const double* vj = vcache[l][j].data() + kvh * d;
                        for (int i = 0; i < d; i++) o[h * d + i] += w[j] / sum * vj[i];
                    }
                }
                const auto attn_out = matvec(at(P_WO, l), D, qd, o);  // o_proj
                for (int i = 0; i < D; i++) x[i] += attn_out[i];
                const auto xn2 = rmsnorm(x, at(P_MLP_NORM, l));
                const auto gate = matvec(at(P_W13, l), F, D, xn2);                  // gate_proj
                const auto up = matvec(at(P_W13, l) + (int64_t)F * D, F, D, xn2);   // up_proj
                std::vector<double> act(F);
                for (int f = 0; f < F; f++) act[f] = gate[f] / (1 + std::exp(-gate[f])) * up[f];
                const auto mlp_out = matvec(at(P_W2, l), D, F, act);  // down_proj
                for (int i = 0; i < D; i++) x[i] += mlp_out[i];
            }
            const auto xf = rmsnorm(x, at(P_FINAL_NORM));
            const auto row = matvec(at(c.tied_embeddings ? P_EMBED : P_LM_HEAD), V, D, xf);
            logits.insert(logits.end(), row.begin(), row.end());
        }
    }
    return logits;
}

TEST(RefModel, MatchesTokenByTokenDecoder) {
    SEEDED_RNG(rng);
    for (const LlamaConfig& c : {fd_config(true), fd_config(false), fd_config(false, true)}) {
        SCOPED_TRACE(c.name);
        const auto params = random_params(c, rng);
        const Batch b = random_batch(c, 2, 6, rng);
        std::vector<double> grads(param_layout(c).total), logits;
        const double loss = ref::model_forward_backward(c, params.data(), b.tokens.data(),
                                                        b.targets.data(), b.B, b.S, grads.data(),
                                                        &logits);
        const auto expect = decode_logits(c, params, b);
        ASSERT_EQ(logits.size(), expect.size());
        EXPECT_LT(rel_error(logits, expect), 1e-12);
        double sum = 0;  // the mean cross-entropy, written out
        int count = 0;
        for (int64_t t = 0; t < b.B * b.S; t++) {
            if (b.targets[t] == -1) continue;
            double z = 0;
            for (int i = 0; i < c.vocab; i++) z += std::exp(expect[t * c.vocab + i]);
            sum += std::log(z) - expect[t * c.vocab + b.targets[t]];
            count++;
        }
        EXPECT_NEAR(loss, sum / count, 1e-12);
    }
}

// An untied model whose LM head is a copy of the embedding is the tied model; the tied
// embedding's gradient is the sum of the untied embedding's and head's.
TEST(RefModel, TiedEqualsUntiedWithCopiedHead) {
    SEEDED_RNG(rng);
    const LlamaConfig ct = fd_config(true), cu = fd_config(false);
    const ParamLayout lt = param_layout(ct), lu = param_layout(cu);
    const auto pt = random_params(ct, rng);
    std::vector<double> pu(lu.total, 0.0);
    for (const auto& t : lt.tensors)
        for (int64_t i = 0; i < t.numel(); i++)
            pu[lu.find(t.kind, t.layer).offset + i] = pt[t.offset + i];
    const int64_t embed = lt.find(P_EMBED).offset, head = lu.find(P_LM_HEAD).offset;
    for (int64_t i = 0; i < (int64_t)cu.vocab * cu.dim; i++) pu[head + i] = pt[embed + i];

    const Batch b = random_batch(ct, 2, 5, rng);
    std::vector<double> gt(lt.total), gu(lu.total);
    const double loss_t = ref::model_forward_backward(ct, pt.data(), b.tokens.data(),
                                                      b.targets.data(), 2, 5, gt.data());
    const double loss_u = ref::model_forward_backward(cu, pu.data(), b.tokens.data(),
                                                      b.targets.data(), 2, 5, gu.data());
    EXPECT_NEAR(loss_t, loss_u, 1e-13);
    for (const auto& t : lt.tensors) {
        SCOPED_TRACE(::testing::Message() << param_kind_name(t.kind) << " layer " << t.layer);
        const std::vector<double> a(gt.begin() + t.offset, gt.begin() + t.offset + t.numel());
        std::vector<double> e(t.numel());
        for (int64_t i = 0; i < t.numel(); i++) {
            e[i] = gu[lu.find(t.kind, t.layer).offset + i];
            if (t.kind == P_EMBED) e[i] += gu[head + i];
        }
        EXPECT_LT(rel_error(a, e), 1e-12);
    }
}

// Sequences are independent (positions restart at t % S, attention stays inside a sequence)
// and causal (a token never sees later ones).
TEST(RefModel, SequencesAreIndependentAndCausal) {
    SEEDED_RNG(rng);
    const LlamaConfig c = fd_config(true);
    const auto params = random_params(c, rng);
    const int64_t S = 5, V = c.vocab;
    Batch b = random_batch(c, 2, S, rng);
    for (int64_t s = 0; s < S; s++) b.tokens[S + s] = b.tokens[s];  // sequence 1 = sequence 0
    std::vector<double> grads(param_layout(c).total), l0, l1;
    ref::model_forward_backward(c, params.data(), b.tokens.data(), b.targets.data(), 2, S,
                                grads.data(), &l0);
    for (int64_t n = 0; n < S * V; n++) EXPECT_NEAR(l0[n], l0[S * V + n], 1e-12);
    b.tokens[S - 1] = (b.tokens[S - 1] + 1) % c.vocab;  // change the last token of sequence 0
    ref::model_forward_backward(c, params.data(), b.tokens.data(), b.targets.data(), 2, S,
                                grads.data(), &l1);
    for (int64_t n = 0; n < (S - 1) * V; n++) EXPECT_EQ(l1[n], l0[n]);  // earlier tokens
    for (int64_t n = S * V; n < 2 * S * V; n++) EXPECT_EQ(l1[n], l0[n]);  // the other sequence
    double changed = 0;
    for (int64_t n = (S - 1) * V; n < S * V; n++) changed += std::fabs(l1[n] - l0[n]);
    EXPECT_GT(changed, 0.0);
}

// Packed documents. One sequence of documents A | B | C (the first cut by the window: its
// positions start at 3) with each token attending only within its document and positions from its
// start computes, token for token, what the documents compute as sequences of their own: the same
// logits, and (targets at the documents' ends ignored) the loss's gradient is their sum's.
ref::Documents documents_of(const std::vector<int64_t>& starts, const std::vector<int64_t>& first_pos, int64_t S) {
    ref::Documents d;
    for (int64_t t = 0; t < S; t++) {
        size_t k = 0;
        while (k + 1 < starts.size() && starts[k + 1] <= t) k++;
        d.first_key.push_back(starts[k]);
        d.position.push_back(first_pos[k] + t - starts[k]);
    }
    return d;
}

TEST(RefModel, PackedDocumentsAreSeparateSequences) {
    SEEDED_RNG(rng);
    const LlamaConfig c = fd_config(false);
    const auto params = random_params(c, rng);
    const std::vector<int64_t> starts = {0, 4, 5, 9}, first_pos = {3, 0, 0, 0}, lengths = {4, 1, 4, 3};
    const int64_t S = 12, V = c.vocab, P = param_layout(c).total;
    Batch packed = random_batch(c, 1, S, rng);
    for (int64_t s : starts)
        if (s > 0) packed.targets[s - 1] = -1;  // a document's last token is not scored on the next one
    const ref::Documents docs = documents_of(starts, first_pos, S);
    std::vector<double> g_packed(P), logits_packed;
    const double loss = ref::model_forward_backward(c, params.data(), packed.tokens.data(), packed.targets.data(), 1,
                                                    S, g_packed.data(), &logits_packed, &docs);
    EXPECT_EQ(loss, ref::model_loss(c, params.data(), packed.tokens.data(), packed.targets.data(), 1, S, &docs));
    std::vector<double> g_sum(P, 0.0), g(P);
    int64_t scored = 0;
    for (int32_t t : packed.targets) scored += t >= 0;
    double loss_sum = 0;
    for (size_t k = 0; k < starts.size(); k++) {
        const int64_t n = lengths[k], s0 = starts[k];
        std::vector<int32_t> tok(packed.tokens.begin() + s0, packed.tokens.begin() + s0 + n),
            tgt(packed.targets.begin() + s0, packed.targets.begin() + s0 + n);
        ref::Documents own;  // the document alone: its own positions (from first_pos), every key its own
        for (int64_t t = 0; t < n; t++) own.first_key.push_back(0), own.position.push_back(first_pos[k] + t);
        int64_t own_scored = 0;
        for (int32_t t : tgt) own_scored += t >= 0;
        std::vector<double> logits;
        const double l = ref::model_forward_backward(c, params.data(), tok.data(), tgt.data(), 1, n, g.data(),
                                                     &logits, &own);
        for (int64_t i = 0; i < n * V; i++) EXPECT_NEAR(logits[i], logits_packed[s0 * V + i], 1e-12) << "document " << k;
        loss_sum += l * own_scored;
        for (int64_t i = 0; i < P; i++) g_sum[i] += g[i] * own_scored;
    }
    EXPECT_NEAR(loss, loss_sum / scored, 1e-12);
    for (double& x : g_sum) x /= scored;
    EXPECT_LT(rel_error(g_packed, g_sum), 1e-12);
    // Without the documents the same tokens see each other: the logits after the first document differ.
    std::vector<double> logits_plain;
    ref::model_forward_backward(c, params.data(), packed.tokens.data(), packed.targets.data(), 1, S, g.data(),
                                &logits_plain);
    double differ = 0;
    for (int64_t i = starts[1] * V; i < S * V; i++) differ += std::fabs(logits_plain[i] - logits_packed[i]);
    EXPECT_GT(differ, 1e-6);
}

// Every gradient of the model with packed documents against central differences.
TEST(RefModel, PackedDocumentGradientsMatchFiniteDifferences) {
    SEEDED_RNG(rng);
    const LlamaConfig c = fd_config(true);
    const ParamLayout lay = param_layout(c);
    auto params = random_params(c, rng);
    const Batch b = random_batch(c, 2, 6, rng);
    ref::Documents docs = documents_of({0, 2, 3}, {5, 0, 0}, 6), second = documents_of({0, 4}, {0, 0}, 6);
    docs.first_key.insert(docs.first_key.end(), second.first_key.begin(), second.first_key.end());
    docs.position.insert(docs.position.end(), second.position.begin(), second.position.end());
    std::vector<double> grads(lay.total, NAN);
    ref::model_forward_backward(c, params.data(), b.tokens.data(), b.targets.data(), b.B, b.S, grads.data(), nullptr,
                                &docs);
    for (const auto& t : lay.tensors) {
        SCOPED_TRACE(::testing::Message() << param_kind_name(t.kind) << " layer " << t.layer);
        const std::vector<double> analytic(grads.begin() + t.offset, grads.begin() + t.offset + t.numel());
        auto loss = [&] {
            return ref::model_loss(c, params.data(), b.tokens.data(), b.targets.data(), b.B, b.S, &docs);
        };
        EXPECT_LT(rel_error(analytic, numeric_grad(loss, params.data() + t.offset, t.numel())), kFdTol);
    }
}

// Near-zero weights give near-uniform logits: the loss is log V. On the "tiny" test model, whose
// head_dim 64 and sizes are those the GPU tests use. With weights of 1e-4, x stays far below
// sqrt(eps), so the final RMSNorm cannot lift it to unit size: logits ~4e-5, loss log V +- ~1e-5.
TEST(RefModel, LossAtTinyInitIsLogV) {
    SEEDED_RNG(rng);
    const LlamaConfig c = config_by_name("tiny");
    const auto params = random_params(c, rng, 1e-4);
    const Batch b = random_batch(c, 2, 16, rng);
    EXPECT_NEAR(loss_of(c, params, b), std::log((double)c.vocab), 1e-4);
}

// kernels/documents.cuh on the host: the cursor through which the fused backward's adder reads
// each step's first key, walking rows down, gives what the binary search gives, on random
// documents of two sequences (one-token documents, several starts in one 64-row tile, long ones),
// from random first rows in random strides; without documents it gives 0.
TEST(Documents, FirstKeyCursorWalkingDownMatchesTheSearch) {
    SEEDED_RNG(rng);
    for (int trial = 0; trial < 200; trial++) {
        const int64_t seq = 1 + (int64_t)(rng() % 3000), batch = 2;
        std::vector<int64_t> start;
        for (int64_t b = 0; b < batch; b++)
            for (int64_t at = b * seq; at < (b + 1) * seq;) {
                start.push_back(at);
                const int kind = (int)(rng() % 3);  // gaps of 1, up to 8, up to 400 tokens
                at += kind == 0 ? 1 : 1 + (int64_t)(rng() % (kind == 1 ? 8 : 400));
            }
        const DocumentView docs(AttentionDocs{start.data(), (int64_t)start.size()}, seq);
        const int b = (int)(rng() % batch);
        const int64_t first_row = (int64_t)(rng() % seq), stride = 1 + (int64_t)(rng() % 70);
        FirstKeyWalkingDown first_key(docs, b, first_row);
        for (int64_t row = first_row; row >= 0; row -= stride)
            ASSERT_EQ(first_key(row), docs.first_key(b, row)) << "seq " << seq << " b " << b << " row " << row;
        const DocumentView none(AttentionDocs{}, seq);
        FirstKeyWalkingDown no_documents(none, b, first_row);
        EXPECT_EQ(no_documents(first_row), 0);
    }
}

}  // namespace
