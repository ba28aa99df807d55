// tests/fuzz/fuzz_tokens.cpp - fuzz target: check_token_file, the reader of --data's token files.
// Oracle: a valid file has the LLTOKENS header (version 1, 4-byte tokens), holds at least the
// tokens it counts, and every one of them is in the vocabulary; the count read is the header's.
#include <cstdint>
#include <cstring>

#include "io/input_files.h"
#include "oracle.h"

namespace {

const int kVocab = 512;

std::string verdict(const uint8_t* data, size_t size) {
    if (size < 24 || memcmp(data, "LLTOKENS\x01\0\0\0\x04\0\0\0", 16) != 0) return "no valid header";
    uint64_t count;
    memcpy(&count, data + 16, 8);
    if (count > (size - 24) / 4) return "fewer tokens than counted";
    for (uint64_t i = 0; i < count; i++) {
        uint32_t t;
        memcpy(&t, data + 24 + 4 * i, 4);
        if (t >= (uint32_t)kVocab) return "token " + std::to_string(t) + " at " + std::to_string(i);
    }
    return "";
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string name = "fuzz.tokens";
    const std::string why = verdict(data, size);
    uint64_t count = 0;
    try {
        count = check_token_file(data, size, kVocab, name);
    } catch (const Fatal& f) {
        judge_refusal(f, name, why, false);
        return 0;
    }
    judge_acceptance(why);
    if (memcmp(&count, data + 16, 8) != 0) oracle_fail("a count other than the header's");
    return 0;
}
