// bench/schedule_sim.cpp - a model (not a measurement) of how the dK/dV kernel's blocks run on
// the GPU, for two questions the bench cannot answer by itself:
//   1. what ordering the fused backward's dQ adds costs (blocks wait for the block of the key
//      tile before them to have added a query tile);
//   2. whether the blocks of one KV head, which walk the same query tiles, still read them at
//      about the same time (so from L2) after many waves of blocks.
// The model: 132 SMs, one block each; blocks start in grid order as SMs free up, the grid key
// tile major (then KV head: the backward's order below 16K tokens), KV head major (the
// forward's, and the backward's from 16K tokens) or in chunks of key tiles (GRID); a block walks
// (query head of its group, query tile) from its diagonal on, head by head or by tiles (WALK),
// one time unit per tile at its own speed (normal around 1, SIGMA); L2 is an LRU list of
// L2_TILES tiles (a step's Q and dO tiles count as one, 32 KB: 1600 of them fill 50 MB).
// Rules (RULE):
//   any       no waiting (the deterministic dK/dV kernel)
//   ordered   a block reads a tile only after the block of the key tile before (same KV head), if
//             running, has passed it (the fused kernel's ordered adds)
//   in-step   ordered, and a block does not go more than IN_STEP tiles ahead of the block of the
//             next key tile while that one runs in the same query head (an experiment, not in
//             the kernel)
//   make build/schedule_sim (part of make all)
//   build/schedule_sim SEQ [KV_HEADS=8] [GROUP=3] [RULE=any] [SIGMA=0.01] [IN_STEP=6] [GRID=kt|kv|cW] [L2_TILES=1600] [WALK=heads|tiles]
// Prints the time against the ideal (total work / SMs) and the L2 hit rate of the reads.
// Where it is cruder than the kernel: it waits before a tile's read, where the fused kernel waits
// only at the add, with a stored dQ part and three stages of slack, so its ordering cost is
// pessimistic; its L2 holds Q and dO only (the fused kernel's fp32 sums, 32 KB per step, go
// through L2 too); its hit rate counts Q/dO reads only, Nsight Compute's counts every sector.
// What it predicted, and how that compared with the kernels: docs/attention.md.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <queue>
#include <random>
#include <string>
#include <vector>

struct Block {
    int64_t id = -1, kt = 0, qt = 0;  // id: index in the grid, -1 when the SM is idle
    int head = 0, kv = 0;
    double speed = 1;
    bool waiting = false;
};

// L2 as one LRU list of tiles (a step's Q and dO tiles count as one, 32 KB), `capacity` of them.
struct Lru {
    std::vector<int64_t> prev, next;
    std::vector<char> held;
    int64_t head = -1, tail = -1, size = 0, capacity;
    Lru(int64_t tiles, int64_t capacity) : prev(tiles, -1), next(tiles, -1), held(tiles, 0), capacity(capacity) {}
    void unlink(int64_t t) {
        (prev[t] >= 0 ? next[prev[t]] : head) = next[t];
        (next[t] >= 0 ? prev[next[t]] : tail) = prev[t];
    }
    bool read(int64_t t) {  // true: a hit; the tile becomes the most recent either way
        const bool hit = held[t];
        if (hit) unlink(t);
        else if (++size > capacity) held[tail] = 0, unlink(tail), size--;
        held[t] = 1, prev[t] = -1, next[t] = head;
        (head >= 0 ? prev[head] : tail) = t;
        head = t;
        return hit;
    }
};

