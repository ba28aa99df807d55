// tests/fuzz/fuzz_index.cpp - fuzz target: index_shards, the reader of
// model.safetensors.index.json. Oracle: a valid index is a JSON object with a non-empty
// weight_map object whose every value is a plain file name (no '/', no NUL, not "." or ".."),
// and the shards read are those names, each once, in the order first named.
#include <cstdint>
#include <set>

#include "io/input_files.h"
#include "oracle.h"

namespace {

// "" when valid; the shards the index names, each once, in *shards.
std::string verdict(const OJson& j, std::vector<std::string>* shards) {
    const OJson* map = j.get("weight_map");
    if (j.kind != OJson::Object || !map || map->kind != OJson::Object || map->order.empty())
        return "no weight_map of tensors";
    std::set<std::string> seen;
    for (const std::string& key : map->order) {
        const OJson& v = *map->get(key);
        if (v.kind != OJson::String || v.s.empty() || v.s == "." || v.s == ".." ||
            v.s.find_first_of(std::string("/\0", 2)) != std::string::npos)
            return "a weight_map value that is not a plain file name";
        if (seen.insert(v.s).second) shards->push_back(v.s);
    }
    return "";
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string name = "model.safetensors.index.json";
    const std::string_view text((const char*)data, size);
    OJson j;
    const bool json = OracleJson::read(text, &j);
    std::vector<std::string> want, got;
    const std::string why = json ? verdict(j, &want) : "not JSON";
    try {
        got = index_shards(text, name);
    } catch (const Fatal& f) {
        judge_refusal(f, name, why, json);
        return 0;
    }
    judge_acceptance(why);
    if (got != want) oracle_fail("shards other than the weight_map's names, each once, in order");
    return 0;
}
