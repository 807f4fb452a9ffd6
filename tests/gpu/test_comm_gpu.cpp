// test_comm_gpu.cpp — the device communicators of src/cuda/comm_cuda.cu on one
// rank (build/test_gpu): NCCL and staged MPI move device buffers exactly, and a
// collective issued right after an asynchronous write on the compute stream sees
// the written data (the event ordering). tests/gpu/test_multirank.sh runs them
// inside training at world 2 and checks the NCCL watchdog's abort.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "broadcast/broadcast.hpp"
#include "shardlm/comm.hpp"
#include "shardlm/cuda.hpp"
#include "shardlm/error.hpp"

using namespace shardlm;

namespace {

#define REQUIRE_CUDA(call) REQUIRE_MESSAGE((call) == cudaSuccess, #call)

// A pattern no stale or zeroed buffer can match: element i of a call's data.
uint32_t pattern(int64_t i, uint32_t salt) { return uint32_t(i) * 2654435761u ^ salt; }

// One collective of each kind through `kind`'s device Comm on one rank: the
// input is written by an asynchronous copy on the compute stream just before the
// collective, so a collective that did not wait for the stream reads zeros.
void check_device_comm(const char* kind, double timeout_s) {
  REQUIRE_MESSAGE(cuda_device_count() > 0, "no CUDA device: run the GPU suite on a GPU machine");
  cuda_set_device(0);
  cudaStream_t compute;
  REQUIRE_CUDA(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  const int64_t n = (int64_t(1) << 26) + 3;  // 256 MiB of fp32: long enough to overtake if unordered
  auto host = make_self_comm();
  auto comm = make_device_comm(*host, kind, compute, 4 * n, timeout_s);
  CHECK(comm->device_buffers());
  CHECK(comm->size() == 1);

  void *src = nullptr, *dst = nullptr, *pinned = nullptr;
  REQUIRE_CUDA(cudaMalloc(&src, 4 * n));
  REQUIRE_CUDA(cudaMalloc(&dst, 4 * n));
  REQUIRE_CUDA(cudaMallocHost(&pinned, 4 * n));
  std::vector<uint32_t> back(n);
  for (const DType type : {DType::F32, DType::BF16}) {
    for (const bool gather : {true, false}) {
      const uint32_t salt = (gather ? 0x1234u : 0xbeefu) + (type == DType::BF16 ? 7u : 0u);
      const int64_t bytes = n * dtype_bytes(type);
      auto* p32 = static_cast<uint32_t*>(pinned);
      auto* p16 = static_cast<uint16_t*>(pinned);
      for (int64_t i = 0; i < n; ++i) {
        // bf16: finite values only (a NaN pattern could be quieted by a sum)
        if (type == DType::F32) p32[i] = pattern(i, salt) & 0x3fffffffu;
        else p16[i] = uint16_t(pattern(i, salt) & 0x3fffu);
      }
      REQUIRE_CUDA(cudaMemsetAsync(src, 0, 4 * n, compute));
      REQUIRE_CUDA(cudaMemsetAsync(dst, 0, 4 * n, compute));
      REQUIRE_CUDA(cudaMemcpyAsync(src, pinned, bytes, cudaMemcpyHostToDevice, compute));
      CommRequest r = gather ? comm->all_gather(src, dst, n, type) : comm->reduce_scatter(src, dst, n, type);
      r.wait();
      REQUIRE_CUDA(cudaMemcpyAsync(back.data(), dst, bytes, cudaMemcpyDeviceToHost, compute));
      REQUIRE_CUDA(cudaStreamSynchronize(compute));
      int64_t wrong = 0;
      const auto* b16 = reinterpret_cast<const uint16_t*>(back.data());
      for (int64_t i = 0; i < n; ++i)
        wrong += type == DType::F32 ? back[i] != p32[i] : b16[i] != p16[i];
      INFO(kind << (gather ? " all-gather " : " reduce-scatter ") << (type == DType::F32 ? "fp32" : "bf16"));
      CHECK(wrong == 0);
    }
  }
  // In-place broadcast from rank 0: on one rank the buffer is unchanged.
  REQUIRE_CUDA(cudaMemcpyAsync(src, pinned, 4 * n, cudaMemcpyHostToDevice, compute));
  comm->broadcast(src, n, DType::F32, 0).wait();
  REQUIRE_CUDA(cudaMemcpyAsync(back.data(), src, 4 * n, cudaMemcpyDeviceToHost, compute));
  REQUIRE_CUDA(cudaStreamSynchronize(compute));
  CHECK(std::memcmp(back.data(), pinned, 4 * n) == 0);
  // The personalised exchange (expert parallelism's rows): on one rank the
  // send span arrives whole at the receive buffer's offset, after the write
  // queued just before it on the compute stream.
  {
    const int64_t bytes = 4 * n - 12, at = 8;  // the receive block starts 8 bytes in
    const int64_t sb[1] = {bytes}, sd[1] = {0}, rb[1] = {bytes}, rd[1] = {at};
    REQUIRE_CUDA(cudaMemsetAsync(dst, 0, 4 * n, compute));
    REQUIRE_CUDA(cudaMemcpyAsync(src, pinned, bytes, cudaMemcpyHostToDevice, compute));
    comm->all_to_all_v_device(src, sb, sd, dst, rb, rd);
    std::vector<char> got(size_t(bytes + at));
    REQUIRE_CUDA(cudaMemcpyAsync(got.data(), dst, size_t(bytes + at), cudaMemcpyDeviceToHost, compute));
    REQUIRE_CUDA(cudaStreamSynchronize(compute));
    INFO(kind << " all-to-all");
    CHECK(std::memcmp(got.data() + at, pinned, size_t(bytes)) == 0);
  }
  // DESIGN.md rule 4: NCCL, and any device Comm, is never handed host memory
  // (pinned or pageable).
  {
    const std::string name = std::string(kind) == "nccl" ? "NCCL" : "staged MPI";
    std::vector<float> pageable(16);
    CHECK_THROWS_WITH_AS(comm->all_gather(pinned, dst, 16, DType::F32),
                         doctest::Contains((name + " was handed host memory for its all-gather input").c_str()), Error);
    CHECK_THROWS_WITH_AS(comm->reduce_scatter(src, pageable.data(), 16, DType::F32),
                         doctest::Contains((name + " was handed host memory for its reduce-scatter output").c_str()),
                         Error);
    CHECK_THROWS_WITH_AS(comm->broadcast(pageable.data(), 16, DType::BF16, 0),
                         doctest::Contains((name + " was handed host memory for its broadcast buffer").c_str()), Error);
    const int64_t sixteen[1] = {16}, zero[1] = {0};
    CHECK_THROWS_WITH_AS(comm->all_to_all_v_device(src, sixteen, zero, pageable.data(), sixteen, zero),
                         doctest::Contains((name + " was handed host memory for its all-to-all receive buffer").c_str()),
                         Error);
  }
  comm.reset();
  cudaFree(src);
  cudaFree(dst);
  cudaFreeHost(pinned);
  cudaStreamDestroy(compute);
}

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("NCCL device communicator on one rank: device buffers moved exactly, after the compute stream's writes") {
  // With SHARDLM_FAULT=nccl_stall@0 the first collective stalls; the watchdog
  // must end the process within the short timeout (tests/gpu/test_multirank.sh).
  check_device_comm("nccl", std::getenv("SHARDLM_FAULT") ? 2.0 : 120.0);
}

TEST_CASE("staged MPI device communicator on one rank: device buffers moved exactly") {
  check_device_comm("mpi", 120.0);
}

}  // TEST_SUITE

// The weight broadcast's checksum on the GPU (trainer rank 0 hashes the gathered
// unit where it lies; a receiver hashes what arrived in its device memory) is
// the host's bf16_checksum bit for bit: any length, any first index, a
// 16-byte-aligned start or not (the vector and the scalar paths), and it changes
// when one element's bits do.
TEST_CASE("cuda_bf16_checksum = bf16_checksum (the broadcast's), at any length, offset and alignment") {
  REQUIRE_MESSAGE(cuda_device_count() > 0, "no CUDA device: run the GPU suite on a GPU machine");
  cuda_set_device(0);
  const int64_t max_n = (int64_t(1) << 24) + 13;
  std::vector<uint16_t> host(size_t(max_n) + 1);
  for (size_t i = 0; i < host.size(); ++i) host[i] = uint16_t(pattern(int64_t(i), 0x5eed) >> 7);
  void* dev = nullptr;
  REQUIRE_CUDA(cudaMalloc(&dev, host.size() * sizeof(uint16_t)));
  REQUIRE_CUDA(cudaMemcpy(dev, host.data(), host.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
  cudaStream_t stream;
  REQUIRE_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void* sum = nullptr;
  REQUIRE_CUDA(cudaMalloc(&sum, kChecksumScratchBytes));
  for (const int64_t n : {int64_t(1), int64_t(7), int64_t(8), int64_t(9), int64_t(4097), max_n})
    for (const int64_t shift : {int64_t(0), int64_t(1)})       // 1: a start 2 bytes past 16-byte alignment
      for (const int64_t begin : {int64_t(0), int64_t(123456789)}) {
        CAPTURE(n);
        CAPTURE(shift);
        CAPTURE(begin);
        const uint16_t* h = host.data() + shift;
        const void* d = static_cast<const uint16_t*>(dev) + shift;
        CHECK(cuda_bf16_checksum(d, begin, n, sum, stream) == bf16_checksum(h, begin, n));
      }
  CHECK(cuda_bf16_checksum(dev, 0, 0, sum, stream) == 0);
  // One element's bits changed: another sum.
  const uint64_t before = cuda_bf16_checksum(dev, 0, max_n, sum, stream);
  const uint16_t flipped = uint16_t(host[size_t(max_n / 2)] ^ 0x0100);
  REQUIRE_CUDA(cudaMemcpy(static_cast<uint16_t*>(dev) + max_n / 2, &flipped, 2, cudaMemcpyHostToDevice));
  CHECK(cuda_bf16_checksum(dev, 0, max_n, sum, stream) != before);
  REQUIRE_CUDA(cudaStreamDestroy(stream));
  REQUIRE_CUDA(cudaFree(sum));
  REQUIRE_CUDA(cudaFree(dev));
}
