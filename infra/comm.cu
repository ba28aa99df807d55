// infra/comm.cu - the communicator: everything that crosses GPUs goes through one of these.
//
//   NcclComm   one process per GPU, NCCL collectives (all-gather, reduce-scatter, all-reduce,
//              all-to-all as grouped send/recv). The NCCL unique id travels from rank 0 to the
//              others over a TCP socket: no shared filesystem, and the same code under
//              ./train --nproc (rank 0 inherits a listening socket from the launcher), mpirun
//              or srun (rank 0 listens on MASTER_PORT, the others connect to MASTER_ADDR).
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
// our first allocation; docs/results.md has their measured size).
//
// Two communicators run at once (FSDP's on its stream, Ulysses's on the compute stream): this
// needs the GPU to run their kernels concurrently, so do not set CUDA_DEVICE_MAX_CONNECTIONS=1.
//
// Failure handling: an NCCL error, or a peer that stops answering, must end the run, not hang
// it. Every wait on a stream that has collectives on it goes through comm_sync, which polls the
// stream and ncclCommGetAsyncError and aborts the communicator (ncclCommAbort) after a timeout.
#include <arpa/inet.h>
#include <nccl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "llama.h"

static size_t dtype_size(DType t) { return t == DType::BF16 ? 2 : 4; }

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
        const int u = fsdp_unit_in_slot(*model, out);  // FSDP's gather of unit u's weights
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
// The unique id's rendezvous over TCP.
static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

static void send_all(int fd, const void* p, size_t n) {
    const char* c = (const char*)p;
    while (n > 0) {
        ssize_t k = send(fd, c, n, MSG_NOSIGNAL);
        if (k <= 0) runtime_error("rendezvous: sending the NCCL id failed: " + std::string(strerror(errno)));
        c += k, n -= k;
    }
}

static void recv_all(int fd, void* p, size_t n, double timeout_s) {
    char* c = (char*)p;
    auto t0 = std::chrono::steady_clock::now();
    while (n > 0) {
        pollfd pf{fd, POLLIN, 0};
        int remaining_ms = (int)std::max(0.0, (timeout_s - seconds_since(t0)) * 1000);
        if (poll(&pf, 1, remaining_ms) <= 0) runtime_error("rendezvous: no NCCL id from rank 0 in time");
        ssize_t k = recv(fd, c, n, 0);
        if (k <= 0) runtime_error("rendezvous: rank 0 closed the connection");
        c += k, n -= k;
    }
}

static ncclUniqueId serve_id(int world, int listen_fd, int port, double timeout_s) {
    ncclUniqueId id;
    NCCL_CHECK(ncclGetUniqueId(&id));
    int fd = listen_fd;
    if (fd < 0) {
        fd = socket(AF_INET, SOCK_STREAM, 0);
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_ANY);
        a.sin_port = htons((uint16_t)port);
        if (bind(fd, (sockaddr*)&a, sizeof a) != 0 || listen(fd, world) != 0)
            runtime_error("rendezvous: rank 0 cannot listen on port " + std::to_string(port) + ": " + strerror(errno) +
                          " (set MASTER_PORT)");
    }
    auto t0 = std::chrono::steady_clock::now();
    for (int served = 1; served < world; served++) {
        pollfd pf{fd, POLLIN, 0};
        int remaining_ms = (int)std::max(0.0, (timeout_s - seconds_since(t0)) * 1000);
        if (poll(&pf, 1, remaining_ms) <= 0)
            runtime_error("rendezvous: only " + std::to_string(served) + " of " + std::to_string(world) +
                          " ranks arrived within " + std::to_string((int)timeout_s) + " s");
        int c = accept(fd, nullptr, nullptr);
        if (c < 0) runtime_error("rendezvous: accept failed: " + std::string(strerror(errno)));
        send_all(c, &id, sizeof id);
        close(c);
    }
    close(fd);
    return id;
}

static ncclUniqueId fetch_id(const std::string& addr, int port, double timeout_s) {
    auto t0 = std::chrono::steady_clock::now();
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, addr.c_str(), &a.sin_addr) != 1)
        usage_error("MASTER_ADDR must be an IPv4 address, got '" + addr + "'");
    while (true) {  // rank 0 may not be listening yet: retry until the timeout
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(fd, (sockaddr*)&a, sizeof a) == 0) {
            ncclUniqueId id;
            recv_all(fd, &id, sizeof id, timeout_s);
            close(fd);
            return id;
        }
        close(fd);
        if (seconds_since(t0) > timeout_s)
            runtime_error("rendezvous: cannot reach rank 0 at " + addr + ":" + std::to_string(port));
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
}

Comm* comm_nccl(int rank, int world, int listen_fd, const std::string& master_addr, int master_port,
                double timeout_s) {
    ncclUniqueId id = rank == 0 ? serve_id(world, listen_fd, master_port, timeout_s)
                                : fetch_id(master_addr, master_port, timeout_s);
    setenv("NCCL_RUNTIME_CONNECT", "0", 0);  // buffers now, not at first use (see above)
    ncclComm_t c = nullptr;
    NCCL_CHECK(ncclCommInitRank(&c, world, id, rank));
    return new NcclComm(c, rank, world);
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
        for (Comm* c : {m.comm, m.comm_fsdp})
            if (c) c->check();
        // Progress: events complete in order; a newly completed one restarts the clock.
        while (done < m.progress_recorded && cudaEventQuery(m.progress[done]) == cudaSuccess) {
            done++;
            t0 = std::chrono::steady_clock::now();
        }
        // The same for an evaluation's forward (model_forward_loss), whose events are its own.
        while (forward_done < m.forward_progress_recorded &&
               cudaEventQuery(m.forward_progress[forward_done]) == cudaSuccess) {
            forward_done++;
            t0 = std::chrono::steady_clock::now();
        }
        if (seconds_since(t0) > m.comm_timeout_s) {
            for (Comm* c : {m.comm, m.comm_fsdp})
                if (c) c->abort();
            runtime_error("no progress for " + std::to_string((int)m.comm_timeout_s) +
                          " s: a peer GPU stopped answering (see --comm-timeout-s)");
        }
        if (++spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
}

void layer_all_to_all(Model& m, int l, void* out, const void* in, int64_t n, DType t, cudaStream_t s) {
    TimelineMark mark(m, s, "compute", "all-to-all", l, n * (m.comm->world - 1) * (int64_t)dtype_size(t));
    m.comm->all_to_all(out, in, n, t, s);
}
