// tests/fuzz/fuzz_outputs.cpp - fuzz target: check_output_path and check_distinct
// (io/output_paths.h), the checks of every path a run writes, on file systems the input builds.
//
// An input is a small tree in a fresh folder (regular files, folders, symbolic links absolute,
// relative, dangling or looping, hard links, FIFOs, sockets, a name of 300 bytes) and a few paths
// of flags that read a file, write a file, write into a folder or clear a folder, each spelled
// one of several ways (./, //, d/../, relative, a trailing slash, over PATH_MAX). The oracle
// judges by doing, not by the checks' rules:
//   * a file path accepted for writing opens for writing (O_CREAT, non-blocking) as a regular
//     file, and was no dangling or looping link; a folder path accepted is a folder or can be
//     made; a folder to clear is a folder and no link; a refused path fails one of those, or
//     has a part over NAME_MAX or the whole over PATH_MAX, or a file's name ends in '/';
//   * the accepted paths, the files among them made where new, are refused together exactly when
//     two of different flags, one of them writing, open the same inode, or a file lies in a
//     folder another flag clears (its links resolved); a read path the kernel refuses as too
//     long names neither;
//   * every refusal is a usage error naming the flag (both flags, for two paths).
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "io/output_paths.h"
#include "oracle.h"

namespace {

struct Input {
    const uint8_t* data;
    size_t size, at = 0;
    uint8_t next() { return at < size ? data[at++] : 0; }
};

const std::string LONG(300, 'l');
const char* const NAMES[] = {"a", "b", "c", "d", "d/x", "d/y", "d/e", "d/e/z", "step-1", "step-1/r", LONG.c_str()};
const int NUM_NAMES = sizeof NAMES / sizeof NAMES[0];
const char* const FLAGS[] = {"--log", "--dump", "--data", "--save-to", "--state-dir", "--eval-data"};

int remove_entry(const char* path, const struct stat*, int, struct FTW*) { return remove(path); }

// The folder every input builds in, made at the first and removed when the fuzzer ends.
std::string base_folder() {
    static std::string base;
    if (base.empty()) {
        char templ[] = "/tmp/fuzz_outputs_XXXXXX";
        if (!mkdtemp(templ)) oracle_fail("cannot make a folder under /tmp");
        base = templ;
        atexit([] { nftw(base.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS); });
    }
    return base;
}

// A fresh, empty folder to build in, the working folder too (for relative paths).
std::string fresh_folder() {
    const std::string w = base_folder() + "/w";
    if (chdir(base_folder().c_str()) != 0) oracle_fail("cannot enter the fuzzing folder");
    nftw(w.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    if (mkdir(w.c_str(), 0755) != 0 || chdir(w.c_str()) != 0) oracle_fail("cannot make " + w);
    return w;
}

void make_socket(const std::string& path) {
    sockaddr_un a{};
    if (path.size() >= sizeof a.sun_path) return;
    const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    a.sun_family = AF_UNIX;
    strcpy(a.sun_path, path.c_str());
    bind(fd, (sockaddr*)&a, sizeof a);
    close(fd);
}

// One entry of the tree, of a kind the input picks (a failure, as under a missing folder, is fine).
void make_entry(Input& in, const std::string& w) {
    const std::string path = w + "/" + NAMES[in.next() % NUM_NAMES], target = NAMES[in.next() % NUM_NAMES];
    switch (in.next() % 8) {
        case 0: close(open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644)); break;
        case 1: mkdir(path.c_str(), 0755); break;
        case 2: symlink((w + "/" + target).c_str(), path.c_str()); break;
        case 3: symlink(target.c_str(), path.c_str()); break;  // relative to the link's folder
        case 4: link((w + "/" + target).c_str(), path.c_str()); break;
        case 5: mkfifo(path.c_str(), 0644); break;
        case 6: make_socket(path); break;
        case 7: symlink(path.c_str(), path.c_str()); break;
    }
}

std::string spelled(Input& in, const std::string& w, const std::string& name, bool reads) {
    switch (in.next() % 8) {
        case 1: return w + "/./" + name;
        case 2: return w + "//" + name;
        case 3: return w + "/d/../" + name;
        case 4: return reads ? w + "/" + name : w + "/" + name + "/";
        case 5: return reads ? name : w + "/" + name + "/.";
        case 6: return name;
        case 7: {
            std::string p = w + "/";
            while (p.size() < PATH_MAX + 8) p += "./";
            return p + name;
        }
    }
    return w + "/" + name;
}

bool too_long(const std::string& path) {
    if (path.size() >= PATH_MAX) return true;
    size_t part = 0;
    for (char c : path) {
        part = c == '/' ? 0 : part + 1;
        if (part > NAME_MAX) return true;
    }
    return false;
}

// The entry a path names itself, not what a link there leads to (a trailing slash would follow it).
std::string entry(std::string path) {
    while (path.size() > 1 && path.back() == '/') path.pop_back();
    return path;
}

bool dangles(const std::string& path) {
    struct stat st;
    return lstat(entry(path).c_str(), &st) == 0 && S_ISLNK(st.st_mode) && stat(path.c_str(), &st) != 0;
}

// Whether the run could write p, found by trying (anything made is taken away again).
bool writable(const RunPath& p) {
    if (too_long(p.path) || dangles(p.path)) return false;
    struct stat st;
    const bool there = lstat(entry(p.path).c_str(), &st) == 0;
    if (p.use == RunPath::WRITES_FILE) {
        if (p.path.back() == '/') return false;
        const int fd = open(p.path.c_str(), O_WRONLY | O_CREAT | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, 0644);
        const bool ok = fd >= 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
        if (fd >= 0) close(fd);
        if (ok && !there) unlink(p.path.c_str());
        return ok;
    }
    if (p.use == RunPath::CLEARS_FOLDER && there && S_ISLNK(st.st_mode)) return false;
    if (stat(p.path.c_str(), &st) == 0) return S_ISDIR(st.st_mode);
    const bool made = mkdir(p.path.c_str(), 0755) == 0;
    if (made) rmdir(p.path.c_str());
    return made;
}

bool names(const Fatal& f, const std::string& flag) {
    return f.code == EXIT_USAGE && std::string(f.what()).find(flag) != std::string::npos;
}

// A path of the distinctness oracle: the inode a file path opens (made where it is new and its
// folder is there), the folder its links resolve into, a cleared folder's own inode. What is
// there before any file is made decides: a link that dangled then names no file, and a cleared
// folder is one that was a folder then (a file made since may be where either points).
struct Opened {
    bool file = false, cleared = false, dangled = false, has_id = false, has_folder = false;
    dev_t dev = 0, folder_dev = 0;
    ino_t ino = 0, folder_ino = 0;
};

Opened before_files_are_made(const RunPath& p) {
    Opened o;
    o.file = p.use == RunPath::READS || p.use == RunPath::WRITES_FILE;
    o.cleared = p.use == RunPath::CLEARS_FOLDER;
    o.dangled = dangles(p.path);
    struct stat st;
    if (o.cleared && stat(p.path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) o.has_id = true, o.dev = st.st_dev, o.ino = st.st_ino;
    return o;
}

void open_file(const RunPath& p, Opened& o) {
    struct stat st;
    if (!o.file || too_long(p.path)) return;  // a name no call can open names no file and no folder
    if (lstat(p.path.c_str(), &st) != 0 && errno == ENOENT)
        close(open(p.path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0644));  // fails where the folder is missing
    const int fd = o.dangled ? -1 : open(p.path.c_str(), O_PATH | O_CLOEXEC);
    if (fd >= 0 && fstat(fd, &st) == 0) o.has_id = true, o.dev = st.st_dev, o.ino = st.st_ino;
    if (fd >= 0) close(fd);
    // The folder of what the path leads to; of the name itself where it leads nowhere.
    std::string folder;
    char* real = o.dangled ? nullptr : realpath(p.path.c_str(), nullptr);
    if (real) {
        folder = real;
        free(real);
        folder = folder.substr(0, std::max<size_t>(1, folder.rfind('/')));
    } else {
        const std::string name = entry(p.path);
        folder = name.find('/') == std::string::npos ? "." : name.substr(0, std::max<size_t>(1, name.rfind('/')));
    }
    if (stat(folder.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
        o.has_folder = true, o.folder_dev = st.st_dev, o.folder_ino = st.st_ino;
}

// Whether check_distinct must refuse the paths, and the flags of the first pair that says so.
bool must_refuse(const std::vector<RunPath>& paths, const std::vector<Opened>& o, std::string* a, std::string* b) {
    for (size_t i = 0; i < paths.size(); i++)
        for (size_t j = 0; j < paths.size(); j++) {
            if (i == j || paths[i].flag == paths[j].flag) continue;
            const bool writes = paths[i].use == RunPath::WRITES_FILE || paths[j].use == RunPath::WRITES_FILE;
            const bool same = o[i].file && o[j].file && writes && o[i].has_id && o[j].has_id && o[i].dev == o[j].dev &&
                              o[i].ino == o[j].ino;
            const bool inside = o[i].cleared && o[i].has_id && o[j].file && o[j].has_folder &&
                                o[i].dev == o[j].folder_dev && o[i].ino == o[j].folder_ino;
            if (same || inside) return *a = paths[i].flag, *b = paths[j].flag, true;
        }
    return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    Input in{data, size};
    const std::string w = fresh_folder();
    for (int n = in.next() % 12; n > 0; n--) make_entry(in, w);
    std::vector<RunPath> accepted;
    for (int n = 1 + in.next() % 5; n > 0; n--) {
        const RunPath::Use use = (RunPath::Use)(in.next() % 4);
        const std::string name = NAMES[in.next() % NUM_NAMES];
        const RunPath p{FLAGS[in.next() % 6], spelled(in, w, name, use == RunPath::READS), use};
        const bool ok = p.use == RunPath::READS || writable(p);
        try {
            check_output_path(p);
        } catch (const Fatal& f) {
            if (!names(f, p.flag)) oracle_fail("a refusal not a usage error naming " + p.flag + ": " + f.what());
            if (ok) oracle_fail("refused a path the run can write: " + std::string(f.what()));
            continue;
        }
        if (!ok) oracle_fail("accepted a path the run cannot write: " + p.flag + " '" + p.path + "'");
        accepted.push_back(p);
    }
    std::string refusal;
    try {
        check_distinct(accepted);
    } catch (const Fatal& f) {
        refusal = f.what();
        if (f.code != EXIT_USAGE) oracle_fail("check_distinct refused with exit code " + std::to_string(f.code));
    }
    std::vector<Opened> opened;
    for (const RunPath& p : accepted) opened.push_back(before_files_are_made(p));
    for (size_t i = 0; i < accepted.size(); i++) open_file(accepted[i], opened[i]);
    std::string a, b;
    const bool refuse = must_refuse(accepted, opened, &a, &b);
    if (refuse && refusal.empty()) oracle_fail(a + " and " + b + " share a file, and were accepted together");
    if (!refuse && !refusal.empty()) oracle_fail("refused paths that share no file: " + refusal);
    int named = 0;
    for (const char* flag : FLAGS) named += refusal.find(flag) != std::string::npos;
    if (refuse && named < 2) oracle_fail("a refusal that does not name both flags: " + refusal);
    return 0;
}
