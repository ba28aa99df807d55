// tests/fuzz/fuzz_config.cpp - fuzz target: check_hf_config, the check of a config.json against
// --config tiny. Oracle: a valid file is a JSON object of the Llama family (model_type "llama";
// architectures, where given, LlamaForCausalLM) in which every field the check relies on,
// where present, has transformers' type and our value, and where missing (or null, for the two
// fields transformers derives), has transformers' default equal to ours; the RoPE settings, in
// rope_theta, rope_scaling or rope_parameters, are ours wherever they are given, and each is
// given somewhere (rope_theta's default, 10000, is not ours).
#include <cstdint>

#include "io/input_files.h"
#include "oracle.h"

namespace {

const LlamaConfig kTiny = config_by_name("tiny");

bool close(double a, double b) { return std::fabs(a - b) <= 1e-9 * std::max(1.0, std::fabs(b)); }

// An integer field: given as an integer equal to ours, or missing (null where null_ok) with a
// default equal to ours.
std::string integer(const OJson& j, const std::string& key, int64_t want, int64_t dflt, bool null_ok) {
    const OJson* v = j.get(key);
    if (!v || (null_ok && v->kind == OJson::Null)) return dflt == want ? "" : "a missing " + key;
    return v->is_integer() && v->integer() == want ? "" : key + " not our integer";
}

// The integers. kTiny differs from every default but the two that follow from other fields.
std::string shape(const OJson& j) {
    std::string why = integer(j, "vocab_size", kTiny.vocab, 32000, false);
    why += integer(j, "hidden_size", kTiny.dim, 4096, false);
    why += integer(j, "intermediate_size", kTiny.ffn_dim, 11008, false);
    why += integer(j, "num_hidden_layers", kTiny.n_layers, 32, false);
    why += integer(j, "num_attention_heads", kTiny.n_heads, 32, false);
    why += integer(j, "num_key_value_heads", kTiny.n_kv_heads, kTiny.n_heads, true);
    return why + integer(j, "head_dim", kTiny.head_dim, kTiny.dim / kTiny.n_heads, true);
}

// The family: model_type "llama", and architectures (where given, not null) a non-empty array
// of "LlamaForCausalLM" only.
std::string family(const OJson& j) {
    const OJson* type = j.get("model_type");
    if (!type || type->kind != OJson::String || type->s != "llama") return "model_type not llama";
    const OJson* arch = j.get("architectures");
    if (!arch || arch->kind == OJson::Null) return "";
    if (arch->kind != OJson::Array || arch->items.empty()) return "architectures not Llama's";
    for (const OJson& a : arch->items)
        if (a.kind != OJson::String || a.s != "LlamaForCausalLM") return "architectures not Llama's";
    return "";
}

std::string flags(const OJson& j) {
    const OJson* eps = j.get("rms_norm_eps");
    if (!eps || eps->kind != OJson::Number || !close(eps->number(), kTiny.norm_eps)) return "rms_norm_eps not ours";
    const OJson* tied = j.get("tie_word_embeddings");
    if (!tied || tied->kind != OJson::Bool || !tied->b) return "tie_word_embeddings not true";
    for (const char* key : {"attention_bias", "mlp_bias"}) {
        const OJson* v = j.get(key);
        if (v && (v->kind != OJson::Bool || v->b)) return std::string(key) + " not false";
    }
    const OJson* act = j.get("hidden_act");
    if (act && (act->kind != OJson::String || (act->s != "silu" && act->s != "swish"))) return "hidden_act not SiLU";
    return "";
}

// Every place a RoPE setting may be given (null: not given there); "" in *why, or what is wrong.
std::vector<const OJson*> rope_values(const OJson& j, const std::string& key, std::string* why) {
    std::vector<const OJson*> out;
    if (key == "rope_theta") out.push_back(j.get(key));
    for (const char* place : {"rope_scaling", "rope_parameters"}) {
        const OJson* o = j.get(place);
        if (o && o->kind != OJson::Null && o->kind != OJson::Object) *why = std::string(place) + " not an object";
        if (!o || o->kind != OJson::Object) continue;
        const OJson* v = o->get(key);
        if (!v && key == "rope_type") v = o->get("type");
        out.push_back(v);
    }
    return out;
}

// Each RoPE setting: ours (a number within 1e-9, or the type "llama3") wherever it is given,
// and given somewhere.
std::string rope(const OJson& j) {
    const RopeScaling& s = kTiny.rope_scaling;
    const std::pair<std::string, double> settings[] = {
        {"rope_theta", kTiny.rope_theta}, {"factor", s.factor}, {"low_freq_factor", s.low_freq_factor},
        {"high_freq_factor", s.high_freq_factor}, {"original_max_position_embeddings", s.original_max_pos},
        {"rope_type", 0}};
    std::string why;
    for (const auto& [key, want] : settings) {
        int given = 0;
        for (const OJson* v : rope_values(j, key, &why)) {
            if (!v || v->kind == OJson::Null) continue;
            const bool ours = key == "rope_type" ? v->kind == OJson::String && v->s == "llama3"
                                                 : v->kind == OJson::Number && close(v->number(), want);
            if (!ours) why += key + " not ours; ";
            given++;
        }
        if (!given) why += "a missing " + key + "; ";
    }
    return why;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string name = "config.json";
    const std::string text((const char*)data, size);
    OJson j;
    const bool json = OracleJson::read(text, &j);
    const std::string why = !json                      ? "not JSON"
                            : j.kind != OJson::Object ? "not an object"
                                                      : family(j) + shape(j) + flags(j) + rope(j);
    try {
        check_hf_config(kTiny, text, name);
    } catch (const Fatal& f) {
        judge_refusal(f, name, why, json);
        return 0;
    }
    judge_acceptance(why);
    return 0;
}
