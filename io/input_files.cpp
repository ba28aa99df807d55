// io/input_files.cpp - the readers of input_files.h: opening files, token files, safetensors
// headers, the sharded index and config.json.
#include "input_files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <set>

// =============================================================================================
// Opening files
std::string not_a_file(const struct stat& st) {
    if (S_ISREG(st.st_mode)) return "";
    if (S_ISDIR(st.st_mode)) return "a directory, not a file";
    if (S_ISFIFO(st.st_mode)) return "a FIFO (named pipe), not a regular file";
    if (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)) return "a device, not a regular file";
    if (S_ISSOCK(st.st_mode)) return "a socket, not a regular file";
    return "not a regular file";
}

// Why stat(path) failed with err, in words.
std::string stat_failure(const std::string& path, int err) {
    struct stat st;
    if (err == ENOENT && lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode))
        return "a symbolic link to a file that does not exist (dangling)";
    if (err == ENOENT) return "no such file or directory";
    if (err == ELOOP) return "a loop of symbolic links";
    return strerror(err);
}

bool path_present(const std::string& path) {
    struct stat st;
    return lstat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
    struct stat st;
    return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

int open_input_file(const std::string& path, const std::string& flag) {
    auto refuse = [&](const std::string& why) { usage_error(flag + " '" + path + "': " + why); };
    if (path.empty()) refuse("an empty path");
    struct stat st;
    if (stat(path.c_str(), &st) != 0) refuse(stat_failure(path, errno));
    if (std::string why = not_a_file(st); !why.empty()) refuse(why);
    // Non-blocking, in case a FIFO took the file's place since: then fstat refuses it.
    const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) refuse(strerror(errno));
    if (fstat(fd, &st) != 0 || !not_a_file(st).empty()) {
        close(fd);
        refuse("replaced while being opened, by something that is not a regular file");
    }
    return fd;
}

std::string read_input_text(const std::string& path, const std::string& flag, size_t cap) {
    const int fd = open_input_file(path, flag);
    std::string text;
    char buf[65536];
    ssize_t n;
    while ((n = read(fd, buf, sizeof buf)) > 0 && text.size() <= cap) text.append(buf, (size_t)n);
    const int err = errno;
    close(fd);
    if (n < 0) usage_error(flag + " '" + path + "': cannot read: " + strerror(err));
    if (text.size() > cap)
        usage_error(flag + " '" + path + "': more than " + std::to_string(cap) + " bytes, the limit for this file");
    return text;
}

Mapped::Mapped(const std::string& p, const std::string& flag) : path(p) {
    const int fd = open_input_file(p, flag);
    struct stat st;
    fstat(fd, &st);
    size = (size_t)st.st_size;
    if (size > 0) {
        void* m = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            const int err = errno;
            close(fd);
            usage_error(flag + " '" + p + "': cannot map: " + strerror(err));
        }
        data = (const uint8_t*)m;
    }
    close(fd);
}

Mapped::~Mapped() {
    if (data) munmap((void*)data, size);
}

