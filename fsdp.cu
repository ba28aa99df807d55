// fsdp.cu - fully sharded data parallel (--fsdp, ladder stage 1; the talk at 05:14; ZeRO stage 3,
// Rajbhandari et al., arXiv 1910.02054).
//
// The plain model (llama.cu) keeps every parameter's model states on every GPU, 16 bytes per
// parameter: the fp32 master weights, their gradient and the two AdamW moments. The bf16 weights
// that the GEMMs read exist only for the two units in use (the one computing and the next, made
// ahead on the communication stream), 2 x 2 bytes x the largest unit. Where several GPUs each
// train on their own sequences, each sums a unit's gradient over them (all-reduce) once it is
// final, and every GPU applies the same AdamW step:
//
//     16 bytes x parameters + 2 x 2 bytes x the largest unit
//
// Fully sharded (FSDP, ZeRO-3). Each unit (a layer, the final norm, the embedding or the untied
// LM head: infra/common.h param_layout) is one flat buffer, padded to a multiple of N x 128
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
// Where it enters the step (llama.cu). To fill a unit's slot, each GPU converts its fp32 shard to
// bf16 in its own place of the slot, and the slot is all-gathered in place (fsdp_gather). In the
// backward each layer is gathered again; its gradient accumulates in fp32 into a unit buffer
// (fsdp_grad_begin), and as soon as the layer is done that buffer is reduce-scattered in place
// (fsdp_reduce_scatter): every GPU receives the sum of its shard over all GPUs in its own place of
// the buffer and adds it to its gradient shard. AdamW then updates each GPU's shard; gradient
// clipping sums the shards' squares over all GPUs.
//
// Cost: every step converts and gathers each unit in bf16 as often as the step uses it: the
// layers twice (in the forward and in the backward), the embedding once (the lookup), the LM
// head once (a tied embedding once more). It reduce-scatters the gradients once in fp32. All
// of it overlaps with compute except in the head, whose final norm holds one slot while the
// head's unit passes through the other. The conversion reads 4 and writes 2 bytes per parameter
// of this GPU's share each time: about 6 x 2 x 8.0e9 / N bytes a step for 8B, milliseconds.
#include <algorithm>
#include <memory>

#include "llama.h"

struct Fsdp {
    float* grad_slot[2] = {};  // the unit gradient buffers, used in turn
    struct GradSlot {
        int unit = -1;
        bool free = true, used = false;
        cudaEvent_t reduced = nullptr;  // its reduce-scatter has read it
    } gs[2];
    int next_grad_slot = 0;  // slots alternate: one accumulates while the other is reduce-scattered
    cudaEvent_t mark = nullptr;
};

// Shard `rank` of every unit: each unit padded to a multiple of world x 128 elements and cut into
// world equal shards; this GPU's shards lie one after the other in its model states.
std::vector<UnitShard> fsdp_shards(const ParamLayout& lay, int world, int rank) {
    std::vector<UnitShard> shards;
    int64_t local = 0;
    for (int u = 0; u < lay.num_units(); u++) {
        const int64_t padded = align_up(lay.unit_size(u), (int64_t)world * 128), count = padded / world;
        shards.push_back({.local = local, .count = count, .first = rank * count, .padded = padded});
        local += count;
    }
    return shards;
}

// The two unit gradient buffers (comm), each as large as the largest padded unit.
void fsdp_declare_buffers(Model& m, Arena& A) {
    if (!m.fsdp) m.fsdp = std::make_shared<Fsdp>();
    const int64_t largest = largest_unit_slot(m);
    for (int k = 0; k < 2; k++)
        m.fsdp->grad_slot[k] = A.take<float>("FSDP unit gradient " + std::to_string(k), MEM_COMM, largest);
}

void fsdp_create(Model& m) {
    Fsdp& f = *m.fsdp;
    CUDA_CHECK(cudaEventCreateWithFlags(&f.mark, cudaEventDisableTiming));  // orders the communication stream
    for (auto& g : f.gs) CUDA_CHECK(cudaEventCreateWithFlags(&g.reduced, cudaEventDisableTiming));
}

void fsdp_destroy(Model& m) {
    if (!m.fsdp) return;
    Fsdp& f = *m.fsdp;
    for (auto& g : f.gs)
        if (g.reduced) cudaEventDestroy(g.reduced);
    if (f.mark) cudaEventDestroy(f.mark);
    m.fsdp.reset();
}

