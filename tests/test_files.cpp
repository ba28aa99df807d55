// tests/test_files.cpp - Hugging Face checkpoints (round trips, FSDP shards, sharded index files,
// corrupt and mismatched files; config.json's dtype and its RoPE settings in either layout), token
// files, and resuming a run (on a GPU): a resumed run, also after a kill, computes exactly the
// losses of an uninterrupted one.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <sstream>

#include "../io/input_files.h"
#include "../llama.h"
#include "../infra/train.h"
#include "files_util.h"
#include "test_util.h"

namespace {

TEST(HfCheckpoint, RoundTripsEveryTensorOnEveryShard) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    for (const char* name : {"tiny", "tiny-untied", "tiny-qwen3"})
        for (bool bf16 : {false, true}) {
            SCOPED_TRACE(std::string(name) + (bf16 ? " bf16" : " fp32"));
            LlamaConfig c = config_by_name(name);
            std::vector<float> p = random_params(param_layout(c), rng);
            std::string dir = tmpdir("rt");
            write_checkpoint(dir, c, p, bf16);
            for (int world : {1, 2, 3})
                for (int rank = 0; rank < world; rank++) {
                    DryModel dm(c, world > 1, world, rank);
                    EXPECT_EQ(read_hf_weights(dm.m, dir), expected_local(dm.m, p, bf16)) << "world " << world << " rank " << rank;
                }
            std::string msg;
            EXPECT_EQ(fatal_code([&] { check_hf_config(c, read_text_file(dir + "/config.json"), "config.json"); }), -1);
        }
}

TEST(HfCheckpoint, ShardedIndexIsRead) {
    std::mt19937_64 rng(fresh_seed());
    LlamaConfig c = config_by_name("tiny-untied");
    std::vector<float> p = random_params(param_layout(c), rng);
    std::string one = tmpdir("one"), two = tmpdir("two");
    write_checkpoint(one, c, p, false);
    // Split into two files by hand: the same tensors, half in each, and an index.
    std::ifstream f(one + "/model.safetensors", std::ios::binary);
    std::string all((std::istreambuf_iterator<char>(f)), {});
    uint64_t hlen;
    memcpy(&hlen, all.data(), 8);
    std::string header = all.substr(8, hlen), data = all.substr(8 + hlen);
    // Reuse the writer's header: file A holds everything, file B an empty-data copy; the index
    // sends the layers' tensors to A and the rest to B (whose header lists them too).
    std::ofstream(two + "/a.safetensors", std::ios::binary) << all;
    std::ofstream(two + "/b.safetensors", std::ios::binary) << all;
    std::string index = "{\"metadata\": {}, \"weight_map\": {\"model.embed_tokens.weight\": \"b.safetensors\", "
                        "\"model.norm.weight\": \"a.safetensors\"}}";
    std::ofstream(two + "/model.safetensors.index.json") << index;
    std::ofstream(two + "/config.json") << hf_config_json(c, false);
    DryModel dm(c, false, 1, 0);
    EXPECT_EQ(read_hf_weights(dm.m, two), expected_local(dm.m, p, false));
}


TEST(HfCheckpoint, CorruptAndMismatchedFilesAreUsageErrorsNamingTheProblem) {
    LlamaConfig c = config_by_name("tiny-untied");
    DryModel dm(c, false, 1, 0);
    std::string dir = tmpdir("bad"), file = dir + "/model.safetensors";
    auto expect_error = [&](const std::string& what, const std::string& needle) {
        SCOPED_TRACE(what);
        std::string msg;
        EXPECT_EQ(fatal_code([&] { check_hf_checkpoint(dm.m, file); }, &msg), EXIT_USAGE);
        EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    };
    auto e = correct_entries(c);
    write_st(file, e);
    EXPECT_EQ(fatal_code([&] { check_hf_checkpoint(dm.m, file); }), -1);  // the correct one passes

    {  // truncated: the last tensor's bytes are cut off
        std::ifstream in(file, std::ios::binary);
        std::string all((std::istreambuf_iterator<char>(in)), {});
        std::ofstream(file, std::ios::binary) << all.substr(0, all.size() - 100);
        expect_error("truncated", "lm_head.weight");
    }
    {
        auto bad = e;
        bad[2].second.shape = {c.q_dim() + 64, c.dim};  // q_proj of layer 0 too tall
        bad[2].second.bytes = (size_t)(c.q_dim() + 64) * c.dim * 4;
        write_st(file, bad);
        expect_error("wrong shape", "model.layers.0.self_attn.q_proj.weight");
    }
    {
        auto bad = e;
        bad.erase(bad.begin() + 8);  // layer 0 up_proj (after embed, norm, q, k, v, o, norm, gate)
        write_st(file, bad);
        expect_error("missing tensor", "model.layers.0.mlp.up_proj.weight");
    }
    {
        auto bad = e;
        bad.push_back({"model.layers.9.mlp.up_proj.weight", {"F32", {4}, 16}});
        write_st(file, bad);
        expect_error("unexpected tensor", "model.layers.9.mlp.up_proj.weight");
    }
    {
        auto bad = e;
        bad[1].second.dtype = "I8";
        bad[1].second.bytes = (size_t)c.dim;
        write_st(file, bad);
        expect_error("dtype", "I8");
    }
    {
        std::ofstream f(file, std::ios::binary);
        uint64_t n = 1ull << 40;
        f.write((char*)&n, 8);
        f << "{}";
        f.close();
        expect_error("header length", "header length");
    }
    {
        uint64_t n = 5;
        std::ofstream f(file, std::ios::binary);
        f.write((char*)&n, 8);
        f << "{\"a\":";
        f.close();
        expect_error("broken JSON", "malformed JSON");
    }
    {  // a config.json that contradicts --config
        write_st(file, e);
        LlamaConfig other = c;
        other.dim = 256;
        std::ofstream(dir + "/config.json") << hf_config_json(other, false);
        std::string msg;
        EXPECT_EQ(fatal_code([&] { check_hf_checkpoint(dm.m, dir); }, &msg), EXIT_USAGE);
        EXPECT_NE(msg.find("hidden_size"), std::string::npos) << msg;
    }
}

// A Qwen3 checkpoint needs its per-head norms: a Llama checkpoint of the same shape is refused,
// naming the first one missing; a norm of the wrong size is named too.
TEST(HfCheckpoint, Qwen3NeedsItsHeadNorms) {
    const LlamaConfig c = config_by_name("tiny-qwen3");
    DryModel dm(c, false, 1, 0);
    const std::string file = tmpdir("qwen3") + "/model.safetensors";
    auto e = correct_entries(c);
    write_st(file, e);
    std::string msg;
    EXPECT_EQ(fatal_code([&] { check_hf_checkpoint(dm.m, file); }, &msg), -1) << msg;
    LlamaConfig llama = c;
    llama.family = Family::LLAMA;
    write_st(file, correct_entries(llama));
    EXPECT_EQ(fatal_code([&] { check_hf_checkpoint(dm.m, file); }, &msg), EXIT_USAGE);
    EXPECT_NE(msg.find("model.layers.0.self_attn.q_norm.weight"), std::string::npos) << msg;
    for (auto& entry : e)
        if (entry.first == "model.layers.1.self_attn.k_norm.weight") entry.second.shape = {64}, entry.second.bytes = 256;
    write_st(file, e);
    EXPECT_EQ(fatal_code([&] { check_hf_checkpoint(dm.m, file); }, &msg), EXIT_USAGE);
    EXPECT_NE(msg.find("model.layers.1.self_attn.k_norm.weight"), std::string::npos) << msg;
}

// ---------------------------------------------------------------------------------------------
// config.json: the dtype it names, and its RoPE settings wherever transformers keeps them.

// Every string value of "key" in a JSON text, in order.
std::vector<std::string> json_strings(const std::string& text, const std::string& key) {
    std::vector<std::string> out;
    std::regex re("\"" + key + "\"\\s*:\\s*\"([^\"]*)\"");
    for (std::sregex_iterator it(text.begin(), text.end(), re), end; it != end; ++it) out.push_back((*it)[1]);
    return out;
}

TEST(HfConfig, NamesTheDtypeTheWeightsWereSavedIn) {
    std::mt19937_64 rng(fresh_seed());
    LlamaConfig c = config_by_name("tiny-untied");
    std::vector<float> p = random_params(param_layout(c), rng);
    for (bool bf16 : {false, true}) {
        SCOPED_TRACE(bf16 ? "bf16" : "fp32");
        std::string dir = tmpdir(bf16 ? "dtype16" : "dtype32");
        write_checkpoint(dir, c, p, bf16);
        std::string st = read_text_file(dir + "/model.safetensors");
        uint64_t hlen;
        memcpy(&hlen, st.data(), 8);
        std::vector<std::string> tensors = json_strings(st.substr(8, hlen), "dtype");
        ASSERT_EQ(tensors.size(), correct_entries(c).size());
        const std::string want = bf16 ? "bfloat16" : "float32";
        for (const std::string& d : tensors) EXPECT_EQ(d == "BF16" ? "bfloat16" : d == "F32" ? "float32" : d, want);
        // transformers reads "dtype" (newer) or "torch_dtype" (older): each once, each the tensors' dtype.
        std::string cfg = read_text_file(dir + "/config.json");
        EXPECT_EQ(json_strings(cfg, "dtype"), std::vector<std::string>{want}) << cfg;
        EXPECT_EQ(json_strings(cfg, "torch_dtype"), std::vector<std::string>{want}) << cfg;
    }
}

