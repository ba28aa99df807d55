// infra/evaluate.cpp - held-out evaluation: the forward alone over fixed windows of a token
// file, per-token losses summed by position in the context (infra/evaluate.h).
#include "infra/evaluate.h"

#include <algorithm>
#include <cstdio>

#include "infra/comm.h"

std::vector<uint64_t> eval_offsets(uint64_t file_tokens, int64_t seq, int count) {
    const uint64_t last = file_tokens - (uint64_t)seq - 1;  // the last window's offset: it ends at the file's end
    std::vector<uint64_t> offsets;
    for (int k = 0; k < count; k++) offsets.push_back(count > 1 ? (uint64_t)((long double)last * k / (count - 1)) : 0);
    offsets.erase(std::unique(offsets.begin(), offsets.end()), offsets.end());  // a short file: fewer windows
    return offsets;
}

int PositionLosses::bucket(int64_t context) {
    int b = 0;
    for (int64_t top = 1024; context > top && b + 1 < BUCKETS; top *= 2) b++;
    return b;
}

static std::string tokens_text(int64_t n) {  // 1K, 64K, 1M, ...
    return n >= (1 << 20) ? std::to_string(n >> 20) + "M" : std::to_string(n >> 10) + "K";
}

std::string PositionLosses::label(int b) {
    return (b == 0 ? std::string("1") : tokens_text((int64_t)1024 << (b - 1))) + "-" + tokens_text((int64_t)1024 << b);
}

double PositionLosses::tokens() const {
    double n = 0;
    for (int b = 0; b < BUCKETS; b++) n += count[b];
    return n;
}

double PositionLosses::mean() const {
    double total = 0;
    for (int b = 0; b < BUCKETS; b++) total += sum[b];
    return tokens() > 0 ? total / tokens() : 0.0;
}

// How many tokens the prediction at flat token g of the forward's sequences sees: its position
// in the window plus one; with documents, in its document from the document's start, or from the
// window's start where the window cut into the document (attention does not reach the tokens
// before the window, although RoPE's positions count them).
static int64_t context_of(int64_t g, int64_t seq, const StepDocuments* docs) {
    if (!docs) return g % seq + 1;
    const int64_t d = std::upper_bound(docs->start.begin(), docs->start.end(), g) - docs->start.begin() - 1;
    return g - docs->start[d] + 1;
}

// The windows of forward i, padding repeats the first window, with nothing scored.
static void eval_group(const EvalSet& e, size_t i, std::vector<int32_t>& tokens, std::vector<int32_t>& targets,
                       StepDocuments* docs) {
    std::vector<uint64_t> offsets;
    for (size_t w = i * e.group; w < (i + 1) * e.group; w++) offsets.push_back(e.offsets[w < e.offsets.size() ? w : 0]);
    windows_at(*e.file, offsets, e.seq, tokens.data(), targets.data(), docs);
    for (size_t w = i * e.group; w < (i + 1) * e.group; w++)
        if (w >= e.offsets.size()) std::fill_n(targets.begin() + (w - i * e.group) * e.seq, e.seq, -1);
}

// Every rank's sums, added in rank order on every rank (the doubles travel as their bits).
static PositionLosses sum_over_ranks(Model& m, const PositionLosses& mine, cudaStream_t s) {
    if (m.world == 1) return mine;
    const int64_t n = 2 * PositionLosses::BUCKETS;  // doubles: the sums, then the counts
    std::vector<double> all(n * m.world);
    double* dev = nullptr;
    CUDA_CHECK(cudaMalloc(&dev, (m.world + 1) * n * sizeof(double)));
    CUDA_CHECK(cudaMemcpyAsync(dev, mine.sum, n * sizeof(double), cudaMemcpyHostToDevice, s));  // sum, count adjacent
    m.comm->all_gather(dev + n, dev, 2 * n, DType::F32, s);
    CUDA_CHECK(cudaMemcpyAsync(all.data(), dev + n, all.size() * sizeof(double), cudaMemcpyDeviceToHost, s));
    comm_sync(m.comm, s, m.watch.timeout_s);
    CUDA_CHECK(cudaFree(dev));
    PositionLosses total;
    for (int r = 0; r < m.world; r++)
        for (int b = 0; b < PositionLosses::BUCKETS; b++)
            total.sum[b] += all[r * n + b], total.count[b] += all[r * n + PositionLosses::BUCKETS + b];
    return total;
}

