// test_runs.cpp — what makes runs trustworthy and comparable, without MPI: the
// run-dir lock, deck comparison and the kept decks, metrics.jsonl across a
// resume (dropped rows, event rows, NaN as null, a failed write), the lr floor
// as a fraction of the peak, TensorBoard event files read back by a decoder
// written here, and the tokenizer files an export carries.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>

#include <nlohmann/json.hpp>

#include "model/tokenizer_files.hpp"
#include "app/metrics.hpp"
#include "base/run_dir.hpp"
#include "app/tensorboard.hpp"
#include "train/optim.hpp"
#include "run_command.hpp"

using namespace shardlm;
using shardlm_test::host_name;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& what)
      : path(fs::temp_directory_path() / ("shardlm-runs-" + what + "-" + std::to_string(getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_text(const fs::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }

std::vector<nlohmann::json> rows_of(const fs::path& p) {
  std::vector<nlohmann::json> rows;
  std::ifstream in(p);
  std::string line;
  while (std::getline(in, line)) rows.push_back(nlohmann::json::parse(line));  // throws on a line that is not JSON
  return rows;
}

StepStats stats(int64_t step, double loss) {
  StepStats s;
  s.step = step;
  s.loss = loss;
  s.grad_norm = 0.5;
  s.lr = 1e-3;
  s.tokens = 100;
  s.loss_tokens = 90;
  s.step_time_s = 0.01;
  return s;
}

// ---- a TFRecord / Event decoder of our own, to read the files back

struct Reader {
  const std::string& b;
  size_t at = 0;
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      const auto c = static_cast<unsigned char>(b.at(at++));
      v |= uint64_t(c & 0x7f) << shift;
      if (!(c & 0x80)) return v;
    }
  }
  template <class T>
  T fixed() {
    T v;
    std::memcpy(&v, b.data() + at, sizeof v);
    at += sizeof v;
    return v;
  }
  std::string bytes() {
    const size_t n = varint();
    std::string s = b.substr(at, n);
    at += n;
    return s;
  }
  bool done() const { return at >= b.size(); }
};

struct DecodedEvent {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  int session_status = -1;
  std::vector<std::pair<std::string, float>> scalars;
};

DecodedEvent decode_event(const std::string& e) {
  DecodedEvent out;
  Reader r{e};
  while (!r.done()) {
    const uint64_t key = r.varint();
    const int field = int(key >> 3);
    if (field == 1) out.wall_time = r.fixed<double>();
    else if (field == 2) out.step = int64_t(r.varint());
    else if (field == 3) out.file_version = r.bytes();
    else if (field == 7) {  // session_log
      const std::string log = r.bytes();
      Reader l{log};
      REQUIRE(l.varint() == (1u << 3 | 0));
      out.session_status = int(l.varint());
    } else if (field == 5) {
      const std::string summary = r.bytes();
      Reader s{summary};
      while (!s.done()) {
        REQUIRE(s.varint() == (1u << 3 | 2));
        const std::string value = s.bytes();
        Reader v{value};
        REQUIRE(v.varint() == (1u << 3 | 2));
        const std::string tag = v.bytes();
        REQUIRE(v.varint() == (2u << 3 | 5));
        out.scalars.push_back({tag, v.fixed<float>()});
      }
    } else {
      FAIL("unexpected Event field " << field);
    }
  }
  return out;
}

// Every record of an event file; each CRC is checked.
std::vector<DecodedEvent> read_events(const fs::path& file) {
  const std::string b = read_text(file);
  std::vector<DecodedEvent> events;
  size_t at = 0;
  while (at < b.size()) {
    REQUIRE(at + 12 <= b.size());
    uint64_t length;
    uint32_t length_crc, data_crc;
    std::memcpy(&length, b.data() + at, 8);
    std::memcpy(&length_crc, b.data() + at + 8, 4);
    CHECK(length_crc == masked_crc32c(b.data() + at, 8));
    REQUIRE(at + 12 + length + 4 <= b.size());
    const std::string data = b.substr(at + 12, length);
    std::memcpy(&data_crc, b.data() + at + 12 + length, 4);
    CHECK(data_crc == masked_crc32c(data.data(), data.size()));
    events.push_back(decode_event(data));
    at += 12 + length + 4;
  }
  return events;
}

}  // namespace

