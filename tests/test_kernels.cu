// tests/test_kernels.cu - every kernel of llama.cu against the float64 reference, forward and
// backward, on fresh random inputs of odd sizes, with poisoned outputs.
#include <algorithm>
#include <cmath>
#include <memory>

#include "gpu_util.h"
#include "reference.h"

namespace {

struct Seeded : ::testing::Test {
    uint64_t seed = fresh_seed();
    std::mt19937_64 rng{seed};
    void SetUp() override {
        REQUIRE_GPU();
        RecordProperty("seed", std::to_string(seed));
    }
};

#define TRACE_SEED() SCOPED_TRACE("seed " + std::to_string(seed))

// ---------------------------------------------------------------------------------------------
using RmsNorm = Seeded;

TEST_F(RmsNorm, ForwardMatchesReference) {
    TRACE_SEED();
    const int64_t T = 37;
    const int D = 200;
    auto x = rounded_bf16(random_normal(T * D, rng, 2.0));
    auto w = rounded_bf16(random_normal(D, rng));
    std::vector<double> y_ref(T * D), rstd_ref(T);
    ref::rmsnorm_forward(x.data(), w.data(), y_ref.data(), rstd_ref.data(), T, D, 1e-5);

    DeviceBuffer<bf16> dx(T * D), dw(D), dy(T * D);
    DeviceBuffer<float> drstd(T);
    upload(dx, x), upload(dw, w);
    poison(dy.ptr, T * D), poison(drstd.ptr, T);
    rmsnorm_forward(dy, drstd, dx, dw, T, D, 1e-5f, 0);
    EXPECT_LT(rel_error(download(dy.ptr, T * D), y_ref), TOL_BF16);
    EXPECT_LT(rel_error(download(drstd.ptr, T), rstd_ref), TOL_FP32);
}

TEST_F(RmsNorm, BackwardMatchesReference) {
    TRACE_SEED();
    const int64_t T = 300;  // more rows than the dw partial-sum chunks, not a multiple of them
    const int D = 136;
    auto x = rounded_bf16(random_normal(T * D, rng));
    auto w = rounded_bf16(random_normal(D, rng));
    auto g = rounded_bf16(random_normal(T * D, rng));
    auto prior = rounded_bf16(random_normal(T * D, rng));  // dx accumulates onto this
    std::vector<double> y(T * D), rstd(T), dx_ref(T * D), dw_ref(D, 0.5);
    ref::rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), T, D, 1e-5);
    ref::rmsnorm_backward(g.data(), x.data(), w.data(), rstd.data(), dx_ref.data(), dw_ref.data(), T, D);

    DeviceBuffer<bf16> d_x(T * D), d_w(D), d_g(T * D), d_dx(T * D), d_y(T * D);
    DeviceBuffer<float> d_rstd(T), d_dw(D), partial(rmsnorm_partial_floats(D));
    upload(d_x, x), upload(d_w, w), upload(d_g, g);
    rmsnorm_forward(d_y, d_rstd, d_x, d_w, T, D, 1e-5f, 0);
    for (bool accumulate : {false, true}) {
        SCOPED_TRACE(accumulate ? "accumulate" : "overwrite");
        if (accumulate) upload(d_dx, prior); else poison(d_dx.ptr, T * D);
        upload(d_dw, std::vector<double>(D, 0.5));  // dw always accumulates
        rmsnorm_backward(d_dx, d_dw, d_g, d_x, d_w, d_rstd, T, D, accumulate, partial, 0);
        std::vector<double> expect = dx_ref;
        if (accumulate)
            for (int64_t i = 0; i < T * D; i++) expect[i] += prior[i];
        EXPECT_LT(rel_error(download(d_dx.ptr, T * D), expect), TOL_BF16);
        EXPECT_LT(rel_error(download(d_dw.ptr, D), dw_ref), 1e-4);  // fp32 sums; rstd is fp32
    }
}

