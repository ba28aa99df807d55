// tests/test_rendezvous.cpp - how NCCL's unique id reaches the ranks of a run (infra/rendezvous.cpp),
// without a GPU: rank 0 and the ranks are threads on the loopback interface, the id 128 random
// bytes. Every real rank gets the same id; a stray connection, a silent client, a slow one, one
// sending random bytes, a wrong secret, a duplicate rank, another world or another run gets
// nothing, stalls nothing and is named in rank 0's log with its address and why. Then the hash and
// MAC under the handshake against their published vectors, and where the secret comes from.
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../infra/common.h"
#include "../infra/rendezvous.h"
#include "test_util.h"

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The standard vectors below, written in groups of four hex digits for reading.
std::string digest(const char* grouped) {
    std::string s;
    for (const char* c = grouped; *c; c++) if (*c != ' ') s += *c;
    return s;
}

std::string random_string(size_t n) {
    std::random_device rd;
    std::string s(n, '\0');
    for (char& c : s) c = (char)rd();
    return s;
}

// ---------------------------------------------------------------------------------------------
// SHA-256: FIPS 180-2's examples (appendix B: one block, two blocks, a million 'a'), and the
// padding's edges (55/56 and 119/120 bytes: the length still fits the last block, or needs
// another) against Python's hashlib.
TEST(Sha256, Fips180Vectors) {
    EXPECT_EQ(hex_text(sha256("abc")),
              digest("ba78 16bf 8f01 cfea 4141 40de 5dae 2223 b003 61a3 9617 7a9c b410 ff61 f200 15ad"));
    EXPECT_EQ(hex_text(sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
              digest("248d 6a61 d206 38b8 e5c0 2693 0c3e 6039 a33c e459 64ff 2167 f6ec edd4 19db 06c1"));
    EXPECT_EQ(hex_text(sha256(std::string(1000000, 'a'))),
              digest("cdc7 6e5c 9914 fb92 81a1 c7e2 84d7 3e67 f180 9a48 a497 200e 046d 39cc c711 2cd0"));
    EXPECT_EQ(hex_text(sha256("")),
              digest("e3b0 c442 98fc 1c14 9afb f4c8 996f b924 27ae 41e4 649b 934c a495 991b 7852 b855"));
    const std::pair<int, std::string> edges[] = {
        {55, digest("9f43 90f8 d30c 2dd9 2ec9 f095 b65e 2b9a e9b0 a925 a525 8e24 1c9f 1e91 0f73 4318")},
        {56, digest("b354 39a4 ac6f 0948 b6d6 f9e3 c6af 0f5f 590c e20f 1bde 7090 ef79 7068 6ec6 738a")},
        {63, digest("7d3e 74a0 5d7d b15b ce4a d9ec 0658 ea98 e3f0 6eee cf16 b4c6 fff2 da45 7ddc 2f34")},
        {64, digest("ffe0 54fe 7ae0 cb6d c65c 3af9 b61d 5209 f439 851d b43d 0ba5 9973 37df 1546 68eb")},
        {119, digest("31eb a51c 313a 5c08 226a df18 d4a3 59cf dfd8 d2e8 16b1 3f4a f952 f7ea 6584 dcfb")},
        {120, digest("2f3d 3354 32c7 0b58 0af0 e8e1 b367 4a7c 020d 683a a5f7 3aaa edfd c55a f904 c21c")}};
    for (const auto& [n, want] : edges) EXPECT_EQ(hex_text(sha256(std::string(n, 'a'))), want) << n << " bytes";
}

// HMAC-SHA256: RFC 4231's test cases 1-7 (case 5 is truncated to 128 bits there).
TEST(HmacSha256, Rfc4231Vectors) {
    const std::string aa131(131, '\xaa');
    std::string key25;
    for (int i = 1; i <= 25; i++) key25 += (char)i;
    EXPECT_EQ(hex_text(hmac_sha256(std::string(20, '\x0b'), "Hi There")),
              digest("b034 4c61 d8db 3853 5ca8 afce af0b f12b 881d c200 c983 3da7 26e9 376c 2e32 cff7"));
    EXPECT_EQ(hex_text(hmac_sha256("Jefe", "what do ya want for nothing?")),
              digest("5bdc c146 bf60 754e 6a04 2426 0895 75c7 5a00 3f08 9d27 3983 9dec 58b9 64ec 3843"));
    EXPECT_EQ(hex_text(hmac_sha256(std::string(20, '\xaa'), std::string(50, '\xdd'))),
              digest("773e a91e 3680 0e46 854d b8eb d091 81a7 2959 098b 3ef8 c122 d963 5514 ced5 65fe"));
    EXPECT_EQ(hex_text(hmac_sha256(key25, std::string(50, '\xcd'))),
              digest("8255 8a38 9a44 3c0e a4cc 8198 99f2 083a 85f0 faa3 e578 f807 7a2e 3ff4 6729 665b"));
    // RFC 4231's test case 5 gives its output truncated to 128 bits.
    EXPECT_EQ(hex_text(hmac_sha256(std::string(20, '\x0c'), "Test With Truncation")).substr(0, 32),
              digest("a3b6 1674 7310 0ee0 6e0c 796c 2955 552b"));
    EXPECT_EQ(hex_text(hmac_sha256(aa131, "Test Using Larger Than Block-Size Key - Hash Key First")),
              digest("60e4 3159 1ee0 b67f 0d8a 26aa cbf5 b77f 8e0b c621 3728 c514 0546 040f 0ee3 7f54"));
    EXPECT_EQ(hex_text(hmac_sha256(aa131,
                                   "This is a test using a larger than block-size key and a larger than block-size "
                                   "data. The key needs to be hashed before being used by the HMAC algorithm.")),
              digest("9b09 ffa7 1b94 2fcb 2763 5fbc d5b0 e944 bfdc 6364 4f07 1393 8a7f 5153 5c3a 35e2"));
}

// ---------------------------------------------------------------------------------------------
// The rendezvous on loopback.

// What a rank, rank 0 or a function of the secret's ended with: exit code 0 and the id, or a
// Fatal's code and message.
struct Outcome {
    int code = -1;
    std::string message, id;
};
Outcome outcome_of(const std::function<std::string()>& body) {
    Outcome out;
    try {
        out.id = body();
        out.code = 0;
    } catch (const Fatal& f) {
        out.code = f.code;
        out.message = f.what();
    }
    return out;
}

// Rank 0's log, kept for the test to read.
struct Log {
    std::mutex mutex;
    std::vector<std::string> lines;
    std::function<void(const std::string&)> sink() {
        return [this](const std::string& line) {
            std::lock_guard<std::mutex> lock(mutex);
            lines.push_back(line);
        };
    }
    // Whether one line holds both pieces.
    bool has(const std::string& a, const std::string& b) {
        std::lock_guard<std::mutex> lock(mutex);
        for (const std::string& l : lines)
            if (l.find(a) != std::string::npos && l.find(b) != std::string::npos) return true;
        return false;
    }
    std::string text() {
        std::lock_guard<std::mutex> lock(mutex);
        std::string all;
        for (const std::string& l : lines) all += l + "\n";
        return all;
    }
};

RendezvousOptions test_options(Log& log, double connection_s = 0.5, double timeout_s = 20) {
    RendezvousOptions o;
    o.secret = "the run's own secret, 32 bytes+";
    o.run = "SLURM_JOB_ID=4242";
    o.timeout_s = timeout_s;
    o.connection_s = connection_s;
    o.log = log.sink();
    return o;
}

int port_of(int fd) {
    sockaddr_in a{};
    socklen_t len = sizeof a;
    getsockname(fd, (sockaddr*)&a, &len);
    return ntohs(a.sin_port);
}

// Rank 0 of a run of `world` ranks, listening on a free port of 127.0.0.1 and serving from a
// thread, from construction until finish().
class Rank0 {
  public:
    Rank0(int world_, const RendezvousOptions& o_) : world(world_), o(o_), id(random_string(RENDEZVOUS_ID_BYTES)) {
        const int fd = rendezvous_listen("127.0.0.1", 0, o);
        port = port_of(fd);
        server = std::thread([this, fd] {
            result = outcome_of([&] {
                rendezvous_serve(fd, world, (const uint8_t*)id.data(), o);
                return id;
            });
        });
    }
    ~Rank0() {
        if (server.joinable()) server.join();
    }
    Outcome finish() {
        server.join();
        return result;
    }
    const int world;
    const RendezvousOptions o;
    const std::string id;
    int port = 0;

  private:
    std::thread server;
    Outcome result;
};

Outcome join_as(int rank, int world, int port, const RendezvousOptions& o) {
    return outcome_of([&] {
        std::string id(RENDEZVOUS_ID_BYTES, '\0');
        rendezvous_fetch(rank, world, "127.0.0.1", port, o, (uint8_t*)&id[0]);
        return id;
    });
}

// Ranks 1 .. world - 1 but `joined` join at once, each a thread; rank 0 finishes; every one has
// the id.
void expect_every_rank_joins(Rank0& rank0, int joined = 0) {
    std::vector<Outcome> ranks(rank0.world);
    std::vector<std::thread> threads;
    for (int r = 1; r < rank0.world; r++)
        if (r != joined) threads.emplace_back([&, r] { ranks[r] = join_as(r, rank0.world, rank0.port, rank0.o); });
    for (std::thread& t : threads) t.join();
    const Outcome served = rank0.finish();
    EXPECT_EQ(served.code, 0) << served.message;
    for (int r = 1; r < rank0.world; r++) {
        if (r == joined) continue;
        EXPECT_EQ(ranks[r].code, 0) << "rank " << r << ": " << ranks[r].message;
        EXPECT_EQ(ranks[r].id, rank0.id) << "rank " << r;
    }
}

// A client that is not a rank: a plain connection to rank 0.
struct Stranger {
    int fd = -1;
    std::string address;  // as rank 0 sees it, 127.0.0.1:port
    explicit Stranger(int port) {
        fd = socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons((uint16_t)port);
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        EXPECT_EQ(connect(fd, (sockaddr*)&a, sizeof a), 0);
        address = "127.0.0.1:" + std::to_string(port_of(fd));
    }
    ~Stranger() {
        if (fd >= 0) close(fd);
    }
    bool say(const std::string& bytes) const {
        return send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == (ssize_t)bytes.size();
    }
    // What rank 0 sends until it closes the connection (or limit_s pass: then `closed` is false).
    std::string heard(double limit_s, bool& closed) const {
        std::string got;
        const Clock::time_point start = Clock::now();
        char buf[512];
        closed = false;
        while (!closed && seconds_since(start) < limit_s) {
            pollfd pf{fd, POLLIN, 0};
            if (poll(&pf, 1, 50) <= 0) continue;
            const ssize_t k = recv(fd, buf, sizeof buf, 0);
            if (k <= 0)
                closed = true;
            else
                got.append(buf, k);
        }
        return got;
    }
};

// A relay between one rank and rank 0 that keeps every byte each way, and can change one byte of
// what rank 0 sends (at offset `flip_at`).
class Relay {
  public:
    Relay(int rank0_port, long flip_at = -1) {
        listener = rendezvous_listen("127.0.0.1", 0, RendezvousOptions{});
        port = port_of(listener);
        worker = std::thread([this, rank0_port, flip_at] { relay(rank0_port, flip_at); });
    }
    ~Relay() {
        if (worker.joinable()) worker.join();
        close(listener);
    }
    void wait() { worker.join(); }
    int port = 0;
    std::string from_rank, from_rank0;

  private:
    int listener = -1;
    std::thread worker;
    void relay(int rank0_port, long flip_at) {
        pollfd arrives{listener, POLLIN, 0};
        if (poll(&arrives, 1, 10000) <= 0) return;  // no rank came: the test fails, it does not hang
        const int rank = accept(listener, nullptr, nullptr);
        Stranger up(rank0_port);
        for (bool open = true; open;) {
            pollfd fds[2] = {{rank, POLLIN, 0}, {up.fd, POLLIN, 0}};
            poll(fds, 2, 100);
            char buf[512];
            for (int side = 0; side < 2 && open; side++) {
                if (!fds[side].revents) continue;
                const ssize_t k = recv(fds[side].fd, buf, sizeof buf, 0);
                open = k > 0;
                if (!open) break;
                std::string& kept = side == 0 ? from_rank : from_rank0;
                for (ssize_t i = 0; i < k; i++)
                    if (side == 1 && (long)kept.size() + i == flip_at) buf[i] ^= 1;
                kept.append(buf, k);
                send(side == 0 ? up.fd : rank, buf, k, MSG_NOSIGNAL);
            }
        }
        close(rank);
    }
};

TEST(Rendezvous, EveryRankGetsTheSameId) {
    Log log;
    Rank0 rank0(8, test_options(log));
    expect_every_rank_joins(rank0);
    EXPECT_EQ(log.text(), "");
}

// The ranks start first and try again until rank 0 listens.
TEST(Rendezvous, RanksThatStartBeforeRankZeroWaitForIt) {
    Log log;
    const RendezvousOptions o = test_options(log);
    int port = 0;
    {
        const int probe = rendezvous_listen("127.0.0.1", 0, o);  // a free port, closed again
        port = port_of(probe);
        close(probe);
    }
    std::vector<Outcome> ranks(4);
    std::vector<std::thread> threads;
    for (int r = 1; r < 4; r++) threads.emplace_back([&, r] { ranks[r] = join_as(r, 4, port, o); });
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const std::string id = random_string(RENDEZVOUS_ID_BYTES);
    rendezvous_serve(rendezvous_listen("127.0.0.1", port, o), 4, (const uint8_t*)id.data(), o);
    for (std::thread& t : threads) t.join();
    for (int r = 1; r < 4; r++) EXPECT_EQ(ranks[r].id, id) << "rank " << r << ": " << ranks[r].message;
}

// Rank 0 takes a rank's connection from its queue later than connection_s: the rank waits on
// that one connection (it does not give up and come back, which would find its first connection
// counted as that rank and be refused as a duplicate), and rank 0 drops nothing.
TEST(Rendezvous, ARankWaitsForRankZeroToTakeItsConnection) {
    Log log;
    const RendezvousOptions o = test_options(log, 0.2);
    const int fd = rendezvous_listen("127.0.0.1", 0, o);
    const int port = port_of(fd);
    Outcome rank1;
    std::thread rank([&] { rank1 = join_as(1, 2, port, o); });
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));  // five times connection_s
    const std::string id = random_string(RENDEZVOUS_ID_BYTES);
    rendezvous_serve(fd, 2, (const uint8_t*)id.data(), o);
    rank.join();
    EXPECT_EQ(rank1.code, 0) << rank1.message;
    EXPECT_EQ(rank1.id, id);
    EXPECT_EQ(log.text(), "") << "one connection, taken late, and nothing dropped";
}

