// tests/test_source.cpp - the repository's shape, read from its files (run from the repository
// root, as `make test` does): the design card's top level, the one index of where each flag
// changes the step (docs/design.md) against the code it names, and the size of every source file.
#include <dirent.h>

#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

namespace {

bool in_repository() { return std::ifstream("docs/design.md").good() && std::ifstream("llama.cu").good(); }
#define REQUIRE_REPOSITORY() \
    if (!in_repository()) GTEST_SKIP() << "run from the repository root"

std::vector<std::string> read_lines(const std::string& path) {
    std::ifstream f(path);
    std::vector<std::string> lines;
    for (std::string line; std::getline(f, line);) lines.push_back(line);
    return lines;
}

std::vector<std::string> list_dir(const std::string& dir) {
    std::vector<std::string> names;
    if (DIR* d = opendir(dir.c_str())) {
        while (dirent* e = readdir(d)) names.push_back(e->d_name);
        closedir(d);
    }
    return names;
}

bool is_source(const std::string& name) {
    for (const char* ext : {".cu", ".cpp", ".h", ".cuh"}) {
        const std::string e = ext;
        if (name.size() > e.size() && name.compare(name.size() - e.size(), e.size(), e) == 0) return true;
    }
    return false;
}

// The body of `name`'s definition in `lines`: from the line that defines it (a return type before
// the name, the line not a declaration) to the closing brace at the definition's indentation.
// Empty when the file does not define it.
std::vector<std::string> function_body(const std::vector<std::string>& lines, const std::string& name) {
    const std::regex def("^(\\s*)(template\\s*<[^>]*>\\s*)?[A-Za-z_][\\w:<>,\\*& ]*[\\s\\*&]" + name + "\\s*\\(");
    for (size_t i = 0; i < lines.size(); i++) {
        std::smatch m;
        if (!std::regex_search(lines[i], m, def)) continue;
        // The signature ends with '{' before any ';' (a declaration ends with ';').
        size_t open = i;
        while (open < lines.size() && lines[open].find('{') == std::string::npos &&
               lines[open].find(';') == std::string::npos)
            open++;
        if (open == lines.size() || lines[open].find('{') == std::string::npos) continue;
        const std::string indent = m[1].str();
        for (size_t j = open; j < lines.size(); j++) {
            if (j > i && lines[j].rfind(indent + "}", 0) == 0) return {lines.begin() + i, lines.begin() + j + 1};
            if (j == open && lines[j].find('}') != std::string::npos && lines[j].rfind('}') > lines[j].find('{'))
                return {lines.begin() + i, lines.begin() + j + 1};  // a one-line body
        }
    }
    return {};
}

bool mentions(const std::vector<std::string>& body, const std::string& word) {
    const std::regex w("(^|[^\\w])" + word + "([^\\w]|$)");
    for (const std::string& line : body) {
        const std::string code = line.substr(0, line.find("//"));  // comments do not count
        if (std::regex_search(code, w)) return true;
    }
    return false;
}

// docs/design.md's table under "## Where each flag changes the step": rows of flag, file,
// function and the hooks it calls (a row without a flag continues the one above).
struct IndexRow {
    std::string flag, file, function;
    std::vector<std::string> calls;
};

std::vector<std::string> backticked(const std::string& cell) {
    std::vector<std::string> out;
    for (size_t a = cell.find('`'); a != std::string::npos; a = cell.find('`', a)) {
        const size_t b = cell.find('`', a + 1);
        if (b == std::string::npos) break;
        out.push_back(cell.substr(a + 1, b - a - 1));
        a = b + 1;
    }
    return out;
}

std::vector<IndexRow> step_index() {
    std::vector<IndexRow> rows;
    bool in_section = false;
    std::string flag;
    for (const std::string& line : read_lines("docs/design.md")) {
        if (line.rfind("## ", 0) == 0) in_section = line == "## Where each flag changes the step";
        if (!in_section || line.rfind("| ", 0) != 0 || line.rfind("| flag", 0) == 0) continue;
        std::vector<std::string> cells;
        std::stringstream ss(line.substr(1));
        for (std::string cell; std::getline(ss, cell, '|');) cells.push_back(cell);
        if (cells.size() < 4) continue;
        if (!backticked(cells[0]).empty()) flag = backticked(cells[0])[0];
        const std::vector<std::string> file = backticked(cells[1]), function = backticked(cells[2]);
        if (file.size() != 1 || function.size() != 1) continue;
        rows.push_back({flag, file[0], function[0], backticked(cells[3])});
    }
    return rows;
}

// The hooks the technique files provide: what llama.h declares from the attention sub-layer
// (ulysses.cu) on, through its technique sections.
std::set<std::string> technique_hooks() {
    std::set<std::string> hooks;
    bool techniques = false;
    const std::regex decl("^[A-Za-z_][\\w:<>,\\*& ]*[\\s\\*&](\\w+)\\(");
    for (const std::string& line : read_lines("llama.h")) {
        if (line.rfind("// The attention sub-layer (", 0) == 0) techniques = true;
        std::smatch m;
        if (techniques && std::regex_search(line, m, decl)) hooks.insert(m[1].str());
    }
    return hooks;
}

}  // namespace

