// tests/fuzz/fuzz_index.cpp - fuzz target: index_shards, the reader of
// model.safetensors.index.json. Oracle: an accepted index is JSON with a non-empty weight_map
// object whose every value is a plain file name (no '/', no NUL, not "." or ".."), and the
// shards returned are those names, each once, in the order first named.
#include <cstdint>
#include <set>

#include "input_files.h"
#include "oracle.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string name = "model.safetensors.index.json";
    const std::string_view text((const char*)data, size);
    OJson j;
    const bool json = OracleJson::read(text, &j);
    std::vector<std::string> shards;
    try {
        shards = index_shards(text, name);
    } catch (const Fatal& f) {
        check_refusal(f, name);
        if (json && is_json_refusal(f, name)) oracle_fail(std::string("valid JSON called malformed: ") + f.what());
        return 0;
    }
    if (!json) oracle_fail("accepted text that is not JSON");
    const OJson* map = j.get("weight_map");
    if (j.kind != OJson::Object || !map || map->kind != OJson::Object || map->order.empty())
        oracle_fail("accepted an index without a weight_map of tensors");
    std::vector<std::string> want;
    std::set<std::string> seen;
    for (const std::string& key : map->order) {
        const OJson& v = *map->get(key);
        if (v.kind != OJson::String || v.s.empty() || v.s == "." || v.s == ".." ||
            v.s.find_first_of(std::string("/\0", 2)) != std::string::npos)
            oracle_fail("accepted a weight_map value that is not a plain file name");
        if (seen.insert(v.s).second) want.push_back(v.s);
    }
    if (shards != want) oracle_fail("shards other than the weight_map's names, each once, in order");
    return 0;
}
