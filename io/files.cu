// io/files.cu - the files of a run: Hugging Face checkpoints (safetensors + config.json), token files, and
// the whole training state for save and resume.
//
// Hugging Face. LlamaForCausalLM names its tensors model.embed_tokens.weight,
// model.layers.{i}.input_layernorm.weight, ...self_attn.{q,k,v,o}_proj.weight,
// ...post_attention_layernorm.weight, ...mlp.{gate,up,down}_proj.weight, model.norm.weight and
// lm_head.weight (absent when tied); Qwen3ForCausalLM the same, and ...self_attn.{q,k}_norm.weight;
// each [out, in] row-major. Their RoPE is the rotate-half layout ours uses, so no permutation is needed. Our fused wqkv is q, k, v stacked by rows and
// w13 is gate then up, so each of our tensors is one or more row ranges of HF tensors. A load
// reads only the pieces of this GPU's shards straight from the memory-mapped files (a GPU never
// holds the whole model in host memory); a save gathers one unit at a time and rank 0 streams it
// into a single model.safetensors (bf16 or fp32) next to a config.json that transformers reads.
//
// Token files: a documented flat format (see README): 8-byte magic "LLTOKENS", uint32 version 1,
// uint32 bytes per token (4), uint64 count, then count little-endian uint32 tokens.
//
// What reads the files a run is given (opening them, token file and safetensors headers, the
// index, config.json, and the JSON under them) is host code in input_files.h and json.h, so a
// fuzzer builds it without CUDA (tests/fuzz/); this file maps what they accept onto the model.
//
// Training state (--state-dir, --resume): per GPU its fp32 master weights, AdamW moments
// (its shards under --fsdp), the step and the data sampler's state, in DIR/step-N/rank-R.state;
// then DIR/latest names step-N. Every file is written as a temporary, fsynced and renamed, and
// latest moves only after every rank's file is in place: a kill at any moment leaves the last
// good state loadable. The bf16 weights are derived from the master copy on load, so a
// resumed run computes exactly what the uninterrupted one would.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <sstream>

#include "io/files.h"
#include "io/input_files.h"
#include "llama.h"

namespace {

const char* const INDEX_NAME = "model.safetensors.index.json";

bool exists(const std::string& p) {
    struct stat st;
    return stat(p.c_str(), &st) == 0;
}

// Write a file atomically: temporary, fsync, rename, fsync the directory.
void fsync_dir(const std::string& dir) {
    int fd = open(dir.c_str(), O_RDONLY);
    if (fd >= 0) fsync(fd), close(fd);
}
std::string dir_of(const std::string& path) {
    size_t p = path.rfind('/');
    return p == std::string::npos ? "." : path.substr(0, p);
}

struct AtomicFile {
    std::string path, tmp;
    FILE* f = nullptr;
    explicit AtomicFile(const std::string& p) : path(p), tmp(p + ".tmp") {
        f = fopen(tmp.c_str(), "wb");
        if (!f) runtime_error("cannot write '" + tmp + "': " + strerror(errno));
    }
    void write(const void* data, size_t n) {
        if (n && fwrite(data, 1, n, f) != n) runtime_error("writing '" + tmp + "' failed: " + strerror(errno));
    }
    void commit() {
        if (fflush(f) != 0 || fsync(fileno(f)) != 0) runtime_error("flushing '" + tmp + "' failed");
        fclose(f);
        f = nullptr;
        if (rename(tmp.c_str(), path.c_str()) != 0) runtime_error("renaming '" + tmp + "' failed");
        fsync_dir(dir_of(path));
    }
    ~AtomicFile() {
        if (f) fclose(f), unlink(tmp.c_str());
    }
};

void make_dirs(const std::string& d) {
    std::string cur;
    std::stringstream ss(d);
    std::string part;
    if (!d.empty() && d[0] == '/') cur = "/";
    while (std::getline(ss, part, '/')) {
        if (part.empty()) continue;
        cur += part + "/";
        mkdir(cur.c_str(), 0755);
    }
    if (!is_directory(d)) usage_error("cannot create directory '" + d + "'");
}

// =============================================================================================
// safetensors
struct StTensor {
    std::string dtype;
    std::vector<int64_t> shape;
    const uint8_t* data;
    int64_t bytes;
    const Mapped* file;
};

// The tensors of one safetensors file, every header checked against the file (input_files.h).
void read_safetensors(const Mapped& f, std::map<std::string, StTensor>& out) {
    const StHeader h = parse_safetensors(f.data, f.size, f.path);
    for (const StEntry& e : h.tensors)
        out[e.name] = {e.dtype, e.shape, f.data + h.data_start + e.begin, (int64_t)(e.end - e.begin), &f};
}

float to_float(const StTensor& t, int64_t i) {
    if (t.dtype == "F32") {
        float v;
        memcpy(&v, t.data + 4 * i, 4);
        return v;
    }
    uint16_t h;
    memcpy(&h, t.data + 2 * i, 2);
    if (t.dtype == "BF16") {
        uint32_t u = (uint32_t)h << 16;
        float v;
        memcpy(&v, &u, 4);
        return v;
    }
    // F16
    uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0) {
        float v = std::ldexp((float)man, -24);
        return sign ? -v : v;
    }
    if (exp == 31) u = (sign << 31) | 0x7f800000 | (man << 13);
    else u = (sign << 31) | ((exp + 112) << 23) | (man << 13);
    float v;
    memcpy(&v, &u, 4);
    return v;
}

