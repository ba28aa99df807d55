// tests/fuzz/fuzz_safetensors.cpp - fuzz target: parse_safetensors, the reader of a safetensors
// file's header. Oracle: an accepted file has a header length within the file and the format's
// 100 MB, a header that is a JSON object, __metadata__ (if any) mapping strings to strings, and
// for every other key a tensor of dtype F32, BF16 or F16, whose shape and data_offsets are lists
// of non-negative integers, whose bytes are its elements times the dtype's size, and which,
// together, fill the data buffer exactly: sorted, each begins where the one before ends, the
// first at 0, the last at the buffer's end. The reader must return exactly those tensors.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "input_files.h"
#include "oracle.h"

namespace {

std::vector<int64_t> integers(const OJson* v, const char* what) {
    if (!v || v->kind != OJson::Array) oracle_fail(std::string("accepted a tensor without a list ") + what);
    std::vector<int64_t> out;
    for (const OJson& e : v->items) {
        if (!e.is_integer() || e.integer() < 0) oracle_fail(std::string("accepted a bad number in ") + what);
        out.push_back(e.integer());
    }
    return out;
}

// The tensor the oracle reads from one header entry.
StEntry oracle_entry(const std::string& key, const OJson& t) {
    if (t.kind != OJson::Object) oracle_fail("accepted a tensor that is not an object");
    const OJson* dtype = t.get("dtype");
    if (!dtype || dtype->kind != OJson::String) oracle_fail("accepted a tensor without a dtype");
    const int size = dtype->s == "F32" ? 4 : dtype->s == "BF16" || dtype->s == "F16" ? 2 : 0;
    if (size == 0) oracle_fail("accepted dtype " + dtype->s);
    StEntry e;
    e.name = key, e.dtype = dtype->s, e.shape = integers(t.get("shape"), "shape");
    const std::vector<int64_t> off = integers(t.get("data_offsets"), "data_offsets");
    if (off.size() != 2 || off[0] > off[1]) oracle_fail("accepted data_offsets that are not [begin, end]");
    e.begin = (uint64_t)off[0], e.end = (uint64_t)off[1];
    // Elements times size, in 128 bits; once past 2^64 it cannot match, unless a dimension is 0.
    unsigned __int128 bytes = (unsigned)size;
    for (int64_t d : e.shape) bytes = bytes >> 64 ? bytes : bytes * (uint64_t)d;
    if (std::count(e.shape.begin(), e.shape.end(), 0)) bytes = 0;
    if (bytes != e.end - e.begin) oracle_fail("accepted tensor " + key + " whose bytes do not match its shape");
    return e;
}

void check_tiles(std::vector<StEntry> tensors, uint64_t buffer) {
    std::sort(tensors.begin(), tensors.end(),
              [](const StEntry& a, const StEntry& b) { return a.begin < b.begin || (a.begin == b.begin && a.end < b.end); });
    uint64_t at = 0;
    for (const StEntry& e : tensors) {
        if (e.begin != at) oracle_fail("accepted tensors that overlap or leave a hole");
        at = e.end;
    }
    if (at != buffer) oracle_fail("accepted a data buffer with bytes after the last tensor");
}

bool same(const StEntry& a, const StEntry& b) {
    return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.begin == b.begin && a.end == b.end;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string name = "fuzz.safetensors";
    uint64_t hlen = 0;
    if (size >= 8) memcpy(&hlen, data, 8);
    const bool sized = size >= 8 && hlen <= size - 8 && hlen <= 100'000'000;
    OJson h;
    const bool json = sized && OracleJson::read(std::string_view((const char*)data + 8, hlen), &h);
    StHeader got;
    try {
        got = parse_safetensors(data, size, name);
    } catch (const Fatal& f) {
        check_refusal(f, name);
        if (json && is_json_refusal(f, name)) oracle_fail(std::string("valid JSON called malformed: ") + f.what());
        return 0;
    }
    if (!json || h.kind != OJson::Object) oracle_fail("accepted a header that is not a JSON object within the file");
    std::vector<StEntry> want;
    for (const std::string& key : h.order) {
        const OJson& v = *h.get(key);
        if (key != "__metadata__") {
            want.push_back(oracle_entry(key, v));
            continue;
        }
        if (v.kind != OJson::Object) oracle_fail("accepted __metadata__ that is not an object");
        for (auto& m : v.members)
            if (m.second.kind != OJson::String) oracle_fail("accepted __metadata__ with a value that is not a string");
    }
    check_tiles(want, size - 8 - hlen);
    if (got.data_start != 8 + hlen) oracle_fail("the data buffer put elsewhere than after the header");
    if (got.tensors.size() != want.size() || !std::equal(want.begin(), want.end(), got.tensors.begin(), same))
        oracle_fail("tensors other than the header's");
    return 0;
}
