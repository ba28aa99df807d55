// infra/run.cpp - the run's machinery, which train.cpp's loop stands on: its setup (the input
// files checked, the GPU and the communicators opened, the allocation agreed on every rank, the
// weights), where training starts (resume), and its end. The memory plan and the choices made
// from free memory are infra/plan.cpp; what the run prints and logs, infra/report.cpp.
#include "infra/run.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>

// Errors raised while flags and input files are checked are the same on every rank: rank 0
// alone reports them. Past that point a rank reports its own errors.
bool g_symmetric_phase = true;

const char* FUSED_NEEDS_FAST_KERNELS =
    "--attention fused needs the fast kernels (head dim 128 on an sm_90 GPU); this run would use kernels/attention.cu's";

// The data of a run (the synthetic task, or windows of the token file).
SyntheticData make_data(const Run& r) {
    SyntheticData data(r.o.task, r.o.task_vocab, r.o.seed ^ 0x5eedda7aull);
    data.file = r.token_file.get();
    data.doc_min = r.o.doc_min, data.doc_max = r.o.doc_max;
    return data;
}

// Input files, checked before any GPU work: a bad one is a usage error (exit code 2).
static void open_inputs(Run& r) {
    const Options& o = r.o;
    if (!o.init_from.empty()) check_hf_checkpoint(r.m, o.init_from);
    if (!o.eval_path.empty()) {
        if (!r.eval_file) r.eval_file.reset(new TokenFile(o.eval_path, r.cfg.vocab, "--eval-data"));
        if (r.eval_file->count < (uint64_t)o.seq_len + 1)
            usage_error("--eval-data '" + o.eval_path + "' holds " + std::to_string(r.eval_file->count) +
                        " tokens; a window of --seq-len " + std::to_string(o.seq_len) + " needs " + std::to_string(o.seq_len + 1));
        r.eval = EvalSet{r.eval_file.get(), eval_offsets(r.eval_file->count, o.seq_len, o.eval_windows), o.seq_len,
                         o.batch * r.dp, o.step.doc_mask};
    }
    if (o.data_path.empty()) return;
    if (!r.token_file) r.token_file.reset(new TokenFile(o.data_path, r.cfg.vocab));
    const uint64_t count = r.token_file->count, need = (uint64_t)o.seq_len + 1;
    if (count < need)
        usage_error("--data '" + o.data_path + "' holds " + std::to_string(count) + " tokens; a sequence of --seq-len " +
                    std::to_string(o.seq_len) + " needs " + std::to_string(need));
    // A window starts at any of count - seq_len offsets: fewer than a step's sequences would
    // make every step train on copies of the same window.
    const uint64_t windows = count - (uint64_t)o.seq_len, sequences = (uint64_t)o.batch * r.dp;
    if (windows < sequences)
        usage_error("--data '" + o.data_path + "' holds " + std::to_string(windows) + " distinct window" +
                    (windows > 1 ? "s" : "") + " of --seq-len + 1 tokens, fewer than the " +
                    std::to_string(sequences) + " sequences of one step (--batch x data-parallel GPUs)");
}

// Collectives on every communicator before memory is measured, small and large (NCCL picks
// other kernels and protocols by size, and loads each kernel at its first use): NCCL's memory
// then belongs to the runtime's share, measured, not hidden in our figures.
static void warm_up(Comm* comm, cudaStream_t s, double timeout_s) {
    if (comm->transport != Transport::NCCL) return;
    for (int64_t n : {(int64_t)1024, (int64_t)1 << 24}) {
        float* buf = nullptr;
        const int64_t w = comm->world;
        CUDA_CHECK(cudaMalloc(&buf, 2 * n * w * sizeof(float)));
        CUDA_CHECK(cudaMemset(buf, 0, 2 * n * w * sizeof(float)));
        for (DType t : {DType::F32, DType::BF16}) {
            comm->all_reduce(buf, n, t, s);
            comm->all_gather(buf + n * w, buf, n, t, s);
            comm->reduce_scatter(buf, buf + n * w, n, t, s);
            comm->all_to_all(buf + n * w, buf, n, t, s);
        }
        comm_sync(comm, s, timeout_s);
        CUDA_CHECK(cudaFree(buf));
    }
}

