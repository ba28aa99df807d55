// infra/rendezvous.cpp - NCCL's unique id, from rank 0 to the run's own ranks, over TCP.
//
// NCCL admits any process that holds the id, so the id goes only to a process that proves it is
// one of the run's ranks, and a stranger on the port (a port scanner, a health check, another job
// given the same MASTER_PORT) gets nothing and costs rank 0 nothing but a log line.
//
// One TCP connection per rank, fixed-size messages, integers big-endian:
//
//   rank -> 0  hello      "TRAINRV1" | rank u32 | world u32 | SHA-256("run " | run name) |
//                         nonce_r[32]                                                             80 B
//   0 -> rank  challenge  "TRAINRV1" | status u8 | nonce_0[32]                                     41 B
//   rank -> 0  proof      HMAC(secret, "rank" | hello | challenge)                                 32 B
//   0 -> rank  answer     status u8 | id XOR keystream [128] | HMAC(secret, "rank 0" | hello |
//                         challenge | id XOR keystream)                                           161 B
//
// where keystream block i (i = 0..3) = HMAC(secret, "id" | i | hello | challenge). So the secret
// never crosses the network, the id crosses only encrypted, a recorded exchange is no use for
// another (both sides add a fresh nonce), and the rank checks rank 0's proof before it takes the
// id: whoever listens at MASTER_ADDR cannot hand it an id without the secret either. Status 0
// lets the exchange go on; any other is a refusal (the Status codes below), after which rank 0
// closes the connection and the rank stops with exit code 2.
//
// Rank 0 refuses a rank of another run (another run name), another world size, a rank outside
// 1 .. world - 1, a rank that has already joined, and a wrong proof (compared in constant time);
// a refused connection does not count. It reads up to max_pending connections at once, all
// non-blocking under one poll(); each has connection_s from accept to its answer, so a client
// that sends nothing, sends slowly or sends garbage is dropped while the real ranks keep joining.
//
// The secret (rendezvous_secret): ./train --nproc makes a fresh one per run and hands it to its
// ranks in their environment. Under mpirun and srun it is TRAIN_RENDEZVOUS_SECRET where the user
// sets it, else a key file only the user can read, made on first use, by default
// ~/.train_rendezvous_key: the user's, not the run's, so the run name the launcher gives (its job
// id) keeps another job of the same user from taking a rank's place.
#include "infra/rendezvous.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "infra/common.h"

// ---------------------------------------------------------------------------------------------
// SHA-256 (FIPS 180-4) and HMAC (RFC 2104): small and plain, for a few short messages per rank.
namespace {

uint32_t load_u32(const uint8_t* p) { return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3]; }
void store_u32(uint8_t* p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (24 - 8 * i));
}
uint32_t rotr(uint32_t x, int n) { return x >> n | x << (32 - n); }

const uint32_t SHA256_K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

// One 64-byte block into the state h.
void sha256_block(uint32_t h[8], const uint8_t* block) {
    uint32_t w[64];
    for (int i = 0; i < 16; i++) w[i] = load_u32(block + 4 * i);
    for (int i = 16; i < 64; i++) {
        const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ w[i - 15] >> 3;
        const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ w[i - 2] >> 10;
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int i = 0; i < 64; i++) {
        const uint32_t t1 = k + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + SHA256_K[i] + w[i];
        const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        k = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    const uint32_t out[8] = {a, b, c, d, e, f, g, k};
    for (int i = 0; i < 8; i++) h[i] += out[i];
}

}  // namespace

std::string sha256(const std::string& message) {
    uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    const uint8_t* p = (const uint8_t*)message.data();
    const size_t n = message.size(), whole = n / 64 * 64;
    for (size_t at = 0; at < whole; at += 64) sha256_block(h, p + at);
    // The rest, a 1 bit, zeros, and the length in bits in the last 8 bytes: one block or two.
    uint8_t tail[128] = {};
    memcpy(tail, p + whole, n - whole);
    tail[n - whole] = 0x80;
    const size_t tail_bytes = n - whole + 9 <= 64 ? 64 : 128;
    for (int i = 0; i < 8; i++) tail[tail_bytes - 1 - i] = (uint8_t)((uint64_t)n * 8 >> (8 * i));
    for (size_t at = 0; at < tail_bytes; at += 64) sha256_block(h, tail + at);
    std::string digest(32, '\0');
    for (int i = 0; i < 8; i++) store_u32((uint8_t*)&digest[4 * i], h[i]);
    return digest;
}

