// A CPU check of why the induction recipe does not carry from 4K to 16K: a tiny model trained on
// the induction task at S_TRAIN with one document per sequence (the copy always half the sequence
// back) or with documents of several lengths, then scored at 4 x S_TRAIN (one document), float64
// reference model, AdamW. Lab experiment, not part of the product.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>
#include "io/data.h"
#include "tests/reference.h"

static double eval(const LlamaConfig& c, const std::vector<double>& p, int64_t S, int B, uint64_t seed, int64_t dmin,
                   int64_t dmax) {
    SyntheticData d("induction", c.vocab, seed);
    d.doc_min = dmin, d.doc_max = dmax;
    std::vector<int32_t> tok(B * S), tgt(B * S);
    d.next(tok.data(), tgt.data(), B, S);
    return ref::model_loss(c, p.data(), tok.data(), tgt.data(), B, S);
}

// Phases: S, doc_min, doc_max, steps, lr (doc_min 0: one document per sequence).
struct Phase { int64_t S, dmin, dmax; int steps; double lr; };

int main(int argc, char** argv) {
    // usage: induction_cpu SEED VOCAB  S,dmin,dmax,steps,lr  [S,dmin,dmax,steps,lr ...]
    const uint64_t seed = atoll(argv[1]);
    const int B = 8;
    LlamaConfig c;
    c.name = "exp"; c.dim = 64; c.n_layers = 2; c.n_heads = 2; c.n_kv_heads = 2; c.head_dim = 32;
    c.ffn_dim = 128; c.vocab = atoi(argv[2]); c.tied_embeddings = true;
    c.rope_scaling = {true, 32.0, 1.0, 4.0, 8192};
    std::vector<Phase> phases;
    for (int i = 3; i < argc; i++) {
        Phase ph;
        sscanf(argv[i], "%ld,%ld,%ld,%d,%lf", &ph.S, &ph.dmin, &ph.dmax, &ph.steps, &ph.lr);
        phases.push_back(ph);
    }
    const ParamLayout lay = param_layout(c);
    std::vector<double> p(lay.total, 0.0), g(lay.total);
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal(0.0, 0.02);
    for (const auto& t : lay.tensors)
        for (int64_t i = 0; i < t.rows * t.cols; i++) p[t.offset + i] = t.decay ? normal(rng) : 1.0;
    int phase_no = 0;
    for (const Phase& ph : phases) {
        std::vector<double> m(lay.total, 0.0), v(lay.total, 0.0);  // a fresh optimizer, as --init-from gives
        SyntheticData data("induction", c.vocab, seed * 1000 + 7 + phase_no++);
        data.doc_min = ph.dmin, data.doc_max = ph.dmax;
        const int64_t S = ph.S;
        std::vector<int32_t> tok(B * S), tgt(B * S);
        printf("phase S %ld docs %ld-%ld steps %d lr %g | step 0: one doc at S %.4f (ln half %.2f, guess %.2f)\n", S,
               ph.dmin, ph.dmax, ph.steps, ph.lr, eval(c, p, S, 2, 99, 0, 0), std::log(S / 2.0), std::log((double)c.vocab));
        for (int step = 1; step <= ph.steps; step++) {
            data.next(tok.data(), tgt.data(), B, S);
            const double loss = ref::model_forward_backward(c, p.data(), tok.data(), tgt.data(), B, S, g.data());
            double norm = 0;
            for (double x : g) norm += x * x;
            norm = std::sqrt(norm);
            const double lr = ph.lr * std::min(1.0, step / 20.0);
            for (const auto& t : lay.tensors)
                ref::adamw_step(p.data() + t.offset, g.data() + t.offset, m.data() + t.offset, v.data() + t.offset,
                                t.rows * t.cols, lr, 0.9, 0.95, 1e-8, 0.0, false, step, norm > 1.0 ? 1.0 / norm : 1.0);
            if (step % 100 == 0 || step == ph.steps)
                printf("  step %d loss %.4f | one doc at S %.4f\n", step, loss, eval(c, p, S, 2, 99, 0, 0));
            fflush(stdout);
        }
    }
}