// The GPU, the communicators, and what the runtime holds before our first allocation.
static void open_gpu(Run& r) {
    const Options& o = r.o;
    Model& m = r.m;
    DeviceMemory& dm = r.dm;
    g_symmetric_phase = false;
    const int n_dev = visible_gpus();
    if (n_dev == 0) no_gpu_error("this program trains on NVIDIA GPUs; `./train --plan ...` prints the memory plan without one");
    dm.device = r.launch.local_rank % n_dev;
    CUDA_CHECK(cudaSetDevice(dm.device));
    CUDA_CHECK(cudaFree(0));  // create the context now, so its memory is counted as runtime
    CUDA_CHECK(cudaGetDeviceProperties(&r.prop, dm.device));
    attention_use_reference(o.attention == "reference");
    r.fast_attention = attention_uses_hopper({1, o.seq_len, r.cfg.n_heads, r.cfg.n_kv_heads, r.cfg.head_dim});
    if (o.step.fused_attention && !r.fast_attention) usage_error(FUSED_NEEDS_FAST_KERNELS);
    gemm_init(0, nullptr);  // the cuBLASLt handle; workspace attached after allocation
    CUDA_CHECK(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking));
    size_t free_before_comm = 0, free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_before_comm, &total_b));
    if (r.launch.world > 1 && o.host_comm)
        m.comm = comm_host(r.rank, r.world, r.launch.host_comm_fd, o.comm_timeout_s);
    else if (r.launch.world > 1)
        m.comm = comm_nccl(r.rank, r.world, r.launch.listen_fd, r.launch.master_addr, r.launch.master_port,
                           o.comm_timeout_s);
    else
        m.comm = r.simulated ? comm_fake(r.world, &m) : comm_single();
    m.owns_comm = true;
    m.comm_params = m.comm->split();
    m.watch.timeout_s = o.comm_timeout_s;
    CUDA_CHECK(cudaStreamCreateWithFlags(&m.comm_stream, cudaStreamNonBlocking));
    warm_up(m.comm, r.stream, o.comm_timeout_s);  // each on the stream the step uses it on
    warm_up(m.comm_params, m.comm_stream, o.comm_timeout_s);
    // Ranks that share this GPU (--comm host, the ranks dealt to the GPUs in turn) each count an
    // equal part of it, measured while every rank's context is up and none has allocated yet.
    dm.sharing = o.host_comm ? (r.world - dm.device + n_dev - 1) / n_dev : 1;
    if (dm.sharing > 1) m.comm->barrier();
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    if (dm.sharing > 1) m.comm->barrier();
    r.nccl_gib = ((double)free_before_comm - (double)free_b) / GiB;  // NCCL's buffers
    if (m.comm->transport != Transport::NCCL) r.nccl_gib = 0;
    dm.total_bytes = (int64_t)total_b / dm.sharing;
    dm.runtime_bytes = (int64_t)(total_b - free_b) / dm.sharing;
    dm.cap_bytes = o.mem_cap_gib > 0 ? std::min<int64_t>((int64_t)(o.mem_cap_gib * GiB), dm.total_bytes)
                                     : dm.total_bytes;
    // Emulating rank 0 of N: the cap also holds the NCCL buffers that rank would have (the
    // plan's estimate), so what fits here fits there.
    if (r.simulated) dm.emulated_bytes = (int64_t)(NCCL_OVERHEAD_ESTIMATE_GIB * GiB);
    m.pin_host = o.steps > 0 || !o.eval_path.empty();  // a run of no steps shows the allocation; pinned memory is planned only
}

// Each rank's numbers summed over all ranks, in place, on the device (setup only).
void sum_over_ranks(Comm* comm, std::vector<float>& x, cudaStream_t s, double timeout_s) {
    float* buf = nullptr;
    const size_t bytes = x.size() * sizeof(float);
    CUDA_CHECK(cudaMalloc(&buf, bytes));
    // On s, in order: cudaMemcpy runs on the legacy stream, which s (non-blocking) does not wait for.
    CUDA_CHECK(cudaMemcpyAsync(buf, x.data(), bytes, cudaMemcpyHostToDevice, s));
    comm->all_reduce(buf, (int64_t)x.size(), DType::F32, s);
    CUDA_CHECK(cudaMemcpyAsync(x.data(), buf, bytes, cudaMemcpyDeviceToHost, s));
    comm_sync(comm, s, timeout_s);
    CUDA_CHECK(cudaFree(buf));
}

// The sum over all ranks of one number per rank (a flag, a count).
float sum_over_ranks(Comm* comm, float mine, cudaStream_t s, double timeout_s) {
    std::vector<float> x{mine};
    sum_over_ranks(comm, x, s, timeout_s);
    return x[0];
}

// The smallest of one count per rank (each rank's in its own entry, summed).
int min_over_ranks(const Run& r, int mine) {
    std::vector<float> counts(r.world, 0.f);
    counts[r.rank] = (float)mine;
    sum_over_ranks(r.m.comm, counts, r.stream, r.o.comm_timeout_s);
    return (int)*std::min_element(counts.begin(), counts.end());
}

