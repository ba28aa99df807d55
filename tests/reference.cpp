// tests/reference.cpp - the float64 CPU reference of the model (interface and conventions in
// reference.h). Plain loops over the textbook formulas; speed does not matter here, clarity does.
#include "reference.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace ref {

namespace {

const double kPi = 3.14159265358979323846;

double silu(double g) { return g / (1.0 + std::exp(-g)); }

// d silu / dg = sigmoid(g) * (1 + g * (1 - sigmoid(g))).
double silu_grad(double g) {
    double s = 1.0 / (1.0 + std::exp(-g));
    return s * (1.0 + g * (1.0 - s));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// RMSNorm

void rmsnorm_forward(const double* x, const double* w, double* y, double* rstd, int64_t T, int D,
                     double eps) {
    for (int64_t t = 0; t < T; t++) {
        const double* xt = x + t * D;
        double sum_sq = 0;
        for (int i = 0; i < D; i++) sum_sq += xt[i] * xt[i];
        double r = 1.0 / std::sqrt(sum_sq / D + eps);
        rstd[t] = r;
        for (int i = 0; i < D; i++) y[t * D + i] = xt[i] * r * w[i];
    }
}

// y_i = x_i r w_i with r = (mean(x^2) + eps)^(-1/2), so dr/dx_j = -r^3 x_j / D and
//   dx_j = r dy_j w_j - x_j r^3 / D * sum_i dy_i w_i x_i,   dw_i += dy_i x_i r.
void rmsnorm_backward(const double* dy, const double* x, const double* w, const double* rstd,
                      double* dx, double* dw, int64_t T, int D) {
    for (int64_t t = 0; t < T; t++) {
        const double* xt = x + t * D;
        const double* dyt = dy + t * D;
        const double r = rstd[t];
        double dot = 0;
        for (int i = 0; i < D; i++) dot += dyt[i] * w[i] * xt[i];
        for (int i = 0; i < D; i++) {
            dx[t * D + i] = r * dyt[i] * w[i] - xt[i] * r * r * r * dot / D;
            dw[i] += dyt[i] * xt[i] * r;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// RoPE

// Hugging Face's _compute_llama3_parameters, written out branch by branch.
std::vector<double> rope_inv_freq(const LlamaConfig& c) {
    const int half = c.head_dim / 2;
    std::vector<double> inv(half);
    for (int i = 0; i < half; i++) {
        double base = 1.0 / std::pow(c.rope_theta, (2.0 * i) / c.head_dim);
        inv[i] = base;
        if (!c.rope_scaling.enabled) continue;
        const RopeScaling& s = c.rope_scaling;
        const double wavelen = 2.0 * kPi / base;
        const double low_freq_wavelen = s.original_max_pos / s.low_freq_factor;
        const double high_freq_wavelen = s.original_max_pos / s.high_freq_factor;
        if (wavelen > low_freq_wavelen) {
            inv[i] = base / s.factor;  // low frequency: stretched by the full factor
        } else if (wavelen < high_freq_wavelen) {
            inv[i] = base;  // high frequency: unchanged
        } else {
            double smooth = (s.original_max_pos / wavelen - s.low_freq_factor) /
                            (s.high_freq_factor - s.low_freq_factor);
            inv[i] = (1.0 - smooth) * base / s.factor + smooth * base;
        }
    }
    return inv;
}

void rope_apply(double* x, int64_t T, int64_t S, int n_heads, int head_dim, int64_t row_stride,
                const std::vector<double>& inv_freq, bool inverse, const int64_t* positions) {
    const int half = head_dim / 2;
    if ((int)inv_freq.size() < half) throw std::invalid_argument("rope_apply: inv_freq too short");
    for (int64_t t = 0; t < T; t++) {
        const double pos = (double)(positions ? positions[t] : t % S);
        for (int h = 0; h < n_heads; h++) {
            double* xh = x + t * row_stride + (int64_t)h * head_dim;
            for (int i = 0; i < half; i++) {
                double a = pos * inv_freq[i];
                if (inverse) a = -a;
                const double c = std::cos(a), s = std::sin(a);
                const double x1 = xh[i], x2 = xh[i + half];
                xh[i] = x1 * c - x2 * s;
                xh[i + half] = x2 * c + x1 * s;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Attention

namespace {

struct AttnShape {
    int64_t S;
    int Hq, Hkv, d;
    const double* row_q(const double* q, int b, int64_t i, int h) const {
        return q + ((int64_t)b * S + i) * Hq * d + (int64_t)h * d;
    }
    const double* row_kv(const double* kv, int b, int64_t j, int g) const {
        return kv + ((int64_t)b * S + j) * Hkv * d + (int64_t)g * d;
    }
    int kv_head(int h) const { return h / (Hq / Hkv); }
};

void check_attn_shape(int Hq, int Hkv, int d) {
    if (Hq <= 0 || Hkv <= 0 || d <= 0 || Hq % Hkv != 0)
        throw std::invalid_argument("attention: need Hq % Hkv == 0 and positive sizes");
}

// Softmax probabilities p[0..i] of query row i of (sequence b, head h) over the keys j0..i of the
// same sequence (causal, never across sequences; j0 the first key of its document, p[j < j0] = 0).
// Returns the log of the softmax denominator.
double attention_probs(const AttnShape& sh, const double* q, const double* k, int b, int h,
                       int64_t i, int64_t j0, std::vector<double>& p) {
    const double scale = 1.0 / std::sqrt((double)sh.d);
    const double* qi = sh.row_q(q, b, i, h);
    p.assign(i + 1, 0.0);
    double max_score = -INFINITY;
    for (int64_t j = j0; j <= i; j++) {
        const double* kj = sh.row_kv(k, b, j, sh.kv_head(h));
        double s = 0;
        for (int c = 0; c < sh.d; c++) s += qi[c] * kj[c];
        p[j] = s * scale;
        if (p[j] > max_score) max_score = p[j];
    }
    double denom = 0;  // subtracting the max keeps exp() finite; it cancels out
    for (int64_t j = j0; j <= i; j++) denom += std::exp(p[j] - max_score);
    const double lse = max_score + std::log(denom);
    for (int64_t j = j0; j <= i; j++) p[j] = std::exp(p[j] - lse);
    return lse;
}

}  // namespace

void attention_forward(const double* q, const double* k, const double* v, double* out,
                       double* lse, int B, int64_t S, int Hq, int Hkv, int d, const int64_t* first_key) {
    check_attn_shape(Hq, Hkv, d);
    const AttnShape sh{S, Hq, Hkv, d};
    std::vector<double> p;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < Hq; h++)
            for (int64_t i = 0; i < S; i++) {
                double l = attention_probs(sh, q, k, b, h, i, first_key ? first_key[(int64_t)b * S + i] : 0, p);
                if (lse) lse[((int64_t)b * Hq + h) * S + i] = l;
                double* oi = out + ((int64_t)b * S + i) * Hq * d + (int64_t)h * d;
                for (int c = 0; c < d; c++) oi[c] = 0;
                for (int64_t j = 0; j <= i; j++) {
                    const double* vj = sh.row_kv(v, b, j, sh.kv_head(h));
                    for (int c = 0; c < d; c++) oi[c] += p[j] * vj[c];
                }
            }
}

// With s_j = scale q.k_j, p = softmax(s), o = sum_j p_j v_j:
//   dv_j += p_j do,  dp_j = do.v_j,  ds_j = p_j (dp_j - sum_l p_l dp_l),
//   dq += scale sum_j ds_j k_j,  dk_j += scale ds_j q.
// Several query heads share a KV head, so dk and dv sum over the heads of the group.
void attention_backward(const double* q, const double* k, const double* v, const double* dout,
                        double* dq, double* dk, double* dv, int B, int64_t S, int Hq, int Hkv,
                        int d, const int64_t* first_key) {
    check_attn_shape(Hq, Hkv, d);
    const AttnShape sh{S, Hq, Hkv, d};
    const double scale = 1.0 / std::sqrt((double)d);
    const int64_t T = (int64_t)B * S;
    for (int64_t n = 0; n < T * Hq * d; n++) dq[n] = 0;
    for (int64_t n = 0; n < T * Hkv * d; n++) dk[n] = dv[n] = 0;
    std::vector<double> p, dp;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < Hq; h++)
            for (int64_t i = 0; i < S; i++) {
                attention_probs(sh, q, k, b, h, i, first_key ? first_key[(int64_t)b * S + i] : 0, p);
                const int g = sh.kv_head(h);
                const int64_t qoff = sh.row_q(q, b, i, h) - q;  // same offset in dq, dout
                const double* doi = dout + qoff;
                dp.assign(i + 1, 0.0);
                double sum_pdp = 0;
                for (int64_t j = 0; j <= i; j++) {
                    const double* vj = sh.row_kv(v, b, j, g);
                    for (int c = 0; c < d; c++) dp[j] += doi[c] * vj[c];
                    sum_pdp += p[j] * dp[j];
                }
                for (int64_t j = 0; j <= i; j++) {
                    const int64_t kvoff = sh.row_kv(k, b, j, g) - k;  // same offset in dk, dv
                    const double ds = p[j] * (dp[j] - sum_pdp);
                    for (int c = 0; c < d; c++) {
                        dq[qoff + c] += scale * ds * k[kvoff + c];
                        dk[kvoff + c] += scale * ds * q[qoff + c];
                        dv[kvoff + c] += p[j] * doi[c];
                    }
                }
            }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

void swiglu_forward(const double* h13, double* act, int64_t T, int F) {
    for (int64_t t = 0; t < T; t++)
        for (int f = 0; f < F; f++) {
            const double gate = h13[t * 2 * F + f], up = h13[t * 2 * F + F + f];
            act[t * F + f] = silu(gate) * up;
        }
}

void swiglu_backward(const double* dact, const double* h13, double* dh13, int64_t T, int F) {
    for (int64_t t = 0; t < T; t++)
        for (int f = 0; f < F; f++) {
            const double gate = h13[t * 2 * F + f], up = h13[t * 2 * F + F + f];
            const double da = dact[t * F + f];
            dh13[t * 2 * F + f] = da * up * silu_grad(gate);
            dh13[t * 2 * F + F + f] = da * silu(gate);
        }
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy

// loss = mean over counted tokens of (logsumexp(logits_t) - logits_t[target_t]); its gradient is
// (softmax(logits_t) - onehot(target_t)) / count. With no counted token the loss is 0.
double cross_entropy(const double* logits, const int32_t* targets, double* dlogits, int64_t T,
                     int V) {
    int64_t count = 0;
    for (int64_t t = 0; t < T; t++) {
        if (targets[t] == -1) continue;
        if (targets[t] < 0 || targets[t] >= V)
            throw std::out_of_range("cross_entropy: target " + std::to_string(targets[t]));
        count++;
    }
    if (dlogits)
        for (int64_t n = 0; n < T * V; n++) dlogits[n] = 0;
    if (count == 0) return 0.0;
    double total = 0;
    for (int64_t t = 0; t < T; t++) {
        if (targets[t] == -1) continue;
        const double* lt = logits + t * V;
        double max_logit = -INFINITY;
        for (int c = 0; c < V; c++) max_logit = std::max(max_logit, lt[c]);
        double denom = 0;
        for (int c = 0; c < V; c++) denom += std::exp(lt[c] - max_logit);
        const double lse = max_logit + std::log(denom);
        total += lse - lt[targets[t]];
        if (dlogits) {
            for (int c = 0; c < V; c++) dlogits[t * V + c] = std::exp(lt[c] - lse) / count;
            dlogits[t * V + targets[t]] -= 1.0 / count;
        }
    }
    return total / count;
}

// ---------------------------------------------------------------------------------------------
// Linear

void linear_forward(const double* x, const double* W, double* y, int64_t T, int in, int out) {
    for (int64_t t = 0; t < T; t++)
        for (int o = 0; o < out; o++) {
            double s = 0;
            for (int i = 0; i < in; i++) s += x[t * in + i] * W[(int64_t)o * in + i];
            y[t * out + o] = s;
        }
}

void linear_backward(const double* dy, const double* x, const double* W, double* dx, double* dW,
                     int64_t T, int in, int out) {
    for (int64_t t = 0; t < T; t++)
        for (int i = 0; i < in; i++) {
            double s = 0;
            for (int o = 0; o < out; o++) s += dy[t * out + o] * W[(int64_t)o * in + i];
            dx[t * in + i] = s;
        }
    for (int o = 0; o < out; o++)
        for (int i = 0; i < in; i++) {
            double s = 0;
            for (int64_t t = 0; t < T; t++) s += dy[t * out + o] * x[t * in + i];
            dW[(int64_t)o * in + i] += s;
        }
}

// ---------------------------------------------------------------------------------------------
// The whole model

namespace {

// Everything the backward pass of one layer needs, saved by the forward pass.
struct LayerActs {
    std::vector<double> x_in;          // [T, D] layer input (residual stream)
    std::vector<double> rstd1, xn1;    // attention RMSNorm
    std::vector<double> q, k, v;       // [T, Hq*d], [T, Hkv*d] x2; q and k after RoPE
    std::vector<double> q_raw, k_raw;  // Qwen3: q and k before their per-head norms
    std::vector<double> rstd_q, rstd_k;  // [T * Hq], [T * Hkv]
    std::vector<double> attn;          // [T, Hq*d] attention output, input of wo
    std::vector<double> h;             // [T, D] residual after attention
    std::vector<double> rstd2, xn2;    // MLP RMSNorm
    std::vector<double> h13, act;      // [T, 2F] gate|up, [T, F] silu(gate)*up
};

struct ModelActs {
    int64_t T = 0;
    std::vector<double> inv_freq;
    std::vector<LayerActs> layers;
    std::vector<double> x_final, rstd_final, xn_final;  // before/after the final RMSNorm
    std::vector<double> logits;                         // [T, V]
};

// Pointers to each tensor of one flat array (parameters or gradients).
template <typename P>
struct LayerTensors {
    P attn_norm, wqkv, wo, mlp_norm, w13, w2;
    P q_norm, k_norm;  // Qwen3's per-head norms (null for Llama)
};

template <typename P>
LayerTensors<P> layer_tensors(const ParamLayout& lay, const LlamaConfig& c, P base, int l) {
    return {base + lay.find(P_ATTN_NORM, l).offset, base + lay.find(P_WQKV, l).offset,
            base + lay.find(P_WO, l).offset,        base + lay.find(P_MLP_NORM, l).offset,
            base + lay.find(P_W13, l).offset,       base + lay.find(P_W2, l).offset,
            c.qk_norm() ? base + lay.find(P_Q_NORM, l).offset : nullptr,
            c.qk_norm() ? base + lay.find(P_K_NORM, l).offset : nullptr};
}

// The LM head: its own matrix, or the embedding when tied.
template <typename P>
P lm_head(const LlamaConfig& c, const ParamLayout& lay, P base) {
    return base + lay.find(c.tied_embeddings ? P_EMBED : P_LM_HEAD).offset;
}

void check_model_inputs(const LlamaConfig& c, const int32_t* tokens, int B, int64_t S) {
    if (c.dim <= 0 || c.n_layers < 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 ||
        c.n_heads % c.n_kv_heads != 0 || c.head_dim <= 0 || c.head_dim % 2 != 0 ||
        c.ffn_dim <= 0 || c.vocab <= 0)
        throw std::invalid_argument("reference model: invalid config '" + c.name + "'");
    if (B <= 0 || S <= 0) throw std::invalid_argument("reference model: empty batch");
    for (int64_t t = 0; t < (int64_t)B * S; t++)
        if (tokens[t] < 0 || tokens[t] >= c.vocab)
            throw std::out_of_range("reference model: token " + std::to_string(tokens[t]));
}

// One transformer layer: x (in/out) = h + mlp(h), h = x + attn(x). Saves what backward needs.
void layer_forward(const LlamaConfig& c, const LayerTensors<const double*>& w, int B, int64_t S,
                   const std::vector<double>& inv_freq, const Documents* docs, std::vector<double>& x, LayerActs& a) {
    const int64_t* pos = docs ? docs->position.data() : nullptr;
    const int64_t* first_key = docs ? docs->first_key.data() : nullptr;
    const int64_t T = (int64_t)B * S;
    const int D = c.dim, F = c.ffn_dim, qd = (int)c.q_dim(), kvd = (int)c.kv_dim();
    const int qkvd = (int)c.qkv_dim();
    a.x_in = x;
    a.rstd1.resize(T);
    a.xn1.resize(T * D);
    rmsnorm_forward(x.data(), w.attn_norm, a.xn1.data(), a.rstd1.data(), T, D, c.norm_eps);

    std::vector<double> qkv(T * qkvd);
    linear_forward(a.xn1.data(), w.wqkv, qkv.data(), T, D, qkvd);
    a.q.resize(T * qd);
    a.k.resize(T * kvd);
    a.v.resize(T * kvd);
    for (int64_t t = 0; t < T; t++) {  // per token: [q heads | k heads | v heads]
        for (int i = 0; i < qd; i++) a.q[t * qd + i] = qkv[t * qkvd + i];
        for (int i = 0; i < kvd; i++) a.k[t * kvd + i] = qkv[t * qkvd + qd + i];
        for (int i = 0; i < kvd; i++) a.v[t * kvd + i] = qkv[t * qkvd + qd + kvd + i];
    }
    if (c.qk_norm()) {  // Qwen3: RMSNorm of each head of q and k (T * heads rows of d), before RoPE
        a.q_raw = a.q, a.k_raw = a.k;
        a.rstd_q.resize(T * c.n_heads), a.rstd_k.resize(T * c.n_kv_heads);
        rmsnorm_forward(a.q_raw.data(), w.q_norm, a.q.data(), a.rstd_q.data(), T * c.n_heads, c.head_dim, c.norm_eps);
        rmsnorm_forward(a.k_raw.data(), w.k_norm, a.k.data(), a.rstd_k.data(), T * c.n_kv_heads, c.head_dim,
                        c.norm_eps);
    }
    rope_apply(a.q.data(), T, S, c.n_heads, c.head_dim, qd, inv_freq, false, pos);
    rope_apply(a.k.data(), T, S, c.n_kv_heads, c.head_dim, kvd, inv_freq, false, pos);

    a.attn.resize(T * qd);
    attention_forward(a.q.data(), a.k.data(), a.v.data(), a.attn.data(), nullptr, B, S,
                      c.n_heads, c.n_kv_heads, c.head_dim, first_key);
    std::vector<double> o(T * D);
    linear_forward(a.attn.data(), w.wo, o.data(), T, qd, D);
    a.h.resize(T * D);
    for (int64_t n = 0; n < T * D; n++) a.h[n] = x[n] + o[n];

    a.rstd2.resize(T);
    a.xn2.resize(T * D);
    rmsnorm_forward(a.h.data(), w.mlp_norm, a.xn2.data(), a.rstd2.data(), T, D, c.norm_eps);
    a.h13.resize(T * 2 * F);
    linear_forward(a.xn2.data(), w.w13, a.h13.data(), T, D, 2 * F);
    a.act.resize(T * F);
    swiglu_forward(a.h13.data(), a.act.data(), T, F);
    std::vector<double> mlp(T * D);
    linear_forward(a.act.data(), w.w2, mlp.data(), T, F, D);
    for (int64_t n = 0; n < T * D; n++) x[n] = a.h[n] + mlp[n];
}

// Backward of layer_forward: dx (in/out) is d loss / d(layer output) on entry and
// d loss / d(layer input) on exit. Parameter gradients accumulate into g.
void layer_backward(const LlamaConfig& c, const LayerTensors<const double*>& w,
                    const LayerTensors<double*>& g, int B, int64_t S,
                    const std::vector<double>& inv_freq, const Documents* docs, const LayerActs& a,
                    std::vector<double>& dx) {
    const int64_t* pos = docs ? docs->position.data() : nullptr;
    const int64_t* first_key = docs ? docs->first_key.data() : nullptr;
    const int64_t T = (int64_t)B * S;
    const int D = c.dim, F = c.ffn_dim, qd = (int)c.q_dim(), kvd = (int)c.kv_dim();
    const int qkvd = (int)c.qkv_dim();

    // MLP branch: x_out = h + w2(swiglu(w13(rmsnorm(h)))).
    std::vector<double> dact(T * F), dh13(T * 2 * F), dxn2(T * D), dh(T * D);
    linear_backward(dx.data(), a.act.data(), w.w2, dact.data(), g.w2, T, F, D);
    swiglu_backward(dact.data(), a.h13.data(), dh13.data(), T, F);
    linear_backward(dh13.data(), a.xn2.data(), w.w13, dxn2.data(), g.w13, T, D, 2 * F);
    rmsnorm_backward(dxn2.data(), a.h.data(), w.mlp_norm, a.rstd2.data(), dh.data(), g.mlp_norm,
                     T, D);
    for (int64_t n = 0; n < T * D; n++) dh[n] += dx[n];  // the residual path

    // Attention branch: h = x_in + wo(attention(rope(q), rope(k), v)).
    std::vector<double> dattn(T * qd), dq(T * qd), dk(T * kvd), dv(T * kvd);
    linear_backward(dh.data(), a.attn.data(), w.wo, dattn.data(), g.wo, T, qd, D);
    attention_backward(a.q.data(), a.k.data(), a.v.data(), dattn.data(), dq.data(), dk.data(),
                       dv.data(), B, S, c.n_heads, c.n_kv_heads, c.head_dim, first_key);
    rope_apply(dq.data(), T, S, c.n_heads, c.head_dim, qd, inv_freq, true, pos);
    rope_apply(dk.data(), T, S, c.n_kv_heads, c.head_dim, kvd, inv_freq, true, pos);
    if (c.qk_norm()) {  // through the per-head norms
        std::vector<double> dq_raw(T * qd), dk_raw(T * kvd);
        rmsnorm_backward(dq.data(), a.q_raw.data(), w.q_norm, a.rstd_q.data(), dq_raw.data(), g.q_norm,
                         T * c.n_heads, c.head_dim);
        rmsnorm_backward(dk.data(), a.k_raw.data(), w.k_norm, a.rstd_k.data(), dk_raw.data(), g.k_norm,
                         T * c.n_kv_heads, c.head_dim);
        dq = dq_raw, dk = dk_raw;
    }
    std::vector<double> dqkv(T * qkvd);
    for (int64_t t = 0; t < T; t++) {
        for (int i = 0; i < qd; i++) dqkv[t * qkvd + i] = dq[t * qd + i];
        for (int i = 0; i < kvd; i++) dqkv[t * qkvd + qd + i] = dk[t * kvd + i];
        for (int i = 0; i < kvd; i++) dqkv[t * qkvd + qd + kvd + i] = dv[t * kvd + i];
    }
    std::vector<double> dxn1(T * D), dx_norm(T * D);
    linear_backward(dqkv.data(), a.xn1.data(), w.wqkv, dxn1.data(), g.wqkv, T, D, qkvd);
    rmsnorm_backward(dxn1.data(), a.x_in.data(), w.attn_norm, a.rstd1.data(), dx_norm.data(),
                     g.attn_norm, T, D);
    for (int64_t n = 0; n < T * D; n++) dx[n] = dh[n] + dx_norm[n];
}

// Embedding lookup, the layers, the final RMSNorm and the LM head; fills a (logits included).
void model_forward(const LlamaConfig& c, const ParamLayout& lay, const double* params,
                   const int32_t* tokens, int B, int64_t S, const Documents* docs, ModelActs& a) {
    check_model_inputs(c, tokens, B, S);
    if (docs && (docs->first_key.size() != (size_t)(B * S) || docs->position.size() != (size_t)(B * S)))
        throw std::invalid_argument("reference model: documents of another length than the batch");
    const int64_t T = (int64_t)B * S;
    const int D = c.dim;
    a.T = T;
    a.inv_freq = ref::rope_inv_freq(c);  // qualified: ADL also finds ::rope_inv_freq
    const double* embed = params + lay.find(P_EMBED).offset;
    std::vector<double> x(T * D);
    for (int64_t t = 0; t < T; t++)
        for (int i = 0; i < D; i++) x[t * D + i] = embed[(int64_t)tokens[t] * D + i];

    a.layers.resize(c.n_layers);
    for (int l = 0; l < c.n_layers; l++)
        layer_forward(c, layer_tensors(lay, c, params, l), B, S, a.inv_freq, docs, x, a.layers[l]);

    a.x_final = x;
    a.rstd_final.resize(T);
    a.xn_final.resize(T * D);
    rmsnorm_forward(x.data(), params + lay.find(P_FINAL_NORM).offset, a.xn_final.data(),
                    a.rstd_final.data(), T, D, c.norm_eps);
    a.logits.resize(T * c.vocab);
    linear_forward(a.xn_final.data(), lm_head(c, lay, params), a.logits.data(), T, D, c.vocab);
}

}  // namespace

double model_forward_backward(const LlamaConfig& cfg, const double* params,
                              const int32_t* tokens, const int32_t* targets, int B, int64_t S,
                              double* grads, std::vector<double>* logits_out, const Documents* docs) {
    const ParamLayout lay = param_layout(cfg);
    ModelActs a;
    model_forward(cfg, lay, params, tokens, B, S, docs, a);
    const int64_t T = a.T;
    const int D = cfg.dim, V = cfg.vocab;
    for (int64_t n = 0; n < lay.total; n++) grads[n] = 0;  // padding included

    std::vector<double> dlogits(T * V);
    const double loss = cross_entropy(a.logits.data(), targets, dlogits.data(), T, V);

    // Head: logits = rmsnorm(x) head^T. With tied embeddings this adds into the embedding grad.
    std::vector<double> dxn(T * D), dx(T * D);
    linear_backward(dlogits.data(), a.xn_final.data(), lm_head(cfg, lay, params), dxn.data(),
                    lm_head(cfg, lay, grads), T, D, V);
    rmsnorm_backward(dxn.data(), a.x_final.data(), params + lay.find(P_FINAL_NORM).offset,
                     a.rstd_final.data(), dx.data(), grads + lay.find(P_FINAL_NORM).offset, T, D);

    for (int l = cfg.n_layers - 1; l >= 0; l--)
        layer_backward(cfg, layer_tensors(lay, cfg, params, l), layer_tensors(lay, cfg, grads, l), B, S,
                       a.inv_freq, docs, a.layers[l], dx);

    // Embedding lookup: scatter-add (a token used twice collects both gradients).
    double* gembed = grads + lay.find(P_EMBED).offset;
    for (int64_t t = 0; t < T; t++)
        for (int i = 0; i < D; i++) gembed[(int64_t)tokens[t] * D + i] += dx[t * D + i];

    if (logits_out) *logits_out = a.logits;
    return loss;
}

double model_loss(const LlamaConfig& cfg, const double* params, const int32_t* tokens,
                  const int32_t* targets, int B, int64_t S, const Documents* docs) {
    const ParamLayout lay = param_layout(cfg);
    ModelActs a;
    model_forward(cfg, lay, params, tokens, B, S, docs, a);
    return cross_entropy(a.logits.data(), targets, nullptr, a.T, cfg.vocab);
}

// ---------------------------------------------------------------------------------------------
// AdamW, in the order of torch.optim.AdamW's single-tensor path.

void adamw_step(double* p, const double* g, double* m, double* v, int64_t n, double lr,
                double beta1, double beta2, double eps, double weight_decay, bool decay,
                int step, double grad_scale) {
    if (step < 1) throw std::invalid_argument("adamw_step: step counts from 1");
    const double bias1 = 1.0 - std::pow(beta1, step);
    const double bias2 = 1.0 - std::pow(beta2, step);
    const double step_size = lr / bias1;
    for (int64_t i = 0; i < n; i++) {
        const double grad = g[i] * grad_scale;
        if (decay) p[i] *= 1.0 - lr * weight_decay;
        m[i] = beta1 * m[i] + (1.0 - beta1) * grad;
        v[i] = beta2 * v[i] + (1.0 - beta2) * grad * grad;
        const double denom = std::sqrt(v[i]) / std::sqrt(bias2) + eps;
        p[i] -= step_size * m[i] / denom;
    }
}

}  // namespace ref
