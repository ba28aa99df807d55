// io/files.h - the files of a run (io/files.cu): Hugging Face checkpoints, token files, the
// training state. The strict readers of files we did not write are io/input_files.h.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "io/output_paths.h"
#include "llama.h"

// ---------------------------------------------------------------------------------------------
// The config.json of a save: c, and the dtype its weights were written in (bf16 or fp32).
std::string hf_config_json(const LlamaConfig& c, bool bf16);
// check_hf_config, the check of a config.json, is in io/input_files.h with the other readers.
// This GPU's parameters from a HF checkpoint (a .safetensors file, or a directory with
// model.safetensors or model.safetensors.index.json): every tensor's name and shape checked.
std::vector<float> read_hf_weights(const Model& m, const std::string& path);
void check_hf_checkpoint(const Model& m, const std::string& path);  // the same checks, no data read
void load_hf_checkpoint(Model& m, const std::string& path, cudaStream_t s);  // + bf16, zero moments
void write_hf_checkpoint(const std::string& dir, const LlamaConfig& c, const ParamLayout& lay, bool bf16, bool lead,
                         const std::function<std::vector<float>(int)>& unit_data);
void save_hf_checkpoint(Model& m, const std::string& dir, bool bf16, cudaStream_t s);
// The files --init-from reads at path: its safetensors file or shards, the index, config.json.
std::vector<RunPath> hf_checkpoint_reads(const std::string& flag, const std::string& path);
// What --save-to DIR writes: the folder; model.safetensors and config.json, each through a
// temporary beside it; and an older model.safetensors.index.json with the shards it names, which
// the save removes once its own files are in place.
std::vector<RunPath> hf_checkpoint_writes(const std::string& flag, const std::string& dir);

struct Mapped;
// A token file (io/input_files.h has the format), mapped: its tokens and where its documents start.
struct TokenFile {
    const uint32_t* tokens = nullptr;
    uint64_t count = 0;
    uint32_t version = 1;
    std::vector<uint64_t> doc_starts;  // ascending, the first 0 (version 1: one document, {0})
    Mapped* map = nullptr;
    // Every token checked against the vocabulary; a bad file is a usage error naming `flag` and the path.
    TokenFile(const std::string& path, int vocab, const std::string& flag = "--data");
    ~TokenFile();
    TokenFile(const TokenFile&) = delete;
    TokenFile& operator=(const TokenFile&) = delete;
};
// Version 1 without document starts; version 2 with them (ascending, the first 0, each below the count).
void write_token_file(const std::string& path, const std::vector<uint32_t>& tokens,
                      const std::vector<uint64_t>& doc_starts = {});

// The whole training state of every GPU (collective). load returns false if dir has none; its
// state is checked as train_state_file checks it, and read (not mapped) into the GPU's arrays.
void save_train_state(Model& m, const std::string& dir, int64_t step, uint64_t data_state, cudaStream_t s,
                      double timeout_s);
bool load_train_state(Model& m, const std::string& dir, int64_t last_step, int64_t* step, uint64_t* data_state,
                      cudaStream_t s);
// --state-dir, checked before any GPU work: `latest` (read by every run that saves, to keep the
// state before it), when present, names a step folder of dir; with `resume`, rank `rank`'s file
// there is a training state of this run's shape: its header read alone (pread), every field of it
// checked, the file's size the one its header implies, its step that of its folder and within
// [0, last_step]. Returns that file, or "" where there is no state yet. Anything else is a usage
// error naming the file, each fault in its own words.
std::string train_state_file(const Model& m, const std::string& dir, int rank, bool resume, int64_t last_step);
// What --state-dir DIR writes: the folder; `latest` through its temporary; the step folders,
// whose files a later save removes, and their rank files, which a save of the same step replaces.
std::vector<RunPath> train_state_writes(const std::string& flag, const std::string& dir);
