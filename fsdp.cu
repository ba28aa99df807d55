// fsdp.cu - parameters across GPUs: replicated (ladder stage 0) or fully sharded (--fsdp,
// ladder stage 1; the talk at 05:14; ZeRO stage 3, Rajbhandari et al., arXiv 1910.02054).
//
// Model states are 16 bytes per parameter wherever they live: the fp32 master weights, their
// gradient and the two AdamW moments. The bf16 weights that the GEMMs read exist only for the
// units in use: a unit's bf16 copy is made from the fp32 master just before the unit is used,
// into one of two unit slots (the one in use and the next, prepared ahead on the communication
// stream while compute runs). A unit is a layer, the final norm, the embedding or the untied LM
// head (infra/common.h param_layout).
//
// Replicated. Every GPU holds every parameter's model states. Each GPU trains on its own
// sequences; once a unit's gradient is complete in the backward it is all-reduced (summed) on
// the communication stream while the backward goes on, and every GPU applies the same AdamW
// step. The two slots are bf16 copies of the unit, converted from the master:
//
//     16 bytes x parameters + 2 x 2 bytes x the largest unit
//
// Fully sharded (FSDP, ZeRO-3). Each unit is one flat buffer, padded to a multiple of N x 128
// elements and cut into N equal shards; GPU r keeps only shard r of every unit, with its master
// weights, gradient and moments. So model states per GPU are
//
//     16 bytes x parameters / N            (Llama 3.1 8B on 8 GPUs: 15.0 GiB, the paper's figure,
//                                           docs/reference.md)
//
// plus communication buffers (category "comm"): the two unit slots in bf16 and two unit-sized
// fp32 gradient buffers, used in turn (one accumulates while the other is reduce-scattered),
//
//     12 bytes x the largest unit          (8B: the 128K-vocabulary embedding, 5.9 GiB)
//
// To fill a slot, each GPU converts its fp32 shard to bf16 in its own place of the slot and the
// slot is all-gathered in place; a slot is refilled only after the compute stream has released
// it. In the backward each layer is gathered again, its gradient accumulates in fp32 into a unit
// buffer, and as soon as the layer is done that buffer is reduce-scattered in place: every GPU
// receives the sum of its shard over all GPUs in its own place of the buffer and adds it to its
// gradient shard. AdamW then updates each GPU's shard; gradient clipping sums the shards'
// squares over all GPUs.
//
// Cost: every step converts and gathers each unit in bf16 as often as the step uses it: the
// layers twice (in the forward and in the backward), the embedding once (the lookup), the LM
// head once (a tied embedding once more). It reduce-scatters the gradients once in fp32. All
// of it overlaps with compute except in the head, whose final norm holds one slot while the
// head's unit passes through the other. The conversion reads 4 and writes 2 bytes per parameter
// of this GPU's share each time: about 6 x 2 x 8.0e9 / N bytes a step for 8B, milliseconds.
//
// The units come in the order model_unit_order lists (llama.cu), so the next one is gathered
// while the current one computes; fsdp_step_end checks that the step kept to it.
//
// Without --fsdp the same calls run the replicated path: the slots are filled by conversion
// alone, gradients are views into the full array, and fsdp_grad_end all-reduces a unit's
// gradient when more than one GPU trains.
#include <algorithm>
#include <memory>

#include "llama.h"

struct Fsdp {
    bool sharded = false;
    int world = 1, rank = 0;
    std::vector<int64_t> padded, shard, shard_offset;  // per unit
    int64_t max_padded = 0, max_shard = 0;
    bf16* weight_slot[2] = {};  // the bf16 weights of the unit in use and of the next
    // Sharded only: gradient slots.
    float* grad_slot[2] = {};
    struct WeightSlot {
        int unit = -1;
        bool free = true, used = false;
        cudaEvent_t gathered = nullptr, released = nullptr;
    } ws[2];
    struct GradSlot {
        int unit = -1;
        bool free = true, used = false;
        cudaEvent_t reduced = nullptr;  // its reduce-scatter has read it
    } gs[2];
    int next_grad_slot = 0;  // slots alternate: one accumulates while the other is reduce-scattered
    std::vector<int> order;  // units in the order the step uses their weights
    size_t next_gather = 0;
    cudaEvent_t mark = nullptr;
};

static int64_t shard_align(int world) { return (int64_t)world * 128; }

