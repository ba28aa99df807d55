// tests/test_cli.cpp - the program's surface, on the CPU: flags and their errors, the learning
// rate schedule, the synthetic data, the memory plan's formulas, and the binary's exit codes.
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <functional>

#include "../llama.h"
#include "../infra/evaluate.h"
#include "../infra/train.h"
#include "../io/json.h"
#include "test_util.h"

namespace {

// The exit code a Fatal would carry, or -1 if fn does not throw one.
int fatal_code(const std::function<void()>& fn) {
    try {
        fn();
    } catch (const Fatal& f) {
        return f.code;
    }
    return -1;
}

Options parse(std::vector<std::string> args) {
    args.insert(args.begin(), "train");
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(&a[0]);
    return parse_options((int)argv.size(), argv.data());
}

// The ladder starts its children through /bin/sh: every argument must arrive as it was.
TEST(Flags, ShellQuotingSurvivesTheShell) {
    for (std::string s : {"plain", "with space", "it's", "'", "''", "a\"b", "$HOME", "`ls`", "back\\slash", "semi;colon", ""}) {
        FILE* p = popen(("printf %s " + shell_quote(s)).c_str(), "r");
        ASSERT_NE(p, nullptr);
        std::string out;
        char buf[256];
        size_t n;
        while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
        pclose(p);
        EXPECT_EQ(out, s);
    }
}

TEST(Flags, JsonNumbersAreNullWhenNotFinite) {
    EXPECT_EQ(json_number(1.5, "%.3g"), "1.5");
    EXPECT_EQ(json_number(NAN, "%.9g"), "null");
    EXPECT_EQ(json_number(INFINITY, "%.9g"), "null");
    EXPECT_EQ(json_number(-INFINITY, "%.9g"), "null");
}

TEST(Flags, TokenCountsWithSuffixes) {
    EXPECT_EQ(parse_tokens("--seq-len", "12"), 12);
    EXPECT_EQ(parse_tokens("--seq-len", "8K"), 8192);
    EXPECT_EQ(parse_tokens("--seq-len", "8k"), 8192);
    EXPECT_EQ(parse_tokens("--seq-len", "3M"), 3LL * 1024 * 1024);
    for (const char* bad : {"", "abc", "-5", "5G", "0", "1.5K", "K", "99999999999999M"})
        EXPECT_EQ(fatal_code([&] { parse_tokens("--seq-len", bad); }), EXIT_USAGE) << "'" << bad << "'";
}

TEST(Flags, CommaListsKeepEveryItem) {  // the benches' --seqs and --shapes
    using L = std::vector<std::string>;
    EXPECT_EQ(split_commas("8K,16K,1M"), (L{"8K", "16K", "1M"}));
    EXPECT_EQ(split_commas("3B"), (L{"3B"}));
    EXPECT_EQ(split_commas(""), (L{""}));
    EXPECT_EQ(split_commas("8K,,16K,"), (L{"8K", "", "16K", ""}));  // empty items left for the caller to refuse
}

TEST(Flags, ParsesBothSpellingsAndDefaults) {
    Options o = parse({"--config", "llama3.1-8b", "--seq-len=64K", "--steps", "7", "--lr=1e-3", "--plan"});
    EXPECT_EQ(o.config, "llama3.1-8b");
    EXPECT_EQ(o.seq_len, 65536);
    EXPECT_EQ(o.steps, 7);
    EXPECT_DOUBLE_EQ(o.lr, 1e-3);
    EXPECT_TRUE(o.plan);
    Options d = parse({});
    EXPECT_EQ(d.config, "llama3.2-3b");
    EXPECT_EQ(d.seq_len, 8192);
}

TEST(Flags, BadValuesAreUsageErrors) {
    std::vector<std::vector<std::string>> bad = {
        {"--frobnicate"}, {"--steps", "-1"}, {"--steps", "ten"}, {"--task", "sort"}, {"--lr", "abc"},
        {"--lr", "nan"}, {"--seq-len"}, {"--batch", "0"}, {"--layers", "0"}, {"--mem-cap-gib", "-3"},
        {"--plan=yes"}, {"--task", "copy", "--seq-len", "3"}, {"--task-vocab", "1"}, {"--attention", "fastest"},
        {"--sim-world", "8", "--save-to", "/tmp/x"}, {"--sim-world", "2", "--dump", "/tmp/x.bin"}};
    for (auto& args : bad) {
        std::string joined;
        for (auto& a : args) joined += a + " ";
        EXPECT_EQ(fatal_code([&] { parse(args); }), EXIT_USAGE) << joined;
    }
}

TEST(Flags, ConfigResolution) {
    Options o = parse({"--config", "llama3.1-8b", "--layers", "3"});
    LlamaConfig c = resolve_config(o);
    EXPECT_EQ(c.n_layers, 3);
    EXPECT_EQ(c.dim, 4096);
    EXPECT_EQ(fatal_code([] { resolve_config(parse({"--config", "llama9"})); }), EXIT_USAGE);
    EXPECT_EQ(fatal_code([] { resolve_config(parse({"--config", "tiny", "--task-vocab", "100000"})); }), EXIT_USAGE);
}

TEST(Configs, MatchPublishedModels) {
    LlamaConfig c3 = config_by_name("llama3.2-3b"), c8 = config_by_name("llama3.1-8b");
    EXPECT_NEAR(count_params(c3) / 1e9, 3.21, 0.01);
    EXPECT_NEAR(count_params(c8) / 1e9, 8.03, 0.01);
    EXPECT_TRUE(c3.tied_embeddings);
    EXPECT_FALSE(c8.tied_embeddings);
    EXPECT_EQ(c3.rope_scaling.factor, 32.0);  // not the 8 that some ports hard-code
    EXPECT_EQ(c8.rope_scaling.factor, 8.0);
    // Qwen3-32B (Qwen/Qwen3-32B's config.json): 32.8 B parameters, q_proj 8192 x 5120, no scaling.
    const LlamaConfig q = config_by_name("qwen3-32b");
    EXPECT_NEAR(count_params(q) / 1e9, 32.76, 0.01);
    EXPECT_EQ(q.q_dim(), 8192);
    EXPECT_TRUE(q.qk_norm() && !q.tied_embeddings && !q.rope_scaling.enabled);
    EXPECT_EQ(q.rope_theta, 1e6);
    EXPECT_EQ(q.norm_eps, 1e-6);
}

TEST(Schedule, WarmupThenCosine) {
    Options o;
    o.steps = 110, o.warmup = 10, o.lr = 1.0, o.min_lr_ratio = 0.1;
    EXPECT_DOUBLE_EQ(lr_at(o, 0), 0.1);
    EXPECT_DOUBLE_EQ(lr_at(o, 9), 1.0);
    EXPECT_DOUBLE_EQ(lr_at(o, 10), 1.0);
    EXPECT_NEAR(lr_at(o, 60), 0.55, 1e-12);  // halfway down the cosine
    EXPECT_NEAR(lr_at(o, 110), 0.1, 1e-12);
    for (int s = 10; s < 110; s++) EXPECT_LE(lr_at(o, s + 1), lr_at(o, s));
}

TEST(SyntheticData, CopyTaskRepeatsAndScoresOnlyTheCopy) {
    const int B = 3, vocab = 50;
    const int64_t S = 101;
    SyntheticData d("copy", vocab, 5);
    std::vector<int32_t> tok(B * S), tgt(B * S);
    d.next(tok.data(), tgt.data(), B, S);
    const int64_t half = (S + 1) / 2;  // the sequence of S + 1 tokens z: z[i + half] == z[i]
    for (int b = 0; b < B; b++) {
        const int32_t* t = &tok[b * S];
        const int32_t* y = &tgt[b * S];
        for (int64_t i = 0; i < S; i++) {
            ASSERT_GE(t[i], 0);
            ASSERT_LT(t[i], vocab);
            if (i >= half) {
                EXPECT_EQ(t[i], t[i - half]);
            }
            if (i + 1 < half) {
                EXPECT_EQ(y[i], -1);  // not predictable: not scored
            } else {
                EXPECT_EQ(y[i], i + 1 < S ? t[i + 1] : t[i + 1 - half]);  // z[S] = z[S - half]
            }
        }
    }
    // Same seed, same data; another seed, other data.
    SyntheticData d2("copy", vocab, 5), d3("copy", vocab, 6);
    std::vector<int32_t> tok2(B * S), tgt2(B * S), tok3(B * S), tgt3(B * S);
    d2.next(tok2.data(), tgt2.data(), B, S);
    d3.next(tok3.data(), tgt3.data(), B, S);
    EXPECT_EQ(tok, tok2);
    EXPECT_NE(tok, tok3);
}

// induction: the first half's tokens all differ, the second half repeats them, and only the
// repeat is scored; each scored token follows the one occurrence of its predecessor in the first
// half. The same seed gives the same data; a first half longer than the vocabulary is refused.
TEST(SyntheticData, InductionTaskHasOneEarlierOccurrence) {
    const int vocab = 5000;
    const int64_t S = 8191, half = (S + 1) / 2;  // 4096 distinct tokens
    SyntheticData d("induction", vocab, 3), again("induction", vocab, 3);
    std::vector<int32_t> tok(2 * S), tgt(2 * S), tok2(2 * S), tgt2(2 * S);
    d.next(tok.data(), tgt.data(), 2, S);
    again.next(tok2.data(), tgt2.data(), 2, S);
    EXPECT_EQ(tok, tok2);
    EXPECT_EQ(tgt, tgt2);
    for (int b = 0; b < 2; b++) {
        const int32_t* t = tok.data() + b * S;
        std::set<int32_t> first(t, t + half);
        EXPECT_EQ((int64_t)first.size(), half) << "sequence " << b;
        for (int64_t i = 0; i < S; i++) {
            ASSERT_GE(t[i], 0);
            ASSERT_LT(t[i], vocab);
            if (i >= half) {
                EXPECT_EQ(t[i], t[i - half]);
            }
            const bool scored = i + 1 >= half;
            EXPECT_EQ(tgt[b * S + i] >= 0, scored) << i;
        }
    }
    EXPECT_NE(std::vector<int32_t>(tok.begin(), tok.begin() + half), std::vector<int32_t>(tok.begin() + S, tok.begin() + S + half));
    if (std::ifstream("./train").good()) {
        CommandResult r = run_command("./train --plan --config mini --seq-len 512K --task induction");
        EXPECT_EQ(r.code, 2) << r.output;
        EXPECT_NE(r.output.find("without repeats"), std::string::npos) << r.output;
    }
}

TEST(SyntheticData, RandomTaskScoresEverything) {
    SyntheticData d("random", 7, 1);
    std::vector<int32_t> tok(64), tgt(64);
    d.next(tok.data(), tgt.data(), 1, 64);
    for (int i = 0; i < 63; i++) EXPECT_EQ(tgt[i], tok[i + 1]);
    EXPECT_GE(tgt[63], 0);
}

// The plan (dry run of the arena) against the memory formulas in the headers of llama.cu,
// fsdp.cu, offload.cu, chunked.cu, beyond/selective.cu and beyond/savings.cu, written out here independently,
// for every combination of flags.
struct Expected {
    double model, attention, other, host;
};

Expected expected_memory(const LlamaConfig& c, const StepOptions& o, double T) {
    const double L = c.n_layers, D = c.dim, F = c.ffn_dim, V = c.vocab, QKV = c.qkv_dim(), QD = c.q_dim();
    const double Hq = c.n_heads;
    const double C = o.chunked ? std::min<double>(o.chunk_tokens ? o.chunk_tokens : D, T) : T;
    const double CL = o.chunked ? std::min<double>(o.loss_chunk_tokens ? o.loss_chunk_tokens : 4096, T) : T;
    const bool keep_att = !o.ckpt, keep_out = !o.ckpt || o.selective, keep_mlp = !o.ckpt && !o.chunked;
    Expected e;
    // 16 bytes per parameter, and two bf16 unit slots of the largest unit: a layer, or the
    // vocabulary tables, whole or (--vocab-pieces) in pieces of about a layer's size.
    const double layer = D * QKV + QD * D + 3 * D * F + 2 * D;
    const double pieces = o.vocab_pieces > 0 ? o.vocab_pieces : std::ceil(V * D / layer), piece_rows = std::ceil(V / pieces);
    const double largest = std::max(layer, piece_rows * D);
    e.model = 16.0 * count_params(c) + 2 * 2 * largest;
    e.attention = (keep_att ? L : 1) * T * 2 * QKV + (keep_out ? (o.offload ? 1 : L) : 1) * T * (2 * QD + 4 * Hq) +
                  T * (2 * QKV + 2 * QD + 4 * Hq)   // dqkv, datt, delta
                  + (o.fused_attention ? std::ceil(T / 64) * (64 * 4 * QD + 4 * Hq) : 0);  // fp32 dQ sums, counts
    e.other = (o.offload ? (o.one_offload_slot ? 1 : 2) : L + 1) * T * 2 * D  // block inputs (all, or staging slots)
              + (keep_att ? L * T : C) * 2 * D          // x_mid
              + (keep_mlp ? L : 1) * C * (2 * (2 * D + 3 * F) + 8)  // xn1, xn2, h13, act, rstd
              + CL * (2 * D + 4 + 2 * piece_rows) + 4 * T  // head chunk (a piece's logits), losses
              + (pieces > 1 ? 12 * T : 0)               // per-token max / lse, sum, target logit
              + T * 2 * D + std::max(C, CL) * 2 * D + C * 6 * F  // dres, dxn, dh13, dact
              + 16 * T + 12 * std::min<double>(T, V);   // tokens, targets, embedding groups
    e.host = o.offload ? L * T * 2 * D + (o.selective ? (L - 1) * T * (2 * QD + 4 * Hq) : 0) : 0;
    return e;
}

TEST(MemoryPlan, MatchesFormulasForEveryTechnique) {
    std::vector<std::pair<std::string, StepOptions>> modes;
    StepOptions o;
    modes.push_back({"plain", o});
    o.ckpt = true;
    modes.push_back({"ckpt", o});
    o.selective = true;
    modes.push_back({"ckpt=selective", o});
    o.offload = true;
    modes.push_back({"ckpt=selective offload", o});
    o.selective = false;
    modes.push_back({"ckpt offload", o});
    o.chunked = true;
    modes.push_back({"ckpt offload chunked", o});
    o = StepOptions();
    o.chunked = true;
    modes.push_back({"chunked", o});
    o.chunk_tokens = 1000, o.loss_chunk_tokens = 3000;
    modes.push_back({"chunked 1000/3000", o});
    o.fused_attention = true;
    modes.push_back({"chunked 1000/3000 fused attention", o});
    o = StepOptions();
    o.fused_attention = true;
    modes.push_back({"fused attention", o});
    o = StepOptions();  // stage 7's savings that do not need Untied
    o.vocab_pieces = 0;
    modes.push_back({"vocab pieces", o});
    o.chunked = true;
    modes.push_back({"vocab pieces chunked", o});
    o.ckpt = o.offload = o.one_offload_slot = true;
    modes.push_back({"vocab pieces chunked ckpt offload one-slot", o});
    o.vocab_pieces = 2;
    modes.push_back({"2 vocab pieces chunked ckpt offload one-slot", o});
    for (const char* name : {"llama3.2-3b", "llama3.1-8b"})
        for (auto& [mode, opt] : modes) {
            SCOPED_TRACE(std::string(name) + " " + mode);
            Options run;
            run.step = opt;
            const int64_t T = 65536;
            LlamaConfig c = config_by_name(name);
            MemoryPlan plan = plan_memory(c, run, T);
            Expected e = expected_memory(c, opt, T);
            EXPECT_NEAR(plan.arena.category_bytes(MEM_MODEL) / e.model, 1.0, 1e-3);
            EXPECT_NEAR(plan.arena.category_bytes(MEM_ATTENTION) / e.attention, 1.0, 1e-3);
            EXPECT_NEAR(plan.arena.category_bytes(MEM_OTHER) / e.other, 1.0, 1e-3);
            EXPECT_EQ(plan.arena.category_bytes(MEM_COMM), 0);
            if (e.host > 0) EXPECT_NEAR(plan.host_bytes / e.host, 1.0, 1e-9);
            else EXPECT_EQ(plan.host_bytes, 0);
        }
}

TEST(MemoryPlan, EachStageNeedsLess) {
    LlamaConfig c = config_by_name("llama3.1-8b");
    Options o;
    double prev = plan_memory(c, o, 262144).arena.total();
    o.step.ckpt = true;
    double ckpt = plan_memory(c, o, 262144).arena.total();
    o.step.offload = true;
    double off = plan_memory(c, o, 262144).arena.total();
    o.step.chunked = true;
    double chunk = plan_memory(c, o, 262144).arena.total();
    EXPECT_LT(ckpt, prev);
    EXPECT_LT(off, ckpt);
    EXPECT_LT(chunk, off);
}

TEST(MemoryPlan, LongestContextIsTheLastThatFits) {
    LlamaConfig c = config_by_name("llama3.2-3b");
    c.n_layers = 4;
    Options o;
    o.step.ckpt = o.step.chunked = true;
    int64_t n = longest_context(c, o, 80.0, 0.55);
    ASSERT_GT(n, 0);
    EXPECT_LE(plan_memory(c, o, n).total_gib(0.55), 80.0);
    EXPECT_GT(plan_memory(c, o, n + 1024).total_gib(0.55), 80.0);
}

// --trace writes Chrome's trace-event JSON: a track per stream, each mark a complete event with its
// layer (or unit) and bytes, memory as counters; strict JSON (our reader refuses anything else).
TEST(Trace, ChromeTraceEventsFromTheTimeline) {
    const std::string path = testing::TempDir() + "trace.json";
    const std::vector<TimelineEntry> tl = {{"compute", "forward", 0, 0.5, 2.0, 0},
                                           {"compute", "all-to-all", 0, 0.75, 1.0, 4096},
                                           {"fsdp", "gather", 3, 0.25, 0.5, 1 << 20},
                                           {"copy", "x_in to host", 1, 1.0, 1.25, 2048}};
    MemTracePoint mem;
    mem.point = "fwd", mem.layer = 0, mem.t_ms = 2.0, mem.live[MEM_MODEL] = 1 << 30, mem.host = 1 << 29;
    write_trace(path, "./train \"quoted\"", tl, {mem});
    std::ifstream f(path);
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    JsonDoc doc(text, path);
    const auto events = doc.root().get("traceEvents");
    ASSERT_TRUE(events && events->kind() == JsonKind::Array);
    std::map<std::string, int> by_phase;
    for (const JsonValue& e : events->elements()) {
        const std::string ph(e.get("ph")->string());
        by_phase[ph]++;
        if (ph != "X") continue;
        const std::string name(e.get("name")->string());
        const int tid = (int)e.get("tid")->integer();
        if (name == "all-to-all 0") {
            EXPECT_EQ(tid, 0);
            EXPECT_DOUBLE_EQ(e.get("ts")->number(), 750.0);
            EXPECT_DOUBLE_EQ(e.get("dur")->number(), 250.0);
            EXPECT_EQ(e.get("args")->get("bytes")->integer(), 4096);
            EXPECT_EQ(e.get("args")->get("what")->string(), "all-to-all");
        }
        if (name == "gather unit 3") {
            EXPECT_EQ(tid, 1);
            EXPECT_EQ(e.get("args")->get("unit")->integer(), 3);
        }
        if (name == "x_in to host 1") {
            EXPECT_EQ(tid, 2);
        }
    }
    EXPECT_EQ(by_phase["X"], 4);
    EXPECT_EQ(by_phase["M"], 4);  // the process's name, each stream's
    EXPECT_EQ(by_phase["C"], 1);
    EXPECT_EQ(doc.root().get("otherData")->get("command")->string(), "./train \"quoted\"");
}

TEST(Flags, MemoryTechniques) {
    Options o = parse({"--offload", "--chunked", "--chunk-tokens", "2K"});
    EXPECT_TRUE(o.step.offload);
    EXPECT_TRUE(o.step.ckpt);  // offload implies checkpointing
    EXPECT_FALSE(o.step.selective);
    EXPECT_EQ(o.step.chunk_tokens, 2048);
    EXPECT_TRUE(parse({"--ckpt=selective"}).step.selective);
    EXPECT_EQ(fatal_code([] { parse({"--ckpt=some"}); }), EXIT_USAGE);
    EXPECT_EQ(fatal_code([] { parse({"--chunk-tokens", "100"}); }), EXIT_USAGE);  // needs --chunked
    EXPECT_EQ(parse({"--timeline", "t.json"}).timeline_path, "t.json");  // any run (infra/timeline.cu)
    EXPECT_EQ(parse({"--trace", "t.json"}).trace_path, "t.json");
    EXPECT_TRUE(parse({"--attention", "fused"}).step.fused_attention);
    EXPECT_FALSE(parse({"--attention", "fast"}).step.fused_attention);
    // auto (the default) plans the lean backward until a run (or --plan with a cap) sees the fused one fit.
    EXPECT_EQ(parse({}).attention, "auto");
    EXPECT_FALSE(parse({}).step.fused_attention);
    EXPECT_FALSE(parse({"--attention", "auto"}).step.fused_attention);
}

// ---------------------------------------------------------------------------------------------
// The binary itself: exit codes and messages.
using Result = CommandResult;
Result run_train(const std::string& args) { return run_command("./train " + args); }

bool have_binary() { return std::ifstream("./train").good(); }

TEST(Binary, UsageErrorsExitWithTwo) {
    if (!have_binary()) GTEST_SKIP() << "./train not built (run from the repository root)";
    Result r = run_train("--seq-len abc");
    EXPECT_EQ(r.code, 2);
    EXPECT_NE(r.output.find("--seq-len"), std::string::npos) << r.output;
    EXPECT_EQ(run_train("--config nope").code, 2);
    Result h = run_train("--help");
    EXPECT_EQ(h.code, 0);
    EXPECT_NE(h.output.find("--mem-cap-gib"), std::string::npos);
}

TEST(Binary, PlanNeedsNoGpu) {
    if (!have_binary()) GTEST_SKIP() << "./train not built";
    Result r = run_train("--plan --config llama3.1-8b --seq-len 64K --mem-cap-gib 80");
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("attention"), std::string::npos);
    EXPECT_NE(r.output.find("OOM, needs"), std::string::npos) << r.output;  // stage 0 at 64K
}