// The design card: "top-level: Makefile, llama.cu, fsdp.cu, ulysses.cu, offload.cu, chunked.cu,
// train.cpp, tests, notebooks, README.md", and the one header they share.
TEST(Card, TheTopLevelIsTheTalk) {
    REQUIRE_REPOSITORY();
    std::set<std::string> sources;
    for (const std::string& name : list_dir("."))
        if (is_source(name)) sources.insert(name);
    const std::set<std::string> card = {"llama.h", "llama.cu", "fsdp.cu", "ulysses.cu", "offload.cu", "chunked.cu",
                                        "train.cpp"};
    EXPECT_EQ(sources, card);
    for (const char* entry : {"Makefile", "README.md", "tests", "notebooks"})
        EXPECT_TRUE(std::ifstream(entry).good() || !list_dir(entry).empty()) << entry;
}

TEST(StepIndex, EveryRowHolds) {
    REQUIRE_REPOSITORY();
    const std::vector<IndexRow> rows = step_index();
    ASSERT_GE(rows.size(), 60u) << "docs/design.md: the table of where each flag changes the step";
    std::map<std::string, std::vector<std::string>> files;
    std::set<std::string> flags;
    for (const IndexRow& r : rows) {
        flags.insert(r.flag);
        if (!files.count(r.file)) files[r.file] = read_lines(r.file);
        ASSERT_FALSE(files[r.file].empty()) << r.file << " (named for " << r.flag << ")";
        const std::vector<std::string> body = function_body(files[r.file], r.function);
        EXPECT_FALSE(body.empty()) << r.file << " defines no " << r.function << " (named for " << r.flag << ")";
        if (body.empty()) continue;
        EXPECT_FALSE(r.calls.empty()) << r.function << ": its row names no hook";
        for (const std::string& hook : r.calls)
            EXPECT_TRUE(mentions(body, hook)) << r.file << " " << r.function << " does not call " << hook
                                              << " (the row of " << r.flag << ")";
    }
    for (const char* flag : {"--fsdp", "--ulysses", "--ckpt", "--offload", "--chunked", "--untied[=K]",
                             "--vocab-pieces[=N]", "--one-offload-slot", "--grad-in-att-output", "--dq-sums-in-staging",
                             "--ckpt=selective"})
        EXPECT_TRUE(flags.count(flag)) << "no row for " << flag;
}