// Unit u's slot, this GPU's shard converted into its place, gathered in place on the communication
// stream: every GPU's shard lands in its place of every GPU's slot.
void fsdp_gather(Model& m, bf16* slot, int u) {
    const UnitShard& sh = m.states.shards[u];
    TimelineMark mark(m, m.comm_stream, "fsdp", "gather", u, sh.count * (m.world - 1) * 2);
    m.comm_params->all_gather(slot, slot + sh.first, sh.count, DType::BF16, m.comm_stream);
}

// Unit u's gradient accumulates in a free unit buffer, zeroed, until fsdp_reduce_scatter.
void fsdp_grad_begin(Model& m, int u, cudaStream_t s) {
    Fsdp& f = *m.fsdp;
    for (int i = 0; i < 2; i++) {
        const int k = (f.next_grad_slot + i) % 2;
        Fsdp::GradSlot& g = f.gs[k];
        if (!g.free) continue;
        f.next_grad_slot = (k + 1) % 2;
        if (g.used) CUDA_CHECK(cudaStreamWaitEvent(s, g.reduced, 0));  // its last reduce-scatter read it
        CUDA_CHECK(cudaMemsetAsync(f.grad_slot[k], 0, m.states.shards[u].padded * sizeof(float), s));
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

// Unit u's gradient summed over the GPUs, once the compute stream is done with it: reduce-scattered
// in place, so this GPU's shard of the sum lands in its own place of the buffer, then added to its
// gradient shard, on the communication stream.
void fsdp_reduce_scatter(Model& m, int u, cudaStream_t s) {
    Fsdp& f = *m.fsdp;
    int k = -1;
    for (int j = 0; j < 2; j++)
        if (!f.gs[j].free && f.gs[j].unit == u) k = j;
    if (k < 0) throw std::logic_error("FSDP: a reduce-scatter without fsdp_grad_begin");
    CUDA_CHECK(cudaEventRecord(f.mark, s));
    CUDA_CHECK(cudaStreamWaitEvent(m.comm_stream, f.mark, 0));
    const UnitShard& sh = m.states.shards[u];
    float* own = f.grad_slot[k] + sh.first;
    {
        TimelineMark mark(m, m.comm_stream, "fsdp", "reduce-scatter", u, sh.count * (m.world - 1) * 4);
        m.comm_params->reduce_scatter(own, f.grad_slot[k], sh.count, DType::F32, m.comm_stream);
    }
    add_kernel<<<(unsigned)std::min<int64_t>((sh.count + 255) / 256, 1 << 16), 256, 0, m.comm_stream>>>(
        m.states.grad + sh.local, own, sh.count);  // this GPU's gradient shard += its sum
    CUDA_CHECK_LAUNCH();
    CUDA_CHECK(cudaEventRecord(f.gs[k].reduced, m.comm_stream));
    f.gs[k].free = true;
    m.unit_g[u] = nullptr;
}

std::vector<float> fsdp_gather_unit(Model& m, const float* local, int u, cudaStream_t s) {
    std::vector<float> out(m.layout.unit_size(u));
    CUDA_CHECK(cudaStreamSynchronize(s));
    if (!m.opt.fsdp) {
        CUDA_CHECK(cudaMemcpy(out.data(), local + m.layout.unit_begin[u], out.size() * sizeof(float),
                              cudaMemcpyDeviceToHost));
        return out;
    }
    // Gathered into a unit gradient buffer: outside a step no gradient accumulates there.
    const UnitShard& sh = m.states.shards[u];
    float* buffer = m.fsdp->grad_slot[0];
    m.comm_params->all_gather(buffer, local + sh.local, sh.count, DType::F32, s);
    comm_sync(m.comm_params, s, m.watch.timeout_s);
    CUDA_CHECK(cudaMemcpy(out.data(), buffer, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return out;
}

std::vector<float> fsdp_full_gradients(Model& m, cudaStream_t s) {
    std::vector<float> g(m.layout.total, 0.f);
    for (int u = 0; u < m.layout.num_units(); u++) {
        std::vector<float> unit = fsdp_gather_unit(m, m.states.grad, u, s);
        std::copy(unit.begin(), unit.end(), g.begin() + m.layout.unit_begin[u]);
    }
    return g;
}