// --attention auto: the fused backward exactly where its fp32 dQ sums fit under the cap. Llama
// 3.2 3B at 64K tokens with --ckpt plans 86.72 GiB with the lean backward and 87.47 with the
// fused one (both with the 0.55 GiB runtime estimate): an 87.1 GiB cap holds only the first.
double plan_total_gib(const std::string& output) {
    const size_t p = output.find("  total ");
    return p == std::string::npos ? NAN : std::atof(output.c_str() + p + 8);
}

TEST(Binary, AutoAttentionTakesTheFusedBackwardWhereItFits) {
    if (!have_binary()) GTEST_SKIP() << "./train not built";
    const std::string shape = "--plan --config llama3.2-3b --seq-len 64K --ckpt";
    Result roomy = run_train(shape + " --mem-cap-gib 88");
    Result tight = run_train(shape + " --mem-cap-gib 87.1");
    Result fused = run_train(shape + " --attention fused");
    Result lean = run_train(shape + " --attention fast");
    for (const Result* r : {&roomy, &tight, &fused, &lean}) ASSERT_EQ(r->code, 0) << r->output;
    EXPECT_NE(roomy.output.find("attention auto: the fused backward"), std::string::npos) << roomy.output;
    EXPECT_NE(roomy.output.find("cap 88.00 GiB: fits"), std::string::npos) << roomy.output;
    // Neither fits: the plan says so (and plans the lean one).
    Result neither = run_train(shape + " --mem-cap-gib 80");
    EXPECT_NE(neither.output.find("neither fits"), std::string::npos) << neither.output;
    EXPECT_DOUBLE_EQ(plan_total_gib(neither.output), plan_total_gib(lean.output));
    EXPECT_NE(tight.output.find("attention auto: the lean backward"), std::string::npos) << tight.output;
    EXPECT_NE(tight.output.find("cap 87.10 GiB: fits"), std::string::npos) << tight.output;
    EXPECT_DOUBLE_EQ(plan_total_gib(roomy.output), plan_total_gib(fused.output));
    EXPECT_DOUBLE_EQ(plan_total_gib(tight.output), plan_total_gib(lean.output));
    EXPECT_GT(plan_total_gib(fused.output), plan_total_gib(lean.output) + 0.5);  // 0.75 GiB of dQ sums
    // The longest context under a cap is the lean backward's: there auto falls back to it.
    Result roomy_lean = run_train(shape + " --mem-cap-gib 88 --attention fast");
    const auto longest_line = [](const std::string& out) {
        const size_t p = out.find("longest context");
        return p == std::string::npos ? std::string("(no longest context line)") : out.substr(p);
    };
    EXPECT_NE(longest_line(roomy.output), "(no longest context line)") << roomy.output;
    EXPECT_EQ(longest_line(roomy.output), longest_line(roomy_lean.output));
}

