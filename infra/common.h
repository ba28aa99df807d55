// infra/common.h - what every file of the project shares.
//
//   * exit codes and the error type that carries them to main()
//   * the model configurations (Llama 3.2 3B, Llama 3.1 8B, Qwen3-32B, small test models)
//   * the flat parameter layout: every weight of the model lives at a fixed offset of one
//     flat array, grouped in "units" (the embedding, each transformer layer, the head).
//     A unit is what FSDP later shards and gathers as one buffer.
//   * memory categories of the tracked allocator
//
// Host-only and header-only, so CPU tests and the planner use it without a GPU.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

// ---------------------------------------------------------------------------------------------
// Exit codes (docs/design.md): 0 ok, 1 runtime failure, 2 bad usage or input, 3 out of memory.
enum ExitCode { EXIT_OK = 0, EXIT_RUNTIME = 1, EXIT_USAGE = 2, EXIT_OOM = 3 };

// Every fatal condition is thrown as a Fatal carrying its exit code; main() prints it once.
struct Fatal : std::runtime_error {
    int code;
    Fatal(int code_, const std::string& msg) : std::runtime_error(msg), code(code_) {}
};
[[noreturn]] inline void usage_error(const std::string& msg) { throw Fatal(EXIT_USAGE, msg); }
[[noreturn]] inline void runtime_error(const std::string& msg) { throw Fatal(EXIT_RUNTIME, msg); }
// For a small program's main(): runs `body`; a Fatal ends it with its message and exit code.
template <class Body>
int exit_code_of(const char* program, Body&& body) {
    try {
        return body();
    } catch (const Fatal& f) {
        fprintf(stderr, "%s: %s\n", program, f.what());
        return f.code;
    }
}

// ---------------------------------------------------------------------------------------------
// Model configuration. Values of the two real models are those of Meta's HF config.json files.
struct RopeScaling {
    bool enabled = false;          // rope_type "llama3"
    double factor = 1.0;           // 32 for Llama 3.2, 8 for Llama 3.1 (never hard-code 8)
    double low_freq_factor = 1.0;
    double high_freq_factor = 4.0;
    double original_max_pos = 8192;
};

// The model family. Qwen3 is Llama's layer with one change: q and k are normalized per head
// (RMSNorm over each head's d values, a gain of d per layer for q and one for k) before RoPE.
enum class Family { LLAMA, QWEN3 };
// Hugging Face's names of each family (config.json's model_type and architectures).
inline const char* family_model_type(Family f) { return f == Family::QWEN3 ? "qwen3" : "llama"; }
inline const char* family_architecture(Family f) { return f == Family::QWEN3 ? "Qwen3ForCausalLM" : "LlamaForCausalLM"; }

struct LlamaConfig {
    std::string name;
    Family family = Family::LLAMA;
    int dim = 0;          // hidden size D
    int n_layers = 0;     // L
    int n_heads = 0;      // query heads Hq
    int n_kv_heads = 0;   // key/value heads Hkv (grouped-query attention: Hq % Hkv == 0)
    int head_dim = 0;     // d
    int ffn_dim = 0;      // SwiGLU intermediate F
    int vocab = 0;        // V
    double norm_eps = 1e-5;
    double rope_theta = 500000.0;
    RopeScaling rope_scaling;
    bool tied_embeddings = false;  // LM head reuses the token embedding

    bool qk_norm() const { return family == Family::QWEN3; }  // per-head RMSNorm of q and k before RoPE
    int64_t q_dim() const { return (int64_t)n_heads * head_dim; }
    int64_t kv_dim() const { return (int64_t)n_kv_heads * head_dim; }
    // The fused QKV projection writes, per token, [q heads | k heads | v heads].
    int64_t qkv_dim() const { return q_dim() + 2 * kv_dim(); }
};