// What --save-to writes passes the check, for every model, in either dtype, scaled or not.
TEST(HfConfig, OurOwnConfigPassesTheCheck) {
    std::vector<LlamaConfig> all = known_configs();
    LlamaConfig unscaled = config_by_name("tiny");
    unscaled.name = "tiny-unscaled";
    unscaled.rope_scaling.enabled = false;
    all.push_back(unscaled);
    for (const LlamaConfig& c : all)
        for (bool bf16 : {false, true}) {
            std::string msg;
            EXPECT_EQ(fatal_code([&] { check_hf_config(c, hf_config_json(c, bf16), "config.json"); }, &msg), -1)
                << c.name << ": " << msg;
        }
}

// RoPE settings, key -> JSON text, in order.
using RopeKv = std::vector<std::pair<std::string, std::string>>;

std::string jnum(double v) {
    char b[32];
    snprintf(b, sizeof b, "%.10g", v);
    return b;
}

RopeKv good_rope(const LlamaConfig& c) {
    const RopeScaling& s = c.rope_scaling;
    return {{"rope_theta", jnum(c.rope_theta)},
            {"rope_type", "\"llama3\""},
            {"factor", jnum(s.factor)},
            {"low_freq_factor", jnum(s.low_freq_factor)},
            {"high_freq_factor", jnum(s.high_freq_factor)},
            {"original_max_position_embeddings", jnum(s.original_max_pos)}};
}

RopeKv with(RopeKv kv, const std::string& key, const std::string& value) {  // value "" removes the key
    for (size_t i = 0; i < kv.size(); i++)
        if (kv[i].first == key) {
            if (value.empty()) kv.erase(kv.begin() + i);
            else kv[i].second = value;
            return kv;
        }
    if (!value.empty()) kv.push_back({key, value});
    return kv;
}

std::string json_object(const RopeKv& kv) {
    std::string s = "{";
    for (size_t i = 0; i < kv.size(); i++) s += (i ? ", \"" : "\"") + kv[i].first + "\": " + kv[i].second;
    return s + "}";
}

// Meta's files and transformers v4: top-level rope_theta, the rest in rope_scaling.
std::string old_style(const RopeKv& kv) {
    RopeKv scaling = with(kv, "rope_theta", "");
    std::string s = "\"rope_scaling\": " + (scaling.empty() ? std::string("null") : json_object(scaling));
    for (auto& p : kv)
        if (p.first == "rope_theta") s = "\"rope_theta\": " + p.second + ", " + s;
    return s;
}
// transformers v5: everything in rope_parameters.
std::string new_style(const RopeKv& kv) { return "\"rope_parameters\": " + json_object(kv); }

// A config.json for c with the given RoPE part.
std::string config_with(const LlamaConfig& c, const std::string& rope) {
    return "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", \"hidden_size\": " +
           std::to_string(c.dim) + ", \"intermediate_size\": " + std::to_string(c.ffn_dim) +
           ", \"num_hidden_layers\": " + std::to_string(c.n_layers) + ", \"num_attention_heads\": " +
           std::to_string(c.n_heads) + ", \"num_key_value_heads\": " + std::to_string(c.n_kv_heads) +
           ", \"head_dim\": " + std::to_string(c.head_dim) + ", \"vocab_size\": " + std::to_string(c.vocab) +
           ", \"rms_norm_eps\": 1e-05, \"tie_word_embeddings\": " + (c.tied_embeddings ? "true" : "false") +
           ", \"max_position_embeddings\": 131072, " + rope + "}";
}

// The check's exit code for a config.json text; its message in *msg.
int check_code(const LlamaConfig& c, const std::string& text, std::string* msg) {
    msg->clear();
    return fatal_code([&] { check_hf_config(c, text, "config.json"); }, msg);
}

// The check refuses text with exit code 2 and a message holding every needle.
void expect_refused(const LlamaConfig& c, const std::string& text, const std::vector<std::string>& needles) {
    std::string msg;
    EXPECT_EQ(check_code(c, text, &msg), EXIT_USAGE) << text;
    for (const std::string& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' in: " << msg;
}

// Meta's Llama 3.2 3B config.json (the transformers v4 layout), and the same model in the layout
// transformers v5 writes: RoPE in rope_parameters with rope_theta inside, "dtype" for "torch_dtype".
const char* kLlama32v4 = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 128, "hidden_act": "silu",
  "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
  "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 24, "num_hidden_layers": 28, "num_key_value_heads": 8, "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256})";
const char* kLlama32v5 = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "dtype": "bfloat16", "eos_token_id": 128001, "head_dim": 128,
  "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
  "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 24, "num_hidden_layers": 28, "num_key_value_heads": 8, "pad_token_id": null,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_parameters": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_theta": 500000.0, "rope_type": "llama3"},
  "tie_word_embeddings": true, "transformers_version": "5.0.0", "use_cache": true, "vocab_size": 128256})";

TEST(HfConfig, RealFilesOfBothGenerationsPass) {
    LlamaConfig c = config_by_name("llama3.2-3b");
    std::string msg;
    EXPECT_EQ(check_code(c, kLlama32v4, &msg), -1) << msg;
    EXPECT_EQ(check_code(c, kLlama32v5, &msg), -1) << msg;
    // A Llama 3.1 factor (8) against 3.2's 32 is caught in either layout.
    std::string v4 = kLlama32v4, v5 = kLlama32v5;
    v4.replace(v4.find("\"factor\": 32.0"), 14, "\"factor\": 8.0");
    v5.replace(v5.find("\"factor\": 32.0"), 14, "\"factor\": 8.0");
    expect_refused(c, v4, {"rope_scaling.factor", "checkpoint 8,", "32"});
    expect_refused(c, v5, {"rope_parameters.factor", "checkpoint 8,", "32"});
}

TEST(HfConfig, EveryRopeSettingIsCheckedInEitherPlace) {
    const LlamaConfig c = config_by_name("tiny");  // theta 500000, llama3: factor 8, 1, 4, 64
    const RopeKv good = good_rope(c);
    std::string msg;
    EXPECT_EQ(check_code(c, config_with(c, old_style(good)), &msg), -1) << msg;
    EXPECT_EQ(check_code(c, config_with(c, new_style(good)), &msg), -1) << msg;
    // both places, agreeing
    EXPECT_EQ(check_code(c, config_with(c, old_style(good) + ", " + new_style(good)), &msg), -1) << msg;
    {  // transformers' older spelling of the rope type
        RopeKv typed = with(with(good, "rope_type", ""), "type", "\"llama3\"");
        EXPECT_EQ(check_code(c, config_with(c, old_style(typed)), &msg), -1) << msg;
    }
    struct Wrong {
        std::string key, value, shown;
    };
    const std::vector<Wrong> wrongs = {{"rope_theta", "10000.0", "10000"},
                                       {"rope_type", "\"linear\"", "\"linear\""},
                                       {"rope_type", "\"default\"", "\"default\""},
                                       {"factor", "32.0", "32"},
                                       {"low_freq_factor", "2.0", "2"},
                                       {"high_freq_factor", "8.0", "8"},
                                       {"original_max_position_embeddings", "8192", "8192"}};
    for (bool v5 : {false, true}) {
        SCOPED_TRACE(v5 ? "rope_parameters" : "rope_theta + rope_scaling");
        auto place = [&](const std::string& key) {
            if (v5) return "rope_parameters." + key;
            return key == "rope_theta" ? key : "rope_scaling." + key;
        };
        auto style = [&](const RopeKv& kv) { return config_with(c, v5 ? new_style(kv) : old_style(kv)); };
        for (const Wrong& w : wrongs) {
            SCOPED_TRACE(w.key + " " + w.value);
            expect_refused(c, style(with(good, w.key, w.value)), {place(w.key) + ": checkpoint " + w.shown + ","});
        }
        for (const auto& kv : good) {  // each setting missing
            SCOPED_TRACE("no " + kv.first);
            const std::string got = kv.first == "rope_type" ? "none" : "missing";
            expect_refused(c, style(with(good, kv.first, "")), {place(kv.first) + ": checkpoint " + got});
        }
        for (const auto& kv : good) {  // each setting of the wrong JSON type
            SCOPED_TRACE(kv.first + " as an array");
            expect_refused(c, style(with(good, kv.first, "[1]")), {place(kv.first) + ": checkpoint an array"});
        }
        expect_refused(c, style(with(good, "factor", "\"8\"")), {place("factor"), "\"8\" (not a number)"});
        expect_refused(c, style(with(good, "rope_type", "3")), {place("rope_type"), "3 (not a string)"});
    }
}