uint16_t to_bf16_bits(float v) {  // round to nearest even
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7f800000) == 0x7f800000) return (uint16_t)(u >> 16) | ((u & 0xffff) ? 0x40 : 0);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

// One of our tensors as row ranges of Hugging Face tensors.
struct HfPiece {
    std::string name;
    int64_t row0, rows;  // our rows [row0, row0 + rows) are the HF tensor's rows [0, rows)
};

std::vector<HfPiece> hf_pieces(const LlamaConfig& c, const ParamTensor& t) {
    const std::string L = "model.layers." + std::to_string(t.layer) + ".";
    switch (t.kind) {
        case P_EMBED: return {{"model.embed_tokens.weight", 0, t.rows}};
        case P_ATTN_NORM: return {{L + "input_layernorm.weight", 0, 1}};
        case P_WQKV:
            return {{L + "self_attn.q_proj.weight", 0, c.q_dim()},
                    {L + "self_attn.k_proj.weight", c.q_dim(), c.kv_dim()},
                    {L + "self_attn.v_proj.weight", c.q_dim() + c.kv_dim(), c.kv_dim()}};
        case P_WO: return {{L + "self_attn.o_proj.weight", 0, t.rows}};
        case P_MLP_NORM: return {{L + "post_attention_layernorm.weight", 0, 1}};
        case P_W13: return {{L + "mlp.gate_proj.weight", 0, c.ffn_dim}, {L + "mlp.up_proj.weight", c.ffn_dim, c.ffn_dim}};
        case P_W2: return {{L + "mlp.down_proj.weight", 0, t.rows}};
        case P_FINAL_NORM: return {{"model.norm.weight", 0, 1}};
        case P_LM_HEAD: return {{"lm_head.weight", 0, t.rows}};
        case P_Q_NORM: return {{L + "self_attn.q_norm.weight", 0, 1}};
        case P_K_NORM: return {{L + "self_attn.k_norm.weight", 0, 1}};
    }
    return {};
}

std::vector<int64_t> hf_shape(const ParamTensor& t, const HfPiece& p) {
    if (t.rows == 1) return {t.cols};  // norms are vectors
    return {p.rows, t.cols};
}

std::string shape_str(const std::vector<int64_t>& s) {
    std::string r = "[";
    for (size_t i = 0; i < s.size(); i++) r += (i ? ", " : "") + std::to_string(s[i]);
    return r + "]";
}

}  // namespace

