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
// L2_TILES tiles of 32 KB (1600 fill 50 MB): a step's Q and dO tiles count as one, and with
// SUMS=1 the fused kernel's fp32 sums of the step's dQ (64 x 128 x 4 bytes) as another; SUMS=2
// with the sums' adds at L2 priority evict_last, 3 Q and dO at evict_first, 4 both, 5 Q and dO at
// evict_last (a miss evicts the least recent tile of the lowest priority held).
// Rules (RULE):
//   any       no waiting (the deterministic dK/dV kernel)
//   ordered   a block reads a tile only after the block of the key tile before (same KV head), if
//             running, has passed it (the fused kernel's ordered adds)
//   in-step   ordered, and a block does not go more than IN_STEP tiles ahead of the block of the
//             next key tile while that one runs in the same query head (an experiment, not in
//             the kernel)
// With DOCS (packed documents of these lengths, repeating, e.g. 4K,16K,1K,32K,8K,2K), the fused
// kernel's document orders instead. WALK=down (the kernel's): key tiles from the first up, each
// block walking down from its document's end, all heads of a tile in turn, its adds after those
// of the key tile before it (ordered: a block waits before a tile that block has not passed).
// WALK=up-heads and WALK=tiles or heads (two earlier versions): key tiles from the last down, each
// block walking up from its diagonal to its document's end, its adds after those of the key tile
// after it; up-heads walks one query head's tiles after another, so the block before reaches a
// tile 2 (head + 1) steps ahead, tiles or heads all heads of a tile in turn, 2 GROUP steps ahead.
// OVERHEAD adds that many time units to every block's start (its K/V load and its dK/dV stores,
// which short documents' blocks pay often). GRID=lpt (with DOCS and WALK=down only): the blocks
// by the length of their walk, longest first, over all documents and KV heads (ties by key tile),
// so that the blocks of one document start apart instead of together (within a document, longest
// first is ascending key tiles, the order of its adds).
//   make build/schedule_sim (part of make all)
//   build/schedule_sim SEQ [KV_HEADS=8] [GROUP=3] [RULE=any] [SIGMA=0.01] [IN_STEP=6] [GRID=kt|kv|cW|lpt] [L2_TILES=1600] [WALK=heads|tiles|up-heads|down]
//                      [DOCS=-] [OVERHEAD=0] [SUMS=0] [LATENCY=0]
// Prints the time against the ideal (total work / SMs), the L2 hit rate of the reads, and with
// SUMS the hit rate of the sums and the DRAM bytes a step moves (a missed Q/dO read 32 KB, a
// missed sum 64 KB: read, and written back when evicted). LATENCY: time units from the add a
// waiting block waits for to its going on (the count's release and poll, an L2 round trip or
// two; a time unit, one step, is about 2.4 us in the fused kernel).
// Where it is cruder than the kernel: it waits before a tile's read, where the fused kernel waits
// only at the add, with a stored dQ part and three stages of slack, so its ordering cost is
// pessimistic; its L2 holds Q and dO only (the fused kernel's fp32 sums, 32 KB per step, go
// through L2 too, SUMS=1); its hit rates count tiles, Nsight Compute's counts every sector.
// What it predicted, and how that compared with the kernels: docs/attention.md.
#include <algorithm>
#include <cctype>
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
// L2 as LRU lists of tiles, one per eviction priority (0 evict_first, 1 normal, 2 evict_last): a
// miss evicts the least recent tile of the lowest priority held.
struct Lru {
    std::vector<int64_t> prev, next;
    std::vector<char> held, priority;
    int64_t head[3] = {-1, -1, -1}, tail[3] = {-1, -1, -1}, size = 0, capacity;
    Lru(int64_t tiles, int64_t capacity) : prev(tiles, -1), next(tiles, -1), held(tiles, 0), priority(tiles, 1), capacity(capacity) {}
    void unlink(int64_t t) {
        const int c = priority[t];
        (prev[t] >= 0 ? next[prev[t]] : head[c]) = next[t];
        (next[t] >= 0 ? prev[next[t]] : tail[c]) = prev[t];
    }
    bool read(int64_t t, int c = 1) {  // true: a hit; the tile becomes the most recent of class c either way
        const bool hit = held[t];
        if (hit) unlink(t);
        else if (++size > capacity) {
            const int64_t victim = tail[0] >= 0 ? tail[0] : tail[1] >= 0 ? tail[1] : tail[2];
            unlink(victim), held[victim] = 0, size--;
        }
        priority[t] = (char)c, held[t] = 1, prev[t] = -1, next[t] = head[c];
        (head[c] >= 0 ? prev[head[c]] : tail[c]) = t;
        head[c] = t;
        return hit;
    }
};

