// app/plan.hpp — the memory plan of a whole run, and the refusal of a run
// whose plan does not fit the machine.
//
// Owns: what a run adds to the engine's plan (optimizer workspaces, the
// broadcast's gathered unit and output staging, the async checkpoint snapshot),
// what the token readers hold, and the start-up check of the plan against this
// node's host and GPU memory. The rows themselves come from each subsystem's
// own byte counts; this file only adds them up. Knows the deck and the layout;
// builds nothing large (a backend object only to ask its sizes).
#pragma once

#include <cstdint>
#include <string>

#include "shardlm/backend.hpp"
#include "shardlm/config.hpp"
#include "shardlm/model.hpp"
#include "shardlm/runtime.hpp"
#include "shardlm/memory.hpp"

namespace shardlm {

// The whole per-rank plan of a run: the engine's (shards, units, activations)
// plus what the optimizer, the broadcast and the export add on top.
MemoryPlan run_memory_plan(const Config& config, const ModelLayout& layout, const Backend& backend);

// What the token readers of a deck hold per rank (data.hpp's DataMemory): the
// files' document index, two epochs' orders, the prefetched micro-batch.
// Opens the files for their sizes; a file that cannot be opened is named in
// `note` and left out of the plan (the run itself will report it).
int64_t data_reader_bytes(const Config& config, int64_t vocab_size, std::string* note);

// model.optim_gpu_state_gib against the plan: how many units, from the
// embedding on, keep their optimizer state (fp32 masters and moments) on the
// GPU under the offload pipeline. gpu_bytes: the GPU memory one rank may use
// (0: unknown; then only a cap the deck gives places units on the GPU). The
// automatic choice (a negative cap) takes what the plan with every unit
// offloaded leaves free, less a margin for what the plan does not count (the
// CUDA context, the libraries' workspaces, fragmentation). 0 without the
// offload pipeline.
int64_t offload_gpu_units(const Config& config, const ModelLayout& layout, const Backend& backend, int64_t gpu_bytes);
// GPU memory one rank of this node may use: its share of its GPU, or
// device.memory_limit_gib when lower; 0 on the CPU backend.
int64_t gpu_bytes_per_rank(const Runtime& rt, const Config& config);
// Sets config.model.optim_gpu_units for this run (before the plan is checked
// and the session built); returns the split's line (offload_split_line).
std::string resolve_offload_split(const Runtime& rt, Config& config);
// check's line on the split ("" without the offload pipeline): which units
// keep their state on the GPU, how much, and which are offloaded.
std::string offload_split_line(const Config& config, const ModelLayout& layout, int64_t gpu_bytes);

// The plan of this run against this node's memory, before anything large is
// built: every process of the node holds its host plan at once, and the ranks
// bound to one GPU share its memory (or device.memory_limit_gib when lower).
// Throws an Error naming the deck when it does not fit.
void refuse_plan_over_machine(const Runtime& rt, const Config& config);

}  // namespace shardlm