inline std::vector<LlamaConfig> known_configs() {
    std::vector<LlamaConfig> all;
    LlamaConfig c;
    // Llama 3.2 3B
    c = LlamaConfig();
    c.name = "llama3.2-3b"; c.dim = 3072; c.n_layers = 28; c.n_heads = 24; c.n_kv_heads = 8;
    c.head_dim = 128; c.ffn_dim = 8192; c.vocab = 128256; c.tied_embeddings = true;
    c.rope_scaling = {true, 32.0, 1.0, 4.0, 8192};
    all.push_back(c);
    // Llama 3.1 8B
    c = LlamaConfig();
    c.name = "llama3.1-8b"; c.dim = 4096; c.n_layers = 32; c.n_heads = 32; c.n_kv_heads = 8;
    c.head_dim = 128; c.ffn_dim = 14336; c.vocab = 128256; c.tied_embeddings = false;
    c.rope_scaling = {true, 8.0, 1.0, 4.0, 8192};
    all.push_back(c);
    // Test models: the same architecture, small. Head dim 64 (the attention kernel's other size).
    c = LlamaConfig();
    c.name = "tiny"; c.dim = 128; c.n_layers = 2; c.n_heads = 4; c.n_kv_heads = 2;
    c.head_dim = 64; c.ffn_dim = 384; c.vocab = 512; c.tied_embeddings = true;
    c.rope_scaling = {true, 8.0, 1.0, 4.0, 64};  // small original_max_pos: all three regimes used
    all.push_back(c);
    c = LlamaConfig();
    c.name = "tiny-untied"; c.dim = 128; c.n_layers = 2; c.n_heads = 4; c.n_kv_heads = 1;
    c.head_dim = 64; c.ffn_dim = 320; c.vocab = 384; c.tied_embeddings = false;
    c.rope_scaling = {true, 32.0, 1.0, 4.0, 64};
    all.push_back(c);
    // Head dim 128: the model-level tests through the fast Hopper attention kernels.
    c = LlamaConfig();
    c.name = "tiny-hd128"; c.dim = 128; c.n_layers = 2; c.n_heads = 4; c.n_kv_heads = 2;
    c.head_dim = 128; c.ffn_dim = 256; c.vocab = 384; c.tied_embeddings = false;
    c.rope_scaling = {true, 8.0, 1.0, 4.0, 64};
    all.push_back(c);
    // Eight query heads over 2 KV heads: Ulysses over 8 ranks, each KV head shared by 4 of them.
    c.name = "tiny-8h"; c.dim = 1024; c.n_heads = 8; c.ffn_dim = 512;
    all.push_back(c);
    c = LlamaConfig();
    c.name = "small"; c.dim = 1024; c.n_layers = 4; c.n_heads = 8; c.n_kv_heads = 2;
    c.head_dim = 128; c.ffn_dim = 2816; c.vocab = 8192; c.tied_embeddings = true;
    c.rope_scaling = {true, 32.0, 1.0, 4.0, 8192};
    all.push_back(c);
    // Learning at long context (--task induction): small enough to train in minutes, with a
    // vocabulary as large as Llama 3's, so that a sequence's first half of up to 128K tokens can
    // be drawn without repeats.
    c = LlamaConfig();
    c.name = "mini"; c.dim = 512; c.n_layers = 4; c.n_heads = 4; c.n_kv_heads = 2;
    c.head_dim = 128; c.ffn_dim = 1536; c.vocab = 131072; c.tied_embeddings = true;
    c.rope_scaling = {true, 32.0, 1.0, 4.0, 8192};
    all.push_back(c);
    // The same model over bytes (tools/tokenize.py --bytes: 256 byte values and a
    // begin-of-document token, in a vocabulary rounded up to a piece): text at long context, as
    // make data builds it from Debian's linux-source.
    c.name = "mini-bytes"; c.vocab = 384;
    all.push_back(c);
    // Qwen3-32B, the Untied Ulysses paper's 32B model (its HF config.json): query heads x head dim
    // (8192) wider than the hidden size (5120), RoPE theta 1e6 without scaling, eps 1e-6.
    c = LlamaConfig();
    c.name = "qwen3-32b"; c.family = Family::QWEN3; c.dim = 5120; c.n_layers = 64; c.n_heads = 64;
    c.n_kv_heads = 8; c.head_dim = 128; c.ffn_dim = 25600; c.vocab = 151936; c.tied_embeddings = false;
    c.norm_eps = 1e-6; c.rope_theta = 1e6;
    all.push_back(c);
    // Its test model: head dim 128 (the fast kernels on Hopper), q_dim 512 against a hidden size of 128.
    c = LlamaConfig();
    c.name = "tiny-qwen3"; c.family = Family::QWEN3; c.dim = 128; c.n_layers = 2; c.n_heads = 4;
    c.n_kv_heads = 2; c.head_dim = 128; c.ffn_dim = 256; c.vocab = 384; c.tied_embeddings = false;
    c.norm_eps = 1e-6; c.rope_theta = 1e6;
    all.push_back(c);
    c.name = "tiny-qwen3-8h"; c.n_heads = 8;  // as tiny-8h: Ulysses over 8 ranks, KV heads shared by 4
    all.push_back(c);
    return all;
}

