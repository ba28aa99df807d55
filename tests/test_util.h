// tests/test_util.h - helpers shared by the test suites: GPU detection, random inputs, error norms.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <string>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <random>
#include <vector>

// True when a CUDA device can be used. Defined in tests/test_main.cpp (no CUDA headers here).
bool gpu_available();

// Skip the current test cleanly on a machine without a GPU (CI has none).
#define REQUIRE_GPU()                                              \
    do {                                                           \
        if (!gpu_available()) GTEST_SKIP() << "no CUDA GPU";       \
    } while (0)

// ||a - b|| / ||b||, NaN if any value of a is not finite (so NaN never passes).
inline double rel_error(const std::vector<double>& a, const std::vector<double>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); i++) {
        if (!std::isfinite(a[i])) return NAN;
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    return std::sqrt(num) / std::sqrt(den > 0 ? den : 1e-300);
}

// rel_error, except where the reference is zero up to float64 rounding (an identity makes it so,
// e.g. dq of a single-token sequence): then the root-mean-square of a, against `scale`, which
// should be the size of the values a is made from.
inline double rel_error_or_abs(const std::vector<double>& a, const std::vector<double>& b, double scale) {
    double den = 0, num = 0;
    for (double x : b) den += x * x;
    if (std::sqrt(den / (b.empty() ? 1 : b.size())) > 1e-12 * scale) return rel_error(a, b);
    for (double x : a) {
        if (!std::isfinite(x)) return NAN;
        num += x * x;
    }
    return std::sqrt(num / (a.empty() ? 1 : a.size())) / scale;
}

// Fresh random inputs every run: the seed comes from std::random_device and is printed on failure.
inline uint64_t fresh_seed() {
    std::random_device rd;
    return ((uint64_t)rd() << 32) ^ rd();
}

inline std::vector<double> random_normal(int64_t n, std::mt19937_64& rng, double stddev = 1.0) {
    std::normal_distribution<double> dist(0.0, stddev);
    std::vector<double> v(n);
    for (auto& x : v) x = dist(rng);
    return v;
}

// Run a shell command; its exit code and everything it printed (stdout and stderr).
struct CommandResult {
    int code;
    std::string output;
};
inline CommandResult run_command(const std::string& cmd) {
    FILE* p = popen((cmd + " 2>&1").c_str(), "r");
    std::string out;
    char buf[4096];
    size_t n;
    while (p && (n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    int st = p ? pclose(p) : -1;
    return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

// A version-2 token file of n tokens (ids below 256) in documents of doc tokens.
inline std::string write_documents_file(const std::string& path, int64_t n, int64_t doc) {
    std::ofstream f(path, std::ios::binary);
    const uint32_t version = 2, width = 4;
    const uint64_t count = n, docs = (n + doc - 1) / doc;
    f.write("LLTOKENS", 8), f.write((const char*)&version, 4), f.write((const char*)&width, 4);
    f.write((const char*)&count, 8), f.write((const char*)&docs, 8);
    for (int64_t i = 0; i < n; i++) {
        const uint32_t t = (uint32_t)((i * 2654435761u) >> 7) % 256;
        f.write((const char*)&t, 4);
    }
    for (uint64_t d = 0; d < docs; d++) {
        const uint64_t start = d * doc;
        f.write((const char*)&start, 8);
    }
    return path;
}