// A port scanner's connect-and-close, and a connection that closes halfway through a hello.
TEST(Rendezvous, StrayConnectionsDoNotCount) {
    Log log;
    Rank0 rank0(4, test_options(log));
    bool closed = false;
    std::string scanner, halfway;
    {
        Stranger s(rank0.port);
        scanner = s.address;
    }
    {
        Stranger s(rank0.port);
        halfway = s.address;
        EXPECT_TRUE(s.say("TRAINRV1\0\0"));
    }
    Stranger late(rank0.port);  // connects and waits: still connected when the run is over
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // rank 0 has read the others
    expect_every_rank_joins(rank0);
    EXPECT_TRUE(log.has(scanner, "connected and closed without a word")) << log.text();
    EXPECT_TRUE(log.has(halfway, "closed the connection after")) << log.text();
    EXPECT_EQ(late.heard(2, closed), "");
    EXPECT_TRUE(closed);
    EXPECT_TRUE(log.has(late.address, "still unfinished when every rank had joined")) << log.text();
}

// Silent clients hold connections for the whole per-connection limit; the ranks join meanwhile.
TEST(Rendezvous, SilentClientsDoNotStallTheRanks) {
    Log log;
    const Clock::time_point start = Clock::now();
    Rank0 rank0(8, test_options(log, 5));
    std::vector<std::unique_ptr<Stranger>> silent;
    for (int i = 0; i < 3; i++) silent.push_back(std::make_unique<Stranger>(rank0.port));
    expect_every_rank_joins(rank0);
    EXPECT_LT(seconds_since(start), 3.0) << "the ranks waited for the silent clients";
    bool closed = false;
    for (const auto& s : silent) {
        EXPECT_EQ(s->heard(2, closed), "");
        EXPECT_TRUE(closed) << s->address << " is still connected after the run";
    }
}

