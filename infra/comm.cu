// infra/comm.cu - the communicator: everything that crosses GPUs goes through one of these.
//
//   NcclComm   one process per GPU, NCCL collectives (all-gather, reduce-scatter, all-reduce,
//              all-to-all as grouped send/recv). The NCCL unique id travels from rank 0 to the
//              others over a TCP socket, to those that prove they belong to the run
//              (infra/rendezvous.cpp): no shared filesystem, and the same code under
//              ./train --nproc (rank 0 inherits a listening socket from the launcher), mpirun
//              or srun (rank 0 listens on MASTER_PORT, the others connect to MASTER_ADDR).
//   HostComm   --comm host: the N processes of ./train --nproc N, on one GPU or a few (NCCL
//              refuses two ranks on one GPU). Every collective is staged through shared host
//              memory, synchronously, and sums run in rank order: slow, exact, bit-reproducible.
//              It lets a machine with one GPU run the real multi-process path: the tests with
//              2, 4 and 8 ranks, and the talk's eight ranks for a reader.
//   LocalComm  --sim-world N: this process is rank 0 of an N-GPU run. Every buffer has the size
//              it has there and every kernel runs as there; a collective is replaced by a local
//              copy of rank 0's own part (an all-gather copies its shard into its slot, an
//              all-to-all keeps its send buffer). A gather into one of FSDP's weight slots also
//              fills the other ranks' shards, drawn from the seed (draw_other_shards, below), so
//              the kernels multiply the values a real rank's would.
//              So memory per category is that of one GPU of the N-GPU run and the step time is
//              its compute; the loss is meaningless.
//              With N = 1 it is the single-GPU communicator: every collective is the identity.
//
// Memory: NCCL's own buffers are part of the runtime's share of the device. They are allocated
// at initialization (NCCL_RUNTIME_CONNECT=0 unless the user sets it: by default NCCL connects
// lazily at a collective's first use, which would hide them from the measurement taken before
// our first allocation; docs/results.md has their measured size). HostComm holds no device
// memory at all, so a rank's categories are the same under every transport.
//
// Two communicators run at once (FSDP's on its stream, Ulysses's on the compute stream): this
// needs the GPU to run their kernels concurrently, so do not set CUDA_DEVICE_MAX_CONNECTIONS=1.
//
// Failure handling: an NCCL error, or a peer that stops answering, must end the run, not hang
// it. Every wait on a stream that has collectives on it goes through comm_sync, which polls the
// stream and ncclCommGetAsyncError and aborts the communicator (ncclCommAbort) after a timeout.
// HostComm waits only at its own barriers, which watch the peers' processes and the timeout.
#include <nccl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <thread>

#include "infra/rendezvous.h"
#include "llama.h"

static size_t dtype_size(DType t) { return t == DType::BF16 ? 2 : 4; }

const char* transport_name(Transport t) {
    switch (t) {
        case Transport::NCCL: return "NCCL";
        case Transport::HOST: return "host shared memory";
        default: return "local";
    }
}

// =============================================================================================
// One GPU (world 1), or rank 0 of an emulated world (--sim-world): every collective is a local
// copy of this rank's own part. An all-gather puts its shard in its slot (the other slots keep
// what they held), a reduce-scatter keeps its own contribution to its slot, an all-reduce sums
// one value, and an all-to-all moves the same bytes as if every rank had sent what this one sends.
//
// A gather of FSDP's weights fills the other ranks' shards too, with values, not zeros: on 7/8
// zeros the GEMMs and attention kernels multiply zeros, the GPU draws less power, clocks higher
// under its power limit, and the emulated step runs faster than a real rank's (docs/results.md
// has the measurement). So a gathered unit holds what a real gather would bring at the start of
// training: unit u's initial weights, drawn from the seed, in the slot's elements outside this
// rank's shard (shard elements from rank x shard).
static void draw_other_shards(const Model& m, bf16* slot, int u, int64_t shard, int rank, cudaStream_t s) {
    const ParamLayout& lay = m.layout;
    const int64_t begin = lay.unit_begin[u], end = lay.unit_begin[u + 1];  // the shards' padding is no tensor's
    const int64_t own_lo = std::min(begin + rank * shard, end), own_hi = std::min(own_lo + shard, end);
    for (const ParamTensor& t : lay.tensors)
        for (auto [lo, hi] : {std::pair<int64_t, int64_t>{begin, own_lo}, {own_hi, end}}) {
            const int64_t a = std::max(lo, t.offset), b = std::min(hi, t.offset + t.numel());
            if (a < b) init_param_values(m, t, a - t.offset, b - a, m.init_seed, nullptr, slot + (a - begin), s);
        }
}