// On a GPU the run says what auto chose; on Hopper with head dim 128 a small run has room for it.
TEST(Binary, AutoAttentionSaysWhatItChose) {
    if (!have_binary()) GTEST_SKIP() << "./train not built";
    REQUIRE_GPU();
    Result r = run_train("--config tiny-hd128 --seq-len 256 --steps 1 --task random");
    ASSERT_EQ(r.code, 0) << r.output;
    if (r.output.find("attention_hopper.cu") == std::string::npos) GTEST_SKIP() << "the fast kernels need sm_90";
    EXPECT_NE(r.output.find("fused backward (auto: its fp32 dQ sums fit)"), std::string::npos) << r.output;
    Result lean = run_train("--config tiny-hd128 --seq-len 256 --steps 1 --task random --attention fast");
    ASSERT_EQ(lean.code, 0) << lean.output;
    EXPECT_NE(lean.output.find("attention_hopper.cu (wgmma + TMA), lean backward\n"), std::string::npos) << lean.output;
}

// The marks of a --timeline file, and those of one kind in one layer.
struct TimelineMark {
    std::string stream, what;
    int layer;
    double start, end;
    long long bytes;
};
std::vector<TimelineMark> read_timeline(const std::string& path) {
    std::vector<TimelineMark> marks;
    std::ifstream f(path);
    for (std::string line; std::getline(f, line);) {
        char stream[32], what[32];
        TimelineMark k;
        if (sscanf(line.c_str(), " {\"stream\": \"%31[^\"]\", \"what\": \"%31[^\"]\", \"layer\": %d, \"start_ms\": %lf, "
                   "\"end_ms\": %lf, \"bytes\": %lld}", stream, what, &k.layer, &k.start, &k.end, &k.bytes) == 6) {
            k.stream = stream, k.what = what;
            marks.push_back(k);
        }
    }
    return marks;
}
std::vector<TimelineMark> find_marks(const std::vector<TimelineMark>& marks, const std::string& what, int layer) {
    std::vector<TimelineMark> out;
    for (const TimelineMark& k : marks)
        if (k.what == what && k.layer == layer) out.push_back(k);
    return out;
}
// How many attention forward kernels ran inside layer l's "attention rerun" mark.
int attention_reruns(const std::vector<TimelineMark>& marks, int l) {
    auto rerun = find_marks(marks, "attention rerun", l);
    if (rerun.size() != 1) return -1;
    int n = 0;
    for (const TimelineMark& k : find_marks(marks, "attention forward", l))
        if (k.start >= rerun[0].start && k.end <= rerun[0].end) n++;
    return n;
}

// --timeline (infra/timeline.cu): every layer's forward and backward, with its attention kernels,
// all-to-alls and MLP inside them; the all-to-alls' bytes are those Ulysses must send. Stage 7's
// one offload slot fetches every layer's input back; the talk's two keep the last layer's in
// place and fetch the one below during a layer's backward.
TEST(Binary, TimelineMarksEachLayersParts) {
    if (!have_binary()) GTEST_SKIP() << "./train not built";
    REQUIRE_GPU();
    const std::string path = testing::TempDir() + "timeline.json";
    const std::string run = "--config tiny-hd128 --seq-len 2048 --sim-world 2 --steps 2 --task random --timeline " + path;
    Result talk = run_train(run + " --stage 6");
    ASSERT_EQ(talk.code, 0) << talk.output;
    {
        const std::vector<TimelineMark> marks = read_timeline(path);
        EXPECT_TRUE(find_marks(marks, "x_in to device", 1).empty());  // the last layer's input stayed in its slot
        auto fetch = find_marks(marks, "x_in to device", 0), backward0 = find_marks(marks, "backward", 0);
        ASSERT_EQ(fetch.size(), 1u);
        ASSERT_EQ(backward0.size(), 1u);
        EXPECT_LT(fetch[0].start, backward0[0].start);  // layer 0's input on its way before its backward begins
    }
    Result r = run_train(run + " --stage 7");
    ASSERT_EQ(r.code, 0) << r.output;
    const std::vector<TimelineMark> marks = read_timeline(path);
    auto find = [&](const std::string& what, int layer) { return find_marks(marks, what, layer); };
    // tiny-hd128 on 2 GPUs: 1024 tokens each; per layer this GPU sends half of its q, k, v and of
    // the attention output: 2 bytes x 1024 x (4 x 128 + 2 x 2 x 128 + 4 x 128) / 2.
    const long long forward_bytes = 2LL * 1024 * (512 + 512 + 512) / 2;
    for (int l = 0; l < 2; l++) {
        for (const char* dir : {"forward", "backward"}) {
            auto layer = find(dir, l);
            ASSERT_EQ(layer.size(), 1u) << dir << " " << l;
            EXPECT_GT(layer[0].end, layer[0].start);
            const bool fwd = std::string(dir) == "forward";
            const char* inside[] = {fwd ? "attention forward" : "attention backward", fwd ? "wo and mlp forward" : "wo and mlp backward",
                                    "all-to-all"};
            for (const char* what : inside) {
                int n = 0;
                long long bytes = 0;
                for (const TimelineMark& k : find(what, l)) {
                    if (k.start >= layer[0].start && k.end <= layer[0].end) n++, bytes += k.bytes;
                }
                EXPECT_GT(n, 0) << what << " inside layer " << l << "'s " << dir;
                if (fwd && std::string(what) == "all-to-all") {
                    EXPECT_EQ(bytes, forward_bytes) << l;
                }
            }
        }
        EXPECT_GT(attention_reruns(marks, l), 0) << l;  // --ckpt: the backward reruns the attention forward
        EXPECT_FALSE(find("x_in to device", l).empty()) << l;   // --offload's copies
    }
    int gathers = 0;
    for (const TimelineMark& k : marks)
        if (k.stream == "fsdp" && k.what == "gather" && k.bytes > 0) gathers++;
    EXPECT_GE(gathers, 4);  // each layer's unit, forward and backward
    EXPECT_EQ(find("head", -1).size(), 1u);
}

