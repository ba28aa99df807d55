// infra/comm.h - the communicator: every byte that crosses GPUs goes through one (infra/comm.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

// ---------------------------------------------------------------------------------------------
// Four implementations: NCCL (one process per GPU), host shared memory (--comm host: N processes
// of ./train --nproc N on one GPU or a few), an emulated one for --sim-world N (rank 0's exact
// share of an N-GPU run: the same buffers and kernels, with collectives replaced by local
// copies), and the single-GPU identity.
struct Model;
enum class DType { BF16, F32 };
enum class Transport { LOCAL, NCCL, HOST };  // LOCAL: one GPU, or --sim-world's emulated ranks
const char* transport_name(Transport t);
class Comm {
  public:
    int rank = 0, world = 1;
    bool simulated = false;  // --sim-world: numbers are rank 0's share, the loss is meaningless
    Transport transport = Transport::LOCAL;
    virtual ~Comm() = default;
    // out[world * n] = the in[n] of every rank, in rank order
    virtual void all_gather(void* out, const void* in, int64_t n, DType t, cudaStream_t s) = 0;
    // out[n] = sum over ranks of their in[rank * n .. (rank + 1) * n)
    virtual void reduce_scatter(void* out, const void* in, int64_t n, DType t, cudaStream_t s) = 0;
    virtual void all_reduce(void* buf, int64_t n, DType t, cudaStream_t s) = 0;  // sum, in place
    // out block i (n elements) = block `rank` of rank i's in
    virtual void all_to_all(void* out, const void* in, int64_t n, DType t, cudaStream_t s) = 0;
    // Another communicator over the same ranks, for collectives issued on another stream.
    virtual Comm* split() = 0;
    // Throws Fatal (exit code 1) if the communicator failed asynchronously.
    virtual void check() {}
    virtual void abort() {}
    // Returns once every rank has called it (ranks that share a GPU measure it between two of
    // these). Only the host transport's ranks share one, so the others return at once.
    virtual void barrier() {}
};
Comm* comm_single();
// --sim-world: rank 0 of `world` GPUs, emulated for `model`. Its all-gather of one of FSDP's
// weight slots fills the other ranks' shards with what a real gather would bring at the start of
// training: the unit's initial weights, drawn from model->init_seed.
Comm* comm_fake(int world, const Model* model);
// NCCL over `world` processes. Rank 0 serves the unique id over TCP: on listen_fd if >= 0 (a
// socket inherited from ./train --nproc), else on master_port; the others connect to
// master_addr:master_port and prove with the run's secret (rendezvous_secret) that they belong to
// the run (infra/rendezvous.h). Waits at most timeout_s for its peers; a refused rank ends with
// exit code 2.
Comm* comm_nccl(int rank, int world, int listen_fd, const std::string& master_addr, int master_port,
                double timeout_s);
// --comm host: this rank of the `world` processes that ./train --nproc N --comm host started,
// through the shared memory whose descriptor the launcher passed down (host_comm_create). A peer
// that ends, or does not answer within timeout_s, ends this rank with a message.
Comm* comm_host(int rank, int world, int shared_fd, double timeout_s);
// The launcher's part: the shared memory of `world` ranks, as a descriptor its children inherit;
// each rank's process id once it is started, so that its peers see it end.
constexpr int HOST_COMM_MAX_RANKS = 64;
int host_comm_create(int world);
void host_comm_rank_started(int shared_fd, int rank, int pid);
// Wait for a stream while watching the communicator: a failed or hung peer ends in Fatal after
// timeout_s, never in a hang.
void comm_sync(Comm* comm, cudaStream_t s, double timeout_s);
// The step's wait: both communicators watched, the timeout counted from the last progress event.
void model_sync(Model& m, cudaStream_t s);
// Ulysses's and Untied's all-to-all over m.comm on the compute stream, marked as layer l's on
// --timeline with the bytes this GPU sends to the others.
void layer_all_to_all(Model& m, int l, void* out, const void* in, int64_t n, DType t, cudaStream_t s);