class LocalComm : public Comm {
  public:
    LocalComm(int w, const Model* m) : model(m) {
        world = w;
        rank = 0;
        simulated = w > 1;
    }
    void all_gather(void* out, const void* in, int64_t n, DType t, cudaStream_t s) override {
        copy(out, in, n, t, s);
        if (!simulated || !model || t != DType::BF16) return;
        const int u = unit_in_weight_slot(*model, out);  // FSDP's gather of unit u's weights
        if (u >= 0) draw_other_shards(*model, (bf16*)out, u, n, rank, s);
    }
    void reduce_scatter(void* out, const void* in, int64_t n, DType t, cudaStream_t s) override {
        copy(out, in, n, t, s);
    }
    void all_reduce(void*, int64_t, DType, cudaStream_t) override {}
    void all_to_all(void* out, const void* in, int64_t n, DType t, cudaStream_t s) override {
        copy(out, in, n * world, t, s);
    }
    Comm* split() override { return new LocalComm(world, model); }

  private:
    const Model* model;  // --sim-world: whose FSDP gathers are emulated
    static void copy(void* out, const void* in, int64_t n, DType t, cudaStream_t s) {
        if (out != in) CUDA_CHECK(cudaMemcpyAsync(out, in, n * dtype_size(t), cudaMemcpyDeviceToDevice, s));
    }
};

Comm* comm_single() { return new LocalComm(1, nullptr); }
Comm* comm_fake(int world, const Model* model) { return new LocalComm(world, model); }

// =============================================================================================
static void nccl_check(ncclResult_t r, const char* what, const char* file, int line) {
    if (r == ncclSuccess || r == ncclInProgress) return;
    throw Fatal(EXIT_RUNTIME, std::string(what) + " failed at " + file + ":" + std::to_string(line) + ": " +
                                  ncclGetErrorString(r) + " (" + ncclGetLastError(nullptr) + ")");
}
#define NCCL_CHECK(call) nccl_check((call), #call, __FILE__, __LINE__)

static ncclDataType_t nccl_type(DType t) { return t == DType::BF16 ? ncclBfloat16 : ncclFloat32; }

class NcclComm : public Comm {
  public:
    ncclComm_t comm = nullptr;
    NcclComm(ncclComm_t c, int r, int w) : comm(c) {
        rank = r;
        world = w;
        transport = Transport::NCCL;
    }
    ~NcclComm() override {
        if (comm) ncclCommDestroy(comm);
    }
    void all_gather(void* out, const void* in, int64_t n, DType t, cudaStream_t s) override {
        NCCL_CHECK(ncclAllGather(in, out, n, nccl_type(t), comm, s));
    }
    void reduce_scatter(void* out, const void* in, int64_t n, DType t, cudaStream_t s) override {
        NCCL_CHECK(ncclReduceScatter(in, out, n, nccl_type(t), ncclSum, comm, s));
    }
    void all_reduce(void* buf, int64_t n, DType t, cudaStream_t s) override {
        NCCL_CHECK(ncclAllReduce(buf, buf, n, nccl_type(t), ncclSum, comm, s));
    }
    void all_to_all(void* out, const void* in, int64_t n, DType t, cudaStream_t s) override {
        const size_t bytes = n * dtype_size(t);
        NCCL_CHECK(ncclGroupStart());
        for (int p = 0; p < world; p++) {
            NCCL_CHECK(ncclSend((const char*)in + p * bytes, n, nccl_type(t), p, comm, s));
            NCCL_CHECK(ncclRecv((char*)out + p * bytes, n, nccl_type(t), p, comm, s));
        }
        NCCL_CHECK(ncclGroupEnd());
    }
    Comm* split() override {
        ncclComm_t c2 = nullptr;
        NCCL_CHECK(ncclCommSplit(comm, 0, rank, &c2, nullptr));
        return new NcclComm(c2, rank, world);
    }
    void check() override {
        ncclResult_t async = ncclSuccess;
        NCCL_CHECK(ncclCommGetAsyncError(comm, &async));
        if (async != ncclSuccess && async != ncclInProgress) {
            abort();
            throw Fatal(EXIT_RUNTIME, std::string("NCCL failed on rank ") + std::to_string(rank) + ": " +
                                          ncclGetErrorString(async));
        }
    }
    void abort() override {
        if (comm) ncclCommAbort(comm);
        comm = nullptr;
    }
};