// --ckpt=selective --offload: the layer the host budget holds (0) and the one --device-keep-gib
// holds (2, before the last) keep their attention output, as does the last (3, in its slot);
// only layer 1 reruns attention in its backward. tiny-hd128 at 2048 tokens: a block input is
// 0.5 MiB, an attention output and its lse 2 MiB + 32 KiB.
TEST(Binary, SelectiveKeepsAttentionOnTheHostThenTheDevice) {
    if (!have_binary()) GTEST_SKIP() << "./train not built";
    REQUIRE_GPU();
    const std::string path = testing::TempDir() + "timeline_selective.json";
    const double MiB = 1.0 / 1024, att = 2 + 1.0 / 32;  // GiB per MiB; MiB of one layer's attention output
    char budgets[120];
    snprintf(budgets, sizeof budgets, " --host-mem-gib %.6f --device-keep-gib %.6f", (4 * 0.5 + 1.5 * att) * MiB, 1.5 * att * MiB);
    Result r = run_train("--config tiny-hd128 --layers 4 --seq-len 2048 --steps 1 --task random --ckpt=selective --offload" +
                         std::string(budgets) + " --timeline " + path);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("attention kept for 3 of 4 layers (0 on the host, 2 on the device, 3 in its slot), rerun for layer 1"),
              std::string::npos) << r.output;
    const std::vector<TimelineMark> marks = read_timeline(path);
    for (int l = 0; l < 4; l++) EXPECT_EQ(attention_reruns(marks, l), l == 1 ? 1 : 0) << "layer " << l;
    EXPECT_FALSE(find_marks(marks, "att to device", 0).empty());  // fetched from the host
    EXPECT_TRUE(find_marks(marks, "att to device", 2).empty());   // never left the device
}

// A block input left off the host: layer 1's is rebuilt from layer 0's in its backward, which lets
// the host keep layer 1's attention output too (the step stays bit for bit --ckpt's:
// test_techniques). With the talk's two offload slots layer 0's input, fetched for the rebuild,
// is still in its slot for layer 0's backward; with stage 7's one slot the rebuild wrote over it.
TEST(Binary, RebuiltInputLetsTheHostKeepOneMoreAttentionOutput) {
    if (!have_binary()) GTEST_SKIP() << "./train not built";
    REQUIRE_GPU();
    const std::string path = testing::TempDir() + "timeline_rebuilt.json";
    const double MiB = 1.0 / 1024, input = 0.5, att = 2 + 1.0 / 32;  // GiB per MiB; MiB of a block input, of an attention output
    char budgets[120];
    snprintf(budgets, sizeof budgets, " --host-mem-gib %.6f --device-keep-gib 0 --rebuild-inputs 1", (3 * input + 2.1 * att) * MiB);
    Result r = run_train("--config tiny-hd128 --layers 4 --seq-len 2048 --steps 1 --task random --ckpt=selective --offload" +
                         std::string(budgets) + " --timeline " + path);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("attention kept for 3 of 4 layers (0-1 on the host, 3 in its slot), rerun for layer 2; "
                            "block input rebuilt for layer 1\n"),
              std::string::npos) << r.output;
    const std::vector<TimelineMark> marks = read_timeline(path);
    for (int l = 0; l < 4; l++) EXPECT_EQ(attention_reruns(marks, l), l == 2 ? 1 : 0) << "layer " << l;
    EXPECT_EQ(find_marks(marks, "input rebuild", 1).size(), 1u);
    for (int l : {0, 2, 3}) EXPECT_TRUE(find_marks(marks, "input rebuild", l).empty()) << "layer " << l;
    EXPECT_TRUE(find_marks(marks, "x_in to host", 1).empty());     // never saved
    EXPECT_EQ(find_marks(marks, "x_in to device", 0).size(), 1u);  // for layer 1's rebuild, and kept
    EXPECT_EQ(find_marks(marks, "att to device", 0).size(), 2u);   // for the rebuild, and again after layer 1's
    Result one = run_train("--config tiny-hd128 --layers 4 --seq-len 2048 --steps 1 --task random --ckpt=selective --offload" +
                           std::string(budgets) + " --one-offload-slot --timeline " + path);
    ASSERT_EQ(one.code, 0) << one.output;
    EXPECT_EQ(find_marks(read_timeline(path), "x_in to device", 0).size(), 2u);  // for layer 1's rebuild, then layer 0's
    Result off = run_train("--config tiny-hd128 --layers 4 --seq-len 2048 --ckpt=selective --offload --plan" +
                           std::string(budgets) + " --rebuild-inputs 0");
    EXPECT_NE(off.output.find("attention kept for 2 of 4 layers (0 on the host, 3 in its slot), rerun for layers 1-2\n"),
              std::string::npos) << off.output;
}

// bench/throughput.py over the logs in dir: each of figures appears in its tables, none of absent.
void recompute_tables(const std::string& dir, const std::string& out, const std::string& names,
                      const std::vector<std::string>& figures, const std::vector<std::string>& absent) {
    Result r = run_command("python3 bench/throughput.py --dir " + dir + " --out " + out + names);
    EXPECT_EQ(r.code, 0) << r.output;
    for (const std::string& f : figures) EXPECT_NE(r.output.find(f), std::string::npos) << dir << ": " << f << "\n" << r.output;
    for (const std::string& f : absent) EXPECT_EQ(r.output.find(f), std::string::npos) << dir << ": " << f << "\n" << r.output;
}

// make throughput (bench/throughput.sh, bench/throughput.py): the short run a full-depth plan asks
// for, one layer of each kind, and the committed runs' figures recomputed from their logs (what
// docs/results.md and docs/history.md report).
TEST(Throughput, RunShapesAndCommittedFigures) {
    if (!have_binary()) GTEST_SKIP() << "./train not built";
    if (run_command("python3 --version").code != 0) GTEST_SKIP() << "no python3";
    const std::string flags = "--plan --sim-world 8 --stage 7 --ckpt=selective --config llama3.1-8b --mem-cap-gib 80";
    auto shape = [&](const std::string& more, const std::string& base = "", const std::string& shape_flags = "") {
        const std::string path = testing::TempDir() + "throughput.plan.txt";
        Result plan = run_command("./train " + (base.empty() ? flags : base) + " " + more + " > " + path);
        EXPECT_EQ(plan.code, 0) << plan.output;
        Result r = run_command("python3 bench/throughput.py --run-shape " + path + shape_flags);
        EXPECT_EQ(r.code, 0) << r.output;
        return r.output;
    };
    // 5M: 15 host, 11 rebuilt, 5 device, the slot: host, rebuilt, slot; 2 block inputs and 2 outputs on the host.
    EXPECT_EQ(shape("--seq-len 5M"), "3 2 2 host,rebuilt,slot\n");
    // RUN_REBUILT=0: the rebuilt layer left out (estimated from the host layer), one output less.
    EXPECT_EQ(shape("--seq-len 5M", "", " --no-rebuilt"), "2 2 1 host,slot\n");
    EXPECT_EQ(shape("--seq-len 3M"), "2 2 1 host,slot\n");
    EXPECT_EQ(shape("--seq-len 5M --rebuild-inputs 0 --host-mem-gib 200"), "3 3 1 host,rerun,slot\n");
    // A rerun layer whose input is rebuilt (layer 25 here) is timed as a rerun layer plus the rebuild.
    EXPECT_EQ(shape("--seq-len 5M --host-mem-gib 225"), "4 3 2 host,rebuilt,rerun,slot\n");
    // Stage 6 (plain --ckpt) reruns every layer, the last too: two rerun layers, no slot.
    EXPECT_EQ(shape("--seq-len 3M", "--plan --sim-world 8 --stage 6 --config llama3.1-8b --mem-cap-gib 80"), "2 2 0 rerun,rerun\n");

    const std::string out = testing::TempDir();
    // bench/throughput.py over a committed run's logs: each figure must appear in its tables.
    const std::string eight = " llama3.1-8b_3M llama3.1-8b_4M llama3.1-8b_5M";
    auto recompute = [&](const std::string& dir, const std::string& names, std::vector<std::string> figures) {
        recompute_tables("results/throughput/" + dir, out, names, figures, {});
    };
    recompute("8b_3m_4m_5m_rebuilt_inputs", eight, {"| **202.2** |", "| **152.8** |", "| **121.5** |", "15 host, 11 rebuilt, 5 device, 1 slot"});
    recompute("8b_3m_4m_5m_rerun_layer", eight, {"| **200.2** |", "| **150.2** |", "| **109.5** |", "15 host, 5 device, 1 slot, 11 rerun"});
    recompute("3b_3m_4m_5m_8b_3m_whole_weights", " llama3.1-8b_3M llama3.2-3b_3M llama3.2-3b_4M llama3.2-3b_5M",
              {"| **196.0** |", "| **309.2** |", "| **233.8** |", "| **186.9** |", "27 host, 1 slot",
               "| not logged |"});  // no clockref then
    // The runs below were logged with their clock references: the clocks by phase come from the GPU's own samples.
    recompute("8b_3m_4m_5m_whole_weights", eight, {"| **197.8** |", "| **149.1** |", "| **118.9** |", "| 1455 MHz, 693 W / 1650 MHz, 692 W |"});
    recompute("8b_3m_4m_5m_whole_weights/3m_stmatrix", " llama3.1-8b_3M", {"| **200.6** |", "| 647 / 581 | 1575 MHz, 691 W / 1650 MHz, 691 W |"});
    // The stmatrix kernels at every length, 3M on one GPU (and again on another), 4M and 5M on a third.
    recompute("8b_3m_4m_5m_stmatrix", eight, {"| **199.9** |", "| **153.2** |", "| **122.8** |", "| 647 / 584 | 1590 MHz, 691 W / 1672 MHz, 691 W |"});
    recompute("8b_3m_4m_5m_stmatrix/3m_other_gpu", " llama3.1-8b_3M", {"| **202.6** |", "| 645 / 586 | 1560 MHz, 692 W / 1680 MHz, 691 W |"});
    // 3B with the stmatrix kernels, every length on one GPU (its forward at 1455-1575 MHz).
    recompute("3b_3m_4m_5m_stmatrix", " llama3.2-3b_3M llama3.2-3b_4M llama3.2-3b_5M",
              {"| **307.7** |", "| **231.5** |", "| **183.1** |", "| 604 / 579 | 1455 MHz, 692 W / 1650 MHz, 692 W |"});
    recompute("8b_3m_q_registers", " llama3.1-8b_3M", {"| **203.1** |", "| 653 / 584 | 1560 MHz, 692 W / 1680 MHz, 691 W |"});
    // The H100's stage 7, its 5M run without the rebuilt layer (RUN_REBUILT=0). Its host layer's
    // MLP mark ends with the layer, and reads a nanosecond past it from the trace's rounded ts and
    // dur: it still counts as the layer's MLP (0.50 s), and so in the rebuilt layers' estimate.
    recompute("8b_h100_stage7", eight, {"| **193.8** |", "| **147.5** |", "| **117.1** |", "rebuilt 174.8*",
                                        "| llama3.1-8b_5M, host (layer 0) | forward | 42.27 | 41.48 (98.1%) | 10.94; 0.009 | 0.50 |"});
    // The GPU's clocks by phase: 3B at 5M, its step ended at 05:46:12 of the device's clock (Unix
    // 1312 against a reference pairing 05:41:00 with 1000). The forward layers then ran from 05:41:59
    // to 05:43:04, six samples (1560-1605 MHz), and the backward to the end, 19 (1635-1710).
    const std::string fx = out + "clocks/";
    Result made = run_command("mkdir -p " + fx + " && cp results/throughput/3b_3m_4m_5m_8b_3m_whole_weights/llama3.2-3b_5M.* " + fx +
                              " && echo '2026/12/01 05:41:00.000000000 1000.0' > " + fx + "llama3.2-3b_5M.clockref" +
                              " && sed -i 's/}$/, \"end_unix_s\": 1312.0}/' " + fx + "llama3.2-3b_5M.jsonl");
    ASSERT_EQ(made.code, 0) << made.output;
    Result clocks = run_command("python3 bench/throughput.py --dir " + fx + " llama3.2-3b_5M");
    ASSERT_EQ(clocks.code, 0) << clocks.output;
    EXPECT_NE(clocks.output.find("| 1598 MHz, 690 W / 1695 MHz, 691 W |"), std::string::npos) << clocks.output;
}

