// tests/files_util.h - what the CPU tests of files share (test_files, test_inputs): the exit
// code of a fatal error, temporary folders, a model's layout without a GPU, and checkpoints
// written through write_hf_checkpoint or by hand.
#pragma once

#include <unistd.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../io/files.h"
#include "../llama.h"
#include "gtest/gtest.h"

inline int fatal_code(const std::function<void()>& fn, std::string* msg = nullptr) {
    try {
        fn();
    } catch (const Fatal& f) {
        if (msg) *msg = f.what();
        return f.code;
    }
    return -1;
}

inline std::string read_text_file(const std::string& path) {
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

inline std::string tmpdir(const std::string& name) {
    std::string d = "/tmp/llama_files_" + std::to_string(getpid()) + "_" + name;
    std::string cmd = "rm -rf " + d + " && mkdir -p " + d;
    if (system(cmd.c_str()) != 0) ADD_FAILURE() << "cannot make " << d;
    return d;
}

// A model's layout and this rank's segments, without a GPU.
struct DryModel {
    Model m;
    Comm* comm = nullptr;
    DryModel(const LlamaConfig& c, bool fsdp, int world, int rank) {
        m.cfg = c;
        m.opt.fsdp = fsdp;
        m.world = world;
        m.shape.seq = 64;
        comm = comm_single();
        comm->rank = rank, comm->world = world;
        m.comm = comm;
        Arena a;
        model_declare_buffers(m, a);
    }
    ~DryModel() { delete comm; }
};

inline std::vector<float> random_params(const ParamLayout& lay, std::mt19937_64& rng) {
    std::vector<float> p(lay.total, 0.f);
    std::normal_distribution<float> nd(0.f, 0.5f);
    for (const auto& t : lay.tensors)
        for (int64_t i = 0; i < t.numel(); i++) p[t.offset + i] = nd(rng);
    return p;
}

inline void write_checkpoint(const std::string& dir, const LlamaConfig& c, const std::vector<float>& p, bool bf16) {
    ParamLayout lay = param_layout(c);
    write_hf_checkpoint(dir, c, lay, bf16, true, [&](int u) {
        return std::vector<float>(p.begin() + lay.unit_begin[u], p.begin() + lay.unit_begin[u + 1]);
    });
}

inline float bf16_round(float v) {  // round to nearest even, as the writer does
    uint32_t u;
    memcpy(&u, &v, 4);
    u += 0x7fff + ((u >> 16) & 1);
    u &= 0xffff0000u;
    memcpy(&v, &u, 4);
    return v;
}

// What rank r of `world` must hold: its segments of the full parameters.
inline std::vector<float> expected_local(const Model& m, const std::vector<float>& full, bool round) {
    std::vector<float> out(m.states.count, 0.f);
    for (const ParamSegment& s : m.states.segments)
        for (int64_t i = 0; i < s.count; i++) {
            float v = full[s.tensor->offset + s.tensor_offset + i];
            out[s.local + i] = round ? bf16_round(v) : v;
        }
    return out;
}

// A safetensors file built by hand: name -> (dtype, shape, bytes).
struct StSpec {
    std::string dtype;
    std::vector<int64_t> shape;
    size_t bytes;
};
inline void write_st(const std::string& path, const std::vector<std::pair<std::string, StSpec>>& entries) {
    std::string h = "{";
    size_t off = 0;
    for (size_t i = 0; i < entries.size(); i++) {
        const auto& e = entries[i].second;
        std::string shape = "[";
        for (size_t k = 0; k < e.shape.size(); k++) shape += (k ? "," : "") + std::to_string(e.shape[k]);
        h += (i ? ", " : "") + std::string("\"") + entries[i].first + "\": {\"dtype\": \"" + e.dtype + "\", \"shape\": " +
             shape + "], \"data_offsets\": [" + std::to_string(off) + ", " + std::to_string(off + e.bytes) + "]}";
        off += e.bytes;
    }
    h += "}";
    uint64_t n = h.size();
    std::ofstream f(path, std::ios::binary);
    f.write((char*)&n, 8);
    f << h << std::string(off, '\0');
}

// The entries of a correct checkpoint for c (zeros).
inline std::vector<std::pair<std::string, StSpec>> correct_entries(const LlamaConfig& c) {
    std::vector<std::pair<std::string, StSpec>> e;
    auto add = [&](const std::string& n, std::vector<int64_t> s) {
        int64_t k = 1;
        for (auto d : s) k *= d;
        e.push_back({n, {"F32", s, (size_t)k * 4}});
    };
    add("model.embed_tokens.weight", {c.vocab, c.dim});
    for (int l = 0; l < c.n_layers; l++) {
        std::string L = "model.layers." + std::to_string(l) + ".";
        add(L + "input_layernorm.weight", {c.dim});
        add(L + "self_attn.q_proj.weight", {c.q_dim(), c.dim});
        add(L + "self_attn.k_proj.weight", {c.kv_dim(), c.dim});
        add(L + "self_attn.v_proj.weight", {c.kv_dim(), c.dim});
        if (c.family == Family::QWEN3)
            add(L + "self_attn.q_norm.weight", {c.head_dim}), add(L + "self_attn.k_norm.weight", {c.head_dim});
        add(L + "self_attn.o_proj.weight", {c.dim, c.q_dim()});
        add(L + "post_attention_layernorm.weight", {c.dim});
        add(L + "mlp.gate_proj.weight", {c.ffn_dim, c.dim});
        add(L + "mlp.up_proj.weight", {c.ffn_dim, c.dim});
        add(L + "mlp.down_proj.weight", {c.dim, c.ffn_dim});
    }
    add("model.norm.weight", {c.dim});
    if (!c.tied_embeddings) add("lm_head.weight", {c.vocab, c.dim});
    return e;
}
