// tests/fuzz/fuzz_safetensors.cpp - fuzz target: parse_safetensors, the reader of a safetensors
// file's header. Oracle: a valid file has a header length within the file and the format's
// 100 MB, a header that is a JSON object, __metadata__ (if any) mapping strings to strings, and
// for every other key a tensor of dtype F32, BF16 or F16, whose shape (at most 64 dimensions)
// and data_offsets are lists of non-negative integers, whose bytes are its elements times the
// dtype's size, and which, together, fill the data buffer exactly: sorted, each begins where
// the one before ends, the first at 0, the last at the buffer's end. The reader must return
// exactly those tensors.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "io/input_files.h"
#include "oracle.h"

namespace {

// Whether v is a list of non-negative integers (appended to *out).
bool integers(const OJson* v, std::vector<int64_t>* out) {
    if (!v || v->kind != OJson::Array) return false;
    for (const OJson& e : v->items) {
        if (!e.is_integer() || e.integer() < 0) return false;
        out->push_back(e.integer());
    }
    return true;
}

// One header entry: "" when it is a valid tensor, read into *e.
std::string tensor(const std::string& key, const OJson& t, StEntry* e) {
    const OJson* dtype = t.get("dtype");
    if (t.kind != OJson::Object || !dtype || dtype->kind != OJson::String) return key + " without a dtype";
    const int size = dtype->s == "F32" ? 4 : dtype->s == "BF16" || dtype->s == "F16" ? 2 : 0;
    if (size == 0) return key + " of dtype " + dtype->s;
    std::vector<int64_t> off;
    e->name = key, e->dtype = dtype->s;
    if (!integers(t.get("shape"), &e->shape) || e->shape.size() > 64) return key + " without a shape";
    if (!integers(t.get("data_offsets"), &off) || off.size() != 2 || off[0] > off[1]) return key + " without offsets";
    e->begin = (uint64_t)off[0], e->end = (uint64_t)off[1];
    // Elements times size, in 128 bits; once past 2^64 it cannot match, unless a dimension is 0.
    unsigned __int128 bytes = (unsigned)size;
    for (int64_t d : e->shape) bytes = bytes >> 64 ? bytes : bytes * (uint64_t)d;
    if (std::count(e->shape.begin(), e->shape.end(), 0)) bytes = 0;
    if (bytes != e->end - e->begin) return key + " whose bytes do not match its shape";
    return "";
}

std::string tiles(std::vector<StEntry> tensors, uint64_t buffer) {
    std::sort(tensors.begin(), tensors.end(), [](const StEntry& a, const StEntry& b) {
        return a.begin < b.begin || (a.begin == b.begin && a.end < b.end);
    });
    uint64_t at = 0;
    for (const StEntry& e : tensors) {
        if (e.begin != at) return "tensors that overlap or leave a hole";
        at = e.end;
    }
    return at == buffer ? "" : "bytes after the last tensor";
}

// "" when the header h is valid for a data buffer of `buffer` bytes; its tensors in *want.
std::string verdict(const OJson& h, uint64_t buffer, std::vector<StEntry>* want) {
    if (h.kind != OJson::Object) return "a header that is not an object";
    for (const std::string& key : h.order) {
        const OJson& v = *h.get(key);
        if (key == "__metadata__") {
            if (v.kind != OJson::Object) return "__metadata__ that is not an object";
            for (auto& m : v.members)
                if (m.second.kind != OJson::String) return "__metadata__ with a value that is not a string";
            continue;
        }
        want->emplace_back();
        const std::string why = tensor(key, v, &want->back());
        if (!why.empty()) return why;
    }
    return tiles(*want, buffer);
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
    std::vector<StEntry> want;
    const std::string why = !sized ? "a header length past the file" : !json ? "a header that is not JSON"
                                                                        : verdict(h, size - 8 - hlen, &want);
    StHeader got;
    try {
        got = parse_safetensors(data, size, name);
    } catch (const Fatal& f) {
        judge_refusal(f, name, why, json);
        return 0;
    }
    judge_acceptance(why);
    if (got.data_start != 8 + hlen) oracle_fail("the data buffer put elsewhere than after the header");
    if (got.tensors.size() != want.size() || !std::equal(want.begin(), want.end(), got.tensors.begin(), same))
        oracle_fail("tensors other than the header's");
    return 0;
}
