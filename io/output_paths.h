// io/output_paths.h - where a run writes, checked before it starts: each path a flag writes can
// be written, and none is a file that another flag reads or writes. io/outputs.cpp gathers the
// paths from the flags (check_outputs); this is host code only, so the fuzz target
// tests/fuzz/fuzz_outputs.cpp builds it without CUDA.
//
// A day-long run that dies at its first save, or truncates its own training data when it opens
// its log, has lost the day: whatever can be known from the file system before the GPU opens
// is known then. Every refusal is a usage error (exit code 2) naming the flag.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

// A path a run reads or writes, and the flag it comes from.
struct RunPath {
    enum Use {
        READS,          // a file the run reads
        WRITES_FILE,    // a file the run writes (or replaces, or removes)
        WRITES_FOLDER,  // a folder the run writes files into (made if new)
        CLEARS_FOLDER,  // an existing folder whose files a later write of the run removes
    };
    std::string flag, path;
    Use use = READS;
};

// A usage error naming p.flag unless what p writes can be written there:
//   * the name is one the kernel takes: no part over NAME_MAX bytes, the whole under PATH_MAX;
//   * no symbolic link on the way dangles or loops (a folder to clear is no link at all: the
//     files of the folder it leads to would go);
//   * an existing entry is of the kind written (a regular file; a folder for a folder), and
//     writable; a new name's folder exists and is writable; a file's name does not end in '/'.
// A path that is read (READS) is the reader's to check: nothing is done here.
void check_output_path(const RunPath& p);

// A usage error naming both flags where what one flag writes is what another reads or writes:
// the same file by identity (device and inode, so hard links and symbolic links count; a name
// not there yet by its folder's identity and its name), or a file inside a folder another flag
// clears. Folders that are written (WRITES_FOLDER) are compared through their files, listed on
// their own.
void check_distinct(const std::vector<RunPath>& paths);

// What a path names: the file or folder it leads to (links followed), or a name not there yet
// by its folder and its name. False where it is neither (a dangling link, a missing folder).
struct FileId {
    dev_t dev = 0;
    ino_t ino = 0;
    std::string name;  // "" for an existing file or folder
    bool operator==(const FileId& o) const { return dev == o.dev && ino == o.ino && name == o.name; }
};
bool identify(const std::string& path, FileId* id);