TEST_SUITE("runs") {

TEST_CASE("run.lock: a second run is refused at once naming host, pid and start; released on exit") {
  TempDir t("lock");
  {
    RunDirLock first(t.path / "run", "tiny", "deck.toml");
    CHECK(first.takeover_note().empty());
    const std::string text = read_text(t.path / "run/run.lock");
    CHECK(text.find("pid=" + std::to_string(getpid()) + "\n") != std::string::npos);
    try {
      RunDirLock second(t.path / "run", "other", "other.toml");
      FAIL("a second lock on the same directory was granted");
    } catch (const RunDirInUse& e) {
      const std::string m = e.what();
      CHECK(m.find("is in use") != std::string::npos);
      CHECK(m.find("pid " + std::to_string(getpid()) + " on host " + host_name()) != std::string::npos);
      CHECK(m.find(", started 20") != std::string::npos);
      CHECK(m.find("(run 'tiny', deck deck.toml)") != std::string::npos);
      CHECK(m.find("--set run.dir=") != std::string::npos);
    }
    CHECK(read_text(t.path / "run/run.lock") == text);  // the refused run touched nothing
  }
  CHECK_FALSE(fs::exists(t.path / "run/run.lock"));
  RunDirLock again(t.path / "run", "tiny", "deck.toml");
  CHECK(again.takeover_note().empty());
}

TEST_CASE("run.lock: a stale lock from a dead process on this host is taken over with a message") {
  TempDir t("stale");
  const pid_t child = fork();
  if (child == 0) _exit(0);
  waitpid(child, nullptr, 0);  // a pid that no longer runs
  write_text(t.path / "run.lock", "host=" + host_name() + "\npid=" + std::to_string(child) +
                                      "\nstarted=2026-01-01 00:00:00 UTC\nrun_name=old\ndeck=old.toml\n");
  RunDirLock lock(t.path, "new", "new.toml");
  CHECK(lock.takeover_note().find("took over") != std::string::npos);
  CHECK(lock.takeover_note().find("pid " + std::to_string(child)) != std::string::npos);
  CHECK(lock.takeover_note().find("that process is no longer running") != std::string::npos);
  CHECK(parse_lock_holder(read_text(t.path / "run.lock")).pid == getpid());
}

TEST_CASE("run.lock: a holder that is a zombie, or a live pid that holds no flock, is stale on this host") {
  TempDir t("zombie");
  const pid_t child = fork();
  if (child == 0) _exit(0);
  // Not reaped yet: the pid still exists (kill(pid, 0) succeeds) but the process has
  // exited, as a rank killed with -9 stays when no init process reaps it.
  for (int i = 0; i < 500; ++i) {
    std::ifstream stat("/proc/" + std::to_string(child) + "/stat");
    std::string line;
    std::getline(stat, line);
    if (line.find(") Z ") != std::string::npos) break;
    usleep(10000);
  }
  write_text(t.path / "run.lock", "host=" + host_name() + "\npid=" + std::to_string(child) + "\nstarted=x\n");
  {
    RunDirLock lock(t.path, "new", "new.toml");
    CHECK(lock.takeover_note().find("a zombie") != std::string::npos);
  }
  waitpid(child, nullptr, 0);
  // A live process (this one) named in a file whose flock nobody holds: not a live run's lock.
  write_text(t.path / "run.lock", "host=" + host_name() + "\npid=" + std::to_string(getpid()) + "\nstarted=x\n");
  RunDirLock lock(t.path, "new", "new.toml");
  CHECK(lock.takeover_note().find("no process holds its flock any more") != std::string::npos);
}

TEST_CASE("run.lock: another host's lock is refused while touched, taken over only when stale") {
  TempDir t("remote");
  const fs::path file = t.path / "run.lock";
  const std::string remote = "host=node-elsewhere-1\npid=4242\nstarted=2026-01-01 00:00:00 UTC\nrun_name=r\ndeck=d\n";
  write_text(file, remote);
  try {
    RunDirLock lock(t.path, "x", "y");
    FAIL("a freshly touched lock of another host was taken");
  } catch (const RunDirInUse& e) {
    CHECK(std::string(e.what()).find("pid 4242 on host node-elsewhere-1") != std::string::npos);
    CHECK(std::string(e.what()).find("touched ") != std::string::npos);
    CHECK(std::string(e.what()).find("untouched for 120 s is taken over") != std::string::npos);
  }
  // Untouched for 10 minutes: its holder is gone.
  struct timespec old[2] = {{std::time(nullptr) - 600, 0}, {std::time(nullptr) - 600, 0}};
  REQUIRE(utimensat(AT_FDCWD, file.c_str(), old, 0) == 0);
  {
    RunDirLock lock(t.path, "x", "y");
    CHECK(lock.takeover_note().find("has not touched it for 6") != std::string::npos);
  }
}

// The same Slurm job and step ids prove nothing (two steps of one
// allocation, or a requeue racing its old node): only a stale heartbeat does.
TEST_CASE("run.lock: a fresh lock with this Slurm job step's ids from another host is refused; a stale one is taken") {
  TempDir t("slurm");
  const fs::path file = t.path / "run.lock";
  const std::string remote = "host=node-elsewhere-2\npid=5151\nstarted=2026-01-01 00:00:00 UTC\nrun_name=r\n"
                             "deck=d\nslurm_job_step=777.0\ntoken=node-elsewhere-2:5151:99:00000000000000aa\n";
  write_text(file, remote);
  setenv("SLURM_JOB_ID", "777", 1);
  setenv("SLURM_STEP_ID", "0", 1);
  setenv("SHARDLM_RUN_LOCK_WAIT_S", "2", 1);  // instead of 135 s: still touched 2 s later, so live
  try {
    RunDirLock lock(t.path, "x", "y");
    FAIL("a freshly touched lock of another host was taken because its Slurm ids match");
  } catch (const RunDirInUse& e) {
    const std::string m = e.what();
    CHECK(m.find("is held by pid 5151 on host node-elsewhere-2") != std::string::npos);
    CHECK(m.find("Slurm job step 777.0") != std::string::npos);
    CHECK(m.find("untouched for 120 s is taken over") != std::string::npos);
  }
  CHECK(read_text(file) == remote);  // the refused run touched nothing
  unsetenv("SHARDLM_RUN_LOCK_WAIT_S");
  // Its heartbeat 118 s old: a requeued job on a new node waits the 2 s until it is stale, then takes it.
  struct timespec old[2] = {{std::time(nullptr) - 118, 0}, {std::time(nullptr) - 118, 0}};
  REQUIRE(utimensat(AT_FDCWD, file.c_str(), old, 0) == 0);
  {
    RunDirLock lock(t.path, "x", "y");
    CHECK(lock.takeover_note().find("pid 5151 on host node-elsewhere-2") != std::string::npos);
    CHECK(lock.takeover_note().find("has not touched it for 12") != std::string::npos);
    const LockHolder mine = parse_lock_holder(read_text(file));
    CHECK(mine.slurm_job == "777.0");
    CHECK(mine.token == lock.token());
  }
  CHECK_FALSE(fs::exists(file));
  unsetenv("SLURM_JOB_ID");
  unsetenv("SLURM_STEP_ID");
}

TEST_CASE("run.lock: each holder writes its own token; a destructor leaves a lock that carries another token") {
  TempDir t("token");
  const fs::path file = t.path / "run.lock";
  std::string first_token;
  {
    RunDirLock lock(t.path, "a", "a.toml");
    first_token = lock.token();
    const LockHolder h = parse_lock_holder(read_text(file));
    CHECK(h.token == lock.token());
    CHECK(h.token.rfind(host_name() + ":" + std::to_string(getpid()) + ":", 0) == 0);
  }
  RunDirLock second(t.path, "a", "a.toml");
  CHECK(second.token() != first_token);  // same host, pid and start: the random part differs
  // Another holder rewrites the file in place (as a run on another host taking it over does).
  const std::string other = "host=node-elsewhere-3\npid=6161\nstarted=2026-01-01 00:00:00 UTC\n"
                            "token=node-elsewhere-3:6161:1:00000000000000bb\n";
  {
    RunDirLock lock(t.path / "sub", "b", "b.toml");
    write_text(t.path / "sub/run.lock", other);
  }
  CHECK(read_text(t.path / "sub/run.lock") == other);
  // Replaced by a new file (another inode) likewise.
  {
    RunDirLock lock(t.path / "sub2", "b", "b.toml");
    fs::remove(t.path / "sub2/run.lock");
    write_text(t.path / "sub2/run.lock", other);
  }
  CHECK(read_text(t.path / "sub2/run.lock") == other);
}

TEST_CASE("run.lock: the heartbeat notices a lock rewritten by another holder, says who, and never touches it again") {
  TempDir t("heartbeat");
  const fs::path file = t.path / "run.lock";
  setenv("SHARDLM_RUN_LOCK_HEARTBEAT_MS", "50", 1);
  std::atomic<int> calls{0};
  std::string seen;
  std::mutex seen_mutex;
  {
    RunDirLock lock(t.path, "a", "a.toml");
    lock.on_lost([&](const std::string& holder) {
      std::lock_guard<std::mutex> guard(seen_mutex);
      seen = holder;
      ++calls;
    });
    usleep(200000);  // a few beats while the lock is ours
    CHECK(calls.load() == 0);
    CHECK(lock.lost_to().empty());
    const std::string other = "host=node-elsewhere-4\npid=7171\nstarted=2026-01-01 00:00:00 UTC\nrun_name=thief\n"
                              "deck=t.toml\ntoken=node-elsewhere-4:7171:1:00000000000000cc\n";
    write_text(file, other);
    struct timespec old[2] = {{1000000000, 0}, {1000000000, 0}};
    REQUIRE(utimensat(AT_FDCWD, file.c_str(), old, 0) == 0);
    for (int i = 0; i < 100 && calls.load() == 0; ++i) usleep(20000);
    REQUIRE(calls.load() == 1);
    {
      std::lock_guard<std::mutex> guard(seen_mutex);
      CHECK(seen.find("pid 7171 on host node-elsewhere-4") != std::string::npos);
      CHECK(seen.find("(run 'thief', deck t.toml)") != std::string::npos);
    }
    CHECK(lock.lost_to() == seen);
    usleep(200000);
    CHECK(calls.load() == 1);
    struct stat st {};
    REQUIRE(stat(file.c_str(), &st) == 0);
    CHECK(st.st_mtime == 1000000000);  // no heartbeat touched the other holder's file
  }
  CHECK(parse_lock_holder(read_text(file)).pid == 7171);  // and the destructor left it
  // A lock removed under a live run is written again by the next beat.
  {
    RunDirLock lock(t.path / "again", "a", "a.toml");
    fs::remove(t.path / "again/run.lock");
    for (int i = 0; i < 100 && !fs::exists(t.path / "again/run.lock"); ++i) usleep(20000);
    CHECK(parse_lock_holder(read_text(t.path / "again/run.lock")).token == lock.token());
    CHECK(lock.lost_to().empty());
  }
  CHECK_FALSE(fs::exists(t.path / "again/run.lock"));
  unsetenv("SHARDLM_RUN_LOCK_HEARTBEAT_MS");
}

TEST_CASE("deck_changes: changed, added and removed keys in the new deck's order") {
  const std::string before = "[run]\nmax_steps = 50\nname = \"a\"\n\n[optim]\nlr = 0.003\nold_key = 1\n";
  const std::string after = "[run]\nmax_steps = 100\nname = \"a\"\n\n[optim]\nlr = 0.001\n\n[log]\ntensorboard = true\n";
  const auto changes = deck_changes(before, after);
  REQUIRE(changes.size() == 4);
  CHECK(changes[0].key == "run.max_steps");
  CHECK(changes[0].before == "50");
  CHECK(changes[0].after == "100");
  CHECK(changes[1].key == "optim.lr");
  CHECK(changes[1].before == "0.003");
  CHECK(changes[1].after == "0.001");
  CHECK(changes[2].key == "log.tensorboard");
  CHECK(changes[2].before.empty());
  CHECK(changes[3].key == "optim.old_key");
  CHECK(changes[3].after.empty());
  CHECK(deck_changes(before, before).empty());
  CHECK_THROWS_WITH_AS(deck_changes("[run\n", after, "step_5.h5"), doctest::Contains("step_5.h5 does not parse"), Error);
}

TEST_CASE("keep_start_deck: one file per start, an earlier deck at the same step is never overwritten") {
  TempDir t("decks");
  CHECK(keep_start_deck(t.path, 0, "a = 1\n") == "config-step0.toml");
  CHECK(keep_start_deck(t.path, 0, "a = 1\n") == "config-step0.toml");  // the same start again
  CHECK(keep_start_deck(t.path, 0, "a = 2\n") == "config-step0-2.toml");
  CHECK(keep_start_deck(t.path, 30, "a = 3\n") == "config-step30.toml");
  CHECK(read_text(t.path / "config-step0.toml") == "a = 1\n");
  CHECK(read_text(t.path / "config-step0-2.toml") == "a = 2\n");
  CHECK_THROWS_WITH_AS(write_file_atomically("/dev/full-is-not-a-dir", "x.toml", "t"),
                       doctest::Contains("cannot write /dev/full-is-not-a-dir/x.toml"), Error);
}

TEST_CASE("sched.min_lr_ratio: the floor follows each peak; min_lr stays absolute") {
  SchedSection cosine;
  cosine.name = "cosine";
  cosine.warmup = 5;
  cosine.min_lr_ratio = 0.1;
  CHECK(lr_at(cosine, 3e-3, 50, 49) == doctest::Approx(3e-4).epsilon(1e-12));
  CHECK(lr_at(cosine, 1e-2, 50, 49) == doctest::Approx(1e-3).epsilon(1e-12));
  CHECK(lr_at(cosine, 1e-2, 50, 5) == doctest::Approx(1e-2).epsilon(1e-12));  // the peak after warmup
  CHECK(lr_at(cosine, 1e-2, 50, 27) > 1e-3);
  SchedSection linear = cosine;
  linear.name = "linear";
  linear.decay = 10;
  CHECK(lr_at(linear, 2e-3, 50, 49) == doctest::Approx(2e-4).epsilon(1e-12));
  CHECK(lr_at(linear, 2e-3, 50, 44) == doctest::Approx(2e-3 + (2e-4 - 2e-3) * 0.5).epsilon(1e-12));
  SchedSection absolute = cosine;
  absolute.min_lr_ratio = 0;
  absolute.min_lr = 3e-4;
  CHECK(lr_at(absolute, 1e-2, 50, 49) == doctest::Approx(3e-4).epsilon(1e-12));
}

TEST_CASE("metrics.jsonl: start row, NaN as null with a flag, a resume drops the abandoned rows and marks itself") {
  TempDir t("metrics");
  Config c;
  c.run.name = "tiny-x";
  c.run.dir = t.path.string();
  c.run.max_steps = 8;
  c.log.interval = 1;
  RunStart fresh;
  fresh.deck_file = "config-step0.toml";
  fresh.world_size = 2;
  fresh.host = "h";
  fresh.backend = "cpu";
  {
    Metrics m(c, true, fresh);
    for (int64_t s = 0; s < 6; ++s) {
      StepStats st = stats(s, 5.0 - 0.5 * double(s));
      if (s == 3) st.loss = std::numeric_limits<double>::quiet_NaN(), st.grad_norm = INFINITY, st.skipped = true;
      m.log(st);
    }
    m.end("stopped", 75, 6);
  }
  auto rows = rows_of(t.path / "metrics.jsonl");  // throws if any line is not JSON
  CHECK(rows.size() == 1 + 6 + 1);
  std::ofstream(t.path / "metrics.jsonl", std::ios::app) << "{\"step\": 7, \"lo";  // a crash mid-line

  RunStart resumed = fresh;
  resumed.step = 4;
  resumed.tokens_seen = 400;
  resumed.checkpoint = (t.path / "checkpoints/step_4.h5").string();
  resumed.deck_file = "config-step4.toml";
  resumed.deck_changes = {{"optim.lr", "0.003", "0.001"}};
  {
    Metrics m(c, true, resumed);
    CHECK(m.dropped_rows() == 4);  // steps 5 and 6, the end row at 6, the torn line
    for (int64_t s = 4; s < 8; ++s) m.log(stats(s, 3.0 - 0.25 * double(s - 4)));
    m.end("done", 0, 8);
  }
  rows = rows_of(t.path / "metrics.jsonl");
  REQUIRE(rows.size() == 1 + 4 + 1 + 4 + 1);
  CHECK(rows[0]["event"] == "start");
  CHECK(rows[0]["run_name"] == "tiny-x");
  CHECK(rows[0]["world_size"] == 2);
  CHECK(rows[0]["deck"] == "config-step0.toml");
  std::vector<int64_t> steps;
  for (const auto& r : rows)
    if (!r.contains("event")) steps.push_back(r["step"].get<int64_t>());
  CHECK(steps == std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8});
  // step 4 (the NaN step): null plus the flag
  CHECK(rows[4]["step"] == 4);
  CHECK(rows[4]["loss"].is_null());
  CHECK(rows[4]["grad_norm"].is_null());
  CHECK(rows[4]["nonfinite"] == nlohmann::json::array({"loss", "grad_norm"}));
  CHECK(rows[4]["skipped"] == true);
  CHECK_FALSE(rows[3].contains("nonfinite"));
  const auto& resume = rows[5];
  CHECK(resume["event"] == "resume");
  CHECK(resume["step"] == 4);
  CHECK(resume["dropped_rows"] == 4);
  CHECK(resume["checkpoint"] == resumed.checkpoint);
  CHECK(resume["deck_changes"]["optim.lr"] == nlohmann::json::array({"0.003", "0.001"}));
  // tokens are cumulative over the run: the checkpoint's 400, then 100 a step
  CHECK(rows[6]["tokens"] == 500);
  CHECK(rows[9]["tokens"] == 800);
  CHECK(rows[9]["loss_tokens"] == 90);
  CHECK(rows[9]["loss"].get<double>() == doctest::Approx(2.25));
  CHECK(rows[9]["mfu"].is_null());  // no peak to compare with on the CPU
  CHECK(rows[9]["time"].get<double>() > 1.7e9);
  CHECK(rows[9]["elapsed_s"].get<double>() >= 0);
  CHECK(rows[10]["event"] == "end");
  CHECK(rows[10]["status"] == "done");
  CHECK(rows[10]["step"] == 8);
}