int main(int argc, char** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: schedule_sim SEQ [KV_HEADS] [GROUP] [any|ordered|in-step] [SIGMA] [IN_STEP] [kt|kv|cW] [L2_TILES] [heads|tiles]\n");
        return 2;
    }
    const int64_t seq = atoll(argv[1]);
    const int kv_heads = argc > 2 ? atoi(argv[2]) : 8, group = argc > 3 ? atoi(argv[3]) : 3;
    const char* rule = argc > 4 ? argv[4] : "any";
    const double sigma = argc > 5 ? atof(argv[5]) : 0.01;
    const int64_t in_step = argc > 6 ? atoll(argv[6]) : 6;
    // GRID: kt = key tile major, kv = KV head major, cW = in chunks of W key tiles, KV head by
    // KV head within a chunk (kt is c1; kv is cN for N key tiles).
    const char* grid = argc > 7 ? argv[7] : "kt";
    const bool kv_major = strcmp(grid, "kv") == 0;
    const int64_t l2_tiles = argc > 8 ? atoll(argv[8]) : 1600;
    // WALK: heads = each query head's tiles from the diagonal up, head after head (the
    // deterministic dK/dV kernel's); tiles = from the last query tile down to the diagonal, all
    // heads of a tile in turn (the fused kernel's).
    const bool by_tiles = argc > 9 && strcmp(argv[9], "tiles") == 0;
    const bool ordered = strcmp(rule, "any") != 0, stepped = strcmp(rule, "in-step") == 0;
    const int SMS = 132;
    if (seq < 128 || seq % 128 != 0 || kv_heads < 1 || group < 1 || l2_tiles < 1 || sigma < 0 || in_step < 0) {
        fprintf(stderr, "schedule_sim: SEQ must be a positive multiple of 128, the counts and L2_TILES positive\n");
        return 2;
    }
    const int64_t n_qt = seq / 64, n_kt = seq / 128, n_blocks = n_kt * kv_heads;
    const int64_t chunk = grid[0] == 'c' ? std::min<int64_t>(std::max<int64_t>(atoll(grid + 1), 1), n_kt) : kv_major ? n_kt : 1;

    std::vector<Block> sm(SMS);
    std::vector<int> on_sm(n_blocks, -1);  // the SM a block runs on; -1 not started or done
    Lru l2((int64_t)kv_heads * group * n_qt, l2_tiles);
    std::mt19937_64 rng(1);
    std::normal_distribution<double> speed(1.0, sigma);
    using Event = std::pair<double, int>;  // (time the SM's current tile is done, SM)
    std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events;
    int64_t next_block = 0, reads = 0, hits = 0;

    auto position = [&](const Block& b) { return by_tiles ? (n_qt - 1 - b.qt) * group + b.head : b.head * n_qt + b.qt; };
    auto neighbour = [&](const Block& b, int64_t dk) -> const Block* {
        const int64_t kt = b.kt + dk;
        if (kt < 0 || kt >= n_kt) return nullptr;
        const int s = on_sm[kt * kv_heads + b.kv];
        return s < 0 ? nullptr : &sm[s];
    };
    auto must_wait = [&](const Block& b) {
        const Block* before = neighbour(b, -1);
        if (ordered && before && position(*before) <= position(b)) return true;
        const Block* after = neighbour(b, +1);
        return stepped && after && (by_tiles || after->head == b.head) && position(*after) < position(b) - in_step;
    };
    auto try_go = [&](int s, double t) {
        Block& b = sm[s];
        b.waiting = must_wait(b);
        if (!b.waiting) events.push({t + 1.0 / b.speed, s});
    };
    auto wake_neighbours = [&](const Block& b, double t) {
        for (int64_t dk : {-1, 1}) {
            const Block* n = neighbour(b, dk);
            if (n && n->waiting) try_go((int)(n - sm.data()), t);
        }
    };
    auto start = [&](int s, double t) {
        Block& b = sm[s];
        b.id = -1;
        if (next_block >= n_blocks) return;
        b.id = next_block++, b.head = 0;
        // Chunk c holds key tiles c*chunk.. (the last chunk may be shorter), KV head by KV head.
        const int64_t full = n_kt / chunk, per_chunk = chunk * kv_heads;
        const bool in_full = b.id < full * per_chunk;
        const int64_t c = in_full ? b.id / per_chunk : full, r = in_full ? b.id % per_chunk : b.id - full * per_chunk;
        const int64_t len = in_full ? chunk : n_kt - full * chunk;
        b.kv = (int)(r / len), b.kt = c * chunk + r % len;
        b.qt = by_tiles ? n_qt - 1 : 2 * b.kt;
        b.speed = std::max(0.5, speed(rng));
        on_sm[b.kt * kv_heads + b.kv] = s;
        try_go(s, t);
        wake_neighbours(b, t);
    };

    for (int s = 0; s < SMS; s++) start(s, 0.0);
    double end = 0;
    while (!events.empty()) {
        const auto [t, s] = events.top();
        events.pop();
        Block& b = sm[s];
        reads++, hits += l2.read(((int64_t)b.kv * group + b.head) * n_qt + b.qt), end = t;
        bool done;
        if (by_tiles) {
            if (++b.head == group) b.head = 0, b.qt--;
            done = b.qt < 2 * b.kt;
        } else {
            if (++b.qt == n_qt && ++b.head < group) b.qt = 2 * b.kt;
            done = b.head == group;
        }
        if (done) {  // the next block in the grid takes the SM
            on_sm[b.kt * kv_heads + b.kv] = -1;
            const Block done = b;
            start(s, t);
            wake_neighbours(done, t);
            continue;
        }
        wake_neighbours(b, t);
        try_go(s, t);
    }
    int stuck = 0;
    for (const Block& b : sm) stuck += b.id >= 0;
    const double ideal = (double)reads / SMS;
    printf("seq %lld, %d KV heads x %d, grid %s (chunks of %lld key tiles)%s, rule %s, sigma %.3f%s, L2 %lld tiles: time %.0f, %.3f x ideal; "
           "L2 hits %.1f%%%s\n", (long long)seq, kv_heads, group, grid, (long long)chunk, by_tiles ? " (tiles walk)" : "", rule, sigma,
           stepped ? (", in-step " + std::to_string(in_step)).c_str() : "", (long long)l2_tiles,
           end, end / ideal, 100.0 * hits / reads, stuck ? "  (DEADLOCK)" : "");
    return stuck ? 1 : 0;
}