inline std::string known_config_names() {
    std::string s;
    for (const auto& c : known_configs()) s += (s.empty() ? "" : ", ") + c.name;
    return s;
}

inline LlamaConfig config_by_name(const std::string& name) {
    for (const auto& c : known_configs())
        if (c.name == name) return c;
    usage_error("unknown --config '" + name + "' (known: " + known_config_names() + ")");
}

// ---------------------------------------------------------------------------------------------
// Flat parameter layout, and its units (what FSDP shards, gathers and reduces one at a time).
//
// tensors, in order: embed [V, D]; per layer l: attn_norm [D], wqkv [Hq*d + 2*Hkv*d, D],
//   (Qwen3: q_norm [d], k_norm [d]), wo [D, Hq*d], mlp_norm [D], w13 [2F, D] (rows 0..F-1 gate,
//   F..2F-1 up), w2 [D, F];
//   final_norm [D]; lm_head [V, D] (only when embeddings are not tied)
// units, in order (k vocabulary pieces):
//   0 .. k-1           the embedding, in k pieces of vocabulary rows (k = 1: the whole table)
//   k + l              layer l
//   k + L              the final norm
//   k + L + 1 ..       the LM head, cut the same way (untied only)
// The talk's FSDP gathers the embedding and the head as whole units (k = 1). Stage 7's
// --vocab-pieces (beyond/savings.cu) cuts them into pieces of about a layer's size, so FSDP's slots,
// sized by the largest unit, hold a layer: the embedding and the head of a 128K vocabulary are
// 2.4 layers each in Llama 3.1 8B. A piece's rows start at a multiple of PIECE_ROWS.
//
// Matrices are [out_features, in_features] row-major, as in PyTorch/HF. Each tensor starts at a
// multiple of PARAM_ALIGN elements so every pointer handed to cuBLAS is 256-byte aligned in bf16.
enum ParamKind { P_EMBED, P_ATTN_NORM, P_WQKV, P_WO, P_MLP_NORM, P_W13, P_W2, P_FINAL_NORM, P_LM_HEAD, P_Q_NORM, P_K_NORM };
constexpr int64_t PARAM_ALIGN = 128;
constexpr int64_t PIECE_ROWS = 128;

struct ParamTensor {
    ParamKind kind;
    int layer;          // -1 outside the transformer layers
    int unit;           // the unit it starts in (the embedding and LM head span k units)
    int64_t offset;     // in elements, from the start of the flat array
    int64_t rows, cols; // a vector has rows = 1
    bool decay;         // AdamW weight decay applies (matrices yes, norm gains no)
    int64_t numel() const { return rows * cols; }
};

constexpr int NUM_PARAM_KINDS = 11;