TEST_CASE("metrics.jsonl: a write that fails is an error naming the file") {
  Config c;
  c.run.dir = "/dev";
  c.log.jsonl = "full";  // every write to /dev/full fails with ENOSPC
  CHECK_THROWS_WITH_AS(Metrics(c, true, RunStart{}), "cannot write /dev/full: No space left on device", Error);
}

TEST_CASE("TensorBoard: CRC32C, and an event file read back: version, session start, every scalar") {
  CHECK(crc32c("123456789", 9) == 0xE3069283u);  // the CRC-32C check value
  CHECK(crc32c("", 0) == 0u);
  const uint32_t c = crc32c("abc", 3);
  CHECK(masked_crc32c("abc", 3) == ((c >> 15 | c << 17) + 0xa282ead8u));

  // Bytes spelled out from event.proto / summary.proto (Event: 1 wall_time, 2 step,
  // 3 file_version, 5 summary, 7 session_log; SessionLog: 1 status, START = 1;
  // Summary: 1 value; Value: 1 tag, 2 simple_value), independent of the writer.
  using namespace std::string_literals;
  CHECK(encode_session_start_event(0.0, 3) == "\x09\0\0\0\0\0\0\0\0\x10\x03\x3a\x02\x08\x01"s);
  CHECK(encode_scalars_event(1.0, 300, {{"a", 1.0f}}) ==
        "\x09\0\0\0\0\0\0\xf0\x3f\x10\xac\x02\x2a\x0a\x0a\x08\x0a\x01" "a" "\x15\0\0\x80\x3f"s);
  CHECK(encode_file_version_event(0.0) == "\x09\0\0\0\0\0\0\0\0\x10\x00\x1a\x0d" "brain.Event:2"s);
  CHECK(tfrecord("ab").size() == 8 + 4 + 2 + 4);

  TempDir t("tb");
  Config cfg;
  cfg.run.dir = t.path.string();
  cfg.run.max_steps = 6;
  cfg.log.interval = 2;
  cfg.log.tensorboard = true;
  RunStart start;
  start.step = 2;
  start.checkpoint = "step_2.h5";
  {
    Metrics m(cfg, true, start);
    for (int64_t s = 2; s < 6; ++s) {
      StepStats st = stats(s, 4.0 - double(s) / 8);
      if (s == 3) st.loss = std::numeric_limits<double>::quiet_NaN();
      m.log(st);
    }
  }
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(t.path / "tensorboard")) files.push_back(e.path());
  REQUIRE(files.size() == 1);
  CHECK(files[0].filename().string().rfind("events.out.tfevents.", 0) == 0);
  const auto events = read_events(files[0]);
  REQUIRE(events.size() == 2 + 2);  // version, START, steps 4 and 6
  CHECK(events[0].file_version == "brain.Event:2");
  CHECK(events[1].session_status == 1);
  CHECK(events[1].step == 3);  // the first step this start logs: TensorBoard keeps the earlier steps 1..2
  CHECK(events[2].step == 4);
  CHECK(events[3].step == 6);
  CHECK(events[3].wall_time > 1.7e9);
  std::map<std::string, float> at4(events[2].scalars.begin(), events[2].scalars.end());
  std::map<std::string, float> at6(events[3].scalars.begin(), events[3].scalars.end());
  CHECK(std::isnan(at4.at("train/loss")));  // NaN goes to TensorBoard as it is
  CHECK(at6.at("train/loss") == float(4.0 - 5.0 / 8));
  CHECK(at6.at("train/lr") == 1e-3f);
  CHECK(at6.at("train/grad_norm") == 0.5f);
  CHECK(at6.at("train/tokens") == 400.0f);
  CHECK(at6.count("perf/tokens_per_s") == 1);
  CHECK(at6.count("perf/mem_peak_gib") == 1);
  CHECK(at6.count("perf/mfu") == 0);
  // the same numbers as metrics.jsonl's step 6 row
  const auto rows = rows_of(t.path / "metrics.jsonl");
  CHECK(rows.back()["step"] == 6);
  CHECK(float(rows.back()["loss"].get<double>()) == at6.at("train/loss"));
  CHECK(float(rows.back()["tokens_per_s"].get<double>()) == doctest::Approx(at6.at("perf/tokens_per_s")).epsilon(1e-5));
}

