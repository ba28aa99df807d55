// io/output_paths.cpp - the checks of output_paths.h: whether each path a run writes can be
// written, and that none is another flag's file.
#include "io/output_paths.h"

#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "io/input_files.h"

namespace {

bool is_folder_use(const RunPath& p) { return p.use == RunPath::WRITES_FOLDER || p.use == RunPath::CLEARS_FOLDER; }
bool is_file_use(const RunPath& p) { return p.use == RunPath::READS || p.use == RunPath::WRITES_FILE; }

// The path without its trailing slashes ("/" stays), its folder and its last part.
std::string trimmed(const std::string& path) {
    size_t end = path.size();
    while (end > 1 && path[end - 1] == '/') end--;
    return path.substr(0, end);
}
std::string folder_of(const std::string& path) {
    const std::string p = trimmed(path);
    const size_t slash = p.find_last_of('/');
    return slash == std::string::npos ? "." : slash == 0 ? "/" : p.substr(0, slash);
}
std::string name_of(const std::string& path) {
    const std::string p = trimmed(path);
    return p.substr(p.find_last_of('/') + 1);  // npos + 1 == 0
}

// Why the kernel would refuse the name ("" if it would not): a part over NAME_MAX bytes, or the
// whole of PATH_MAX bytes or more (the limit counts the terminating zero).
std::string too_long(const std::string& path) {
    if (path.size() >= PATH_MAX)
        return std::to_string(path.size()) + " bytes long, over the " + std::to_string(PATH_MAX - 1) +
               " a path may have";
    for (size_t start = 0; start < path.size();) {
        size_t end = path.find('/', start);
        if (end == std::string::npos) end = path.size();
        if (end - start > NAME_MAX)
            return "its part '" + path.substr(start, 16) + "...' is " + std::to_string(end - start) +
                   " bytes long, over the " + std::to_string(NAME_MAX) + " a name may have";
        start = end + 1;
    }
    return "";
}

// An entry that is there (st: what its links lead to): of the kind written, and writable.
std::string existing_entry_fault(const RunPath& p, const struct stat& st) {
    const bool folder = is_folder_use(p);
    if (folder && !S_ISDIR(st.st_mode)) return " is not a folder";
    if (!folder && !S_ISREG(st.st_mode)) return " is " + not_a_file(st);
    if (access(p.path.c_str(), folder ? W_OK | X_OK : W_OK) != 0) return " is not writable (" + std::string(strerror(errno)) + ")";
    return "";
}

// A name that is not there yet: its folder is there, a folder, and writable.
std::string new_name_fault(const RunPath& p) {
    const std::string folder = folder_of(p.path);
    struct stat st;
    if (stat(folder.c_str(), &st) != 0) {
        const int err = errno;
        if (err == ENOENT && lstat(folder.c_str(), &st) != 0) return ": the folder '" + folder + "' does not exist";
        return ": the folder '" + folder + "': " + stat_failure(folder, err);
    }
    if (!S_ISDIR(st.st_mode)) return ": '" + folder + "' is not a folder";
    if (access(folder.c_str(), W_OK | X_OK) != 0)
        return ": the folder '" + folder + "' is not writable (" + std::string(strerror(errno)) + ")";
    return "";
}

std::string output_fault(const RunPath& p) {
    if (std::string why = too_long(p.path); !why.empty()) return ": " + why;
    if (!is_folder_use(p) && p.path.back() == '/') return " ends in '/', as a folder's name does, not a file's";
    // The entry itself, a link not followed (lstat follows one that a trailing slash ends).
    struct stat st;
    if (lstat(trimmed(p.path).c_str(), &st) != 0) return errno == ENOENT ? new_name_fault(p) : ": " + stat_failure(p.path, errno);
    if (p.use == RunPath::CLEARS_FOLDER && S_ISLNK(st.st_mode))
        return " is a symbolic link: the files of the folder it leads to would be removed with the step folders";
    if (stat(p.path.c_str(), &st) != 0) return ": " + stat_failure(p.path, errno);
    return existing_entry_fault(p, st);
}

// A path of check_distinct: what it names, and the folder that holds what it leads to.
struct Known {
    const RunPath* p;
    bool named, held;
    FileId id, folder;
};

bool identify_folder(const std::string& path, FileId* id) {
    // A name the kernel refuses leads nowhere: the run cannot open it (realpath, which walks the
    // parts itself, would still resolve an over-long name whose file exists).
    if (!too_long(path).empty()) return false;
    char* real = realpath(path.c_str(), nullptr);  // a new name: its folder is the given one
    const std::string resolved = real ? real : path;
    free(real);
    struct stat st;
    if (stat(folder_of(resolved).c_str(), &st) != 0) return false;
    *id = {st.st_dev, st.st_ino, ""};
    return true;
}

std::string quoted(const RunPath& p) { return p.flag + " '" + p.path + "'"; }

// The usage error for two paths of different flags, or nothing where they may go together.
void refuse_pair(const Known& a, const Known& b) {
    const bool writes = a.p->use == RunPath::WRITES_FILE || b.p->use == RunPath::WRITES_FILE;
    if (is_file_use(*a.p) && is_file_use(*b.p) && writes && a.named && b.named && a.id == b.id) {
        const Known& w = a.p->use == RunPath::WRITES_FILE ? a : b;
        const Known& other = &w == &a ? b : a;
        if (other.p->use == RunPath::READS)
            usage_error(quoted(*w.p) + " is the file " + quoted(*other.p) + " reads: a run never writes what it reads");
        usage_error(quoted(*a.p) + " and " + quoted(*b.p) + " are the same file: each output needs its own");
    }
    for (const auto& [cleared, file] : {std::make_pair(&a, &b), std::make_pair(&b, &a)})
        if (cleared->p->use == RunPath::CLEARS_FOLDER && is_file_use(*file->p) && cleared->named &&
            file->held && cleared->id == file->folder)
            usage_error(quoted(*file->p) + " is in " + quoted(*cleared->p) + ", a folder whose files a later save of " +
                        cleared->p->flag + " removes");
}

}  // namespace

void check_output_path(const RunPath& p) {
    if (p.use == RunPath::READS) return;
    if (p.path.empty()) usage_error(p.flag + " needs a path, got an empty one");
    if (std::string why = output_fault(p); !why.empty()) usage_error(quoted(p) + why);
}

bool identify(const std::string& path, FileId* id) {
    struct stat st;
    if (stat(path.c_str(), &st) == 0) {
        *id = {st.st_dev, st.st_ino, ""};
        return true;
    }
    if (errno != ENOENT || lstat(trimmed(path).c_str(), &st) == 0) return false;  // a dangling link names no new file
    if (stat(folder_of(path).c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return false;
    *id = {st.st_dev, st.st_ino, name_of(path)};
    return true;
}

void check_distinct(const std::vector<RunPath>& paths) {
    std::vector<Known> known;
    for (const RunPath& p : paths) {
        if (p.use == RunPath::WRITES_FOLDER) continue;
        Known k{&p, false, false, {}, {}};
        k.named = identify(p.path, &k.id);
        k.held = identify_folder(p.path, &k.folder);
        known.push_back(k);
    }
    for (size_t i = 0; i < known.size(); i++)
        for (size_t j = i + 1; j < known.size(); j++)
            if (known[i].p->flag != known[j].p->flag) refuse_pair(known[i], known[j]);
}