// ---------------------------------------------------------------------------------------------
// NCCL's unique id, from rank 0 to the run's own ranks (infra/rendezvous.cpp): a rank proves with
// the run's secret that it belongs to the run before rank 0 answers.
static ncclUniqueId exchange_id(int rank, int world, int listen_fd, const std::string& master_addr, int master_port,
                                double timeout_s) {
    static_assert(sizeof(ncclUniqueId) == RENDEZVOUS_ID_BYTES, "the rendezvous carries NCCL's id as it is");
    RendezvousOptions o;
    o.secret = rendezvous_secret();
    o.run = rendezvous_run_name();
    o.timeout_s = timeout_s;
    ncclUniqueId id;
    if (rank == 0) {
        NCCL_CHECK(ncclGetUniqueId(&id));
        if (listen_fd < 0) listen_fd = rendezvous_listen(master_addr, master_port, o);
        rendezvous_serve(listen_fd, world, (const uint8_t*)&id, o);
    } else {
        rendezvous_fetch(rank, world, master_addr, master_port, o, (uint8_t*)&id);
    }
    return id;
}

static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Comm* comm_nccl(int rank, int world, int listen_fd, const std::string& master_addr, int master_port,
                double timeout_s) {
    const ncclUniqueId id = exchange_id(rank, world, listen_fd, master_addr, master_port, timeout_s);
    setenv("NCCL_RUNTIME_CONNECT", "0", 0);  // buffers now, not at first use (see above)
    ncclComm_t c = nullptr;
    NCCL_CHECK(ncclCommInitRank(&c, world, id, rank));
    return new NcclComm(c, rank, world);
}

// =============================================================================================
// HostComm: the processes of ./train --nproc N --comm host, through host shared memory.
//
// The launcher creates the memory before it starts the ranks (host_comm_create) with
// memfd_create: it has no name, so nothing can be left behind in /dev/shm whatever ends the
// run, and the kernel frees it when the last process holding it ends. The ranks inherit its
// descriptor. It holds a header, then a slot per rank:
//
//   header   the world, the size of a half slot, the first rank that failed (abort), and per
//            rank its process id and how many barriers it has passed
//   slots    [world][2 halves][HOST_HALF_BYTES]: a rank's part of the current round
//
// A collective runs in rounds of at most half a slot. In a round every rank
//   1. copies its part of `in` into its slot (device to host) and waits for the copy,
//   2. waits at the barrier until every rank has done step 1,
//   3. reads its part from every slot in rank order, and copies it to `out` (all-gather,
//      all-to-all) or sums it in fp32 and rounds once (reduce-scatter, all-reduce), then waits
//      for those copies.
// Rounds alternate between the halves: a rank writes round k + 1's half only after passing round
// k's barrier, which every rank reached after finishing its reads of round k - 1, the last
// round of that half. So one barrier a round. Every rank sums in the same order, so every rank
// and every run gets the same bits.
//
// A run's communicators (the compute stream's and FSDP's) share the channel: one host thread
// issues every collective, in the same order on every rank, and each ends before the next.
// Waiting at a barrier, a rank watches its peers: one whose process ended, or one that called
// abort(), ends the wait at once with a message; so does one that does not arrive within the
// timeout (--comm-timeout-s). This rank's Fatal then ends it, and the launcher the rest.
constexpr int64_t HOST_HALF_BYTES = 8 << 20;
constexpr uint64_t HOST_MAGIC = 0x31544d4d4f435453ull;  // "STCOMMT1"
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<int32_t>::is_always_lock_free,
              "the barrier's counters live in memory shared by processes: they must be lock-free");

struct HostHeader {
    uint64_t magic;
    int32_t world;
    std::atomic<int32_t> failed;  // 0, or the first rank that aborted, plus one
};
struct alignas(64) HostRankState {  // one cache line per rank: each writes only its own
    std::atomic<uint64_t> passed;   // barriers this rank has reached
    std::atomic<int32_t> pid;       // its process, 0 until the launcher has started it
};