PositionLosses evaluate(Model& m, const EvalSet& e, int rank, cudaStream_t s) {
    static_assert(offsetof(PositionLosses, count) == offsetof(PositionLosses, sum) + sizeof(PositionLosses::sum),
                  "sum_over_ranks sends the sums and the counts as one array");
    const int64_t T = m.shape.tokens(), all_tokens = e.group * e.seq;
    std::vector<int32_t> tokens(all_tokens), targets(all_tokens);
    std::vector<float> losses(T);
    StepDocuments docs, mine;
    PositionLosses p;
    const size_t forwards = (e.offsets.size() + e.group - 1) / e.group;
    for (size_t i = 0; i < forwards; i++) {
        eval_group(e, i, tokens, targets, e.doc_mask ? &docs : nullptr);
        if (e.doc_mask) mine = documents_of_rank(docs, m.shape.sp > 1, rank, T);
        model_set_batch(m, tokens.data() + rank * T, targets.data() + rank * T, s, -1, e.doc_mask ? &mine : nullptr);
        model_forward_loss(m, s);
        CUDA_CHECK(cudaMemcpyAsync(losses.data(), m.head.losses, T * sizeof(float), cudaMemcpyDeviceToHost, s));
        model_sync(m, s);
        for (int64_t t = 0; t < T; t++) {
            const int64_t g = rank * T + t;
            if (targets[g] >= 0) p.add(context_of(g, e.seq, e.doc_mask ? &docs : nullptr), losses[t]);
        }
    }
    return sum_over_ranks(m, p, s);
}

static int last_bucket(const PositionLosses& p) {
    int last = 0;
    for (int b = 0; b < PositionLosses::BUCKETS; b++)
        if (p.count[b] > 0) last = b;
    return last;
}

std::string eval_line(int step, const EvalSet& e, const PositionLosses& p) {
    char buf[128];
    snprintf(buf, sizeof buf, "eval %4d  loss %8.4f  over %zu windows (%.0f tokens) | by position:", step, p.mean(),
             e.offsets.size(), p.tokens());
    std::string line = buf;
    for (int b = 0; b <= last_bucket(p); b++) {
        if (p.count[b] == 0) continue;
        snprintf(buf, sizeof buf, "  %s %.4f", PositionLosses::label(b).c_str(), p.sum[b] / p.count[b]);
        line += buf;
    }
    return line;
}

std::string eval_json(int step, const EvalSet& e, const PositionLosses& p) {
    char buf[256];
    snprintf(buf, sizeof buf, "{\"type\": \"eval\", \"step\": %d, \"loss\": %.9g, \"windows\": %zu, \"tokens\": %.0f, "
             "\"positions\": [", step, p.mean(), e.offsets.size(), p.tokens());
    std::string json = buf;
    bool first = true;
    for (int b = 0; b <= last_bucket(p); b++) {
        if (p.count[b] == 0) continue;
        const int64_t from = b == 0 ? 1 : ((int64_t)1024 << (b - 1)) + 1, to = (int64_t)1024 << b;
        snprintf(buf, sizeof buf, "%s{\"from\": %lld, \"to\": %lld, \"label\": \"%s\", \"tokens\": %.0f, \"loss\": %.9g}",
                 first ? "" : ", ", (long long)from, (long long)to, PositionLosses::label(b).c_str(), p.count[b],
                 p.sum[b] / p.count[b]);
        json += buf, first = false;
    }
    return json + "]}";
}
