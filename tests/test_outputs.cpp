// tests/test_outputs.cpp - every path a run writes, checked before the GPU opens (io/outputs.cpp,
// io/output_paths.h), on the CPU (./train refuses with exit code 2 before any CUDA call):
//   * each flag of the flags table that writes, read from the table itself, against a dangling
//     link, a link loop, an entry of the wrong kind (a folder, a socket, a FIFO), a name too long,
//     a missing folder, and a hard or symbolic link to an input: a new flag that writes is
//     checked here because the table says it writes;
//   * no output is an input or another output, by identity, whatever the spelling of the path;
//   * --save-to leaves no older index behind, and a folder holding both is read as transformers
//     reads it;
//   * the ladder refuses the files it would not pass on to its child runs, and checks where its
//     child runs' log goes; --nproc says a refusal once; the synthetic task's bound on --seq-len
//     is not said to a run on a token file.
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <regex>
#include <set>

#include "../infra/train.h"
#include "../io/input_files.h"
#include "files_util.h"
#include "test_util.h"

namespace {

bool have_train() { return std::ifstream("./train").good(); }

// The run of ./train `args` ended with `code` and said every needle.
void expect_exit(const std::string& args, int code, const std::vector<std::string>& needles) {
    SCOPED_TRACE(args);
    const CommandResult r = run_command("./train " + args);
    EXPECT_EQ(r.code, code) << r.output;
    for (const std::string& n : needles) EXPECT_NE(r.output.find(n), std::string::npos) << "'" << n << "' not in: " << r.output;
}

void make_socket(const std::string& path) {
    const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    ASSERT_LT(path.size(), sizeof a.sun_path) << path;
    strcpy(a.sun_path, path.c_str());
    ASSERT_EQ(bind(fd, (sockaddr*)&a, sizeof a), 0) << path;
    close(fd);  // the socket file stays
}

void write_text_file(const std::string& path) { std::ofstream(path) << "text"; }

// A folder or a file at path.
void make_entry(const std::string& path, bool folder) {
    if (folder) mkdir(path.c_str(), 0755);
    else write_text_file(path);
}

// A folder holding a token file for --data and one for --eval-data.
std::string folder_with_inputs(const std::string& name) {
    const std::string d = tmpdir(name);
    write_token_file(d + "/data.bin", std::vector<uint32_t>(200, 7));
    write_token_file(d + "/eval.bin", std::vector<uint32_t>(200, 9));
    return d;
}

// The file inside a folder flag's folder that a run writes first (where a link to an input goes).
std::string written_inside(PathRole role) {
    if (role == PathRole::WRITES_CHECKPOINT) return "model.safetensors";
    if (role == PathRole::WRITES_STATE) return "latest";
    ADD_FAILURE() << "a folder role this test does not know: add what the run writes in it";
    return "";
}

// One way an output path can be wrong: how to make it at `path`, and what the refusal says.
struct BadOutput {
    std::string name;
    std::function<void(const std::string& path, const std::string& inputs)> make;
    std::string says;
};

std::vector<BadOutput> bad_outputs(const PathFlag& f) {
    const bool folder = f.role != PathRole::WRITES_FILE;
    const std::string inside = folder ? written_inside(f.role) : "";
    auto link_to_input = [=](bool hard, const std::string& input) {
        return [=](const std::string& p, const std::string& d) {
            if (folder) mkdir(p.c_str(), 0755);
            const std::string at = folder ? p + "/" + inside : p;
            ASSERT_EQ(hard ? link((d + "/" + input).c_str(), at.c_str()) : symlink((d + "/" + input).c_str(), at.c_str()), 0);
        };
    };
    return {
        {"dangling", [](const std::string& p, const std::string& d) { symlink((d + "/nowhere").c_str(), p.c_str()); },
         "a symbolic link to a file that does not exist (dangling)"},
        {"loop", [](const std::string& p, const std::string&) { symlink(p.c_str(), p.c_str()); }, "a loop of symbolic links"},
        {"kind", [=](const std::string& p, const std::string&) { make_entry(p, !folder); },
         folder ? "is not a folder" : "is a directory, not a file"},
        {"socket", [](const std::string& p, const std::string&) { make_socket(p); }, folder ? "is not a folder" : "is a socket"},
        {"fifo", [](const std::string& p, const std::string&) { mkfifo(p.c_str(), 0644); }, folder ? "is not a folder" : "is a FIFO"},
        {std::string(300, 'n'), [](const std::string&, const std::string&) {}, "over the 255 a name may have"},
        {"missing/out", [](const std::string&, const std::string&) {}, "/missing' does not exist"},
        {"hard", link_to_input(true, "data.bin"), "--data"},
        {"symbolic", link_to_input(false, "eval.bin"), "--eval-data"},
    };
}

// Every flag that names a path says, in the table, what the run does with it: --help's path flags
// (FILE, DIR, PATH) are exactly path_flags', and the ones known to write are among its writers.
TEST(Outputs, EveryPathFlagSaysWhatTheRunDoesWithIt) {
    std::set<std::string> in_help, in_table, writers;
    const std::regex path_flag("^  (--[a-z-]+) (FILE|DIR|PATH)\\b");
    std::istringstream help(usage_text());
    for (std::string line; std::getline(help, line);) {
        std::smatch m;
        if (std::regex_search(line, m, path_flag)) in_help.insert(m[1]);
    }
    for (const PathFlag& f : path_flags(Options())) {
        in_table.insert(f.name);
        if (f.role == PathRole::WRITES_FILE || f.role == PathRole::WRITES_CHECKPOINT || f.role == PathRole::WRITES_STATE)
            writers.insert(f.name);
    }
    EXPECT_EQ(in_help, in_table);
    for (const char* flag : {"--log", "--dump", "--timeline", "--trace", "--mem-trace", "--save-to", "--state-dir"})
        EXPECT_TRUE(writers.count(flag)) << flag << " writes, and is not checked as a flag that writes";
}

// Each flag that writes, each way its path can be wrong: exit 2 before the GPU, naming the flag
// and what is wrong. The same flag on a new name, a regular file or a folder, as it should be, is
// accepted (--plan: exit 0).
TEST(Outputs, EveryFlagThatWritesIsCheckedBeforeTheGpu) {
    if (!have_train()) GTEST_SKIP() << "./train not built";
    for (const PathFlag& f : path_flags(Options())) {
        if (f.role == PathRole::READS_FILE || f.role == PathRole::READS_CHECKPOINT) continue;
        SCOPED_TRACE(f.name);
        const std::string d = folder_with_inputs("out" + f.name);
        const std::string run = "--config tiny --seq-len 64 --steps 1 --data " + d + "/data.bin --eval-data " + d + "/eval.bin ";
        for (const BadOutput& bad : bad_outputs(f)) {
            const std::string p = d + "/" + bad.name;
            bad.make(p, d);
            expect_exit(run + f.name + " " + p, 2, {f.name + " '" + p, bad.says});
        }
        const bool folder = f.role != PathRole::WRITES_FILE;
        expect_exit(run + "--plan " + f.name + " " + d + "/new", 0, {});
        make_entry(d + "/there", folder);
        expect_exit(run + "--plan " + f.name + " " + d + "/there", 0, {});
        if (!folder) expect_exit(run + f.name + " " + d + "/new/", 2, {f.name, "ends in '/'"});
        if (folder) expect_exit(run + f.name + " " + d + "/dangling/", 2, {f.name, "dangling"});  // the link, not followed
    }
}

// A checkpoint of garbage files (check_outputs comes before any is read): model.safetensors and
// config.json in `one`, an index and two shards in `sharded`.
void make_checkpoints(const std::string& d) {
    mkdir((d + "/one").c_str(), 0755), mkdir((d + "/sharded").c_str(), 0755);
    for (const char* f : {"one/model.safetensors", "one/config.json", "sharded/a.safetensors", "sharded/b.safetensors"})
        write_text_file(d + "/" + f);
    std::ofstream(d + "/sharded/model.safetensors.index.json")
        << "{\"weight_map\": {\"x\": \"a.safetensors\", \"y\": \"b.safetensors\"}}";
}

TEST(Outputs, NoOutputIsAnInputOrAnotherOutput) {
    if (!have_train()) GTEST_SKIP() << "./train not built";
    const std::string d = folder_with_inputs("distinct");
    make_checkpoints(d);
    const std::string run = "--config tiny --seq-len 64 --steps 1 --plan ";
    const std::string data = "--data " + d + "/data.bin ";
    expect_exit(run + data + "--log " + d + "/data.bin", 2, {"--log", "--data", "a run never writes what it reads"});
    expect_exit(run + data + "--dump " + d + "/../" + d.substr(d.rfind('/') + 1) + "/data.bin", 2, {"--dump", "--data"});
    expect_exit(run + "--eval-data " + d + "/eval.bin --trace " + d + "/eval.bin", 2, {"--trace", "--eval-data"});
    // Every file --init-from reads: the safetensors file, config.json, the index, a shard.
    expect_exit(run + "--init-from " + d + "/one --save-to " + d + "/one", 2, {"--save-to", "--init-from", "model.safetensors"});
    expect_exit(run + "--init-from " + d + "/one --timeline " + d + "/one/config.json", 2, {"--timeline", "--init-from"});
    expect_exit(run + "--init-from " + d + "/sharded --mem-trace " + d + "/sharded/b.safetensors", 2, {"--mem-trace", "--init-from"});
    expect_exit(run + "--init-from " + d + "/sharded/model.safetensors.index.json --log " + d +
                    "/sharded/model.safetensors.index.json", 2, {"--log", "--init-from"});
    // Outputs among themselves, new names spelled two ways, and the files of a folder an output writes.
    expect_exit(run + "--log " + d + "/a --dump " + d + "/./a", 2, {"--log", "--dump", "are the same file"});
    expect_exit(run + "--trace " + d + "/b --timeline " + d + "/one/../b", 2, {"--trace", "--timeline", "are the same file"});
    mkdir((d + "/saved").c_str(), 0755), mkdir((d + "/state").c_str(), 0755), mkdir((d + "/state/step-2").c_str(), 0755);
    expect_exit(run + "--save-to " + d + "/saved --log " + d + "/saved/config.json", 2, {"--log", "--save-to"});
    expect_exit(run + "--state-dir " + d + "/state --log " + d + "/state/latest", 2, {"--log", "--state-dir"});
    expect_exit(run + "--state-dir " + d + "/state --dump " + d + "/state/step-2/grads.bin", 2,
                {"--dump", "--state-dir", "whose files a later save of --state-dir removes"});
    // An older index in --save-to's folder names a shard that is --data: the save would remove it.
    std::ofstream(d + "/saved/model.safetensors.index.json") << "{\"weight_map\": {\"x\": \"old.safetensors\"}}";
    ASSERT_EQ(link((d + "/data.bin").c_str(), (d + "/saved/old.safetensors").c_str()), 0);
    expect_exit(run + data + "--save-to " + d + "/saved", 2, {"--save-to", "old.safetensors", "--data"});
    // What may go together: one file read twice, two outputs in one folder, an output beside an input.
    expect_exit(run + data + "--eval-data " + d + "/data.bin --log " + d + "/run.jsonl", 0, {});
    expect_exit(run + "--save-to " + d + "/state --state-dir " + d + "/state", 0, {});
}

// --save-to over an older sharded checkpoint: its index and shards go once the new file is in
// place (other files stay), and a folder holding model.safetensors beside an index is read as
// transformers reads it, through model.safetensors.
TEST(Outputs, SaveLeavesNoOlderCheckpointBehind) {
    std::mt19937_64 rng(fresh_seed());
    const LlamaConfig c = config_by_name("tiny");
    const std::vector<float> p = random_params(param_layout(c), rng);
    const std::string d = tmpdir("stale");
    std::ofstream(d + "/model.safetensors.index.json")
        << "{\"weight_map\": {\"x\": \"old-1.safetensors\", \"y\": \"old-2.safetensors\"}}";
    for (const char* f : {"old-1.safetensors", "old-2.safetensors", "notes.txt"}) write_text_file(d + "/" + f);
    write_checkpoint(d, c, p, false);
    for (const char* gone : {"model.safetensors.index.json", "old-1.safetensors", "old-2.safetensors"})
        EXPECT_FALSE(path_present(d + "/" + gone)) << gone;
    EXPECT_TRUE(path_present(d + "/notes.txt"));
    DryModel dm(c, false, 1, 0);
    const std::vector<float> want = expected_local(dm.m, p, false);
    EXPECT_EQ(read_hf_weights(dm.m, d), want);
    std::ofstream(d + "/model.safetensors.index.json") << "{\"weight_map\": {\"x\": \"notes.txt\"}}";
    EXPECT_EQ(read_hf_weights(dm.m, d), want);
}

// The ladder's child runs get no file of the run's but their own logs: every other path flag is
// refused, planned or measured. Where their log goes ($TMPDIR) is checked before the GPU.
TEST(Outputs, LadderRefusesWhatItWouldNotPassOn) {
    if (!have_train()) GTEST_SKIP() << "./train not built";
    for (const PathFlag& f : path_flags(Options()))
        if (f.name != "--log")
            for (const char* plan : {"--plan ", ""})
                expect_exit(std::string("--ladder ") + plan + "--config tiny " + f.name + " x", 2,
                            {"--ladder runs its own steps: leave out " + f.name});
    const CommandResult r = run_command("TMPDIR=/nonexistent ./train --ladder --config tiny --seq-len 64");
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find("--ladder: cannot make its child runs' log in '/nonexistent'"), std::string::npos) << r.output;
}