TEST(HfConfig, UnreadableRopeIsRefused) {
    const LlamaConfig c = config_by_name("tiny");
    const RopeKv good = good_rope(c);
    // rope_scaling or rope_parameters that is not an object
    expect_refused(c, config_with(c, "\"rope_theta\": 500000, \"rope_scaling\": \"llama3\""),
                   {"rope_scaling: checkpoint \"llama3\" (not an object)"});
    expect_refused(c, config_with(c, "\"rope_theta\": 500000, \"rope_scaling\": 8"),
                   {"rope_scaling: checkpoint 8 (not an object)"});
    expect_refused(c, config_with(c, "\"rope_parameters\": [500000]"),
                   {"rope_parameters: checkpoint an array (not an object)"});
    expect_refused(c, config_with(c, old_style(good) + ", \"rope_parameters\": true"),
                   {"rope_parameters: checkpoint true (not an object)"});
    // no RoPE at all: theta missing, and no scaling where the model has one
    expect_refused(c, config_with(c, "\"use_cache\": true"),
                   {"rope_theta: checkpoint missing", "rope_scaling.rope_type: checkpoint none"});
    // both places present and disagreeing, on each setting
    for (const auto& kv : good) {
        SCOPED_TRACE(kv.first);
        const std::string other = kv.first == "rope_type" ? "\"linear\"" : "7";
        const std::string text = config_with(c, old_style(good) + ", " + new_style(with(good, kv.first, other)));
        const std::string old_name = kv.first == "rope_theta" ? kv.first : "rope_scaling." + kv.first;
        expect_refused(c, text, {old_name + " is " + kv.second,
                                  "rope_parameters." + kv.first + " is " + other, "disagree"});
    }
}

TEST(HfConfig, AModelWithoutScalingTakesNoneOrDefault) {
    LlamaConfig c = config_by_name("tiny");
    c.rope_scaling.enabled = false;
    const std::string theta = jnum(c.rope_theta);
    std::string msg;
    EXPECT_EQ(check_code(c, config_with(c, "\"rope_theta\": " + theta + ", \"rope_scaling\": null"), &msg), -1) << msg;
    EXPECT_EQ(check_code(c, config_with(c, "\"rope_theta\": " + theta), &msg), -1) << msg;
    EXPECT_EQ(check_code(c, config_with(c, new_style({{"rope_theta", theta}, {"rope_type", "\"default\""}})), &msg), -1)
        << msg;
    EXPECT_EQ(check_code(c, config_with(c, new_style({{"rope_theta", theta}})), &msg), -1) << msg;
    expect_refused(c, config_with(c, old_style(good_rope(c))),
                   {"rope_scaling.rope_type: checkpoint \"llama3\"", "none or \"default\""});
    expect_refused(c, config_with(c, new_style(good_rope(c))), {"rope_parameters.rope_type: checkpoint \"llama3\""});
    expect_refused(c, config_with(c, new_style({{"rope_theta", "10000"}})),
                   {"rope_parameters.rope_theta: checkpoint 10000,"});
}

// text with its first `from` replaced by `to`.
std::string replaced(std::string text, const std::string& from, const std::string& to) {
    return text.replace(text.find(from), from.size(), to);
}

// Another family's config.json with Llama's fields is refused, naming the checkpoint's family
// and ours: Mistral's model_type, GPT-2's architectures, a file with no model_type.
TEST(HfConfig, AnotherModelFamilyIsRefused) {
    const LlamaConfig c = config_by_name("tiny");
    const std::string rope = old_style(good_rope(c)), good = config_with(c, rope);
    std::string msg;
    EXPECT_EQ(check_code(c, good, &msg), -1) << msg;
    auto with = [&](const std::string& from, const std::string& to) { return replaced(good, from, to); };
    expect_refused(c, with("\"model_type\": \"llama\"", "\"model_type\": \"mistral\""),
                   {"model_type: checkpoint \"mistral\", --config tiny \"llama\""});
    expect_refused(c, with("[\"LlamaForCausalLM\"]", "[\"GPT2LMHeadModel\"]"),
                   {"architectures: checkpoint [\"GPT2LMHeadModel\"], --config tiny [\"LlamaForCausalLM\"]"});
    expect_refused(c, with("[\"LlamaForCausalLM\"]", "[]"), {"architectures: checkpoint []"});
    expect_refused(c, with("\"model_type\": \"llama\", ", ""), {"model_type: checkpoint missing, --config tiny \"llama\""});
    EXPECT_EQ(check_code(c, with("\"architectures\": [\"LlamaForCausalLM\"], ", ""), &msg), -1) << msg;  // optional
}

// Qwen3-32B's config.json (Qwen/Qwen3-32B) passes --config qwen3-32b; a Llama file is refused
// for a Qwen3 config and a Qwen3 file for a Llama one, each naming both families; Qwen3's
// sliding window is refused (its attention would see a window only).
const char* kQwen3_32b = R"({
  "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
  "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 25600,
  "max_position_embeddings": 40960, "max_window_layers": 64, "model_type": "qwen3",
  "num_attention_heads": 64, "num_hidden_layers": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
  "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": true,
  "use_sliding_window": false, "vocab_size": 151936})";

TEST(HfConfig, Qwen3FilesAreReadAsQwen3Only) {
    const LlamaConfig qwen = config_by_name("qwen3-32b");
    std::string msg, file = kQwen3_32b;
    EXPECT_EQ(check_code(qwen, file, &msg), -1) << msg;
    auto with = [&](const std::string& from, const std::string& to) { return replaced(file, from, to); };
    expect_refused(qwen, with("\"use_sliding_window\": false", "\"use_sliding_window\": true"),
                   {"use_sliding_window: checkpoint true, --config qwen3-32b false"});
    expect_refused(qwen, with("\"model_type\": \"qwen3\"", "\"model_type\": \"llama\""),
                   {"model_type: checkpoint \"llama\", --config qwen3-32b \"qwen3\""});
    expect_refused(qwen, with("[\"Qwen3ForCausalLM\"]", "[\"LlamaForCausalLM\"]"),
                   {"architectures: checkpoint [\"LlamaForCausalLM\"], --config qwen3-32b [\"Qwen3ForCausalLM\"]"});
    // Missing head_dim is transformers' Qwen3 default, 128 (not hidden size / heads = 80).
    EXPECT_EQ(check_code(qwen, with("\"head_dim\": 128, ", ""), &msg), -1) << msg;
    // Our own Qwen3 file for a Llama config of the same shape: refused by family alone.
    LlamaConfig as_llama = config_by_name("tiny-qwen3");
    const std::string ours = hf_config_json(as_llama, true);
    as_llama.family = Family::LLAMA, as_llama.name = "tiny-as-llama";
    expect_refused(as_llama, ours, {"model_type: checkpoint \"qwen3\", --config tiny-as-llama \"llama\"",
                                    "architectures: checkpoint [\"Qwen3ForCausalLM\"], --config tiny-as-llama [\"LlamaForCausalLM\"]"});
}

// ---------------------------------------------------------------------------------------------
TEST(TokenFiles, RoundTripAndErrors) {
    std::string dir = tmpdir("tok");
    std::vector<uint32_t> toks = {1, 2, 3, 500, 7};
    write_token_file(dir + "/ok.bin", toks);
    {
        TokenFile tf(dir + "/ok.bin", 512);
        ASSERT_EQ(tf.count, toks.size());
        for (size_t i = 0; i < toks.size(); i++) EXPECT_EQ(tf.tokens[i], toks[i]);
    }
    std::string msg;
    EXPECT_EQ(fatal_code([&] { TokenFile tf(dir + "/ok.bin", 400); }, &msg), EXIT_USAGE);  // 500 >= 400
    EXPECT_NE(msg.find("position 3"), std::string::npos) << msg;
    std::ofstream(dir + "/junk.bin") << "not tokens at all, just text";
    EXPECT_EQ(fatal_code([&] { TokenFile tf(dir + "/junk.bin", 512); }, &msg), EXIT_USAGE);
    EXPECT_NE(msg.find("LLTOKENS"), std::string::npos) << msg;
    {  // header promises more tokens than the file holds
        std::ifstream in(dir + "/ok.bin", std::ios::binary);
        std::string all((std::istreambuf_iterator<char>(in)), {});
        std::ofstream(dir + "/short.bin", std::ios::binary) << all.substr(0, all.size() - 8);
    }
    EXPECT_EQ(fatal_code([&] { TokenFile tf(dir + "/short.bin", 512); }, &msg), EXIT_USAGE);
    EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
    EXPECT_EQ(fatal_code([&] { TokenFile tf(dir + "/none.bin", 512); }), EXIT_USAGE);
}

