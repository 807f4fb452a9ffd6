# shardlm — build, run and test.
#
#   make            build build/shardlm (CPU backend, plus CUDA when nvcc is found)
#   make run        train inputs/tiny-sft.toml under mpirun -np 2
#   make run-text   train inputs/text-sft.toml (real text) under mpirun -np 2
#   make test       all CPU test suites; ends with "N passed, N failed"
#   make test-gpu   the same plus the GPU suites (CUDA build, needs a GPU)
#   make test-sanitize  ASan + UBSan build in build-sanitize/ (SANITIZE=1): the
#                   unit suite and tiny runs at -np 1 and 2 (docs/testing.md)
#   make clean
#
# On a fresh Debian/Ubuntu machine `make run` and `make test` install what is
# missing (tools/install-deps.sh). On a cluster, load modules and override:
#   make MPICXX=... HDF5_DIR=... BLAS_LIBS=... CUDA_HOME=... CUDA=0|1 CUDA_ARCH=... CUDNN=0|1 CUDNN_HOME=...

MPICXX    ?= mpicxx
MPIRUN    ?= mpirun
PKG_CONFIG ?= pkg-config
# SANITIZE=1: AddressSanitizer + UndefinedBehaviorSanitizer, CPU backend, its own build dir.
SANITIZE  ?= 0
ifeq ($(SANITIZE),1)
BUILD     ?= build-sanitize
OPT       ?= -O1
CUDA      := 0
SANITIZE_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
endif
BUILD     ?= build
OPT       ?= -O2
CUDA_HOME ?= /usr/local/cuda
NVCC      ?= $(CUDA_HOME)/bin/nvcc
CUDA      ?= $(if $(wildcard $(NVCC)),1,0)
CUDA_ARCH ?= -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=sm_90
# Python interpreter with h5py + numpy, for tools and tool tests.
PYTHON    ?= $(shell tools/find_python.sh)

