// tests/test_model.cu - the whole training step on the GPU against the float64 reference model
// (loss and every parameter's gradient), determinism of the step, and learning: the tiny model
// must solve the long-range copy task.
#include <cmath>
#include <cstdio>
#include <set>

#include "../infra/train.h"
#include "gpu_util.h"
#include "reference.h"

namespace {

// A model on the device with the plan allocated, as train.cpp sets it up.
struct GpuModel {
    Model m;
    DeviceMemory dm;
    GpuModel(const LlamaConfig& cfg, int batch, int64_t seq, int vocab_pieces = 1, int64_t max_docs = 0) {
        m.cfg = cfg;
        m.opt.vocab_pieces = vocab_pieces;
        m.opt.doc_mask = max_docs > 0, m.opt.max_docs = max_docs;
        m.shape.batch = batch;
        m.shape.seq = seq;
        allocate_on_whole_gpu(m, dm);
    }
    ~GpuModel() { model_free(m, dm); }
    // Random parameters: matrices N(0, std), norm gains 1 + N(0, 0.1). bf16-exact, so the
    // reference sees the device's compute weights.
    std::vector<double> set_random_params(std::mt19937_64& rng, double std) {
        std::vector<double> p(m.layout.total, 0.0);
        for (const auto& t : m.layout.tensors) {
            auto v = random_normal(t.numel(), rng, t.rows == 1 ? 0.1 : std);
            for (int64_t i = 0; i < t.numel(); i++) p[t.offset + i] = bf16_round((t.rows == 1 ? 1.0 : 0.0) + v[i]);
        }
        upload(m.states.master, p);
        return p;
    }
    double loss() {
        float sum = download(m.scalars, 1)[0];
        return sum / m.batch.n_valid_targets;
    }
};

void random_batch(std::mt19937_64& rng, int V, int64_t T, std::vector<int32_t>& tok, std::vector<int32_t>& tgt) {
    tok.resize(T), tgt.resize(T);
    for (int64_t t = 0; t < T; t++) {
        tok[t] = (int32_t)(rng() % V);
        tgt[t] = (rng() % 7 == 0) ? -1 : (int32_t)(rng() % V);
    }
}

// Packed documents of B sequences of S tokens, fresh each run: starts at 0, 1 (a one-token
// document), 64 and a random few; the first document of each sequence cut by its window (its
// first position far in). The device's view (starts and first positions) and the reference's (each
// token's first key and position), each built on its own.
struct TestDocuments {
    StepDocuments step;
    ref::Documents ref;
};
TestDocuments random_documents(std::mt19937_64& rng, int B, int64_t S) {
    TestDocuments d;
    for (int b = 0; b < B; b++) {
        std::set<int64_t> st = {0, 1, 64 % S};
        for (int k = 0; k < 2; k++) st.insert((int64_t)(rng() % (uint64_t)S));
        const int64_t cut = (int64_t)(rng() % 5000);
        for (int64_t x : st) d.step.start.push_back(b * S + x), d.step.first_position.push_back(x == 0 ? cut : 0);
        for (int64_t t = 0, first = 0; t < S; t++) {
            if (st.count(t)) first = t;
            d.ref.first_key.push_back(first);
            d.ref.position.push_back(first == 0 ? cut + t : t - first);
        }
    }
    return d;
}

// Tolerance of the whole step. Each kernel stays within TOL_BF16 of float64 on its own (see
// test_kernels, test_attention); the step chains about twenty bf16 roundings of activations and
// activation gradients (x, xn, qkv, P, att, h13, act, logits, dlogits, dres, ...), each about 0.2%
// RMS, so the gradients land near 1% (measured on an H200: 0.7% to 1.2%). A real defect shows far
// above that (a wrong RoPE table gave 50%).
constexpr double TOL_STEP = 2e-2;

class WholeStep : public ::testing::TestWithParam<std::string> {};

TEST_P(WholeStep, LossAndEveryGradientMatchReference) {
    REQUIRE_GPU();
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(GetParam() + " seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    // "+pieces": the embedding and LM head in three units of vocabulary rows (beyond/savings.cu lm_head_in_pieces).
    std::string param = GetParam();
    const bool docs = param.size() > 5 && param.substr(param.size() - 5) == "+docs";
    if (docs) param = param.substr(0, param.size() - 5);
    const bool pieces = param.size() > 7 && param.substr(param.size() - 7) == "+pieces";
    LlamaConfig cfg = config_by_name(pieces ? param.substr(0, param.size() - 7) : param);
    const int vocab_pieces = pieces ? 3 : 1;
    printf("  attention kernels: %s, %d vocabulary pieces\n",
           attention_uses_hopper({1, 64, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim}) ? "the fast kernels" : "the reference kernels",
           param_layout(cfg, vocab_pieces).vocab_pieces());
    const int B = 2;
    const int64_t S = 67;  // two attention tiles, the second ragged
    GpuModel g(cfg, B, S, vocab_pieces, docs ? 16 : 0);
    auto params = g.set_random_params(rng, 0.08);
    std::vector<int32_t> tok, tgt;
    random_batch(rng, cfg.vocab, B * S, tok, tgt);
    const TestDocuments d = docs ? random_documents(rng, B, S) : TestDocuments{};
    model_set_batch(g.m, tok.data(), tgt.data(), 0, -1, docs ? &d.step : nullptr);
    poison(g.m.states.grad, g.m.layout.total);  // the step must zero what it accumulates into
    model_forward_backward(g.m, 0);
    double loss = g.loss();
    auto grads = download(g.m.states.grad, g.m.layout.total);

    std::vector<double> ref_grads(g.m.layout.total);
    double ref_loss = ref::model_forward_backward(cfg, params.data(), tok.data(), tgt.data(), B, S, ref_grads.data(),
                                                  nullptr, docs ? &d.ref : nullptr);
    printf("  loss %.6f, reference %.6f\n", loss, ref_loss);
    EXPECT_LT(std::fabs(loss - ref_loss) / ref_loss, TOL_BF16) << "loss " << loss << " vs " << ref_loss;
    for (const auto& t : g.m.layout.tensors) {
        std::vector<double> a(grads.begin() + t.offset, grads.begin() + t.offset + t.numel());
        std::vector<double> b(ref_grads.begin() + t.offset, ref_grads.begin() + t.offset + t.numel());
        double err = rel_error(a, b);
        printf("  %-10s layer %2d  rel error %.2e\n", param_kind_name(t.kind), t.layer, err);
        EXPECT_LT(err, TOL_STEP) << param_kind_name(t.kind) << " layer " << t.layer;
    }
}

// tiny-hd128: head dim 128, so on Hopper the step runs kernels/attention_hopper.cu's kernels.
// tiny-qwen3: the Qwen3 family (per-head norms of q and k; q_dim 512 against a hidden size of 128).
INSTANTIATE_TEST_SUITE_P(Configs, WholeStep,
                         ::testing::Values("tiny", "tiny-untied", "tiny-hd128", "tiny+pieces", "tiny-untied+pieces",
                                           "tiny+docs", "tiny-hd128+docs", "tiny-qwen3", "tiny-qwen3+docs"),
                         [](const auto& info) {
                             std::string p = info.param;
                             std::string name = p.find("qwen3") != std::string::npos ? "qwen3"
                                                : p.find("hd128") != std::string::npos ? "hd128"
                                                : p.find("untied") != std::string::npos ? "untied" : "tied";
                             if (p.find("+pieces") != std::string::npos) name += "_pieces";
                             return p.find("+docs") != std::string::npos ? name + "_documents" : name;
                         });

// Same seed, same data: the same losses and weights, bit for bit (no atomics anywhere).
TEST(Determinism, SameSeedSameLossesAndWeights) {
    REQUIRE_GPU();
    LlamaConfig cfg = config_by_name("tiny");
    std::vector<std::vector<double>> losses(2), weights(2);
    for (int run = 0; run < 2; run++) {
        GpuModel g(cfg, 2, 100);
        model_init_weights(g.m, 42, 0);
        SyntheticData data("copy", 64, 7);
        std::vector<int32_t> tok(200), tgt(200);
        for (int step = 0; step < 3; step++) {
            data.next(tok.data(), tgt.data(), 2, 100);
            model_set_batch(g.m, tok.data(), tgt.data(), 0);
            model_forward_backward(g.m, 0);
            AdamW opt;
            opt.lr = 1e-3f;
            opt.step = step + 1;
            model_optimizer_step(g.m, opt, 1.0f, 0);
            losses[run].push_back(g.loss());
        }
        weights[run] = download(g.m.states.master, g.m.layout.total);
    }
    EXPECT_EQ(losses[0], losses[1]);
    EXPECT_TRUE(weights[0] == weights[1]);
}

// The tiny model must learn the copy task: the second half of each sequence repeats the first,
// so a target there is predictable only by attending half a sequence back. Guessing gives
// ln(64) = 4.16; the test requires well under a third of that.
TEST(Learning, TinyModelLearnsLongRangeCopy) {
    REQUIRE_GPU();
    LlamaConfig cfg = config_by_name("tiny");
    const int B = 16, vocab = 64;
    const int64_t S = 128;
    Options o;
    o.steps = 800;
    o.lr = 3e-3;
    o.warmup = 40;
    GpuModel g(cfg, B, S);
    model_init_weights(g.m, 1, 0);
    SyntheticData data("copy", vocab, 99);
    std::vector<int32_t> tok(B * S), tgt(B * S);
    const double guess = std::log((double)vocab);
    double recent = guess;
    int step = 0;
    for (; step < o.steps; step++) {
        data.next(tok.data(), tgt.data(), B, S);
        model_set_batch(g.m, tok.data(), tgt.data(), 0);
        model_forward_backward(g.m, 0);
        AdamW opt;
        opt.lr = (float)lr_at(o, step);
        opt.step = step + 1;
        model_optimizer_step(g.m, opt, 1.0f, 0);
        double loss = g.loss();
        ASSERT_TRUE(std::isfinite(loss)) << "step " << step;
        recent = 0.9 * recent + 0.1 * loss;
        if (step % 100 == 0) printf("  step %d loss %.4f\n", step, loss);
        if (step > 50 && recent < 0.1 * guess) break;
    }
    printf("  stopped at step %d with smoothed loss %.4f (guess %.4f)\n", step, recent, guess);
    EXPECT_LT(recent, guess / 3);
}

}  // namespace