// Silent clients take every connection rank 0 reads at once: the ranks wait in the listen queue
// until the silent ones are dropped at the per-connection limit, then join.
TEST(Rendezvous, SilentClientsFillingEverySlotOnlyDelayTheRanks) {
    Log log;
    RendezvousOptions o = test_options(log, 0.3);
    o.max_pending = 2;
    Rank0 rank0(4, o);
    Stranger first(rank0.port), second(rank0.port);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // both taken before any rank
    expect_every_rank_joins(rank0);
    for (const Stranger* s : {&first, &second})
        EXPECT_TRUE(log.has(s->address, "sent nothing within 0.3 s")) << log.text();
}

// Random bytes are dropped at once; a client that drips a hello is dropped at the limit; one that
// sends a well-formed hello of random content is refused. None of them hears the id.
TEST(Rendezvous, RandomBytesAndSlowClientsGetNothing) {
    Log log;
    Rank0 rank0(4, test_options(log));
    Stranger noise(rank0.port), slow(rank0.port), forged(rank0.port);
    EXPECT_TRUE(noise.say(random_string(80)));
    EXPECT_TRUE(forged.say("TRAINRV1" + random_string(72)));
    for (char c : std::string("TRAINRV1\0\0\0\1", 12)) {  // past the limit: dropped halfway
        slow.say(std::string(1, c));
        std::this_thread::sleep_for(std::chrono::milliseconds(60));
    }
    expect_every_rank_joins(rank0);
    bool closed = false;
    EXPECT_EQ(noise.heard(2, closed), "");
    EXPECT_TRUE(log.has(noise.address, "not a rank's hello")) << log.text();
    EXPECT_EQ(slow.heard(2, closed), "");
    EXPECT_TRUE(log.has(slow.address, "of a hello's 80 bytes within 0.5 s")) << log.text();
    const std::string to_forged = forged.heard(2, closed);
    EXPECT_EQ(to_forged.find(rank0.id), std::string::npos);
    EXPECT_EQ(to_forged.size(), 41u) << "a refusal: the challenge's 41 bytes, then the connection closes";
    EXPECT_EQ(to_forged.substr(0, 8), "TRAINRV1");
    EXPECT_NE(to_forged.substr(8, 1), std::string(1, '\0')) << "its status is a refusal, not 0 (go on)";
    EXPECT_TRUE(closed);
    EXPECT_TRUE(log.has(forged.address, "refused")) << log.text();
}

