// tests/test_hf.cpp - runs tests/hf_parity.py (parity with Hugging Face transformers) where a GPU,
// PyTorch and transformers are present, and skips cleanly elsewhere.
#include <cstdio>
#include <fstream>
#include <string>

#include "test_util.h"

TEST(HuggingFace, ParityWithTransformers) {
    REQUIRE_GPU();
    if (!std::ifstream("./train").good()) GTEST_SKIP() << "./train not built";
    if (system("python3 -c 'import torch, transformers' > /dev/null 2>&1") != 0)
        GTEST_SKIP() << "python3 with torch and transformers not installed";
    FILE* p = popen("python3 tests/hf_parity.py 2>&1", "r");
    std::string out;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    int st = pclose(p);
    printf("%s", out.c_str());
    EXPECT_EQ(st, 0) << out;
    EXPECT_NE(out.find("PASSED"), std::string::npos) << out;
}