// =============================================================================================
// config.json
std::string hf_config_json(const LlamaConfig& c, bool bf16) {
    // transformers loads the weights in the dtype config.json names when from_pretrained is given
    // none: newer versions read "dtype", older ones "torch_dtype"; both name the dtype written.
    const char* dtype = bf16 ? "bfloat16" : "float32";
    char buf[2048];
    snprintf(buf, sizeof buf,
             "{\n"
             "  \"architectures\": [\"%s\"],\n"
             "  \"model_type\": \"%s\",\n"
             "  \"hidden_size\": %d,\n"
             "  \"intermediate_size\": %d,\n"
             "  \"num_hidden_layers\": %d,\n"
             "  \"num_attention_heads\": %d,\n"
             "  \"num_key_value_heads\": %d,\n"
             "  \"head_dim\": %d,\n"
             "  \"vocab_size\": %d,\n"
             "  \"rms_norm_eps\": %.10g,\n"
             "  \"rope_theta\": %.10g,\n"
             "  \"rope_scaling\": %s,\n"
             "  \"tie_word_embeddings\": %s,\n"
             "  \"max_position_embeddings\": 131072,\n"
             "  \"hidden_act\": \"silu\",\n"
             "  \"attention_bias\": false,\n"
             "  \"mlp_bias\": false,\n"
             "  \"torch_dtype\": \"%s\",\n"
             "  \"dtype\": \"%s\"\n"
             "}\n",
             family_architecture(c.family), family_model_type(c.family), c.dim, c.ffn_dim, c.n_layers, c.n_heads,
             c.n_kv_heads, c.head_dim, c.vocab, c.norm_eps, c.rope_theta,
             c.rope_scaling.enabled
                 ? ("{\"rope_type\": \"llama3\", \"factor\": " + std::to_string(c.rope_scaling.factor) +
                    ", \"low_freq_factor\": " + std::to_string(c.rope_scaling.low_freq_factor) +
                    ", \"high_freq_factor\": " + std::to_string(c.rope_scaling.high_freq_factor) +
                    ", \"original_max_position_embeddings\": " +
                    std::to_string((int64_t)c.rope_scaling.original_max_pos) + "}")
                       .c_str()
                 : "null",
             c.tied_embeddings ? "true" : "false", dtype, dtype);
    return buf;
}

// =============================================================================================
// Reading a Hugging Face checkpoint: open and check every file, name and shape first (no
// weights are read), then this GPU's parameters (its shards under --fsdp) in fp32.
struct HfCheckpoint {
    std::vector<std::unique_ptr<Mapped>> maps;
    std::map<std::string, StTensor> tensors;
};

// The files of the checkpoint at `path` (a .safetensors file, a directory with model.safetensors
// or a sharded index, or the index itself), the index they are listed in ("" for none), and the
// directory its config.json would be in. A directory holding both is read as transformers reads
// it: model.safetensors (so an older index beside a newer save cannot stand in for it).
static std::vector<std::string> checkpoint_files(const std::string& path, std::string* dir, std::string* index) {
    auto shards = [&](const std::string& index_path) {
        std::vector<std::string> files;
        for (const std::string& f : index_shards(read_input_text(index_path, "--init-from"), index_path))
            files.push_back(*dir + "/" + f);
        *index = index_path;
        return files;
    };
    if (!is_directory(path)) {  // a file (or not a file: Mapped says what is wrong with it)
        *dir = dir_of(path);
        const bool is_index = path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0;
        return is_index ? shards(path) : std::vector<std::string>{path};
    }
    *dir = path;
    if (path_present(path + "/model.safetensors")) return {path + "/model.safetensors"};
    if (path_present(path + "/" + INDEX_NAME)) return shards(path + "/" + INDEX_NAME);
    usage_error("--init-from '" + path + "': no model.safetensors or " + INDEX_NAME + " there");
}

std::vector<RunPath> hf_checkpoint_reads(const std::string& flag, const std::string& path) {
    std::string dir, index;
    std::vector<RunPath> reads;
    for (const std::string& f : checkpoint_files(path, &dir, &index)) reads.push_back({flag, f, RunPath::READS});
    if (!index.empty()) reads.push_back({flag, index, RunPath::READS});
    if (path_present(dir + "/config.json")) reads.push_back({flag, dir + "/config.json", RunPath::READS});
    return reads;
}

