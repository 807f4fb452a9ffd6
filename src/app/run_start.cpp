// run_start.cpp — the run directory and the record of a start, for cmd_train.
#include "app/run_start.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "checkpoint/retention.hpp"
#include "base/signals.hpp"
#include "train/optim.hpp"

namespace shardlm {

namespace {

std::string bcast_text(std::string text, MPI_Comm comm) {
  int64_t size = static_cast<int64_t>(text.size());
  MPI_CHECK(MPI_Bcast(&size, 1, MPI_INT64_T, 0, comm));
  text.resize(static_cast<size_t>(size));
  MPI_CHECK(MPI_Bcast(text.data(), static_cast<int>(size), MPI_CHAR, 0, comm));
  return text;
}

// "" when `dir` exists (made if not) and a file can be created in it; else why
// not, with the path and the reason: found at start rather than as MPI-IO's
// "MPI_ERR_OTHER" at the first checkpoint.
std::string writable_dir_problem(const std::filesystem::path& dir, const char* what) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return fmt("cannot create %s %s: %s", what, dir.c_str(), ec.message().c_str());
  if (!std::filesystem::is_directory(dir))
    return fmt("cannot create %s %s: a file of that name is in the way", what, dir.c_str());
  const std::filesystem::path probe = dir / ".shardlm-write-test";
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return fmt("cannot write in %s %s: %s", what, dir.c_str(), std::strerror(errno));
  ::close(fd);
  ::unlink(probe.c_str());
  return "";
}

}  // namespace

std::unique_ptr<RunDirLock> open_run_dir(const Runtime& rt, const Config& config, bool* in_use,
                                         bool* checkpoints_refused) {
  std::unique_ptr<RunDirLock> lock;
  std::string refusal;
  int checkpoints_ok = 1;
  if (rt.world_rank == 0) {  // world rank 0 is trainer rank 0
    try {
      lock = std::make_unique<RunDirLock>(config.run.dir, config.run.name, config.deck_path);
      if (!lock->takeover_note().empty()) std::printf("run dir: %s\n", lock->takeover_note().c_str());
      // Taken by another run mid-run: stop at the end of the step like a signal,
      // agreed by all trainers, but save nothing (report_run_dir_lost says so).
      lock->on_lost([](const std::string&) { request_stop_run_dir_lost(); });
      write_file_atomically(config.run.dir, "config.toml", resolved_deck(config));
      const std::string problem = writable_dir_problem(checkpoint_dir(config), "the checkpoint directory");
      if (!problem.empty()) {
        const bool stop = config.ckpt.on_error == "stop";
        checkpoints_ok = stop ? 0 : 1;
        std::fprintf(stderr, "shardlm: %s: %s\n", problem.c_str(),
                     stop ? "every save would fail; ckpt.on_error = \"stop\": exit 74 before the first step"
                          : "every save will fail; ckpt.on_error = \"continue\": training anyway");
        std::fflush(stderr);
      }
    } catch (const RunDirInUse& e) {
      refusal = e.what();
      std::fprintf(stderr, "shardlm: %s\n", refusal.c_str());
      std::fflush(stderr);
      // Receivers wait for the trainers' first broadcast: only an abort ends them.
      if (rt.num_receivers > 0) MPI_Abort(MPI_COMM_WORLD, kExitRunDirInUse);
    }
  }
  *in_use = !bcast_text(refusal, rt.role_comm).empty();
  MPI_CHECK(MPI_Bcast(&checkpoints_ok, 1, MPI_INT, 0, rt.role_comm));
  *checkpoints_refused = !checkpoints_ok;
  return lock;
}

void report_run_dir_lost(const Runtime& rt, const Config& config, const RunDirLock* lock, int64_t steps_done) {
  if (rt.world_rank != 0) return;
  std::fprintf(stderr,
               "shardlm: run.dir %s was taken by another run: %s/run.lock now names %s. Stopped after step %lld "
               "without a checkpoint and left the directory to that run: exit %d. Give each run its own run.dir "
               "(--set run.dir=...)\n",
               config.run.dir.c_str(), config.run.dir.c_str(), lock ? lock->lost_to().c_str() : "another holder",
               (long long)steps_done, kExitRunDirInUse);
  std::fflush(stderr);
}

void print_deck_echo(const Runtime& rt, const Config& config) {
  if (rt.world_rank != 0) return;
  Config defaults;
  defaults.deck_path = config.deck_path;
  std::vector<DeckChange> set = deck_changes(resolved_deck(defaults), resolved_deck(config), "the defaults");
  // A key with no meaning for the rest of this deck (loss.mask_high under the
  // clipped objective) is commented out of its resolved deck: not set, not shown.
  std::erase_if(set, [](const DeckChange& c) { return c.after.empty(); });
  std::printf("deck: %zu key%s set (the full resolved deck: %s/config.toml)\n", set.size(), set.size() == 1 ? "" : "s",
              config.run.dir.c_str());
  for (const auto& c : set) std::printf("  %s = %s\n", c.key.c_str(), c.after.c_str());
  std::fflush(stdout);
}

RunStart describe_start(const Runtime& rt, const Config& config, const ResumePoint& start) {
  RunStart r;
  r.step = start.step;
  r.tokens_seen = start.tokens_seen;
  r.checkpoint = start.path.string();
  r.world_size = rt.num_trainers;
  r.host = rt.hostname;
  r.backend = rt.backend;
  r.version = fmt("%s (%s)", shardlm_version(), shardlm_git_rev());
  if (rt.world_rank != 0) return r;
  const std::string deck = resolved_deck(config);
  r.deck_file = keep_start_deck(config.run.dir, start.step, deck);
  if (!start.path.empty()) {
    const std::string saved_deck = read_checkpoint_info(start.path).deck;
    r.deck_changes = deck_changes(saved_deck, deck, start.path.filename().string());
    if (r.deck_changes.empty()) std::printf("resume: the deck is the one %s was saved with\n", start.path.filename().c_str());
    else
      std::printf("resume: %zu deck key%s differ%s from the deck %s was saved with:\n", r.deck_changes.size(),
                  r.deck_changes.size() == 1 ? "" : "s", r.deck_changes.size() == 1 ? "s" : "",
                  start.path.filename().c_str());
    bool schedule_changed = false;
    for (const auto& c : r.deck_changes) {
      std::printf("  %s: %s -> %s\n", c.key.c_str(), c.before.empty() ? "(absent)" : c.before.c_str(),
                  c.after.empty() ? "(absent)" : c.after.c_str());
      schedule_changed |= c.key.rfind("sched.", 0) == 0 || c.key == "run.max_steps" || c.key == "optim.lr";
    }
    if (schedule_changed) {  // the schedule is a function of these: say what the next step gets
      const Config before = parse_deck_text(saved_deck, start.path.string(), {}, 0).config;
      std::printf("  the lr schedule follows this deck: step %lld trains at lr %.4e (%.4e with the checkpoint's "
                  "deck)\n", (long long)start.step + 1,
                  lr_at(config.sched, config.optim.lr, config.run.max_steps, start.step),
                  lr_at(before.sched, before.optim.lr, before.run.max_steps, start.step));
    }
    std::fflush(stdout);
  }
  return r;
}

}  // namespace shardlm
