// launch.hpp — what main.cpp's subcommands do before their own work, and a
// training run's start up to its first step.
//
// Owns: the deck as the whole job agrees on it (every rank parses it; the
// lowest rank that found errors prints them), with the launch's shape checked
// beside it (which app of an MPMD launch runs which subcommand); the faults
// the tests arm at start-up; the trainers' runtime from the deck (watchdogs,
// device, communicator backend, device memory limit, CPU threads); the
// start-up banner; and the two ends a run can reach before its first step (a
// finished run started again, a stop signalled during setup). Knows nothing
// about the model or the step.
#pragma once

#include <optional>

#include "base/run_dir.hpp"
#include "broadcast/broadcast.hpp"
#include "checkpoint/checkpoint.hpp"
#include "config/cli.hpp"
#include "shardlm/comm.hpp"
#include "shardlm/config.hpp"
#include "shardlm/runtime.hpp"

namespace shardlm {

// Collective over MPI_COMM_WORLD: every rank parses args.deck for `world`
// trainer ranks; the job agrees on whether it is valid (and fits this launch),
// and the lowest rank that found errors prints them. Returns false when the
// deck is bad (the caller exits 1); `config` is the parsed deck either way.
bool load_deck(const Runtime& rt, const CliArgs& args, int world, Config& config);

// Tests (SHARDLM_FAULT): an injected error, a crash or a call through a null
// function pointer at start-up, on the rank the fault names.
void inject_startup_faults();

// The trainers' runtime from the deck: the collective timeout and the watchdog,
// the device (device.backend "auto" resolved into config), the communicator
// backend, the device memory limit and the CPU threads.
void set_up_trainer_runtime(Runtime& rt, Config& config);

// World rank 0: the version, the ranks and their roles, the backend and
// device, the deck and the run dir, the placement.
void print_banner(const Runtime& rt, const Config& config);

// A training run that ends before its first step: at a checkpoint at or past
// run.max_steps (exit 0), or stopped by a signal during setup (exit 75, or 73
// when another run took run.lock). Says why on `trainers`' rank 0, finishes
// the broadcaster with that exit code and returns it; nullopt: train.
// Collective over the trainers.
std::optional<int> end_before_first_step(const Runtime& rt, const Config& config, const ResumePoint& start,
                                         const RunDirLock* run_dir_lock, WeightBroadcaster& broadcaster,
                                         Comm& trainers);

}  // namespace shardlm