// The command line: SEQ [KV_HEADS] [GROUP] [RULE] [SIGMA] [IN_STEP] [GRID] [L2_TILES] [WALK] [DOCS] [OVERHEAD]
// [SUMS] [LATENCY].
struct SimOptions {
    int64_t seq = 0, in_step = 6, l2_tiles = 1600, chunk = 1;
    int kv_heads = 8, group = 3;
    const char *rule = "any", *grid = "kt";
    double sigma = 0.01, overhead = 0, latency = 0;
    bool ordered = false, stepped = false, sums = false;
    enum Walk { HEADS, TILES, UP_HEADS, DOWN } walk = HEADS;  // WALK (the header says each)
    int sums_priority = 1, qdo_priority = 1;  // SUMS 2-5: L2 eviction priorities (Lru)
    std::vector<int64_t> doc_lengths;  // DOCS: empty for one causal sequence
};

// 4K -> 4096; 0 for what is not a token count.
static int64_t parse_tokens(const std::string& t) {
    if (t.empty() || !isdigit((unsigned char)t[0])) return 0;
    const char last = (char)toupper((unsigned char)t.back());
    const int64_t mult = last == 'K' ? 1024 : last == 'M' ? 1024 * 1024 : 1;
    return atoll(t.c_str()) * mult;
}

static bool parse_sim_options(int argc, char** argv, SimOptions& o) {
    if (argc < 2) {
        fprintf(stderr, "usage: schedule_sim SEQ [KV_HEADS] [GROUP] [any|ordered|in-step] [SIGMA] [IN_STEP] [kt|kv|cW] "
                        "[L2_TILES] [heads|tiles] [DOCS] [OVERHEAD] [SUMS] [LATENCY]\n");
        return false;
    }
    o.seq = atoll(argv[1]);
    if (argc > 2) o.kv_heads = atoi(argv[2]);
    if (argc > 3) o.group = atoi(argv[3]);
    if (argc > 4) o.rule = argv[4];
    if (argc > 5) o.sigma = atof(argv[5]);
    if (argc > 6) o.in_step = atoll(argv[6]);
    // GRID: kt = key tile major, kv = KV head major, cW = in chunks of W key tiles, KV head by
    // KV head within a chunk (kt is c1; kv is cN for N key tiles).
    if (argc > 7) o.grid = argv[7];
    if (argc > 8) o.l2_tiles = atoll(argv[8]);
    // WALK: heads = each query head's tiles from the diagonal up, head after head (the
    // deterministic dK/dV kernel's); tiles = from the last query tile down to the diagonal, all
    // heads of a tile in turn (the fused kernel's).
    if (argc > 9) {
        const std::string w = argv[9];
        if (w == "tiles") o.walk = SimOptions::TILES;
        else if (w == "up-heads") o.walk = SimOptions::UP_HEADS;
        else if (w == "down") o.walk = SimOptions::DOWN;  // with DOCS: the kernel's order
        else if (w != "heads") {
            fprintf(stderr, "schedule_sim: WALK is heads, tiles, up-heads or down, got '%s'\n", argv[9]);
            return false;
        }
    }
    if (argc > 10 && strcmp(argv[10], "-") != 0) {
        std::string list = argv[10];
        for (size_t at = 0; at <= list.size();) {
            const size_t comma = std::min(list.find(',', at), list.size());
            const int64_t n = parse_tokens(list.substr(at, comma - at));
            if (n < 128 || n % 128) {
                fprintf(stderr, "schedule_sim: DOCS takes lengths that are positive multiples of 128\n");
                return false;
            }
            o.doc_lengths.push_back(n);
            at = comma + 1;
        }
    }
    if (argc > 11) o.overhead = atof(argv[11]);
    const int sums = argc > 12 ? atoi(argv[12]) : 0;
    o.sums = sums != 0;
    o.sums_priority = sums == 2 || sums == 4 ? 2 : 1;  // the sums' adds evict_last
    o.qdo_priority = sums == 3 || sums == 4 ? 0 : sums == 5 ? 2 : 1;  // Q and dO evict_first, or evict_last
    if (argc > 13) o.latency = atof(argv[13]);
    o.ordered = strcmp(o.rule, "any") != 0, o.stepped = strcmp(o.rule, "in-step") == 0;
    if (o.seq < 128 || o.seq % 128 != 0 || o.kv_heads < 1 || o.group < 1 || o.l2_tiles < 1 || o.sigma < 0 || o.in_step < 0 ||
        o.overhead < 0 || o.latency < 0) {
        fprintf(stderr, "schedule_sim: SEQ must be a positive multiple of 128, the counts and L2_TILES positive\n");
        return false;
    }
    if (strcmp(o.grid, "lpt") == 0 && (o.doc_lengths.empty() || o.walk != SimOptions::DOWN)) {
        fprintf(stderr, "schedule_sim: GRID=lpt takes DOCS and WALK=down (the order of the adds within a document)\n");
        return false;
    }
    const int64_t n_kt = o.seq / 128;
    o.chunk = o.grid[0] == 'c' ? std::min<int64_t>(std::max<int64_t>(atoll(o.grid + 1), 1), n_kt)
              : strcmp(o.grid, "kv") == 0 ? n_kt
                                         : 1;
    return true;
}