static void describe(Fsdp& f, const ParamLayout& lay, bool sharded, int world, int rank) {
    f.sharded = sharded, f.world = world, f.rank = rank;
    int64_t off = 0;
    for (int u = 0; u < lay.num_units(); u++) {
        int64_t p = sharded ? align_up(lay.unit_size(u), shard_align(world)) : lay.unit_size(u);
        int64_t sh = sharded ? p / world : p;
        f.padded.push_back(p);
        f.shard.push_back(sh);
        f.shard_offset.push_back(sharded ? off : lay.unit_begin[u]);
        off += sh;
        f.max_padded = std::max(f.max_padded, p);
        f.max_shard = std::max(f.max_shard, sh);
    }
}

int64_t fsdp_local_params(const ParamLayout& lay, bool sharded, int world) {
    if (!sharded) return lay.total;
    Fsdp f;
    describe(f, lay, true, world, 0);
    int64_t n = 0;
    for (int64_t s : f.shard) n += s;
    return n;
}

void fsdp_plan(Model& m) {
    step_hook(m, STEP_BEGIN, [](Model& m, int, cudaStream_t s) { fsdp_step_begin(m, s); });
    step_hook(m, STEP_END, [](Model& m, int, cudaStream_t s) { fsdp_step_end(m, s); });
    setup_hook(m, fsdp_create, fsdp_destroy);
}

// Model states, 16 bytes per parameter: all of them, or (--fsdp) this GPU's shards. The bf16
// weights that compute reads exist only for the units in use.
static void declare_model_states(Model& m, Arena& A) {
    const int64_t P = m.local_params = fsdp_local_params(m.layout, m.opt.fsdp, m.world);
    m.master = A.take<float>("master weights (fp32)", MEM_MODEL, P);
    m.grad = A.take<float>("gradients (fp32)", MEM_MODEL, P);
    m.adam_m = A.take<float>("AdamW first moment", MEM_MODEL, P);
    m.adam_v = A.take<float>("AdamW second moment", MEM_MODEL, P);
}

void fsdp_declare_buffers(Model& m, Arena& A) {
    declare_model_states(m, A);
    if (!m.fsdp) m.fsdp = std::make_shared<Fsdp>();
    Fsdp& f = *m.fsdp;
    f.padded.clear(), f.shard.clear(), f.shard_offset.clear();
    f.max_padded = f.max_shard = 0;
    describe(f, m.layout, m.opt.fsdp, m.world, m.comm ? m.comm->rank : 0);
    m.segments = fsdp_segments(m);
    const int U = m.layout.num_units();
    m.unit_w.assign(U, nullptr);
    m.unit_g.assign(U, nullptr);
    // The bf16 weights of two units: gathered under --fsdp (comm), converted locally without.
    const MemCategory slot_category = f.sharded ? MEM_COMM : MEM_MODEL;
    for (int k = 0; k < 2; k++)
        f.weight_slot[k] = A.take<bf16>((f.sharded ? "FSDP gathered unit " : "bf16 weights, unit slot ") +
                                            std::to_string(k), slot_category, f.max_padded);
    if (!f.sharded) {  // gradients accumulate in this GPU's full array directly
        for (int u = 0; u < U; u++)
            if (m.grad) m.unit_g[u] = m.grad + m.layout.unit_begin[u];
        return;
    }
    for (int k = 0; k < 2; k++)
        f.grad_slot[k] = A.take<float>("FSDP unit gradient " + std::to_string(k), MEM_COMM, f.max_padded);
}

void fsdp_create(Model& m) {
    Fsdp& f = *m.fsdp;
    auto event = [](cudaEvent_t* e) { CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming)); };
    event(&f.mark);  // orders the communication stream after compute
    for (int k = 0; k < 2; k++) {
        event(&f.ws[k].gathered), event(&f.ws[k].released);
        if (f.sharded) event(&f.gs[k].reduced);
        // Zero once: the gaps between tensors are never read, but no byte of a slot is left
        // uninitialized, whichever elements a gather writes.
        CUDA_CHECK(cudaMemset(f.weight_slot[k], 0, f.max_padded * sizeof(bf16)));
    }
}

void fsdp_destroy(Model& m) {
    if (!m.fsdp) return;
    Fsdp& f = *m.fsdp;
    for (int k = 0; k < 2; k++) {
        if (f.ws[k].gathered) cudaEventDestroy(f.ws[k].gathered), cudaEventDestroy(f.ws[k].released);
        if (f.gs[k].reduced) cudaEventDestroy(f.gs[k].reduced);
    }
    if (f.mark) cudaEventDestroy(f.mark);
    m.fsdp.reset();
}

// The communication stream continues once the compute stream has reached this point.
static void comm_after_compute(Model& m, cudaStream_t s) {
    CUDA_CHECK(cudaEventRecord(m.fsdp->mark, s));
    CUDA_CHECK(cudaStreamWaitEvent(m.comm_stream, m.fsdp->mark, 0));
}

