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

// docs/design.md's table under "## Where each flag changes the step": rows of flag, file,
// function and the names it calls or reads for that flag (a row without a flag continues the one
// above).
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

// A technique as the step's code names it: the functions llama.h declares in its section, and
// the flags and state it reads (`opt.fsdp`, `m.ulysses`).
struct Technique {
    std::string flag, section;               // the section of llama.h, by the start of its first line
    std::vector<std::string> reads;          // members, as written after `m.` or `opt.`
    std::vector<std::string> also;           // functions declared elsewhere in llama.h
    std::set<std::string> functions;         // from llama.h
};

std::vector<Technique> techniques() {
    std::vector<Technique> t = {
        {"--fsdp", "// Stage 1 (fsdp.cu)", {"opt.fsdp", "m.fsdp"}, {}, {}},
        {"--ulysses", "// Stage 2 (ulysses.cu)", {"opt.ulysses", "m.ulysses"}, {}, {}},
        {"--ckpt", "// Stage 3 (offload.cu)", {"opt.ckpt"}, {}, {}},
        {"--offload", "// Stage 4 (offload.cu)", {"opt.offload", "m.offload"}, {"block_input_on_host"}, {}},
        {"--chunked", "// Stage 5 (chunked.cu)", {"opt.chunked"}, {}, {}},
        {"--untied[=K]", "// Stage 6 (ulysses.cu)", {"opt.untied", "m.untied"}, {}, {}},
        {"stage 7", "// Stage 7 (beyond/savings.cu)",
         {"opt.vocab_pieces", "opt.one_offload_slot", "opt.grad_in_att_output", "opt.dq_sums_in_staging"}, {}, {}},
        {"--ckpt=selective", "// Selective checkpointing within a host budget",
         {"opt.selective", "m.selective"}, {"attention_on_host", "attention_kept"}, {}},
        {"--doc-mask", "", {"opt.doc_mask", "m.docs"}, {}, {}},
    };
    const std::regex decl("^[A-Za-z_][\\w:<>,\\*& ]*[\\s\\*&](\\w+)\\(");
    Technique* in = nullptr;
    for (const std::string& line : read_lines("llama.h")) {
        if (line.rfind("// ---", 0) == 0) in = nullptr;
        for (Technique& x : t)
            if (!x.section.empty() && line.rfind(x.section, 0) == 0) in = &x;
        std::smatch m;
        if (in && std::regex_search(line, m, decl)) in->functions.insert(m[1].str());
    }
    for (Technique& x : t) x.functions.insert(x.also.begin(), x.also.end());
    return t;
}

// The code of each function of a file: a definition opens at the start of a line and closes with
// a `}` at the start of one; comments removed.
std::map<std::string, std::vector<std::string>> functions_of(const std::string& path) {
    std::map<std::string, std::vector<std::string>> out;
    const std::regex def("^(static\\s+)?(template\\s*<[^>]*>\\s*)?[A-Za-z_][\\w:<>,\\*& ]*[\\s\\*&](\\w+)\\s*\\(");
    const std::vector<std::string> lines = read_lines(path);
    for (size_t i = 0; i < lines.size(); i++) {
        std::smatch m;
        const bool declaration = lines[i].find(';') != std::string::npos && lines[i].find('{') == std::string::npos;
        if (!std::regex_search(lines[i], m, def) || declaration) continue;
        std::vector<std::string> body;
        size_t j = i;
        for (; j < lines.size(); j++) {
            body.push_back(lines[j].substr(0, lines[j].find("//")));
            if (j > i && lines[j].rfind("}", 0) == 0) break;
            if (j == i && lines[j].find('{') != std::string::npos && lines[j].back() == '}') break;  // one line
        }
        out[m[3].str()] = body;
        i = j;
    }
    return out;
}

// Whether code names `name`: a function or member as a word, or `m.x` / `opt.x` as written.
bool names(const std::vector<std::string>& code, const std::string& name) {
    const std::string pattern = name.find('.') != std::string::npos
                                    ? "(^|[^\\w.])(m\\.)?" + std::regex_replace(name, std::regex("\\."), "\\.") + "\\b"
                                    : "(^|[^\\w])" + name + "([^\\w]|$)";
    const std::regex r(pattern);
    for (const std::string& line : code)
        if (std::regex_search(line, r)) return true;
    return false;
}

// Whether code calls function `name` (not a method of that name).
bool calls(const std::vector<std::string>& code, const std::string& name) {
    const std::regex r("(^|[^\\w.>])" + name + "\\s*\\(");
    for (const std::string& line : code)
        if (std::regex_search(line, r)) return true;
    return false;
}

// What of technique t a function's code names.
std::vector<std::string> named(const std::vector<std::string>& code, const Technique& t) {
    std::vector<std::string> out;
    for (const std::string& f : t.functions)
        if (names(code, f)) out.push_back(f);
    for (const std::string& r : t.reads)
        if (names(code, r)) out.push_back(r);
    return out;
}

