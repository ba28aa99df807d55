// io/data.h - the data a run trains on (io/data.cpp): the synthetic tasks, windows of a token
// file, and the documents of both.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/files.h"
#include "llama.h"

// Synthetic data (no download). copy: each sequence is h random tokens followed by the same h
// tokens again; only targets that can be predicted by looking back are scored (the rest are -1).
// induction: the same with the first h tokens all different, so that the token before each
// scored one occurs once in the first half: an induction head finds it however far back.
// random: uniform tokens, every target scored (the loss cannot go below log(task_vocab)).
// With --doc-lengths MIN,MAX a sequence is documents of MIN to MAX tokens (the last cut off), each
// a copy or induction problem of its own.
// With a token file (--data), each sequence is a window of seq + 1 tokens at a random offset:
// tokens are its first seq, targets its last seq. `state` is all there is to the sampler: the
// training state saves it, so a resumed run sees the same data.
// Documents (docs given): where each of the sequences' documents starts, in their flat order, and
// the position of its first token (where a window cut into a file's document: that document's
// position there); a document's last target, the next one's first token, is not scored.
struct SyntheticData {
    std::string task;
    int vocab;
    uint64_t state;
    int64_t doc_min = 0, doc_max = 0;  // --doc-lengths (0: a sequence is one document)
    const TokenFile* file = nullptr;
    std::vector<uint64_t> offsets;  // with a file: where the last call's windows start
    std::vector<int32_t> pool;      // induction: the tokens, shuffled as they are drawn without repeats
    SyntheticData(const std::string& task_, int vocab_, uint64_t seed) : task(task_), vocab(vocab_), state(seed) {}
    // Fill tokens and targets for `batch` sequences of `seq` tokens, and docs if given.
    void next(int32_t* tokens, int32_t* targets, int batch, int64_t seq, StepDocuments* docs = nullptr);
    // The most documents one sequence of `seq` tokens can hold (1 without documents).
    int64_t max_docs_per_sequence(int64_t seq) const;
    uint64_t next_u64();
    uint32_t next_u32() { return (uint32_t)(next_u64() >> 32); }
    int32_t next_distinct(int64_t i);
};

// The windows of a token file at these offsets, one sequence each, with their documents if docs
// is given (as SyntheticData::next cuts them): the fixed windows of an evaluation.
void windows_at(const TokenFile& f, const std::vector<uint64_t>& offsets, int64_t seq, int32_t* tokens,
                int32_t* targets, StepDocuments* docs = nullptr);

// Every GPU draws the whole step's data (the same seed) and keeps its part: its sequences, or
// under Ulysses its slice of the one sequence; either way rank r's tokens start at r x tokens.
// This GPU's share of the step's documents: under Ulysses (whole_sequence) the one sequence's,
// all of them; data parallel, those of its own sequences, counted from its first.
StepDocuments documents_of_rank(const StepDocuments& all, bool whole_sequence, int rank, int64_t tokens);
