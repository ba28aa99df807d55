// bench/attention.cu - forward and backward TFLOP/s of attention.cu's kernels.
//
//   build/bench_attention [--seqs 8K,16K,64K,128K] [--reps N] [--json FILE]
//
// Shapes: Llama 3.2 3B (24 query / 8 KV heads) and Llama 3.1 8B (32 / 8), head dim 128, bf16,
// causal, one sequence. FLOPs as REFERENCE.md counts them: forward 4 S^2 d H / 2, backward 2.5x.
// Times are CUDA-event medians of `reps` runs after two warm-up runs, on random inputs.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../llama.h"
#include "../train.h"

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char** argv) {
    std::vector<int64_t> seqs = {8192, 16384, 65536, 131072};
    int reps = 10;
    std::string json;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (a == "--seqs" && i + 1 < argc) {
            seqs.clear();
            std::string list = argv[++i];
            size_t pos = 0;
            while (pos <= list.size()) {
                size_t comma = list.find(',', pos);
                if (comma == std::string::npos) comma = list.size();
                seqs.push_back(parse_tokens("--seqs", list.substr(pos, comma - pos)));
                pos = comma + 1;
            }
        } else if (a == "--reps" && i + 1 < argc) {
            reps = std::max(1, atoi(argv[++i]));
        } else if (a == "--json" && i + 1 < argc) {
            json = argv[++i];
        } else {
            fprintf(stderr, "usage: bench_attention [--seqs 8K,16K,...] [--reps N] [--json FILE]\n");
            return 2;
        }
    }
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        fprintf(stderr, "bench_attention: no CUDA GPU\n");
        return 1;
    }
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    FILE* jf = json.empty() ? nullptr : fopen(json.c_str(), "w");
    printf("attention.cu on %s, bf16, causal, head dim 128, median of %d\n", prop.name, reps);
    printf("%-12s %9s %10s %10s %10s %10s\n", "shape", "seq", "fwd ms", "fwd TF/s", "bwd ms", "bwd TF/s");
    struct Shape { const char* name; int hq, hkv; };
    for (Shape shp : {Shape{"3B 24/8", 24, 8}, Shape{"8B 32/8", 32, 8}})
        for (int64_t S : seqs) {
            const int d = 128;
            const int64_t qd = (int64_t)shp.hq * d, kd = (int64_t)shp.hkv * d, ld = qd + 2 * kd;
            bf16 *qkv, *out, *dout, *dqkv;
            float *lse, *delta;
            CUDA_CHECK(cudaMalloc(&qkv, S * ld * 2));
            CUDA_CHECK(cudaMalloc(&dqkv, S * ld * 2));
            CUDA_CHECK(cudaMalloc(&out, S * qd * 2));
            CUDA_CHECK(cudaMalloc(&dout, S * qd * 2));
            CUDA_CHECK(cudaMalloc(&lse, S * shp.hq * 4));
            CUDA_CHECK(cudaMalloc(&delta, S * shp.hq * 4));
            float* scratch;  // random N(0, 1) inputs, drawn in fp32 and rounded to bf16
            CUDA_CHECK(cudaMalloc(&scratch, S * ld * 4));
            init_normal(scratch, S * ld, 1.0f, 1, 0);
            convert_f32_to_bf16(qkv, scratch, S * ld, 0);
            init_normal(scratch, S * qd, 1.0f, 2, 0);
            convert_f32_to_bf16(dout, scratch, S * qd, 0);
            CUDA_CHECK(cudaFree(scratch));
            AttentionShape sh{1, S, shp.hq, shp.hkv, d};
            AttentionForwardArgs fa{qkv, qkv + qd, qkv + qd + kd, ld, ld, ld, out, qd, lse};
            AttentionBackwardArgs ba{qkv, qkv + qd, qkv + qd + kd, out, dout, ld, ld, ld, qd, qd,
                                     lse, dqkv, dqkv + qd, dqkv + qd + kd, ld, ld, ld, delta};
            cudaEvent_t e0, e1;
            CUDA_CHECK(cudaEventCreate(&e0));
            CUDA_CHECK(cudaEventCreate(&e1));
            std::vector<float> tf, tb;
            for (int r = 0; r < reps + 2; r++) {
                float ms;
                CUDA_CHECK(cudaEventRecord(e0));
                attention_forward(fa, sh, 0);
                CUDA_CHECK(cudaEventRecord(e1));
                CUDA_CHECK(cudaEventSynchronize(e1));
                CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
                if (r >= 2) tf.push_back(ms);
                CUDA_CHECK(cudaEventRecord(e0));
                attention_backward(ba, sh, 0);
                CUDA_CHECK(cudaEventRecord(e1));
                CUDA_CHECK(cudaEventSynchronize(e1));
                CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
                if (r >= 2) tb.push_back(ms);
            }
            double flops = attention_forward_flops(sh);
            float mf = median(tf), mb = median(tb);
            double tff = flops / (mf * 1e-3) / 1e12, tfb = 2.5 * flops / (mb * 1e-3) / 1e12;
            printf("%-12s %9lld %10.3f %10.1f %10.3f %10.1f\n", shp.name, (long long)S, mf, tff, mb, tfb);
            if (jf)
                fprintf(jf, "{\"shape\": \"%s\", \"seq\": %lld, \"fwd_ms\": %.4f, \"fwd_tflops\": %.2f, "
                            "\"bwd_ms\": %.4f, \"bwd_tflops\": %.2f, \"gpu\": \"%s\"}\n",
                        shp.name, (long long)S, mf, tff, mb, tfb, prop.name);
            fflush(stdout);
            cudaFree(qkv), cudaFree(dqkv), cudaFree(out), cudaFree(dout), cudaFree(lse), cudaFree(delta);
            cudaEventDestroy(e0), cudaEventDestroy(e1);
        }
    if (jf) fclose(jf);
    return 0;
}
