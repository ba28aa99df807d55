// tests/fuzz/fuzz_tokens.cpp - fuzz target: check_token_file, the reader of --data's token files.
// Oracle: an accepted file has the LLTOKENS header (version 1, 4-byte tokens), holds at least
// the tokens it counts, and every one of them is in the vocabulary.
#include <cstdint>
#include <cstring>

#include "input_files.h"
#include "oracle.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const int vocab = 512;
    const std::string name = "fuzz.tokens";
    uint64_t count = 0;
    try {
        count = check_token_file(data, size, vocab, name);
    } catch (const Fatal& f) {
        check_refusal(f, name);
        return 0;
    }
    if (size < 24 || memcmp(data, "LLTOKENS\x01\0\0\0\x04\0\0\0", 16) != 0) oracle_fail("accepted without a valid header");
    uint64_t header_count;
    memcpy(&header_count, data + 16, 8);
    if (count != header_count) oracle_fail("a count other than the header's");
    if (count > (size - 24) / 4) oracle_fail("accepted more tokens than the file holds");
    for (uint64_t i = 0; i < count; i++) {
        uint32_t t;
        memcpy(&t, data + 24 + 4 * i, 4);
        if (t >= (uint32_t)vocab) oracle_fail("accepted token " + std::to_string(t) + " at " + std::to_string(i));
    }
    return 0;
}