// A rank with the wrong secret is refused with exit code 2 and hears nothing of the id (through a
// relay that keeps what rank 0 sends); the real rank of that number joins after it.
TEST(Rendezvous, AWrongSecretIsRefusedAndDoesNotCount) {
    Log log;
    Rank0 rank0(4, test_options(log));
    RendezvousOptions wrong = rank0.o;
    wrong.secret = "another run's secret, as long as";
    Relay relay(rank0.port);
    const Outcome intruder = join_as(1, 4, relay.port, wrong);
    relay.wait();
    EXPECT_EQ(intruder.code, EXIT_USAGE) << intruder.message;
    EXPECT_NE(intruder.message.find("this rank's secret is not rank 0's"), std::string::npos) << intruder.message;
    EXPECT_EQ(relay.from_rank0.find(rank0.id), std::string::npos);
    EXPECT_EQ(relay.from_rank0.size(), 41u + 161u) << "a challenge, then a refusal";
    EXPECT_EQ(relay.from_rank0.substr(42), std::string(160, '\0')) << "a refusal is zeros past its status";
    expect_every_rank_joins(rank0);
    EXPECT_TRUE(log.has("claims rank 1 of 4", "wrong answer to the challenge")) << log.text();
}

// What crosses the network for a real rank holds neither the secret nor the id in the clear.
TEST(Rendezvous, NeitherTheSecretNorTheIdCrossesInTheClear) {
    Log log;
    Rank0 rank0(2, test_options(log));
    Relay relay(rank0.port);
    const Outcome rank1 = join_as(1, 2, relay.port, rank0.o);
    relay.wait();
    EXPECT_EQ(rank1.id, rank0.id) << rank1.message;
    EXPECT_EQ(rank0.finish().code, 0);
    for (const std::string* wire : {&relay.from_rank, &relay.from_rank0}) {
        EXPECT_EQ(wire->find(rank0.o.secret), std::string::npos);
        EXPECT_EQ(wire->find(rank0.id.substr(0, 16)), std::string::npos);
    }
}

