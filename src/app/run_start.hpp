// run_start.hpp — how a training run takes its directory and records its start.
//
// Owns: the collective around run.lock (trainer rank 0 takes it and writes
// config.toml; every trainer learns the outcome), the deck echo in the job log
// (the keys a deck sets), and the RunStart record of this start: on a resume,
// the deck's changes against the checkpoint's deck, printed with what the
// changed schedule gives the next step, and config-step<N>.toml. Knows the
// runtime's communicators, the deck and the checkpoint's attributes; nothing
// about the model or the step.
#pragma once

#include <memory>

#include "checkpoint/checkpoint.hpp"
#include "shardlm/config.hpp"
#include "app/metrics.hpp"
#include "base/run_dir.hpp"
#include "shardlm/runtime.hpp"

namespace shardlm {

// Collective over rt.role_comm (the trainers). The lock on rank 0, null elsewhere;
// its heartbeat asks for a stop (request_stop_run_dir_lost) if another run takes it.
// *in_use is set on every rank when another run holds the directory (rank 0 has
// said so; with receivers in the job it aborts it, since they would wait forever).
// *checkpoints_refused is set on every rank when the checkpoint directory cannot
// be written and ckpt.on_error = "stop" (rank 0 has named the path and the
// reason; the run exits 74 before its first step, as at a failed save); with
// "continue" rank 0 warns and the run trains on.
std::unique_ptr<RunDirLock> open_run_dir(const Runtime& rt, const Config& config, bool* in_use,
                                         bool* checkpoints_refused);

// Rank 0, when the run stopped because run.lock was taken by another run (the
// heartbeat's on_lost; exit kExitRunDirInUse): the message naming that holder.
void report_run_dir_lost(const Runtime& rt, const Config& config, const RunDirLock* lock, int64_t steps_done);

// Rank 0: "deck: N keys set" and one line per key that is not at its default.
void print_deck_echo(const Runtime& rt, const Config& config);

// This start's record for Metrics; rank 0 also writes config-step<N>.toml and,
// on a resume, prints the deck's changes against the checkpoint's deck.
RunStart describe_start(const Runtime& rt, const Config& config, const ResumePoint& start);

}  // namespace shardlm
