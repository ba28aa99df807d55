// bench/attention.cu - forward and backward TFLOP/s of the attention kernels the model uses
// (kernels/attention_hopper.cu on Hopper, head dim 128), each shape first checked against
// kernels/attention.cu's reference kernels on the same inputs.
//
//   build/bench_attention [--seqs 8K,16K,64K,128K,1M] [--reps N] [--warmup N]
//                         [--shapes 3B,8B,3B-U8,8B-U8,untied] [--reference] [--no-check]
//                         [--separate] [--input-std Q,K,V,DO] [--json FILE]
//
// Shapes: Llama 3.2 3B (24 query / 8 KV heads) and Llama 3.1 8B (32 / 8), and (3B-U8, 8B-U8,
// untied; not by default) their heads on one of eight Ulysses ranks (3 / 1 and 4 / 1), and one
// call of Untied Ulysses at --untied=1 on such a rank (1 / 1: what --stage 6 runs), head dim 128, bf16,
// causal, one sequence. FLOPs as docs/reference.md counts them: forward 4 S^2 d H / 2, backward 2.5x
// (the backward's time includes its delta = rowsum(dO * O) kernel; the fused backward's also
// clearing and converting its fp32 dQ workspace). Times are CUDA-event medians of `reps` runs
// after `warmup` (2) warm-up runs, on random normal inputs (N(0, 1) unless --input-std), forward
// and backward alternating as in training (bench/attention_vs_torch.py times PyTorch the same way).
//   check        out, lse, dq, dk, dv of the fast kernels against the reference kernels' (relative
//                L2 error over the whole tensors, computed on the device); a mismatch fails the run
//   --reference  also time the reference kernels
//   --no-check   skip the check (the reference backward takes minutes at 1M tokens)
//   --separate   time all the forwards, then all the backwards (each after its own warm-up)
//   --input-std Q,K,V,DO  the inputs' standard deviations (default 1,1,1,1): the GPU's power, and so
//                its clock under the power limit, depends on the values it multiplies
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../llama.h"
#include "../infra/train.h"

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// sum (a - b)^2 and sum b^2 over a [rows][cols] block of two strided bf16 or fp32 matrices.
template <typename T>
__global__ void diff_kernel(const T* a, const T* b, int64_t rows, int64_t cols, int64_t ld, double* sums) {
    double num = 0, den = 0;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < rows * cols; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t off = (i / cols) * ld + i % cols;
        const double x = (double)(float)a[off], y = (double)(float)b[off];
        num += (x - y) * (x - y), den += y * y;
        if (!(x == x)) num += INFINITY;  // NaN: poisoned output never written
    }
    for (int o = 16; o > 0; o >>= 1) num += __shfl_xor_sync(0xffffffffu, num, o), den += __shfl_xor_sync(0xffffffffu, den, o);
    if (threadIdx.x % 32 == 0) atomicAdd(&sums[0], num), atomicAdd(&sums[1], den);
}
template <typename T>
static double rel_error(const T* a, const T* b, int64_t rows, int64_t cols, int64_t ld) {
    double* d;
    CUDA_CHECK(cudaMalloc(&d, 16));
    CUDA_CHECK(cudaMemset(d, 0, 16));
    diff_kernel<T><<<1024, 256>>>(a, b, rows, cols, ld, d);
    CUDA_CHECK_LAUNCH();
    double h[2];
    CUDA_CHECK(cudaMemcpy(h, d, 16, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaFree(d));
    return std::sqrt(h[0] / (h[1] > 0 ? h[1] : 1));
}

// Scales the columns of a [rows][ld] fp32 matrix: [0, c1) by s0, [c1, c2) by s1, the rest by s2.
__global__ void scale_columns_kernel(float* x, int64_t n, int64_t ld, int64_t c1, int64_t c2, float s0, float s1, float s2) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t c = i % ld;
        x[i] *= c < c1 ? s0 : c < c2 ? s1 : s2;
    }
}

struct Timing { float fwd_ms, bwd_ms; };