// Qwen3's per-head norms: `heads` heads of d values from column `col` of rows ld apart, in place;
// the row's other columns stay as they were. The reference normalizes T * heads rows of d.
TEST_F(RmsNorm, PerHeadForwardAndBackwardMatchReference) {
    TRACE_SEED();
    for (int d : {64, 128}) {
        SCOPED_TRACE("head dim " + std::to_string(d));
        const int64_t T = 301, col = 8, ld = 5 * d + 16;  // 903 (row, head) pairs: not a multiple of the chunks
        const int heads = 3;
        const double eps = 1e-6;
        auto x = rounded_bf16(random_normal(T * ld, rng, 3.0));
        auto g = rounded_bf16(random_normal(T * ld, rng));
        auto w = rounded_bf16(random_normal(d, rng, 0.3));
        for (auto& v : w) v += 1.0;
        std::vector<double> xh(T * heads * d), gh(T * heads * d), y(T * heads * d), rstd(T * heads);
        std::vector<double> dx_ref(T * heads * d), dw_ref(d, 0.25);
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < heads * d; i++) xh[t * heads * d + i] = x[t * ld + col + i], gh[t * heads * d + i] = g[t * ld + col + i];
        ref::rmsnorm_forward(xh.data(), w.data(), y.data(), rstd.data(), T * heads, d, eps);
        ref::rmsnorm_backward(gh.data(), xh.data(), w.data(), rstd.data(), dx_ref.data(), dw_ref.data(), T * heads, d);
        auto heads_of = [&](const std::vector<double>& rows) {  // the heads' columns; checks the others are untouched
            std::vector<double> out(T * heads * d);
            for (int64_t t = 0; t < T; t++)
                for (int64_t i = 0; i < ld; i++) {
                    if (i >= col && i < col + heads * d) out[t * heads * d + i - col] = rows[t * ld + i];
                    else EXPECT_EQ(rows[t * ld + i], x[t * ld + i]) << "row " << t << " column " << i;
                }
            return out;
        };
        DeviceBuffer<bf16> d_x(T * ld), d_w(d), d_g(T * ld);
        DeviceBuffer<float> d_dw(d), partial(rmsnorm_partial_floats(d));
        upload(d_x, x), upload(d_w, w);
        head_rmsnorm_forward(d_x.ptr + col, ld, d_w, T, heads, d, (float)eps, 0);
        EXPECT_LT(rel_error(heads_of(download(d_x.ptr, T * ld)), y), TOL_BF16);
        std::vector<double> first_dw;
        for (int run = 0; run < 2; run++) {  // twice: the same bits
            upload(d_x, x);
            std::vector<double> g_outside = g;  // the gradient rows carry x outside the heads, to check they stay
            for (int64_t t = 0; t < T; t++)
                for (int64_t i = 0; i < ld; i++)
                    if (i < col || i >= col + heads * d) g_outside[t * ld + i] = x[t * ld + i];
            upload(d_g, g_outside);
            upload(d_dw, std::vector<double>(d, 0.25));  // dw accumulates
            head_rmsnorm_backward(d_g.ptr + col, ld, d_x.ptr + col, ld, d_w, d_dw, T, heads, d, (float)eps, partial, 0);
            EXPECT_LT(rel_error(heads_of(download(d_g.ptr, T * ld)), dx_ref), TOL_BF16);
            const std::vector<double> dw = download(d_dw.ptr, d);  // floats, exactly
            EXPECT_LT(rel_error(dw, dw_ref), 1e-4);
            if (run == 0) first_dw = dw;
            else EXPECT_TRUE(dw == first_dw) << "dw differs between two runs";
        }
    }
}

// ---------------------------------------------------------------------------------------------
using Rope = Seeded;

