# tests/fuzz/fuzz.mk - the fuzz targets of the input readers and the output checks, included by
# the Makefile.
#
# One libFuzzer target per reader of io/input_files.h: the token file, the safetensors header,
# config.json and the sharded index; and one of the checks of the paths a run writes
# (io/output_paths.h) on file systems its input builds (tests/fuzz/fuzz_*.cpp, each with its own
# oracle and seeds under tests/fuzz/seeds/). Each is built by clang++ from their own sources, with
# AddressSanitizer and UndefinedBehaviorSanitizer. `make test` runs each for FUZZ_SECONDS
# through tests/fuzz/run_fuzz.sh and counts it as one test; without a clang++ that links
# libFuzzer (Debian: clang, libclang-rt-dev) the targets are not built and their runs skip.
# tools/tokenize.py has a fuzzer of its own, in Python (tests/fuzz/fuzz_tokenize.py, seeds under
# tests/fuzz/seeds/tokenize/): one more suite, for FUZZ_SECONDS too, needing only python3.
#   make test FUZZ_SECONDS=600         fuzz longer
#   build/fuzz/fuzz_config -help=1     libFuzzer's options, for a run by hand
FUZZ_CXX     ?= clang++
FUZZ_SECONDS ?= 40
FUZZ_FLAGS   := -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -I. -Itests/fuzz
FUZZ_TARGETS := tokens safetensors config index outputs
FUZZ_SOURCES := io/json.cpp io/input_files.cpp io/output_paths.cpp
FUZZ_RUNS    := $(FUZZ_TARGETS:%=build/fuzz/run_%)
export FUZZ_SECONDS

TEST_BINS += $(FUZZ_RUNS)
all: $(FUZZ_RUNS)

# A target that fails to compile fails the build, unless clang++ cannot link libFuzzer at all.
LIBFUZZER_PROBE := echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' | \
                   $(FUZZ_CXX) -x c++ -fsanitize=fuzzer,address,undefined - -o build/fuzz/probe_$* >/dev/null 2>&1
build/fuzz/fuzz_%: tests/fuzz/fuzz_%.cpp tests/fuzz/oracle.h $(FUZZ_SOURCES) io/json.h io/input_files.h io/output_paths.h infra/common.h
	@mkdir -p build/fuzz
	@if $(LIBFUZZER_PROBE); then \
	  echo "$(FUZZ_CXX) $(FUZZ_FLAGS) $< $(FUZZ_SOURCES) -o $@"; \
	  $(FUZZ_CXX) $(FUZZ_FLAGS) $< $(FUZZ_SOURCES) -o $@; \
	else echo "no $(FUZZ_CXX) with libFuzzer: $@ not built, its run will skip"; fi; \
	status=$$?; rm -f build/fuzz/probe_$*; exit $$status

# What tests/run_tests.sh runs: a two-line script calling run_fuzz.sh for the target.
build/fuzz/run_%: build/fuzz/fuzz_% tests/fuzz/run_fuzz.sh
	@printf '#!/bin/sh\nexec bash "%s/tests/fuzz/run_fuzz.sh" %s\n' "$(CURDIR)" $* > $@ && chmod +x $@

# The tokenizer's fuzzer: a script that skips (TESTCOUNTS skipped=1) where there is no python3.
TEST_BINS += build/fuzz/run_tokenize
all: build/fuzz/run_tokenize
build/fuzz/run_tokenize: tests/fuzz/fuzz_tokenize.py
	@mkdir -p build/fuzz
	@printf '#!/bin/sh\ncommand -v python3 >/dev/null || { echo "fuzz_tokenize: no python3: skipped"; echo "TESTCOUNTS passed=0 failed=0 skipped=1"; exit 0; }\nexec python3 "%s/tests/fuzz/fuzz_tokenize.py"\n' "$(CURDIR)" > $@ && chmod +x $@
