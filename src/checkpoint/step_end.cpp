// checkpoint/step_end.cpp — the Checkpointer's decisions (async.hpp): at the
// end of every step, whether to save and whether the run stops; at the end of
// the run, how it ends. The exit codes are what the job scripts act on
// (base/signals.hpp): 75 requeues, 74 reports a lost checkpoint, 73 says another
// run took run.dir (base/run_dir.hpp): then nothing more is saved there.
//
// Every branch below is taken on every rank alike: poll, the stop signal and a
// save's outcome are agreed over the trainers before they are returned, so the
// ranks leave the loop at the same step (never one rank in a collective alone).
#include <cstdio>
#include <optional>

#include "checkpoint/agree.hpp"  // comm_rank
#include "checkpoint/async.hpp"
#include "checkpoint/retention.hpp"
#include "base/run_dir.hpp"  // kExitRunDirInUse
#include "base/signals.hpp"
#include "shardlm/runtime.hpp"
#include "train/train.hpp"

namespace shardlm {

namespace {
constexpr StepEnd kGoOn{};
constexpr StepEnd kStopRequeue{true, kExitRequeue};
constexpr StepEnd kStopSaveFailed{true, kExitCheckpointFailed};
constexpr StepEnd kStopRunDirLost{true, kExitRunDirInUse};
}  // namespace

const char* RunEnd::status() const {
  return exit_code == 0                  ? "done"
         : exit_code == kExitRequeue     ? "stopped"
         : exit_code == kExitRunDirInUse ? "run_dir_lost"
                                         : "checkpoint_failed";
}

bool Checkpointer::stops_run(const std::optional<SaveResult>& result) const {
  return result && !result->ok && session_.config.ckpt.on_error == "stop";
}

StepEnd Checkpointer::after_step(int64_t steps_done, int64_t tokens_seen) {
  steps_done_ = steps_done;
  end_ = decide(steps_done, tokens_seen);
  return end_;
}

StepEnd Checkpointer::decide(int64_t steps_done, int64_t tokens_seen) {
  const Config& config = session_.config;
  const bool stop = stop_requested(session_.comm);  // SIGUSR1/SIGTERM/SIGINT on any rank, agreed by all (watched)
  // run.lock names another run now: its directory is not ours to save in, nor to
  // publish a finished background save in (so this comes before poll).
  if (stop && run_dir_lost()) return kStopRunDirLost;
  if (stops_run(poll())) return kStopSaveFailed;  // a background save finished: reported here, failed or not
  const bool last_step = steps_done == config.run.max_steps;
  bool save_failed = false;  // this step's save (sync: known now; async: once waited for)
  if (stop || checkpoint_due(config.ckpt, steps_done, config.run.max_steps)) {
    std::optional<SaveResult> previous;  // the save still in flight, waited for first
    const SaveResult saved = save(steps_done, tokens_seen, &previous);
    save_failed = !saved.ok;
    final_save_failed_ = save_failed && last_step;
    if (stops_run(previous) || stops_run(saved)) return kStopSaveFailed;
  }
  if (!stop) return kGoOn;
  // A signalled stop leaves only once its save is on disk: the requeued job resumes from it.
  const std::optional<SaveResult> written = wait();
  if (stops_run(written)) return kStopSaveFailed;
  if (written && !written->ok) save_failed = true;
  const bool rank0 = ckpt::comm_rank(comm_) == 0;
  if (last_step) {  // nothing left to train: the run completes (exit 0, or 74 if its final save failed)
    final_save_failed_ = final_save_failed_ || save_failed;
    if (rank0)
      std::printf("stop signal %d on the last step (%lld): the run completes, nothing to requeue\n", stop_signal(),
                  (long long)steps_done);
    return kGoOn;
  }
  if (rank0 && !save_failed)
    std::printf("stopped by signal %d after step %lld: exit %d (requeue and resume)\n", stop_signal(),
                (long long)steps_done, kExitRequeue);
  if (rank0 && save_failed)  // ckpt.on_error = "continue": the stop still requeues, from an older checkpoint
    std::printf("stopped by signal %d after step %lld: exit %d, but the checkpoint of step %lld failed "
                "(ckpt.on_error = \"continue\"): a requeued job resumes from the last good checkpoint (or "
                "the start) and trains the steps after it again\n",
                stop_signal(), (long long)steps_done, kExitRequeue, (long long)steps_done);
  return kStopRequeue;
}

RunEnd Checkpointer::finish() {
  if (end_.exit_code == kExitRunDirInUse) {  // a save in flight is abandoned (its .tmp is never renamed)
    RunEnd lost;
    lost.stopped = true;
    lost.exit_code = kExitRunDirInUse;
    return lost;
  }
  // The last save, if it was still being written: at run.max_steps that is the final one.
  const std::optional<SaveResult> last = wait();
  if (last && !last->ok && steps_done_ == session_.config.run.max_steps) final_save_failed_ = true;
  if (stops_run(last) && !end_.stop) end_ = kStopSaveFailed;
  RunEnd run;
  run.stopped = end_.stop;
  run.final_save_failed = !end_.stop && final_save_failed_;
  run.exit_code = end_.stop ? end_.exit_code : run.final_save_failed ? kExitCheckpointFailed : 0;
  return run;
}

}  // namespace shardlm