// Version 2: the same tokens, and where each document starts; read back exactly.
TEST(TokenFiles, Version2HoldsDocuments) {
    std::string dir = tmpdir("tok2");
    const std::vector<uint32_t> toks = {1, 2, 3, 500, 7, 8, 9};
    const std::vector<uint64_t> starts = {0, 1, 4, 6};
    write_token_file(dir + "/docs.bin", toks, starts);
    TokenFile tf(dir + "/docs.bin", 512);
    EXPECT_EQ(tf.version, 2u);
    ASSERT_EQ(tf.count, toks.size());
    for (size_t i = 0; i < toks.size(); i++) EXPECT_EQ(tf.tokens[i], toks[i]);
    EXPECT_EQ(tf.doc_starts, starts);
    write_token_file(dir + "/v1.bin", toks);
    TokenFile v1(dir + "/v1.bin", 512);  // version 1 reads as one document
    EXPECT_EQ(v1.version, 1u);
    EXPECT_EQ(v1.doc_starts, std::vector<uint64_t>{0});
}

// A file is exactly as long as its header says, and its documents' starts are an index of it:
// anything else is a usage error naming the file and what is wrong.
TEST(TokenFiles, SizesAndIndexesAreStrict) {
    std::string dir = tmpdir("strict");
    auto bytes_of = [&](const std::string& name) {
        std::ifstream in(dir + "/" + name, std::ios::binary);
        return std::string((std::istreambuf_iterator<char>(in)), {});
    };
    auto refused = [&](const std::string& content, const std::string& why) {
        std::ofstream(dir + "/bad.bin", std::ios::binary) << content;
        std::string msg;
        EXPECT_EQ(fatal_code([&] { TokenFile tf(dir + "/bad.bin", 512); }, &msg), EXIT_USAGE) << why;
        EXPECT_NE(msg.find("--data '" + dir + "/bad.bin'"), std::string::npos) << msg;
        EXPECT_NE(msg.find(why), std::string::npos) << msg;
    };
    write_token_file(dir + "/v1.bin", {1, 2, 3});
    const std::string v1 = bytes_of("v1.bin");
    refused(v1 + std::string(4, '\0'), "but 4 more bytes follow them");
    std::string fewer = v1;
    fewer[16] = 2;  // a count smaller than the tokens that follow
    refused(fewer, "the header says 2 tokens, but 4 more bytes follow them");
    refused(v1.substr(0, v1.size() - 1), "truncated");
    auto v2 = [&](const std::vector<uint32_t>& toks, const std::vector<uint64_t>& starts) {
        write_token_file(dir + "/v2.bin", toks, starts);
        return bytes_of("v2.bin");
    };
    refused(v2({1, 2, 3, 4}, {0, 3, 2}), "document 2 starts at token 2, not after document 1's start 3");
    refused(v2({1, 2, 3, 4}, {0, 2, 2}), "document 2 starts at token 2, not after document 1's start 2");
    refused(v2({1, 2, 3}, {1}), "document 0 starts at token 1 (the first document starts at 0)");
    refused(v2({1, 2, 3}, {0, 3}), "document 1 starts at token 3, past the last token (3)");
    refused(v2({1, 2, 3}, {0}) + std::string(8, '\0'), "and 1 documents, but 8 more bytes follow them");
    std::string more_docs = v2({1, 2, 3}, {0});
    more_docs[24] = 2;  // two documents counted, one start written
    refused(more_docs, "truncated");
    std::string no_docs = v2({1, 2, 3}, {0});
    no_docs[24] = 0;
    refused(no_docs.substr(0, no_docs.size() - 8), "3 tokens in 0 documents");
    std::string v3 = v1;
    v3[8] = 3;
    refused(v3, "version 3, 4-byte tokens (version 1 or 2, 4 bytes expected)");
}

TEST(TokenFiles, WindowsComeFromTheFile) {
    std::string dir = tmpdir("win");
    std::vector<uint32_t> toks(1000);
    for (size_t i = 0; i < toks.size(); i++) toks[i] = (uint32_t)(i % 97);
    write_token_file(dir + "/t.bin", toks);
    TokenFile tf(dir + "/t.bin", 128);
    SyntheticData d("random", 128, 3);
    d.file = &tf;
    std::vector<int32_t> x(2 * 50), y(2 * 50);
    d.next(x.data(), y.data(), 2, 50);
    ASSERT_EQ(d.offsets.size(), 2u);  // where each window starts (the step log's "windows")
    for (int b = 0; b < 2; b++) EXPECT_EQ((uint32_t)x[b * 50], toks[d.offsets[b]]);
    for (int b = 0; b < 2; b++)
        for (int i = 0; i < 49; i++) {
            EXPECT_EQ(y[b * 50 + i], x[b * 50 + i + 1]);             // targets are the next tokens
            EXPECT_EQ((x[b * 50 + i] + 1) % 97, x[b * 50 + i + 1]);  // consecutive in the file
        }
}

// ---------------------------------------------------------------------------------------------
// tools/tokenize.py: text to a version-2 token file, read back by the program's reader.
bool have_tokenizer_tool() { return std::ifstream("tools/tokenize.py").good() && run_command("python3 -c 1").code == 0; }

void write_text(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// The expected tokens of byte-level documents: each document's bytes, after the BOS (256) if asked.
void expect_documents(const TokenFile& tf, const std::vector<std::string>& docs, bool bos) {
    std::vector<uint32_t> tokens;
    std::vector<uint64_t> starts;
    for (const std::string& d : docs) {
        starts.push_back(tokens.size());
        if (bos) tokens.push_back(256);
        for (unsigned char ch : d) tokens.push_back(ch);
    }
    EXPECT_EQ(tf.version, 2u);
    EXPECT_EQ(tf.doc_starts, starts);
    ASSERT_EQ(tf.count, tokens.size());
    EXPECT_TRUE(std::equal(tokens.begin(), tokens.end(), tf.tokens));
}

TEST(TokenizeTool, BytesOfAFolderReadBackAsItsDocuments) {
    if (!have_tokenizer_tool()) GTEST_SKIP() << "run from the repository root, with python3";
    const std::string dir = tmpdir("tokenize_bytes");
    mkdir((dir + "/corpus").c_str(), 0755), mkdir((dir + "/corpus/sub").c_str(), 0755);
    write_text(dir + "/corpus/a.txt", "caf\xc3\xa9\n");  // UTF-8, and bytes over 127
    write_text(dir + "/corpus/b.bin", std::string("\x00\xff\x01", 3));
    write_text(dir + "/corpus/sub/c.txt", "in a subfolder");
    write_text(dir + "/corpus/sub/d.txt", "and its second file");
    write_text(dir + "/corpus/empty.txt", "");
    write_text(dir + "/corpus/.hidden", "left out");
    CommandResult r = run_command("python3 tools/tokenize.py --bytes --bos --out " + dir + "/docs.bin " + dir + "/corpus");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("4 documents"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("1 empty documents left out"), std::string::npos) << r.output;
    expect_documents(TokenFile(dir + "/docs.bin", 257),
                     {"caf\xc3\xa9\n", std::string("\x00\xff\x01", 3), "in a subfolder", "and its second file"}, true);
    // --doc-per-folder: a subfolder's files, concatenated in sorted order, are one document.
    r = run_command("python3 tools/tokenize.py --bytes --doc-per-folder --out " + dir + "/folders.bin " + dir + "/corpus");
    ASSERT_EQ(r.code, 0) << r.output;
    expect_documents(TokenFile(dir + "/folders.bin", 257),
                     {"caf\xc3\xa9\n", std::string("\x00\xff\x01", 3), "in a subfolderand its second file"}, false);
    // JSON lines: each object's "text" is a document (blank lines skipped).
    write_text(dir + "/docs.jsonl", "{\"text\": \"one\"}\n\n{\"text\": \"two \\u00e9\", \"id\": 7}\n");
    r = run_command("python3 tools/tokenize.py --bytes --out " + dir + "/lines.bin " + dir + "/docs.jsonl");
    ASSERT_EQ(r.code, 0) << r.output;
    expect_documents(TokenFile(dir + "/lines.bin", 257), {"one", "two \xc3\xa9"}, false);
}

// Bad input: a message naming the file, exit 2, and no output file (nor a temporary one) left.
TEST(TokenizeTool, BadInputIsAUsageErrorNamingTheFile) {
    if (!have_tokenizer_tool()) GTEST_SKIP() << "run from the repository root, with python3";
    const std::string dir = tmpdir("tokenize_bad");
    mkdir((dir + "/broken").c_str(), 0755);
    symlink((dir + "/nowhere").c_str(), (dir + "/broken/link.txt").c_str());  // listed, unreadable
    write_text(dir + "/empty.txt", "");
    write_text(dir + "/bad.jsonl", "{\"text\": \"fine\"}\n{\"text\": 5}\n");
    write_text(dir + "/notjson.jsonl", "{\"text\": \n");
    write_text(dir + "/ok.txt", "ok");
    const std::pair<std::string, std::string> cases[] = {
        {"--bytes " + dir + "/broken", dir + "/broken/link.txt: cannot read it"},
        {"--bytes " + dir + "/empty.txt", "an empty corpus"},
        {"--bytes " + dir + "/bad.jsonl", dir + "/bad.jsonl:2: a JSON object with a string \"text\" expected"},
        {"--bytes " + dir + "/notjson.jsonl", dir + "/notjson.jsonl:1: not a JSON object"},
        {"--bytes " + dir + "/missing.txt", dir + "/missing.txt: no such file or folder"},
        {"--bytes --eos " + dir + "/ok.txt", "--eos: this tokenizer has no end-of-text token"},
        {"--tokenizer " + dir + " " + dir + "/ok.txt", ""},  // no tokenizer.json there (or no package)
    };
    for (const auto& [args, why] : cases) {
        SCOPED_TRACE(args);
        CommandResult r = run_command("python3 tools/tokenize.py --out " + dir + "/out.bin " + args);
        EXPECT_EQ(r.code, 2) << r.output;
        EXPECT_NE(r.output.find(why), std::string::npos) << r.output;
        EXPECT_FALSE(std::ifstream(dir + "/out.bin").good());
    }
    EXPECT_EQ(run_command("ls " + dir).output.find(".tmp"), std::string::npos) << "a temporary output was left behind";
}

// The tool on the command line, in a 20 s and 4 GiB bound: an input that hangs it or grows its
// memory without end times out (exit status 124) or fails, rather than stalling the suite.
std::string bounded(const std::string& tool) { return "ulimit -v 4194304; timeout 20 " + tool; }

// Expects exit status 2 in bounded time, the one line why, and neither the output nor a
// temporary file of it left in out's folder.
void expect_refused(const std::string& cmd, const std::string& why, const std::string& out) {
    SCOPED_TRACE(cmd);
    CommandResult r = run_command(cmd);
    EXPECT_NE(r.code, 124) << "timed out: " << r.output;
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find(why), std::string::npos) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;  // no traceback either
    EXPECT_FALSE(std::ifstream(out).good()) << out << " was written";
    const std::string folder = out.substr(0, out.rfind('/'));
    EXPECT_EQ(run_command("ls -a " + folder).output.find(out.substr(out.rfind('/') + 1) + ".tmp"), std::string::npos)
        << "a temporary output was left behind";
}