// The talk's stack like for like (stage 6, every attention rerun) beside UPipe: tokens/s, and the
// attention rate the paper's figure would need with our other costs; Qwen3-32B at 3M and 4M as rank
// 0 of 16, the all-to-alls across two nodes of 8 modelled at 50 GB/s; documents' FLOPs.
TEST(Throughput, LikeForLikeFiguresAndDocuments) {
    if (!have_binary()) GTEST_SKIP() << "./train not built";
    if (run_command("python3 --version").code != 0) GTEST_SKIP() << "no python3";
    const std::string out = testing::TempDir(), dir = "results/throughput/";
    recompute_tables(dir + "8b_stage6_3m_4m_5m", out, " llama3.1-8b_3M llama3.1-8b_4M llama3.1-8b_5M",
                     {"| **159.9** |", "| **120.4** |", "| **96.2** |", "| 32 rerun |",
                      "| llama3.1-8b_3M (paper 166) | 76.81 = 75.27 + 1.53 | 73.96 | 606; 630 |"}, {});
    // The register split 56 / 224 (the 8B run above had 40 / 232).
    recompute_tables(dir + "8b_stage6_3m_registers", out, " llama3.1-8b_3M",
                     {"| **164.2** |", "| llama3.1-8b_3M (paper 166) | 74.75 = 73.23 + 1.52 | 73.96 | 623; 629 |"}, {});
    recompute_tables(dir + "qwen3_32b_3m/stage6", out, " qwen3-32b_3M", {"| **39.8** | 39.6 | UPipe 40.4", "| 64 rerun |"}, {});
    recompute_tables(dir + "qwen3_32b_3m/stage7_selective", out, " qwen3-32b_3M",
                     {"| **50.1** | 49.9 |", "29 host, 27 rebuilt, 7 device, 1 slot"}, {});
    recompute_tables(dir + "qwen3_32b_4m/stage6", out, " qwen3-32b_4M",
                     {"| **30.5** | 30.4 | UPipe 30.0", "| qwen3-32b_4M (paper 30) | 134.26 = 131.71 + 2.55 | 136.50 | 615; 605 |"}, {});
    recompute_tables(dir + "qwen3_32b_4m/stage7_selective", out, " qwen3-32b_4M",
                     {"| **34.1** | 34.1 |", "14 host, 14 rebuilt, 4 device, 1 slot, 31 rerun", "measured rates: 34.1, 38.3;"}, {});
    // With --doc-mask the rates count the documents' pairs: the same logs, read as 48 documents of
    // 64K tokens (1/48 of causal's pairs), give 1/48 of the causal rates (646 / 576); drawn lengths
    // give no FLOP count, and neither is set beside the paper.
    const std::string docs = out + "docs/";
    Result copied = run_command("mkdir -p " + docs + " && cp " + dir + "8b_stage6_3m_4m_5m/llama3.1-8b_3M.* " + docs +
                                " && sed -i 's/--task random/--task copy --doc-lengths 64K,64K --doc-mask/' " + docs +
                                "llama3.1-8b_3M.jsonl");
    ASSERT_EQ(copied.code, 0) << copied.output;
    recompute_tables(docs, out, " llama3.1-8b_3M", {"| 13 / 12 |"}, {"(paper 166)"});
    ASSERT_EQ(run_command("sed -i 's/64K,64K/32K,64K/' " + docs + "llama3.1-8b_3M.jsonl").code, 0);
    recompute_tables(docs, out, " llama3.1-8b_3M", {"(documents the logs do not give: no FLOP count)"}, {});
}

// bench/flex_blocks.py: FlexAttention's block mask for packed documents, made from the documents'
// lengths (what lets the FlexAttention bench reach 1M), against a pair-by-pair classification.
TEST(Throughput, FlexBlockMaskFromDocumentLengths) {
    if (run_command("python3 --version").code != 0) GTEST_SKIP() << "no python3";
    Result r = run_command("python3 bench/flex_blocks.py --check");
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("one-token documents: 16 query blocks agree"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("pair by pair"), std::string::npos) << r.output;
}

TEST(Binary, TrainsAndReportsOutOfMemory) {
    if (!have_binary()) GTEST_SKIP() << "./train not built";
    REQUIRE_GPU();
    Result ok = run_train("--config tiny --seq-len 256 --steps 3 --batch 2");
    EXPECT_EQ(ok.code, 0) << ok.output;
    EXPECT_NE(ok.output.find("step    3/3"), std::string::npos) << ok.output;
    Result oom = run_train("--config small --seq-len 64K --steps 1 --mem-cap-gib 4");
    EXPECT_EQ(oom.code, 3) << oom.output;
    EXPECT_NE(oom.output.find("out of memory"), std::string::npos) << oom.output;
    EXPECT_NE(oom.output.find("the step needs"), std::string::npos) << oom.output;
}

}  // namespace

