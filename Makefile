# Makefile - `make` builds, `make test` builds and runs every test, `make run` trains.
#
#   make                 build ./train, the test binaries and the benches (Hopper: sm_90a)
#   make test            run every test suite; GPU tests skip without a GPU; ends with
#                        "N passed, N failed, N skipped"
#   make run             a small model learns the induction task on the visible GPU (RUN_ARGS to change it)
#   make ladder          the talk's memory ladder, measured (on 8 GPUs, or one emulating rank 0 of 8)
#   make long            the talk's stack (stage 6) trained at 3M and 5M tokens on the talk's node
#   make bench           the attention kernels, timed, beside PyTorch where it is installed
#   make notebooks       the figures of results/figures/ from results/
#   make GPU_ARCH='-gencode=arch=compute_80,code=sm_80'   build for another architecture
CUDA_HOME ?= /usr/local/cuda
NVCC      ?= $(CUDA_HOME)/bin/nvcc
CXX       ?= g++
GPU_ARCH  ?= -gencode=arch=compute_90a,code=sm_90a
NVFLAGS   ?= -O3 -std=c++17 $(GPU_ARCH) -lineinfo -Xcompiler -Wall -I.
CXXFLAGS  ?= -O2 -std=c++17 -Wall -I. -I$(CUDA_HOME)/include
LDLIBS    := -L$(CUDA_HOME)/lib64 -lcublasLt -lcudart -lnccl -lpthread
GTEST     := -lgtest -lpthread

# `make` alone builds what `make all` builds.
.DEFAULT_GOAL := all

# The compiler flags in use, kept in build/flags and rewritten only when they change: every
# object depends on it, so a build with another GPU_ARCH (or other flags) rebuilds everything.
BUILD_FLAGS := $(NVCC) $(NVFLAGS) / $(CXX) $(CXXFLAGS)
$(shell mkdir -p build && (echo '$(BUILD_FLAGS)' | cmp -s - build/flags || echo '$(BUILD_FLAGS)' > build/flags))

RUN_ARGS  ?= --config mini --seq-len 4K --batch 4 --steps 1000 --lr 1e-3 --task induction --seed 1