// A rank checks rank 0's proof before it takes the id: one byte of the sealed id changed on the
// way, and the rank refuses the answer with exit code 2.
TEST(Rendezvous, AnAlteredAnswerIsRefusedByTheRank) {
    Log log;
    Rank0 rank0(2, test_options(log));
    Relay relay(rank0.port, 41 + 1 + 7);  // after the challenge and the answer's status
    const Outcome rank1 = join_as(1, 2, relay.port, rank0.o);
    relay.wait();
    EXPECT_EQ(rank1.code, EXIT_USAGE) << rank1.message;
    EXPECT_NE(rank1.message.find("does not prove it holds this run's secret"), std::string::npos) << rank1.message;
    EXPECT_EQ(rank0.finish().code, 0);
}

// Two processes started as rank 2: the second is refused with exit code 2 and does not count.
TEST(Rendezvous, ADuplicateRankIsRefused) {
    Log log;
    Rank0 rank0(4, test_options(log));
    const Outcome first = join_as(2, 4, rank0.port, rank0.o);
    const Outcome second = join_as(2, 4, rank0.port, rank0.o);
    EXPECT_EQ(first.id, rank0.id) << first.message;
    EXPECT_EQ(second.code, EXIT_USAGE);
    EXPECT_NE(second.message.find("another process has already joined as rank 2"), std::string::npos) << second.message;
    EXPECT_TRUE(log.has("claims rank 2 of 4", "rank 2 has already joined, from 127.0.0.1:")) << log.text();
    expect_every_rank_joins(rank0, 2);
}

