// io/outputs.cpp - the files a run writes besides its log: --timeline, --trace, --mem-trace, --dump;
// and the check, before any work, of every path the run writes (check_outputs).
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "infra/memory.h"
#include "infra/timeline.h"
#include "infra/train.h"
#include "io/output_paths.h"

// The paths one path flag reads or writes, by its role in the flags table.
static std::vector<RunPath> paths_of(const PathFlag& f) {
    switch (f.role) {
        case PathRole::READS_FILE: return {{f.name, f.value, RunPath::READS}};
        case PathRole::READS_CHECKPOINT: return hf_checkpoint_reads(f.name, f.value);
        case PathRole::WRITES_FILE: return {{f.name, f.value, RunPath::WRITES_FILE}};
        case PathRole::WRITES_CHECKPOINT: return hf_checkpoint_writes(f.name, f.value);
        case PathRole::WRITES_STATE: return train_state_writes(f.name, f.value);
    }
    return {};
}

// An output may be written only at the end of a long run, and one that is an input would destroy
// it (a log opened over the token file truncates it under the run): both are found here, first.
void check_outputs(const Options& o, bool lead) {
    std::vector<RunPath> paths;
    for (const PathFlag& f : path_flags(o)) {
        if (f.value.empty() || (!lead && f.role != PathRole::WRITES_STATE)) continue;  // every rank writes its state
        for (const RunPath& p : paths_of(f)) paths.push_back(p);
    }
    for (const RunPath& p : paths) check_output_path(p);
    if (lead) check_distinct(paths);
}

FILE* open_output(const std::string& path, const char* flag) {
    if (path.empty()) return nullptr;
    FILE* f = fopen(path.c_str(), "w");
    if (!f) usage_error(std::string("cannot write ") + flag + " file '" + path + "': " + strerror(errno));
    return f;
}

std::string technique_flags(const StepOptions& s) {
    std::string flags;
    if (s.fsdp) flags += " --fsdp";
    if (s.ulysses) flags += " --ulysses";
    if (s.ckpt) flags += s.selective ? " --ckpt=selective" : " --ckpt";
    if (s.offload) flags += " --offload";
    if (s.chunked) flags += " --chunked";
    if (s.untied) flags += " --untied=" + std::to_string(s.untied);
    if (s.vocab_pieces != 1) flags += s.vocab_pieces ? " --vocab-pieces=" + std::to_string(s.vocab_pieces) : " --vocab-pieces";
    if (s.one_offload_slot) flags += " --one-offload-slot";
    if (s.grad_in_att_output) flags += " --grad-in-att-output";
    if (s.dq_sums_in_staging) flags += " --dq-sums-in-staging";
    return flags.empty() ? "" : flags.substr(1);
}

void write_timeline(const std::string& path, const std::vector<TimelineEntry>& tl) {
    FILE* f = open_output(path, "--timeline");
    fprintf(f, "[\n");
    for (size_t i = 0; i < tl.size(); i++)
        fprintf(f,
                "  {\"stream\": \"%s\", \"what\": \"%s\", \"layer\": %d, \"start_ms\": %.4f, \"end_ms\": %.4f, "
                "\"bytes\": %lld}%s\n",
                tl[i].stream.c_str(), tl[i].what.c_str(), tl[i].layer, tl[i].start_ms, tl[i].end_ms,
                (long long)tl[i].bytes, i + 1 < tl.size() ? "," : "");
    fprintf(f, "]\n");
    fclose(f);
}

