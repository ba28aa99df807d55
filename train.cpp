// train.cpp - the training program: its flags (infra/options.cpp), the model on this process's
// GPU (infra/run.cpp sets it up: the plan, the GPU and the communicators, the allocation), and
// the training loop, here. The process launcher is infra/launch.cpp; the memory ladder (--ladder)
// is infra/ladder.cpp.
//
//   ./train --config llama3.2-3b --seq-len 8K --steps 20      train, print one line a step
//   ./train --config llama3.1-8b --seq-len 64K --plan         the memory plan, no GPU needed
//   ./train --help                                            every flag
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>

#include "infra/run.h"

// The learning-rate schedule: linear warmup, then cosine decay.
double lr_at(const Options& o, int step) {
    int warmup = o.warmup >= 0 ? o.warmup : std::max(1, o.steps / 10);
    if (step < warmup) return o.lr * (step + 1) / warmup;
    int decay_steps = std::max(1, o.steps - warmup);
    double progress = std::min(1.0, (double)(step - warmup) / decay_steps);
    double min_lr = o.lr * o.min_lr_ratio;
    return min_lr + 0.5 * (o.lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

// The training loop: each step's data, its forward and backward, the optimizer, the report.
static void train_steps(Run& r, SyntheticData& data, int first_step) {
    const Options& o = r.o;
    Model& m = r.m;
    const int64_t T = m.shape.tokens();
    std::vector<int32_t> all_tokens(r.step_tokens), all_targets(r.step_tokens);
    cudaEvent_t ev0, ev1;
    CUDA_CHECK(cudaEventCreate(&ev0));
    CUDA_CHECK(cudaEventCreate(&ev1));
    double last_step_s = model_step_flops(r.cfg, m.shape) / 150e12;  // guess for the first step: 150 TFLOP/s
    StepDocuments all_docs, docs;
    for (int step = first_step; step < o.steps; step++) {
        data.next(all_tokens.data(), all_targets.data(), o.batch * r.dp, o.seq_len, o.step.doc_mask ? &all_docs : nullptr);
        int64_t n_valid = 0;
        for (int32_t t : all_targets) n_valid += t >= 0;
        if (o.step.doc_mask) docs = documents_of_rank(all_docs, m.shape.sp > 1, r.rank, T);
        model_set_batch(m, all_tokens.data() + r.rank * T, all_targets.data() + r.rank * T, r.stream, n_valid,
                        o.step.doc_mask ? &docs : nullptr);
        Progress prog{std::chrono::steady_clock::now(), r.cfg.n_layers, r.stream, &m};
        const bool show_progress = r.lead && last_step_s > 10.0;  // long steps show per-layer progress
        AdamW opt;
        opt.lr = (float)lr_at(o, step);
        opt.weight_decay = (float)o.weight_decay;
        opt.step = step + 1;

        CUDA_CHECK(cudaEventRecord(ev0, r.stream));
        model_forward_backward(m, r.stream, show_progress ? progress_callback : nullptr, &prog);
        if (step == first_step && !o.dump_path.empty()) {
            dump_first_step(r, n_valid);
            CUDA_CHECK(cudaEventRecord(ev0, r.stream));  // the dump is not part of the step's time
        }
        model_optimizer_step(m, opt, (float)o.grad_clip, r.stream);
        CUDA_CHECK(cudaEventRecord(ev1, r.stream));
        CUDA_CHECK(cudaMemcpyAsync(m.watch.host_scalars, m.scalars, 3 * sizeof(float), cudaMemcpyDeviceToHost, r.stream));
        model_sync(m, r.stream);  // host-pinned target: the copy is asynchronous, the wait is watched
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, ev0, ev1));
        const StepReport s{step + 1, n_valid > 0 ? m.watch.host_scalars[0] / n_valid : 0.0, opt.lr,
                           std::sqrt(m.watch.host_scalars[1]), ms / 1000.0,
                           o.step.doc_mask ? document_attention_share(docs, o.seq_len, m.shape.batch) : 1.0};
        last_step_s = s.seconds, r.last_loss = s.loss;
        if (!std::isfinite(s.loss) && !r.simulated) runtime_error("loss is not finite at step " + std::to_string(s.step));
        if (o.state_every && (s.step % o.state_every == 0 || s.step == o.steps))
            save_train_state(m, o.state_dir, s.step, data.state, r.stream, o.comm_timeout_s);
        if (r.lead) report_step(r, s, data);
        if (r.eval.file && o.eval_every && s.step % o.eval_every == 0 && s.step < o.steps) run_eval(r, s.step);
    }
    CUDA_CHECK(cudaEventDestroy(ev0));
    CUDA_CHECK(cudaEventDestroy(ev1));
}

// Flags -> the model on this GPU -> the loop.
static int run(const Options& o, const Launch& launch) {
    Run r;
    r.o = o, r.launch = launch;
    plan_run(r);  // the model, its shape on this GPU, its memory plan
    if (r.lead) print_run(r);
    if (o.plan) return print_plan(r);
    if (int code = open_run(r)) return code;  // the GPU, the allocation on every rank, the weights
    SyntheticData data = make_data(r);
    const int first_step = resume_or_start(r, data);
    if (!o.eval_only) {
        if (r.lead) print_training(r, data);
        train_steps(r, data, first_step);
    }
    if (r.eval.file) run_eval(r, o.eval_only ? first_step : std::max(first_step, o.steps));
    finish(r);
    return EXIT_OK;
}

int train_main(int argc, char** argv) {
    const Launch launch = launch_from_env();
    // A usage error or an out-of-memory is the same on every rank: rank 0 alone reports it.
    auto report = [&](int code, const char* what) {
        if (launch.world > 1 && launch.rank != 0 && g_symmetric_phase) return;
        std::string prefix = launch.world > 1 ? "[rank " + std::to_string(launch.rank) + "] " : "";
        fprintf(stderr, "%s%s%s\n", prefix.c_str(), code == EXIT_OOM ? "" : "error: ", what);
    };
    try {
        Options o = parse_options(argc, argv);
        if (o.help) {
            printf("%s", usage_text().c_str());
            return EXIT_OK;
        }
        if (o.nproc > 1 && launch.world > 1 && o.nproc != launch.world)
            usage_error("--nproc " + std::to_string(o.nproc) + " but the launcher started " +
                        std::to_string(launch.world) + " processes; under mpirun or srun leave --nproc out");
        if (o.host_comm && launch.world > 1 && launch.host_comm_fd < 0)
            usage_error("--comm host runs among the processes that ./train --nproc N starts: under mpirun or srun "
                        "leave it out");
        if (o.host_comm && launch.world == 1 && o.nproc < 2) usage_error("--comm host needs --nproc N, N of 2 or more");
        if (!launch.by_launcher) check_outputs(o, launch.rank == 0);  // under --nproc, once, before the ranks start
        if (o.ladder) return ladder_main(o);
        if (o.nproc > 1 && launch.world == 1 && !o.plan) {
            check_before_launch(o);
            return launch_local(o.nproc, argv, o.host_comm);
        }
        return run(o, launch);
    } catch (const Fatal& f) {
        report(f.code, f.what());
        return f.code;
    } catch (const std::exception& e) {
        report(EXIT_RUNTIME, e.what());
        return EXIT_RUNTIME;
    }
}

#ifndef TRAIN_NO_MAIN
int main(int argc, char** argv) { return train_main(argc, argv); }
#endif
