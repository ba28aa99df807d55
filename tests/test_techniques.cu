// tests/test_techniques.cu - every memory technique computes the same function as the plain
// step: the same loss and the same gradient of every parameter, and the same loss curve over a
// few optimizer steps. Checkpointing and offload recompute with the same kernels on the same
// inputs, so they must agree bit for bit; chunking changes GEMM shapes and summation order, so
// it agrees within rounding, as does the fused attention backward (dQ summed in fp32 in another
// order than the dQ kernel's).
#include <cmath>
#include <cstdio>
#include <cstring>

#include "../infra/train.h"
#include "gpu_util.h"

namespace {

struct StepResult {
    double loss;
    std::vector<double> grads;
    std::vector<double> curve;  // losses over a few optimizer steps
    int64_t eval_differ = 0;    // with evaluate: per-token losses where the forward alone and the step differ
};

static std::vector<float> token_losses(const Model& m, cudaStream_t s) {
    std::vector<float> l(m.shape.tokens());
    CUDA_CHECK(cudaMemcpyAsync(l.data(), m.head.losses, l.size() * 4, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    return l;
}

// One model with the given techniques: the loss and gradients of one step from fixed weights,
// then a short training run. With `evaluate`, before each step the forward alone
// (model_forward_loss, as --eval-data runs it between steps) on the step's batch: its per-token
// losses must be the step's, and the steps must go on as if it had not run.
StepResult run_variant(const LlamaConfig& cfg, const StepOptions& opt, int B, int64_t S, uint64_t seed,
                       int device_attention_layers = 0, bool evaluate = false) {
    Model m;
    m.cfg = cfg;
    m.opt = opt;
    if (opt.doc_mask) m.opt.max_docs = B * ((S + 1 + 19) / 20);
    m.device_attention_layers = device_attention_layers;
    m.shape.batch = B;
    m.shape.seq = S;
    DeviceMemory dm;
    allocate_on_whole_gpu(m, dm);
    cudaStream_t s;
    CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));  // like train.cpp
    model_init_weights(m, seed, s);
    // With --doc-mask: the copy task in documents of 20 to 90 tokens.
    SyntheticData data(opt.doc_mask ? "copy" : "random", 200, seed);
    if (opt.doc_mask) data.doc_min = 20, data.doc_max = 90;
    std::vector<int32_t> tok(B * S), tgt(B * S);
    StepDocuments docs;
    StepResult r;
    for (int step = 0; step < 4; step++) {
        data.next(tok.data(), tgt.data(), B, (int)S, opt.doc_mask ? &docs : nullptr);
        for (int64_t t = 0; t < B * S; t += 7) tgt[t] = -1;  // some ignored targets
        model_set_batch(m, tok.data(), tgt.data(), s, -1, opt.doc_mask ? &docs : nullptr);
        std::vector<float> alone;
        if (evaluate) model_forward_loss(m, s), alone = token_losses(m, s);
        model_forward_backward(m, s);
        if (evaluate) {
            const std::vector<float> in_step = token_losses(m, s);
            for (size_t t = 0; t < alone.size(); t++) r.eval_differ += memcmp(&alone[t], &in_step[t], 4) != 0;
        }
        float loss_sum;
        CUDA_CHECK(cudaMemcpyAsync(&loss_sum, m.scalars, 4, cudaMemcpyDeviceToHost, s));
        CUDA_CHECK(cudaStreamSynchronize(s));
        double loss = loss_sum / m.batch.n_valid_targets;
        if (step == 0) {
            r.loss = loss;
            r.grads = download(m.states.grad, m.layout.total);
        }
        r.curve.push_back(loss);
        AdamW adam;
        adam.lr = 2e-3f;
        adam.step = step + 1;
        model_optimizer_step(m, adam, 1.0f, s);
    }
    CUDA_CHECK(cudaStreamSynchronize(s));
    CUDA_CHECK(cudaStreamDestroy(s));
    model_free(m, dm);
    return r;
}

struct Variant {
    const char* name;
    bool ckpt, selective, offload, chunked, fsdp;
    int untied = 0;        // head-chunked attention (Untied Ulysses on one GPU)
    bool fused = false;    // --attention fused: dQ summed in fp32 by the dK/dV kernel (head dim 128 on Hopper)
    bool savings = false;  // stage 7's --one-offload-slot, --grad-in-att-output, --dq-sums-in-staging
};

class Techniques : public ::testing::TestWithParam<std::string> {};

// Every technique against the plain step: with documents (--doc-mask) too.
void techniques_against_the_plain_step(const std::string& config, bool documents) {
    REQUIRE_GPU();
    LlamaConfig cfg = config_by_name(config);
    printf("  attention kernels: %s\n",
           attention_uses_hopper({1, 64, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim}) ? "the fast kernels" : "the reference kernels");
    cfg.n_layers = 4;
    StepOptions base;
    base.vocab_pieces = cfg.tied_embeddings ? 1 : 3;  // the LM head whole, and in pieces (--vocab-pieces)
    base.doc_mask = documents;
    const int B = 2;
    const int64_t S = 150;  // 300 tokens: chunks of 48 and 40 leave ragged tails
    printf("  %d units, %lld parameters%s\n", param_layout(cfg, base.vocab_pieces).num_units(), (long long)count_params(cfg),
           documents ? ", packed documents" : "");
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(config + (documents ? " documents" : "") + " seed " + std::to_string(seed));
    StepResult plain = run_variant(cfg, base, B, S, seed);
    // fsdp on one GPU runs the whole shard / gather / reduce-scatter machinery with N = 1.
    const Variant variants[] = {
        {"plain", false, false, false, false, false},  // with the forward alone before each step
        {"ckpt", true, false, false, false, false},
        {"ckpt=selective", true, true, false, false, false},
        {"ckpt offload", true, false, true, false, false},
        {"ckpt=selective offload", true, true, true, false, false},
        {"fsdp", false, false, false, false, true},
        {"fsdp ckpt offload", true, false, true, false, true},
        {"chunked", false, false, false, true, false},
        {"chunked ckpt", true, false, false, true, false},
        {"chunked ckpt=selective offload", true, true, true, true, false},
        {"fsdp chunked ckpt offload", true, false, true, true, true},
        {"untied=1", true, false, false, false, false, 1},
        {"untied=2 chunked", true, false, false, true, false, 2},
        {"untied=1 ckpt=selective offload", true, true, true, false, false, 1},
        {"fused attention", false, false, false, false, false, 0, true},
        {"fused ckpt offload fsdp", true, false, true, false, true, 0, true},
        {"fused untied=2 chunked", true, false, false, true, false, 2, true},
        // Stage 7's savings: one offload slot, Untied's d normalized input in the attention
        // output's memory, the fused dQ sums in Untied's staging.
        {"ckpt offload one-slot", true, false, true, false, false, 0, false, true},
        {"ckpt=selective offload one-slot", true, true, true, false, false, 0, false, true},
        {"fsdp chunked ckpt offload one-slot", true, false, true, true, true, 0, false, true},
        {"untied=1 savings", true, false, true, false, false, 1, false, true},
        {"fused untied=2 chunked savings", true, false, true, true, false, 2, true, true},
    };
    for (const Variant& v : variants) {
        SCOPED_TRACE(v.name);
        StepOptions o = base;
        o.ckpt = v.ckpt, o.selective = v.selective, o.offload = v.offload, o.chunked = v.chunked, o.fsdp = v.fsdp;
        o.untied = v.untied, o.fused_attention = v.fused;
        o.one_offload_slot = o.grad_in_att_output = o.dq_sums_in_staging = v.savings;
        if (v.chunked) o.chunk_tokens = 48, o.loss_chunk_tokens = 40;
        StepResult r = run_variant(cfg, o, B, S, seed, 0, true);  // the forward alone before each step too
        EXPECT_EQ(r.eval_differ, 0) << "per-token losses of the forward alone differ from the step's";
        double grad_err = rel_error(r.grads, plain.grads);
        double curve_err = 0;
        for (size_t i = 0; i < r.curve.size(); i++)
            curve_err = std::max(curve_err, std::fabs(r.curve[i] - plain.curve[i]) / plain.curve[i]);
        printf("  %-32s loss %.6f (plain %.6f)  gradient rel error %.2e  loss curve max rel diff %.2e\n", v.name,
               r.loss, plain.loss, grad_err, curve_err);
        if (!v.chunked && !v.untied && !v.fused) {  // same kernels, same shapes: bit for bit
            EXPECT_EQ(r.loss, plain.loss);
            EXPECT_TRUE(r.grads == plain.grads) << "gradients differ: rel error " << grad_err;
            EXPECT_EQ(r.curve, plain.curve);
        } else {  // other GEMM shapes and summation order (untied: per-chunk sums in bf16; fused: dQ's
                  // fp32 sums by key tile): rounding only
            EXPECT_LT(std::fabs(r.loss - plain.loss) / plain.loss, 1e-3);
            EXPECT_LT(grad_err, 1e-2);
            EXPECT_LT(curve_err, 1e-2);
        }
    }
}

TEST_P(Techniques, SameLossAndGradientsAsThePlainStep) { techniques_against_the_plain_step(GetParam(), false); }

// Packed documents (--doc-mask: attention inside each document, positions from its start) through
// every technique: the same agreement with the plain step with documents.
TEST_P(Techniques, WithDocumentsTheSameAsThePlainStep) { techniques_against_the_plain_step(GetParam(), true); }

// Stage 7's savings other than --vocab-pieces change where bytes live, not what is computed: the
// talk's stage 6 and the same with one offload slot, Untied's normalized-input gradient in the
// attention output's memory and the fused dQ sums in its staging give the same loss, gradients
// and loss curve bit for bit, with the lean and the fused backward.
TEST_P(Techniques, SavingsAreTheTalksStackBitForBit) {
    REQUIRE_GPU();
    LlamaConfig cfg = config_by_name(GetParam());
    cfg.n_layers = 4;
    const int B = 2;
    const int64_t S = 150;
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(GetParam() + " seed " + std::to_string(seed));
    for (bool fused : {false, true}) {
        StepOptions talk;
        apply_stage(talk, 6);
        talk.chunk_tokens = 48, talk.loss_chunk_tokens = 40, talk.fused_attention = fused;
        StepOptions ours = talk;
        ours.one_offload_slot = ours.grad_in_att_output = ours.dq_sums_in_staging = true;
        const StepResult a = run_variant(cfg, talk, B, S, seed), b = run_variant(cfg, ours, B, S, seed);
        printf("  %s backward: stage 6 loss %.6f, with the savings %.6f\n", fused ? "fused" : "lean", a.loss, b.loss);
        EXPECT_EQ(a.loss, b.loss) << (fused ? "fused" : "lean");
        EXPECT_TRUE(a.grads == b.grads) << (fused ? "fused" : "lean") << ": rel error " << rel_error(a.grads, b.grads);
        EXPECT_EQ(a.curve, b.curve) << (fused ? "fused" : "lean");
    }
}

// --ckpt=selective --offload within a host budget (--host-mem-gib) that holds the attention
// outputs of only K layers: those layers skip the attention rerun, and so do the D layers before
// the last that keep theirs on the device (the room under the cap); the others rerun it. Either
// way the same kernels see the same inputs, so the step equals --ckpt --offload bit for bit, for
// every K and D, with the talk's two offload slots and stage 7's one.
TEST_P(Techniques, SelectiveWithinHostBudgetIsCkptBitForBit) {
    REQUIRE_GPU();
    LlamaConfig cfg = config_by_name(GetParam());
    cfg.n_layers = 4;
    const int B = 2;
    const int64_t S = 150;
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(GetParam() + " seed " + std::to_string(seed));
    const double T = B * S;
    const double inputs = cfg.n_layers * T * cfg.dim * 2, per_layer = T * cfg.q_dim() * 2 + (double)B * cfg.n_heads * S * 4;
    for (int untied : {0, 1})
    for (bool one_slot : {false, true}) {
        StepOptions full;
        full.ckpt = full.offload = true, full.untied = untied, full.one_offload_slot = one_slot;
        StepResult ref = run_variant(cfg, full, B, S, seed);
        for (int K = 0; K < cfg.n_layers; K++) {
            const int room = cfg.n_layers - 1 - K;  // layers that could keep theirs on the device
            std::vector<int> device_counts{0};
            for (int D : {1, room})
                if (D <= room && D != device_counts.back()) device_counts.push_back(D);
            for (int D : device_counts) {
                StepOptions o = full;
                o.selective = true, o.rebuild_inputs = 0;  // every input on the host (the next test rebuilds some)
                o.host_mem_gib = (inputs + (K + 0.5) * per_layer) / GiB;
                Model plan;  // what the budget keeps
                plan.cfg = cfg, plan.opt = o, plan.shape.batch = B, plan.shape.seq = S;
                plan.device_attention_layers = D;
                Arena dry;
                model_declare_buffers(plan, dry);
                ASSERT_EQ(plan.plan.att_host_layers, K);
                ASSERT_EQ(plan.plan.att_device_layers, D);
                for (int l = 0; l < cfg.n_layers; l++)
                    EXPECT_EQ(attention_kept(plan, l), l < K || l >= cfg.n_layers - 1 - D) << "K " << K << " D " << D;
                StepResult r = run_variant(cfg, o, B, S, seed, D);
                printf("  untied=%d, %d offload slot%s, attention kept on the host for %d and on the device for %d of %d "
                       "layers: loss %.6f (--ckpt %.6f)\n", untied, one_slot ? 1 : 2, one_slot ? "" : "s", K, D,
                       cfg.n_layers, r.loss, ref.loss);
                EXPECT_EQ(r.loss, ref.loss) << "K " << K << " D " << D;
                EXPECT_TRUE(r.grads == ref.grads) << "K " << K << " D " << D << ": rel error " << rel_error(r.grads, ref.grads);
                EXPECT_EQ(r.curve, ref.curve) << "K " << K << " D " << D;
            }
        }
    }
}

// The same with n block inputs left off the host (layers 1, 3, .., 2n - 1), which frees the host
// for n more attention outputs: layer l's backward first rebuilds its input from layer l-1's input
// and attention output (Wo and the MLP of layer l-1 again, the forward's kernels on the forward's
// inputs), so the step still equals --ckpt --offload bit for bit. Six layers: n = 1 and 2, with
// the layers after the host's keeping theirs on the device (layer 3, rebuilt, among them when
// K = 3, D = 2); Untied, and FSDP with chunks; with one offload slot (the rebuild overwrites the
// input chunk by chunk) and with two (the rebuild writes the other slot, and the layer below then
// finds its input in place).
TEST_P(Techniques, RebuiltInputsAreCkptBitForBit) {
    REQUIRE_GPU();
    LlamaConfig cfg = config_by_name(GetParam());
    cfg.n_layers = 6;
    const int B = 2, L = cfg.n_layers;
    const int64_t S = 150;
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(GetParam() + " seed " + std::to_string(seed));
    const double T = B * S;
    const double input = T * cfg.dim * 2, per_layer = T * cfg.q_dim() * 2 + (double)B * cfg.n_heads * S * 4;
    struct Base {
        const char* name;
        int untied;
        bool fsdp_chunked, one_slot;
    };
    for (const Base& base : {Base{"one slot", 0, false, true}, Base{"two slots", 0, false, false},
                             Base{"untied=1, one slot", 1, false, true}, Base{"fsdp chunked, one slot", 0, true, true},
                             Base{"fsdp chunked, two slots", 0, true, false}}) {
        StepOptions full;
        full.ckpt = full.offload = true, full.untied = base.untied, full.one_offload_slot = base.one_slot;
        if (base.fsdp_chunked) full.fsdp = full.chunked = true, full.chunk_tokens = 48, full.loss_chunk_tokens = 40;
        StepResult ref = run_variant(cfg, full, B, S, seed);
        for (int n : {1, 2})
            for (int K : {2 * n - 1, L - 2})
                for (int D : {0, 1, 2}) {
                    if (K + D > L - 1) continue;  // the device keeps only layers the host does not
                    StepOptions o = full;
                    o.selective = true, o.rebuild_inputs = n;
                    // A tenth of a layer to spare: less than one rebuilt input frees (a quarter to
                    // half of an attention output here), so each of the n rebuilt inputs keeps one more.
                    o.host_mem_gib = ((L - n) * input + (K + 0.1) * per_layer) / GiB;
                    Model plan;
                    plan.cfg = cfg, plan.opt = o, plan.shape.batch = B, plan.shape.seq = S;
                    plan.device_attention_layers = D;
                    Arena dry;
                    model_declare_buffers(plan, dry);
                    ASSERT_EQ(plan.plan.x_rebuilt_layers, n) << "K " << K << " D " << D;
                    ASSERT_EQ(plan.plan.att_host_layers, K);
                    ASSERT_EQ(plan.plan.att_device_layers, D);
                    for (int l = 0; l < L; l++)
                        EXPECT_EQ(input_rebuilt(plan.plan, l), l % 2 == 1 && l < 2 * n) << "layer " << l;
                    EXPECT_EQ(model_host_bytes(plan), (int64_t)((L - n) * input) + (int64_t)(K * per_layer));
                    StepResult r = run_variant(cfg, o, B, S, seed, D);
                    printf("  %s: %d inputs rebuilt, attention kept on the host for %d and on the device for %d of %d "
                           "layers: loss %.6f (--ckpt %.6f)\n", base.name, n, K, D, L, r.loss, ref.loss);
                    EXPECT_EQ(r.loss, ref.loss) << base.name << " n " << n << " K " << K << " D " << D;
                    EXPECT_TRUE(r.grads == ref.grads) << base.name << " n " << n << " K " << K << " D " << D
                                                      << ": rel error " << rel_error(r.grads, ref.grads);
                    EXPECT_EQ(r.curve, ref.curve) << base.name << " n " << n << " K " << K << " D " << D;
                }
    }
}

// --sim-world 8 under --fsdp: every unit the step gathers holds the whole model's weights, as a
// real rank's gather brings them (rank 0's shard from its master, the others drawn from the
// seed), bit for bit the single-GPU model's bf16 weights; not zeros outside rank 0's shard.
TEST(SimWorld, GatheredUnitsHoldTheWholeModel) {
    REQUIRE_GPU();
    for (const char* name : {"tiny", "tiny-untied"}) {
        LlamaConfig cfg = config_by_name(name);
        const uint64_t seed = 11;
        cudaStream_t s;
        CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        auto make = [&](Model& m, DeviceMemory& dm, int world) {
            m.cfg = cfg;
            m.opt.vocab_pieces = 3;  // the embedding and the LM head span several units (the head's two passes)
            m.opt.fsdp = world > 1;
            m.world = world;
            if (world > 1) m.comm = comm_fake(world, &m), m.owns_comm = true;
            m.shape.batch = 1, m.shape.seq = 64;
            allocate_on_whole_gpu(m, dm);
            model_init_weights(m, seed, s);
        };
        Model one, sim;
        DeviceMemory dm_one, dm_sim;
        make(one, dm_one, 1);
        make(sim, dm_sim, 8);
        const ParamLayout& lay = one.layout;
        bf16* whole;  // the single-GPU model's weights in bf16
        CUDA_CHECK(cudaMalloc(&whole, lay.total * sizeof(bf16)));
        convert_f32_to_bf16(whole, one.states.master, lay.total, s);
        const std::vector<double> expected = download(whole, lay.total);
        CUDA_CHECK(cudaFree(whole));
        const std::vector<int> order = model_unit_order(sim);  // the step's: embedding, layers, final norm, head, layers
        units_step_begin(sim, s);
        int64_t compared = 0, nonzero = 0, differ = 0, first_differ = -1;
        for (int u : order) {
            unit_begin(sim, u, WEIGHTS, s);
            CUDA_CHECK(cudaStreamSynchronize(s));
            const std::vector<double> got = download(sim.unit_w[u], lay.unit_size(u));
            for (const ParamTensor& t : lay.tensors) {  // the tensors' elements (not the alignment gaps)
                const int64_t a = std::max(t.offset, lay.unit_begin[u]), b = std::min(t.offset + t.numel(), lay.unit_begin[u + 1]);
                for (int64_t i = a; i < b; i++) {
                    const bool same = got[i - lay.unit_begin[u]] == expected[i];
                    if (!same && differ++ == 0) first_differ = i;
                    compared++, nonzero += expected[i] != 0;
                }
            }
            unit_end(sim, u, WEIGHTS, s);
        }
        units_step_end(sim, s);
        EXPECT_EQ(differ, 0) << name << ": the first differing weight is element " << first_differ << " of the layout";
        EXPECT_GT(nonzero, compared * 9 / 10) << name;
        printf("  %s: %lld weights of %zu gathered units bit for bit the single-GPU model's\n", name, (long long)compared, order.size());
        CUDA_CHECK(cudaStreamSynchronize(s));
        model_free(sim, dm_sim);
        model_free(one, dm_one);
        CUDA_CHECK(cudaStreamDestroy(s));
    }
}

// tiny-hd128: head dim 128, so on Hopper every technique runs kernels/attention_hopper.cu's kernels.
// tiny-qwen3: the Qwen3 family, its per-head norms of q and k through every technique.
INSTANTIATE_TEST_SUITE_P(Configs, Techniques, ::testing::Values("tiny", "tiny-untied", "tiny-hd128", "tiny-qwen3"),
                         [](const auto& info) {
                             return info.param == "tiny"          ? "tied"
                                    : info.param == "tiny-untied" ? "untied"
                                    : info.param == "tiny-qwen3"  ? "qwen3"
                                                                  : "hd128";
                         });

}  // namespace
