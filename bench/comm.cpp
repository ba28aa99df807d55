// bench/comm.cpp - the communicators' bandwidth: each collective the step uses, timed over N
// processes started the way ./train --nproc N starts them (infra/launch.cpp), over NCCL or the
// host transport (--comm host: the processes share the visible GPUs).
//
//   build/bench_comm --nproc N [--comm nccl|host] [--mib 1,16,256] [--reps 5]
//
// For each size (MiB of one rank's send buffer) and collective: the median wall time of `reps`
// runs after one warm-up, each ended by a stream synchronization, and the bus bandwidth as NCCL's
// tests count it: the bytes one rank moves over its link, (N - 1) / N of the buffer for
// all-gather, reduce-scatter and all-to-all, twice that for all-reduce.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "../llama.h"
#include "../infra/train.h"

namespace {

struct BenchOptions {
    int nproc = 2;
    bool host = false;
    std::vector<int64_t> mib = {1, 16, 256};
    int reps = 5;
};

BenchOptions parse(int argc, char** argv) {
    BenchOptions o;
    for (int i = 1; i < argc; i++) {
        const std::string flag = argv[i];
        if (i + 1 >= argc) usage_error(flag + " needs a value (usage in bench/comm.cpp's header)");
        const std::string v = argv[++i];
        if (flag == "--nproc") o.nproc = std::atoi(v.c_str());
        else if (flag == "--comm" && (v == "nccl" || v == "host")) o.host = v == "host";
        else if (flag == "--reps") o.reps = std::atoi(v.c_str());
        else if (flag == "--mib") {
            o.mib.clear();
            for (const std::string& m : split_commas(v)) o.mib.push_back(std::atoll(m.c_str()));
        } else usage_error("unknown flag or value: " + flag + " " + v);
    }
    if (o.nproc < 2 || o.reps < 1 || o.mib.empty() || *std::min_element(o.mib.begin(), o.mib.end()) < 1)
        usage_error("--nproc of 2 or more, --reps of 1 or more and sizes of 1 MiB or more");
    return o;
}

double seconds_of(Comm* comm, cudaStream_t s, int reps, const std::function<void()>& collective) {
    collective();  // warm-up
    CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<double> t;
    for (int i = 0; i < reps; i++) {
        const auto t0 = std::chrono::steady_clock::now();
        collective();
        comm_sync(comm, s, 600);
        t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

int rank_main(const BenchOptions& o, const Launch& l) {
    int gpus = 0;
    CUDA_CHECK(cudaGetDeviceCount(&gpus));
    CUDA_CHECK(cudaSetDevice(l.local_rank % gpus));
    cudaStream_t s;
    CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    Comm* comm = o.host ? comm_host(l.rank, l.world, l.host_comm_fd, 600)
                        : comm_nccl(l.rank, l.world, l.listen_fd, l.master_addr, l.master_port, 600);
    const int64_t most = *std::max_element(o.mib.begin(), o.mib.end()) << 20;
    char *in = nullptr, *out = nullptr;
    CUDA_CHECK(cudaMalloc(&in, most));
    CUDA_CHECK(cudaMalloc(&out, most * l.world));
    CUDA_CHECK(cudaMemset(in, 0, most));
    if (l.rank == 0)
        printf("%d ranks on %d GPU%s, %s: bus bandwidth GB/s (median of %d, wall time)\n%8s %12s %15s %12s %12s\n",
               l.world, std::min(gpus, l.world), gpus > 1 ? "s" : "", transport_name(comm->transport), o.reps, "MiB",
               "all-gather", "reduce-scatter", "all-reduce", "all-to-all");
    const double share = (l.world - 1.0) / l.world;
    for (int64_t mib : o.mib) {
        const int64_t bytes = mib << 20, n = bytes / 4 / l.world;  // fp32, the buffer in world pieces
        const double gather = seconds_of(comm, s, o.reps, [&] { comm->all_gather(out, in, n * l.world, DType::F32, s); });
        const double scatter = seconds_of(comm, s, o.reps, [&] { comm->reduce_scatter(out, in, n, DType::F32, s); });
        const double reduce = seconds_of(comm, s, o.reps, [&] { comm->all_reduce(in, n * l.world, DType::F32, s); });
        const double a2a = seconds_of(comm, s, o.reps, [&] { comm->all_to_all(out, in, n, DType::F32, s); });
        // all-gather: each rank's `bytes` go to every other rank; the others: its buffer of `bytes`.
        if (l.rank == 0)
            printf("%8lld %12.2f %15.2f %12.2f %12.2f\n", (long long)mib, bytes * (l.world - 1.0) / gather / 1e9,
                   bytes * share / scatter / 1e9, 2 * bytes * share / reduce / 1e9, bytes * share / a2a / 1e9);
    }
    CUDA_CHECK(cudaFree(in));
    CUDA_CHECK(cudaFree(out));
    delete comm;
    return EXIT_OK;
}

}  // namespace

int main(int argc, char** argv) {
    return exit_code_of("bench_comm", [&] {
        const BenchOptions o = parse(argc, argv);
        const Launch l = launch_from_env();
        if (l.world == 1) return launch_local(o.nproc, argv, o.host);
        return rank_main(o, l);
    });
}