TEST_CASE("RL: the rollout file's metrics join metrics.jsonl (rollout_*) and TensorBoard (rollout/*) at the step") {
  TempDir t("rollout-metrics");
  Config cfg;
  cfg.run.dir = t.path.string();
  cfg.run.max_steps = 2;
  cfg.log.tensorboard = true;
  {
    Metrics m(cfg, true, RunStart{});
    for (int64_t s = 0; s < 2; ++s) {
      StepStats st = stats(s, 1.0);
      st.rl = true;
      st.rollout_metrics = {{"reward_exact", 0.25 + double(s)}, {"reward_mean", 0.375 + double(s)},
                            {"sampling_tokens_per_s", 812.5}};
      if (s == 1) st.rollout_metrics.push_back({"reward_std", std::numeric_limits<double>::quiet_NaN()});
      m.log(st);
    }
  }
  const auto rows = rows_of(t.path / "metrics.jsonl");
  REQUIRE(rows.size() == 3);  // start, steps 1 and 2
  CHECK(rows[1]["rollout_reward_mean"].get<double>() == 0.375);
  CHECK(rows[1]["rollout_reward_exact"].get<double>() == 0.25);
  CHECK(rows[2]["rollout_reward_mean"].get<double>() == 1.375);
  CHECK(rows[2]["rollout_sampling_tokens_per_s"].get<double>() == 812.5);
  CHECK(rows[2]["rollout_reward_std"].is_null());  // JSON has no NaN: null, and named in "nonfinite"
  CHECK(rows[2]["nonfinite"].dump() == "[\"rollout_reward_std\"]");
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(t.path / "tensorboard")) files.push_back(e.path());
  REQUIRE(files.size() == 1);
  const auto events = read_events(files[0]);
  REQUIRE(events.size() == 2 + 2);  // version, START, steps 1 and 2
  std::map<std::string, float> at2(events[3].scalars.begin(), events[3].scalars.end());
  CHECK(events[3].step == 2);
  CHECK(at2.at("rollout/reward_mean") == 1.375f);
  CHECK(at2.at("rollout/reward_exact") == 1.25f);
  CHECK(at2.at("rollout/sampling_tokens_per_s") == 812.5f);
}