std::string hmac_sha256(const std::string& key, const std::string& message) {
    std::string k = key.size() > 64 ? sha256(key) : key;
    k.resize(64, '\0');
    std::string inner = k, outer = k;
    for (int i = 0; i < 64; i++) inner[i] ^= 0x36, outer[i] ^= 0x5c;
    return sha256(outer + sha256(inner + message));
}

// ---------------------------------------------------------------------------------------------
// The secret.
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
std::string seconds_text(double s) {
    char text[32];
    snprintf(text, sizeof text, "%g s", s);
    return text;
}

constexpr size_t SECRET_MIN_BYTES = 16;
const char* const SECRET_HINT =
    "every rank must hold the same secret: set TRAIN_RENDEZVOUS_SECRET for all of them (Open MPI: mpirun -x "
    "TRAIN_RENDEZVOUS_SECRET; srun and MPICH pass the environment on), or let them all read one key file "
    "(TRAIN_RENDEZVOUS_KEY_FILE, by default ~/.train_rendezvous_key: nodes that do not share $HOME each make their "
    "own)";

std::string random_bytes(size_t n) {
    std::string out(n, '\0');
    for (size_t got = 0; got < n;) {
        const ssize_t k = getrandom(&out[got], n - got, 0);
        if (k < 0 && errno != EINTR)
            runtime_error("rendezvous: no random bytes from the kernel: " + std::string(strerror(errno)));
        if (k > 0) got += k;
    }
    return out;
}

std::string checked_secret(std::string s, const std::string& where) {
    while (!s.empty() && isspace((unsigned char)s.back())) s.pop_back();
    if (s.size() < SECRET_MIN_BYTES)
        usage_error("rendezvous: " + where + " holds a secret of " + std::to_string(s.size()) + " bytes; it needs " +
                    std::to_string(SECRET_MIN_BYTES) +
                    " or more (e.g. 64 hex digits: head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n')");
    return s;
}

// Reads the key file into `secret`; false when it does not exist. Only the user's own file that
// group and others cannot read or write will do.
bool read_key_file(const std::string& path, std::string& secret) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT) return false;
    if (fd < 0) usage_error("rendezvous: cannot read the key file " + path + ": " + strerror(errno));
    struct stat st {};
    char buf[4096];
    const bool stated = fstat(fd, &st) == 0;
    const ssize_t n = stated && S_ISREG(st.st_mode) ? read(fd, buf, sizeof buf) : -1;
    close(fd);
    if (!stated || !S_ISREG(st.st_mode) || n < 0)
        usage_error("rendezvous: the key file " + path + " is not a readable file");
    if (st.st_uid != geteuid())
        usage_error("rendezvous: the key file " + path + " belongs to another user (uid " + std::to_string(st.st_uid) +
                    "): the key must be this user's own");
    if (st.st_mode & 077) {
        char mode[8];
        snprintf(mode, sizeof mode, "%04o", (unsigned)(st.st_mode & 07777));
        usage_error("rendezvous: the key file " + path + " has mode " + mode +
                    ": group or others may read it, so it proves nothing (chmod 600 " + path +
                    ", or delete it: a new one is made)");
    }
    secret = checked_secret(std::string(buf, n), "the key file " + path);
    return true;
}

// Makes the key file unless it exists: a fresh key is written to a file of this process's own,
// then hard-linked into place. link() fails if the name exists, atomically, also on NFS, so when
// several ranks (of this node, or of nodes that share $HOME) make it at once, one wins and every
// rank then reads the same file, never a half-written one.
void create_key_file(const std::string& path) {
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    const std::string mine =
        path + ".new." + host + "." + std::to_string(getpid()) + "." + rendezvous_new_secret().substr(0, 8);
    const int fd = open(mine.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0)
        usage_error("rendezvous: cannot make the key file " + path + ": " + strerror(errno) +
                    " (set TRAIN_RENDEZVOUS_SECRET, or TRAIN_RENDEZVOUS_KEY_FILE to a file you can write)");
    const std::string key = rendezvous_new_secret() + "\n";
    const bool written =
        fchmod(fd, 0600) == 0 && write(fd, key.data(), key.size()) == (ssize_t)key.size() && fsync(fd) == 0;
    close(fd);
    const int linked = written ? link(mine.c_str(), path.c_str()) : -1;
    const int err = errno;
    unlink(mine.c_str());
    if (!written || (linked != 0 && err != EEXIST))
        runtime_error("rendezvous: cannot make the key file " + path + ": " + strerror(err));
    if (linked == 0)
        fprintf(stderr,
                "rendezvous: made the key file %s (mode 0600); the ranks of your runs under mpirun and srun "
                "prove with it that they belong to the run\n",
                path.c_str());
}

}  // namespace

