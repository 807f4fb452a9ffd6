// decoder_cuda.hpp — the GPU decoder's factory, seen from host code without
// CUDA types.
//
// Owns: make_cuda_decoder, plan_cuda_decoder. The decoder itself lives in src/infer/decoder_cuda.cu
// (the Makefile compiles src/*/*.cu only in CUDA builds; src/no_cuda.cpp
// answers for a CPU-only build with a sentence saying there is no CUDA).
// It holds the whole model in bf16 on the current device (uploaded from the
// InferenceModel's fp32 host copy, refreshed parameter by parameter from the
// weight broadcast's bf16 values), a bf16 KV cache (per layer, keys and values
// (slots, max_len, KV, D)), and the activations of the largest prefill or
// decode step; prefill packs every prompt of a call into one pass (the flash
// attention's documents keep them apart), decode attends over the cache with
// src/cuda/decode_attention.hpp, and an extend packs every sequence's new
// tokens into one pass whose rows attend over the cache with the same kernel
// (a row per new token, each to its own length). Logits come back fp32 to host memory, or stay
// on the device where draw() samples them (src/cuda/sampling.hpp; the default:
// SHARDLM_HOST_SAMPLER=1 samples on the host instead, to compare).
// Must not know: sampling, prompt files, MPI, output.
#pragma once

#include <memory>

#include "infer/decoder.hpp"

namespace shardlm {

// On the current CUDA device (select_device bound it). Throws Error when the
// build has no CUDA or the device memory does not hold the plan.
std::unique_ptr<Decoder> make_cuda_decoder(const InferenceModel& model, const DecoderLimits& limits);
// The CUDA decoder's memory for these limits, from the table it allocates from;
// no device needed. Throws Error in a build without CUDA.
DecoderPlan plan_cuda_decoder(const ModelConfig& c, const DecoderLimits& limits);

}  // namespace shardlm
