// tests/fuzz/fuzz_tokens.cpp - fuzz target: check_token_file, the reader of --data's token files.
// Oracle, written apart from the reader: a valid file has the LLTOKENS header (version 1 or 2,
// 4-byte tokens), is exactly as long as its header says (24 + 4 N bytes, or 32 + 4 N + 8 M),
// every token is in the vocabulary, and (version 2) its M document starts ascend from 0 and stay
// below N, with M = 0 exactly when N = 0. The counts read are the header's.
#include <cstdint>
#include <cstring>

#include "io/input_files.h"
#include "oracle.h"

namespace {

const int kVocab = 512;

uint64_t u64(const uint8_t* p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

std::string verdict(const uint8_t* data, size_t size) {
    if (size < 16 || memcmp(data, "LLTOKENS", 8) != 0) return "no valid header";
    uint32_t version, width;
    memcpy(&version, data + 8, 4), memcpy(&width, data + 12, 4);
    if ((version != 1 && version != 2) || width != 4) return "version or width";
    const size_t header = version == 1 ? 24 : 32;
    if (size < header) return "short header";
    const uint64_t n = u64(data + 16), m = version == 2 ? u64(data + 24) : 0;
    // Sizes compared in 128 bits: a header's counts may be anything.
    const unsigned __int128 want = (unsigned __int128)header + (unsigned __int128)n * 4 + (unsigned __int128)m * 8;
    if (want != size) return "size other than the header's";
    for (uint64_t i = 0; i < n; i++) {
        uint32_t t;
        memcpy(&t, data + header + 4 * i, 4);
        if (t >= (uint32_t)kVocab) return "token " + std::to_string(t) + " at " + std::to_string(i);
    }
    if (version == 2 && (m == 0) != (n == 0)) return "tokens without documents, or documents without tokens";
    for (uint64_t d = 0; d < m; d++) {
        const uint64_t start = u64(data + header + 4 * n + 8 * d);
        if (d == 0 ? start != 0 : start <= u64(data + header + 4 * n + 8 * (d - 1))) return "starts do not ascend from 0";
        if (start >= n) return "a start past the last token";
    }
    return "";
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string name = "fuzz.tokens";
    const std::string why = verdict(data, size);
    TokenFileContents c;
    try {
        c = check_token_file(data, size, kVocab, name);
    } catch (const Fatal& f) {
        judge_refusal(f, name, why, false);
        return 0;
    }
    judge_acceptance(why);
    if (c.count != u64(data + 16)) oracle_fail("a count other than the header's");
    if (c.version == 2 && c.docs != u64(data + 24)) oracle_fail("a document count other than the header's");
    return 0;
}
