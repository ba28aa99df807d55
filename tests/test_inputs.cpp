// tests/test_inputs.cpp - the readers of input files (io/json.h, io/input_files.h) against hostile
// inputs, on the CPU: each must end in a usage error (exit code 2) that names the file and what
// is wrong, in bounded time and memory, and valid inputs must still load exactly as before.
//   * the JSON reader: strict RFC 8259, limited nesting, no duplicate keys, linear cost;
//   * special files (FIFOs, devices, directories, dangling or looping links) refused unopened;
//   * safetensors: integers where integers belong, offsets that tile the data buffer;
//   * config.json: transformers' types and defaults, hidden_act and the bias flags;
//   * the index: plain file names, many of them, and the index file given directly;
//   * empty --data and --init-from paths.
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <regex>

#include "../io/input_files.h"
#include "../io/json.h"
#include "../llama.h"
#include "../infra/train.h"
#include "files_util.h"
#include "test_util.h"

namespace {

// Refused with exit code 2 and a message holding every needle.
void expect_usage_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
    std::string msg;
    EXPECT_EQ(fatal_code(fn, &msg), EXIT_USAGE) << msg;
    for (const std::string& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
}

void write_file(const std::string& path, const std::string& bytes) {
    std::ofstream(path, std::ios::binary) << bytes;
}

std::string nested(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

// A safetensors file: the 8-byte length (hlen, or the header's own), the header, `data` zero bytes.
std::string safetensors(const std::string& header, size_t data, int64_t hlen = -1) {
    uint64_t n = hlen < 0 ? header.size() : (uint64_t)hlen;
    std::string out((const char*)&n, 8);
    return out + header + std::string(data, '\0');
}

StHeader parse(const std::string& file) {
    return parse_safetensors((const uint8_t*)file.data(), file.size(), "x.safetensors");
}

// A config.json as hf_config_json writes it, one field a line, with one field's value replaced
// ("" removes the field).
std::string with_field(const std::string& text, const std::string& key, const std::string& value) {
    const std::regex line("  \"" + key + "\": [^\n]*\n");
    EXPECT_TRUE(std::regex_search(text, line)) << key;
    return std::regex_replace(text, line, value.empty() ? "" : "  \"" + key + "\": " + value + ",\n");
}
std::string config_with_field(const LlamaConfig& c, const std::string& key, const std::string& value) {
    return with_field(hf_config_json(c, false), key, value);
}

void expect_config_refused(const LlamaConfig& c, const std::string& text, const std::vector<std::string>& needles) {
    SCOPED_TRACE(text);
    expect_usage_error([&] { check_hf_config(c, text, "config.json"); }, needles);
}

void expect_config_accepted(const LlamaConfig& c, const std::string& text) {
    std::string msg;
    EXPECT_EQ(fatal_code([&] { check_hf_config(c, text, "config.json"); }, &msg), -1) << msg << "\n" << text;
}

// ---------------------------------------------------------------------------------------------
// The JSON reader
TEST(Json, ReadsWhatRfc8259Allows) {
    JsonDoc doc(" {\"a\": [0, -0, 12, -7, 1.5e3, 2E-2, 9223372036854775807, 9223372036854775808, true, false, null],\n"
                "\t\"s\": \"q\\\" \\\\ \\/ \\b\\f\\n\\r\\t \\u00e9 \\ud83d\\ude00 caf\xc3\xa9\", \"\": {}, \"e\": []}\r\n",
                "t.json");
    const JsonValue root = doc.root();
    ASSERT_TRUE(root.is(JsonKind::Object));
    EXPECT_EQ(root.size(), 4u);
    std::vector<std::string> shown;
    for (const JsonValue& v : root.get("a")->elements()) shown.push_back(json_shown(v) + (v.is_integer() ? "i" : ""));
    EXPECT_EQ(shown, (std::vector<std::string>{"0i", "0i", "12i", "-7i", "1500", "0.02", "9223372036854775807i",
                                               "9.223372037e+18", "true", "false", "null"}));
    EXPECT_EQ(root.get("s")->string(), "q\" \\ / \b\f\n\r\t \xc3\xa9 \xf0\x9f\x98\x80 caf\xc3\xa9");
    EXPECT_TRUE(root.get("")->is(JsonKind::Object));
    EXPECT_EQ(root.get("e")->size(), 0u);
    EXPECT_FALSE(root.get("missing"));
    EXPECT_EQ(JsonDoc("\"\\u0000\"", "t").root().string(), std::string(1, '\0'));  // escaped NUL is JSON
    EXPECT_EQ(JsonDoc("-1", "t").root().integer(), -1);
}

TEST(Json, RefusesWhatRfc8259DoesNot) {
    const std::pair<std::string, std::string> bad[] = {
        {"", "unexpected end"}, {"  ", "unexpected end"}, {"+1", "found '+'"}, {".9", "found '.'"},
        {"01", "text after"}, {"1.", "digit expected"}, {"1e", "digit expected"}, {"-", "digit expected"},
        {"[1,]", "found ']'"}, {"{\"a\":1,}", "a key (a string) expected"}, {"{a:1}", "a key"}, {"'a'", "found"},
        {"NaN", "found 'N'"}, {"Infinity", "found 'I'"}, {"/*c*/1", "found '/'"}, {"[1] x", "text after"},
        {"tru", "found 't'"}, {"nulll", "text after"}, {"[1 2]", "',' or ']' expected"}, {"{\"a\" 1}", "':' expected"},
        {"\"\\uZZZZ\"", "four hex digits"}, {"\"\\u12\"", "four hex digits"}, {"\"\\ud800\"", "high surrogate"},
        {"\"\\udc00\"", "low surrogate"}, {"\"\\ud800\\u0041\"", "high surrogate"}, {"\"\\x\"", "unknown escape \\x"},
        {"\"a\x01\"", "raw control character"}, {std::string("\"a\0\"", 4), "raw control character byte 0x00"},
        {"\"a\tb\"", "raw control character"}, {"\"\xc0\xaf\"", "invalid UTF-8"}, {"\"\xed\xa0\x80\"", "invalid UTF-8"},
        {"\"\xf5\x80\x80\x80\"", "invalid UTF-8"}, {"\"\xe2\x82\"", "invalid UTF-8"}, {"\"\x80\"", "invalid UTF-8"},
        {"\"abc", "unterminated string"}, {"1e999", "out of range"}, {std::string(101, '1'), "more than 100 characters"},
        {"\xef\xbb\xbf{}", "byte 0xef"}, {"{\"a\":1}}", "text after"}};
    for (const auto& [text, why] : bad) {
        SCOPED_TRACE(text);
        expect_usage_error([&] { JsonDoc doc(text, "t.json"); }, {"t.json: malformed JSON at byte ", why});
    }
}

TEST(Json, NestingIsLimited) {
    JsonDoc ok(nested(kJsonMaxDepth), "t.json");
    expect_usage_error([] { JsonDoc doc(nested(kJsonMaxDepth + 1), "t.json"); },
                       {"t.json: JSON nested deeper than 64"});
    expect_usage_error([] { JsonDoc doc("{\"a\":" + nested(30000) + "}", "t.json"); }, {"nested deeper than 64"});
    expect_usage_error([] { JsonDoc doc(std::string(100000, '{'), "t.json"); }, {"t.json"});
}

TEST(Json, DuplicateKeysAreRefusedAtAnyDepthInLinearithmicTime) {
    expect_usage_error([] { JsonDoc d("{\"a\": 1, \"b\": 2, \"a\": 3}", "t.json"); }, {"t.json", "key \"a\" twice"});
    expect_usage_error([] { JsonDoc d("{\"x\": [{\"k\": 1, \"\\u006b\": 2}]}", "t.json"); }, {"key \"k\" twice"});
    JsonDoc fine("{\"a\": {\"a\": {\"a\": 1}}, \"b\": [{\"a\": 1}, {\"a\": 2}]}", "t.json");
    std::string many = "{";
    for (int i = 0; i < 200000; i++) many += "\"key" + std::to_string(i) + "\": 0, ";
    const auto t0 = std::chrono::steady_clock::now();
    JsonDoc distinct(many + "\"last\": 0}", "t.json");
    expect_usage_error([&] { JsonDoc d(many + "\"key7\": 0}", "t.json"); }, {"key \"key7\" twice"});
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
}

// Peak resident memory of fn, run in a child process, beyond what the parent already holds.
long child_peak_bytes(const std::function<void()>& fn) {
    auto run = [](const std::function<void()>& f) {
        fflush(nullptr);
        const pid_t pid = fork();
        if (pid == 0) {
            try {
                f();
            } catch (...) {
            }
            _exit(0);
        }
        int status;
        struct rusage ru;
        wait4(pid, &status, 0, &ru);
        return ru.ru_maxrss * 1024L;
    };
    return run(fn) - run([] {});
}

// A header that is 10 MB of zeros took 1 GB to read with a tree of values; now the nodes take
// 16 bytes for each two bytes of text at worst.
TEST(Json, MemoryIsASmallMultipleOfTheText) {
    std::string zeros = "[0";
    while (zeros.size() < 10'000'000) zeros += ",0";
    zeros += "]";
    const long peak = child_peak_bytes([&] { JsonDoc doc(zeros, "t.json"); });
    printf("  10 MB of [0,0,...]: %.1f MB read, peak %.1f MB more\n", zeros.size() / 1e6, peak / 1e6);
    EXPECT_LT(peak, 10 * (long)zeros.size());
    // And the cap: more than 100 MB of JSON is refused before it is read.
    const std::string big(kJsonMaxBytes + 1, ' ');
    expect_usage_error([&] { JsonDoc doc(big, "t.json"); }, {"t.json", "over the limit of 100000000"});
}

// ---------------------------------------------------------------------------------------------
// Special files: refused before they are opened for reading (a FIFO would block open forever).
struct AlarmGuard {  // a regression that hangs kills the test binary instead: a failure, not a stall
    AlarmGuard() { alarm(60); }
    ~AlarmGuard() { alarm(0); }
};

TEST(InputFiles, SpecialFilesAreRefusedUnopened) {
    AlarmGuard guard;
    const std::string d = tmpdir("special");
    ASSERT_EQ(mkfifo((d + "/fifo").c_str(), 0600), 0);
    ASSERT_EQ(symlink("nowhere", (d + "/dangling").c_str()), 0);
    ASSERT_EQ(symlink("loop", (d + "/loop").c_str()), 0);
    write_file(d + "/text", "{}");
    const std::pair<std::string, std::string> cases[] = {
        {d + "/fifo", "a FIFO (named pipe), not a regular file"},
        {"/dev/null", "a device, not a regular file"},
        {"/dev/zero", "a device, not a regular file"},
        {d, "a directory, not a file"},
        {d + "/dangling", "a symbolic link to a file that does not exist (dangling)"},
        {d + "/loop", "a loop of symbolic links"},
        {d + "/absent", "no such file or directory"},
        {"", "an empty path"}};
    for (const auto& [path, why] : cases) {
        SCOPED_TRACE(path);
        expect_usage_error([&] { TokenFile t(path, 512); }, {"--data '" + path + "': " + why});
        expect_usage_error([&] { read_input_text(path, "--init-from"); }, {"--init-from '" + path + "': " + why});
    }
    EXPECT_EQ(read_input_text(d + "/text", "--init-from"), "{}");
    expect_usage_error([&] { read_input_text(d + "/text", "--init-from", 1); }, {"more than 1 bytes"});
}

// Every file of a checkpoint: model.safetensors, a shard, config.json (a FIFO, a dangling or a
// looping link is refused, not skipped).
TEST(InputFiles, SpecialFilesInACheckpointAreRefused) {
    AlarmGuard guard;
    const LlamaConfig c = config_by_name("tiny");
    DryModel dm(c, false, 1, 0);
    const std::string d = tmpdir("special_ck");
    const auto expect = [&](const std::string& name, const std::string& why) {
        SCOPED_TRACE(name);
        expect_usage_error([&] { check_hf_checkpoint(dm.m, d); }, {"--init-from '" + d + "/" + name + "': ", why});
        unlink((d + "/" + name).c_str());
    };
    write_st(d + "/a.safetensors", correct_entries(c));
    ASSERT_EQ(mkfifo((d + "/model.safetensors").c_str(), 0600), 0);
    expect("model.safetensors", "a FIFO");
    ASSERT_EQ(symlink("gone.safetensors", (d + "/model.safetensors").c_str()), 0);
    expect("model.safetensors", "dangling");
    write_file(d + "/model.safetensors.index.json",
               "{\"weight_map\": {\"x\": \"a.safetensors\", \"y\": \"b.safetensors\"}}");
    ASSERT_EQ(mkfifo((d + "/b.safetensors").c_str(), 0600), 0);
    expect("b.safetensors", "a FIFO");
    write_file(d + "/model.safetensors.index.json", "{\"weight_map\": {\"x\": \"a.safetensors\"}}");
    EXPECT_EQ(fatal_code([&] { check_hf_checkpoint(dm.m, d); }), -1);  // the shard alone is a checkpoint
    ASSERT_EQ(mkfifo((d + "/config.json").c_str(), 0600), 0);
    expect("config.json", "a FIFO");
    ASSERT_EQ(symlink("absent.json", (d + "/config.json").c_str()), 0);
    expect("config.json", "dangling");
    ASSERT_EQ(symlink("config.json", (d + "/config.json").c_str()), 0);
    expect("config.json", "a loop of symbolic links");
}

// ---------------------------------------------------------------------------------------------
// Deep nesting and bad escapes in each JSON file of a checkpoint.
TEST(InputFiles, EveryJsonFileIsReadStrictly) {
    const LlamaConfig c = config_by_name("tiny");
    DryModel dm(c, false, 1, 0);
    const std::string d = tmpdir("strict");
    const std::string deep = nested(30000), escape = "\"\\uZZZZ\"";
    for (const std::string& bad : {deep, escape}) {
        const std::string why = bad == deep ? "JSON nested deeper than 64 levels" : "\\u must be followed by four hex";
        write_st(d + "/model.safetensors", correct_entries(c));
        write_file(d + "/config.json", config_with_field(c, "architectures", bad));
        expect_usage_error([&] { check_hf_checkpoint(dm.m, d); }, {d + "/config.json: ", why});
        unlink((d + "/config.json").c_str());
        write_file(d + "/model.safetensors", safetensors("{\"__metadata__\": {\"a\": " + bad + "}}", 0));
        expect_usage_error([&] { check_hf_checkpoint(dm.m, d); }, {d + "/model.safetensors: ", why});
        unlink((d + "/model.safetensors").c_str());  // a folder holding both is read through model.safetensors
        write_file(d + "/model.safetensors.index.json", "{\"metadata\": " + bad + ", \"weight_map\": {}}");
        expect_usage_error([&] { check_hf_checkpoint(dm.m, d); }, {d + "/model.safetensors.index.json: ", why});
        unlink((d + "/model.safetensors.index.json").c_str());
    }
}

// ---------------------------------------------------------------------------------------------
// The sharded index
TEST(HfIndex, ShardNamesArePlainNamesEachReadOnce) {
    const std::string idx = "model.safetensors.index.json";
    EXPECT_EQ(index_shards("{\"weight_map\": {\"a\": \"2.st\", \"b\": \"1.st\", \"c\": \"2.st\"}, \"metadata\": {}}", idx),
              (std::vector<std::string>{"2.st", "1.st"}));
    const std::pair<std::string, std::string> bad[] = {
        {"{\"weight_map\": {\"t\": 5}}", "weight_map[\"t\"] is 5, a shard's file name expected"},
        {"{\"weight_map\": {\"t\": null}}", "weight_map[\"t\"] is null, a shard's file name expected"},
        {"{\"weight_map\": {\"t\": [\"a\"]}}", "is an array, a shard's file name expected"},
        {"{\"weight_map\": {\"t\": \"\"}}", "weight_map[\"t\"] is \"\", not the name of a file beside the index"},
        {"{\"weight_map\": {\"t\": \"../x\"}}", "is \"../x\", not the name of a file beside the index"},
        {"{\"weight_map\": {\"t\": \"/etc/passwd\"}}", "not the name of a file beside the index"},
        {"{\"weight_map\": {\"t\": \"..\"}}", "not the name of a file beside the index"},
        {"{\"weight_map\": {\"t\": \"a\\u0000b\"}}", "is \"a\\u0000b\", not the name of a file"},
        {"{\"weight_map\": {}}", "weight_map names no tensors"},
        {"{\"weight_map\": []}", "weight_map is an array, an object expected"},
        {"{\"metadata\": {}}", "has no weight_map"},
        {"null", "null, an object with a weight_map expected"}};
    for (const auto& [text, why] : bad) {
        SCOPED_TRACE(text);
        expect_usage_error([&] { index_shards(text, idx); }, {idx, why});
    }
}

// Shard names were de-duplicated in quadratic time: 200,000 took 42 s.
TEST(HfIndex, ManyShardNamesAreFast) {
    const LlamaConfig c = config_by_name("tiny");
    DryModel dm(c, false, 1, 0);
    const std::string d = tmpdir("many");
    std::string text = "{\"weight_map\": {";
    for (int i = 0; i < 200000; i++)
        text += (i ? ", \"t" : "\"t") + std::to_string(i) + "\": \"s" + std::to_string(i) + "\"";
    write_file(d + "/model.safetensors.index.json", text + "}}");
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(index_shards(text + "}}", "i").size(), 200000u);
    expect_usage_error([&] { check_hf_checkpoint(dm.m, d); }, {"--init-from '" + d + "/s0': no such file"});
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("  200,000 shard names: %.2f s\n", s);
    EXPECT_LT(s, 10.0);
}

// A sharded folder, each shard holding only its own tensors, reads back bit for bit through the
// folder and through its index file given directly (as --help and the README say it may be).
TEST(HfIndex, ShardedFolderAndTheIndexItselfReadBitForBit) {
    std::mt19937_64 rng(fresh_seed());
    for (bool bf16 : {false, true}) {
        const LlamaConfig c = config_by_name("tiny-untied");
        const std::vector<float> p = random_params(param_layout(c), rng);
        const std::string one = tmpdir("one"), two = tmpdir("sharded");
        write_checkpoint(one, c, p, bf16);
        const std::string all = read_text_file(one + "/model.safetensors");
        const StHeader h = parse(all);
        // Shard k holds the tensors k, k + 2, ...: its own header, its own tiled data.
        std::string index = "{\"metadata\": {}, \"weight_map\": {";
        for (int k = 0; k < 2; k++) {
            std::string header = "{", data;
            for (size_t i = k; i < h.tensors.size(); i += 2) {
                const StEntry& e = h.tensors[i];
                std::string shape;
                for (int64_t s : e.shape) shape += (shape.empty() ? "" : ",") + std::to_string(s);
                header += std::string(header.size() > 1 ? ", " : "") + "\"" + e.name + "\": {\"dtype\": \"" + e.dtype +
                          "\", \"shape\": [" + shape + "], \"data_offsets\": [" + std::to_string(data.size()) + ", " +
                          std::to_string(data.size() + e.end - e.begin) + "]}";
                data += all.substr(h.data_start + e.begin, e.end - e.begin);
                index += std::string(index.back() == '{' ? "" : ", ") + "\"" + e.name + "\": \"part" +
                         std::to_string(k) + "\"";
            }
            write_file(two + "/part" + std::to_string(k), safetensors(header + "}", 0) + data);
        }
        write_file(two + "/model.safetensors.index.json", index + "}}");
        write_file(two + "/config.json", hf_config_json(c, bf16));
        DryModel dm(c, false, 1, 0);
        const std::vector<float> want = expected_local(dm.m, p, bf16);
        EXPECT_EQ(read_hf_weights(dm.m, two), want);
        EXPECT_EQ(read_hf_weights(dm.m, two + "/model.safetensors.index.json"), want);
        EXPECT_EQ(read_hf_weights(dm.m, one + "/model.safetensors"), want);
    }
}

// ---------------------------------------------------------------------------------------------
// safetensors
TEST(Safetensors, OffsetsTileTheDataBufferExactly) {
    const std::string a = "\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": ";
    const std::string b = "\"b\": {\"dtype\": \"BF16\", \"shape\": [2, 1], \"data_offsets\": ";
    const std::string ok = "{" + b + "[8, 12]}, " + a + "[0, 8]}, \"z\": {\"dtype\": \"F16\", \"shape\": [0, 3], "
                           "\"data_offsets\": [12, 12]}}   ";
    const StHeader h = parse(safetensors(ok, 12));
    ASSERT_EQ(h.tensors.size(), 3u);
    EXPECT_EQ(h.data_start, 8 + ok.size());
    EXPECT_EQ(h.tensors[0].name, "b");
    EXPECT_EQ(h.tensors[0].shape, (std::vector<int64_t>{2, 1}));
    const std::string rule = "x.safetensors: the tensors must fill the data buffer exactly";
    const auto refused = [&](const std::string& file, const std::string& why) {
        expect_usage_error([&] { parse(file); }, {rule, why});
    };
    // the header length one short: every tensor one byte early, and a byte left over
    refused(safetensors(ok, 12, (int64_t)ok.size() - 1), "its last 1 byte belongs to no tensor");
    refused(safetensors(ok, 13), "its last 1 byte belongs to no tensor (is the header length wrong?)");
    refused(safetensors(ok, 20), "its last 8 bytes belong to no tensor");
    refused(safetensors("{" + a + "[0, 8]}, " + b + "[4, 8]}}", 8), "tensor 'a' and tensor 'b' overlap at bytes 4 to 8");
    refused(safetensors("{" + a + "[0, 8]}, " + b + "[12, 16]}}", 16),
            "bytes 8 to 12, before tensor 'b', belong to no tensor");
    refused(safetensors("{" + a + "[4, 12]}}", 12), "bytes 0 to 4, before tensor 'a'");
    refused(safetensors("{" + a + "[0, 8]}, \"c\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}", 8),
            "overlap");
    EXPECT_EQ(parse(safetensors("{}", 0)).tensors.size(), 0u);
    refused(safetensors("{}", 1), "its last 1 byte belongs");
}

TEST(Safetensors, NumbersAndEntriesAreChecked) {
    std::string ones = "[1";  // 65 dimensions: more than any framework gives a tensor
    for (int k = 1; k < 65; k++) ones += ",1";
    const auto entry = [](const std::string& dtype, const std::string& shape, const std::string& offsets) {
        const std::string t = "{\"dtype\": " + dtype + ", \"shape\": " + shape + ", \"data_offsets\": " + offsets + "}";
        return safetensors("{\"t\": " + t + "}", 8);
    };
    const std::pair<std::string, std::string> bad[] = {
        {entry("\"F32\"", "[128.99]", "[0, 8]"),
         "tensor 't': shape holds 128.99, a list of non-negative integers expected"},
        {entry("\"F32\"", "[\"128\"]", "[0, 8]"), "shape holds \"128\", a list of non-negative integers"},
        {entry("\"F32\"", "[2e0]", "[0, 8]"), "shape holds 2, a list"},
        {entry("\"F32\"", "[-2]", "[0, 8]"), "shape holds -2"},
        {entry("\"F32\"", "2", "[0, 8]"), "shape is 2, a list of non-negative integers expected"},
        {entry("\"F32\"", "[2]", "[0.9, 8.1]"), "data_offsets holds 0.9"},
        {entry("\"F32\"", "[+2]", "[0, 8]"), "malformed JSON at byte 33: a value expected, found '+'"},
        {entry("\"F32\"", "[2]", "[0, 8, 8]"), "data_offsets has 3 numbers, [begin, end] expected"},
        {entry("\"F32\"", "[2]", "[8, 0]"), "data_offsets [begin, end] ends before it begins"},
        {entry("\"F32\"", "[2]", "[0, 16]"), "tensor 't' lies outside the file"},
        {entry("\"F32\"", "[3]", "[0, 8]"), "tensor 't' has 8 bytes for its shape (12 expected)"},
        {entry("\"F32\"", "[4294967296, 4294967296, 4294967296]", "[0, 8]"),
         "has 8 bytes for its shape (over 2^63 expected)"},
        {entry("\"F32\"", ones + "]", "[0, 4]"), "tensor 't': shape has 65 numbers, at most 64 expected"},
        {entry("\"I8\"", "[8]", "[0, 8]"), "has dtype I8 (BF16, F16 or F32 expected)"},
        {entry("5", "[2]", "[0, 8]"), "dtype is 5, a string expected"},
        {entry(std::string("\"F\0\"", 4), "[2]", "[0, 8]"), "raw control character byte 0x00"},
        {safetensors("{\"t\": 5}", 0), "tensor 't' is described by 5, an object expected"},
        {safetensors("{\"t\": {\"dtype\": \"F32\"}}", 0), "tensor 't' has an incomplete header"},
        {safetensors("[]", 0), "the safetensors header is an array, not an object"},
        {safetensors("{\"__metadata__\": {\"a\": [0, 0]}}", 0), "__metadata__ must map names to strings"},
        {safetensors("{\"__metadata__\": 1}", 0),
         "__metadata__ must map names to strings (the safetensors format); it is 1"},
        {std::string("\x10\0\0\0\0\0\0\0{}", 10), "header length 16 runs past the end of the file (10 bytes)"},
        {safetensors("{}", 0, 100'000'001), "header length 100000001 is over the format's limit of 100000000 bytes"},
        {std::string("{}"), "truncated (no safetensors header)"}};
    for (const auto& [file, why] : bad) {
        SCOPED_TRACE(why);
        expect_usage_error([&] { parse(file); }, {"x.safetensors", why});
    }
}

// ---------------------------------------------------------------------------------------------
// config.json
TEST(HfConfig, FieldsHaveTransformersTypes) {
    const LlamaConfig c = config_by_name("tiny");
    struct Case {
        std::string key, value, why;
    };
    const Case cases[] = {
        {"hidden_size", "\"128\"", "hidden_size: checkpoint \"128\" (not an integer), --config tiny 128"},
        {"hidden_size", "128.0", "hidden_size: checkpoint 128 (not an integer)"},
        {"num_hidden_layers", "null", "num_hidden_layers: checkpoint null (not an integer)"},
        {"vocab_size", "5e2", "vocab_size: checkpoint 500 (not an integer), --config tiny 512"},
        {"tie_word_embeddings", "\"true\"", "tie_word_embeddings: checkpoint \"true\" (not true or false)"},
        {"tie_word_embeddings", "1", "tie_word_embeddings: checkpoint 1 (not true or false)"},
        {"rms_norm_eps", "\"1e-5\"", "rms_norm_eps: checkpoint \"1e-5\" (not a number)"},
        {"hidden_act", "1", "hidden_act: checkpoint 1 (not a string)"},
        {"hidden_act", "\"gelu\"", "hidden_act: checkpoint \"gelu\", --config tiny \"silu\""},
        {"attention_bias", "true", "attention_bias: checkpoint true, --config tiny false"},
        {"mlp_bias", "\"false\"", "mlp_bias: checkpoint \"false\" (not true or false)"}};
    for (const Case& k : cases) expect_config_refused(c, config_with_field(c, k.key, k.value), {k.why});
    expect_config_accepted(c, config_with_field(c, "hidden_act", "\"swish\""));  // SiLU under its other name
    expect_config_refused(c, "null", {"config.json: null, a JSON object expected"});
    expect_config_refused(c, "[]", {"config.json: an array, a JSON object expected"});
    // A duplicate key: transformers keeps the last, we kept the first; now neither.
    std::string dup = hf_config_json(c, false);
    dup.insert(dup.rfind('}'), ", \"rope_scaling\": null");
    expect_config_refused(c, dup, {"config.json: the object at byte 0 has the key \"rope_scaling\" twice"});
}

// A missing field is transformers' LlamaConfig default: rms_norm_eps 1e-6, key/value heads as
// many as heads, head_dim hidden size // heads, untied, rope_theta 10000, silu, no biases.
TEST(HfConfig, MissingFieldsTakeTransformersDefaults) {
    const LlamaConfig c = config_by_name("tiny");  // eps 1e-5, 4 heads, 2 kv heads, head_dim 64 (128 / 4 = 32)
    const std::pair<std::string, std::string> missing[] = {
        {"rms_norm_eps", "rms_norm_eps: checkpoint missing (transformers' default 1e-06), --config tiny 1e-05"},
        {"num_key_value_heads", "num_key_value_heads: checkpoint missing (transformers' default 4), --config tiny 2"},
        {"head_dim", "head_dim: checkpoint missing (transformers' default 32), --config tiny 64"},
        {"tie_word_embeddings",
         "tie_word_embeddings: checkpoint missing (transformers' default false), --config tiny true"},
        {"hidden_size", "hidden_size: checkpoint missing (transformers' default 4096), --config tiny 128"},
        {"vocab_size", "vocab_size: checkpoint missing (transformers' default 32000)"},
        {"intermediate_size", "intermediate_size: checkpoint missing (transformers' default 11008)"},
        {"num_hidden_layers", "num_hidden_layers: checkpoint missing (transformers' default 32)"}};
    for (const auto& [key, why] : missing) expect_config_refused(c, config_with_field(c, key, ""), {why});
    expect_config_refused(c, config_with_field(c, "head_dim", "null"),
                          {"head_dim: checkpoint null, so missing (transformers' default 32)"});
    for (const char* key : {"hidden_act", "attention_bias", "mlp_bias"})
        expect_config_accepted(c, config_with_field(c, key, ""));
    // Where the default is ours, a missing field passes.
    LlamaConfig mha = c;  // as many key/value heads as heads, head_dim = dim / heads, untied, eps 1e-6
    mha.n_kv_heads = 4, mha.head_dim = 32, mha.tied_embeddings = false, mha.norm_eps = 1e-6;
    for (const char* key : {"num_key_value_heads", "head_dim", "tie_word_embeddings", "rms_norm_eps"})
        expect_config_accepted(mha, config_with_field(mha, key, ""));
    expect_config_accepted(mha, with_field(config_with_field(mha, "head_dim", "null"), "num_key_value_heads", "null"));
    LlamaConfig theta = c;
    theta.rope_theta = 10000;
    expect_config_accepted(theta, config_with_field(theta, "rope_theta", ""));
    expect_config_refused(c, config_with_field(c, "rope_theta", ""),
                          {"rope_theta: checkpoint missing (transformers' default 10000), --config tiny 500000"});
}

// ---------------------------------------------------------------------------------------------
// Empty paths: --data '' trained on synthetic data, --init-from '' from random weights.
TEST(Binary, EmptyPathsAreUsageErrors) {
    for (const std::string flag : {"--data", "--init-from"}) {
        std::string program = "train", alone = flag, empty, joined = flag + "=";
        char* apart[] = {&program[0], &alone[0], &empty[0]};
        char* together[] = {&program[0], &joined[0]};
        expect_usage_error([&] { parse_options(3, apart); }, {flag + " needs a path, got an empty one"});
        expect_usage_error([&] { parse_options(2, together); }, {flag + " needs a path, got an empty one"});
    }
    if (!std::ifstream("./train").good()) GTEST_SKIP() << "./train not built";
    for (const char* flag : {"--data", "--init-from"}) {
        const CommandResult r = run_command(std::string("./train --config tiny --plan ") + flag + " ''");
        EXPECT_EQ(r.code, 2) << r.output;
        EXPECT_NE(r.output.find(std::string(flag) + " needs a path"), std::string::npos) << r.output;
    }
}

// The program itself: a FIFO as --data ends with exit code 2 (it hung in open()), and an index
// file given to --init-from is accepted (exit 1 without a GPU, 0 with one: not 2).
TEST(Binary, HostileFilesEndWithExitCodeTwo) {
    if (!std::ifstream("./train").good()) GTEST_SKIP() << "./train not built";
    const LlamaConfig c = config_by_name("tiny");
    const std::string d = tmpdir("binary");
    ASSERT_EQ(mkfifo((d + "/fifo").c_str(), 0600), 0);
    const std::string run = "timeout 60 ./train --config tiny --seq-len 64 --steps 1 ";
    CommandResult r = run_command(run + "--data " + d + "/fifo");
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find("a FIFO (named pipe)"), std::string::npos) << r.output;
    write_st(d + "/a.safetensors", correct_entries(c));
    write_file(d + "/model.safetensors.index.json", "{\"weight_map\": {\"model.norm.weight\": \"a.safetensors\"}}");
    write_file(d + "/config.json", hf_config_json(c, false));
    r = run_command(run + "--init-from " + d + "/model.safetensors.index.json");
    EXPECT_NE(r.code, 2) << r.output;
    write_file(d + "/config.json", config_with_field(c, "architectures", nested(30000)));
    r = run_command(run + "--init-from " + d);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find(d + "/config.json: JSON nested deeper than 64 levels"), std::string::npos) << r.output;
}

}  // namespace