// llama.cu's step: the functions model_forward_backward and model_forward_loss reach through
// llama.cu's own functions, but step_begin (what each step starts from, one place for all).
std::set<std::string> step_functions(const std::map<std::string, std::vector<std::string>>& fns) {
    std::set<std::string> seen;
    std::vector<std::string> todo = {"model_forward_backward", "model_forward_loss"};
    while (!todo.empty()) {
        const std::string f = todo.back();
        todo.pop_back();
        if (seen.count(f) || f == "step_begin" || !fns.count(f)) continue;
        seen.insert(f);
        for (const auto& [g, code] : fns)
            if (g != f && calls(fns.at(f), g)) todo.push_back(g);
    }
    return seen;
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
    ASSERT_GE(rows.size(), 40u) << "docs/design.md: the table of where each flag changes the step";
    std::map<std::string, std::vector<std::string>> files;
    std::set<std::string> flags;
    for (const IndexRow& r : rows) {
        flags.insert(r.flag);
        if (!files.count(r.file)) files[r.file] = read_lines(r.file);
        ASSERT_FALSE(files[r.file].empty()) << r.file << " (named for " << r.flag << ")";
        std::vector<std::string> code = function_body(files[r.file], r.function);
        EXPECT_FALSE(code.empty()) << r.file << " defines no " << r.function << " (named for " << r.flag << ")";
        if (code.empty()) continue;
        for (std::string& line : code) line = line.substr(0, line.find("//"));  // comments do not count
        EXPECT_FALSE(r.calls.empty()) << r.function << ": its row names nothing";
        for (const std::string& name : r.calls)
            EXPECT_TRUE(names(code, name)) << r.file << " " << r.function << " does not name " << name
                                           << " (the row of " << r.flag << ")";
    }
    for (const Technique& t : techniques()) EXPECT_TRUE(flags.count(t.flag)) << "no row for " << t.flag;
}

// Every function of llama.cu that names a technique (calls a function of its llama.h section or
// reads its flag or state) has its row, listing all it names, and the rows of llama.cu list
// nothing more.
TEST(StepIndex, EveryPlaceLlamaCuNamesATechniqueIsListed) {
    REQUIRE_REPOSITORY();
    std::map<std::pair<std::string, std::string>, std::set<std::string>> listed;  // (flag, function) -> names
    for (const IndexRow& r : step_index())
        if (r.file == "llama.cu") listed[{r.flag, r.function}].insert(r.calls.begin(), r.calls.end());
    const std::vector<Technique> all = techniques();
    for (const Technique& t : all) EXPECT_GE(t.functions.size() + t.reads.size(), 2u) << t.flag << ": llama.h has no section";
    int places = 0;
    for (const auto& [function, code] : functions_of("llama.cu"))
        for (const Technique& t : all) {
            const std::vector<std::string> found = named(code, t);
            if (found.empty()) continue;
            places++;
            std::string row = "| `" + t.flag + "` | `llama.cu` | `" + function + "` |";
            for (const std::string& n : found) row += " `" + n + "`";
            const auto it = listed.find({t.flag, function});
            EXPECT_TRUE(it != listed.end()) << "docs/design.md has no row for " << row;
            if (it == listed.end()) continue;
            for (const std::string& n : found)
                EXPECT_TRUE(it->second.count(n)) << "docs/design.md's row leaves out " << n << ": " << row;
            EXPECT_EQ(it->second.size(), found.size()) << "docs/design.md's row names more than the code: " << row;
            listed.erase(it);
        }
    for (const auto& [key, names] : listed) ADD_FAILURE() << "docs/design.md lists llama.cu " << key.second << " for " << key.first << ", which names none of it";
    EXPECT_GE(places, 20);
}

// A technique reads in two files, its own and the step: the step (llama.cu's functions that
// model_forward_backward and model_forward_loss reach) names it in at most three functions,
// besides step_begin, where each step starts from. Counted in the code.
TEST(StepIndex, EachTechniqueEntersTheStepInAtMostThreeFunctions) {
    REQUIRE_REPOSITORY();
    const auto fns = functions_of("llama.cu");
    const std::set<std::string> step = step_functions(fns);
    ASSERT_GE(step.size(), 15u) << "the step's functions, from model_forward_backward";
    for (const char* f : {"forward_turn", "backward_turn", "layer_forward", "layer_backward", "unit_begin"})
        EXPECT_TRUE(step.count(f)) << f << " is not reached from model_forward_backward";
    int entries = 0;
    for (const Technique& t : techniques()) {
        std::string list;
        int n = 0;
        for (const std::string& f : step)
            if (!named(fns.at(f), t).empty()) list += " " + f, n++;
        EXPECT_LE(n, 3) << t.flag << " enters the step in" << list;
        printf("  %s enters the step in%s\n", t.flag.c_str(), list.c_str());
        entries += n;
    }
    EXPECT_GE(entries, 12);
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