TEST_F(Rope, ForwardAndInverseMatchReference) {
    TRACE_SEED();
    LlamaConfig c = config_by_name("llama3.2-3b");
    const int B = 2, hd = 128, heads = 5;  // rotate 5 heads of a row that holds 7
    const int64_t S = 150, T = B * S, ld = 7 * hd;
    auto x = rounded_bf16(random_normal(T * ld, rng));
    std::vector<double> inv = rope_inv_freq(c);
    DeviceBuffer<double> d_inv(hd / 2);
    CUDA_CHECK(cudaMemcpy(d_inv.ptr, inv.data(), inv.size() * sizeof(double), cudaMemcpyHostToDevice));
    DeviceBuffer<bf16> d_x(T * ld);
    for (bool inverse : {false, true}) {
        SCOPED_TRACE(inverse ? "inverse" : "forward");
        upload(d_x, x);
        rope_apply(d_x, T, 0, S, 0, heads, hd, ld, d_inv, inverse, 0);
        std::vector<double> expect = x;
        ref::rope_apply(expect.data(), T, S, heads, hd, ld, ref::rope_inv_freq(c), inverse);
        auto got = download(d_x.ptr, T * ld);
        EXPECT_LT(rel_error(columns(got, T, ld, 0, heads * hd), columns(expect, T, ld, 0, heads * hd)), TOL_BF16);
        // The two heads past n_heads are untouched, bit for bit.
        EXPECT_EQ(columns(got, T, ld, heads * hd, 2 * hd), columns(x, T, ld, heads * hd, 2 * hd));
    }
}