// Allocate, and agree: an out-of-memory on one rank (a fuller GPU, pinned host memory that ran
// out) ends the run on every rank, reported by the ranks it happened on (once if all).
static int allocate_on_every_rank(Run& r) {
    std::string alloc_error;
    int alloc_code = 0;
    try {
        const std::string hint = r.m.plan.att_device_layers > 0
                                     ? "lower --device-keep-gib (attention outputs kept on the device: " +
                                           std::to_string(r.m.plan.att_device_layers) + " layers)"
                                     : next_stage_hint(r.o, r.world);
        model_allocate(r.m, r.arena, r.dm, hint);
    } catch (const Fatal& f) {
        alloc_error = f.what(), alloc_code = f.code;
    }
    if (r.launch.world == 1) {
        if (alloc_code) throw Fatal(alloc_code, alloc_error);
        return 0;
    }
    const float failed = sum_over_ranks(r.m.comm, alloc_code ? 1.f : 0.f, r.stream, r.o.comm_timeout_s);
    if (failed == 0) return 0;
    if (alloc_code && (failed < r.world || r.rank == 0))
        fprintf(stderr, "%s%s\n", failed < r.world ? ("[rank " + std::to_string(r.rank) + "] ").c_str() : "",
                alloc_error.c_str());
    return alloc_code ? alloc_code : EXIT_OOM;
}

int open_run(Run& r) {
    const Options& o = r.o;
    check_host_memory(r);
    open_inputs(r);
    if (!o.state_dir.empty()) train_state_file(r.m, o.state_dir, r.rank, o.resume, o.steps);  // before the GPU opens
    open_gpu(r);
    if (o.attention == "auto") choose_attention(r);
    keep_attention_on_device(r);
    check_host_memory(r);  // the device's layers may leave fewer inputs to rebuild
    print_attention_plan(r);
    if (r.lead) print_gpu(r);
    if (int code = allocate_on_every_rank(r)) return code;
    if (!o.timeline_path.empty() || !o.trace_path.empty()) timeline_enable(r.m);
    r.m.init_seed = o.seed;  // under --sim-world, also what the other ranks' shards are drawn from
    if (!o.init_from.empty()) load_hf_checkpoint(r.m, o.init_from, r.stream);
    else model_init_weights(r.m, o.seed, r.stream);
    open_log(r);
    return EXIT_OK;
}

// Where training starts: step 0, or the saved state of --resume.
int resume_or_start(Run& r, SyntheticData& data) {
    if (!r.o.resume) return 0;
    int64_t step = 0;
    uint64_t data_state = 0;
    if (!load_train_state(r.m, r.o.state_dir, r.o.steps, &step, &data_state, r.stream)) {
        if (r.lead) printf("no training state in %s yet: starting at step 0\n", r.o.state_dir.c_str());
        return 0;
    }
    data.state = data_state;
    if (r.lead) printf("resumed from %s at step %d\n", r.o.state_dir.c_str(), (int)step);
    return (int)step;
}

// After the last step: the files asked for, then the GPU's resources back.
void finish(Run& r) {
    const Options& o = r.o;
    print_ranks(r);
    if (r.log) fclose(r.log);
    if (r.lead && !o.timeline_path.empty()) write_timeline(o.timeline_path, timeline_read(r.m));
    if (r.lead && !o.trace_path.empty())
        write_trace(o.trace_path, command_line(o) + " (" + r.prop.name + ")", timeline_read(r.m),
                    model_memory_trace(r.m, r.arena));
    if (r.lead && !o.mem_trace_path.empty())
        write_mem_trace(o, r.prop.name, r.m, r.arena, r.dm.driver_used_bytes() / GiB);
    if (!o.save_to.empty()) {
        save_hf_checkpoint(r.m, o.save_to, o.save_dtype == "bf16", r.stream);
        if (r.lead) printf("saved a Hugging Face checkpoint (%s) to %s\n", o.save_dtype.c_str(), o.save_to.c_str());
    }
    gemm_destroy();
    model_free(r.m, r.dm);
}

// ./train --nproc N: what every rank would refuse alike (flags, shapes, input files) is said once,
// here, before any process starts.
void check_before_launch(const Options& o) {
    Run r;
    r.o = o;
    r.launch.world = o.nproc;
    plan_run(r);
    check_host_memory(r);
    open_inputs(r);
    if (!o.state_dir.empty())  // every rank's file, before any process starts
        for (int rank = 0; rank < o.nproc; rank++) train_state_file(r.m, o.state_dir, rank, o.resume, o.steps);
    const int visible = visible_gpus();  // none: each process says so in one line (no_gpu_error)
    if (visible > 0 && visible < o.nproc && !o.host_comm)
        usage_error("--nproc " + std::to_string(o.nproc) + " starts one process per GPU, but this machine shows " +
                    std::to_string(visible) + " GPU" + (visible > 1 ? "s" : "") +
                    " (CUDA_VISIBLE_DEVICES); --comm host runs the processes on fewer GPUs, --sim-world " +
                    std::to_string(o.nproc) + " runs rank 0's share of that many on one");
    if (o.host_comm && o.nproc > HOST_COMM_MAX_RANKS)
        usage_error("--comm host runs at most " + std::to_string(HOST_COMM_MAX_RANKS) + " processes");
}