std::string hex_text(const std::string& bytes) {
    std::string out;
    char two[3];
    for (unsigned char c : bytes) snprintf(two, sizeof two, "%02x", c), out += two;
    return out;
}

std::string rendezvous_new_secret() { return hex_text(random_bytes(32)); }

std::string rendezvous_key_file(const std::string& path) {
    std::string secret;
    if (read_key_file(path, secret)) return secret;
    create_key_file(path);
    // Made here or elsewhere just now: a shared filesystem may take a moment to show it.
    for (int tries = 0; tries < 50; tries++) {
        if (read_key_file(path, secret)) return secret;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    runtime_error("rendezvous: the key file " + path + " was made but cannot be found");
}

std::string rendezvous_secret() {
    const char* secret = getenv("TRAIN_RENDEZVOUS_SECRET");
    if (secret && *secret) return checked_secret(secret, "TRAIN_RENDEZVOUS_SECRET");
    const char* file = getenv("TRAIN_RENDEZVOUS_KEY_FILE");
    if (file && *file) return rendezvous_key_file(file);
    const char* home = getenv("HOME");
    if (!home || !*home)
        usage_error(std::string("rendezvous: no secret and no $HOME for the default key file: ") + SECRET_HINT);
    return rendezvous_key_file(std::string(home) + "/.train_rendezvous_key");
}

std::string rendezvous_run_name() {
    for (const char* var : {"PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "SLURM_JOB_ID"}) {
        const char* v = getenv(var);
        if (v && *v) return std::string(var) + "=" + v;
    }
    return "";
}

// ---------------------------------------------------------------------------------------------
// The messages.
namespace {

const std::string MAGIC = "TRAINRV1";
constexpr size_t NONCE_BYTES = 32, MAC_BYTES = 32;
constexpr size_t HELLO_BYTES = 8 + 4 + 4 + 32 + NONCE_BYTES, CHALLENGE_BYTES = 8 + 1 + NONCE_BYTES,
                 PROOF_BYTES = MAC_BYTES, ANSWER_BYTES = 1 + RENDEZVOUS_ID_BYTES + MAC_BYTES;
static_assert(HELLO_BYTES == 80 && CHALLENGE_BYTES == 41 && ANSWER_BYTES == 161,
              "the sizes the top of this file gives");

// A challenge's or an answer's status: 0 goes on, the others refuse.
enum Status : uint8_t { GO_ON = 0, ANOTHER_RUN, WRONG_WORLD, NO_SUCH_RANK, RANK_TAKEN, WRONG_PROOF };

std::string u32_bytes(uint32_t v) {
    std::string s(4, '\0');
    store_u32((uint8_t*)&s[0], v);
    return s;
}

struct Hello {
    int64_t rank, world;  // as sent: a stranger's may be anything
    std::string run_digest;
};
std::string hello_bytes(int rank, int world, const std::string& run) {
    return MAGIC + u32_bytes(rank) + u32_bytes(world) + sha256("run " + run) + random_bytes(NONCE_BYTES);
}
Hello parse_hello(const std::string& b) {
    return {load_u32((const uint8_t*)&b[8]), load_u32((const uint8_t*)&b[12]), b.substr(16, 32)};
}

// A refusal's challenge carries rank 0's world size where the nonce would be.
std::string challenge_bytes(Status s, int world) {
    const std::string filler =
        s == GO_ON ? random_bytes(NONCE_BYTES) : u32_bytes(world) + std::string(NONCE_BYTES - 4, '\0');
    return MAGIC + (char)s + filler;
}

std::string rank_proof(const std::string& secret, const std::string& hello, const std::string& challenge) {
    return hmac_sha256(secret, "rank" + hello + challenge);
}

// The id XOR the keystream, both ways.
std::string sealed_id(const std::string& secret, const std::string& hello, const std::string& challenge,
                      const std::string& id) {
    std::string out = id;
    for (size_t block = 0; block * MAC_BYTES < out.size(); block++) {
        const std::string key = hmac_sha256(secret, "id" + std::string(1, (char)block) + hello + challenge);
        for (size_t i = 0; i < MAC_BYTES && block * MAC_BYTES + i < out.size(); i++)
            out[block * MAC_BYTES + i] ^= key[i];
    }
    return out;
}

std::string rank0_proof(const std::string& secret, const std::string& hello, const std::string& challenge,
                        const std::string& sealed) {
    return hmac_sha256(secret, "rank 0" + hello + challenge + sealed);
}

// Equal bytes, in a time that does not depend on where they differ.
bool same_bytes(const std::string& a, const std::string& b) {
    if (a.size() != b.size()) return false;
    unsigned char differ = 0;
    for (size_t i = 0; i < a.size(); i++) differ |= (unsigned char)(a[i] ^ b[i]);
    return differ == 0;
}

std::string address_text(const sockaddr_in& a) {
    char ip[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &a.sin_addr, ip, sizeof ip);
    return std::string(ip) + ":" + std::to_string(ntohs(a.sin_port));
}

sockaddr_in ipv4_address(const std::string& addr, int port) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, addr.c_str(), &a.sin_addr) != 1)
        usage_error("MASTER_ADDR must be an IPv4 address, got '" + addr + "'");
    return a;
}

