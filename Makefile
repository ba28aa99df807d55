# Makefile - `make` builds, `make test` builds and runs every test, `make run` trains.
#
#   make                 build ./train and the test binaries (Hopper: sm_90a)
#   make test            run every test suite; GPU tests skip without a GPU; ends with
#                        "N passed, N failed, N skipped"
#   make run             train the default model on the visible GPU (RUN_ARGS to change it)
#   make GPU_ARCH='-gencode=arch=compute_80,code=sm_80'   build for another architecture
CUDA_HOME ?= /usr/local/cuda
NVCC      ?= $(CUDA_HOME)/bin/nvcc
CXX       ?= g++
GPU_ARCH  ?= -gencode=arch=compute_90a,code=sm_90a
NVFLAGS   ?= -O3 -std=c++17 $(GPU_ARCH) -lineinfo -Xcompiler -Wall
CXXFLAGS  ?= -O2 -std=c++17 -Wall -I$(CUDA_HOME)/include
LDLIBS    := -L$(CUDA_HOME)/lib64 -lcublasLt -lcudart -lnccl -lpthread
GTEST     := -lgtest -lpthread

RUN_ARGS  ?= --config llama3.2-3b --seq-len 8K --steps 30 --lr 3e-4 --task copy

HEADERS   := common.h llama.h train.h attention_ptx.cuh
LIB_OBJS  := build/llama.o build/attention.o build/attention_hopper.o build/checkpointing.o build/chunked.o build/offload.o build/fsdp.o \
             build/ulysses.o build/untied.o build/comm.o build/checkpoint.o
TEST_BINS := build/tests/test_reference build/tests/test_cli build/tests/test_kernels build/tests/test_techniques \
             build/tests/test_attention build/tests/test_model build/tests/test_multi_gpu \
             build/tests/test_files build/tests/test_hf
TEST_COMMON := build/tests/test_main.o build/tests/reference.o

all: train $(TEST_BINS) build/bench_attention build/bench_attention_hopper build/schedule_sim

build/%.o: %.cu $(HEADERS) | build
	$(NVCC) $(NVFLAGS) -c $< -o $@

build/train.o: train.cpp $(HEADERS) | build
	$(CXX) $(CXXFLAGS) -c $< -o $@

build/train_lib.o: train.cpp $(HEADERS) | build
	$(CXX) $(CXXFLAGS) -DTRAIN_NO_MAIN -c $< -o $@

train: build/train.o $(LIB_OBJS)
	$(NVCC) $(GPU_ARCH) $^ -o $@ $(LDLIBS)

build/tests/%.o: tests/%.cpp $(HEADERS) tests/reference.h tests/test_util.h | build
	$(CXX) $(CXXFLAGS) -c $< -o $@

build/tests/%.o: tests/%.cu $(HEADERS) tests/reference.h tests/test_util.h tests/gpu_util.h | build
	$(NVCC) $(NVFLAGS) -c $< -o $@

build/tests/test_reference: build/tests/test_reference.o $(TEST_COMMON)
	$(CXX) $^ -o $@ $(LDLIBS) $(GTEST)

build/tests/test_%: build/tests/test_%.o build/train_lib.o $(LIB_OBJS) $(TEST_COMMON)
	$(NVCC) $(GPU_ARCH) $^ -o $@ $(LDLIBS) $(GTEST)

build/bench_%: build/bench/%.o build/train_lib.o $(LIB_OBJS)
	$(NVCC) $(GPU_ARCH) $^ -o $@ $(LDLIBS)

build/bench/%.o: bench/%.cu $(HEADERS) | build
	$(NVCC) $(NVFLAGS) -c $< -o $@

# A model of the dK/dV kernel's block schedule (CPU only; see its header).
build/schedule_sim: bench/schedule_sim.cpp | build
	$(CXX) $(CXXFLAGS) $< -o $@

build:
	mkdir -p build/tests build/bench

test: all
	@bash tests/run_tests.sh $(TEST_BINS)

run: train
	./train $(RUN_ARGS)

# The memory ladder of the talk on one GPU emulating rank 0 of eight 80 GB GPUs: every stage
# of both models at 3M and 5M tokens is planned at full depth and allocated (--steps 0: the
# static plan's peak is reached at allocation); at 3M each stage's longest context is allocated
# too, and 1K more tried (refused where 1K costs more than the plan's runtime margin). JSON under
# results/, with the commit (TRAIN_COMMIT; git's HEAD here, "-dirty" when the tree has changes).
# LADDER_ARGS adds steps where the GPU time is there (--steps 1 --measure-layers 1).
LADDER_ARGS ?= --sim-world 8 --mem-cap-gib 80 --steps 0 --task random
LADDER_CONFIGS ?= llama3.2-3b llama3.1-8b
ladder: train
	@export TRAIN_COMMIT=$${TRAIN_COMMIT:-$$(git rev-parse HEAD 2>/dev/null || echo unknown)$$(git diff --quiet HEAD 2>/dev/null || echo -dirty)}; \
	for cfg in $(LADDER_CONFIGS); do for seq in 3M 5M; do \
	  confirm=$$([ $$seq = 3M ] && echo --confirm-longest); \
	  ./train --ladder --config $$cfg --seq-len $$seq $(LADDER_ARGS) $$confirm --log results/ladder_$${cfg}_$${seq}.jsonl || exit 1; \
	done; done

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


clean:
	rm -rf build train

.PHONY: all test run bench ladder clean
.SECONDARY:

# The figures: every notebook in notebooks/ runs headless over the committed results (a copy with
# outputs goes to a temporary folder, so the committed notebooks stay output-free) and writes its
# PNGs to $(RESULTS)/figures/. A notebook whose results files are missing or malformed fails, and
# so does this target (after the others ran; a failure shows the notebook's own traceback).
# RESULTS=DIR draws from another folder. Needs Debian's jupyter-nbconvert, python3-matplotlib,
# python3-ipykernel and python3-nbformat (.ci/run installs them).
RESULTS   ?= results
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))
notebooks:
	@out=$$(mktemp -d) && trap 'rm -rf "$$out"' EXIT && failed= && \
	for nb in $(NOTEBOOKS); do \
	  echo "notebook $$nb (results from $(RESULTS))"; \
	  RESULTS="$(abspath $(RESULTS))" MPLBACKEND=Agg PYDEVD_DISABLE_FILE_VALIDATION=1 \
	    jupyter nbconvert --to notebook --execute --ExecutePreprocessor.kernel_name=python3 \
	    --ExecutePreprocessor.timeout=120 --log-level=WARN --output-dir "$$out" "$$nb" 2>"$$out/log" && continue; \
	  failed="$$failed $$nb"; \
	  sed 's/\x1b\[[0-9;]*m//g' "$$out/log" > "$$out/err"; \
	  if grep -q -- '^----------------------------------------' "$$out/err"; then \
	    awk '/^----------------------------------------/ { buf = "" } { buf = buf $$0 "\n" } \
	      END { printf "%s", buf }' "$$out/err" | uniq | tail -n 40 >&2; \
	  else tail -n 15 "$$out/err" >&2; fi; \
	done; \
	if [ -n "$$failed" ]; then echo "notebooks failed:$$failed" >&2; exit 1; fi; \
	echo "figures in $(RESULTS)/figures/: $$(cd $(RESULTS)/figures && ls *.png | tr '\n' ' ')"

.PHONY: notebooks