// Packed documents: a token's position counts from its document's start (the first document of
// each sequence cut by its window: its first position is far in). Rows are one GPU's part of the
// sequences (from row0 on) as under Ulysses, or several sequences; a chunk of rows at a time.
TEST_F(Rope, DocumentPositionsMatchReference) {
    TRACE_SEED();
    LlamaConfig c = config_by_name("llama3.2-3b");
    const int hd = 128, heads = 3;
    const int64_t S = 200, ld = heads * hd;
    std::vector<double> inv = rope_inv_freq(c);
    DeviceBuffer<double> d_inv(hd / 2);
    CUDA_CHECK(cudaMemcpy(d_inv.ptr, inv.data(), inv.size() * sizeof(double), cudaMemcpyHostToDevice));
    for (int B : {1, 2}) {
        const int sp = B == 1 ? 4 : 1;  // one sequence over 4 GPUs, or two sequences on one
        const int64_t T = B * S / sp;
        std::vector<int64_t> start, first;  // flat over the B sequences
        for (int b = 0; b < B; b++)
            for (int64_t x : {(int64_t)0, (int64_t)1, (int64_t)64, 65 + (int64_t)(rng() % 100), (int64_t)199}) {
                start.push_back(b * S + x);
                first.push_back(x == 0 ? 1000 + (int64_t)(rng() % 100000) : 0);
            }
        std::sort(start.begin(), start.end());
        start.erase(std::unique(start.begin(), start.end()), start.end());
        first.resize(start.size());
        std::vector<int64_t> positions(B * S);  // the reference's view: per token
        for (int64_t t = 0, d = 0; t < B * S; t++) {
            while (d + 1 < (int64_t)start.size() && start[d + 1] <= t) d++;
            positions[t] = first[d] + t - start[d];
        }
        DeviceBuffer<int64_t> d_start(start.size()), d_first(first.size());
        CUDA_CHECK(cudaMemcpy(d_start.ptr, start.data(), start.size() * 8, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemcpy(d_first.ptr, first.data(), first.size() * 8, cudaMemcpyHostToDevice));
        const DocPositions docs{d_start.ptr, d_first.ptr, (int64_t)start.size()};
        for (int rank = 0; rank < sp; rank++) {
            SCOPED_TRACE("B " + std::to_string(B) + " rank " + std::to_string(rank));
            auto x = rounded_bf16(random_normal(T * ld, rng));
            DeviceBuffer<bf16> d_x(T * ld);
            upload(d_x, x);
            const int64_t pos0 = rank * (S / sp), C = 37;  // chunks of 37 rows
            for (int64_t t0 = 0; t0 < T; t0 += C)
                rope_apply(d_x.ptr + t0 * ld, std::min(C, T - t0), t0, S, pos0, heads, hd, ld, d_inv, false, 0, docs);
            std::vector<double> expect = x;
            std::vector<int64_t> mine(positions.begin() + (B == 1 ? pos0 : 0), positions.begin() + (B == 1 ? pos0 : 0) + T);
            ref::rope_apply(expect.data(), T, S, heads, hd, ld, ref::rope_inv_freq(c), false, mine.data());
            EXPECT_LT(rel_error(download(d_x.ptr, T * ld), expect), TOL_BF16);
        }
    }
}

// Positions in the millions: the float64 angle with range reduction keeps RoPE exact there
// (a float angle at position 5M is off by up to 0.25 rad).
TEST_F(Rope, FarPositionsStayAccurate) {
    TRACE_SEED();
    LlamaConfig c = config_by_name("llama3.1-8b");
    const int hd = 128;
    const int64_t T = 64, pos0 = 5 * 1024 * 1024 - 7;
    auto x = rounded_bf16(random_normal(T * hd, rng));
    std::vector<double> inv = ref::rope_inv_freq(c);
    DeviceBuffer<double> d_inv(hd / 2);
    std::vector<double> inv_gpu = rope_inv_freq(c);
    CUDA_CHECK(cudaMemcpy(d_inv.ptr, inv_gpu.data(), inv_gpu.size() * sizeof(double), cudaMemcpyHostToDevice));
    DeviceBuffer<bf16> d_x(T * hd);
    upload(d_x, x);
    rope_apply(d_x, T, 0, T, pos0, 1, hd, hd, d_inv, false, 0);
    std::vector<double> expect(T * hd);
    for (int64_t t = 0; t < T; t++)
        for (int i = 0; i < hd / 2; i++) {
            long double a = (long double)(pos0 + t) * inv[i];
            double cs = (double)cosl(a), sn = (double)sinl(a);
            double x1 = x[t * hd + i], x2 = x[t * hd + i + hd / 2];
            expect[t * hd + i] = x1 * cs - x2 * sn;
            expect[t * hd + i + hd / 2] = x2 * cs + x1 * sn;
        }
    EXPECT_LT(rel_error(download(d_x.ptr, T * hd), expect), TOL_BF16);
}

// ---------------------------------------------------------------------------------------------
using SwiGlu = Seeded;

TEST_F(SwiGlu, ForwardAndBackwardMatchReference) {
    TRACE_SEED();
    const int64_t T = 41;
    const int F = 88;
    auto h13 = rounded_bf16(random_normal(T * 2 * F, rng, 3.0));
    auto dact = rounded_bf16(random_normal(T * F, rng));
    std::vector<double> act_ref(T * F), dh_ref(T * 2 * F);
    ref::swiglu_forward(h13.data(), act_ref.data(), T, F);
    ref::swiglu_backward(dact.data(), h13.data(), dh_ref.data(), T, F);

    DeviceBuffer<bf16> d_h(T * 2 * F), d_act(T * F), d_dact(T * F), d_dh(T * 2 * F);
    upload(d_h, h13), upload(d_dact, dact);
    poison(d_act.ptr, T * F), poison(d_dh.ptr, T * 2 * F);
    swiglu_forward(d_act, d_h, T, F, 0);
    swiglu_backward(d_dh, d_dact, d_h, T, F, 0);
    EXPECT_LT(rel_error(download(d_act.ptr, T * F), act_ref), TOL_BF16);
    EXPECT_LT(rel_error(download(d_dh.ptr, T * 2 * F), dh_ref), TOL_BF16);
}

// ---------------------------------------------------------------------------------------------
using CrossEntropy = Seeded;

// bf16 logits [T, V] and targets (every fifth ignored), with the float64 reference's mean loss
// and gradient.
double random_loss_case(std::mt19937_64& rng, int64_t T, int V, std::vector<double>& logits,
                        std::vector<int32_t>& targets, int& valid, std::vector<double>& dref) {
    logits = rounded_bf16(random_normal(T * V, rng, 4.0));
    targets.assign(T, 0);
    valid = 0;
    for (int64_t t = 0; t < T; t++) {
        targets[t] = (t % 5 == 3) ? -1 : (int32_t)(rng() % V);
        valid += targets[t] >= 0;
    }
    dref.assign(T * V, 0.0);
    return ref::cross_entropy(logits.data(), targets.data(), dref.data(), T, V);
}

TEST_F(CrossEntropy, LossAndGradientMatchReference) {
    TRACE_SEED();
    const int64_t T = 33;
    const int V = 1000;
    std::vector<double> logits, dref;
    std::vector<int32_t> targets;
    int valid = 0;
    const double loss_ref = random_loss_case(rng, T, V, logits, targets, valid, dref);

    DeviceBuffer<bf16> d_logits(T * V);
    DeviceBuffer<float> d_losses(T), d_sum(1), scratch(sum_scratch_floats());
    DeviceBuffer<int32_t> d_targets(T);
    upload(d_logits, logits), upload(d_targets, targets);
    poison(d_losses.ptr, T);
    cross_entropy_forward_backward(d_logits, d_losses, d_targets, T, V, 1.0f / valid, 0);
    sum_floats(d_sum, d_losses, T, scratch, 0);
    double loss = download(d_sum.ptr, 1)[0] / valid;
    EXPECT_LT(std::fabs(loss - loss_ref) / loss_ref, TOL_FP32);
    EXPECT_LT(rel_error(download(d_logits.ptr, T * V), dref), TOL_BF16);
}

// The same loss and gradient from logits in three pieces of columns (the LM head in vocabulary
// pieces, beyond/savings.cu lm_head_in_pieces): running max and sum over the pieces, then the gradient of
// each piece with the final lse.
TEST_F(CrossEntropy, InPiecesMatchesReference) {
    TRACE_SEED();
    const int64_t T = 33;
    const int V = 1000;
    const int64_t cut[] = {0, 264, 640, V};  // pieces of 264, 376 and 360 columns
    std::vector<double> logits, dref;
    std::vector<int32_t> targets;
    int valid = 0;
    const double loss_ref = random_loss_case(rng, T, V, logits, targets, valid, dref);

    DeviceBuffer<float> d_losses(T), d_max(T), d_sumexp(T), d_target(T), d_sum(1), scratch(sum_scratch_floats());
    DeviceBuffer<int32_t> d_targets(T);
    upload(d_targets, targets);
    poison(d_losses.ptr, T);
    std::vector<std::unique_ptr<DeviceBuffer<bf16>>> piece;
    for (int p = 0; p < 3; p++) {  // each piece [T, its columns], as the head's GEMM writes it
        const int64_t w = cut[p + 1] - cut[p];
        std::vector<double> cols(T * w);
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < w; j++) cols[t * w + j] = logits[t * V + cut[p] + j];
        piece.emplace_back(new DeviceBuffer<bf16>(T * w));
        upload(*piece[p], cols);
        cross_entropy_piece_stats(*piece[p], T, (int)w, cut[p], d_targets, d_max, d_sumexp, d_target, p == 0, 0);
    }
    cross_entropy_piece_loss(d_losses, d_max, d_sumexp, d_target, d_targets, T, 0);
    sum_floats(d_sum, d_losses, T, scratch, 0);
    double loss = download(d_sum.ptr, 1)[0] / valid;
    EXPECT_LT(std::fabs(loss - loss_ref) / loss_ref, TOL_FP32);
    std::vector<double> grad(T * V);
    for (int p = 0; p < 3; p++) {
        const int64_t w = cut[p + 1] - cut[p];
        cross_entropy_piece_backward(*piece[p], T, (int)w, cut[p], d_max, d_targets, 1.0f / valid, 0);
        auto g = download(piece[p]->ptr, T * w);
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < w; j++) grad[t * V + cut[p] + j] = g[t * w + j];
    }
    EXPECT_LT(rel_error(grad, dref), TOL_BF16);
}