// Sends all of `bytes` at once or not at all: a message is tiny and the socket's buffer empty.
bool send_now(int fd, const std::string& bytes) {
    return send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT) == (ssize_t)bytes.size();
}

void say(const RendezvousOptions& o, const std::string& line) {
    if (o.log)
        o.log(line);
    else
        fprintf(stderr, "%s\n", line.c_str());
}

// A descriptor closed when it goes out of scope.
struct Socket {
    int fd = -1;
    ~Socket() {
        if (fd >= 0) close(fd);
    }
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Rank 0.
int rendezvous_listen(const std::string& master_addr, int port, const RendezvousOptions& o) {
    sockaddr_in a = ipv4_address(master_addr, port);
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) runtime_error("rendezvous: rank 0 has no socket: " + std::string(strerror(errno)));
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int bound = bind(fd, (sockaddr*)&a, sizeof a);
    if (bound != 0 && errno == EADDRNOTAVAIL) {  // MASTER_ADDR is not this host's (NAT, a proxy)
        say(o, "rendezvous: MASTER_ADDR " + master_addr +
                   " is not an address of this host; rank 0 listens on every interface");
        a.sin_addr.s_addr = htonl(INADDR_ANY);
        bound = bind(fd, (sockaddr*)&a, sizeof a);
    }
    if (bound != 0 || listen(fd, SOMAXCONN) != 0) {
        const std::string why = strerror(errno);
        close(fd);
        runtime_error("rendezvous: rank 0 cannot listen on " + master_addr + ":" + std::to_string(port) + ": " + why +
                      " (set MASTER_PORT)");
    }
    return fd;
}

namespace {

// One connection to rank 0, from accept to its answer.
struct Connection {
    int fd = -1;
    std::string peer;  // address:port
    Clock::time_point opened;
    std::string received;  // the message being read
    std::string hello, challenge;
    std::string claim;  // "rank R of W", once the hello is read
};

class IdServer {
  public:
    IdServer(int world_, const uint8_t* id_, const RendezvousOptions& o_)
        : world(world_),
          id((const char*)id_, RENDEZVOUS_ID_BYTES),
          o(o_),
          run_digest(sha256("run " + o_.run)),
          joined_from(world_) {}
    void serve(int listen_fd);

  private:
    int world;
    std::string id;
    const RendezvousOptions& o;
    std::string run_digest;
    std::vector<std::string> joined_from;  // per rank: the address it joined from, "" until then
    int joined = 0, turned_away = 0;
    std::vector<Connection> open;