static Timing time_kernels(const AttentionForwardArgs& fa, const AttentionBackwardArgs& ba, const AttentionShape& sh,
                           int reps, int warmup, bool separate) {
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    auto time_one = [&](auto run) {  // one call, timed by events around it
        float ms;
        CUDA_CHECK(cudaEventRecord(e0));
        run();
        CUDA_CHECK(cudaEventRecord(e1));
        CUDA_CHECK(cudaEventSynchronize(e1));
        CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        return ms;
    };
    std::vector<float> tf, tb;
    auto forward = [&] { attention_forward(fa, sh, 0); };
    auto backward = [&] { attention_backward(ba, sh, 0); };
    // `reps` timings of each, after `warmup` untimed rounds: forward and backward alternating,
    // as in training, or (separate) all the forwards, then all the backwards.
    auto rounds = [&](bool time_f, bool time_b) {
        for (int r = 0; r < reps + warmup; r++) {
            const float f = time_f ? time_one(forward) : 0.f, b = time_b ? time_one(backward) : 0.f;
            if (r < warmup) continue;
            if (time_f) tf.push_back(f);
            if (time_b) tb.push_back(b);
        }
    };
    if (separate)
        rounds(true, false), rounds(false, true);
    else
        rounds(true, true);
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    return {median(tf), median(tb)};
}

struct Shape {
    const char *key, *name;
    int hq, hkv;
};
static const Shape KNOWN_SHAPES[] = {{"3B", "3B 24/8", 24, 8}, {"8B", "8B 32/8", 32, 8}, {"3B-U8", "3B-U8 3/1", 3, 1},
                                     {"8B-U8", "8B-U8 4/1", 4, 1}, {"untied", "untied 1/1", 1, 1}};

struct BenchOptions {
    std::vector<int64_t> seqs = {8192, 16384, 65536, 131072};
    int reps = 10, warmup = 2;
    std::vector<Shape> shapes = {KNOWN_SHAPES[0], KNOWN_SHAPES[1]};
    bool time_reference = false, check = true, separate = false;
    float input_std[4] = {1, 1, 1, 1};  // q, k, v, dO
    std::vector<int64_t> docs;          // --docs: packed documents of these lengths, repeating
    std::string json;
};

static const char* USAGE =
    "usage: bench_attention [--seqs 8K,16K,...] [--reps N] [--warmup N] [--shapes 3B,8B,3B-U8,8B-U8,untied] "
    "[--reference] [--no-check] [--separate] [--input-std Q,K,V,DO] [--docs 4K,16K,...] [--json FILE]";

static std::vector<Shape> parse_shapes(const std::string& list) {
    std::vector<Shape> shapes;
    for (const std::string& key : split_commas(list)) {
        const Shape* found = nullptr;
        for (const Shape& k : KNOWN_SHAPES)
            if (key == k.key) found = &k;
        if (!found) usage_error("--shapes takes a list of 3B, 8B, 3B-U8, 8B-U8, untied, got '" + key + "'");
        shapes.push_back(*found);
    }
    return shapes;
}

static BenchOptions parse_bench_options(int argc, char** argv) {
    BenchOptions o;
    for (int i = 1; i < argc; i++) {
        const std::string a = argv[i];
        const bool value = i + 1 < argc;
        if (a == "--seqs" && value) {
            o.seqs.clear();
            for (const std::string& s : split_commas(argv[++i])) o.seqs.push_back(parse_tokens("--seqs", s));
        } else if (a == "--reps" && value) {
            o.reps = std::max(1, atoi(argv[++i]));
        } else if (a == "--shapes" && value) {
            o.shapes = parse_shapes(argv[++i]);
        } else if (a == "--warmup" && value) {
            o.warmup = std::max(0, atoi(argv[++i]));
        } else if (a == "--json" && value) {
            o.json = argv[++i];
        } else if (a == "--docs" && value) {
            for (const std::string& s : split_commas(argv[++i])) o.docs.push_back(parse_tokens("--docs", s));
        } else if (a == "--reference") {
            o.time_reference = true;
        } else if (a == "--no-check") {
            o.check = false;
        } else if (a == "--separate") {
            o.separate = true;
        } else if (a == "--input-std" && value) {
            const std::vector<std::string> v = split_commas(argv[++i]);
            bool ok = v.size() == 4;
            for (int j = 0; ok && j < 4; j++) ok = (o.input_std[j] = strtof(v[j].c_str(), nullptr)) > 0;
            if (!ok) usage_error("--input-std takes four positive numbers Q,K,V,DO, got '" + std::string(argv[i]) + "'");
        } else {
            usage_error(USAGE);
        }
    }
    return o;
}