struct ParamLayout {
    std::vector<ParamTensor> tensors;
    std::vector<int64_t> unit_begin;  // unit u spans [unit_begin[u], unit_begin[u+1])
    std::vector<int> by_key;          // key(kind, layer) -> index in tensors, or -1
    int64_t total = 0;                // elements including alignment padding
    int n_layers = 0;
    bool tied = false;
    std::vector<int64_t> piece_row;   // vocabulary piece p holds rows [piece_row[p], piece_row[p + 1])
    int num_units() const { return (int)unit_begin.size() - 1; }
    int64_t unit_size(int u) const { return unit_begin[u + 1] - unit_begin[u]; }
    int vocab_pieces() const { return (int)piece_row.size() - 1; }
    int64_t piece_rows(int p) const { return piece_row[p + 1] - piece_row[p]; }
    int embed_unit(int piece) const { return piece; }
    int layer_unit(int l) const { return vocab_pieces() + l; }
    int final_norm_unit() const { return vocab_pieces() + n_layers; }
    // The LM head's piece: the embedding's under tied embeddings.
    int head_unit(int piece) const { return tied ? embed_unit(piece) : final_norm_unit() + 1 + piece; }
    static int key(ParamKind kind, int layer) { return (layer + 1) * NUM_PARAM_KINDS + (int)kind; }
    const ParamTensor& find(ParamKind kind, int layer = -1) const {
        int k = key(kind, layer);
        if (k < 0 || k >= (int)by_key.size() || by_key[k] < 0) throw std::logic_error("parameter not in layout");
        return tensors[by_key[k]];
    }
};

inline int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// Elements of one transformer layer's unit.
inline int64_t layer_params(const LlamaConfig& c) {
    auto a = [](int64_t n) { return align_up(n, PARAM_ALIGN); };
    return 2 * a(c.dim) + a(c.qkv_dim() * c.dim) + (c.qk_norm() ? 2 * a(c.head_dim) : 0) + a(c.dim * c.q_dim()) +
           a(2LL * c.ffn_dim * c.dim) + a((int64_t)c.dim * c.ffn_dim);
}

// Vocabulary pieces: `pieces`, or (0) as few as keep a piece of V x D within about a layer's size
// (boundaries round up to PIECE_ROWS rows).
inline int vocab_piece_count(const LlamaConfig& c, int pieces) {
    if (pieces > 0) return pieces;
    const int64_t table = (int64_t)c.vocab * c.dim, layer = std::max<int64_t>(1, layer_params(c));
    const int64_t most = std::max<int64_t>(1, c.vocab / PIECE_ROWS);  // a piece holds PIECE_ROWS rows at least
    return (int)std::min<int64_t>(std::max<int64_t>(1, (table + layer - 1) / layer), most);
}

// The layout of c's parameters with the embedding and LM head in `vocab_pieces` units (1: whole;
// 0: as few as keep each within about a layer's size). Tensors and offsets do not depend on it.
inline ParamLayout param_layout(const LlamaConfig& c, int vocab_pieces = 1) {
    ParamLayout lay;
    lay.n_layers = c.n_layers;
    lay.tied = c.tied_embeddings;
    const int k = vocab_piece_count(c, vocab_pieces);
    for (int p = 0; p <= k; p++)
        lay.piece_row.push_back(p == k ? c.vocab : std::min<int64_t>(c.vocab, align_up((int64_t)c.vocab * p / k, PIECE_ROWS)));
    int64_t off = 0;
    auto add = [&](ParamKind kind, int layer, int unit, int64_t rows, int64_t cols, bool decay) {
        lay.tensors.push_back(
            {.kind = kind, .layer = layer, .unit = unit, .offset = off, .rows = rows, .cols = cols, .decay = decay});
        off = align_up(off + rows * cols, PARAM_ALIGN);
    };
    auto begin_unit = [&](int64_t at) {  // the next unit starts at element `at`: its index
        lay.unit_begin.push_back(at);
        return (int)lay.unit_begin.size() - 1;
    };
    // A table of vocabulary rows: one unit per piece (the table stays one tensor, its pieces
    // contiguous in the flat array).
    auto add_table = [&](ParamKind kind) {
        const int64_t begin = off;
        add(kind, -1, (int)lay.unit_begin.size(), c.vocab, c.dim, true);
        for (int p = 0; p < k; p++) begin_unit(begin + lay.piece_row[p] * c.dim);
    };
    add_table(P_EMBED);
    for (int l = 0; l < c.n_layers; l++) {
        const int u = begin_unit(off);
        add(P_ATTN_NORM, l, u, 1, c.dim, false);
        add(P_WQKV, l, u, c.qkv_dim(), c.dim, true);
        if (c.qk_norm()) add(P_Q_NORM, l, u, 1, c.head_dim, false), add(P_K_NORM, l, u, 1, c.head_dim, false);
        add(P_WO, l, u, c.dim, c.q_dim(), true);
        add(P_MLP_NORM, l, u, 1, c.dim, false);
        add(P_W13, l, u, 2 * (int64_t)c.ffn_dim, c.dim, true);
        add(P_W2, l, u, c.dim, c.ffn_dim, true);
    }
    add(P_FINAL_NORM, -1, begin_unit(off), 1, c.dim, false);
    if (!c.tied_embeddings) add_table(P_LM_HEAD);
    lay.unit_begin.push_back(off);  // the end of the last unit
    lay.total = off;
    lay.by_key.assign((c.n_layers + 1) * NUM_PARAM_KINDS, -1);
    for (size_t i = 0; i < lay.tensors.size(); i++)
        lay.by_key[ParamLayout::key(lay.tensors[i].kind, lay.tensors[i].layer)] = (int)i;
    return lay;
}