namespace {

TEST(Ladder, PlannedLadderReproducesTheTalksStory) {
    Options o = parse({"--config", "llama3.1-8b", "--seq-len", "3M", "--sim-world", "8", "--ladder", "--plan"});
    std::vector<LadderRow> rows = ladder_plan(o);
    ASSERT_EQ(rows.size(), 8u);
    for (int k = 0; k <= 4; k++) EXPECT_FALSE(rows[k].fits) << "stage " << k;  // OOM at 3M up to offload
    EXPECT_TRUE(rows[5].fits);                                                // the ALST stack fits
    EXPECT_TRUE(rows[6].fits);                                                // and Untied Ulysses
    EXPECT_TRUE(rows[7].fits);                                                // and our savings
    for (int k = 1; k <= 7; k++) EXPECT_LT(rows[k].total_gib, rows[k - 1].total_gib) << "stage " << k;
    // FSDP: 16 bytes per parameter over N (stage 0 adds its two bf16 unit slots to the same).
    const double states_gib = 16.0 * count_params(config_by_name("llama3.1-8b")) / GiB;
    EXPECT_NEAR(rows[1].gib[MEM_MODEL] * 8, states_gib, 0.001 * states_gib);
    EXPECT_GT(rows[0].gib[MEM_MODEL], states_gib);
    EXPECT_GT(rows[4].host_gib, 0);                                           // offload moves memory to the host
    for (int k = 1; k <= 7; k++) EXPECT_GE(rows[k].longest, rows[k - 1].longest) << "stage " << k;
    // Each row is the plan of that stage's flags.
    for (int k : {5, 6, 7}) {
        Options sk = parse({"--config", "llama3.1-8b", "--seq-len", "3M", "--sim-world", "8", "--stage", std::to_string(k)});
        MemoryPlan p = plan_memory(resolve_config(sk), sk, sk.seq_len);
        EXPECT_NEAR(rows[k].total_gib, p.total_gib(runtime_estimate_gib(8)), 1e-9) << "stage " << k;
    }
    // The talk's story at 5M: only Untied Ulysses (stage 6) fits; our savings fit with less.
    Options five = parse({"--config", "llama3.1-8b", "--seq-len", "5M", "--sim-world", "8", "--ladder", "--plan"});
    std::vector<LadderRow> at5 = ladder_plan(five);
    for (int k = 0; k <= 5; k++) EXPECT_FALSE(at5[k].fits) << "stage " << k << " at 5M";
    EXPECT_TRUE(at5[6].fits);
    EXPECT_TRUE(at5[7].fits);
    EXPECT_LT(at5[7].total_gib, at5[6].total_gib);
    // What each saving of stage 7 takes off stage 6 at 3M, from the formulas of beyond/savings.cu's header
    // (T = 393216 tokens per GPU, D = 4096, V = 128256, 8 GPUs): one offload slot T 2D, Untied's
    // normalized-input gradient T 2D, FSDP's slots and unit gradients 12 bytes x (the table - the
    // largest piece or layer), the logits 2 C_loss V x 2/3 (the ladder plans the lean backward:
    // no dQ sums to move).
    const LlamaConfig c = config_by_name("llama3.1-8b");
    const double T = 393216, D = 4096, V = 128256;
    const ParamLayout pieces = param_layout(c, 0);
    int64_t largest = 0;
    for (int u = 0; u < pieces.num_units(); u++) largest = std::max(largest, pieces.unit_size(u));
    const auto padded = [](double n) { return std::ceil(n / (8 * 128)) * (8 * 128); };  // FSDP pads to N x 128
    const double expected = 2 * T * 2 * D + 12 * (padded(V * D) - padded((double)largest)) + 2.0 * 4096 * V * 2 / 3;
    EXPECT_NEAR((rows[6].total_gib - rows[7].total_gib) * GiB / expected, 1.0, 2e-3)
        << rows[6].total_gib << " - " << rows[7].total_gib;
}

// bench/ncu_wavefronts.py on a made-up source page of two kernels: the second one's wavefronts
// and warp instructions summed by opcode (HGMMA by shape) and divided by --steps; a kernel that is
// not there, or a page without the counters, is a clear error.
TEST(Bench, NcuWavefrontsSumsBySassOpcode) {
    if (run_command("python3 --version").code != 0) GTEST_SKIP() << "no python3";
    const std::string dir = testing::TempDir(), csv = dir + "source_sass.csv", bare = dir + "bare.csv";
    const std::string head = "\"Address\",\"Source\",\"Instructions Executed\",\"L1 Wavefronts Shared\",\"L1 Wavefronts Shared Ideal\"\n";
    std::ofstream(csv) << "\"Kernel Name\",\"void k<(bool)0>(int)\",\n" << head
                       << "\"0x10\",\"LDS.64 R2, [R0]\",\"4\",\"8\",\"8\"\n"
                       << "\"Kernel Name\",\"void k<(bool)1>(int)\",\n" << head
                       << "\"0x10\",\"HGMMA.64x64x16.F32.BF16 R152, gdesc[UR20], RZ, !UPT\",\"16\",\"128\",\"128\"\n"
                       << "\"0x20\",\"HGMMA.64x64x16.F32.BF16 R152, gdesc[UR20], R152, gsb0\",\"16\",\"128\",\"128\"\n"
                       << "\"0x30\",\"@!P0 STS.64 [R3], R4\",\"8\",\"24\",\"16\"\n"
                       << "\"0x40\",\"IMAD.MOV.U32 R1, RZ, RZ, R2\",\"6\",\"0\",\"0\"\n";
    std::ofstream(bare) << "\"Kernel Name\",\"void k<(bool)1>(int)\",\n\"Address\",\"Source\"\n\"0x10\",\"NOP\"\n";
    Result r = run_command("python3 bench/ncu_wavefronts.py " + csv + " --kernel 'k<(bool)1>' --steps 2");
    ASSERT_EQ(r.code, 0) << r.output;
    for (const char* row : {"| HGMMA.64x64x16 | 128.0 | 128.0 | 16.00 |", "| STS | 12.0 | 8.0 | 4.00 |", "| all | 140.0 | 136.0 | 23.00 |"})
        EXPECT_NE(r.output.find(row), std::string::npos) << row << "\n" << r.output;
    EXPECT_EQ(r.output.find("LDS"), std::string::npos) << r.output;  // the other kernel's
    Result missing = run_command("python3 bench/ncu_wavefronts.py " + csv + " --kernel 'k<(bool)2>'");
    EXPECT_NE(missing.code, 0);
    EXPECT_NE(missing.output.find("no kernel matching"), std::string::npos) << missing.output;
    Result no_counters = run_command("python3 bench/ncu_wavefronts.py " + bare + " --kernel 'k<(bool)1>'");
    EXPECT_NE(no_counters.code, 0);
    EXPECT_NE(no_counters.output.find("lacks the columns"), std::string::npos) << no_counters.output;
}

// bench/schedule_sim.cpp, the model behind docs/attention.md's leads for the fused backward with
// documents (3B heads at 128K): with the fp32 dQ sums in L2, the kernel's walk (down from each
// document's end) keeps a document's blocks on one tile (98.6%); the two earlier walks up from the
// diagonal hit 60.5% (head after head) and a third (all heads of a tile in turn), their blocks
// spread over a document's query tiles. The figures are the ones docs/attention.md quotes.
TEST(Bench, ScheduleModelOfTheDocumentsOrders) {
    if (!std::ifstream("build/schedule_sim").good()) GTEST_SKIP() << "build/schedule_sim not built";
    const std::string run = "build/schedule_sim 131072 8 3 ordered 0.01 6 kv 1600 ";
    Result heads = run_command(run + "up-heads 4K,16K,1K,32K,8K,2K 0 1");  // an earlier walk
    ASSERT_EQ(heads.code, 0) << heads.output;
    EXPECT_NE(heads.output.find("1.016 x ideal; L2 hits 60.5%"), std::string::npos) << heads.output;
    EXPECT_NE(heads.output.find("DRAM per step 38.0 KB"), std::string::npos) << heads.output;
    // The sums' adds at L2 priority evict_last (SUMS=2): the sums stay, Q and dO miss.
    Result last = run_command(run + "up-heads 4K,16K,1K,32K,8K,2K 0 2");
    ASSERT_EQ(last.code, 0) << last.output;
    EXPECT_NE(last.output.find("sums: L2 hits 98.8%; DRAM per step 32.5 KB (Q/dO 31.7, sums 0.7)"), std::string::npos)
        << last.output;
    Result tiles = run_command(run + "tiles 4K,16K,1K,32K,8K,2K 0 1");  // the walk before it
    ASSERT_EQ(tiles.code, 0) << tiles.output;
    EXPECT_NE(tiles.output.find("1.016 x ideal; L2 hits 32.9%"), std::string::npos) << tiles.output;
    EXPECT_NE(tiles.output.find("DRAM per step 64.4 KB"), std::string::npos) << tiles.output;
    Result first = run_command(run + "down 4K,16K,1K,32K,8K,2K 0 1");  // the kernel's walk
    ASSERT_EQ(first.code, 0) << first.output;
    EXPECT_NE(first.output.find("L2 hits 98.6%"), std::string::npos) << first.output;
    // The same walk, other grids: key tile by key tile across the KV heads keeps most hits; the
    // longest walks first over all documents (GRID=lpt) start each document's blocks apart, and
    // its sums leave L2 between a block and the next.
    const std::string grid = "build/schedule_sim 131072 8 3 ordered 0.01 6 ";
    Result kt = run_command(grid + "kt 1600 down 4K,16K,1K,32K,8K,2K 0 1");
    ASSERT_EQ(kt.code, 0) << kt.output;
    EXPECT_NE(kt.output.find("1.008 x ideal; L2 hits 93.2%"), std::string::npos) << kt.output;
    Result lpt = run_command(grid + "lpt 1600 down 4K,16K,1K,32K,8K,2K 0 1");
    ASSERT_EQ(lpt.code, 0) << lpt.output;
    EXPECT_NE(lpt.output.find("1.005 x ideal; L2 hits 72.2%"), std::string::npos) << lpt.output;
    Result unsafe = run_command(grid + "lpt 1600 up-heads 4K,16K,1K,32K,8K,2K 0 1");
    EXPECT_EQ(unsafe.code, 2) << unsafe.output;
    Result walk = run_command(run + "sideways");
    EXPECT_EQ(walk.code, 2);
    EXPECT_NE(walk.output.find("WALK is heads, tiles, up-heads or down"), std::string::npos) << walk.output;
    Result bad = run_command(run + "down 4K,100");
    EXPECT_EQ(bad.code, 2);
    EXPECT_NE(bad.output.find("positive multiples of 128"), std::string::npos) << bad.output;
}

TEST(Ladder, RefusesWhatUlyssesCannotSplit) {
    std::vector<LadderRow> rows = ladder_plan(parse({"--config", "tiny", "--seq-len", "1001", "--sim-world", "8"}));
    EXPECT_TRUE(rows[1].refused.empty());
    EXPECT_NE(rows[2].refused.find("not divisible"), std::string::npos) << rows[2].refused;
}

TEST(Binary, LadderPlanNeedsNoGpu) {
    if (!have_binary()) GTEST_SKIP() << "./train not built";
    Result r = run_train("--ladder --plan --config llama3.2-3b --seq-len 3M --sim-world 8");
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("OOM, needs"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("fits"), std::string::npos) << r.output;
    if (!gpu_available()) {  // the measured ladder needs one, and says so in one line
        Result m = run_train("--ladder --config tiny");
        EXPECT_EQ(m.code, 1) << m.output;
        EXPECT_NE(m.output.find("no CUDA GPU"), std::string::npos) << m.output;
        EXPECT_EQ(std::count(m.output.begin(), m.output.end(), '\n'), 1) << m.output;
    }
}

// What a newcomer runs into. Every output path is checked before any work, the ladder refuses
// the flags it sets itself and plans the talk's node unless told otherwise, and an
// out-of-memory's hint names only what would help this run.
// The run of `args` ended with `code` and said `text`.
void expect_exit(const std::string& args, int code, const std::string& text) {
    Result r = run_train(args);
    EXPECT_EQ(r.code, code) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(text), std::string::npos) << args << "\n" << r.output;
}

// A training run's outputs, flag by flag and fault by fault, are test_outputs'; here the other
// modes: the ladder's log and a --plan's.
TEST(Binary, UnwritableOutputsAreRefusedBeforeAnyWork) {
    if (!have_binary()) GTEST_SKIP() << "./train not built";
    for (const char* flags : {"--ladder --plan --log /nonexistent/ladder.jsonl",
                              "--plan --config tiny --log /nonexistent/run.jsonl"})
        expect_exit(flags, 2, "'/nonexistent' does not exist");
    expect_exit("--plan --config tiny --log tests", 2, "is a directory, not a file");
}

// The vocabulary pieces (stage 7, beyond/savings.cu): --vocab-pieces sets them, within what a vocabulary
// can be cut into; without it the tables are whole units, as in the talk; the plan shows them in
// the FSDP slots and the logits (one piece's columns).
TEST(Binary, VocabularyPieces) {
    if (!have_binary()) GTEST_SKIP() << "./train not built";
    expect_exit("--plan --config tiny --vocab-pieces 5", 2, "a piece holds at least 128 of the 512 vocabulary rows");
    Result whole = run_train("--plan --config llama3.1-8b --seq-len 8K --chunked");
    Result one = run_train("--plan --config llama3.1-8b --seq-len 8K --chunked --vocab-pieces 1");
    Result auto_pieces = run_train("--plan --config llama3.1-8b --seq-len 8K --chunked --vocab-pieces");
    Result three = run_train("--plan --config llama3.1-8b --seq-len 8K --chunked --vocab-pieces=3");
    ASSERT_EQ(whole.code, 0) << whole.output;
    ASSERT_EQ(auto_pieces.code, 0) << auto_pieces.output;
    EXPECT_DOUBLE_EQ(plan_total_gib(whole.output), plan_total_gib(one.output));
    EXPECT_DOUBLE_EQ(plan_total_gib(auto_pieces.output), plan_total_gib(three.output));
    EXPECT_NE(auto_pieces.output.find("--vocab-pieces"), std::string::npos) << auto_pieces.output;  // the techniques line
    // 8B: three pieces, so the two bf16 unit slots hold a layer (2 x 0.41 GiB) instead of a whole
    // table (2 x 0.98 GiB), and one chunk's logits a third of the vocabulary.
    EXPECT_NEAR(plan_total_gib(whole.output) - plan_total_gib(auto_pieces.output), 2 * (0.979 - 0.406) + 0.979 * 2 / 3,
                0.01);
}