// The SMs, the blocks on them, L2, and the events of an SM's current tile being done.
struct Simulation {
    static constexpr int SMS = 132;
    const SimOptions o;
    const int64_t n_qt, n_kt, n_blocks;
    const bool docs;
    std::vector<int64_t> qt_end;  // per key tile: the query tiles it walks end before this one
    std::vector<std::pair<int64_t, int>> lpt;  // GRID=lpt: (key tile, KV head) by walk length, longest first
    bool by_tiles() const { return o.walk == SimOptions::TILES; }
    bool up_heads() const { return o.walk == SimOptions::UP_HEADS; }
    bool down() const { return o.walk == SimOptions::DOWN; }
    std::vector<Block> sm;
    std::vector<int> on_sm;  // the SM a block runs on; -1 not started or done
    Lru l2;
    std::mt19937_64 rng{1};
    std::normal_distribution<double> speed;
    using Event = std::pair<double, int>;  // (time the SM's current tile is done, SM)
    std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events;
    int64_t next_block = 0, reads = 0, hits = 0, sum_hits = 0;

    explicit Simulation(const SimOptions& opt)
        : o(opt), n_qt(opt.seq / 64), n_kt(opt.seq / 128), n_blocks(n_kt * opt.kv_heads), docs(!opt.doc_lengths.empty()),
          qt_end(n_kt, opt.seq / 64), sm(SMS), on_sm(n_blocks, -1), l2(2 * (int64_t)opt.kv_heads * opt.group * n_qt, opt.l2_tiles),
          speed(1.0, opt.sigma) {
        // The documents, repeating from the start, the last cut off at SEQ (as bench/attention.cu --docs).
        for (int64_t at = 0, i = 0; docs && at < o.seq; i++) {
            const int64_t end = std::min(o.seq, at + o.doc_lengths[i % o.doc_lengths.size()]);
            for (int64_t kt = at / 128; kt < (end + 127) / 128; kt++) qt_end[kt] = (end + 63) / 64;
            at = end;
        }
        if (strcmp(o.grid, "lpt") == 0) {
            for (int64_t kt = 0; kt < n_kt; kt++)
                for (int kv = 0; kv < o.kv_heads; kv++) lpt.push_back({kt, kv});
            std::stable_sort(lpt.begin(), lpt.end(), [&](auto a, auto b) { return qt_end[a.first] - 2 * a.first > qt_end[b.first] - 2 * b.first; });
        }
    }