// --trace: Chrome's trace-event format (the "JSON object" form), which Perfetto and
// chrome://tracing open. One process, one track per stream in the order the step uses them;
// each mark a complete event ("X", microseconds from the step's start) named by what it does and
// its layer (FSDP's marks: its unit), with its bytes; the memory per category at each progress
// point a counter track ("C", GiB). Marks of one stream nest, as the viewers expect.
void write_trace(const std::string& path, const std::string& title, const std::vector<TimelineEntry>& tl,
                 const std::vector<MemTracePoint>& memory) {
    FILE* f = open_output(path, "--trace");
    const char* tracks[] = {"compute", "fsdp", "copy"};
    auto track_of = [&](const std::string& stream) {
        for (int k = 0; k < 3; k++)
            if (stream == tracks[k]) return k;
        return 3;
    };
    fprintf(f, "{\"displayTimeUnit\": \"ms\", \"otherData\": {\"command\": \"%s\"}, \"traceEvents\": [\n",
            json_escape(title).c_str());
    fprintf(f, "  {\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 1, \"args\": {\"name\": \"the last step\"}}");
    for (int k = 0; k < 3; k++)
        fprintf(f, ",\n  {\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 1, \"tid\": %d, \"args\": {\"name\": \"%s\"}}",
                k, tracks[k]);
    for (const TimelineEntry& e : tl) {
        const bool unit = e.stream == "fsdp";  // FSDP's marks hold the unit, not a layer
        std::string name = e.what;
        if (e.layer >= 0) name += (unit ? " unit " : " ") + std::to_string(e.layer);
        fprintf(f, ",\n  {\"name\": \"%s\", \"cat\": \"%s\", \"ph\": \"X\", \"ts\": %.3f, \"dur\": %.3f, \"pid\": 1, "
                   "\"tid\": %d, \"args\": {\"what\": \"%s\", \"%s\": %d, \"bytes\": %lld}}",
                json_escape(name).c_str(), json_escape(e.stream).c_str(), e.start_ms * 1000,
                (e.end_ms - e.start_ms) * 1000, track_of(e.stream), json_escape(e.what).c_str(),
                unit ? "unit" : "layer", e.layer, (long long)e.bytes);
    }
    for (const MemTracePoint& p : memory) {
        fprintf(f, ",\n  {\"name\": \"memory (GiB)\", \"ph\": \"C\", \"ts\": %.3f, \"pid\": 1, \"args\": {", p.t_ms * 1000);
        for (int c = 0; c < MEM_NUM_CATEGORIES; c++) fprintf(f, "%s\"%s\": %.4f", c ? ", " : "", mem_category_name(c), p.live[c] / GiB);
        fprintf(f, ", \"host pinned\": %.4f}}", p.host / GiB);
    }
    fprintf(f, "\n]}\n");
    if (fclose(f) != 0) runtime_error("writing --trace file '" + path + "' failed");
}

// --mem-trace: one JSON line for the run, then one per progress event of the last step.
void write_mem_trace(const Options& o, const char* gpu, const Model& m, const Arena& arena, double driver_gib) {
    FILE* f = open_output(o.mem_trace_path, "--mem-trace");
    fprintf(f, "{\"type\": \"mem_trace_run\", \"command\": \"%s\", \"gpu\": \"%s\", \"config\": \"%s\", "
               "\"layers\": %d, \"seq_len\": %lld, \"flags\": \"%s\"}\n",
            json_escape(command_line(o)).c_str(), gpu, m.cfg.name.c_str(), m.cfg.n_layers, (long long)o.seq_len,
            technique_flags(m.opt).c_str());
    for (const MemTracePoint& p : model_memory_trace(m, arena)) {
        fprintf(f, "{\"type\": \"mem_trace\", \"point\": \"%s\", \"layer\": %d, \"t_ms\": %.3f, \"live_gib\": {",
                p.point.c_str(), p.layer, p.t_ms);
        for (int c = 0; c < MEM_NUM_CATEGORIES; c++)
            fprintf(f, "%s\"%s\": %.4f", c ? ", " : "", mem_category_name(c), p.live[c] / GiB);
        fprintf(f, "}, \"host_gib\": %.4f, \"arena_gib\": %.4f, \"driver_gib\": %.4f}\n", p.host / GiB,
                arena.total() / GiB, driver_gib);
    }
    fclose(f);
}

void write_dump(const std::string& path, double loss, const std::vector<float>& grads) {
    FILE* f = open_output(path, "--dump");
    const char magic[8] = {'L', 'L', 'G', 'R', 'A', 'D', '0', '1'};
    int64_t n = (int64_t)grads.size();
    bool ok = fwrite(magic, 8, 1, f) == 1 && fwrite(&loss, 8, 1, f) == 1 && fwrite(&n, 8, 1, f) == 1 &&
              fwrite(grads.data(), 4, grads.size(), f) == grads.size();
    if (fclose(f) != 0 || !ok) runtime_error("writing --dump file '" + path + "' failed");
}