// =============================================================================================
// Token files
static uint64_t read_u64(const uint8_t* p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

TokenFileContents check_token_file(const uint8_t* data, size_t size, int vocab, const std::string& label) {
    if (size < 24 || memcmp(data, "LLTOKENS", 8) != 0)
        usage_error(label + ": not a token file (no LLTOKENS header; see README for the format)");
    TokenFileContents c;
    uint32_t width;
    memcpy(&c.version, data + 8, 4);
    memcpy(&width, data + 12, 4);
    c.count = read_u64(data + 16);
    if ((c.version != 1 && c.version != 2) || width != 4)
        usage_error(label + ": version " + std::to_string(c.version) + ", " + std::to_string(width) +
                    "-byte tokens (version 1 or 2, 4 bytes expected)");
    const size_t header = c.version == 1 ? 24 : 32;
    if (size < header) usage_error(label + ": truncated version-2 header (" + std::to_string(size) + " bytes)");
    if (c.version == 2) c.docs = read_u64(data + 24);
    // The size the header says, without overflow: header + 4 N + 8 M.
    const size_t room = size - header;
    const bool fits = c.count <= room / 4 && c.docs <= (room - 4 * c.count) / 8;
    if (!fits || header + 4 * c.count + 8 * c.docs != size)
        usage_error(label + ": the header says " + std::to_string(c.count) + " tokens" +
                    (c.version == 2 ? " and " + std::to_string(c.docs) + " documents" : "") + ", " +
                    (fits ? "but " + std::to_string(size - header - 4 * c.count - 8 * c.docs) +
                                " more bytes follow them"
                          : "more than the file's " + std::to_string(size) + " bytes hold (truncated?)"));
    c.tokens_at = header, c.docs_at = header + 4 * c.count;
    // A plain loop that stops at the first bad token: the mapping's page faults, not these
    // comparisons, set its speed.
    const uint32_t* tokens = (const uint32_t*)(data + c.tokens_at);
    for (uint64_t i = 0; i < c.count; i++)
        if (tokens[i] >= (uint32_t)vocab)
            usage_error(label + ": token " + std::to_string(tokens[i]) + " at position " + std::to_string(i) +
                        " is outside the vocabulary (" + std::to_string(vocab) + ")");
    if (c.version == 2 && (c.docs == 0) != (c.count == 0))
        usage_error(label + ": " + std::to_string(c.count) + " tokens in " + std::to_string(c.docs) +
                    " documents (every token belongs to one)");
    for (uint64_t d = 0; d < c.docs; d++) {
        const uint64_t start = read_u64(data + c.docs_at + 8 * d), before = d ? read_u64(data + c.docs_at + 8 * (d - 1)) : 0;
        const std::string at = "document " + std::to_string(d) + " starts at token " + std::to_string(start);
        if (d == 0 && start != 0) usage_error(label + ": " + at + " (the first document starts at 0)");
        if (d > 0 && start <= before)
            usage_error(label + ": " + at + ", not after document " + std::to_string(d - 1) + "'s start " +
                        std::to_string(before) + " (starts ascend)");
        if (start >= c.count) usage_error(label + ": " + at + ", past the last token (" + std::to_string(c.count) + ")");
    }
    return c;
}

// =============================================================================================
// safetensors
namespace {

// The most dimensions a shape may have: numpy's limit, far past any model's. Without one, a
// header of millions of zeros in a shape would cost memory again after it is read.
constexpr size_t kMaxDims = 64;

std::string tensor_name(std::string_view name) { return "tensor '" + json_printable(name) + "'"; }

// A JSON array of at most `most` non-negative integers (a shape, data_offsets); `field` names
// it in the message when it is not one.
std::vector<int64_t> unsigned_list(const JsonValue& v, size_t most, const std::string& field) {
    const std::string want = ", a list of non-negative integers expected";
    if (!v.is(JsonKind::Array)) usage_error(field + " is " + json_shown(v) + want);
    if (v.size() > most)
        usage_error(field + " has " + std::to_string(v.size()) + " numbers, at most " + std::to_string(most) + " expected");
    std::vector<int64_t> out;
    for (const JsonValue& e : v.elements()) {
        if (!e.is_integer() || e.integer() < 0) usage_error(field + " holds " + json_shown(e) + want);
        out.push_back(e.integer());
    }
    return out;
}

// Elements times bytes per element, or -1 past 2^63 (checked before each product overflows).
int64_t tensor_bytes(const std::vector<int64_t>& shape, int element_bytes) {
    if (std::count(shape.begin(), shape.end(), 0)) return 0;
    int64_t n = element_bytes;
    for (int64_t d : shape) {
        if (n > INT64_MAX / d) return -1;
        n *= d;
    }
    return n;
}

StEntry read_entry(const JsonMember& m, uint64_t data_size, const std::string& p) {
    StEntry e;
    e.name = std::string(m.key);
    const std::string t = p + ": " + tensor_name(m.key);
    if (!m.value.is(JsonKind::Object))
        usage_error(t + " is described by " + json_shown(m.value) + ", an object expected");
    const auto dtype = m.value.get("dtype"), shape = m.value.get("shape"), offsets = m.value.get("data_offsets");
    if (!dtype || !shape || !offsets)
        usage_error(t + " has an incomplete header (dtype, shape and data_offsets expected)");
    if (!dtype->is(JsonKind::String)) usage_error(t + ": dtype is " + json_shown(*dtype) + ", a string expected");
    e.dtype = std::string(dtype->string());
    const int eb = dtype_bytes(e.dtype);
    if (eb == 0) usage_error(t + " has dtype " + json_printable(e.dtype) + " (BF16, F16 or F32 expected)");
    e.shape = unsigned_list(*shape, kMaxDims, t + ": shape");
    if (offsets->is(JsonKind::Array) && offsets->size() != 2)
        usage_error(t + ": data_offsets has " + std::to_string(offsets->size()) + " numbers, [begin, end] expected");
    const std::vector<int64_t> range = unsigned_list(*offsets, 2, t + ": data_offsets");
    if (range[1] < range[0]) usage_error(t + ": data_offsets [begin, end] ends before it begins");
    e.begin = (uint64_t)range[0], e.end = (uint64_t)range[1];
    if (e.end > data_size) usage_error(t + " lies outside the file (truncated or corrupt)");
    const int64_t want = tensor_bytes(e.shape, eb);
    if (want != (int64_t)(e.end - e.begin))
        usage_error(t + " has " + std::to_string(e.end - e.begin) + " bytes for its shape (" +
                    (want < 0 ? "over 2^63" : std::to_string(want)) + " expected)");
    return e;
}

void check_metadata(const JsonValue& v, const std::string& p) {
    const std::string rule = p + ": __metadata__ must map names to strings (the safetensors format)";
    if (!v.is(JsonKind::Object)) usage_error(rule + "; it is " + json_shown(v));
    for (const JsonMember& m : v.members())
        if (!m.value.is(JsonKind::String)) usage_error(rule + "; " + json_quoted(m.key) + " is " + json_shown(m.value));
}

// The format requires the tensors to fill the data buffer exactly, in some order: no byte
// shared, none left over. A header length one off, or offsets shifted, fails here.
void check_tiling(const std::vector<StEntry>& tensors, uint64_t data_size, const std::string& p) {
    std::vector<const StEntry*> order;
    for (const StEntry& e : tensors) order.push_back(&e);
    std::sort(order.begin(), order.end(), [](const StEntry* a, const StEntry* b) {
        return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
    });
    const std::string rule = p + ": the tensors must fill the data buffer exactly (the safetensors format): ";
    uint64_t covered = 0;
    const StEntry* prev = nullptr;
    for (const StEntry* e : order) {
        if (e->begin < covered)
            usage_error(rule + tensor_name(prev->name) + " and " + tensor_name(e->name) + " overlap at bytes " +
                        std::to_string(e->begin) + " to " + std::to_string(std::min(covered, e->end)));
        if (e->begin > covered)
            usage_error(rule + "bytes " + std::to_string(covered) + " to " + std::to_string(e->begin) + ", before " +
                        tensor_name(e->name) + ", belong to no tensor");
        covered = e->end, prev = e;
    }
    const uint64_t left = data_size - covered;
    if (left) usage_error(rule + "its last " + std::to_string(left) + (left == 1 ? " byte belongs" : " bytes belong") +
                          " to no tensor (is the header length wrong?)");
}

}  // namespace

int dtype_bytes(std::string_view d) {
    if (d == "F32") return 4;
    if (d == "BF16" || d == "F16") return 2;
    return 0;
}

StHeader parse_safetensors(const uint8_t* data, size_t size, const std::string& p) {
    if (size < 8) usage_error(p + ": truncated (no safetensors header)");
    uint64_t hlen = 0;
    memcpy(&hlen, data, 8);
    if (hlen > kJsonMaxBytes)
        usage_error(p + ": safetensors header length " + std::to_string(hlen) + " is over the format's limit of " +
                    std::to_string(kJsonMaxBytes) + " bytes (corrupt?)");
    if (hlen > size - 8)
        usage_error(p + ": safetensors header length " + std::to_string(hlen) + " runs past the end of the file (" +
                    std::to_string(size) + " bytes): truncated or corrupt");
    StHeader h;
    h.data_start = 8 + hlen;
    const uint64_t data_size = size - h.data_start;
    const JsonDoc doc(std::string_view((const char*)data + 8, hlen), p);
    const JsonValue root = doc.root();
    if (!root.is(JsonKind::Object))
        usage_error(p + ": the safetensors header is " + json_shown(root) + ", not an object");
    for (const JsonMember& m : root.members()) {
        if (m.key == "__metadata__") check_metadata(m.value, p);
        else h.tensors.push_back(read_entry(m, data_size, p));
    }
    check_tiling(h.tensors, data_size, p);
    return h;
}

// =============================================================================================
// model.safetensors.index.json
std::vector<std::string> index_shards(std::string_view text, const std::string& path) {
    const JsonDoc doc(text, path);
    const JsonValue root = doc.root();
    if (!root.is(JsonKind::Object))
        usage_error(path + ": " + json_shown(root) + ", an object with a weight_map expected");
    const auto map = root.get("weight_map");
    if (!map) usage_error(path + " has no weight_map");
    if (!map->is(JsonKind::Object)) usage_error(path + ": weight_map is " + json_shown(*map) + ", an object expected");
    if (map->size() == 0) usage_error(path + ": weight_map names no tensors");
    std::vector<std::string> files;
    std::set<std::string_view> seen;  // O(log n) a name: an index may name many
    for (const JsonMember& m : map->members()) {
        const std::string entry = path + ": weight_map[" + json_quoted(m.key) + "] is " + json_shown(m.value);
        if (!m.value.is(JsonKind::String)) usage_error(entry + ", a shard's file name expected");
        const std::string_view f = m.value.string();
        // A plain name: the shards lie beside the index, and nothing outside that folder is read.
        if (f.empty() || f == "." || f == ".." || f.find('/') != f.npos || f.find('\0') != f.npos)
            usage_error(entry + ", not the name of a file beside the index");
        if (seen.insert(f).second) files.emplace_back(f);
    }
    return files;
}

// =============================================================================================
// config.json
namespace {

std::string num_str(double v) {
    char b[32];
    snprintf(b, sizeof b, "%.10g", v);
    return b;
}

bool close_to(double got, double want) { return std::fabs(got - want) <= 1e-9 * std::max(1.0, std::fabs(want)); }

bool same_value(const JsonValue& a, const JsonValue& b) {
    if (a.is(JsonKind::Number) && b.is(JsonKind::Number)) return close_to(a.number(), b.number());
    return json_shown(a) == json_shown(b);
}

// One line of check_hf_config's message: a field, the checkpoint's value and ours.
std::string config_line(const std::string& field, const std::string& got, const LlamaConfig& c,
                        const std::string& want) {
    return "  " + field + ": checkpoint " + got + ", --config " + c.name + " " + want + "\n";
}

std::string missing(const std::string& default_value) {
    return "missing (transformers' default " + default_value + ")";
}

// An integer field, checked against ours: its value; transformers' default `dflt` when it is
// missing (or null, where transformers reads null as "not given"); nullopt when it is not an
// integer, or its default follows from a field that is not one.
std::optional<int64_t> check_int(const JsonValue& j, const char* key, std::optional<int64_t> dflt, bool null_is_missing,
                                 int64_t want, const LlamaConfig& c, std::string& bad) {
    const std::optional<JsonValue> v = j.get(key);
    if (!v || (null_is_missing && v->is(JsonKind::Null))) {
        if (dflt && *dflt != want)
            bad += config_line(key, (v ? "null, so " : "") + missing(std::to_string(*dflt)), c, std::to_string(want));
        return dflt;
    }
    if (!v->is_integer()) {
        bad += config_line(key, json_shown(*v) + " (not an integer)", c, std::to_string(want));
        return std::nullopt;
    }
    if (v->integer() != want) bad += config_line(key, json_shown(*v), c, std::to_string(want));
    return v->integer();
}

// The model's shape. transformers' LlamaConfig defaults: vocabulary 32000, hidden size 4096,
// intermediate size 11008, 32 layers, 32 heads; key/value heads as many as heads; head_dim
// hidden size // heads. Its Qwen3Config: vocabulary 151936, intermediate size 22016, head_dim 128.
void check_hf_shape(const JsonValue& j, const LlamaConfig& c, std::string& bad) {
    const bool qwen3 = c.family == Family::QWEN3;
    check_int(j, "vocab_size", qwen3 ? 151936 : 32000, false, c.vocab, c, bad);
    const auto dim = check_int(j, "hidden_size", 4096, false, c.dim, c, bad);
    check_int(j, "intermediate_size", qwen3 ? 22016 : 11008, false, c.ffn_dim, c, bad);
    check_int(j, "num_hidden_layers", 32, false, c.n_layers, c, bad);
    const auto heads = check_int(j, "num_attention_heads", 32, false, c.n_heads, c, bad);
    check_int(j, "num_key_value_heads", heads, true, c.n_kv_heads, c, bad);
    std::optional<int64_t> head_dim;
    if (qwen3) head_dim = 128;
    else if (dim && heads && *dim >= 0 && *heads > 0) head_dim = *dim / *heads;
    check_int(j, "head_dim", head_dim, true, c.head_dim, c, bad);
}

void check_float(const JsonValue& j, const char* key, double dflt, double want, const LlamaConfig& c,
                 std::string& bad) {
    const std::optional<JsonValue> v = j.get(key);
    if (!v) {
        if (!close_to(dflt, want)) bad += config_line(key, missing(num_str(dflt)), c, num_str(want));
    } else if (!v->is(JsonKind::Number)) {
        bad += config_line(key, json_shown(*v) + " (not a number)", c, num_str(want));
    } else if (!close_to(v->number(), want)) {
        bad += config_line(key, json_shown(*v), c, num_str(want));
    }
}

// A flag whose default in transformers is false.
void check_bool(const JsonValue& j, const char* key, bool want, const LlamaConfig& c, std::string& bad) {
    const std::optional<JsonValue> v = j.get(key);
    const std::string ours = want ? "true" : "false";
    if (!v) {
        if (want) bad += config_line(key, missing("false"), c, ours);
    } else if (!v->is(JsonKind::Bool)) {
        bad += config_line(key, json_shown(*v) + " (not true or false)", c, ours);
    } else if (v->boolean() != want) {
        bad += config_line(key, json_shown(*v), c, ours);
    }
}

// The model family: model_type "llama" and, where given, architectures ["LlamaForCausalLM"]; or
// for Qwen3 "qwen3" and ["Qwen3ForCausalLM"]. Another family's file with the same fields
// (Mistral's, say) would otherwise load as if it were ours: both must be present and name the
// config's family, or each is named.
void check_family(const JsonValue& j, const LlamaConfig& c, std::string& bad) {
    const std::string type_want = family_model_type(c.family), arch_want = family_architecture(c.family);
    const std::optional<JsonValue> type = j.get("model_type");
    if (!type) bad += config_line("model_type", "missing", c, "\"" + type_want + "\"");
    else if (!type->is(JsonKind::String) || type->string() != type_want)
        bad += config_line("model_type", json_shown(*type), c, "\"" + type_want + "\"");
    const std::optional<JsonValue> arch = j.get("architectures");
    if (!arch || arch->is(JsonKind::Null)) return;
    bool ours = arch->is(JsonKind::Array) && arch->size() > 0;
    for (const JsonValue& a : arch->elements()) ours = ours && a.is(JsonKind::String) && a.string() == arch_want;
    if (ours) return;
    std::string shown = json_shown(*arch);  // an array: its elements, as written
    if (arch->is(JsonKind::Array)) {
        shown = "[";
        for (const JsonValue& a : arch->elements()) shown += (shown.size() > 1 ? ", " : "") + json_shown(a);
        shown += "]";
    }
    bad += config_line("architectures", shown, c, "[\"" + arch_want + "\"]");
}

// The MLP's activation: SwiGLU's SiLU, which transformers calls "silu" (its default) or "swish".
void check_activation(const JsonValue& j, const LlamaConfig& c, std::string& bad) {
    const std::optional<JsonValue> v = j.get("hidden_act");
    if (!v) return;
    if (!v->is(JsonKind::String)) bad += config_line("hidden_act", json_shown(*v) + " (not a string)", c, "\"silu\"");
    else if (v->string() != "silu" && v->string() != "swish")
        bad += config_line("hidden_act", json_shown(*v), c, "\"silu\"");
}

// The RoPE settings of a config.json, wherever it keeps them: top-level rope_theta and a
// rope_scaling object (Meta's files, transformers v4), or a rope_parameters object with
// rope_theta inside (transformers v5). A file may state a setting in both places; then the two
// must agree. null counts as absent, as in transformers. Each setting keeps the name of where it
// was found, for messages.
const char* const kRopeKeys[] = {"rope_theta",      "rope_type",        "factor",
                                 "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"};
constexpr double kDefaultRopeTheta = 10000;  // transformers' LlamaConfig

struct RopeSetting {
    std::optional<JsonValue> value;
    std::string where;
    bool conflict = false;  // the two places disagree (already reported)
};

struct HfRope {
    std::map<std::string, RopeSetting> at;  // by key of kRopeKeys
    std::string home = "rope_scaling";      // the place a missing setting is named in
    bool unreadable = false;                // rope_scaling or rope_parameters is not an object

    const RopeSetting* find(const std::string& key) const {
        auto it = at.find(key);
        return it == at.end() || it->second.conflict ? nullptr : &it->second;
    }
    std::string name(const std::string& key) const {
        auto it = at.find(key);
        if (it != at.end()) return it->second.where;
        return key == "rope_theta" && home == "rope_scaling" ? key : home + "." + key;
    }
    void add(const std::string& key, const std::optional<JsonValue>& v, const std::string& where, std::string& bad) {
        if (!v || v->is(JsonKind::Null)) return;
        RopeSetting& s = at[key];
        if (!s.value) {
            s.value = v, s.where = where;
        } else if (!same_value(*s.value, *v)) {
            bad += "  " + key + ": " + s.where + " is " + json_shown(*s.value) + " but " + where + " is " +
                   json_shown(*v) + " (the two places disagree)\n";
            s.conflict = true;
        }
    }
};

HfRope read_hf_rope(const JsonValue& j, const LlamaConfig& c, std::string& bad) {
    HfRope r;
    r.add("rope_theta", j.get("rope_theta"), "rope_theta", bad);
    for (const std::string place : {"rope_scaling", "rope_parameters"}) {
        const std::optional<JsonValue> o = j.get(place);
        if (!o || o->is(JsonKind::Null)) continue;
        if (!o->is(JsonKind::Object)) {
            bad += config_line(place, json_shown(*o) + " (not an object)", c,
                               c.rope_scaling.enabled ? "llama3 scaling" : "no scaling");
            r.unreadable = true;
            continue;
        }
        r.home = place;
        for (const std::string key : kRopeKeys) {
            std::string k = key == "rope_type" && !o->get(key) ? "type" : key;  // transformers' older spelling
            r.add(key, o->get(k), place + "." + k, bad);
        }
    }
    return r;
}

// A RoPE number: rope_theta takes transformers' default when missing; the llama3 scaling's
// numbers have none (transformers requires them).
void check_rope_num(const HfRope& r, const std::string& key, double want, const LlamaConfig& c, std::string& bad) {
    const RopeSetting* s = r.find(key);
    if (!s) {
        if (r.at.count(key)) return;  // the two places disagree (reported)
        if (key != "rope_theta") bad += config_line(r.name(key), "missing", c, num_str(want));
        else if (!close_to(kDefaultRopeTheta, want))
            bad += config_line(r.name(key), missing(num_str(kDefaultRopeTheta)), c, num_str(want));
    } else if (!s->value->is(JsonKind::Number)) {
        bad += config_line(s->where, json_shown(*s->value) + " (not a number)", c, num_str(want));
    } else if (!close_to(s->value->number(), want)) {
        bad += config_line(s->where, num_str(s->value->number()), c, num_str(want));
    }
}

// Every RoPE setting of ours against the file's: theta, the rope type ("llama3", or none or
// "default" when c has no scaling) and, with llama3 scaling, its four numbers, all required.
void check_hf_rope(const JsonValue& j, const LlamaConfig& c, std::string& bad) {
    HfRope r = read_hf_rope(j, c, bad);
    if (r.unreadable) return;
    check_rope_num(r, "rope_theta", c.rope_theta, c, bad);
    const RopeSetting* t = r.find("rope_type");
    if (r.at.count("rope_type") && !t) return;  // the two places disagree on it
    const std::string want = c.rope_scaling.enabled ? "\"llama3\"" : "none or \"default\"";
    if (t && !t->value->is(JsonKind::String)) {
        bad += config_line(t->where, json_shown(*t->value) + " (not a string)", c, want);
        return;
    }
    const std::string_view type = t ? t->value->string() : "default";  // transformers' type when none is given
    if (type != (c.rope_scaling.enabled ? "llama3" : "default")) {
        bad += config_line(r.name("rope_type"), t ? json_shown(*t->value) : "none", c, want);
        return;
    }
    if (!c.rope_scaling.enabled) return;
    const RopeScaling& s = c.rope_scaling;
    check_rope_num(r, "factor", s.factor, c, bad);
    check_rope_num(r, "low_freq_factor", s.low_freq_factor, c, bad);
    check_rope_num(r, "high_freq_factor", s.high_freq_factor, c, bad);
    check_rope_num(r, "original_max_position_embeddings", s.original_max_pos, c, bad);
}

}  // namespace

void check_hf_config(const LlamaConfig& c, const std::string& text, const std::string& path) {
    const JsonDoc doc(text, path);
    const JsonValue j = doc.root();
    if (!j.is(JsonKind::Object)) usage_error(path + ": " + json_shown(j) + ", a JSON object expected");
    std::string bad;
    check_family(j, c, bad);
    check_hf_shape(j, c, bad);
    check_float(j, "rms_norm_eps", 1e-6, c.norm_eps, c, bad);
    check_bool(j, "tie_word_embeddings", c.tied_embeddings, c, bad);
    check_bool(j, "attention_bias", false, c, bad);  // we have no biases
    check_bool(j, "mlp_bias", false, c, bad);
    check_bool(j, "use_sliding_window", false, c, bad);  // Qwen3's option: attention over a window only
    check_activation(j, c, bad);
    check_hf_rope(j, c, bad);
    if (!bad.empty()) usage_error(path + " does not match --config " + c.name + " (with --layers):\n" + bad);
}