// Another world size, a rank that does not exist, another run with the same secret: refused
// with exit code 2, and the run goes on.
TEST(Rendezvous, AnotherWorldRankOrRunIsRefused) {
    Log log;
    Rank0 rank0(3, test_options(log));
    RendezvousOptions other_run = rank0.o;
    other_run.run = "SLURM_JOB_ID=4243";
    const Outcome world = join_as(1, 4, rank0.port, rank0.o), rank = join_as(3, 3, rank0.port, rank0.o),
                  claims_zero = join_as(0, 3, rank0.port, rank0.o), run = join_as(1, 3, rank0.port, other_run);
    for (const Outcome* o : {&world, &rank, &claims_zero, &run}) EXPECT_EQ(o->code, EXIT_USAGE) << o->message;
    EXPECT_NE(world.message.find("its run has 3 ranks, this rank was started as one of 4"), std::string::npos)
        << world.message;
    EXPECT_NE(rank.message.find("no such rank"), std::string::npos) << rank.message;
    EXPECT_NE(run.message.find("another run"), std::string::npos) << run.message;
    EXPECT_TRUE(log.has("claims rank 1 of 4", "this run has 3 ranks")) << log.text();
    EXPECT_TRUE(log.has("claims rank 1 of 3", "another run (this one is SLURM_JOB_ID=4242)")) << log.text();
    expect_every_rank_joins(rank0);
}

