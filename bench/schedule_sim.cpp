// bench/schedule_sim.cpp - a model (not a measurement) of how the dK/dV kernel's blocks run on
// the GPU, for two questions the bench cannot answer by itself:
//   1. what ordering the fused backward's dQ adds costs (blocks wait for the block of the key
//      tile before them to have added a query tile);
//   2. whether the blocks of one KV head, which walk the same query tiles, still read them at
//      about the same time (so from L2) after many waves of blocks.
// The model: SMS SMs, one block each; blocks start in grid order (key tile major, then KV head)
// as SMs free up; a block walks (query head of its group, query tile) from its diagonal on, one
// time unit per tile at its own speed (normal around 1, SIGMA); a read hits L2 if the same tile
// was read at most WINDOW units before (L2 holds about 12 steps of the whole GPU's Q and dO
// tiles: 50 MB / (132 x 32 KB)). Rules (--rule):
//   any       no waiting (the deterministic dK/dV kernel, and the fused one before 3c2c11c)
//   ordered   a block reads a tile only after the block of the key tile before (same KV head), if
//             running, has passed it (the fused kernel's ordered adds, 3c2c11c)
//   in-step   ordered, and a block does not go more than IN_STEP tiles ahead of the block of the
//             next key tile while that one runs in the same query head (wip/in_step.patch)
//   make build/schedule_sim (part of make all)
//   build/schedule_sim SEQ [KV_HEADS=8] [GROUP=3] [RULE=any] [SIGMA=0.01] [IN_STEP=6] [WINDOW=12]
// Prints the time against the ideal (total work / SMs) and the L2 hit rate of the reads.
// What it said (2026-11-30), 3B shape (8 KV heads, groups of 3), sigma 1%: the ordered adds cost
// 12% at 16K and 3% at 64K (measured on an H200: 7-9% and 2%); one KV head per GPU (Ulysses over
// eight GPUs): 28% at 64K, 13% at 128K (not measured). L2 hits: 92% at 16K, 87% at 64K, 35% at
// 256K without in-step (measured at 512K and 1M: 33-40%), 94% at 256K with it.
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

int main(int argc, char** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: schedule_sim SEQ [KV_HEADS] [GROUP] [any|ordered|in-step] [SIGMA] [IN_STEP] [WINDOW]\n");
        return 2;
    }
    const int64_t seq = atoll(argv[1]);
    const int kv_heads = argc > 2 ? atoi(argv[2]) : 8, group = argc > 3 ? atoi(argv[3]) : 3;
    const char* rule = argc > 4 ? argv[4] : "any";
    const double sigma = argc > 5 ? atof(argv[5]) : 0.01;
    const int64_t in_step = argc > 6 ? atoll(argv[6]) : 6;
    const double window = argc > 7 ? atof(argv[7]) : 12;
    const bool ordered = strcmp(rule, "any") != 0, stepped = strcmp(rule, "in-step") == 0;
    const int SMS = 132;
    const int64_t n_qt = seq / 64, n_kt = seq / 128, n_blocks = n_kt * kv_heads;

    std::vector<Block> sm(SMS);
    std::vector<int> on_sm(n_blocks, -1);  // the SM a block runs on; -1 not started or done
    std::vector<double> last_read((size_t)kv_heads * group * n_qt, -1e18);
    std::mt19937_64 rng(1);
    std::normal_distribution<double> speed(1.0, sigma);
    using Event = std::pair<double, int>;  // (time the SM's current tile is done, SM)
    std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events;
    int64_t next_block = 0, reads = 0, hits = 0;

    auto position = [&](const Block& b) { return b.head * n_qt + b.qt; };
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
        return stepped && after && after->head == b.head && position(*after) < position(b) - in_step;
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
        b.id = next_block++, b.kt = b.id / kv_heads, b.kv = (int)(b.id % kv_heads), b.head = 0, b.qt = 2 * b.kt;
        b.speed = std::max(0.5, speed(rng));
        on_sm[b.id] = s;
        try_go(s, t);
        wake_neighbours(b, t);
    };

    for (int s = 0; s < SMS; s++) start(s, 0.0);
    double end = 0;
    while (!events.empty()) {
        const auto [t, s] = events.top();
        events.pop();
        Block& b = sm[s];
        double& last = last_read[((size_t)b.kv * group + b.head) * n_qt + b.qt];
        reads++, hits += t - last <= window, last = t, end = t;
        if (++b.qt == n_qt && ++b.head < group) b.qt = 2 * b.kt;
        if (b.head == group) {  // done: the next block in the grid takes the SM
            on_sm[b.id] = -1;
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
    printf("seq %lld, %d KV heads x %d, rule %s, sigma %.3f%s: time %.0f, %.3f x ideal; L2 hits %.1f%%%s\n",
           (long long)seq, kv_heads, group, rule, sigma, stepped ? (", in-step " + std::to_string(in_step)).c_str() : "",
           end, end / ideal, 100.0 * hits / reads, stuck ? "  (DEADLOCK)" : "");
    return stuck ? 1 : 0;
}