// One shape's inputs and outputs: q|k|v as one [S, Hq d + 2 Hkv d] buffer (the model's fused
// projection), out and d out [S, Hq d], d q|k|v, lse, delta; random normal inputs drawn in fp32 and
// rounded to bf16, each part scaled by its --input-std.
// With --docs, the sequence is documents of those lengths, repeating (the last cut off), and the
// FLOPs count the pairs they allow (n^2 / 2 for a document of n tokens, as causal's S^2 / 2).
struct Buffers {
    AttentionShape sh;
    int64_t qd, kd, ld;
    bf16 *qkv = nullptr, *out = nullptr, *dout = nullptr, *dqkv = nullptr;
    float *lse = nullptr, *delta = nullptr;
    int64_t* doc_starts = nullptr;
    int64_t n_docs = 0;
    double pair_share = 1.0;  // of causal's pairs, those the documents allow
    Buffers(const Shape& shape, int64_t S, const float input_std[4], const std::vector<int64_t>& docs) {
        const int d = 128;
        sh = {1, S, shape.hq, shape.hkv, d};
        qd = (int64_t)shape.hq * d, kd = (int64_t)shape.hkv * d, ld = qd + 2 * kd;
        CUDA_CHECK(cudaMalloc(&qkv, S * ld * 2));
        CUDA_CHECK(cudaMalloc(&dqkv, S * ld * 2));
        CUDA_CHECK(cudaMalloc(&out, S * qd * 2));
        CUDA_CHECK(cudaMalloc(&dout, S * qd * 2));
        CUDA_CHECK(cudaMalloc(&lse, S * shape.hq * 4));
        CUDA_CHECK(cudaMalloc(&delta, S * shape.hq * 4));
        float* scratch;
        CUDA_CHECK(cudaMalloc(&scratch, S * ld * 4));
        init_normal(scratch, S * ld, 1.0f, 1, 0);
        scale_columns_kernel<<<1024, 256>>>(scratch, S * ld, ld, qd, qd + kd, input_std[0], input_std[1], input_std[2]);
        CUDA_CHECK_LAUNCH();
        convert_f32_to_bf16(qkv, scratch, S * ld, 0);
        init_normal(scratch, S * qd, input_std[3], 2, 0);
        convert_f32_to_bf16(dout, scratch, S * qd, 0);
        CUDA_CHECK(cudaFree(scratch));
        if (docs.empty()) return;
        std::vector<int64_t> starts;
        double pairs = 0;
        for (int64_t at = 0, k = 0; at < S; k++) {
            const int64_t n = std::min(docs[k % docs.size()], S - at);
            starts.push_back(at), pairs += (double)n * n / 2, at += n;
        }
        pair_share = pairs / ((double)S * S / 2), n_docs = (int64_t)starts.size();
        CUDA_CHECK(cudaMalloc(&doc_starts, n_docs * 8));
        CUDA_CHECK(cudaMemcpy(doc_starts, starts.data(), n_docs * 8, cudaMemcpyHostToDevice));
    }
    ~Buffers() {
        cudaFree(qkv), cudaFree(dqkv), cudaFree(out), cudaFree(dout), cudaFree(lse), cudaFree(delta), cudaFree(doc_starts);
    }
    Buffers(const Buffers&) = delete;
    Buffers& operator=(const Buffers&) = delete;
    AttentionForwardArgs forward() const {
        return {.q = qkv, .k = qkv + qd, .v = qkv + qd + kd, .ldq = ld, .ldk = ld, .ldv = ld, .out = out, .ldo = qd,
                .lse = lse, .docs = {doc_starts, n_docs}};
    }
    AttentionBackwardArgs backward() const {
        return {.q = qkv, .k = qkv + qd, .v = qkv + qd + kd, .out = out, .dout = dout, .ldq = ld, .ldk = ld, .ldv = ld,
                .ldo = qd, .lddo = qd, .lse = lse, .dq = dqkv, .dk = dqkv + qd, .dv = dqkv + qd + kd, .lddq = ld,
                .lddk = ld, .lddv = ld, .delta = delta, .docs = {doc_starts, n_docs}};
    }
};