static void open_hf_checkpoint(const Model& m, const std::string& path, HfCheckpoint& ck) {
    std::string dir, index;
    const std::vector<std::string> files = checkpoint_files(path, &dir, &index);
    // Present means checked: a config.json that is a dangling link or a FIFO is refused, not skipped.
    if (path_present(dir + "/config.json"))
        check_hf_config(m.cfg, read_input_text(dir + "/config.json", "--init-from"), dir + "/config.json");

    std::vector<std::unique_ptr<Mapped>>& maps = ck.maps;
    std::map<std::string, StTensor>& tensors = ck.tensors;
    for (auto& f : files) {
        maps.emplace_back(new Mapped(f, "--init-from"));
        read_safetensors(*maps.back(), tensors);
    }
    // Every tensor present with the right shape; nothing unexpected left over.
    std::map<std::string, bool> used;
    for (auto& kv : tensors) used[kv.first] = false;
    for (const ParamTensor& t : m.layout.tensors)
        for (const HfPiece& p : hf_pieces(m.cfg, t)) {
            auto it = tensors.find(p.name);
            if (it == tensors.end()) usage_error("--init-from '" + path + "': tensor '" + p.name + "' is missing");
            std::vector<int64_t> want = hf_shape(t, p);
            if (it->second.shape != want)
                usage_error("--init-from '" + path + "': tensor '" + p.name + "' has shape " + shape_str(it->second.shape) +
                            ", --config " + m.cfg.name + " needs " + shape_str(want));
            used[p.name] = true;
        }
    for (auto& kv : used)
        if (!kv.second && !(kv.first == "lm_head.weight" && m.cfg.tied_embeddings) &&
            kv.first.find("rotary_emb") == std::string::npos)
            usage_error("--init-from '" + path + "': tensor '" + kv.first + "' has no place in --config " + m.cfg.name +
                        " (a deeper or different model?)");
}

void check_hf_checkpoint(const Model& m, const std::string& path) {
    HfCheckpoint ck;
    open_hf_checkpoint(m, path, ck);
}

std::vector<float> read_hf_weights(const Model& m, const std::string& path) {
    HfCheckpoint ck;
    open_hf_checkpoint(m, path, ck);
    std::map<std::string, StTensor>& tensors = ck.tensors;
    std::vector<float> local(m.states.count, 0.f);
    for (const ParamSegment& seg : m.states.segments) {
        const ParamTensor& t = *seg.tensor;
        const int64_t e0 = seg.tensor_offset, e1 = e0 + seg.count;
        for (const HfPiece& p : hf_pieces(m.cfg, t)) {
            const StTensor& st = tensors[p.name];
            int64_t p0 = p.row0 * t.cols, p1 = p0 + p.rows * t.cols;  // our elements this piece holds
            for (int64_t e = std::max(e0, p0); e < std::min(e1, p1); e++) local[seg.local + (e - e0)] = to_float(st, e - p0);
        }
    }
    return local;
}