// A rank that never comes ends rank 0 within its timeout (exit code 1), naming it; a rank whose
// rank 0 never listens ends the same way.
TEST(Rendezvous, MissingRanksEndTheRunInTime) {
    Log log;
    const RendezvousOptions o = test_options(log, 0.5, 0.5);
    const Clock::time_point start = Clock::now();
    Rank0 rank0(3, o);
    EXPECT_EQ(join_as(1, 3, rank0.port, o).code, 0);
    const Outcome served = rank0.finish();
    EXPECT_EQ(served.code, EXIT_RUNTIME);
    EXPECT_NE(served.message.find("only 2 of 3 ranks joined within 0.5 s; missing: 2"), std::string::npos)
        << served.message;
    const Outcome alone = join_as(1, 2, rank0.port, o);  // rank 0 has closed its socket
    EXPECT_EQ(alone.code, EXIT_RUNTIME);
    EXPECT_NE(alone.message.find("got no answer from rank 0 at 127.0.0.1:"), std::string::npos) << alone.message;
    EXPECT_LT(seconds_since(start), 3.0);
}

// Rank 0 listens on MASTER_ADDR's interface; an address that is not this host's gets every
// interface, and a line that says so; a name is a usage error.
TEST(Rendezvous, RankZeroListensOnMasterAddr) {
    Log log;
    const RendezvousOptions o = test_options(log);
    for (const char* addr : {"127.0.0.1", "192.0.2.1"}) {  // 192.0.2.0/24: TEST-NET-1, no host's
        const int fd = rendezvous_listen(addr, 0, o);
        sockaddr_in a{};
        socklen_t len = sizeof a;
        getsockname(fd, (sockaddr*)&a, &len);
        EXPECT_EQ(ntohl(a.sin_addr.s_addr), std::string(addr) == "127.0.0.1" ? INADDR_LOOPBACK : INADDR_ANY) << addr;
        close(fd);
    }
    EXPECT_TRUE(log.has("MASTER_ADDR 192.0.2.1 is not an address of this host", "every interface")) << log.text();
    EXPECT_EQ(outcome_of([&] { return std::to_string(rendezvous_listen("localhost", 0, o)); }).code, EXIT_USAGE);
}

// ---------------------------------------------------------------------------------------------
// The secret: the environment first, then a key file only its user can read.