// What the review found hanging, growing without bound, failing with a traceback or reading the
// wrong file: each is a one-line message naming the file or the flag, exit 2, within 20 s.
TEST(TokenizeTool, HostileInputIsRefusedInBoundedTime) {
    if (!have_tokenizer_tool()) GTEST_SKIP() << "run from the repository root, with python3";
    const std::string dir = tmpdir("tokenize_hostile"), out = dir + "/out.bin";
    write_text(dir + "/surrogate.jsonl", "{\"text\": \"ok\"}\n{\"text\": \"\\ud800\"}\n");
    write_text(dir + "/deep.jsonl", std::string(100000, '['));
    write_text(dir + "/number.jsonl", "{\"text\": \"a\", \"n\": 1" + std::string(10000, '7') + "}\n");
    write_text(dir + "/long.jsonl", "{\"text\": \"short\"}\n{\"text\": \"" + std::string(200, 'x') + "\"}\n");
    write_text(dir + "/big.txt", "");
    ASSERT_EQ(truncate((dir + "/big.txt").c_str(), (off_t(1) << 31) + 1), 0);  // sparse: no disk used
    ASSERT_EQ(mkfifo((dir + "/fifo").c_str(), 0644), 0);
    mkdir((dir + "/corpus").c_str(), 0755), mkdir((dir + "/corpus/sub").c_str(), 0755);
    write_text(dir + "/corpus/a.txt", "a document");
    ASSERT_EQ(mkfifo((dir + "/corpus/sub/pipe").c_str(), 0644), 0);
    ASSERT_EQ(run_command("python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('" + dir + "/socket')\"").code, 0);
    mkdir((dir + "/folder").c_str(), 0755);
    const std::string tool = bounded("python3 tools/tokenize.py --bytes ");
    const std::pair<std::string, std::string> cases[] = {
        {"--out " + out + " " + dir + "/surrogate.jsonl", dir + "/surrogate.jsonl:2: \"text\" holds a lone surrogate (\\ud800)"},
        {"--out " + out + " " + dir + "/deep.jsonl", dir + "/deep.jsonl:1: nested too deeply"},
        {"--out " + out + " " + dir + "/number.jsonl", dir + "/number.jsonl:1: a number of over 4300 digits"},
        {"--out " + out + " --max-doc-bytes 100 " + dir + "/long.jsonl", dir + "/long.jsonl:2: a line over 100 bytes"},
        {"--out " + out + " " + dir + "/big.txt", dir + "/big.txt: over 2147483648 bytes, the bound on a document"},
        {"--out " + out + " /dev/zero", "/dev/zero: not a regular file (a character device)"},
        {"--out " + out + " " + dir + "/fifo", dir + "/fifo: not a regular file (a FIFO)"},
        {"--out " + out + " " + dir + "/corpus", dir + "/corpus/sub/pipe: not a regular file (a FIFO)"},
        {"--out " + out + " --doc-per-folder " + dir + "/corpus", dir + "/corpus/sub/pipe: not a regular file (a FIFO)"},
        {"--out " + out + " " + dir + "/socket", dir + "/socket: not a regular file (a socket)"},
        {"--out " + dir + "/folder " + dir + "/corpus/a.txt", "--out " + dir + "/folder: a folder, not a file to write"},
        {"--out '' " + dir + "/corpus/a.txt", "--out: an empty path"},
        {"--out " + dir + "/null " + dir + "/corpus/a.txt", "--out " + dir + "/null: a character device, not a file to write"},
    };
    // --out /dev/null through a link: a tool that wrote there anyway replaces the link, not /dev/null.
    ASSERT_EQ(symlink("/dev/null", (dir + "/null").c_str()), 0);
    for (const auto& [args, why] : cases) expect_refused(tool + args, why, out);
    struct stat st;
    EXPECT_TRUE(lstat((dir + "/null").c_str(), &st) == 0 && S_ISLNK(st.st_mode)) << "--out " << dir << "/null was written";
}

// The output inside an input folder (the review's wrong result: the tool read its own temporary
// back as a document): the output, its temporary and a hard link to it are left out, a stale
// output of an earlier run too; the output named as an input is refused, and stays as it was.
TEST(TokenizeTool, ItsOwnOutputIsNeverRead) {
    if (!have_tokenizer_tool()) GTEST_SKIP() << "run from the repository root, with python3";
    const std::string dir = tmpdir("tokenize_own"), out = dir + "/corpus/out.bin";
    mkdir((dir + "/corpus").c_str(), 0755), mkdir((dir + "/corpus/sub").c_str(), 0755);
    write_text(dir + "/corpus/a.txt", "one");
    write_text(dir + "/corpus/sub/b.txt", "two");
    for (int pass = 0; pass < 2; pass++) {  // the second with last run's output there
        SCOPED_TRACE("pass " + std::to_string(pass));
        CommandResult r = run_command(bounded("python3 tools/tokenize.py --bytes --out " + out + " " + dir + "/corpus"));
        ASSERT_EQ(r.code, 0) << r.output;
        EXPECT_NE(r.output.find(out + ".tmp"), std::string::npos) << r.output;  // its note: left out
        EXPECT_EQ(r.output.find(out + ": the output file") == std::string::npos, pass == 0) << r.output;
        expect_documents(TokenFile(out, 257), {"one", "two"}, false);
    }
    ASSERT_EQ(link(out.c_str(), (dir + "/corpus/sub/hardlink.bin").c_str()), 0);
    CommandResult r = run_command(bounded("python3 tools/tokenize.py --bytes --doc-per-folder --out " + out + " " + dir + "/corpus"));
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find(dir + "/corpus/sub/hardlink.bin: the output file (--out), left out"), std::string::npos) << r.output;
    expect_documents(TokenFile(out, 257), {"one", "two"}, false);
    r = run_command(bounded("python3 tools/tokenize.py --bytes --out " + out + " " + dir + "/corpus/a.txt " + out));
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find(out + ": the output file (--out) given as an input"), std::string::npos) << r.output;
    expect_documents(TokenFile(out, 257), {"one", "two"}, false);
    EXPECT_EQ(run_command("ls -a " + dir + "/corpus").output.find(".tmp"), std::string::npos) << "a temporary output was left behind";
}