void load_hf_checkpoint(Model& m, const std::string& path, cudaStream_t s) {
    std::vector<float> local = read_hf_weights(m, path);
    CUDA_CHECK(cudaMemcpyAsync(m.states.master, local.data(), m.states.count * sizeof(float), cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemsetAsync(m.states.adam_m, 0, m.states.count * sizeof(float), s));
    CUDA_CHECK(cudaMemsetAsync(m.states.adam_v, 0, m.states.count * sizeof(float), s));
    CUDA_CHECK(cudaStreamSynchronize(s));
}

// =============================================================================================
// Writing a Hugging Face checkpoint.

// An index in the folder a save writes, and the shards it names: an older checkpoint's files,
// which the save removes once its own are in place (a reader that took the index would read
// the old weights). An index that cannot be read names no shards; it goes alone.
static std::vector<std::string> stale_checkpoint_files(const std::string& dir) {
    const std::string index = dir + "/" + INDEX_NAME;
    if (!path_present(index)) return {};
    std::vector<std::string> files = {index};
    try {
        for (const std::string& shard : index_shards(read_input_text(index, "--save-to"), index))
            if (shard != "model.safetensors" && shard != "config.json") files.push_back(dir + "/" + shard);
    } catch (const Fatal&) {  // the index goes alone
    }
    return files;
}

std::vector<RunPath> hf_checkpoint_writes(const std::string& flag, const std::string& dir) {
    std::vector<RunPath> paths = {{flag, dir, RunPath::WRITES_FOLDER}};
    if (!is_directory(dir)) return paths;  // a new folder holds nothing yet
    for (const char* name : {"model.safetensors", "config.json"})
        for (const char* tail : {"", ".tmp"}) paths.push_back({flag, dir + "/" + name + tail, RunPath::WRITES_FILE});
    for (const std::string& f : stale_checkpoint_files(dir)) paths.push_back({flag, f, RunPath::WRITES_FILE});
    return paths;
}

// unit_data(u) returns unit u's parameters (layout order); every rank calls it (under --fsdp it
// is a gather), only `lead` writes.
void write_hf_checkpoint(const std::string& dir, const LlamaConfig& c, const ParamLayout& lay, bool bf16, bool lead,
                         const std::function<std::vector<float>(int)>& unit_data) {
    if (lead) make_dirs(dir);
    // The header first: names, shapes and offsets follow from the layout.
    struct Out {
        std::string name;
        const ParamTensor* t;
        HfPiece piece;
        int64_t begin, bytes;
    };
    std::vector<Out> outs;
    int64_t off = 0;
    const int eb = bf16 ? 2 : 4;
    for (const ParamTensor& t : lay.tensors)
        for (const HfPiece& p : hf_pieces(c, t)) {
            int64_t bytes = p.rows * t.cols * eb;
            outs.push_back({p.name, &t, p, off, bytes});
            off += bytes;
        }
    std::string header = "{\"__metadata__\": {\"format\": \"pt\"}";
    for (auto& o : outs)
        header += ", \"" + o.name + "\": {\"dtype\": \"" + (bf16 ? "BF16" : "F32") + "\", \"shape\": " +
                  shape_str(hf_shape(*o.t, o.piece)) + ", \"data_offsets\": [" + std::to_string(o.begin) + ", " +
                  std::to_string(o.begin + o.bytes) + "]}";
    header += "}";
    while (header.size() % 8) header += ' ';  // tensor data 8-byte aligned
    std::unique_ptr<AtomicFile> f;
    if (lead) {
        f.reset(new AtomicFile(dir + "/model.safetensors"));
        uint64_t hlen = header.size();
        f->write(&hlen, 8);
        f->write(header.data(), header.size());
    }
    // Then the data, unit by unit in layout order: the units a tensor lies in (the embedding and
    // LM head span several), each fetched once, the last kept for the tensors after it.
    std::vector<float> units;  // units [first, next) of the layout, concatenated
    int first = 0, next = 0;
    std::vector<uint8_t> bytes;
    for (auto& o : outs) {
        const ParamTensor& t = *o.t;
        if (t.unit >= next) units.clear(), first = next = t.unit;
        while (next < lay.num_units() && lay.unit_begin[next] < t.offset + t.numel()) {
            std::vector<float> u = unit_data(next++);
            units.insert(units.end(), u.begin(), u.end());
        }
        if (!lead) continue;
        const float* src = units.data() + (t.offset - lay.unit_begin[first]) + o.piece.row0 * t.cols;
        const int64_t n = o.piece.rows * t.cols;
        bytes.resize(n * eb);
        for (int64_t i = 0; i < n; i++) {
            if (bf16) {
                uint16_t b = to_bf16_bits(src[i]);
                memcpy(&bytes[2 * i], &b, 2);
            } else {
                memcpy(&bytes[4 * i], &src[i], 4);
            }
        }
        f->write(bytes.data(), bytes.size());
    }
    if (lead) {
        f->commit();
        AtomicFile cfg(dir + "/config.json");
        std::string js = hf_config_json(c, bf16);
        cfg.write(js.data(), js.size());
        cfg.commit();
        for (const std::string& f : stale_checkpoint_files(dir)) unlink(f.c_str());
        fsync_dir(dir);
    }
}

void save_hf_checkpoint(Model& m, const std::string& dir, bool bf16, cudaStream_t s) {
    write_hf_checkpoint(dir, m.cfg, m.layout, bf16, m.comm->rank == 0,
                        [&](int u) { return fsdp_gather_unit(m, m.states.master, u, s); });
}

// =============================================================================================
// Token files
TokenFile::TokenFile(const std::string& path, int vocab, const std::string& flag) {
    std::unique_ptr<Mapped> f(new Mapped(path, flag));
    const TokenFileContents c = check_token_file(f->data, f->size, vocab, flag + " '" + path + "'");
    count = c.count, version = c.version;
    tokens = (const uint32_t*)(f->data + c.tokens_at);
    doc_starts.resize(c.version == 1 ? (count > 0) : c.docs);
    if (c.version == 2) memcpy(doc_starts.data(), f->data + c.docs_at, c.docs * 8);
    map = f.release();
}
TokenFile::~TokenFile() { delete map; }

void write_token_file(const std::string& path, const std::vector<uint32_t>& tokens,
                      const std::vector<uint64_t>& doc_starts) {
    AtomicFile f(path);
    const uint32_t version = doc_starts.empty() ? 1 : 2, width = 4;
    const uint64_t n = tokens.size(), m = doc_starts.size();
    f.write("LLTOKENS", 8);
    f.write(&version, 4);
    f.write(&width, 4);
    f.write(&n, 8);
    if (version == 2) f.write(&m, 8);
    f.write(tokens.data(), tokens.size() * 4);
    if (version == 2) f.write(doc_starts.data(), m * 8);
    f.commit();
}

// =============================================================================================
// Training state
namespace {
// Version 2: the units of the layout (and so the FSDP shards) include the vocabulary pieces.
struct StateHeader {
    char magic[8] = {'L', 'L', 'S', 'T', 'A', 'T', 'E', '2'};
    int64_t step, data_state, world, rank, fsdp, local_params, layout_total, dim, layers, vocab, vocab_pieces;
};

// "step-N": the folders save_train_state makes (at most 18 digits: N fits in an int64).
bool is_step_name(const std::string& name) {
    if (name.size() < 6 || name.size() > 23 || name.rfind("step-", 0) != 0) return false;
    return std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; });
}
bool is_rank_file(const std::string& name) {
    const size_t n = name.size();
    return n > 11 && name.rfind("rank-", 0) == 0 && name.compare(n - 6, 6, ".state") == 0 &&
           std::all_of(name.begin() + 5, name.end() - 6, [](char c) { return c >= '0' && c <= '9'; });
}