// ---------------------------------------------------------------------------------------------
using Embedding = Seeded;

TEST_F(Embedding, LookupAndDeterministicBackward) {
    TRACE_SEED();
    const int V = 50, D = 64;
    const int64_t T = 301;
    auto table = rounded_bf16(random_normal((int64_t)V * D, rng));
    auto dx = rounded_bf16(random_normal(T * D, rng));
    std::vector<int32_t> tokens(T);
    for (auto& t : tokens) t = (int32_t)(rng() % 20);  // many repeats, some ids unused
    DeviceBuffer<bf16> d_table((int64_t)V * D), d_x(T * D), d_dx(T * D);
    DeviceBuffer<int32_t> d_tok(T);
    upload(d_table, table), upload(d_tok, tokens), upload(d_dx, dx);
    poison(d_x.ptr, T * D);
    // In two pieces of rows, [0, 8) and [8, V): each fills the rows of its tokens.
    embedding_forward(d_x, d_tok, d_table, 0, 8, T, D, 0);
    embedding_forward(d_x, d_tok, d_table.ptr + 8 * D, 8, V - 8, T, D, 0);
    auto x = download(d_x.ptr, T * D);
    for (int64_t t = 0; t < T; t++)
        for (int c = 0; c < D; c++) ASSERT_EQ(x[t * D + c], table[tokens[t] * D + c]);

    EmbeddingGroups groups;
    groups.build(tokens.data(), T);
    DeviceBuffer<int32_t> g_tok(groups.token.size());
    DeviceBuffer<int64_t> g_begin(groups.begin.size()), g_pos(T);
    CUDA_CHECK(cudaMemcpy(g_tok.ptr, groups.token.data(), groups.token.size() * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(g_begin.ptr, groups.begin.data(), groups.begin.size() * 8, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(g_pos.ptr, groups.position.data(), T * 8, cudaMemcpyHostToDevice));
    std::vector<double> expect((int64_t)V * D, 0.25);
    for (int64_t t = 0; t < T; t++)
        for (int c = 0; c < D; c++) expect[tokens[t] * D + c] += dx[t * D + c];
    std::vector<double> first;
    for (int run = 0; run < 2; run++) {
        DeviceBuffer<float> d_grad((int64_t)V * D);
        upload(d_grad, std::vector<double>((int64_t)V * D, 0.25));
        // Piece [8, V) takes the groups of tokens from 8 on, piece [0, 8) the others.
        const int64_t split = std::lower_bound(groups.token.begin(), groups.token.end(), 8) - groups.token.begin();
        embedding_backward(d_grad, 0, d_dx, g_tok, g_begin, g_pos, split, D, 0);
        embedding_backward(d_grad.ptr + 8 * D, 8, d_dx, g_tok.ptr + split, g_begin.ptr + split, g_pos,
                           (int64_t)groups.token.size() - split, D, 0);
        auto got = download(d_grad.ptr, (int64_t)V * D);
        EXPECT_LT(rel_error(got, expect), TOL_FP32);
        if (run == 0) first = got;
        else EXPECT_EQ(got, first);  // bitwise: same order of additions every time
    }
}

// ---------------------------------------------------------------------------------------------
using Linear = Seeded;

TEST_F(Linear, ForwardAndBackwardMatchReference) {
    TRACE_SEED();
    const int64_t T = 37, in = 136, out = 72;
    gemm_init(0, nullptr);
    auto x = rounded_bf16(random_normal(T * in, rng));
    auto W = rounded_bf16(random_normal(out * in, rng, 0.1));
    auto res = rounded_bf16(random_normal(T * out, rng));
    auto dy = rounded_bf16(random_normal(T * out, rng));
    std::vector<double> y_ref(T * out), dx_ref(T * in), dW_ref(out * in, 1.0);
    ref::linear_forward(x.data(), W.data(), y_ref.data(), T, in, out);
    ref::linear_backward(dy.data(), x.data(), W.data(), dx_ref.data(), dW_ref.data(), T, in, out);

    DeviceBuffer<bf16> d_x(T * in), d_W(out * in), d_res(T * out), d_y(T * out), d_dy(T * out), d_dx(T * in);
    DeviceBuffer<float> d_dW(out * in);
    upload(d_x, x), upload(d_W, W), upload(d_res, res), upload(d_dy, dy);
    upload(d_dW, std::vector<double>(out * in, 1.0));  // weight gradients accumulate
    poison(d_y.ptr, T * out), poison(d_dx.ptr, T * in);

    linear_forward(d_y, d_x, d_W, nullptr, T, in, out, 0);
    EXPECT_LT(rel_error(download(d_y.ptr, T * out), y_ref), TOL_BF16);
    linear_forward(d_y, d_x, d_W, d_res, T, in, out, 0);  // with the residual as C
    std::vector<double> y_res = y_ref;
    for (int64_t i = 0; i < T * out; i++) y_res[i] += res[i];
    EXPECT_LT(rel_error(download(d_y.ptr, T * out), y_res), TOL_BF16);

    linear_backward_input(d_dx, d_dy, d_W, T, in, out, 0);
    EXPECT_LT(rel_error(download(d_dx.ptr, T * in), dx_ref), TOL_BF16);
    linear_backward_weight(d_dW, d_dy, d_x, T, in, out, 0);
    EXPECT_LT(rel_error(download(d_dW.ptr, out * in), dW_ref), TOL_FP32);
}

// ---------------------------------------------------------------------------------------------
using Reductions = Seeded;

TEST_F(Reductions, SumAndSumOfSquares) {
    TRACE_SEED();
    const int64_t n = 1000003;
    auto x = random_normal(n, rng);
    std::vector<float> xf(x.begin(), x.end());
    double sum = 0, sq = 0;
    for (float v : xf) sum += v, sq += (double)v * v;
    DeviceBuffer<float> d_x(n), d_out(2), scratch(sum_scratch_floats());
    CUDA_CHECK(cudaMemcpy(d_x.ptr, xf.data(), n * 4, cudaMemcpyHostToDevice));
    sum_floats(d_out.ptr, d_x, n, scratch, 0);
    sum_squares(d_out.ptr + 1, d_x, n, scratch, 0);
    auto got = download(d_out.ptr, 2);
    EXPECT_LT(std::fabs(got[0] - sum), 1e-5 * sq);  // a sum near zero: error relative to the scale
    EXPECT_LT(std::fabs(got[1] - sq) / sq, TOL_FP32);
}

// ---------------------------------------------------------------------------------------------
using Optimizer = Seeded;

TEST_F(Optimizer, AdamWMatchesReferenceWithClipping) {
    TRACE_SEED();
    const int64_t n = 4099;
    auto p = random_normal(n, rng), g = random_normal(n, rng), m = random_normal(n, rng, 0.1);
    auto v = random_normal(n, rng, 0.1);
    for (auto& x : v) x = x * x;
    // fp32 inputs: the reference starts from the same rounded values.
    for (auto* vec : {&p, &g, &m, &v})
        for (auto& x : *vec) x = (double)(float)x;
    DeviceBuffer<float> d_p(n), d_g(n), d_m(n), d_v(n), d_scale(1);
    upload(d_p, p), upload(d_g, g), upload(d_m, m), upload(d_v, v);
    upload(d_scale, std::vector<double>{0.25});
    AdamW opt;
    opt.lr = 1e-2f;
    opt.step = 3;
    for (bool decay : {true, false}) {
        SCOPED_TRACE(decay ? "decay" : "no decay");
        std::vector<double> rp = p, rm = m, rv = v;
        upload(d_p, p), upload(d_m, m), upload(d_v, v);
        adamw_update(d_p, d_g, d_m, d_v, n, opt, decay, d_scale, 0);
        ref::adamw_step(rp.data(), g.data(), rm.data(), rv.data(), n, opt.lr, opt.beta1, opt.beta2, opt.eps,
                        opt.weight_decay, decay, opt.step, 0.25);
        EXPECT_LT(rel_error(download(d_p.ptr, n), rp), TOL_FP32);
        EXPECT_LT(rel_error(download(d_m.ptr, n), rm), TOL_FP32);
        EXPECT_LT(rel_error(download(d_v.ptr, n), rv), TOL_FP32);
    }
}

TEST_F(Optimizer, ClipScale) {
    TRACE_SEED();
    DeviceBuffer<float> sumsq(1), scale(1);
    upload(sumsq, std::vector<double>{16.0});  // norm 4
    clip_scale(scale, sumsq, 1.0f, 0);
    EXPECT_NEAR(download(scale.ptr, 1)[0], 0.25, 1e-6);
    clip_scale(scale, sumsq, 8.0f, 0);
    EXPECT_EQ(download(scale.ptr, 1)[0], 1.0);
    clip_scale(scale, sumsq, 0.0f, 0);  // 0 = clipping off
    EXPECT_EQ(download(scale.ptr, 1)[0], 1.0);
}

}  // namespace
