// bench/attention_hopper.cu - the tuning bench of kernels/attention_hopper.cu: its kernels against
// kernels/attention.cu's (themselves checked against float64 in tests/test_attention.cu) on six small
// shapes of fresh random inputs, then (--bench) the forward, the backward and the backward's
// two kernels apart timed (median of 5 after 2 warm-ups).
//   build/bench_attention_hopper [--bench] [--seqs 16K,64K]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "../llama.h"
#include "../infra/train.h"

static std::vector<float> download_bf16(const bf16* d, int64_t n) {
    std::vector<bf16> h(n);
    CUDA_CHECK(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
    std::vector<float> f(n);
    for (int64_t i = 0; i < n; i++) f[i] = __bfloat162float(h[i]);
    return f;
}

struct Buffers {
    int64_t T, ld;
    bf16 *qkv, *out_a, *out_b, *dout, *dqkv_a, *dqkv_b;
    float *lse_a, *lse_b, *delta;
};

// Random N(0, 1) bf16 values, drawn on the device (at 64K tokens a shape has hundreds of millions
// of them, slow to draw on the host).
static void random_bf16(bf16* dst, int64_t n, uint64_t seed) {
    float* scratch;
    CUDA_CHECK(cudaMalloc(&scratch, n * 4));
    init_normal(scratch, n, 1.0f, seed, 0);
    convert_f32_to_bf16(dst, scratch, n, 0);
    CUDA_CHECK(cudaFree(scratch));
}

static Buffers make(int B, int64_t S, int Hq, int Hkv, uint64_t seed) {
    Buffers b;
    b.T = B * S;
    b.ld = (int64_t)(Hq + 2 * Hkv) * 128;
    CUDA_CHECK(cudaMalloc(&b.qkv, b.T * b.ld * 2));
    random_bf16(b.qkv, b.T * b.ld, seed);
    CUDA_CHECK(cudaMalloc(&b.out_a, b.T * Hq * 128 * 2));
    CUDA_CHECK(cudaMalloc(&b.out_b, b.T * Hq * 128 * 2));
    CUDA_CHECK(cudaMalloc(&b.lse_a, b.T * Hq * 4));
    CUDA_CHECK(cudaMalloc(&b.lse_b, b.T * Hq * 4));
    CUDA_CHECK(cudaMemset(b.out_b, 0xff, b.T * Hq * 128 * 2));  // NaN poison
    CUDA_CHECK(cudaMemset(b.lse_b, 0xff, b.T * Hq * 4));
    CUDA_CHECK(cudaMalloc(&b.dout, b.T * Hq * 128 * 2));
    random_bf16(b.dout, b.T * Hq * 128, seed + 1);
    CUDA_CHECK(cudaMalloc(&b.dqkv_a, b.T * b.ld * 2));
    CUDA_CHECK(cudaMalloc(&b.dqkv_b, b.T * b.ld * 2));
    CUDA_CHECK(cudaMemset(b.dqkv_b, 0xff, b.T * b.ld * 2));
    CUDA_CHECK(cudaMalloc(&b.delta, b.T * Hq * 4));
    return b;
}
static void release(Buffers& b) {
    cudaFree(b.qkv), cudaFree(b.out_a), cudaFree(b.out_b), cudaFree(b.lse_a), cudaFree(b.lse_b);
    cudaFree(b.dout), cudaFree(b.dqkv_a), cudaFree(b.dqkv_b), cudaFree(b.delta);
}
static AttentionForwardArgs args(const Buffers& b, int Hq, int Hkv, bool hopper) {
    return {.q = b.qkv, .k = b.qkv + Hq * 128, .v = b.qkv + (Hq + Hkv) * 128, .ldq = b.ld, .ldk = b.ld, .ldv = b.ld,
            .out = hopper ? b.out_b : b.out_a, .ldo = (int64_t)Hq * 128, .lse = hopper ? b.lse_b : b.lse_a};
}

// Backward: the reference computes delta from out; the Hopper one is given it.
static AttentionBackwardArgs bargs(const Buffers& b, int Hq, int Hkv, bool hopper) {
    const int64_t qd = Hq * 128, kd = Hkv * 128;
    bf16* d = hopper ? b.dqkv_b : b.dqkv_a;
    return {.q = b.qkv, .k = b.qkv + qd, .v = b.qkv + qd + kd, .out = hopper ? nullptr : b.out_a, .dout = b.dout,
            .ldq = b.ld, .ldk = b.ld, .ldv = b.ld, .ldo = qd, .lddo = qd, .lse = b.lse_a, .dq = d, .dk = d + qd,
            .dv = d + qd + kd, .lddq = b.ld, .lddk = b.ld, .lddv = b.ld, .delta = b.delta};
}

static double rel(const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); i++) {
        double d = (double)a[i] - b[i];
        if (!std::isfinite(a[i])) return INFINITY;
        num += d * d, den += (double)b[i] * b[i];
    }
    return std::sqrt(num / (den > 0 ? den : 1));
}