    void accept_new(int listen_fd);
    void read_from(Connection& c);
    void on_hello(Connection& c);
    void on_proof(Connection& c);
    void drop_late();
    void end(Connection& c, const std::string& verb, const std::string& why, const std::string& refusal = "");
    [[noreturn]] void give_up() const;
};

void IdServer::serve(int listen_fd) {
    const Clock::time_point start = Clock::now();
    while (joined < world - 1) {
        if (seconds_since(start) > o.timeout_s) give_up();
        // The listening socket is read only while there is room: beyond, connections wait in its queue.
        std::vector<pollfd> fds{{(int)open.size() < o.max_pending ? listen_fd : -1, POLLIN, 0}};
        for (const Connection& c : open) fds.push_back({c.fd, POLLIN, 0});
        if (poll(fds.data(), fds.size(), 20) < 0 && errno != EINTR)
            runtime_error("rendezvous: poll failed: " + std::string(strerror(errno)));
        for (size_t i = 0; i < open.size(); i++)
            if (fds[i + 1].revents) read_from(open[i]);
        if (fds[0].revents) accept_new(listen_fd);
        drop_late();
        open.erase(std::remove_if(open.begin(), open.end(), [](const Connection& c) { return c.fd < 0; }), open.end());
    }
    for (Connection& c : open)
        if (c.fd >= 0) end(c, "dropped", "still unfinished when every rank had joined");
    open.clear();
}

void IdServer::accept_new(int listen_fd) {
    while ((int)open.size() < o.max_pending) {
        sockaddr_in peer{};
        socklen_t len = sizeof peer;
        const int fd = accept4(listen_fd, (sockaddr*)&peer, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED))
            return;  // none left, or one that vanished before it was taken
        if (fd < 0)  // out of descriptors or memory: the queue would stay readable and poll() spin
            runtime_error("rendezvous: rank 0 cannot take a connection: " + std::string(strerror(errno)));
        Connection c;
        c.fd = fd;
        c.peer = address_text(peer);
        c.opened = Clock::now();
        open.push_back(std::move(c));
    }
}

void IdServer::read_from(Connection& c) {
    if (c.fd < 0) return;
    const size_t want = (c.hello.empty() ? HELLO_BYTES : PROOF_BYTES) - c.received.size();
    char buf[HELLO_BYTES];
    const ssize_t k = recv(c.fd, buf, want, 0);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (k <= 0) {
        const size_t got = c.received.size() + c.hello.size();
        return end(c, "dropped",
                   got == 0 ? "connected and closed without a word"
                            : "closed the connection after " + std::to_string(got) + " bytes");
    }
    c.received.append(buf, k);
    const size_t magic = std::min(c.received.size(), MAGIC.size());
    if (c.hello.empty() && c.received.compare(0, magic, MAGIC, 0, magic) != 0)
        return end(c, "dropped", "sent bytes that are not a rank's hello");
    if (c.received.size() < (c.hello.empty() ? HELLO_BYTES : PROOF_BYTES)) return;
    if (c.hello.empty())
        on_hello(c);
    else
        on_proof(c);
}

void IdServer::on_hello(Connection& c) {
    c.hello.swap(c.received);
    const Hello h = parse_hello(c.hello);
    c.claim = "rank " + std::to_string(h.rank) + " of " + std::to_string(h.world);
    Status s = GO_ON;
    std::string why;
    if (!same_bytes(h.run_digest, run_digest))
        s = ANOTHER_RUN, why = "it belongs to another run (this one is " + (o.run.empty() ? "unnamed" : o.run) + ")";
    else if (h.world != world)
        s = WRONG_WORLD, why = "this run has " + std::to_string(world) + " ranks";
    else if (h.rank < 1 || h.rank >= world)
        s = NO_SUCH_RANK, why = "no such rank: ranks 1 to " + std::to_string(world - 1) + " join rank 0";
    else if (!joined_from[h.rank].empty())
        s = RANK_TAKEN, why = "rank " + std::to_string(h.rank) + " has already joined, from " + joined_from[h.rank];
    c.challenge = challenge_bytes(s, world);
    if (s != GO_ON) return end(c, "refused", why, c.challenge);
    if (!send_now(c.fd, c.challenge)) end(c, "dropped", "it does not take rank 0's challenge");
}

void IdServer::on_proof(Connection& c) {
    const int rank = (int)parse_hello(c.hello).rank;  // checked by on_hello
    Status s = GO_ON;
    std::string why;
    if (!same_bytes(c.received, rank_proof(o.secret, c.hello, c.challenge)))
        s = WRONG_PROOF, why = "wrong answer to the challenge: it does not hold this run's secret";
    else if (!joined_from[rank].empty())  // two processes with the secret, started as one rank
        s = RANK_TAKEN, why = "rank " + std::to_string(rank) + " has already joined, from " + joined_from[rank];
    // A refusal's answer is zeros past its status.
    const std::string sealed =
        s == GO_ON ? sealed_id(o.secret, c.hello, c.challenge, id) : std::string(RENDEZVOUS_ID_BYTES, '\0');
    const std::string proof =
        s == GO_ON ? rank0_proof(o.secret, c.hello, c.challenge, sealed) : std::string(MAC_BYTES, '\0');
    const std::string answer = (char)s + sealed + proof;
    if (s != GO_ON) return end(c, "refused", why, answer);
    if (!send_now(c.fd, answer)) return end(c, "dropped", "it does not take rank 0's answer");
    joined_from[rank] = c.peer;
    joined++;
    close(c.fd);
    c.fd = -1;
}