// Where the parts of the shared memory start, for `world` ranks.
struct HostLayout {
    int world;
    size_t ranks_at = 256, slots_at, bytes;
    explicit HostLayout(int w) : world(w) {
        slots_at = (ranks_at + w * sizeof(HostRankState) + 4095) / 4096 * 4096;
        bytes = slots_at + (size_t)w * 2 * HOST_HALF_BYTES;
    }
};

static char* map_shared(int fd, size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) runtime_error("--comm host: cannot map the shared memory: " + std::string(strerror(errno)));
    return (char*)p;
}

int host_comm_create(int world) {
    if (world < 2 || world > HOST_COMM_MAX_RANKS)
        usage_error("--comm host runs 2 to " + std::to_string(HOST_COMM_MAX_RANKS) + " ranks, not " + std::to_string(world));
    const HostLayout lay(world);
    const int fd = memfd_create("train-comm-host", 0);  // no MFD_CLOEXEC: the ranks inherit it
    if (fd < 0 || ftruncate(fd, (off_t)lay.bytes) != 0)
        runtime_error("--comm host: cannot create " + std::to_string(lay.bytes >> 20) + " MiB of shared memory: " +
                      strerror(errno));
    char* base = map_shared(fd, lay.ranks_at);  // a fresh file reads as zeros: counters and pids start at 0
    HostHeader* h = (HostHeader*)base;
    h->magic = HOST_MAGIC;
    h->world = world;
    munmap(base, lay.ranks_at);
    return fd;
}

void host_comm_rank_started(int shared_fd, int rank, int pid) {
    const size_t ranks_at = HostLayout(rank + 1).ranks_at, bytes = ranks_at + (rank + 1) * sizeof(HostRankState);
    char* base = map_shared(shared_fd, bytes);
    ((HostRankState*)(base + ranks_at))[rank].pid.store(pid);
    munmap(base, bytes);
}

// Whether process `pid` has ended (gone, or a zombie its launcher has not reaped yet).
static bool process_ended(int pid) {
    if (pid <= 0) return false;  // not started yet: the launcher watches that
    std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
    std::string stat;
    if (!std::getline(f, stat)) return true;
    const size_t name_end = stat.rfind(')');  // "pid (name) state ...": the name may hold anything
    const char state = name_end + 2 < stat.size() ? stat[name_end + 2] : 'X';
    return state == 'Z' || state == 'X';
}

// The memory every rank maps, and this rank's place in the rounds.
struct HostChannel {
    int rank = 0, world = 0;
    double timeout_s = 0;
    HostLayout layout{2};
    char* base = nullptr;
    bool pinned = false;      // registered with CUDA: copies run at DMA speed
    char* sums = nullptr;     // [HOST_HALF_BYTES] this rank's sums, pinned
    uint64_t passed = 0;      // barriers passed
    uint64_t round = 0;       // rounds done: which half is this round's

    HostHeader& header() const { return *(HostHeader*)base; }
    HostRankState& state(int r) const { return ((HostRankState*)(base + layout.ranks_at))[r]; }
    char* slot(int r) const { return base + layout.slots_at + ((size_t)r * 2 + round % 2) * HOST_HALF_BYTES; }

    HostChannel(int r, int w, int fd, double timeout) : rank(r), world(w), timeout_s(timeout), layout(w) {
        base = map_shared(fd, layout.bytes);
        if (header().magic != HOST_MAGIC || header().world != w)
            runtime_error("--comm host: the shared memory was not made for " + std::to_string(w) + " ranks");
        pinned = cudaHostRegister(base, layout.bytes, cudaHostRegisterDefault) == cudaSuccess;
        if (!pinned) cudaGetLastError();  // pageable copies: slower, the same bytes
        CUDA_CHECK(cudaMallocHost(&sums, HOST_HALF_BYTES));
    }
    ~HostChannel() {  // at exit the CUDA context may be gone already: errors are ignored
        if (pinned) cudaHostUnregister(base);
        cudaFreeHost(sums);
        cudaGetLastError();
        munmap(base, layout.bytes);
    }