// Every call llama.cu makes into a technique's file (a function of llama.h's technique sections)
// is a row of the index, with the function it is made from.
TEST(StepIndex, EveryHookLlamaCuCallsIsListed) {
    REQUIRE_REPOSITORY();
    std::set<std::pair<std::string, std::string>> listed;
    for (const IndexRow& r : step_index())
        if (r.file == "llama.cu")
            for (const std::string& hook : r.calls) listed.insert({r.function, hook});
    const std::set<std::string> hooks = technique_hooks();
    ASSERT_GE(hooks.size(), 40u) << "llama.h: the technique sections, from '// The attention sub-layer ('";
    const std::vector<std::string> lines = read_lines("llama.cu");
    const std::regex def("^(static\\s+)?(template\\s*<[^>]*>\\s*)?[A-Za-z_][\\w:<>,\\*& ]*[\\s\\*&](\\w+)\\s*\\(");
    const std::regex call("(^|[^\\w.>])(\\w+)\\s*\\(");
    std::string function;
    int calls = 0;
    for (const std::string& line : lines) {
        std::smatch m;
        const bool opens = line.find('{') != std::string::npos || line.find(';') == std::string::npos;
        if (opens && std::regex_search(line, m, def)) function = m[3].str();
        const std::string code = line.substr(0, line.find("//"));
        for (auto it = std::sregex_iterator(code.begin(), code.end(), call); it != std::sregex_iterator(); ++it) {
            const std::string name = (*it)[2].str();
            if (!hooks.count(name) || name == function) continue;
            calls++;
            EXPECT_TRUE(listed.count({function, name}))
                << "llama.cu " << function << " calls " << name << ": docs/design.md has no row for it";
        }
    }
    EXPECT_GE(calls, 20);
}

// A technique reads in two files, its own and the step: llama.cu names it (its rows of the index)
// in at most three functions. The places of the hooks and the attention sub-layer belong to every
// stage, the plain model's too.
TEST(StepIndex, EachTechniqueEntersLlamaCuInAtMostThreeFunctions) {
    REQUIRE_REPOSITORY();
    std::map<std::string, std::set<std::string>> functions;
    for (const IndexRow& r : step_index())
        if (r.file == "llama.cu") functions[r.flag].insert(r.function);
    EXPECT_GE(functions.size(), 8u);
    for (const auto& [flag, names] : functions) {
        if (flag == "hooks" || flag == "attention") continue;
        std::string list;
        for (const std::string& n : names) list += " " + n;
        EXPECT_LE(names.size(), 3u) << flag << " enters llama.cu in" << list;
    }
}

// Functions outside the kernels read in one screen or two: under 80 lines. A function here is a
// definition that opens at the start of a line and closes at the start of one; kernels and other
// device code (__global__, __device__) are not counted.
TEST(Card, EveryFunctionOutsideTheKernelsIsUnder80Lines) {
    REQUIRE_REPOSITORY();
    const std::regex opens("^[A-Za-z_][^;]*\\)\\s*(const\\s*)?(override\\s*)?\\{\\s*$");
    int functions = 0;
    for (const char* dir : {".", "beyond", "kernels", "io", "infra", "tests", "tests/fuzz", "bench"})
        for (const std::string& name : list_dir(dir)) {
            if (!is_source(name)) continue;
            const std::string path = std::string(dir) == "." ? name : std::string(dir) + "/" + name;
            const std::vector<std::string> lines = read_lines(path);
            for (size_t i = 0; i < lines.size(); i++) {
                const std::string& l = lines[i];
                const std::string before = i > 0 ? lines[i - 1] : "";
                if (!std::regex_search(l, opens) || l.rfind("struct", 0) == 0 || l.rfind("class", 0) == 0 ||
                    l.rfind("namespace", 0) == 0 || l.find("__global__") != std::string::npos ||
                    l.find("__device__") != std::string::npos || before.find("__global__") != std::string::npos)
                    continue;
                size_t j = i + 1;
                while (j < lines.size() && lines[j].rfind("}", 0) != 0) j++;
                EXPECT_LT(j - i + 1, 80u) << path << ":" << i + 1 << " " << l;
                functions++;
            }
        }
    EXPECT_GE(functions, 300);
}

// A reader takes in a file in one sitting.
TEST(Card, EverySourceFileIsUnder1300Lines) {
    REQUIRE_REPOSITORY();
    int files = 0;
    for (const char* dir : {".", "beyond", "kernels", "io", "infra", "tests", "tests/fuzz", "bench"})
        for (const std::string& name : list_dir(dir)) {
            if (!is_source(name)) continue;
            const std::string path = std::string(dir) == "." ? name : std::string(dir) + "/" + name;
            EXPECT_LE(read_lines(path).size(), 1300u) << path;
            files++;
        }
    EXPECT_GE(files, 30);
}