// The names in folder dir that pass `keep`, sorted.
std::vector<std::string> names_in(const std::string& dir, bool (*keep)(const std::string&)) {
    std::vector<std::string> names;
    if (DIR* d = opendir(dir.c_str())) {
        while (dirent* e = readdir(d))
            if (keep(e->d_name)) names.push_back(e->d_name);
        closedir(d);
    }
    std::sort(names.begin(), names.end());
    return names;
}

// n bytes of fd at offset `at`, or a runtime error naming the file.
void pread_all(int fd, void* to, size_t n, off_t at, const std::string& path) {
    for (size_t done = 0; done < n;) {
        const ssize_t got = pread(fd, (char*)to + done, n - done, at + (off_t)done);
        if (got <= 0)
            runtime_error("--resume: reading '" + path + "' failed: " + (got < 0 ? strerror(errno) : "the file is shorter than it was"));
        done += (size_t)got;
    }
}
}  // namespace

void save_train_state(Model& m, const std::string& dir, int64_t step, uint64_t data_state, cudaStream_t s,
                      double timeout_s) {
    const int rank = m.comm->rank;
    const std::string step_dir = dir + "/step-" + std::to_string(step);
    if (rank == 0) make_dirs(step_dir);
    m.comm->all_reduce(m.scalars + 3, 1, DType::F32, s);  // barrier: the directory exists
    comm_sync(m.comm, s, timeout_s);
    if (rank != 0) make_dirs(step_dir);
    StateHeader h;
    h.step = step, h.data_state = (int64_t)data_state, h.world = m.world, h.rank = rank, h.fsdp = m.opt.fsdp;
    h.local_params = m.states.count, h.layout_total = m.layout.total;
    h.dim = m.cfg.dim, h.layers = m.cfg.n_layers, h.vocab = m.cfg.vocab, h.vocab_pieces = m.layout.vocab_pieces();
    std::vector<float> buf(m.states.count);
    AtomicFile f(step_dir + "/rank-" + std::to_string(rank) + ".state");
    f.write(&h, sizeof h);
    for (float* arr : {m.states.master, m.states.adam_m, m.states.adam_v}) {
        CUDA_CHECK(cudaMemcpy(buf.data(), arr, m.states.count * sizeof(float), cudaMemcpyDeviceToHost));
        f.write(buf.data(), buf.size() * sizeof(float));
    }
    f.commit();
    m.comm->all_reduce(m.scalars + 3, 1, DType::F32, s);  // barrier: every rank's file is in place
    comm_sync(m.comm, s, timeout_s);
    if (rank != 0) return;
    std::string prev;
    if (exists(dir + "/latest")) prev = read_input_text(dir + "/latest", "--state-dir");
    if (!prev.empty() && prev.back() == '\n') prev.pop_back();  // as `echo step-4 > latest` writes it
    AtomicFile latest(dir + "/latest");
    const std::string name = "step-" + std::to_string(step);
    latest.write(name.data(), name.size());
    latest.commit();
    // Keep this state and the one before; the older step folders' files go (check_outputs saw
    // to it that no other flag's file is among them).
    for (const std::string& n : names_in(dir, is_step_name)) {
        if (n == name || n == prev) continue;
        const std::string sub = dir + "/" + n;
        if (DIR* d2 = opendir(sub.c_str())) {
            while (dirent* e2 = readdir(d2))
                if (e2->d_name[0] != '.') unlink((sub + "/" + e2->d_name).c_str());
            closedir(d2);
        }
        rmdir(sub.c_str());
    }
}

