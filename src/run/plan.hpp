// run/plan.hpp — the memory plan of a whole run, and the refusal of a run
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

// The plan of this run against this node's memory, before anything large is
// built: every process of the node holds its host plan at once, and the ranks
// bound to one GPU share its memory (or device.memory_limit_gib when lower).
// Throws an Error naming the deck when it does not fit.
void refuse_plan_over_machine(const Runtime& rt, const Config& config);

}  // namespace shardlm