# Dependencies: pkg-config names, or explicit overrides from modules.
ifdef HDF5_DIR
HDF5_CFLAGS ?= -I$(HDF5_DIR)/include
HDF5_LIBS   ?= -L$(HDF5_DIR)/lib -Wl,-rpath,$(HDF5_DIR)/lib -lhdf5
else
HDF5_CFLAGS ?= $(shell $(PKG_CONFIG) --cflags hdf5-openmpi 2>/dev/null || $(PKG_CONFIG) --cflags hdf5 2>/dev/null)
HDF5_LIBS   ?= $(shell $(PKG_CONFIG) --libs hdf5-openmpi 2>/dev/null || $(PKG_CONFIG) --libs hdf5 2>/dev/null)
endif
TOML_CFLAGS ?= $(shell $(PKG_CONFIG) --cflags tomlplusplus 2>/dev/null)
TOML_LIBS   ?= $(shell $(PKG_CONFIG) --libs tomlplusplus 2>/dev/null)
# OpenBLAS built on OpenMP shares our thread pool; the pthreads build would
# fight the OpenMP threads for the cores (measured: 10x slower on 2 cores).
BLAS_OMP_DIR := $(patsubst %/pkgconfig,%,$(firstword $(wildcard /usr/lib/*/openblas-openmp/pkgconfig)))
ifneq ($(BLAS_OMP_DIR),)
BLAS_CFLAGS ?= $(shell PKG_CONFIG_PATH=$(BLAS_OMP_DIR)/pkgconfig $(PKG_CONFIG) --cflags openblas)
BLAS_LIBS   ?= $(shell PKG_CONFIG_PATH=$(BLAS_OMP_DIR)/pkgconfig $(PKG_CONFIG) --libs openblas) -Wl,-rpath,$(BLAS_OMP_DIR)
else
BLAS_CFLAGS ?= $(shell $(PKG_CONFIG) --cflags openblas 2>/dev/null || $(PKG_CONFIG) --cflags blas 2>/dev/null)
BLAS_LIBS   ?= $(shell $(PKG_CONFIG) --libs openblas 2>/dev/null || $(PKG_CONFIG) --libs blas 2>/dev/null)
endif
JSON_CFLAGS ?= $(shell $(PKG_CONFIG) --cflags nlohmann_json 2>/dev/null)
# PCRE2 with Unicode properties: the tokenizer's pre-tokenizer regex (src/data/token_encoder.cpp).
PCRE2_CFLAGS ?= $(shell $(PKG_CONFIG) --cflags libpcre2-8 2>/dev/null)
PCRE2_LIBS   ?= $(shell $(PKG_CONFIG) --libs libpcre2-8 2>/dev/null || echo -lpcre2-8)
MPI_CFLAGS  ?= $(shell $(MPICXX) --showme:compile 2>/dev/null)

CXXFLAGS ?= $(OPT) -g
CXXFLAGS += -std=c++20 -Wall -Wextra -fopenmp -MMD -MP -Iinclude -Isrc -DOMPI_SKIP_MPICXX -DMPICH_SKIP_MPICXX \
            $(HDF5_CFLAGS) $(TOML_CFLAGS) $(BLAS_CFLAGS) $(JSON_CFLAGS) $(PCRE2_CFLAGS)
LDLIBS   += $(HDF5_LIBS) $(TOML_LIBS) $(BLAS_LIBS) $(PCRE2_LIBS) -lz -fopenmp
CXXFLAGS += $(SANITIZE_FLAGS)
LDLIBS   += $(SANITIZE_FLAGS)

VERSION := $(shell cat VERSION 2>/dev/null || echo 0.0.0)
GIT_REV := $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
# Only the file that prints them: every commit changes GIT_REV, and a flag on
# every file would make each build after a commit miss ccache everywhere.
VERSION_FLAGS := -DSHARDLM_VERSION='"$(VERSION)"' -DSHARDLM_GIT_REV='"$(GIT_REV)"'

LIB_SRCS := $(wildcard src/*/*.cpp)
CU_SRCS  := $(wildcard src/*/*.cu)
ifeq ($(CUDA),1)
NVCCFLAGS ?= $(OPT) -lineinfo
NVCCFLAGS += -std=c++20 $(CUDA_ARCH) -Iinclude -Isrc $(MPI_CFLAGS) -DOMPI_SKIP_MPICXX -ccbin $(firstword $(CXX)) \
             -Xcompiler -Wall,-Wextra,-fopenmp -MMD -MP
LIB_OBJS := $(LIB_SRCS:%.cpp=$(BUILD)/obj/%.o) $(CU_SRCS:%.cu=$(BUILD)/obj/%.o)
LDLIBS   += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublasLt -lcublas -lnccl -lcudart
# cuDNN's fused attention (src/cuda/sdpa_cudnn.cu) needs only cuDNN 9's headers at
# build time: the library is opened at run time, so the binary starts without it
# (and says so). CUDNN=0 builds without; CUDNN_HOME points at another install.
CUDNN_HOME ?= $(CUDA_HOME)
CUDNN      ?= $(if $(wildcard $(CUDNN_HOME)/include/cudnn_graph.h),1,0)
NVCCFLAGS  += -DSHARDLM_CUDNN=$(CUDNN) $(if $(filter 1,$(CUDNN)),-I$(CUDNN_HOME)/include)
LDLIBS     += -ldl
else
LIB_OBJS := $(LIB_SRCS:%.cpp=$(BUILD)/obj/%.o) $(BUILD)/obj/src/no_cuda.o
endif

UNIT_OBJS := $(patsubst %.cpp,$(BUILD)/obj/%.o,$(wildcard tests/unit/*.cpp)) $(BUILD)/obj/tests/main_unit.o
MPI_OBJS  := $(patsubst %.cpp,$(BUILD)/obj/%.o,$(wildcard tests/mpi/*.cpp)) $(BUILD)/obj/tests/main_mpi.o
GPU_OBJS  := $(patsubst %.cpp,$(BUILD)/obj/%.o,$(wildcard tests/gpu/*.cpp)) $(BUILD)/obj/tests/main_unit.o

.PHONY: all run run-text test test-gpu test-sanitize test-suites clean deps bench-cpu-adamw bench-h2d bench-gemm-algos bench-cudnn-fp8-attention bench-moe-gemm
all: $(BUILD)/shardlm $(BUILD)/test_unit $(BUILD)/test_mpi

$(BUILD)/shardlm: $(BUILD)/obj/src/main.o $(LIB_OBJS)
	$(MPICXX) -o $@ $^ $(LDLIBS)

$(BUILD)/test_unit: $(UNIT_OBJS) $(LIB_OBJS)
	$(MPICXX) -o $@ $^ $(LDLIBS)

$(BUILD)/test_mpi: $(MPI_OBJS) $(LIB_OBJS)
	$(MPICXX) -o $@ $^ $(LDLIBS)

# GPU-only suites (CUDA builds): run by `make test-gpu` on a machine with a GPU.
$(BUILD)/test_gpu: $(GPU_OBJS) $(LIB_OBJS)
	$(MPICXX) -o $@ $^ $(LDLIBS)

# The GPU suites call the CUDA runtime directly (device buffers for the communicator tests).
$(BUILD)/obj/tests/gpu/%.o: CXXFLAGS += -I$(CUDA_HOME)/include
$(BUILD)/obj/src/comm/runtime.o: CXXFLAGS += $(VERSION_FLAGS)

# The host AdamW benchmark (tools/bench_cpu_adamw.cpp); not part of `all`.
bench-cpu-adamw: $(BUILD)/bench_cpu_adamw

$(BUILD)/bench_cpu_adamw: $(BUILD)/obj/tools/bench_cpu_adamw.o $(BUILD)/obj/src/cpu/adamw.o
	$(MPICXX) -o $@ $^ -fopenmp

# The link microbenchmark (tools/bench_h2d.cu: uploads alone, beside downloads,
# beside a memory-bound host loop); standalone, not part of `all`.
bench-h2d: $(BUILD)/bench_h2d

$(BUILD)/bench_h2d: tools/bench_h2d.cu
	@mkdir -p $(dir $@)
	$(NVCC) -O2 -std=c++17 $(CUDA_ARCH) -Xcompiler -fopenmp,-Wall,-Wextra $< -o $@ -lgomp

# The decode GEMMs' candidate algorithms timed one by one (tools/bench_gemm_algos.cu);
# standalone, not part of `all`.
bench-gemm-algos: $(BUILD)/bench_gemm_algos

$(BUILD)/bench_gemm_algos: tools/bench_gemm_algos.cu
	@mkdir -p $(dir $@)
	$(NVCC) -O2 -std=c++17 $(CUDA_ARCH) -Xcompiler -Wall,-Wextra $< -o $@ -lcublasLt

# A layer of experts' GEMMs each way cuBLAS runs them (tools/bench_moe_gemm.cu);
# standalone, not part of `all`.
bench-moe-gemm: $(BUILD)/bench_moe_gemm

$(BUILD)/bench_moe_gemm: tools/bench_moe_gemm.cu
	@mkdir -p $(dir $@)
	$(NVCC) -O2 -std=c++17 $(CUDA_ARCH) -Xcompiler -Wall,-Wextra $< -o $@ -lcublas

# cuDNN's FP8 attention against bf16 at the training shapes
# (tools/bench_cudnn_fp8_attention.cu); standalone, not part of `all`: needs NVIDIA's
# header-only cudnn-frontend (CUDNN_FRONTEND=.../cudnn-frontend/include).
bench-cudnn-fp8-attention: $(BUILD)/bench_cudnn_fp8_attention

$(BUILD)/bench_cudnn_fp8_attention: tools/bench_cudnn_fp8_attention.cu
	@test -n "$(CUDNN_FRONTEND)" -a -f "$(CUDNN_FRONTEND)/cudnn_frontend.h" || \
	  { echo "bench-cudnn-fp8-attention: set CUDNN_FRONTEND to cudnn-frontend's include directory"; exit 1; }
	@mkdir -p $(dir $@)
	$(NVCC) -O2 -std=c++17 $(CUDA_ARCH) -I$(CUDNN_FRONTEND) -I$(CUDNN_HOME)/include $< -o $@ -L$(CUDNN_HOME)/lib64 -lcudnn -lnvrtc -lcuda

$(BUILD)/obj/%.o: %.cpp
	@mkdir -p $(dir $@)
	$(MPICXX) $(CXXFLAGS) -c $< -o $@

$(BUILD)/obj/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

$(BUILD)/obj/tests/main_unit.o: tests/test_main.cpp
	@mkdir -p $(dir $@)
	$(MPICXX) $(CXXFLAGS) -c $< -o $@

$(BUILD)/obj/tests/main_mpi.o: tests/test_main.cpp
	@mkdir -p $(dir $@)
	$(MPICXX) $(CXXFLAGS) -DSHARDLM_TEST_MPI -c $< -o $@

# run and test install missing dependencies first, then build in a fresh make so
# that the pkg-config flags above are read after the install.
deps:
	@bash tools/install-deps.sh

run: deps
	@$(MAKE) --no-print-directory all
	@MPIRUN="$(MPIRUN)" bash tools/run-tiny.sh

# The real-text deck: a 0.77M-parameter model on the King James Bible, about two
# minutes on 2 cores (docs/text-sft.md).
run-text: deps
	@$(MAKE) --no-print-directory all
	@bash tools/make_text_data.sh
	@MPIRUN="$(MPIRUN)" DECK=inputs/text-sft.toml bash tools/run-tiny.sh

test: deps
	@$(MAKE) --no-print-directory all
	@MPIRUN="$(MPIRUN)" PYTHON="$(PYTHON)" BUILD="$(BUILD)" bash tests/run.sh

test-gpu: deps
	@$(MAKE) --no-print-directory all $(BUILD)/test_gpu CUDA=1
	@MPIRUN="$(MPIRUN)" PYTHON="$(PYTHON)" BUILD="$(BUILD)" SHARDLM_TEST_GPU=1 bash tests/run.sh

# The sanitizer build: the unit suite and tiny runs at -np 1 and 2 must be clean
# (any ASan or UBSan report fails them). About 10 minutes on 2 cores, build included.
test-sanitize: deps
	@$(MAKE) --no-print-directory SANITIZE=1 BUILD=build-sanitize build-sanitize/shardlm build-sanitize/test_unit
	@MPIRUN="$(MPIRUN)" PYTHON="$(PYTHON)" BUILD=build-sanitize bash tests/sanitize.sh

clean:
	rm -rf $(BUILD)

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