std::vector<RunPath> train_state_writes(const std::string& flag, const std::string& dir) {
    std::vector<RunPath> paths = {{flag, dir, RunPath::WRITES_FOLDER}};
    if (!is_directory(dir)) return paths;  // a new folder holds nothing yet
    paths.push_back({flag, dir + "/latest", RunPath::WRITES_FILE});
    paths.push_back({flag, dir + "/latest.tmp", RunPath::WRITES_FILE});
    for (const std::string& step : names_in(dir, is_step_name)) {
        paths.push_back({flag, dir + "/" + step, RunPath::CLEARS_FOLDER});
        for (const std::string& rank : names_in(dir + "/" + step, is_rank_file))
            paths.push_back({flag, dir + "/" + step + "/" + rank, RunPath::WRITES_FILE});
    }
    return paths;
}

// The header of a training state file and the file's size, read with fstat and pread: a state
// may be tens of GB, more than the address space a process is given, and nothing more than its
// header is needed to check it.
static StateHeader read_state_header(const std::string& path, int64_t* size) {
    const int fd = open_input_file(path, "--resume");
    struct stat st {};
    StateHeader h;
    if (fstat(fd, &st) != 0 || st.st_size < (off_t)sizeof h) {
        close(fd);
        usage_error("--resume: '" + path + "' is truncated or corrupt: " + std::to_string(st.st_size) +
                    " bytes, less than a state's header (" + std::to_string(sizeof h) + ")");
    }
    pread_all(fd, &h, sizeof h, 0, path);
    close(fd);
    *size = st.st_size;
    return h;
}