// A folder that cannot be listed, a file that cannot be read, a folder the output cannot be
// written in: errors naming them. Permissions bind only users other than root: as root, the
// tool runs as nobody (setpriv), from a copy nobody can read, with a python3 outside root's home.
TEST(TokenizeTool, WhatCannotBeReadOrWrittenIsNamed) {
    if (!have_tokenizer_tool()) GTEST_SKIP() << "run from the repository root, with python3";
    const std::string dir = tmpdir("tokenize_perm");
    std::string tool = "python3 tools/tokenize.py --bytes ";
    if (geteuid() == 0) {
        tool = "setpriv --reuid=65534 --regid=65534 --clear-groups env PATH=/usr/local/bin:/usr/bin:/bin python3 ";
        if (run_command("cp tools/tokenize.py " + dir + "/ && " + tool + dir + "/tokenize.py --help").code != 0)
            GTEST_SKIP() << "root, and no setpriv or python3 for the user nobody";
        tool += dir + "/tokenize.py --bytes ";
    }
    mkdir((dir + "/corpus").c_str(), 0755), mkdir((dir + "/corpus/locked").c_str(), 0755);
    mkdir((dir + "/out").c_str(), 0777), chmod((dir + "/out").c_str(), 0777);
    mkdir((dir + "/readonly").c_str(), 0555);
    write_text(dir + "/corpus/a.txt", "a document");
    write_text(dir + "/corpus/locked/b.txt", "out of reach");
    write_text(dir + "/secret.txt", "out of reach");
    chmod((dir + "/corpus/locked").c_str(), 0), chmod((dir + "/secret.txt").c_str(), 0);
    const std::string out = dir + "/out/out.bin";
    expect_refused(bounded(tool + "--out " + out + " " + dir + "/corpus"), dir + "/corpus/locked: cannot list it (Permission denied)", out);
    expect_refused(bounded(tool + "--out " + out + " --doc-per-folder " + dir + "/corpus"),
                   dir + "/corpus/locked: cannot list it (Permission denied)", out);
    expect_refused(bounded(tool + "--out " + out + " " + dir + "/secret.txt"), dir + "/secret.txt: cannot read it (Permission denied)", out);
    expect_refused(bounded(tool + "--out " + dir + "/readonly/out.bin " + dir + "/corpus/a.txt"),
                   "--out " + dir + "/readonly/out.bin: cannot write in " + dir + "/readonly (Permission denied)", dir + "/readonly/out.bin");
    chmod((dir + "/corpus/locked").c_str(), 0755);
}

// A run that fails at its very end leaves nothing either: a stdout that is full (/dev/full) or
// closed cannot take the summary, which goes out before the output is put in place: exit status
// 1, one line naming stdout, neither the output nor its temporary left. And the report of an
// internal error never takes the tool for the standard library's `tokenize` (its folder comes
// first on sys.path when it runs): one line still, no traceback. A message about a flag's value
// names the flag.
TEST(TokenizeTool, AFailedStdoutOrABugLeavesNoOutputAndOneLine) {
    if (!have_tokenizer_tool()) GTEST_SKIP() << "run from the repository root, with python3";
    const std::string dir = tmpdir("tokenize_stdout"), out = dir + "/out.bin", err = dir + "/err";
    write_text(dir + "/a.txt", "a document");
    const std::string tool = "python3 tools/tokenize.py --bytes --out " + out + " " + dir + "/a.txt 2>" + err;
    for (const auto& [redirect, why] : {std::make_pair(" >/dev/full", "(No space left on device)"),
                                        std::make_pair(" >&-", "(stdout is closed)")}) {
        SCOPED_TRACE(redirect);
        const CommandResult r = run_command(tool + redirect + "; echo exit $?");
        EXPECT_EQ(r.output, "exit 1\n");
        const std::string said = read_text_file(err);
        EXPECT_EQ(said, "tokenize.py: cannot write the summary to stdout " + std::string(why) + ": no output written\n");
        EXPECT_EQ(run_command("ls -a " + dir).output, ".\n..\na.txt\nerr\n") << "an output was left behind";
    }
    // The tool as `python3 tools/tokenize.py` runs it (tools/ first on sys.path), its run() broken.
    write_text(dir + "/broken.py",
               "import importlib.util, sys\n"
               "sys.path.insert(0, 'tools')\n"
               "spec = importlib.util.spec_from_file_location('tool', 'tools/tokenize.py')\n"
               "tool = importlib.util.module_from_spec(spec)\n"
               "spec.loader.exec_module(tool)\n"
               "def broken(args):\n"
               "    raise RuntimeError('made to fail')\n"
               "tool.run = broken\n"
               "tool.main(['--bytes', '--out', sys.argv[1], sys.argv[2]])\n");
    const CommandResult r = run_command("python3 " + dir + "/broken.py " + out + " " + dir + "/a.txt");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_EQ(r.output.rfind("tokenize.py: internal error (a bug): RuntimeError: made to fail at ", 0), 0u) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
    expect_refused("python3 tools/tokenize.py --tokenizer " + dir + " --out " + out + " " + dir + "/a.txt",
                   run_command("python3 -c 'import tokenizers'").code == 0 ? "--tokenizer " + dir + ": no tokenizer.json"
                                                                            : "--tokenizer needs the `tokenizers` package",
                   out);
}

// A Hugging Face tokenizer.json through the `tokenizers` package (where it is installed): a word
// level one written here, its BOS from tokenizer_config.json; text that is not UTF-8 refused.
TEST(TokenizeTool, HuggingFaceTokenizerWhereInstalled) {
    if (!have_tokenizer_tool()) GTEST_SKIP() << "run from the repository root, with python3";
    if (run_command("python3 -c 'import tokenizers'").code != 0) GTEST_SKIP() << "the tokenizers package is not installed";
    const std::string dir = tmpdir("tokenize_hf");
    mkdir((dir + "/tok").c_str(), 0755);
    write_text(dir + "/tok/tokenizer.json",
               "{\"version\": \"1.0\", \"truncation\": null, \"padding\": null, \"added_tokens\": [], \"normalizer\": null,"
               " \"pre_tokenizer\": {\"type\": \"Whitespace\"}, \"post_processor\": null, \"decoder\": null,"
               " \"model\": {\"type\": \"WordLevel\", \"vocab\": {\"<s>\": 0, \"hello\": 1, \"world\": 2, \"[UNK]\": 3},"
               " \"unk_token\": \"[UNK]\"}}");
    write_text(dir + "/tok/tokenizer_config.json", "{\"bos_token\": \"<s>\"}");
    write_text(dir + "/a.txt", "hello world hello");
    write_text(dir + "/b.txt", "world again");
    CommandResult r = run_command("python3 tools/tokenize.py --tokenizer " + dir + "/tok --bos --out " + dir + "/hf.bin " +
                                  dir + "/a.txt " + dir + "/b.txt");
    ASSERT_EQ(r.code, 0) << r.output;
    TokenFile tf(dir + "/hf.bin", 4);
    EXPECT_EQ(tf.doc_starts, (std::vector<uint64_t>{0, 4}));
    ASSERT_EQ(tf.count, 7u);
    const uint32_t want[] = {0, 1, 2, 1, 0, 2, 3};
    EXPECT_TRUE(std::equal(want, want + 7, tf.tokens));
    write_text(dir + "/latin1.txt", "caf\xe9");
    r = run_command("python3 tools/tokenize.py --tokenizer " + dir + "/tok/tokenizer.json --out " + dir + "/x.bin " + dir +
                    "/latin1.txt");
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find(dir + "/latin1.txt: not UTF-8"), std::string::npos) << r.output;
}