// --host-mem-gib: pinned host memory beyond it is an out-of-memory before any GPU work, and
// --ckpt=selective --offload keeps as many layers' attention outputs as it holds. 8B at 5M on 8
// GPUs: the block inputs take 32 x 5 GiB of the 240, which leave 80 for 15 layers' outputs (5.08
// GiB each); the last layer's stays in its slot. Then the device keeps as many more as fit
// under the cap, less 1 GiB (--device-keep-gib bounds them).
TEST(Binary, HostMemoryBudget) {
    if (!have_binary()) GTEST_SKIP() << "./train not built";
    expect_exit("--config tiny --seq-len 8K --offload --steps 1 --host-mem-gib 0.001", 3, "--host-mem-gib allows");
    const std::string flags = "--plan --sim-world 8 --stage 7 --ckpt=selective --config llama3.1-8b --seq-len 5M --mem-cap-gib 80";
    // Every block input on the host (--rebuild-inputs 0): 160 GiB of them leave 80 for 15 layers' attention outputs.
    const std::string all_inputs = flags + " --rebuild-inputs 0";
    Result host_only = run_train(all_inputs + " --device-keep-gib 0");
    ASSERT_EQ(host_only.code, 0) << host_only.output;
    EXPECT_NE(host_only.output.find("attention kept for 16 of 32 layers (0-14 on the host, 31 in its slot), rerun for layers 15-30\n"),
              std::string::npos) << host_only.output;
    EXPECT_NE(host_only.output.find("host 240.00 GiB (--host-mem-gib): fits"), std::string::npos) << host_only.output;
    // The longest context: 7.5M tokens need exactly 240 GiB of block inputs; the device would hold more.
    EXPECT_NE(host_only.output.find("7864320 tokens (7.50M); host memory binds"), std::string::npos) << host_only.output;

    // The room under the cap: 80 GiB less the plan's total (the runtime estimate included) and the 1 GiB margin.
    const double input = 5.0, per_layer = 5.0 + 4.0 * 5 * (1 << 20) * 4 / (1 << 30);  // att, and lse of 4 heads, GiB
    const double room = 80 - plan_total_gib(host_only.output) - 1.0;
    const int D = (int)(room / per_layer);
    ASSERT_GE(D, 1) << room;
    Result r = run_train(all_inputs);
    ASSERT_EQ(r.code, 0) << r.output;
    const std::string kept = "attention kept for " + std::to_string(16 + D) + " of 32 layers (0-14 on the host, " +
                             std::to_string(31 - D) + "-30 on the device, 31 in its slot), rerun for layers 15-" +
                             std::to_string(30 - D) + "\n";
    EXPECT_NE(r.output.find(kept), std::string::npos) << kept << "\n" << r.output;
    EXPECT_NEAR(plan_total_gib(r.output) - plan_total_gib(host_only.output), D * per_layer, 0.01);
    EXPECT_NE(r.output.find("cap 80.00 GiB: fits"), std::string::npos) << r.output;
    Result two = run_train(all_inputs + " --device-keep-gib 10.2");  // two layers' worth
    EXPECT_NE(two.output.find("(0-14 on the host, 29-30 on the device, 31 in its slot), rerun for layers 15-28\n"),
              std::string::npos) << two.output;

    // Rebuilt inputs (the default): each input left off the host makes room for one more attention
    // output, as few as keep the most: with the device's D, every layer keeps its own.
    int n = 0, K = 15;
    while (K + D < 31) n++, K = (int)((240 - (32 - n) * input) / per_layer);
    Result rebuilt = run_train(flags);
    ASSERT_EQ(rebuilt.code, 0) << rebuilt.output;
    const std::string all = "attention kept for 32 of 32 layers (0-" + std::to_string(K - 1) + " on the host, " +
                            std::to_string(K) + "-30 on the device, 31 in its slot), rerun for none; block inputs "
                            "rebuilt for layers 1, 3, .., " + std::to_string(2 * n - 1) + "\n";
    EXPECT_NE(rebuilt.output.find(all), std::string::npos) << all << "\n" << rebuilt.output;
    EXPECT_NEAR(plan_total_gib(rebuilt.output), plan_total_gib(r.output) + (31 - K - D) * per_layer, 0.01);
    EXPECT_NE(rebuilt.output.find("host 240.00 GiB (--host-mem-gib): fits"), std::string::npos) << rebuilt.output;
    // On the host alone, 15 inputs rebuilt (layers 1-29, each one's lower neighbour keeps both) hold 30 layers'.
    Result alone = run_train(flags + " --device-keep-gib 0");
    EXPECT_NE(alone.output.find("attention kept for 31 of 32 layers (0-29 on the host, 31 in its slot), rerun for "
                                "layer 30; block inputs rebuilt for layers 1, 3, .., 29\n"),
              std::string::npos) << alone.output;
    // At 32K a rebuild (Wo and the MLP of a layer) costs more than the attention forward it saves,
    // so by default none; asked for, two inputs off the host (0.25 GiB each) make room for one
    // more attention output (0.254 GiB).
    const std::string short_ctx = "--plan --config llama3.1-8b --seq-len 32K --ckpt=selective --offload --host-mem-gib 10.54";
    Result by_default = run_train(short_ctx);
    EXPECT_NE(by_default.output.find("attention kept for 11 of 32 layers (0-9 on the host, 31 in its slot), rerun for "
                                     "layers 10-30\n"), std::string::npos) << by_default.output;
    Result asked = run_train(short_ctx + " --rebuild-inputs 2");
    EXPECT_NE(asked.output.find("attention kept for 12 of 32 layers (0-10 on the host, 31 in its slot), rerun for "
                                "layers 11-30; block inputs rebuilt for layers 1 and 3\n"), std::string::npos) << asked.output;
}

TEST(Ladder, RefusesTheFlagsItSetsItself) {
    if (!have_binary()) GTEST_SKIP() << "./train not built";
    for (const char* flags : {"--stage 3", "--fsdp", "--ulysses", "--ckpt", "--ckpt=selective", "--offload",
                              "--chunked", "--untied=2"})
        expect_exit(std::string("--ladder --plan --config tiny ") + flags, 2, "--ladder runs every stage itself");
}

TEST(Ladder, PlansTheTalksNodeUnlessToldOtherwise) {
    if (!have_binary()) GTEST_SKIP() << "./train not built";
    Result r = run_train("--ladder --plan --config llama3.1-8b --seq-len 3M");
    ASSERT_EQ(r.code, 0) << r.output;
    const std::string first = r.output.substr(0, r.output.find('\n'));
    EXPECT_NE(first.find("8 GPUs (the talk's node"), std::string::npos) << first;
    EXPECT_NE(r.output.find("\n6     --untied"), std::string::npos) << r.output;
    EXPECT_EQ(parse({"--config", "tiny", "--ladder", "--plan"}).gpus_given, false);
    Result one = run_train("--ladder --plan --config tiny --seq-len 4K --sim-world 1");
    ASSERT_EQ(one.code, 0) << one.output;
    EXPECT_NE(one.output.find(", 1 GPU, cap"), std::string::npos) << one.output;
    // The planned rows are the same as with the node given explicitly.
    Result eight = run_train("--ladder --plan --config llama3.1-8b --seq-len 3M --nproc 8");
    EXPECT_EQ(r.output.substr(r.output.find("\nstage")), eight.output.substr(eight.output.find("\nstage")));
}

TEST(Binary, OutOfMemoryHintNamesWhatHelps) {
    if (!have_binary()) GTEST_SKIP() << "./train not built";
    Result one = run_train("--plan --config llama3.1-8b --seq-len 64K --mem-cap-gib 80");
    EXPECT_NE(one.output.find("(next: add --ckpt,"), std::string::npos) << one.output;  // no --fsdp on one GPU
    Result eight = run_train("--plan --config llama3.1-8b --seq-len 3M --sim-world 8 --mem-cap-gib 80");
    EXPECT_NE(eight.output.find("(next: add --fsdp,"), std::string::npos) << eight.output;
}

TEST(Binary, NoGpuIsSaidOnceInOneLine) {
    if (!have_binary()) GTEST_SKIP() << "./train not built";
    if (gpu_available()) GTEST_SKIP() << "this machine has a GPU";
    for (const char* flags : {"--config tiny --steps 1", "--nproc 2 --config tiny --steps 1"}) {
        Result r = run_train(flags);
        EXPECT_EQ(r.code, 1) << r.output;
        EXPECT_EQ(r.output.find("insufficient"), std::string::npos) << r.output;
        const size_t at = r.output.find("error: no CUDA GPU");
        ASSERT_NE(at, std::string::npos) << r.output;
        EXPECT_EQ(r.output.find("no CUDA GPU", at + 18), std::string::npos) << flags << "\n" << r.output;  // once
        const std::string line = r.output.substr(at, r.output.find('\n', at) - at);  // and whole in one line
        EXPECT_NE(line.find("--plan"), std::string::npos) << flags << "\n" << r.output;
    }
}

// The measured ladder (GPU): every stage runs, and what it allocates agrees with its plan.
TEST(Binary, MeasuredLadderAgreesWithThePlan) {
    if (!have_binary()) GTEST_SKIP() << "./train not built";
    REQUIRE_GPU();
    Result r = run_train("--ladder --config tiny --seq-len 256 --steps 1 --sim-world 2 --task random");
    EXPECT_EQ(r.code, 0) << r.output;
    int rows = 0;
    for (size_t p = 0; (p = r.output.find("%", p)) != std::string::npos; p++) {
        size_t b = r.output.rfind(' ', p - 1);
        double diff = std::atof(r.output.c_str() + b + 1);
        EXPECT_LT(std::fabs(diff), 3.0) << r.output;
        rows++;
    }
    EXPECT_EQ(rows, 8) << r.output;  // stages 0..7 all ran a step
    // The fused backward where the fast kernels do not run (head dim 64): one usage error up
    // front, not one per stage.
    Result f = run_train("--ladder --config tiny --seq-len 256 --steps 1 --sim-world 2 --task random --attention fused");
    EXPECT_EQ(f.code, 2) << f.output;
    size_t said = 0;
    for (size_t p = 0; (p = f.output.find("needs the fast kernels", p)) != std::string::npos; p++) said++;
    EXPECT_EQ(said, 1u) << f.output;
}

}  // namespace