    // Every rank has reached the same barrier; a peer that ended, failed or is late ends the wait.
    void barrier(const char* what) {
        const uint64_t target = ++passed;
        state(rank).passed.store(target, std::memory_order_release);
        const auto t0 = std::chrono::steady_clock::now();
        auto checked = t0;
        for (int p = 0, spins = 0; p < world;) {
            if (state(p).passed.load(std::memory_order_acquire) >= target) {
                p++;
                continue;
            }
            // Spin briefly, then sleep: a round's copies take microseconds, a layer's compute
            // between collectives takes milliseconds to seconds.
            if (++spins > 2000) std::this_thread::sleep_for(std::chrono::microseconds(50));
            if (seconds_since(checked) > 0.01) {
                checked = std::chrono::steady_clock::now();
                watch_peers(what, target, seconds_since(t0));
            }
        }
    }

    void watch_peers(const char* what, uint64_t target, double waited_s) const {
        const int failed = header().failed.load();
        if (failed > 0 && failed - 1 != rank)
            runtime_error("rank " + std::to_string(failed - 1) + " failed; rank " + std::to_string(rank) +
                          " stops in the " + what + " too");
        std::string late;
        for (int p = 0; p < world; p++) {
            if (state(p).passed.load() >= target) continue;
            if (process_ended(state(p).pid.load()))
                runtime_error("rank " + std::to_string(p) + " (process " + std::to_string(state(p).pid.load()) +
                              ") ended before the " + what + "; rank " + std::to_string(rank) + " stops too");
            late += (late.empty() ? "" : ", ") + std::to_string(p);
        }
        if (waited_s > timeout_s)
            runtime_error("rank" + std::string(late.find(',') == std::string::npos ? " " : "s ") + late +
                          " did not reach the " + what + " within " + std::to_string((int)timeout_s) +
                          " s: a peer stopped answering (see --comm-timeout-s)");
    }

    // This round's sum of every rank's `count` elements at byte `at` of its slot, in rank order.
    template <class T, class Load, class Store>
    void sum_slots(size_t at, int64_t count, Load load, Store store) {
        T* out = (T*)sums;
        for (int64_t i = 0; i < count; i++) {
            float acc = load(((const T*)(slot(0) + at))[i]);
            for (int p = 1; p < world; p++) acc += load(((const T*)(slot(p) + at))[i]);
            out[i] = store(acc);
        }
    }
    void sum_slots(size_t at, int64_t count, DType t) {
        if (t == DType::F32)
            sum_slots<float>(at, count, [](float x) { return x; }, [](float x) { return x; });
        else
            sum_slots<bf16>(at, count, [](bf16 x) { return __bfloat162float(x); },
                            [](float x) { return __float2bfloat16(x); });
    }
};

class HostComm : public Comm {
  public:
    explicit HostComm(std::shared_ptr<HostChannel> c) : channel(std::move(c)) {
        rank = channel->rank;
        world = channel->world;
        transport = Transport::HOST;
    }
    void all_gather(void* out, const void* in, int64_t n, DType t, cudaStream_t s) override {
        collective("all-gather", out, in, n, t, s, false, false);
    }
    void reduce_scatter(void* out, const void* in, int64_t n, DType t, cudaStream_t s) override {
        collective("reduce-scatter", out, in, n, t, s, true, true);
    }
    void all_reduce(void* buf, int64_t n, DType t, cudaStream_t s) override {
        collective("all-reduce", buf, buf, n, t, s, false, true);
    }
    void all_to_all(void* out, const void* in, int64_t n, DType t, cudaStream_t s) override {
        collective("all-to-all", out, in, n, t, s, true, false);
    }
    Comm* split() override { return new HostComm(channel); }
    void check() override {
        const int failed = channel->header().failed.load();
        if (failed > 0 && failed - 1 != rank) runtime_error("rank " + std::to_string(failed - 1) + " failed");
    }
    void abort() override {
        int none = 0;
        channel->header().failed.compare_exchange_strong(none, rank + 1);
    }
    void barrier() override { channel->barrier("barrier"); }

  private:
    std::shared_ptr<HostChannel> channel;