// bench/corpus.py (make data): folders of a source tarball become documents between
// --min-bytes and --max-bytes, each file after a line naming it; the training and the held-out
// documents come from different directories, and both token files read back.
TEST(CorpusTool, FoldersBecomeDocumentsOfBoundedSize) {
    if (!have_tokenizer_tool() || !std::ifstream("bench/corpus.py").good()) GTEST_SKIP() << "run from the repository root, with python3";
    const std::string dir = tmpdir("corpus"), top = dir + "/src/linux-x";
    const std::map<std::string, std::string> files = {
        {"fs/a.c", std::string(300, 'a')}, {"fs/sub/b.c", std::string(400, 'b')}, {"fs/a.o", "binary"},
        {"net/n1.c", std::string(600, 'n')}, {"net/n2.c", std::string(600, 'm')},      // own files: two runs
        {"net/small/x.c", std::string(50, 'x')}, {"net/big/y.c", std::string(500, 'y')},  // left out; one document
        {"kernel/k.c", std::string(200, 'k')}, {"mm/k.c", std::string(200, 'l')}, {"lib/k.c", std::string(200, 'i')},
        {"block/k.c", std::string(200, 'o')}, {"ipc/k.c", std::string(200, 'p')}, {"init/k.c", std::string(200, 'q')},
        {"sound/s.c", std::string(200, 's')}, {"crypto/c.c", std::string(200, 'c')}, {"security/s.c", std::string(200, 'e')}};
    for (const auto& [path, text] : files) {
        ASSERT_EQ(run_command("mkdir -p $(dirname " + top + "/" + path + ")").code, 0);
        write_text(top + "/" + path, text);
    }
    ASSERT_EQ(run_command("tar -cJf " + dir + "/src.tar.xz -C " + dir + "/src linux-x").code, 0);
    // The other source: a folder's .py files, nothing else of it.
    const std::map<std::string, std::string> other = {{"pkg/m.py", std::string(150, 'p')}, {"pkg/data.txt", "left out"},
                                                      {"pkg/__pycache__/m.py", std::string(150, 'c')}};
    for (const auto& [path, text] : other) {
        ASSERT_EQ(run_command("mkdir -p $(dirname " + dir + "/py/" + path + ")").code, 0);
        write_text(dir + "/py/" + path, text);
    }
    const std::string cmd = "python3 bench/corpus.py --out " + dir + "/out --source " + dir + "/src.tar.xz --other " + dir +
                            "/py --min-bytes 100 --max-bytes 1000";
    CommandResult r = run_command(cmd);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("train: 10 documents"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("50 bytes in pieces under 100 bytes left out"), std::string::npos) << r.output;
    auto doc = [&](std::initializer_list<std::string> paths) {
        std::string d;
        for (const std::string& p : paths) d += "==> " + p + " <==\n" + files.at(p);
        return d;
    };
    // In sorted order of the document names: net.2 (net's second run of own files) before net.
    expect_documents(TokenFile(dir + "/out/train.tok", 257),
                     {doc({"block/k.c"}), doc({"fs/a.c", "fs/sub/b.c"}), doc({"init/k.c"}), doc({"ipc/k.c"}),
                      doc({"kernel/k.c"}), doc({"lib/k.c"}), doc({"mm/k.c"}), doc({"net/n2.c"}), doc({"net/n1.c"}),
                      doc({"net/big/y.c"})}, true);
    expect_documents(TokenFile(dir + "/out/heldout.tok", 257),
                     {doc({"crypto/c.c"}), doc({"security/s.c"}), doc({"sound/s.c"})}, true);
    expect_documents(TokenFile(dir + "/out/other.tok", 257), {"==> pkg/m.py <==\n" + other.at("pkg/m.py")}, true);
    // Run again: the outputs are there, nothing is rebuilt. The GPU machine's path: only
    // text.tar.xz carried, the token files made from it.
    r = run_command(cmd);
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("are there"), std::string::npos) << r.output;
    ASSERT_EQ(run_command("mkdir " + dir + "/carried && cp " + dir + "/out/text.tar.xz " + dir + "/out/other.tar.xz " + dir +
                          "/carried/").code, 0);
    r = run_command("python3 bench/corpus.py --out " + dir + "/carried");
    ASSERT_EQ(r.code, 0) << r.output;
    for (const char* tok : {"train.tok", "other.tok"})
        EXPECT_EQ(run_command("cmp " + dir + "/out/" + tok + " " + dir + "/carried/" + tok).code, 0) << tok;
    // A source that is not there: exit 2, naming it.
    r = run_command("python3 bench/corpus.py --out " + dir + "/none --source " + dir + "/missing.tar.xz");
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find(dir + "/missing.tar.xz: no such file"), std::string::npos) << r.output;
}

// ---------------------------------------------------------------------------------------------
// The binary: bad files are usage errors before any GPU work (so this runs on CI too).
using Result = CommandResult;
Result sh(const std::string& cmd) { return run_command(cmd); }
bool have_train() { return std::ifstream("./train").good(); }

TEST(Binary, BadInputFilesExitWithTwo) {
    if (!have_train()) GTEST_SKIP() << "./train not built";
    std::string dir = tmpdir("bin");
    std::ofstream(dir + "/model.safetensors") << "garbage";
    Result a = sh("./train --config tiny --init-from " + dir);
    EXPECT_EQ(a.code, 2) << a.output;
    Result b = sh("./train --config tiny --init-from /nonexistent/dir");
    EXPECT_EQ(b.code, 2) << b.output;
    std::ofstream(dir + "/tokens.bin") << "garbage";
    Result c = sh("./train --config tiny --data " + dir + "/tokens.bin");
    EXPECT_EQ(c.code, 2) << c.output;
    write_token_file(dir + "/few.bin", {1, 2, 3});
    Result d = sh("./train --config tiny --seq-len 64 --data " + dir + "/few.bin");
    EXPECT_EQ(d.code, 2) << d.output;
    EXPECT_NE(d.output.find("needs 65"), std::string::npos) << d.output;
    // One window of --seq-len + 1 tokens cannot fill a step of two sequences but with copies.
    write_token_file(dir + "/one.bin", std::vector<uint32_t>(65, 7));
    Result e = sh("./train --config tiny --seq-len 64 --batch 2 --data " + dir + "/one.bin");
    EXPECT_EQ(e.code, 2) << e.output;
    EXPECT_NE(e.output.find("1 distinct window"), std::string::npos) << e.output;
    Result f = sh("./train --config tiny --seq-len 64 --batch 1 --steps 1 --data " + dir + "/one.bin");
    EXPECT_NE(f.code, 2) << f.output;  // one window, one sequence: fine (exit 1 without a GPU)
}

// Each step's log line says where its sequences start in the token file.
TEST(Binary, StepLogNamesTheDataWindows) {
    REQUIRE_GPU();
    if (!have_train()) GTEST_SKIP() << "./train not built";
    std::string dir = tmpdir("windows");
    std::vector<uint32_t> toks(4000);
    for (size_t i = 0; i < toks.size(); i++) toks[i] = (uint32_t)(i * 7 % 500);
    write_token_file(dir + "/t.bin", toks);
    Result r = sh("./train --config tiny --seq-len 64 --batch 2 --steps 2 --data " + dir + "/t.bin --log " + dir +
                  "/log.jsonl");
    ASSERT_EQ(r.code, 0) << r.output;
    std::ifstream f(dir + "/log.jsonl");
    std::string line;
    int steps = 0;
    while (std::getline(f, line)) {
        if (line.find("\"type\": \"step\"") == std::string::npos) continue;
        steps++;
        size_t w = line.find("\"windows\": [");
        ASSERT_NE(w, std::string::npos) << line;
        const std::string list = line.substr(w + 13, line.find(']', w) - w - 13);
        EXPECT_EQ(std::count(list.begin(), list.end(), ','), 1) << line;  // two windows
    }
    EXPECT_EQ(steps, 2);
}

// ---------------------------------------------------------------------------------------------
// Resume (GPU): the losses of a resumed run are those of the uninterrupted run, to the last bit.
std::map<int, std::string> losses_by_step(const std::string& log) {
    std::map<int, std::string> out;
    std::ifstream f(log);
    std::string line;
    while (std::getline(f, line)) {
        size_t s = line.find("\"step\": "), l = line.find("\"loss\": ");
        if (line.find("\"type\": \"step\"") == std::string::npos || s == std::string::npos) continue;
        int step = atoi(line.c_str() + s + 8);
        out[step] = line.substr(l + 8, line.find(',', l) - l - 8);
    }
    return out;
}

TEST(Resume, FromAnEarlierCheckpointReproducesTheLosses) {
    REQUIRE_GPU();
    if (!have_train()) GTEST_SKIP() << "./train not built";
    std::string dir = tmpdir("resume");
    const std::string common = "./train --config tiny --seq-len 128 --steps 6 --lr 3e-3 --task copy --seed 5";
    Result a = sh(common + " --state-dir " + dir + "/ck --state-every 2 --log " + dir + "/a.jsonl");
    ASSERT_EQ(a.code, 0) << a.output;
    // Kept: step-4 and step-6. Go back to step 4 and finish again.
    std::ofstream(dir + "/ck/latest") << "step-4";
    Result b = sh(common + " --state-dir " + dir + "/ck --resume --log " + dir + "/b.jsonl");
    ASSERT_EQ(b.code, 0) << b.output;
    auto la = losses_by_step(dir + "/a.jsonl"), lb = losses_by_step(dir + "/b.jsonl");
    ASSERT_EQ(lb.size(), 2u) << b.output;
    for (auto& kv : lb) EXPECT_EQ(kv.second, la[kv.first]) << "step " << kv.first;
    // Other vocabulary pieces cut the shards differently: refused, not loaded scrambled.
    Result c = sh(common + " --vocab-pieces 2 --state-dir " + dir + "/ck --resume");
    EXPECT_EQ(c.code, 2) << c.output;
    EXPECT_NE(c.output.find("vocabulary pieces 1, this run has 2"), std::string::npos) << c.output;
}

