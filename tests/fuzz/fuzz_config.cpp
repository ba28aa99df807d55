// tests/fuzz/fuzz_config.cpp - fuzz target: check_hf_config, the check of a config.json against
// --config tiny. Oracle: an accepted file is a JSON object in which every field the check relies
// on, where present, has transformers' type and our value, and where missing, has transformers'
// default equal to ours; the RoPE settings, in rope_theta, rope_scaling or rope_parameters, are
// all ours wherever they are given, and each is given somewhere (rope_theta may default).
#include <cstdint>

#include "input_files.h"
#include "oracle.h"

namespace {

const LlamaConfig kTiny = config_by_name("tiny");

bool close(double a, double b) { return std::fabs(a - b) <= 1e-9 * std::max(1.0, std::fabs(b)); }

// An integer field: given as an integer equal to ours, or missing (null where null_ok) with a
// default equal to ours (dflt < 0: no default known; then it must be given).
void check_int(const OJson& j, const char* key, int64_t want, int64_t dflt, bool null_ok) {
    const OJson* v = j.get(key);
    if (!v || (null_ok && v->kind == OJson::Null)) {
        if (dflt != want) oracle_fail(std::string("accepted a missing ") + key + " whose default is not ours");
    } else if (!v->is_integer() || v->integer() != want) {
        oracle_fail(std::string("accepted ") + key + " = " + v->text + " (not our integer)");
    }
}

// The integers, with transformers' defaults: kTiny's values differ from every default but the
// ones that follow from other fields, which must then be given and ours.
void check_shape(const OJson& j) {
    check_int(j, "vocab_size", kTiny.vocab, 32000, false);
    check_int(j, "hidden_size", kTiny.dim, 4096, false);
    check_int(j, "intermediate_size", kTiny.ffn_dim, 11008, false);
    check_int(j, "num_hidden_layers", kTiny.n_layers, 32, false);
    check_int(j, "num_attention_heads", kTiny.n_heads, 32, false);
    check_int(j, "num_key_value_heads", kTiny.n_kv_heads, kTiny.n_heads, true);
    check_int(j, "head_dim", kTiny.head_dim, kTiny.dim / kTiny.n_heads, true);
}

void check_flags(const OJson& j) {
    const OJson* eps = j.get("rms_norm_eps");
    if (!eps || eps->kind != OJson::Number || !close(eps->number(), kTiny.norm_eps)) oracle_fail("accepted rms_norm_eps");
    const OJson* tied = j.get("tie_word_embeddings");
    if (!tied || tied->kind != OJson::Bool || !tied->b) oracle_fail("accepted tie_word_embeddings (ours: true)");
    for (const char* key : {"attention_bias", "mlp_bias"}) {
        const OJson* v = j.get(key);
        if (v && (v->kind != OJson::Bool || v->b)) oracle_fail(std::string("accepted ") + key);
    }
    const OJson* act = j.get("hidden_act");
    if (act && (act->kind != OJson::String || (act->s != "silu" && act->s != "swish"))) oracle_fail("accepted hidden_act");
}

// Every place a RoPE setting may be given (null: not given).
std::vector<const OJson*> rope_values(const OJson& j, const std::string& key) {
    std::vector<const OJson*> out;
    if (key == "rope_theta") out.push_back(j.get(key));
    for (const char* place : {"rope_scaling", "rope_parameters"}) {
        const OJson* o = j.get(place);
        if (o && o->kind != OJson::Null && o->kind != OJson::Object) oracle_fail(std::string("accepted ") + place);
        if (!o || o->kind != OJson::Object) continue;
        const OJson* v = o->get(key);
        if (!v && key == "rope_type") v = o->get("type");
        out.push_back(v);
    }
    return out;
}

void check_rope(const OJson& j) {
    const RopeScaling& s = kTiny.rope_scaling;
    const std::pair<const char*, double> numbers[] = {{"rope_theta", kTiny.rope_theta},
                                                      {"factor", s.factor},
                                                      {"low_freq_factor", s.low_freq_factor},
                                                      {"high_freq_factor", s.high_freq_factor},
                                                      {"original_max_position_embeddings", s.original_max_pos}};
    for (const auto& [key, want] : numbers) {
        int given = 0;
        for (const OJson* v : rope_values(j, key)) {
            if (!v || v->kind == OJson::Null) continue;
            if (v->kind != OJson::Number || !close(v->number(), want)) oracle_fail(std::string("accepted ") + key);
            given++;
        }
        if (!given) oracle_fail(std::string("accepted a missing ") + key);  // theta's default 10000 is not ours
    }
    int typed = 0;
    for (const OJson* v : rope_values(j, "rope_type")) {
        if (!v || v->kind == OJson::Null) continue;
        if (v->kind != OJson::String || v->s != "llama3") oracle_fail("accepted a rope type other than llama3");
        typed++;
    }
    if (!typed) oracle_fail("accepted a config without llama3 scaling");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string name = "config.json";
    const std::string text((const char*)data, size);
    OJson j;
    const bool json = OracleJson::read(text, &j);
    try {
        check_hf_config(kTiny, text, name);
    } catch (const Fatal& f) {
        check_refusal(f, name);
        if (json && is_json_refusal(f, name)) oracle_fail(std::string("valid JSON called malformed: ") + f.what());
        return 0;
    }
    if (!json || j.kind != OJson::Object) oracle_fail("accepted text that is not a JSON object");
    check_shape(j);
    check_flags(j);
    check_rope(j);
    return 0;
}