void fsdp_step_begin(Model& m, cudaStream_t s) {
    Fsdp& f = *m.fsdp;
    CUDA_CHECK(cudaMemsetAsync(m.grad, 0, m.local_params * sizeof(float), s));
    f.order = model_unit_order(m);
    f.next_gather = 0;
    for (auto& w : f.ws) w.free = true, w.unit = -1;
    comm_after_compute(m, s);  // the optimizer has written the master weights about to be converted
}

// Fill slot k with unit u's bf16 weights, on the communication stream: this GPU's fp32 master
// (its shard, in the shard's place of the slot) converted, then under --fsdp gathered in place.
static void fill_slot(Model& m, int k, int u) {
    Fsdp& f = *m.fsdp;
    bf16* own = f.weight_slot[k] + (f.sharded ? (int64_t)f.rank * f.shard[u] : 0);
    convert_f32_to_bf16(own, m.master + f.shard_offset[u], f.shard[u], m.comm_stream);
    if (!f.sharded) return;
    TimelineMark mark(m, m.comm_stream, "fsdp", "gather", u, f.shard[u] * (f.world - 1) * 2);
    m.comm_fsdp->all_gather(f.weight_slot[k], own, f.shard[u], DType::BF16, m.comm_stream);
}

// Start filling the next units of the order into free slots.
static void gather_ahead(Model& m) {
    Fsdp& f = *m.fsdp;
    for (int k = 0; k < 2 && f.next_gather < f.order.size(); k++) {
        Fsdp::WeightSlot& w = f.ws[k];
        if (!w.free) continue;
        int u = f.order[f.next_gather++];
        if (w.used) CUDA_CHECK(cudaStreamWaitEvent(m.comm_stream, w.released, 0));
        w.unit = u, w.free = false, w.used = true;
        fill_slot(m, k, u);
        CUDA_CHECK(cudaEventRecord(w.gathered, m.comm_stream));
    }
}

static int slot_of(Fsdp& f, int u) {
    for (int k = 0; k < 2; k++)
        if (!f.ws[k].free && f.ws[k].unit == u) return k;
    throw std::logic_error("FSDP: unit " + std::to_string(u) + " used out of the planned order");
}

void fsdp_acquire(Model& m, int u, cudaStream_t s) {
    Fsdp& f = *m.fsdp;
    gather_ahead(m);
    int k = slot_of(f, u);
    CUDA_CHECK(cudaStreamWaitEvent(s, f.ws[k].gathered, 0));
    m.unit_w[u] = f.weight_slot[k];
}

void fsdp_release(Model& m, int u, cudaStream_t s) {
    Fsdp& f = *m.fsdp;
    int k = slot_of(f, u);
    CUDA_CHECK(cudaEventRecord(f.ws[k].released, s));
    f.ws[k].free = true;
    m.unit_w[u] = nullptr;
    gather_ahead(m);
}

int fsdp_unit_in_slot(const Model& m, const void* slot) {
    const Fsdp& f = *m.fsdp;
    for (int k = 0; k < 2; k++)
        if (f.weight_slot[k] == slot && !f.ws[k].free) return f.ws[k].unit;
    return -1;
}

void fsdp_grad_begin(Model& m, int u, cudaStream_t s) {
    Fsdp& f = *m.fsdp;
    if (!f.sharded) return;
    for (int i = 0; i < 2; i++) {
        const int k = (f.next_grad_slot + i) % 2;
        Fsdp::GradSlot& g = f.gs[k];
        if (!g.free) continue;
        f.next_grad_slot = (k + 1) % 2;
        if (g.used) CUDA_CHECK(cudaStreamWaitEvent(s, g.reduced, 0));  // its last reduce-scatter read it
        CUDA_CHECK(cudaMemsetAsync(f.grad_slot[k], 0, f.padded[u] * sizeof(float), s));
        g.unit = u, g.free = false, g.used = true;
        m.unit_g[u] = f.grad_slot[k];
        return;
    }
    throw std::logic_error("FSDP: more than two units accumulating gradients at once");
}

__global__ void add_kernel(float* dst, const float* src, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] += src[i];
}

// Gradient slot k's unit u summed over the GPUs, in place: this GPU's shard of the sum lands in
// its own place of the slot (returned).
static float* reduce_scatter_slot(Model& m, int k, int u) {
    Fsdp& f = *m.fsdp;
    float* own = f.grad_slot[k] + (int64_t)f.rank * f.shard[u];
    TimelineMark mark(m, m.comm_stream, "fsdp", "reduce-scatter", u, f.shard[u] * (f.world - 1) * 4);
    m.comm_fsdp->reduce_scatter(own, f.grad_slot[k], f.shard[u], DType::F32, m.comm_stream);
    return own;
}