static float time_ms(const std::function<void()>& f) {
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    std::vector<float> t;
    for (int r = 0; r < 7; r++) {
        cudaEventRecord(e0);
        f();
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float x;
        cudaEventElapsedTime(&x, e0, e1);
        if (r >= 2) t.push_back(x);
    }
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

struct Case {
    int B;
    int64_t S;
    int Hq, Hkv;
};

// One shape, the fast kernels against kernels/attention.cu's: forward, lean and fused backward.
// Returns how many of them differ.
static int check_case(const Case& c) {
    int failed = 0;
    Buffers b = make(c.B, c.S, c.Hq, c.Hkv, 1234 + c.S);
    AttentionShape sh{c.B, c.S, c.Hq, c.Hkv, 128};
    attention_forward_reference(args(b, c.Hq, c.Hkv, false), sh, 0);
    attention_forward_hopper(args(b, c.Hq, c.Hkv, true), sh, 0);
    CUDA_CHECK(cudaDeviceSynchronize());
    auto oa = download_bf16(b.out_a, b.T * c.Hq * 128), ob = download_bf16(b.out_b, b.T * c.Hq * 128);
    std::vector<float> la(b.T * c.Hq), lb(b.T * c.Hq);
    CUDA_CHECK(cudaMemcpy(la.data(), b.lse_a, la.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(lb.data(), b.lse_b, lb.size() * 4, cudaMemcpyDeviceToHost));
    double eo = rel(ob, oa), el = rel(lb, la);
    attention_backward_reference(bargs(b, c.Hq, c.Hkv, false), sh, 0);
    attention_backward_hopper(bargs(b, c.Hq, c.Hkv, true), sh, 0);
    CUDA_CHECK(cudaDeviceSynchronize());
    auto ga = download_bf16(b.dqkv_a, b.T * b.ld), gb = download_bf16(b.dqkv_b, b.T * b.ld);
    auto cols = [&](const std::vector<float>& x, int64_t c0, int64_t n) {
        std::vector<float> r;
        for (int64_t t = 0; t < b.T; t++) r.insert(r.end(), x.begin() + t * b.ld + c0, x.begin() + t * b.ld + c0 + n);
        return r;
    };
    const int64_t qd = c.Hq * 128, kd = c.Hkv * 128;
    double edq = rel(cols(gb, 0, qd), cols(ga, 0, qd)), edk = rel(cols(gb, qd, kd), cols(ga, qd, kd)),
           edv = rel(cols(gb, qd + kd, kd), cols(ga, qd + kd, kd));
    const bool ok = eo < 1e-2 && el < 1e-5 && edq < 2e-2 && edk < 2e-2 && edv < 2e-2;
    failed += !ok;
    printf("B%d S%lld Hq%d Hkv%d: out %.1e lse %.1e dq %.1e dk %.1e dv %.1e  %s\n", c.B,
           (long long)c.S, c.Hq, c.Hkv, eo, el, edq, edk, edv, ok ? "ok" : "MISMATCH");
    // The fused backward (dQ summed in fp32 by the dK/dV kernel), into poisoned buffers again.
    float* acc;
    CUDA_CHECK(cudaMalloc(&acc, attention_dq_accum_floats(sh) * 4));
    CUDA_CHECK(cudaMemset(acc, 0xff, attention_dq_accum_floats(sh) * 4));
    CUDA_CHECK(cudaMemset(b.dqkv_b, 0xff, b.T * b.ld * 2));
    AttentionBackwardArgs fb = bargs(b, c.Hq, c.Hkv, true);
    fb.dq_accum = acc;
    attention_backward_hopper(fb, sh, 0);
    CUDA_CHECK(cudaDeviceSynchronize());
    gb = download_bf16(b.dqkv_b, b.T * b.ld);
    CUDA_CHECK(cudaFree(acc));
    edq = rel(cols(gb, 0, qd), cols(ga, 0, qd)), edk = rel(cols(gb, qd, kd), cols(ga, qd, kd)),
    edv = rel(cols(gb, qd + kd, kd), cols(ga, qd + kd, kd));
    const bool fused_ok = edq < 2e-2 && edk < 2e-2 && edv < 2e-2;
    failed += !fused_ok;
    printf("   fused backward:                   dq %.1e dk %.1e dv %.1e  %s\n", edq, edk, edv,
           fused_ok ? "ok" : "MISMATCH");
    release(b);
    return failed;
}

// The 3B (shape 0) or 8B (shape 1) heads at S tokens: forward, backward and its kernels apart,
// the fused backward, and whether two of its runs give the same bits (0) or not (1).
static int time_shape(int shape, int64_t S) {
    const int Hq = shape ? 32 : 24, Hkv = 8;
    Buffers b = make(1, S, Hq, Hkv, 99);
    AttentionShape sh{1, S, Hq, Hkv, 128};
    const double flops = attention_forward_flops(sh);
    attention_forward_reference(args(b, Hq, Hkv, false), sh, 0);
    attention_backward_reference(bargs(b, Hq, Hkv, false), sh, 0);  // delta
    const float fwd = time_ms([&] { attention_forward_hopper(args(b, Hq, Hkv, true), sh, 0); });
    const float bwd = time_ms([&] { attention_backward_hopper(bargs(b, Hq, Hkv, true), sh, 0); });
    const float dkdv = time_ms([&] { attention_backward_hopper(bargs(b, Hq, Hkv, true), sh, 0, {.parts = 1}); });
    const float dq = time_ms([&] { attention_backward_hopper(bargs(b, Hq, Hkv, true), sh, 0, {.parts = 2}); });
    float* acc;
    CUDA_CHECK(cudaMalloc(&acc, attention_dq_accum_floats(sh) * 4));
    AttentionBackwardArgs fb = bargs(b, Hq, Hkv, true);
    fb.dq_accum = acc;
    const float fused = time_ms([&] { attention_backward_hopper(fb, sh, 0); });
    // Bit-reproducible? The last timed run's gradients (dq, dk, dv) against one more run's.
    std::vector<bf16> grads_1(b.T * b.ld), grads_2(b.T * b.ld);
    CUDA_CHECK(cudaMemcpy(grads_1.data(), b.dqkv_b, b.T * b.ld * 2, cudaMemcpyDeviceToHost));
    attention_backward_hopper(fb, sh, 0);
    CUDA_CHECK(cudaMemcpy(grads_2.data(), b.dqkv_b, b.T * b.ld * 2, cudaMemcpyDeviceToHost));
    const bool same = memcmp(grads_1.data(), grads_2.data(), grads_1.size() * 2) == 0;
    const float fused_kernel = time_ms([&] { attention_backward_hopper(fb, sh, 0, {.parts = 1}); });
    CUDA_CHECK(cudaFree(acc));
    printf("%s %6lld  fwd %8.3f ms %6.1f TF/s  bwd %8.3f ms %6.1f TF/s  (dK/dV %.3f ms %.1f TF/s "
           "of its 4 products, dQ %.3f ms %.1f of its 3)\n",
           shape ? "8B 32/8" : "3B 24/8", (long long)S, fwd, flops / fwd / 1e9, bwd,
           2.5 * flops / bwd / 1e9, dkdv, 2.0 * flops / dkdv / 1e9, dq, 1.5 * flops / dq / 1e9);
    printf("               fused bwd %8.3f ms %6.1f TF/s  (its dK/dV/dQ kernel and clearing %.3f ms)  "
           "two runs' gradients %s\n", fused, 2.5 * flops / fused / 1e9, fused_kernel,
           same ? "bitwise equal" : "DIFFER");
    fflush(stdout);
    release(b);
    return same ? 0 : 1;  // the fused backward's adds go in a fixed order: the same bits every run
}

// Checked against kernels/attention.cu on six shapes, then (bench) timed.
static int run(bool bench, const std::vector<int64_t>& seqs) {
    const Case cases[] = {{1, 128, 2, 1}, {1, 1000, 8, 2}, {2, 130, 4, 4}, {1, 4097, 32, 8}, {3, 77, 3, 1}, {1, 16384, 24, 8}};
    int failed = 0;
    for (const Case& c : cases) failed += check_case(c);
    if (!bench || failed) return failed;
    for (int shape = 0; shape < 2; shape++)
        for (int64_t S : seqs) failed += time_shape(shape, S);
    return failed;
}

// build/bench_attention_hopper [--bench] [--seqs 16K,64K]
static int bench_main(int argc, char** argv) {
    bool bench = false;
    std::vector<int64_t> seqs = {16384, 65536};
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (a == "--bench") {
            bench = true;
        } else if (a == "--seqs" && i + 1 < argc) {
            seqs.clear();
            for (const std::string& s : split_commas(argv[++i])) seqs.push_back(parse_tokens("--seqs", s));
        } else {
            fprintf(stderr, "usage: bench_attention_hopper [--bench] [--seqs 16K,...]\n");
            return 2;
        }
    }
    return run(bench, seqs) ? 1 : 0;
}

// Bad arguments and CUDA failures end with their message and exit code (2 usage, 1 runtime).
int main(int argc, char** argv) { return exit_code_of("bench_attention_hopper", [&] { return bench_main(argc, argv); }); }