namespace {

TEST(Untied, ChunkSizesThatDoNotFitAreUsageErrors) {
    LlamaConfig c8 = config_by_name("llama3.1-8b");  // 32 query heads, 8 KV heads: GQA groups of 4
    RunShape sh;
    sh.seq = 1 << 20, sh.sp = 8;                      // 4 query heads per GPU
    for (int k : {1, 2, 4}) EXPECT_EQ(fatal_code([&] { untied_check(c8, sh, k); }), -1) << k;
    EXPECT_EQ(fatal_code([&] { untied_check(c8, sh, 3); }), EXIT_USAGE);
    EXPECT_EQ(fatal_code([&] { untied_check(c8, sh, 8); }), EXIT_USAGE);
    LlamaConfig c3 = config_by_name("llama3.2-3b");   // 24 / 8: groups of 3, 3 query heads per GPU
    EXPECT_EQ(fatal_code([&] { untied_check(c3, sh, 3); }), -1);
    EXPECT_EQ(fatal_code([&] { untied_check(c3, sh, 2); }), EXIT_USAGE);
    Options o = parse({"--untied=2"});
    EXPECT_EQ(o.step.untied, 2);
    EXPECT_TRUE(o.step.ckpt);  // implied
    EXPECT_EQ(parse({"--stage", "6"}).step.untied, 1);
    EXPECT_EQ(fatal_code([] { parse({"--untied=0"}); }), EXIT_USAGE);
}

// The untied attention working set shrinks with K, the rest stays.
TEST(Untied, PlanShrinksWithSmallerChunks) {
    Options o = parse({"--config", "llama3.1-8b", "--seq-len", "3M", "--sim-world", "8", "--stage", "5"});
    LlamaConfig c = resolve_config(o);
    double plain = plan_memory(c, o, o.seq_len).arena.category_bytes(MEM_ATTENTION);
    double prev = 0;
    for (int k : {4, 2, 1}) {
        o.step.untied = k;
        double att = plan_memory(c, o, o.seq_len).arena.category_bytes(MEM_ATTENTION);
        if (prev > 0) {
            EXPECT_LT(att, prev) << "K " << k;
        }
        prev = att;
    }
    EXPECT_LT(prev, 0.75 * plain);  // K = 1 against plain Ulysses
}

// --mem-trace (GPU): one line per progress event of the last step; GPU times that never go back;
// without offload the saved activations fill over the forward and empty over the backward; with
// --offload they live on the host instead, which holds nothing at the step's start and end.
TEST(Binary, MemTraceFollowsTheStep) {
    if (!have_binary()) GTEST_SKIP() << "./train not built";
    REQUIRE_GPU();
    const int L = 3;
    auto trace = [&](const std::string& flags) {
        const std::string path = "/tmp/test_mem_trace_" + std::to_string(getpid()) + ".jsonl";
        Result r = run_train("--config tiny --layers 3 --seq-len 1024 --steps 1 " + flags + " --mem-trace " + path);
        EXPECT_EQ(r.code, 0) << r.output;
        std::vector<std::string> lines;
        std::ifstream f(path);
        for (std::string line; std::getline(f, line);) lines.push_back(line);
        unlink(path.c_str());
        return lines;
    };
    auto number = [](const std::string& line, const std::string& key) {
        size_t p = line.find("\"" + key + "\": ");
        return p == std::string::npos ? NAN : std::atof(line.c_str() + p + key.size() + 4);
    };
    std::vector<std::string> plain = trace("");
    ASSERT_EQ(plain.size(), 1u + 2 * L + 2);  // the run, start, L forwards, the head, L backwards
    for (size_t i = 2; i < plain.size(); i++) EXPECT_GE(number(plain[i], "t_ms"), number(plain[i - 1], "t_ms"));
    const double start = number(plain[1], "other"), head = number(plain[1 + L + 1], "other");
    EXPECT_GT(head, start);                                   // activations saved layer by layer
    EXPECT_DOUBLE_EQ(number(plain.back(), "other"), start);   // and all released
    std::vector<std::string> off = trace("--ckpt --offload");
    ASSERT_EQ(off.size(), 1u + 2 * L + 2);
    EXPECT_EQ(number(off[1], "host_gib"), 0.0);
    EXPECT_GT(number(off[1 + L + 1], "host_gib"), 0.0);
    EXPECT_EQ(number(off.back(), "host_gib"), 0.0);
    EXPECT_DOUBLE_EQ(number(off[1], "other"), number(off[1 + L + 1], "other"));  // flat on the device
}

// ---------------------------------------------------------------------------------------------
// Held-out evaluation (--eval-data, infra/evaluate.cpp).
TEST(Evaluation, BucketsDoubleFromOneK) {
    EXPECT_EQ(PositionLosses::bucket(1), 0);
    EXPECT_EQ(PositionLosses::bucket(1024), 0);
    EXPECT_EQ(PositionLosses::bucket(1025), 1);
    EXPECT_EQ(PositionLosses::bucket(2048), 1);
    EXPECT_EQ(PositionLosses::bucket(2049), 2);
    EXPECT_EQ(PositionLosses::bucket((int64_t)3 << 20), 12);  // 2M-4M
    EXPECT_EQ(PositionLosses::label(0), "1-1K");
    EXPECT_EQ(PositionLosses::label(1), "1K-2K");
    EXPECT_EQ(PositionLosses::label(6), "32K-64K");
    EXPECT_EQ(PositionLosses::label(11), "1M-2M");
    // Evenly spaced windows, the first at 0, the last ending at the file's end; a file of one
    // window gives one.
    EXPECT_EQ(eval_offsets(1000, 99, 4), (std::vector<uint64_t>{0, 300, 600, 900}));
    EXPECT_EQ(eval_offsets(100, 99, 8), (std::vector<uint64_t>{0}));
    EXPECT_EQ(fatal_code([] { parse({"--eval-every", "5"}); }), EXIT_USAGE);  // needs --eval-data
    EXPECT_EQ(fatal_code([] { parse({"--eval-only"}); }), EXIT_USAGE);
    EXPECT_EQ(fatal_code([] { parse({"--eval-data", "f", "--sim-world", "8"}); }), EXIT_USAGE);
    EXPECT_EQ(fatal_code([] { parse({"--eval-windows", "8"}); }), EXIT_USAGE);  // the default, given: still needs --eval-data
    EXPECT_EQ(fatal_code([] { parse({"--eval-data", "f", "--ladder"}); }), EXIT_USAGE);
    EXPECT_EQ(fatal_code([] { parse({"--eval-data", "f", "--eval-only", "--dump", "d"}); }), EXIT_USAGE);
    EXPECT_EQ(parse({"--eval-data", "f"}).eval_windows, 8);
}

// The eval records of a log: the "positions" tokens and losses of the last one, and its loss.
struct EvalRecord {
    double loss = NAN;
    std::vector<double> tokens, losses;
    int records = 0;
};
EvalRecord read_eval(const std::string& log) {
    EvalRecord e;
    std::ifstream f(log);
    for (std::string line; std::getline(f, line);) {
        if (line.find("\"type\": \"eval\"") == std::string::npos) continue;
        e.records++, e.tokens.clear(), e.losses.clear();
        e.loss = std::atof(line.c_str() + line.find("\"loss\": ") + 8);
        for (size_t p = line.find("\"label\""); p != std::string::npos; p = line.find("\"label\"", p + 1)) {
            e.tokens.push_back(std::atof(line.c_str() + line.find("\"tokens\": ", p) + 10));
            e.losses.push_back(std::atof(line.c_str() + line.find("\"loss\": ", p) + 8));
        }
    }
    return e;
}

std::vector<std::string> step_lines(const std::string& log) {
    std::vector<std::string> steps;
    std::ifstream f(log);
    for (std::string line; std::getline(f, line);)
        if (line.find("\"type\": \"step\"") != std::string::npos) steps.push_back(line.substr(0, line.find("\"lr\"")));
    return steps;
}

// One window of 4,096 tokens at offset 0 of a file of 1,000-token documents: positions 1-1K,
// 1K-2K and 2K-4K hold 1,024, 1,024 and 2,048 targets. Under --doc-mask a document's last target
// (the next one's first token) is not scored, and every position counts from its document's
// start: all 4,092 in 1-1K. The same
// numbers under every stage one GPU runs, bit for bit where the kernels are the same (stages 0,
// 3, 4). Evaluating never changes training: the steps' losses with and without it are the same.
TEST(Binary, EvaluationByPositionUnderEveryStage) {
    if (!have_binary()) GTEST_SKIP() << "./train not built";
    REQUIRE_GPU();
    const std::string file = write_documents_file("/tmp/test_eval_" + std::to_string(getpid()) + ".tok", 6000, 1000),
                      log = "/tmp/test_eval_" + std::to_string(getpid()) + ".jsonl";
    const std::string base = "--config tiny-hd128 --seq-len 4096 --data " + file + " --eval-data " + file + " --log " + log;
    auto eval = [&](const std::string& flags) {
        Result r = run_train(base + " " + flags);
        EXPECT_EQ(r.code, 0) << r.output;
        EXPECT_NE(r.output.find("| by position:  1-1K "), std::string::npos) << r.output;
        return read_eval(log);
    };
    EvalRecord plain = eval("--eval-only --eval-windows 1");
    EXPECT_EQ(plain.records, 1);
    EXPECT_EQ(plain.tokens, (std::vector<double>{1024, 1024, 2048}));
    EvalRecord docs = eval("--eval-only --eval-windows 1 --doc-mask");
    EXPECT_EQ(docs.tokens, (std::vector<double>{4092}));
    for (const char* stage : {"--ckpt", "--ckpt --offload", "--stage 5", "--stage 6", "--stage 7"})
        for (const char* mask : {"", " --doc-mask"}) {
            SCOPED_TRACE(std::string(stage) + mask);
            const EvalRecord& ref = *mask ? docs : plain;
            EvalRecord e = eval(std::string("--eval-only --eval-windows 1 ") + stage + mask);
            EXPECT_EQ(e.tokens, ref.tokens);
            if (std::string(stage).find("--stage") == std::string::npos) {
                EXPECT_EQ(e.losses, ref.losses);
            }
            for (size_t b = 0; b < e.losses.size() && b < ref.losses.size(); b++)
                EXPECT_NEAR(e.losses[b], ref.losses[b], 1e-3 * ref.losses[b]);
        }
    // Windows that cut into documents: 3,000-token documents, windows at 0 and 7,903. Positions
    // count from the part of the document the window holds (the tokens before it are not seen).
    const std::string cut = write_documents_file("/tmp/test_eval_cut_" + std::to_string(getpid()) + ".tok", 12000, 3000);
    Result r = run_train("--config tiny-hd128 --seq-len 4096 --eval-data " + cut + " --eval-only --eval-windows 2 --doc-mask --log " + log);
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(read_eval(log).tokens, (std::vector<double>{4096, 2192, 1902}));
    unlink(cut.c_str());
    Result without = run_train("--config tiny-hd128 --seq-len 4096 --data " + file + " --steps 4 --log " + log);
    EXPECT_EQ(without.code, 0) << without.output;
    const std::vector<std::string> steps = step_lines(log);
    EvalRecord during = eval("--steps 4 --eval-every 2 --eval-windows 3");
    EXPECT_EQ(during.records, 2);  // after step 2, and after the last
    EXPECT_EQ(step_lines(log), steps);
    EXPECT_EQ(steps.size(), 4u);
    unlink(file.c_str()), unlink(log.c_str());
}

}  // namespace