void fsdp_grad_end(Model& m, int u, bool last, cudaStream_t s) {
    Fsdp& f = *m.fsdp;
    if (!f.sharded) {  // replicated: sum the unit's gradient over the GPUs, once it is final
        if (m.world > 1 && last) {
            comm_after_compute(m, s);
            // A ring all-reduce sends 2 (N - 1) / N of the buffer from each GPU.
            TimelineMark mark(m, m.comm_stream, "fsdp", "all-reduce", u,
                              2 * (m.world - 1) * m.layout.unit_size(u) * 4 / m.world);
            m.comm_fsdp->all_reduce(m.grad + m.layout.unit_begin[u], m.layout.unit_size(u), DType::F32,
                                    m.comm_stream);
        }
        return;
    }
    int k = -1;
    for (int j = 0; j < 2; j++)
        if (!f.gs[j].free && f.gs[j].unit == u) k = j;
    if (k < 0) throw std::logic_error("FSDP: grad_end without grad_begin");
    comm_after_compute(m, s);
    const float* own = reduce_scatter_slot(m, k, u);
    add_kernel<<<(unsigned)std::min<int64_t>((f.shard[u] + 255) / 256, 1 << 16), 256, 0, m.comm_stream>>>(
        m.grad + f.shard_offset[u], own, f.shard[u]);  // this GPU's gradient shard += its sum
    CUDA_CHECK_LAUNCH();
    CUDA_CHECK(cudaEventRecord(f.gs[k].reduced, m.comm_stream));
    f.gs[k].free = true;
    m.unit_g[u] = nullptr;
}

void fsdp_step_end(Model& m, cudaStream_t s) {  // the optimizer writes what the slots were made from
    Fsdp& f = *m.fsdp;
    if (f.next_gather != f.order.size() || !f.ws[0].free || !f.ws[1].free)
        throw std::logic_error("FSDP: the step did not acquire and release every unit of fsdp_step_begin's order");
    CUDA_CHECK(cudaEventRecord(m.fsdp->mark, m.comm_stream));
    CUDA_CHECK(cudaStreamWaitEvent(s, m.fsdp->mark, 0));
}

std::vector<ParamSegment> fsdp_segments(const Model& m) {
    std::vector<ParamSegment> out;
    const Fsdp& f = *m.fsdp;
    const ParamLayout& lay = m.layout;
    for (const ParamTensor& t : lay.tensors) {
        if (!f.sharded) {
            out.push_back({t.offset, t.numel(), &t, 0});
            continue;
        }
        // This GPU's shard of each unit the tensor lies in (the embedding and LM head span
        // several), in layout coordinates.
        for (int u = t.unit; u < lay.num_units() && lay.unit_begin[u] < t.offset + t.numel(); u++) {
            int64_t lo = lay.unit_begin[u] + f.rank * f.shard[u];
            int64_t hi = std::min(lo + f.shard[u], lay.unit_begin[u + 1]);  // the shard's padding is no tensor's
            int64_t a = std::max(lo, t.offset), b = std::min(hi, t.offset + t.numel());
            if (a < b) out.push_back({f.shard_offset[u] + (a - lo), b - a, &t, a - t.offset});
        }
    }
    return out;
}

std::vector<float> fsdp_gather_unit(Model& m, const float* local, int u, cudaStream_t s) {
    Fsdp& f = *m.fsdp;
    std::vector<float> out(m.layout.unit_size(u));
    CUDA_CHECK(cudaStreamSynchronize(s));
    if (!f.sharded) {
        CUDA_CHECK(cudaMemcpy(out.data(), local + m.layout.unit_begin[u], out.size() * sizeof(float),
                              cudaMemcpyDeviceToHost));
        return out;
    }
    // Gathered into a unit-gradient slot: outside a step no gradient accumulates there.
    m.comm_fsdp->all_gather(f.grad_slot[0], local + f.shard_offset[u], f.shard[u], DType::F32, s);
    comm_sync(m.comm_fsdp, s, m.comm_timeout_s);
    CUDA_CHECK(cudaMemcpy(out.data(), f.grad_slot[0], out.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return out;
}

std::vector<float> fsdp_full_gradients(Model& m, cudaStream_t s) {
    std::vector<float> g(m.layout.total, 0.f);
    for (int u = 0; u < m.layout.num_units(); u++) {
        std::vector<float> unit = fsdp_gather_unit(m, m.grad, u, s);
        std::copy(unit.begin(), unit.end(), g.begin() + m.layout.unit_begin[u]);
    }
    return g;
}
