// io/data.cpp - the data a run trains on: the synthetic tasks (copy, induction, random; in
// documents with --doc-lengths), windows of a token file, and their documents (--doc-mask).
#include "io/data.h"

#include <algorithm>

uint64_t SyntheticData::next_u64() {  // splitmix64: small, fast, reproducible everywhere
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Sequence b is the window of the token file at `offset`. With documents: the window's first
// document starts at its first token, at the position the window cut into it; the others where
// the file says; and a document's last target (the next one's first token) is not scored.
static void file_window(const TokenFile& f, uint64_t offset, int b, int64_t seq, int32_t* tokens, int32_t* targets,
                        StepDocuments* docs) {
    for (int64_t i = 0; i < seq; i++) {
        tokens[b * seq + i] = (int32_t)f.tokens[offset + i];
        targets[b * seq + i] = (int32_t)f.tokens[offset + i + 1];
    }
    if (!docs) return;
    auto it = std::upper_bound(f.doc_starts.begin(), f.doc_starts.end(), offset);  // past offset's document
    docs->start.push_back(b * seq), docs->first_position.push_back((int64_t)(offset - *(it - 1)));
    for (; it != f.doc_starts.end() && *it <= offset + seq; ++it) {
        const int64_t at = (int64_t)(*it - offset);  // in (0, seq]
        targets[b * seq + at - 1] = -1;
        if (at < seq) docs->start.push_back(b * seq + at), docs->first_position.push_back(0);
    }
}

void windows_at(const TokenFile& f, const std::vector<uint64_t>& offsets, int64_t seq, int32_t* tokens,
                int32_t* targets, StepDocuments* docs) {
    if (docs) docs->start.clear(), docs->first_position.clear();
    for (size_t b = 0; b < offsets.size(); b++) file_window(f, offsets[b], (int)b, seq, tokens, targets, docs);
}

// One document of the copy or induction task, z[0 .. n-1] (a random task: uniform tokens):
// z[half + i] = z[i]. Returns half (0 for random).
static int64_t task_document(SyntheticData& d, int32_t* z, int64_t n) {
    const bool repeats = d.task == "copy" || d.task == "induction";
    const int64_t half = n / 2;
    if (d.task == "induction") {  // a fresh pool each document: the sampler's state stays one number
        d.pool.resize(d.vocab);
        for (int32_t v = 0; v < d.vocab; v++) d.pool[v] = v;
    }
    for (int64_t i = 0; i < n; i++) {
        const bool copied = repeats && i >= half && i < 2 * half;
        z[i] = copied ? z[i - half] : d.task == "induction" && i < half ? d.next_distinct(i) : (int32_t)(d.next_u32() % (uint32_t)d.vocab);
    }
    return repeats ? half : 0;
}

void SyntheticData::next(int32_t* tokens, int32_t* targets, int batch, int64_t seq, StepDocuments* docs) {
    if (docs) docs->start.clear(), docs->first_position.clear();
    if (file) {  // one window of the token file per sequence, at a random offset
        offsets.clear();
        for (int b = 0; b < batch; b++) offsets.push_back(next_u64() % (file->count - (uint64_t)seq));
        return windows_at(*file, offsets, seq, tokens, targets, docs);
    }
    // Each sequence is seq + 1 tokens z; inputs z[0..seq-1], targets z[1..seq]: one document, or
    // documents of doc_min .. doc_max tokens (the last cut off at seq + 1). In copy and induction
    // only the targets that repeat their document's first half are scored.
    const bool repeats = task == "copy" || task == "induction";
    std::vector<int32_t> z(seq + 1);
    std::vector<char> scored(seq + 1);
    for (int b = 0; b < batch; b++) {
        for (int64_t at = 0; at <= seq;) {
            const int64_t n = doc_min > 0 ? std::min<int64_t>(doc_min + (int64_t)(next_u64() % (uint64_t)(doc_max - doc_min + 1)), seq + 1 - at)
                                          : seq + 1;
            const int64_t half = task_document(*this, z.data() + at, n);
            for (int64_t i = 0; i < n; i++) scored[at + i] = !repeats || (i >= half && i < 2 * half);
            if (docs && at < seq) docs->start.push_back(b * seq + at), docs->first_position.push_back(0);
            at += n;
        }
        for (int64_t i = 0; i < seq; i++) {
            tokens[b * seq + i] = z[i];
            targets[b * seq + i] = scored[i + 1] ? z[i + 1] : -1;
        }
    }
}

int64_t SyntheticData::max_docs_per_sequence(int64_t seq) const {
    if (doc_min > 0) return (seq + 1 + doc_min - 1) / doc_min;
    if (!file) return 1;
    // 1 + the starts inside a window's tokens 1 .. seq - 1: the most starts among seq - 1
    // consecutive tokens of the file.
    const std::vector<uint64_t>& st = file->doc_starts;
    int64_t most = 0;
    for (size_t lo = 0, hi = 0; hi < st.size(); hi++) {
        while (st[hi] - st[lo] >= (uint64_t)std::max<int64_t>(1, seq - 1)) lo++;
        most = std::max<int64_t>(most, (int64_t)(hi - lo + 1));
    }
    return 1 + (seq > 1 ? most : 0);
}

// The i-th token of a sample without repeats from [0, vocab): one step of a Fisher-Yates shuffle
// of the pool, whose first i entries are the sample so far.
int32_t SyntheticData::next_distinct(int64_t i) {
    const int64_t j = i + (int64_t)(next_u64() % (uint64_t)(vocab - i));
    std::swap(pool[i], pool[j]);
    return pool[i];
}

StepDocuments documents_of_rank(const StepDocuments& all, bool whole_sequence, int rank, int64_t tokens) {
    if (whole_sequence) return all;
    const int64_t lo = (int64_t)rank * tokens, hi = lo + tokens;
    StepDocuments mine;
    for (size_t i = 0; i < all.start.size(); i++)
        if (all.start[i] >= lo && all.start[i] < hi)
            mine.start.push_back(all.start[i] - lo), mine.first_position.push_back(all.first_position[i]);
    return mine;
}