# The talk at the top level (llama.cu and one file per technique); stage 7 in beyond/; the
# layers' kernels in kernels/; the files a run reads and writes in io/; the run's machinery
# (configs, communicator, launcher, ladder, timeline) in infra/.
HEADERS   := llama.h $(wildcard beyond/*.h kernels/*.h kernels/*.cuh io/*.h infra/*.h)
LIB_OBJS  := build/llama.o build/fsdp.o build/ulysses.o build/offload.o build/chunked.o \
             build/beyond/savings.o build/beyond/selective.o \
             build/kernels/kernels.o build/kernels/gemm.o build/kernels/attention.o build/kernels/attention_hopper.o \
             build/io/files.o build/io/data.o build/io/json.o build/io/input_files.o build/io/output_paths.o \
             build/infra/memory.o build/infra/comm.o build/infra/rendezvous.o build/infra/timeline.o build/infra/evaluate.o
APP_OBJS  := build/infra/launch.o build/infra/ladder.o build/infra/options.o build/infra/plan.o build/infra/run.o \
             build/infra/report.o build/io/outputs.o
TEST_BINS := build/tests/test_reference build/tests/test_source build/tests/test_rendezvous build/tests/test_cli build/tests/test_kernels build/tests/test_techniques \
             build/tests/test_attention build/tests/test_model build/tests/test_multi_gpu \
             build/tests/test_files build/tests/test_inputs build/tests/test_outputs build/tests/test_hf build/tests/check_results
TEST_COMMON := build/tests/test_main.o build/tests/reference.o
# tests/check_results.py (results/ holds what README.md and docs/results.md show, they cite nothing
# missing, and every number of README's results table is what its files give, on the GPU they
# name), run by tests/run_tests.sh through a two-line script, as tests/fuzz/fuzz.mk does.
build/tests/check_results: tests/check_results.py
	@mkdir -p $(dir $@) && printf '#!/bin/sh\ncommand -v python3 >/dev/null || { echo "no python3"; echo "TESTCOUNTS passed=0 failed=0 skipped=1"; exit 0; }\nexec python3 "%s/tests/check_results.py"\n' "$(CURDIR)" > $@ && chmod +x $@
TEST_HEADERS := tests/reference.h tests/test_util.h tests/gpu_util.h tests/files_util.h

all: train $(TEST_BINS) build/bench_attention build/bench_attention_hopper build/bench_comm build/schedule_sim

build/%.o: %.cu $(HEADERS) build/flags
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c $< -o $@

build/%.o: %.cpp $(HEADERS) build/flags
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) -c $< -o $@

build/train_lib.o: train.cpp $(HEADERS) build/flags
	$(CXX) $(CXXFLAGS) -DTRAIN_NO_MAIN -c $< -o $@

train: build/train.o $(APP_OBJS) $(LIB_OBJS)
	$(NVCC) $(GPU_ARCH) $^ -o $@ $(LDLIBS)

build/tests/%.o: tests/%.cpp $(HEADERS) $(TEST_HEADERS) build/flags
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) -c $< -o $@

build/tests/%.o: tests/%.cu $(HEADERS) $(TEST_HEADERS) build/flags
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c $< -o $@

# The CPU-only suites link without the library: the rendezvous suite with the rendezvous alone.
build/tests/test_reference build/tests/test_source build/tests/test_rendezvous: build/tests/%: build/tests/%.o $(TEST_COMMON)
	$(CXX) $^ -o $@ $(LDLIBS) $(GTEST)
build/tests/test_rendezvous: build/infra/rendezvous.o

build/tests/test_%: build/tests/test_%.o build/train_lib.o $(APP_OBJS) $(LIB_OBJS) $(TEST_COMMON)
	$(NVCC) $(GPU_ARCH) $^ -o $@ $(LDLIBS) $(GTEST)

build/bench_%: build/bench/%.o build/train_lib.o $(APP_OBJS) $(LIB_OBJS)
	$(NVCC) $(GPU_ARCH) $^ -o $@ $(LDLIBS)

# A model of the dK/dV kernel's block schedule (CPU only; see its header).
build/schedule_sim: bench/schedule_sim.cpp build/flags
	$(CXX) $(CXXFLAGS) $< -o $@

test: all
	@bash tests/run_tests.sh $(TEST_BINS)

# The fuzz targets of the input readers: built by all, each run by test as one suite.
include tests/fuzz/fuzz.mk

run: train
	./train $(RUN_ARGS)

# The talk's node: eight GPUs of 80 GB. With eight GPUs visible (CUDA_VISIBLE_DEVICES, else
# nvidia-smi), a run uses them, one process each (--nproc 8); with fewer, one GPU runs rank 0's
# exact share of the eight-GPU run (--sim-world 8), capped at 80 GiB like an H100.
VISIBLE_GPUS := $(shell if [ -n "$$CUDA_VISIBLE_DEVICES" ]; then echo "$$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .; \
                  else nvidia-smi -L 2>/dev/null | grep -c '^GPU'; fi)
NODE_GPUS ?= $(if $(filter-out 0 1 2 3 4 5 6 7,$(VISIBLE_GPUS)),--nproc 8,--sim-world 8)

# The memory ladder: every stage of both models at 3M and 5M tokens, planned at full depth and
# allocated on the node (--steps 0: the static plan's peak is reached at allocation); at 3M each
# stage's longest context is allocated too, and 1K more tried. JSON under LADDER_OUT (results/ladder/),
# with the commit (TRAIN_COMMIT; git's HEAD here, "-dirty" when the tree has changes).
# LADDER_ARGS adds steps where the GPU time is there (--steps 1 --measure-layers 1). A reduced
# run of the multi-process path on two GPUs: make ladder NODE_GPUS='--nproc 2' LADDER_SEQS=256K
# LADDER_CONFIGS=llama3.2-3b LADDER_OUT=/tmp/ladder.
LADDER_ARGS ?= --mem-cap-gib 80 --steps 0 --task random
LADDER_CONFIGS ?= llama3.2-3b llama3.1-8b
LADDER_SEQS ?= 3M 5M
LADDER_OUT ?= results/ladder
ladder: train
	@mkdir -p $(LADDER_OUT); \
	export TRAIN_COMMIT=$${TRAIN_COMMIT:-$$(git rev-parse HEAD 2>/dev/null || echo unknown)$$(git diff --quiet HEAD 2>/dev/null || echo -dirty)}; \
	for cfg in $(LADDER_CONFIGS); do for seq in $(LADDER_SEQS); do \
	  confirm=$$([ $$seq = 3M ] && echo --confirm-longest); \
	  ./train --ladder --config $$cfg --seq-len $$seq $(NODE_GPUS) $(LADDER_ARGS) $$confirm \
	    --log $(LADDER_OUT)/ladder_$${cfg}_$${seq}.jsonl || exit 1; \
	done; done

# The talk's stack (--stage 6) trained on the node at 3M and then 5M tokens: Llama 3.1 8B at full
# depth, LONG_STEPS steps each, one JSON log per length under LONG_OUT. A step takes tens of
# minutes per GPU at these lengths (each GPU holds S/8 tokens of a sequence whose attention
# grows as S^2). LONG_ARGS adds flags (e.g. --layers 2 for a quick look).
LONG_CONFIG ?= llama3.1-8b
LONG_SEQS ?= 3M 5M
LONG_STEPS ?= 2
LONG_ARGS ?=
LONG_OUT ?= results/multi_gpu
long: train
	@mkdir -p $(LONG_OUT); \
	for seq in $(LONG_SEQS); do \
	  ./train --stage 6 --config $(LONG_CONFIG) --seq-len $$seq --steps $(LONG_STEPS) $(NODE_GPUS) --mem-cap-gib 80 \
	    --task random $(LONG_ARGS) --log $(LONG_OUT)/long_$(LONG_CONFIG)_$$seq.jsonl || exit 1; \
	done

# Tokens/s per GPU at full depth for long contexts, stage 7 with --ckpt=selective
# (THROUGHPUT_FLAGS; '--stage 6' for the talk's stack, every attention rerun as UPipe does):
# a few layers of each model at each length, one of each kind the full-depth plan has (attention output on the host, input rebuilt, attention
# rerun, the last in its slot), and the rest of the step, added up to the full depth; each layer
# taken apart from the --timeline, and the bounds (bench/throughput.sh, bench/throughput.py).
# Output under THROUGHPUT_OUT.
THROUGHPUT_CONFIGS ?= llama3.1-8b llama3.2-3b
THROUGHPUT_SEQS ?= 3M 4M 5M
THROUGHPUT_OUT ?= gpu_logs/throughput
THROUGHPUT_FLAGS ?= --stage 7 --ckpt=selective
throughput: train
	@CONFIGS='$(THROUGHPUT_CONFIGS)' SEQS='$(THROUGHPUT_SEQS)' NODE_GPUS='$(NODE_GPUS)' OUT='$(THROUGHPUT_OUT)' \
	  FLAGS='$(THROUGHPUT_FLAGS)' \
	  bash bench/throughput.sh

# The attention kernels the model uses, each shape checked against attention.cu's first, then
# PyTorch's SDPA on the same shapes. BENCH_SEQS=...,1M adds a million tokens (the reference
# check alone then takes minutes; BENCH_ARGS=--no-check skips it, --reference times attention.cu).
# PyTorch's side runs where PyTorch is installed.
# BENCH_SHAPES: 3B, 8B, and 3B-U8, 8B-U8 (the heads of one of eight Ulysses ranks).
BENCH_SEQS ?= 8K,16K,64K,128K
BENCH_SHAPES ?= 3B,8B
BENCH_ARGS ?=
bench: build/bench_attention
	build/bench_attention --seqs $(BENCH_SEQS) --shapes $(BENCH_SHAPES) $(BENCH_ARGS)
	@python3 -c 'import torch' 2>/dev/null && python3 bench/attention_vs_torch.py --seqs $(BENCH_SEQS) --shapes $(BENCH_SHAPES) || echo "(PyTorch not installed: no side-by-side)"

# Real text at long context: the Linux kernel's source from Debian's linux-source package,
# folders concatenated into documents of 100 KB to 10 MB, byte-level tokens (--config mini-bytes).
# DATA_OUT/train.tok from fs, net, kernel, mm, lib, block, ipc and init; DATA_OUT/heldout.tok
# from sound, crypto and security. Where no package registry is reached, carry
# DATA_OUT/text.tar.xz (21 MiB) and run this again: it tokenizes the carried text.
DATA_OUT ?= data/linux
data:
	python3 bench/corpus.py --out $(DATA_OUT)

clean:
	rm -rf build train

.PHONY: all test run bench ladder long throughput data clean
.SECONDARY:

# The notebooks, committed with their outputs: each runs headless over the committed results and
# ./train --plan (no GPU needed; `make train` builds it) into a temporary copy, writing its PNGs
# to $(RESULTS)/figures/. notebooks/outputs.py then compares the copy's text outputs (streams and
# text/plain; not images, execution counts or metadata) with the committed notebook's and reports
# the first difference, and the fresh notebook is written in place. The target fails if a notebook
# fails (its own traceback shown) or if a text output differs: review the fresh notebooks and
# commit them. RESULTS=DIR draws from another folder, into the temporary copy only (nothing
# compared or written in place). Needs Debian's jupyter-nbconvert, python3-matplotlib,
# python3-ipykernel and python3-nbformat (.ci/run installs them).
RESULTS   ?= results
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))
notebooks:
	@[ -x train ] || { echo "make notebooks: no ./train (make train builds it; the notebooks run ./train --plan)" >&2; exit 1; }
	@out=$$(mktemp -d) && trap 'rm -rf "$$out"' EXIT && failed= && differ= && \
	for nb in $(NOTEBOOKS); do \
	  echo "notebook $$nb (results from $(RESULTS))"; \
	  if ! RESULTS="$(abspath $(RESULTS))" TRAIN="$(abspath train)" MPLBACKEND=Agg PYDEVD_DISABLE_FILE_VALIDATION=1 \
	      PYTHONDONTWRITEBYTECODE=1 jupyter nbconvert --to notebook --execute --ExecutePreprocessor.kernel_name=python3 \
	      --ExecutePreprocessor.timeout=120 --ExecutePreprocessor.record_timing=False --log-level=WARN \
	      --output-dir "$$out" "$$nb" 2>"$$out/log"; then \
	    failed="$$failed $$nb"; \
	    sed 's/\x1b\[[0-9;]*m//g' "$$out/log" > "$$out/err"; \
	    if grep -q -- '^----------------------------------------' "$$out/err"; then \
	      awk '/^----------------------------------------/ { buf = "" } { buf = buf $$0 "\n" } \
	        END { printf "%s", buf }' "$$out/err" | uniq | tail -n 40 >&2; \
	    else tail -n 15 "$$out/err" >&2; fi; \
	    continue; \
	  fi; \
	  [ "$(RESULTS)" = results ] || continue; \
	  python3 notebooks/outputs.py "$$nb" "$$out/$$(basename $$nb)" >&2 || differ="$$differ $$nb"; \
	  cp "$$out/$$(basename $$nb)" "$$nb"; \
	done; \
	if [ -n "$$failed" ]; then echo "notebooks failed:$$failed" >&2; exit 1; fi; \
	if [ -n "$$differ" ]; then echo "notebooks whose text outputs differ from the committed ones (the fresh ones are written in place: review and commit them):$$differ" >&2; exit 1; fi; \
	echo "figures in $(RESULTS)/figures/: $$(cd $(RESULTS)/figures && ls *.png | tr '\n' ' ')"

.PHONY: notebooks