// Whether a state's header and size hold together, and fit this run; each fault its own message.
// data_state needs no check: any 64-bit value is a state of the sampler.
static void check_state_header(const StateHeader& h, int64_t size, const Model& m, int rank, const std::string& path,
                               int64_t folder_step, int64_t last_step) {
    const std::string file = "--resume: '" + path + "'";
    if (memcmp(h.magic, "LLSTATE1", 8) == 0)
        usage_error(file + " was written by an earlier version, whose shards follow other units; "
                    "its weights can still come in through a --save-to checkpoint and --init-from");
    if (memcmp(h.magic, "LLSTATE2", 8) != 0) usage_error(file + " is not a training state file");
    // The header, then three arrays of local_params floats: master weights and the two moments.
    const int64_t arrays = size - (int64_t)sizeof h;
    if (h.local_params < 0 || arrays % 12 != 0 || h.local_params != arrays / 12) {
        const bool sized = h.local_params >= 0 && h.local_params <= INT64_MAX / 16;
        usage_error(file + " is truncated or corrupt: " + std::to_string(size) + " bytes, where its header's " +
                    std::to_string(h.local_params) + " parameters per GPU make " +
                    (sized ? std::to_string(sizeof h + 12 * h.local_params) + " bytes" : std::string("no possible size")));
    }
    auto mismatch = [&](const char* what, int64_t in_file, int64_t now) {
        if (in_file != now)
            usage_error(file + " was written with " + what + " " + std::to_string(in_file) + ", this run has " +
                        std::to_string(now));
    };
    mismatch("GPUs", h.world, m.world);
    mismatch("rank", h.rank, rank);
    mismatch("--fsdp", h.fsdp, m.opt.fsdp);
    mismatch("hidden size", h.dim, m.cfg.dim);
    mismatch("layers", h.layers, m.cfg.n_layers);
    mismatch("vocabulary", h.vocab, m.cfg.vocab);
    mismatch("vocabulary pieces", h.vocab_pieces, m.layout.vocab_pieces());  // they cut the FSDP shards
    mismatch("parameters in all", h.layout_total, m.layout.total);
    mismatch("parameters per GPU", h.local_params, m.states.count);
    if (h.step < 0 || h.step > last_step)
        usage_error(file + " holds step " + std::to_string(h.step) + ", outside [0, --steps " + std::to_string(last_step) + "]");
    if (h.step != folder_step)
        usage_error(file + " holds step " + std::to_string(h.step) + ", but its folder is step-" + std::to_string(folder_step));
}

std::string train_state_file(const Model& m, const std::string& dir, int rank, bool resume, int64_t last_step) {
    const std::string pointer = dir + "/latest";
    if (!path_present(pointer)) return "";  // lstat: a dangling link is present, and refused below
    std::string name = read_input_text(pointer, "--state-dir", 64);  // a link to nowhere or to itself, a folder: refused
    if (!name.empty() && name.back() == '\n') name.pop_back();  // as `echo step-4 > latest` writes it
    if (!is_step_name(name))
        usage_error("--state-dir: '" + pointer + "' should name a step folder (step-N); it holds " +
                    std::to_string(name.size()) + " other bytes");
    if (!is_directory(dir + "/" + name))
        usage_error("--state-dir: '" + pointer + "' names " + name + ", which is not a folder of '" + dir + "'");
    if (!resume) return "";
    const std::string path = dir + "/" + name + "/rank-" + std::to_string(rank) + ".state";
    int64_t size = 0;
    const StateHeader h = read_state_header(path, &size);
    check_state_header(h, size, m, rank, path, std::stoll(name.substr(5)), last_step);
    return path;
}

bool load_train_state(Model& m, const std::string& dir, int64_t last_step, int64_t* step, uint64_t* data_state,
                      cudaStream_t s) {
    const std::string path = train_state_file(m, dir, m.comm->rank, true, last_step);
    if (path.empty()) return false;
    int64_t size = 0;
    const StateHeader h = read_state_header(path, &size);
    // Read, not mapped, through one host buffer of at most 64 MiB: a state may be larger than the
    // address space a process is given. On s, after the weights' initialization there.
    const int fd = open_input_file(path, "--resume");
    std::vector<float> buf((size_t)std::min<int64_t>(m.states.count, 16 << 20));
    off_t at = sizeof h;
    for (float* arr : {m.states.master, m.states.adam_m, m.states.adam_v})
        for (int64_t done = 0, n; done < m.states.count; done += n, at += n * sizeof(float)) {
            n = std::min<int64_t>((int64_t)buf.size(), m.states.count - done);
            pread_all(fd, buf.data(), n * sizeof(float), at, path);
            CUDA_CHECK(cudaMemcpyAsync(arr + done, buf.data(), n * sizeof(float), cudaMemcpyHostToDevice, s));
            CUDA_CHECK(cudaStreamSynchronize(s));  // the buffer is reused
        }
    close(fd);
    *step = h.step;
    *data_state = (uint64_t)h.data_state;
    return true;
}