TEST_CASE("copy_tokenizer_files: the source's tokenizer, generation and chat-template files, or why none") {
  TempDir t("tok");
  fs::create_directories(t.path / "src");
  fs::create_directories(t.path / "dst");
  write_text(t.path / "src/tokenizer.json", "{\"model\": {}}");
  write_text(t.path / "src/generation_config.json", "{\"eos_token_id\": 2}");
  write_text(t.path / "src/chat_template.jinja", "{{ messages }}");
  write_text(t.path / "src/model.safetensors", "weights are not copied");
  const std::string note = copy_tokenizer_files(t.path / "src", t.path / "dst");
  CHECK(note == "tokenizer files from " + (t.path / "src").string() +
                    ": tokenizer.json, generation_config.json, chat_template.jinja");
  CHECK(read_text(t.path / "dst/tokenizer.json") == "{\"model\": {}}");
  CHECK(read_text(t.path / "dst/chat_template.jinja") == "{{ messages }}");
  CHECK_FALSE(fs::exists(t.path / "dst/model.safetensors"));
  CHECK_FALSE(fs::exists(t.path / "dst/tokenizer.json.tmp"));
  fs::create_directories(t.path / "bare");
  CHECK(copy_tokenizer_files(t.path / "bare", t.path / "dst").find("has none") != std::string::npos);
  CHECK(copy_tokenizer_files("", t.path / "dst").find("model.hf is not set") != std::string::npos);
  CHECK(copy_tokenizer_files(t.path / "gone", t.path / "dst").find("is not there") != std::string::npos);
}

}  // TEST_SUITE