// --state-dir is checked before any GPU work, with or without --resume (a run that saves reads
// `latest` too): a pointer that dangles, loops or names no step folder, and with --resume a rank
// file that is not this run's state, are usage errors naming the file (runs without a GPU too).
TEST(Resume, BadStateIsRefusedBeforeTheGpu) {
    if (!have_train()) GTEST_SKIP() << "./train not built";
    const std::string dir = tmpdir("bad_state");
    const std::string run = "./train --config tiny --seq-len 128 --steps 1 --state-dir " + dir;
    auto expect = [&](const std::string& flags, const std::string& why) {
        SCOPED_TRACE(flags + ": " + why);
        Result r = sh(run + flags);
        EXPECT_EQ(r.code, 2) << r.output;
        EXPECT_NE(r.output.find(why), std::string::npos) << r.output;
    };
    symlink((dir + "/nowhere").c_str(), (dir + "/latest").c_str());
    expect(" --state-every 1", "a symbolic link to a file that does not exist");
    unlink((dir + "/latest").c_str());
    symlink((dir + "/latest").c_str(), (dir + "/latest").c_str());
    expect(" --resume", "a loop of symbolic links");
    unlink((dir + "/latest").c_str());
    std::ofstream(dir + "/latest") << "../../etc";
    expect(" --state-every 1", "should name a step folder (step-N)");
    std::ofstream(dir + "/latest") << "step-4\n";
    expect(" --resume", "names step-4, which is not a folder");
    mkdir((dir + "/step-4").c_str(), 0755);
    expect(" --resume", "step-4/rank-0.state': no such file");
    std::ofstream(dir + "/step-4/rank-0.state") << std::string(200, 'x');
    expect(" --resume", "is not a training state file");
    expect(" --resume --nproc 2", "is not a training state file");  // said once, before the ranks start
}

// A training state written by hand as save_train_state writes it: "LLSTATE2", then eleven int64
// (step, the sampler's state, GPUs, rank, --fsdp, parameters per GPU, parameters in all, hidden
// size, layers, vocabulary, vocabulary pieces), then three arrays of parameters-per-GPU floats,
// here a hole in a sparse file (a 38 GB state takes no disk).
struct HandState {
    std::string magic = "LLSTATE2";
    int64_t field[11];
    int64_t bytes;  // the file's size
    HandState(const Model& m, int64_t step) {
        const int64_t f[11] = {step, 77, m.world, 0, m.opt.fsdp, m.states.count, m.layout.total, m.cfg.dim,
                               m.cfg.n_layers, m.cfg.vocab, m.layout.vocab_pieces()};
        std::copy(f, f + 11, field);
        bytes = 96 + 12 * m.states.count;
    }
    void write(const std::string& path) const {
        std::ofstream(path, std::ios::binary | std::ios::trunc).write(magic.data(), 8).write((const char*)field, 88);
        ASSERT_EQ(truncate(path.c_str(), bytes), 0);
    }
};

// --resume checks the whole header and the file's size before the GPU opens, each fault in its
// own words: the step within [0, --steps] and that of its folder, every field against this run,
// the size against what the header implies ("truncated or corrupt"); a state that passes goes on
// to the GPU (exit 1 without one).
TEST(Resume, EveryHeaderFieldAndTheSizeAreChecked) {
    if (!have_train()) GTEST_SKIP() << "./train not built";
    const std::string dir = tmpdir("state_fields"), file = dir + "/step-4/rank-0.state";
    mkdir((dir + "/step-4").c_str(), 0755);
    std::ofstream(dir + "/latest") << "step-4";
    DryModel dm(config_by_name("tiny"), false, 1, 0);
    const HandState good(dm.m, 4);
    const std::string run = "./train --config tiny --seq-len 128 --steps 10 --state-dir " + dir + " --resume";
    good.write(file);
    const Result passed = sh(run);
    EXPECT_NE(passed.code, 2) << passed.output;
    EXPECT_EQ(passed.output.find("--resume"), std::string::npos) << passed.output;
    auto expect = [&](const std::function<void(HandState&)>& change, int code, const std::string& why) {
        SCOPED_TRACE(why);
        HandState s = good;
        change(s);
        s.write(file);
        const Result r = sh(run);
        EXPECT_EQ(r.code, code) << r.output;
        EXPECT_NE(r.output.find(why), std::string::npos) << r.output;
    };
    expect([](HandState& s) { s.field[0] = -1; }, 2, "holds step -1, outside [0, --steps 10]");
    expect([](HandState& s) { s.field[0] = 1LL << 40; }, 2, "holds step 1099511627776, outside [0, --steps 10]");
    expect([](HandState& s) { s.field[0] = 3; }, 2, "holds step 3, but its folder is step-4");
    expect([](HandState& s) { s.bytes -= 4; }, 2, "is truncated or corrupt");
    expect([](HandState& s) { s.bytes += 12; }, 2, "is truncated or corrupt");
    expect([](HandState& s) { s.bytes = 50; }, 2, "is truncated or corrupt: 50 bytes, less than a state's header (96)");
    expect([](HandState& s) { s.field[5] = 1LL << 62; }, 2, "is truncated or corrupt");
    expect([](HandState& s) { s.field[5] -= 1, s.bytes -= 12; }, 2, "parameters per GPU " + std::to_string(dm.m.states.count - 1));
    expect([](HandState& s) { s.magic = "LLSTATE1"; }, 2, "was written by an earlier version");
    const std::pair<int, std::string> fields[] = {{2, "GPUs 2"}, {3, "rank 2"}, {4, "--fsdp 2"}, {6, "parameters in all"},
                                                  {7, "hidden size"}, {8, "layers 3"}, {9, "vocabulary"},
                                                  {10, "vocabulary pieces 2"}};
    for (const auto& [at, says] : fields)
        expect([at = at](HandState& s) { s.field[at] = at == 3 || at == 4 ? 2 : s.field[at] + 1; }, 2, "written with " + says);
}

// A 3B model's state (38.6 GB) is checked under an 8 GiB address-space limit: its header is read,
// not the file mapped, so the run goes on to the GPU (which the limit or its absence then stops,
// with exit 1), and a state one float short is "truncated or corrupt" there too.
TEST(Resume, AStateLargerThanTheAddressSpaceIsCheckedUnmapped) {
    if (!have_train()) GTEST_SKIP() << "./train not built";
    const std::string dir = tmpdir("state_large");
    mkdir((dir + "/step-2").c_str(), 0755);
    std::ofstream(dir + "/latest") << "step-2";
    DryModel dm(config_by_name("llama3.2-3b"), false, 1, 0);
    HandState s(dm.m, 2);
    ASSERT_GT(s.bytes, 30LL << 30);
    s.write(dir + "/step-2/rank-0.state");
    const std::string run = "ulimit -v 8388608; ./train --config llama3.2-3b --seq-len 64 --steps 4 --state-dir " + dir + " --resume";
    Result r = sh(run);
    EXPECT_NE(r.code, 2) << r.output;
    EXPECT_EQ(r.output.find("--resume"), std::string::npos) << r.output;
    s.bytes -= 4;
    s.write(dir + "/step-2/rank-0.state");
    r = sh(run);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find("is truncated or corrupt"), std::string::npos) << r.output;
}

TEST(Resume, AfterAKillAtAnyMoment) {
    REQUIRE_GPU();
    if (!have_train()) GTEST_SKIP() << "./train not built";
    std::string dir = tmpdir("kill");
    const std::string args = "--config small --seq-len 2048 --steps 20 --task copy --seed 9";
    Result ref = sh("./train " + args + " --log " + dir + "/ref.jsonl");
    ASSERT_EQ(ref.code, 0) << ref.output;
    // Save every step, kill the run somewhere in the middle (perhaps mid-write).
    pid_t pid = fork();
    if (pid == 0) {
        std::string cmd = "exec ./train " + args + " --state-dir " + dir + "/ck --state-every 1 > /dev/null 2>&1";
        execl("/bin/sh", "sh", "-c", cmd.c_str(), (char*)nullptr);
        _exit(127);
    }
    for (int i = 0; i < 400 && !std::ifstream(dir + "/ck/latest").good(); i++) usleep(50000);
    usleep(700000);
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    Result r = sh("./train " + args + " --state-dir " + dir + "/ck --resume --log " + dir + "/r.jsonl");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
    auto lr = losses_by_step(dir + "/r.jsonl"), lref = losses_by_step(dir + "/ref.jsonl");
    ASSERT_FALSE(lr.empty());
    printf("  killed and resumed at step %d of 20\n", lr.begin()->first - 1);
    for (auto& kv : lr) EXPECT_EQ(kv.second, lref[kv.first]) << "step " << kv.first;
}

}  // namespace