// Parameter count without padding (what model cards quote: 3.21 B, 8.03 B).
inline int64_t count_params(const LlamaConfig& c) {
    int64_t n = 0;
    for (const auto& t : param_layout(c).tensors) n += t.numel();
    return n;
}

// Parameters that take part in matrix products, for FLOP counting (the embedding lookup is not
// a matrix product; a tied embedding still costs a product as the LM head).
inline int64_t count_matmul_params(const LlamaConfig& c) {
    int64_t per_layer = (c.qkv_dim() + c.q_dim()) * c.dim + 3LL * c.ffn_dim * c.dim;
    return per_layer * c.n_layers + (int64_t)c.vocab * c.dim;
}

inline const char* param_kind_name(ParamKind k) {
    switch (k) {
        case P_EMBED: return "embed";
        case P_ATTN_NORM: return "attn_norm";
        case P_WQKV: return "wqkv";
        case P_WO: return "wo";
        case P_MLP_NORM: return "mlp_norm";
        case P_W13: return "w13";
        case P_W2: return "w2";
        case P_FINAL_NORM: return "final_norm";
        case P_LM_HEAD: return "lm_head";
        case P_Q_NORM: return "q_norm";
        case P_K_NORM: return "k_norm";
    }
    return "?";
}

// Inverse RoPE frequencies with Llama 3 scaling, in float64 (HF's _compute_llama3_parameters).
// Used by the GPU code; the CPU reference computes its own copy independently.
inline std::vector<double> rope_inv_freq(const LlamaConfig& c) {
    const double pi = 3.14159265358979323846;
    std::vector<double> inv(c.head_dim / 2);
    for (int i = 0; i < c.head_dim / 2; i++) {
        double f = 1.0 / std::pow(c.rope_theta, (2.0 * i) / c.head_dim);
        if (c.rope_scaling.enabled) {
            const RopeScaling& s = c.rope_scaling;
            double low_wavelen = s.original_max_pos / s.low_freq_factor;
            double high_wavelen = s.original_max_pos / s.high_freq_factor;
            double wavelen = 2.0 * pi / f;
            if (wavelen > low_wavelen) {
                f = f / s.factor;
            } else if (wavelen >= high_wavelen) {  // between the two: blend
                double smooth = (s.original_max_pos / wavelen - s.low_freq_factor) /
                                (s.high_freq_factor - s.low_freq_factor);
                f = (1.0 - smooth) * f / s.factor + smooth * f;
            }
        }
        inv[i] = f;
    }
    return inv;
}

// ---------------------------------------------------------------------------------------------
// Memory categories of the tracked allocator (docs/design.md, "Memory").
enum MemCategory { MEM_MODEL, MEM_ATTENTION, MEM_OTHER, MEM_COMM, MEM_WORKSPACE, MEM_NUM_CATEGORIES };

inline const char* mem_category_name(int c) {
    static const char* names[] = {"model", "attention", "other", "comm", "workspace"};
    return (c >= 0 && c < MEM_NUM_CATEGORIES) ? names[c] : "?";
}

constexpr double GiB = 1024.0 * 1024.0 * 1024.0;
