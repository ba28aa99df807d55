// io/input_files.h - reading what a run is given: token files (--data), and the safetensors files,
// model.safetensors.index.json and config.json of a Hugging Face checkpoint (--init-from).
// Host code only (no CUDA): files.cu uses it, and the fuzz targets of tests/fuzz/ build it
// with clang and libFuzzer.
//
// The inputs may be anything, so every reader refuses with a usage error (exit code 2) naming
// the file and what is wrong, in time and memory linear in what it reads (json.h for JSON):
//   * a path must name a regular file: a directory, a FIFO, a device, a socket, a dangling or
//     looping symbolic link is refused before it is opened for reading (opening a FIFO blocks
//     until a writer comes; a device may never end);
//   * a safetensors file's tensors tile its data buffer exactly, as the format requires;
//   * config.json's fields have the types transformers gives them, and a missing one takes
//     transformers' default for Llama.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "infra/common.h"
#include "json.h"

// ---------------------------------------------------------------------------------------------
// Opening files. `flag` names where the path came from in messages ("--data", "--init-from").

bool path_present(const std::string& path);  // anything by that name, even a dangling link
// What a stat result is when it is not a regular file ("a socket, not a regular file"); "" when it is one.
std::string not_a_file(const struct stat& st);
// Why stat(path) failed with err, in words ("a loop of symbolic links").
std::string stat_failure(const std::string& path, int err);
bool is_directory(const std::string& path);  // following links
// A descriptor open for reading, or a usage error when path is not a regular file.
int open_input_file(const std::string& path, const std::string& flag);
// The whole of a small file (at most `cap` bytes).
std::string read_input_text(const std::string& path, const std::string& flag, size_t cap = kJsonMaxBytes);

// A read-only memory map of a whole file (declared in llama.h: TokenFile keeps one).
struct Mapped {
    const uint8_t* data = nullptr;
    size_t size = 0;
    std::string path;
    Mapped(const std::string& path, const std::string& flag);
    ~Mapped();
    Mapped(const Mapped&) = delete;
    Mapped& operator=(const Mapped&) = delete;
};

// ---------------------------------------------------------------------------------------------
// Token files (little-endian throughout):
//   version 1: "LLTOKENS", uint32 1, uint32 bytes per token (4), uint64 token count N, then the N
//              uint32 tokens: one document;
//   version 2: "LLTOKENS", uint32 2, uint32 4, uint64 N, uint64 document count M, the N tokens,
//              then M uint64 document starts: ascending, the first 0, each below N (M = 0 only
//              when N = 0).
// Every token is below the vocabulary, and the file's size is exactly what its header says.
// `label` names the file in the usage error that refuses anything else.
struct TokenFileContents {
    uint32_t version = 1;
    uint64_t count = 0, docs = 0;        // tokens, documents
    size_t tokens_at = 0, docs_at = 0;   // byte offsets of the tokens and of the document starts
};
TokenFileContents check_token_file(const uint8_t* data, size_t size, int vocab, const std::string& label);

// ---------------------------------------------------------------------------------------------
// safetensors: uint64 header length N, N bytes of JSON header, then the data buffer. The header
// maps each tensor's name to {dtype, shape, data_offsets: [begin, end)} within the buffer, and
// may hold "__metadata__", a map of strings to strings.
struct StEntry {
    std::string name, dtype;
    std::vector<int64_t> shape;
    uint64_t begin = 0, end = 0;  // bytes of the data buffer
};
struct StHeader {
    uint64_t data_start = 0;       // where the data buffer starts in the file: 8 + N
    std::vector<StEntry> tensors;  // in header order
};
int dtype_bytes(std::string_view dtype);  // BF16, F16: 2; F32: 4; others (unsupported): 0
// The header of a whole safetensors file in memory, every tensor checked against the data.
StHeader parse_safetensors(const uint8_t* data, size_t size, const std::string& path);

// ---------------------------------------------------------------------------------------------
// model.safetensors.index.json: the shard files its weight_map names, each once, in the order
// first named; each a plain file name in the index's folder.
std::vector<std::string> index_shards(std::string_view text, const std::string& path);

// ---------------------------------------------------------------------------------------------
// config.json: a usage error listing every field that contradicts c (a missing field counts as
// transformers' default for Llama), has the wrong JSON type, or, for RoPE, is missing or
// unreadable (top-level rope_theta + rope_scaling, or rope_parameters).
void check_hf_config(const LlamaConfig& c, const std::string& config_json, const std::string& path);
