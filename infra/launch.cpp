// infra/launch.cpp - how the processes of a run start: one process per GPU. ./train --nproc N starts
// N local processes itself (one node, no launcher needed); under mpirun or srun each process
// reads its rank and the world size from their environment, so several nodes use those
// launchers. Also: whether this machine has a GPU at all, said in one line.
#include <arpa/inet.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "infra/comm.h"
#include "infra/rendezvous.h"
#include "train.h"

// ---------------------------------------------------------------------------------------------
// The GPUs this process sees.
int visible_gpus() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

void no_gpu_error(const std::string& what) {
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    cudaGetLastError();
    std::string why;
    if (err == cudaSuccess || err == cudaErrorNoDevice) {
        why = "no CUDA GPU is visible";
    } else if (err == cudaErrorInsufficientDriver) {
        void* driver = dlopen("libcuda.so.1", RTLD_LAZY);
        why = driver ? "the NVIDIA driver is older than this build's CUDA runtime needs"
                     : "no CUDA GPU here (no NVIDIA driver is installed)";
        if (driver) dlclose(driver);
    } else {
        why = std::string("no CUDA GPU is usable here (") + cudaGetErrorString(err) + ")";
    }
    runtime_error(why + ": " + what);
}

// ---------------------------------------------------------------------------------------------
// How this process was started: alone, by ./train --nproc N (our launcher), or by mpirun/srun.
static int env_int(const char* name, int fallback) {
    const char* v = getenv(name);
    return v && *v ? atoi(v) : fallback;
}

Launch launch_from_env() {
    Launch l;
    // Ours first, then Open MPI, MPICH/Hydra, Slurm.
    const char* vars[][3] = {{"TRAIN_RANK", "TRAIN_WORLD", "TRAIN_LOCAL_RANK"},
                             {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
                             {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"},
                             {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"}};
    for (auto& v : vars)
        if (getenv(v[0]) && getenv(v[1]) && env_int(v[1], 1) > 1) {
            l.rank = env_int(v[0], 0);
            l.world = env_int(v[1], 1);
            l.local_rank = env_int(v[2], l.rank);
            break;
        }
    l.by_launcher = getenv("TRAIN_RANK") != nullptr;  // set by launch_local alone
    l.listen_fd = env_int("TRAIN_LISTEN_FD", -1);
    l.host_comm_fd = env_int("TRAIN_HOST_COMM_FD", -1);
    if (getenv("MASTER_ADDR")) l.master_addr = getenv("MASTER_ADDR");
    l.master_port = env_int("MASTER_PORT", 29500);
    return l;
}

// ---------------------------------------------------------------------------------------------
// ./train --nproc N: start N copies of this program, one per GPU, and wait for them. Rank 0
// inherits a socket already listening on a free port of the loopback interface, so the NCCL id
// needs no shared file and no fixed port; every rank inherits a fresh secret of this run's own,
// in an environment only this user's processes can read, to prove itself to rank 0 with
// (infra/rendezvous.cpp). Under --comm host every rank inherits the shared memory of the host
// transport instead (infra/comm.cu). If any rank fails, the others are stopped at once: no rank
// waits forever for a peer that is gone. The exit code is the first failing rank's.

// Wait for every rank. The first rank to fail sets the exit code. The others get a moment to
// end by themselves (an error every rank sees is reported by rank 0 alone, which may still be
// writing it); whoever is still running after that, waiting on a dead peer, is sent SIGTERM,
// and SIGKILL a little later (a stopped or hung process does not act on SIGTERM).
static int wait_for_ranks(const std::vector<pid_t>& pids) {
    int result = 0, signal_sent = 0;
    std::vector<bool> alive(pids.size(), true);
    auto failed_at = std::chrono::steady_clock::time_point::max();
    for (size_t left = pids.size(); left > 0;) {
        if (result != 0) {
            const auto since = std::chrono::steady_clock::now() - failed_at;
            const int sig = since > std::chrono::seconds(7) ? SIGKILL : since > std::chrono::seconds(2) ? SIGTERM : 0;
            if (sig && sig != signal_sent) {
                for (size_t i = 0; i < pids.size(); i++)
                    if (alive[i]) kill(pids[i], sig);
                signal_sent = sig;
            }
        }
        int st = 0;
        pid_t p = waitpid(-1, &st, result != 0 ? WNOHANG : 0);
        if (p == 0) {  // none ended yet, after a failure
            usleep(10000);
            continue;
        }
        if (p < 0) {
            if (errno == EINTR) continue;
            break;
        }
        size_t rank = 0;
        while (rank < pids.size() && pids[rank] != p) rank++;
        if (rank == pids.size() || !alive[rank]) continue;
        alive[rank] = false, left--;
        int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        if (code == 0 || result != 0) continue;
        result = code, failed_at = std::chrono::steady_clock::now();
        if (WIFSIGNALED(st))  // a rank that ends by itself says why; one killed cannot
            fprintf(stderr, "error: rank %zu (process %d) was killed by signal %d (%s); the other ranks stop\n", rank,
                    (int)p, WTERMSIG(st), strsignal(WTERMSIG(st)));
    }
    return result;
}

int launch_local(int n, char** argv, bool host_comm) {
    // Said once here, not by each rank.
    if (visible_gpus() == 0) no_gpu_error("--nproc starts one process per GPU; `--plan --nproc N` needs none");
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (sockaddr*)&a, sizeof a) != 0 || listen(fd, SOMAXCONN) != 0 ||
        getsockname(fd, (sockaddr*)&a, &len) != 0)
        runtime_error("--nproc: cannot open the rendezvous socket: " + std::string(strerror(errno)));
    const int shared_fd = host_comm ? host_comm_create(n) : -1;
    const std::string secret = rendezvous_new_secret();
    std::vector<pid_t> pids;
    for (int r = 0; r < n; r++) {
        pid_t pid = fork();
        if (pid < 0) runtime_error("--nproc: fork failed: " + std::string(strerror(errno)));
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);  // the ranks end with their launcher
            setenv("TRAIN_RANK", std::to_string(r).c_str(), 1);
            setenv("TRAIN_WORLD", std::to_string(n).c_str(), 1);
            setenv("TRAIN_LOCAL_RANK", std::to_string(r).c_str(), 1);
            setenv("MASTER_ADDR", "127.0.0.1", 1);
            setenv("MASTER_PORT", std::to_string(ntohs(a.sin_port)).c_str(), 1);
            setenv("TRAIN_LISTEN_FD", std::to_string(r == 0 && !host_comm ? fd : -1).c_str(), 1);
            setenv("TRAIN_HOST_COMM_FD", std::to_string(shared_fd).c_str(), 1);
            setenv("TRAIN_RENDEZVOUS_SECRET", secret.c_str(), 1);
            if (r != 0 || host_comm) close(fd);
            execv("/proc/self/exe", argv);
            fprintf(stderr, "error: --nproc: cannot start rank %d: %s\n", r, strerror(errno));
            _exit(EXIT_RUNTIME);
        }
        pids.push_back(pid);
        if (host_comm) host_comm_rank_started(shared_fd, r, pid);
    }
    close(fd);
    if (shared_fd >= 0) close(shared_fd);  // the ranks hold it now; it is freed when the last one ends
    return wait_for_ranks(pids);
}