void IdServer::drop_late() {
    for (Connection& c : open) {
        if (c.fd < 0 || seconds_since(c.opened) <= o.connection_s) continue;
        std::string what = "did not answer the challenge";
        if (c.hello.empty() && c.received.empty()) what = "sent nothing";
        if (c.hello.empty() && !c.received.empty())
            what = "sent " + std::to_string(c.received.size()) + " of a hello's 80 bytes";
        end(c, "dropped", what + " within " + seconds_text(o.connection_s));
    }
}

// Closes a connection that does not count, and says why: in the log first, then to the peer
// (`refusal`, the message that tells a rank it is refused), so the log has it when the rank stops.
void IdServer::end(Connection& c, const std::string& verb, const std::string& why, const std::string& refusal) {
    say(o, "rendezvous: rank 0 " + verb + " " + c.peer + (c.claim.empty() ? "" : " (claims " + c.claim + ")") + ": " +
               why + "; it does not count");
    if (!refusal.empty()) send_now(c.fd, refusal);
    close(c.fd);
    c.fd = -1;
    turned_away++;
}

void IdServer::give_up() const {
    std::string missing;
    int listed = 0;
    for (int r = 1; r < world; r++)
        if (joined_from[r].empty() && listed++ < 16) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    if (listed > 16) missing += " and " + std::to_string(listed - 16) + " more";
    runtime_error(
        "rendezvous: only " + std::to_string(joined + 1) + " of " + std::to_string(world) + " ranks joined within " +
        seconds_text(o.timeout_s) + "; missing: " + missing +
        (turned_away ? "; rank 0 turned away " + std::to_string(turned_away) + " connections (said above)" : "") +
        " (see --comm-timeout-s)");
}

}  // namespace

void rendezvous_serve(int listen_fd, int world, const uint8_t* id, const RendezvousOptions& o) {
    const Socket closer{listen_fd};
    const int flags = fcntl(listen_fd, F_GETFL);
    if (flags < 0 || fcntl(listen_fd, F_SETFL, flags | O_NONBLOCK) != 0)
        runtime_error("rendezvous: rank 0's listening socket is not usable: " + std::string(strerror(errno)));
    IdServer(world, id, o).serve(listen_fd);
}