    int64_t position(const Block& b) const {
        if (docs && down()) return (qt_end[b.kt] - 1 - b.qt) * o.group + b.head;  // down from the document's end
        if (docs) return b.qt * o.group + b.head;  // up from the diagonal, all heads of a tile in turn
        return by_tiles() ? (n_qt - 1 - b.qt) * o.group + b.head : b.head * n_qt + b.qt;
    }
    const Block* neighbour(const Block& b, int64_t dk) const {
        const int64_t kt = b.kt + dk;
        if (kt < 0 || kt >= n_kt) return nullptr;
        const int s = on_sm[kt * o.kv_heads + b.kv];
        return s < 0 ? nullptr : &sm[s];
    }
    bool must_wait(const Block& b) const {
        if (docs && down()) {  // the key tile before, in the same document, adds first
            const Block* before = neighbour(b, -1);
            return o.ordered && before && qt_end[before->kt] == qt_end[b.kt] && position(*before) <= position(b);
        }
        if (docs) {  // the key tile after this one adds first, where it is one of the tile's adders
            const Block* after = neighbour(b, +1);
            if (!o.ordered || !after || after->kt > b.qt / 2) return false;
            if (up_heads()) return after->head < b.head || (after->head == b.head && after->qt <= b.qt);
            return position(*after) <= position(b);
        }
        const Block* before = neighbour(b, -1);
        if (o.ordered && before && position(*before) <= position(b)) return true;
        const Block* after = neighbour(b, +1);
        return o.stepped && after && (by_tiles() || after->head == b.head) && position(*after) < position(b) - o.in_step;
    }
    void try_go(int s, double t, double extra = 0) {
        Block& b = sm[s];
        b.waiting = must_wait(b);
        if (!b.waiting) events.push({t + extra + 1.0 / b.speed, s});
    }
    void wake_neighbours(const Block& b, double t) {
        for (int64_t dk : {-1, 1}) {
            const Block* n = neighbour(b, dk);
            if (n && n->waiting) try_go((int)(n - sm.data()), t, o.latency);
        }
    }
    // Block b.id's key tile and KV head: GRID=lpt from its table; else chunk c holds key tiles
    // c*chunk.. (the last chunk may be shorter), KV head by KV head.
    void place(Block& b) const {
        if (!lpt.empty()) {
            b.kt = lpt[b.id].first, b.kv = lpt[b.id].second;
            return;
        }
        const int64_t full = n_kt / o.chunk, per_chunk = o.chunk * o.kv_heads;
        const bool in_full = b.id < full * per_chunk;
        const int64_t c = in_full ? b.id / per_chunk : full, r = in_full ? b.id % per_chunk : b.id - full * per_chunk;
        const int64_t len = in_full ? o.chunk : n_kt - full * o.chunk;
        b.kv = (int)(r / len), b.kt = c * o.chunk + r % len;
        if (docs && !down()) b.kt = n_kt - 1 - b.kt;  // from the last key tile down
    }
    // The next block of the grid on SM s.
    void start(int s, double t) {
        Block& b = sm[s];
        b.id = -1;
        if (next_block >= n_blocks) return;
        b.id = next_block++, b.head = 0;
        place(b);
        b.qt = docs ? (down() ? qt_end[b.kt] - 1 : 2 * b.kt) : by_tiles() ? n_qt - 1 : 2 * b.kt;
        b.speed = std::max(0.5, speed(rng));
        on_sm[b.kt * o.kv_heads + b.kv] = s;
        try_go(s, t, o.overhead);
        wake_neighbours(b, t);
    }
    // Block b's next tile; whether the block is done.
    bool step(Block& b) {
        if (docs && up_heads()) {
            if (++b.qt < qt_end[b.kt]) return false;
            b.qt = 2 * b.kt;
            return ++b.head == o.group;
        }
        if (docs && !down()) {
            if (++b.head == o.group) b.head = 0, b.qt++;
            return b.qt >= qt_end[b.kt];
        }
        if (by_tiles() || docs) {  // down to the diagonal (documents: from the document's end)
            if (++b.head == o.group) b.head = 0, b.qt--;
            return b.qt < 2 * b.kt;
        }
        if (++b.qt == n_qt && ++b.head < o.group) b.qt = 2 * b.kt;
        return b.head == o.group;
    }
    // Every block to its end: the time of the last tile, and how many blocks never finished.
    double run(int& stuck) {
        for (int s = 0; s < SMS; s++) start(s, 0.0);
        double end = 0;
        while (!events.empty()) {
            const auto [t, s] = events.top();
            events.pop();
            Block& b = sm[s];
            const int64_t tile = ((int64_t)b.kv * o.group + b.head) * n_qt + b.qt;
            reads++, hits += l2.read(tile, o.qdo_priority), end = t;
            if (o.sums) sum_hits += l2.read((int64_t)o.kv_heads * o.group * n_qt + tile, o.sums_priority);
            if (step(b)) {  // the next block in the grid takes the SM
                on_sm[b.kt * o.kv_heads + b.kv] = -1;
                const Block done = b;
                start(s, t);
                wake_neighbours(done, t);
                continue;
            }
            wake_neighbours(b, t);
            try_go(s, t);
        }
        stuck = 0;
        for (const Block& b : sm) stuck += b.id >= 0;
        return end;
    }
};

int main(int argc, char** argv) {
    SimOptions o;
    if (!parse_sim_options(argc, argv, o)) return 2;
    Simulation sim(o);
    int stuck = 0;
    const double end = sim.run(stuck);
    const double ideal = ((double)sim.reads + o.overhead * (double)sim.n_blocks) / Simulation::SMS;
    printf("seq %lld, %d KV heads x %d, grid %s (chunks of %lld key tiles)%s, rule %s, sigma %.3f%s, L2 %lld tiles: "
           "time %.0f, %.3f x ideal; L2 hits %.1f%%%s%s\n",
           (long long)o.seq, o.kv_heads, o.group, o.grid, (long long)o.chunk, o.walk == SimOptions::TILES ? " (tiles walk)" : "", o.rule,
           o.sigma, o.stepped ? (", in-step " + std::to_string(o.in_step)).c_str() : "", (long long)o.l2_tiles, end,
           end / ideal, 100.0 * sim.hits / sim.reads, stuck ? "  (DEADLOCK)" : "", sim.docs ? " (documents)" : "");
    if (o.sums) {
        const double misses = (double)(sim.reads - sim.hits), sum_misses = (double)(sim.reads - sim.sum_hits);
        printf("  sums: L2 hits %.1f%%; DRAM per step %.1f KB (Q/dO %.1f, sums %.1f)\n", 100.0 * sim.sum_hits / sim.reads,
               (32 * misses + 64 * sum_misses) / sim.reads, 32 * misses / sim.reads, 64 * sum_misses / sim.reads);
    }
    return stuck ? 1 : 0;
}
