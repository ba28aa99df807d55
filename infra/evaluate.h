// infra/evaluate.h - held-out evaluation (--eval-data, infra/evaluate.cpp): the mean loss over a
// fixed set of windows of a token file, and the loss by position in the context.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/data.h"
#include "llama.h"

// The windows an evaluation reads: `count` evenly spaced over a file of `file_tokens` tokens, the
// first at offset 0 and the last ending at the file's end (one window if the file holds no more).
// They depend on the file, --seq-len and --eval-windows alone: the same at every evaluation,
// under every stage and rank count.
std::vector<uint64_t> eval_offsets(uint64_t file_tokens, int64_t seq, int count);

// Per-token losses summed by position: a prediction that sees c tokens (its own and those before
// it that attention reaches: the window's, or under --doc-mask its document's from the
// document's start or, where the window cut into the document, from the window's) falls in
// bucket 0 for c in 1..1K, then in buckets that double: 1K-2K, 2K-4K, ...
struct PositionLosses {
    static constexpr int BUCKETS = 40;
    double sum[BUCKETS] = {};
    double count[BUCKETS] = {};  // whole numbers, exact in a double
    static int bucket(int64_t context);
    static std::string label(int b);  // "1-1K", "1K-2K", ...
    void add(int64_t context, double loss) { sum[bucket(context)] += loss, count[bucket(context)] += 1; }
    double tokens() const;
    double mean() const;
};

// What one evaluation reads: the file, its windows, and how many sequences one forward takes
// (the step's: --batch x data-parallel GPUs; the last forward's missing windows are padding,
// not scored).
struct EvalSet {
    const TokenFile* file = nullptr;
    std::vector<uint64_t> offsets;
    int64_t seq = 0;
    int group = 1;
    bool doc_mask = false;
};

// Every window's forward (model_forward_loss) on this rank's share of its tokens, rank `rank` of
// the step's data (its sequences, or under Ulysses its slice: tokens from rank x T), then the
// sums of every rank, added in rank order. Training's state is untouched: between steps only.
PositionLosses evaluate(Model& m, const EvalSet& e, int rank, cudaStream_t s);

// The one line printed, and the log's JSON object, of an evaluation after `step` steps.
std::string eval_line(int step, const EvalSet& e, const PositionLosses& p);
std::string eval_json(int step, const EvalSet& e, const PositionLosses& p);