// ---------------------------------------------------------------------------------------------
// The other ranks.
namespace {

struct Client {
    int rank, world;
    std::string where;  // rank 0's address:port
    const RendezvousOptions& o;
};

// Connects within limit_s; false (and why) when rank 0 is not there (yet).
bool connect_within(Socket& s, const sockaddr_in& a, double limit_s, std::string& why_not) {
    s.fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (s.fd < 0) runtime_error("rendezvous: no socket: " + std::string(strerror(errno)));
    if (connect(s.fd, (const sockaddr*)&a, sizeof a) == 0) return true;
    int err = errno;
    if (err == EINPROGRESS) {
        pollfd pf{s.fd, POLLOUT, 0};
        socklen_t len = sizeof err;
        if (poll(&pf, 1, (int)(limit_s * 1000)) <= 0)
            err = ETIMEDOUT;
        else if (getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0)
            err = errno;
        if (err == 0) return true;
    }
    why_not = "connecting failed (" + std::string(strerror(err)) + ")";
    return false;
}

// Reads n bytes before the deadline; false (and why) when rank 0 closes or stays silent.
bool receive(int fd, size_t n, Clock::time_point start, double limit_s, std::string& out, std::string& why_not) {
    out.clear();
    char buf[ANSWER_BYTES];
    while (out.size() < n) {
        pollfd pf{fd, POLLIN, 0};
        const int left_ms = (int)std::max(0.0, (limit_s - seconds_since(start)) * 1000);
        if (poll(&pf, 1, left_ms) <= 0) {
            why_not = "rank 0 took the connection but did not answer within " + seconds_text(limit_s);
            return false;
        }
        const ssize_t k = recv(fd, buf, n - out.size(), 0);
        if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (k <= 0) {
            why_not = "rank 0 closed the connection";
            return false;
        }
        out.append(buf, k);
    }
    return true;
}

[[noreturn]] void refused(const Client& c, Status s, const std::string& challenge) {
    const std::string head = "rendezvous: rank 0 at " + c.where + " refused rank " + std::to_string(c.rank) + ": ";
    const uint32_t rank0_world = load_u32((const uint8_t*)&challenge[9]);
    switch (s) {
        case ANOTHER_RUN:
            usage_error(head + "rank 0 there belongs to another run than this rank's (" +
                        (c.o.run.empty() ? "unnamed" : c.o.run) + "): do two jobs share MASTER_ADDR:MASTER_PORT?");
        case WRONG_WORLD:
            usage_error(head + "its run has " + std::to_string(rank0_world) +
                        " ranks, this rank was started as one of " + std::to_string(c.world));
        case NO_SUCH_RANK:
            usage_error(head + "no such rank in a run of " + std::to_string(rank0_world));
        case RANK_TAKEN:
            usage_error(head + "another process has already joined as rank " + std::to_string(c.rank) +
                        " (were two started as the same rank?)");
        case WRONG_PROOF:
            usage_error(head + "this rank's secret is not rank 0's; " + SECRET_HINT);
        default:
            usage_error(head + "status " + std::to_string((int)s) + ", which this build does not know");
    }
}

// One exchange with rank 0 over a connected socket: true with the id, false (and why) when it
// should be tried again; a refusal throws. Once connected the rank waits for rank 0's answers
// until its own deadline (start + o.timeout_s), not connection_s: rank 0 may take the
// connection from its queue late, and a rank that gave up and came back would find its first
// connection already counted as that rank.
bool exchange(const Client& c, int fd, Clock::time_point start, uint8_t* id, std::string& why_not) {
    const std::string hello = hello_bytes(c.rank, c.world, c.o.run);
    std::string challenge, answer;
    if (!send_now(fd, hello)) {
        why_not = "rank 0 does not take a hello";
        return false;
    }
    if (!receive(fd, CHALLENGE_BYTES, start, c.o.timeout_s, challenge, why_not)) return false;
    if (challenge.compare(0, MAGIC.size(), MAGIC) != 0) {
        why_not = "what answers there is not rank 0's rendezvous";
        return false;
    }
    if (challenge[8] != GO_ON) refused(c, (Status)(uint8_t)challenge[8], challenge);
    if (!send_now(fd, rank_proof(c.o.secret, hello, challenge)) ||
        !receive(fd, ANSWER_BYTES, start, c.o.timeout_s, answer, why_not))
        return false;
    if (answer[0] != GO_ON) refused(c, (Status)(uint8_t)answer[0], challenge);
    const std::string sealed = answer.substr(1, RENDEZVOUS_ID_BYTES);
    if (!same_bytes(answer.substr(1 + RENDEZVOUS_ID_BYTES), rank0_proof(c.o.secret, hello, challenge, sealed)))
        usage_error(
            "rendezvous: what answers at " + c.where +
            " does not prove it holds this run's secret: it is not this run's rank 0, or the reply was altered");
    const std::string plain = sealed_id(c.o.secret, hello, challenge, sealed);
    memcpy(id, plain.data(), RENDEZVOUS_ID_BYTES);
    return true;
}

}  // namespace

void rendezvous_fetch(int rank, int world, const std::string& master_addr, int port, const RendezvousOptions& o,
                      uint8_t* id) {
    const sockaddr_in a = ipv4_address(master_addr, port);
    const Client c{rank, world, address_text(a), o};
    const Clock::time_point start = Clock::now();
    std::string why_not = "nothing tried";
    while (true) {  // rank 0 may not be listening yet, or busy with strangers: try again until the timeout
        Socket s;
        if (connect_within(s, a, o.connection_s, why_not) && exchange(c, s.fd, start, id, why_not)) return;
        if (seconds_since(start) > o.timeout_s)
            runtime_error("rendezvous: rank " + std::to_string(rank) + " got no answer from rank 0 at " + c.where +
                          " within " + seconds_text(o.timeout_s) + ": " + why_not + " (see --comm-timeout-s)");
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
}