// The reference kernels' out, lse, d q|k|v on the same inputs, in buffers of their own.
struct Reference {
    bf16 *out = nullptr, *dqkv = nullptr;
    float* lse = nullptr;
    explicit Reference(const Buffers& b) {
        const int64_t S = b.sh.seq;
        CUDA_CHECK(cudaMalloc(&out, S * b.qd * 2));
        CUDA_CHECK(cudaMalloc(&dqkv, S * b.ld * 2));
        CUDA_CHECK(cudaMalloc(&lse, S * b.sh.n_heads * 4));
        AttentionForwardArgs fr = b.forward();
        fr.out = out, fr.lse = lse;
        AttentionBackwardArgs br = b.backward();
        br.out = out, br.lse = lse, br.dq = dqkv, br.dk = dqkv + b.qd, br.dv = dqkv + b.qd + b.kd;
        attention_forward_reference(fr, b.sh, 0);
        attention_backward_reference(br, b.sh, 0);
    }
    ~Reference() { cudaFree(out), cudaFree(dqkv), cudaFree(lse); }
    Reference(const Reference&) = delete;
    Reference& operator=(const Reference&) = delete;
};

// The kernels under test into poisoned buffers, against the reference: relative L2 errors of out,
// lse, dq, dk, dv (err[5]); whether each is within its bound.
static bool check_kernels(const Buffers& b, const AttentionBackwardArgs& ba, const Reference& ref, double err[5]) {
    const int64_t S = b.sh.seq, qd = b.qd, kd = b.kd, ld = b.ld;
    CUDA_CHECK(cudaMemset(b.out, 0xff, S * qd * 2));
    CUDA_CHECK(cudaMemset(b.dqkv, 0xff, S * ld * 2));
    CUDA_CHECK(cudaMemset(b.lse, 0xff, S * b.sh.n_heads * 4));
    if (ba.dq_accum) CUDA_CHECK(cudaMemset(ba.dq_accum, 0xff, attention_dq_accum_floats(b.sh) * 4));
    attention_forward(b.forward(), b.sh, 0);
    attention_backward(ba, b.sh, 0);
    err[0] = rel_error(b.out, ref.out, S, qd, qd);
    err[1] = rel_error(b.lse, ref.lse, 1, S * b.sh.n_heads, 0);
    err[2] = rel_error(b.dqkv, ref.dqkv, S, qd, ld);
    err[3] = rel_error(b.dqkv + qd, ref.dqkv + qd, S, kd, ld);
    err[4] = rel_error(b.dqkv + qd + kd, ref.dqkv + qd + kd, S, kd, ld);
    return err[0] < 1e-2 && err[1] < 1e-5 && err[2] < 1e-2 && err[3] < 1e-2 && err[4] < 1e-2;
}

// One line of the table, and of the --json file.
static void report(const BenchOptions& o, FILE* jf, const char* gpu, const char* which, const Shape& shape,
                   const Buffers& b, Timing tm, const std::string& note, const double* err) {
    const AttentionShape& sh = b.sh;
    const double flops = attention_forward_flops(sh) * b.pair_share;
    const double tff = flops / (tm.fwd_ms * 1e-3) / 1e12, tfb = 2.5 * flops / (tm.bwd_ms * 1e-3) / 1e12;
    printf("%-10s %-9s %8lld %9.3f %9.1f %9.3f %9.1f  %s\n", which, shape.name, (long long)sh.seq, tm.fwd_ms, tff,
           tm.bwd_ms, tfb, note.c_str());
    if (jf)
        fprintf(jf,
                "{\"kernels\": \"%s\", \"shape\": \"%s\", \"seq\": %lld, \"fwd_ms\": %.4f, \"fwd_tflops\": %.2f, "
                "\"bwd_ms\": %.4f, \"bwd_tflops\": %.2f, \"timing\": \"%s\", \"checked\": %s, "
                "\"rel_err\": [%.3e, %.3e, %.3e, %.3e, %.3e], \"documents\": %lld, \"pair_share\": %.6f, "
                "\"gpu\": \"%s\"}\n",
                which, shape.name, (long long)sh.seq, tm.fwd_ms, tff, tm.bwd_ms, tfb,
                o.separate ? "separate" : "alternating", err ? "true" : "false", err ? err[0] : 0, err ? err[1] : 0,
                err ? err[2] : 0, err ? err[3] : 0, err ? err[4] : 0, (long long)b.n_docs, b.pair_share, gpu);
    fflush(stdout);
}

