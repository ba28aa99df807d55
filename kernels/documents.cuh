// kernels/documents.cuh - packed documents as the attention kernels see them, in one place for
// every kernel: the reference ones (attention.cu) and the fast ones (attention_hopper.cu).
//
// An attention call's documents are the ascending starts of its documents in the call's flat
// token order, [batch][seq], where every sequence's first token starts one (AttentionDocs,
// kernels/attention.h). Query row i of sequence b sees the keys first_key(b, i) .. i: from the
// start of its document on, causally. So for a tile of rows [r0, r1) the keys that matter start
// at first_key(b, r0) (first keys ascend with the row), and for a tile of keys [k0, k1) the rows
// that matter end at doc_end(b, k1 - 1) (the first row of the next document). Each is one
// binary search over the starts, done once per tile or once per row a thread owns: no per-token
// array beyond the starts themselves. Without starts every sequence is one document.
#pragma once

#include <cstdint>

#include "kernels/attention.h"

// The index of the document holding flat token `flat`: the last of `count` ascending starts at
// or before it (start[0] = 0 <= flat). RoPE's positions (kernels/kernels.cu) use it too.
__host__ __device__ inline int64_t document_index(const int64_t* start, int64_t count, int64_t flat) {
    int64_t lo = 0, hi = count - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (start[mid] <= flat) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

struct DocumentView {
    const int64_t* start;
    int64_t count, seq;
    __host__ __device__ DocumentView(const AttentionDocs& d, int64_t seq_) : start(d.start), count(d.count), seq(seq_) {}
    __host__ __device__ bool on() const { return start != nullptr; }
    // The index of the document holding flat token `flat`: the last start at or before it.
    __host__ __device__ int64_t index_of(int64_t flat) const { return document_index(start, count, flat); }
    // The first key row `row` of sequence b may see (0 without documents).
    __host__ __device__ int64_t first_key(int b, int64_t row) const {
        if (!on()) return 0;
        const int64_t base = (int64_t)b * seq;
        return start[index_of(base + row)] - base;
    }
    // The first row of sequence b after the document that holds `key` (seq without documents).
    __host__ __device__ int64_t doc_end(int b, int64_t key) const {
        if (!on()) return seq;
        const int64_t base = (int64_t)b * seq, i = index_of(base + key) + 1;
        return i < count && start[i] - base < seq ? start[i] - base : seq;
    }
    // Whether row `row`, whose document's first key is `first`, sees key `key`.
    __host__ __device__ static bool sees(int64_t row, int64_t first, int64_t key) { return key <= row && key >= first; }
};

// The first keys of rows visited from the last down (the fused backward's adds walk down from a
// document's end): one search for the first row, then a step back to the document before whenever
// a row precedes the current one's start, so no search per step.
struct FirstKeyWalkingDown {
    const DocumentView& docs;
    const int64_t base;
    int64_t index = 0, first = 0;  // the current document and its start, flat
    __host__ __device__ FirstKeyWalkingDown(const DocumentView& d, int b, int64_t row) : docs(d), base((int64_t)b * d.seq) {
        if (d.on()) index = d.index_of(base + row), first = d.start[index];
    }
    __host__ __device__ int64_t operator()(int64_t row) {
        if (!docs.on()) return 0;
        while (base + row < first) first = docs.start[--index];
        return first - base;
    }
};