// Under --nproc the outputs are checked once, by the launcher, before any rank starts.
TEST(Outputs, NprocRefusesOnceBeforeTheRanksStart) {
    if (!have_train()) GTEST_SKIP() << "./train not built";
    const std::string d = folder_with_inputs("nproc");
    const CommandResult r = run_command("./train --nproc 2 --config tiny --seq-len 64 --data " + d + "/data.bin --log " + d + "/data.bin");
    EXPECT_EQ(r.code, 2) << r.output;
    const size_t at = r.output.find("--log");
    ASSERT_NE(at, std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("--log", at + 5), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("[rank"), std::string::npos) << r.output;
}

// The synthetic task's bound on --seq-len is said where the synthetic task runs, not to a run on
// a token file (which takes any length).
TEST(Outputs, ShortSequencesOfATokenFileAreNotTheTasks) {
    if (!have_train()) GTEST_SKIP() << "./train not built";
    const std::string d = tmpdir("short");
    write_documents_file(d + "/v2.bin", 1000, 100);
    const CommandResult r = run_command("./train --config tiny --plan --data " + d + "/v2.bin --doc-mask --seq-len 2");
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(r.output.find("--task"), std::string::npos) << r.output;
    expect_exit("--config tiny --plan --seq-len 2", 2, {"--seq-len 2: the synthetic task copy needs at least 4"});
    expect_exit("--config tiny --plan --seq-len 2 --task induction", 2, {"the synthetic task induction needs at least 4"});
    expect_exit("--config tiny --plan --seq-len 2 --task random", 0, {});
}

}  // namespace
