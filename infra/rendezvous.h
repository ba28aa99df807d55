// infra/rendezvous.h - how the ranks of a run get NCCL's unique id from rank 0: over TCP, to the
// run's own ranks only (infra/rendezvous.cpp has the protocol). Host-only: no CUDA or NCCL types,
// the id is RENDEZVOUS_ID_BYTES opaque bytes, so the CPU tests run it without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

constexpr size_t RENDEZVOUS_ID_BYTES = 128;  // NCCL's unique id

struct RendezvousOptions {
    std::string secret;       // the same bytes on every rank of the run (rendezvous_secret)
    std::string run;          // the run's name where the launcher gives one (rendezvous_run_name)
    double timeout_s = 600;   // rank 0: until every rank has joined; a rank: until rank 0 answers
    double connection_s = 5;  // rank 0: what one connection may take, accept to answer; a rank: its connect
    int max_pending = 64;     // connections rank 0 reads at once; more wait in the listen queue
    // Rank 0's account of every connection it refuses or drops; stderr when empty.
    std::function<void(const std::string&)> log;
};

// Rank 0's listening socket on `port`: bound to master_addr when that is an address of this
// host, else to every interface (said through o.log). Port 0 picks a free one.
int rendezvous_listen(const std::string& master_addr, int port, const RendezvousOptions& o);
// Rank 0: gives `id` to ranks 1 .. world - 1, each once it has proved it holds o.secret, and
// closes listen_fd. Throws Fatal (exit code 1) when they have not all joined within o.timeout_s.
void rendezvous_serve(int listen_fd, int world, const uint8_t* id, const RendezvousOptions& o);
// Rank `rank` (> 0): the id from rank 0 at master_addr:port, into id[RENDEZVOUS_ID_BYTES].
// Throws Fatal with exit code 2 when rank 0 refuses this rank (or cannot prove it holds the
// secret), 1 when rank 0 does not answer within o.timeout_s.
void rendezvous_fetch(int rank, int world, const std::string& master_addr, int port, const RendezvousOptions& o,
                      uint8_t* id);

// The run's secret: TRAIN_RENDEZVOUS_SECRET if set (./train --nproc sets a fresh one for its
// ranks), else the key file TRAIN_RENDEZVOUS_KEY_FILE names, else $HOME/.train_rendezvous_key.
std::string rendezvous_secret();
// The key file at `path`, made (mode 0600, a fresh random key) when it does not exist; refused
// (exit code 2) when it is not the user's own or group or others may read or write it.
std::string rendezvous_key_file(const std::string& path);
// 64 hex digits from the kernel's random source; bytes as hex digits, two a byte.
std::string rendezvous_new_secret();
std::string hex_text(const std::string& bytes);
// The job the launcher names (PMIX_NAMESPACE, OMPI_MCA_ess_base_jobid, SLURM_JOB_ID), or "":
// a rank of another job that reaches this run's port is refused even with the user's own key.
std::string rendezvous_run_name();

// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104) of byte strings, as 32 raw bytes; the
// handshake's, declared here for their test vectors.
std::string sha256(const std::string& message);
std::string hmac_sha256(const std::string& key, const std::string& message);