    // `in` is one piece of n elements, or (pieces) one per rank, n apart: rank p gets piece p.
    // Every rank then reads, from each rank's slot, the same piece (all-gather, all-reduce) or
    // its own (reduce-scatter, all-to-all), and sums them (reduce) or places each rank's in turn.
    void collective(const char* what, void* out, const void* in, int64_t n, DType t, cudaStream_t s, bool pieces,
                    bool reduce) {
        HostChannel& ch = *channel;
        const int64_t e = dtype_size(t), parts = pieces ? world : 1;
        const int64_t per_round = HOST_HALF_BYTES / (parts * e);
        for (int64_t off = 0; off < n; off += per_round, ch.round++) {
            const int64_t count = std::min(per_round, n - off), bytes = count * e;
            for (int64_t q = 0; q < parts; q++)
                CUDA_CHECK(cudaMemcpyAsync(ch.slot(rank) + q * bytes, (const char*)in + (q * n + off) * e, bytes,
                                           cudaMemcpyDeviceToHost, s));
            CUDA_CHECK(cudaStreamSynchronize(s));
            ch.barrier(what);
            const size_t at = pieces ? rank * bytes : 0;  // this rank's piece in every slot
            if (reduce) {
                ch.sum_slots(at, count, t);
                CUDA_CHECK(cudaMemcpyAsync((char*)out + off * e, ch.sums, bytes, cudaMemcpyHostToDevice, s));
            } else {
                for (int p = 0; p < world; p++)
                    CUDA_CHECK(cudaMemcpyAsync((char*)out + (p * n + off) * e, ch.slot(p) + at, bytes,
                                               cudaMemcpyHostToDevice, s));
            }
            CUDA_CHECK(cudaStreamSynchronize(s));  // the slots are read before this rank arrives anywhere again
        }
    }
};

Comm* comm_host(int rank, int world, int shared_fd, double timeout_s) {
    if (shared_fd < 0)
        usage_error("--comm host runs among the processes that ./train --nproc N starts (not under mpirun or srun)");
    HostComm* c = new HostComm(std::make_shared<HostChannel>(rank, world, shared_fd, timeout_s));
    c->barrier();  // every rank is up before any collective
    return c;
}

// =============================================================================================
void comm_sync(Comm* comm, cudaStream_t s, double timeout_s) {
    auto t0 = std::chrono::steady_clock::now();
    int spins = 0;
    while (true) {
        cudaError_t e = cudaStreamQuery(s);
        if (e == cudaSuccess) return;
        if (e != cudaErrorNotReady) CUDA_CHECK(e);
        if (comm) comm->check();
        if (timeout_s > 0 && seconds_since(t0) > timeout_s) {
            if (comm) comm->abort();
            runtime_error("a step did not finish within " + std::to_string((int)timeout_s) +
                          " s: a peer GPU stopped answering (see --comm-timeout-s)");
        }
        // Spin briefly, then sleep: short steps stay fast, long ones do not burn a core.
        if (++spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
}

void model_sync(Model& m, cudaStream_t s) {
    auto t0 = std::chrono::steady_clock::now();
    int done = 0, forward_done = 0, spins = 0;
    while (true) {
        cudaError_t e = cudaStreamQuery(s);
        if (e == cudaSuccess) return;
        if (e != cudaErrorNotReady) CUDA_CHECK(e);
        for (Comm* c : {m.comm, m.comm_params})
            if (c) c->check();
        // Progress: events complete in order; a newly completed one restarts the clock.
        while (done < m.watch.step_recorded && cudaEventQuery(m.watch.step[done]) == cudaSuccess) {
            done++;
            t0 = std::chrono::steady_clock::now();
        }
        // The same for an evaluation's forward (model_forward_loss), whose events are its own.
        while (forward_done < m.watch.forward_recorded &&
               cudaEventQuery(m.watch.forward[forward_done]) == cudaSuccess) {
            forward_done++;
            t0 = std::chrono::steady_clock::now();
        }
        if (seconds_since(t0) > m.watch.timeout_s) {
            for (Comm* c : {m.comm, m.comm_params})
                if (c) c->abort();
            runtime_error("no progress for " + std::to_string((int)m.watch.timeout_s) +
                          " s: a peer GPU stopped answering (see --comm-timeout-s)");
        }
        if (++spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
}

void layer_all_to_all(Model& m, int l, void* out, const void* in, int64_t n, DType t, cudaStream_t s) {
    TimelineMark mark(m, s, "compute", "all-to-all", l, n * (m.comm->world - 1) * (int64_t)dtype_size(t));
    m.comm->all_to_all(out, in, n, t, s);
}
