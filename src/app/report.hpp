// app/report.hpp — what a run prints about itself beyond the step lines:
// `shardlm check`'s report of a deck, the setup lines once the session is
// built, and the end-of-run report.
//
// Owns: the text and order of those reports, and the few collectives they need
// (the peaks and Muon's times over the trainers, at the end). Reads the
// TrainSession in one place only (report.cpp's `view`), so a change in the
// session's members changes one function here. Knows nothing about how a step
// is computed or when a checkpoint is saved (the Checkpointer decides; its
// RunEnd is only read).
#pragma once

#include <cstdint>
#include <string>

#include "checkpoint/async.hpp"
#include "broadcast/broadcast.hpp"
#include "app/metrics.hpp"
#include "shardlm/config.hpp"
#include "shardlm/runtime.hpp"

namespace shardlm {

struct TrainSession;

// `shardlm check DECK`, rank 0, the deck already valid for `world` ranks: the
// data as `train` opens it (throws on a bad token file or rollout directory),
// the resolved deck, the model, the memory plan and the data readers, what an
// async checkpoint holds and costs, the plan against this machine, and what
// optim_cpu_offload saves. `deck` is the path as given on the command line.
void check_report(const Config& config, const std::string& deck, int world);

// After the session is built (rank 0 of the trainers prints): model, data,
// eval, the attention kernels, and the setup time with the state's part of it.
void setup_report(const Config& config, TrainSession& session, double setup_s);

// Collective over the trainers, after the last save, when the loop was not
// stopped: metrics' summary (the peaks over the ranks against the run's plan
// with the broadcaster's staging and the readers as built), the offload
// summary, Muon's timing line (steps after `start_step`), and, when the final
// save failed under ckpt.on_error = "continue", the message that explains the
// run's exit 74.
void end_of_run_report(const Runtime& rt, const Config& config, TrainSession& session,
                       const WeightBroadcaster& broadcaster, Metrics& metrics, int64_t start_step, const RunEnd& end,
                       int64_t steps_done);

}  // namespace shardlm
