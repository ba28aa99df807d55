// tests/test_main.cpp - the main() of every test binary. Besides GoogleTest's own report it prints
// one machine-readable line, "TESTCOUNTS passed=P failed=F skipped=S", which tests/run_tests.sh
// sums over all binaries into the final "N passed, N failed, N skipped" line of `make test`.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdio>

bool gpu_available() {
    static int cached = -1;
    if (cached < 0) {
        int n = 0;
        cached = (cudaGetDeviceCount(&n) == cudaSuccess && n > 0) ? 1 : 0;
        cudaGetLastError();  // clear the error a driverless machine leaves behind
    }
    return cached == 1;
}

int main(int argc, char** argv) {
    ::testing::InitGoogleTest(&argc, argv);
    int rc = RUN_ALL_TESTS();
    const auto* ut = ::testing::UnitTest::GetInstance();
    int skipped = ut->skipped_test_count();
    int failed = ut->failed_test_count();
    int passed = ut->successful_test_count();  // gtest counts skipped as neither
    std::printf("TESTCOUNTS passed=%d failed=%d skipped=%d\n", passed, failed, skipped);
    return rc;
}