// One shape at one length: the kernels the model uses, checked and timed. The fast kernels run
// twice, with the deterministic backward and with the fused one (dQ added in fp32 inside the
// dK/dV kernel; --attention fused); the reference kernels run once (--reference: timed too).
// Returns how many variants differ from the reference.
static int bench_shape(const BenchOptions& o, FILE* jf, const char* gpu, const Shape& shape, int64_t S) {
    const Buffers b(shape, S, o.input_std, o.docs);
    const bool fast = attention_uses_hopper(b.sh);
    float* dq_accum = nullptr;
    if (fast) CUDA_CHECK(cudaMalloc(&dq_accum, attention_dq_accum_floats(b.sh) * 4));
    std::unique_ptr<Reference> ref(o.check ? new Reference(b) : nullptr);
    int failed = 0;
    for (int variant = 0; variant < (fast ? 2 : 1); variant++) {
        AttentionBackwardArgs ba = b.backward();
        ba.dq_accum = variant == 1 ? dq_accum : nullptr;
        std::string verdict = "not checked";
        double err[5] = {0, 0, 0, 0, 0};
        if (ref) {
            const bool ok = check_kernels(b, ba, *ref, err);
            failed += !ok;
            char buf[160];
            snprintf(buf, sizeof buf, "out %.1e lse %.1e dq %.1e dk %.1e dv %.1e %s", err[0], err[1], err[2], err[3],
                     err[4], ok ? "ok" : "MISMATCH");
            verdict = buf;
        }
        const Timing tm = time_kernels(b.forward(), ba, b.sh, o.reps, o.warmup, o.separate);
        report(o, jf, gpu, variant == 1 ? "fused" : fast ? "hopper" : "reference", shape, b, tm, verdict,
               ref ? err : nullptr);
    }
    if (o.time_reference && fast) {
        attention_use_reference(true);
        report(o, jf, gpu, "reference", shape, b, time_kernels(b.forward(), b.backward(), b.sh, o.reps, o.warmup, o.separate),
               "", nullptr);
        attention_use_reference(false);
    }
    cudaFree(dq_accum);
    return failed;
}

static int bench_main(int argc, char** argv) {
    const BenchOptions o = parse_bench_options(argc, argv);
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) runtime_error("no CUDA GPU");
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    FILE* jf = o.json.empty() ? nullptr : open_output(o.json, "--json");
    printf("attention on %s, bf16, causal, head dim 128, median of %d%s\n", prop.name, o.reps,
           o.docs.empty() ? "" : "; packed documents: TFLOP/s over the pairs they allow");
    printf("%-10s %-9s %8s %9s %9s %9s %9s  %s\n", "kernels", "shape", "seq", "fwd ms", "fwd TF/s", "bwd ms", "bwd TF/s",
           "check against the reference (relative L2 error)");
    int failed = 0;
    for (const Shape& shape : o.shapes)
        for (int64_t S : o.seqs) failed += bench_shape(o, jf, prop.name, shape, S);
    if (jf) fclose(jf);
    if (failed) fprintf(stderr, "bench_attention: %d shape(s) differ from the reference kernels\n", failed);
    return failed ? 1 : 0;
}

// Bad arguments and CUDA failures end with their message and exit code (2 usage, 1 runtime).
int main(int argc, char** argv) { return exit_code_of("bench_attention", [&] { return bench_main(argc, argv); }); }