// A fresh folder under $TMPDIR, removed with what it holds.
struct TempDir {
    std::string path;
    TempDir() {
        std::string pattern = std::string(getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp") + "/rendezvous.XXXXXX";
        path = mkdtemp(&pattern[0]) ? pattern : "";
    }
    ~TempDir() {
        for (const std::string& name : names()) unlink((path + "/" + name).c_str());
        rmdir(path.c_str());
    }
    std::vector<std::string> names() const {
        std::vector<std::string> out;
        if (DIR* d = opendir(path.c_str())) {
            while (dirent* e = readdir(d))
                if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") out.push_back(e->d_name);
            closedir(d);
        }
        return out;
    }
};

void write_file(const std::string& path, const std::string& text, mode_t mode) {
    std::ofstream(path) << text;
    chmod(path.c_str(), mode);
}

TEST(KeyFile, MadeOnceWithMode0600) {
    TempDir dir;
    const std::string path = dir.path + "/key";
    const std::string secret = rendezvous_key_file(path);
    EXPECT_EQ(secret.size(), 64u);
    struct stat st {};
    ASSERT_EQ(stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    EXPECT_EQ(rendezvous_key_file(path), secret);
}

// Ranks that find no key file all make one at once (as on a node's first run, or nodes sharing
// $HOME): one wins, every one reads its key, and nothing else is left in the folder.
TEST(KeyFile, RanksMakingItAtOnceAgree) {
    TempDir dir;
    const std::string path = dir.path + "/key";
    std::vector<std::string> secrets(16);
    std::vector<std::thread> ranks;
    for (size_t r = 0; r < secrets.size(); r++) ranks.emplace_back([&, r] { secrets[r] = rendezvous_key_file(path); });
    for (std::thread& t : ranks) t.join();
    for (const std::string& s : secrets) EXPECT_EQ(s, secrets[0]);
    EXPECT_EQ(dir.names(), std::vector<std::string>{"key"});
}

TEST(KeyFile, OneOthersCanReadOrAShortOneIsRefused) {
    TempDir dir;
    write_file(dir.path + "/open", rendezvous_new_secret(), 0644);
    write_file(dir.path + "/short", "0123456789\n", 0600);
    const Outcome open = outcome_of([&] { return rendezvous_key_file(dir.path + "/open"); });
    EXPECT_EQ(open.code, EXIT_USAGE);
    EXPECT_NE(open.message.find("has mode 0644: group or others may read it"), std::string::npos) << open.message;
    const Outcome short_key = outcome_of([&] { return rendezvous_key_file(dir.path + "/short"); });
    EXPECT_EQ(short_key.code, EXIT_USAGE);
    EXPECT_NE(short_key.message.find("a secret of 10 bytes"), std::string::npos) << short_key.message;
}

// TRAIN_RENDEZVOUS_SECRET, else TRAIN_RENDEZVOUS_KEY_FILE, else $HOME/.train_rendezvous_key.
TEST(KeyFile, TheSecretComesFromTheEnvironmentThenTheKeyFile) {
    TempDir dir;
    const char* home = getenv("HOME");
    const std::string saved_home = home ? home : "";
    setenv("HOME", dir.path.c_str(), 1);
    unsetenv("TRAIN_RENDEZVOUS_KEY_FILE");
    setenv("TRAIN_RENDEZVOUS_SECRET", "from the environment, 16+ bytes", 1);
    EXPECT_EQ(rendezvous_secret(), "from the environment, 16+ bytes");
    unsetenv("TRAIN_RENDEZVOUS_SECRET");
    write_file(dir.path + "/named", "named key file, 16+ bytes\n", 0600);
    setenv("TRAIN_RENDEZVOUS_KEY_FILE", (dir.path + "/named").c_str(), 1);
    EXPECT_EQ(rendezvous_secret(), "named key file, 16+ bytes");
    unsetenv("TRAIN_RENDEZVOUS_KEY_FILE");
    const std::string made = rendezvous_secret();
    EXPECT_EQ(rendezvous_key_file(dir.path + "/.train_rendezvous_key"), made);
    setenv("TRAIN_RENDEZVOUS_SECRET", "too short", 1);
    EXPECT_EQ(outcome_of(rendezvous_secret).code, EXIT_USAGE);
    unsetenv("TRAIN_RENDEZVOUS_SECRET");
    setenv("HOME", saved_home.c_str(), 1);
}

}  // namespace
