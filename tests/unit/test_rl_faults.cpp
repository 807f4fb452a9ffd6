// test_rl_faults.cpp — the RL sampling path under faults, each case with the
// behaviour it reproduces:
//   the reward program: a stop signal sent to the inference rank's process
//     group while it runs, a program that dies of such a signal, one that closes
//     stdout and keeps running, one that floods stdout or prints an endless
//     line, one that leaves a background child holding stdout, one that hangs
//     with a child of its own;
//   the files an inference rank reads: tokenizer.json ids (negative, huge) and
//     merges (not pairs, not in the vocabulary), and a prompt file whose
//     'answer' dataset declares more than the file holds.
// Readers and programs that could take the machine's memory run in a forked
// child with its address space limited (the fix must hold there; the bug shows
// as "bad_alloc" or "crashed"). The job end to end: tests/scripts/test_rl_faults.sh.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/signals.hpp"
#include "data/prompts.hpp"
#include "data/token_encoder.hpp"
#include "data/tokenizer.hpp"
#include "infer/reward.hpp"
#include "shardlm/config.hpp"
#include "shardlm/error.hpp"
#include "shardlm/h5util.hpp"

namespace fs = std::filesystem;
using namespace shardlm;

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct TempDir {
  fs::path path;
  TempDir() {
    static int counter = 0;
    path = fs::temp_directory_path() / fmt("shardlm-rl-faults-%d-%d", int(getpid()), counter++);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}
void write_text(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

int count_lines(const std::string& path) {
  const std::string text = read_text(path);
  return int(std::count(text.begin(), text.end(), '\n'));
}

bool wait_until(double limit_s, const std::function<bool()>& done) {
  const auto t0 = Clock::now();
  while (seconds_since(t0) < limit_s) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return done();
}

// A process that has ended: no /proc entry, or a zombie nobody reaped yet.
bool process_ended(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');
  return close != std::string::npos && close + 2 < text.size() && text[close + 2] == 'Z';
}

// `run` in a forked child whose address space may grow by 512 MiB at most:
// "accepted: <what run returned>", "refused: <the Error>", "bad_alloc", or
// "crashed (signal N)" when the child died.
std::string in_bounded_child(const TempDir& dir, const std::function<std::string()>& run) {
  const std::string out = dir / "child.txt";
  fs::remove(out);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    for (int sig : {SIGSEGV, SIGBUS, SIGABRT, SIGFPE}) signal(sig, SIG_DFL);  // not the test runner's crash report
    long vm_kb = 0;
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);)
      if (line.rfind("VmSize:", 0) == 0) vm_kb = std::atol(line.c_str() + 7);
    const rlim_t limit = rlim_t(vm_kb) * 1024 + (rlim_t(512) << 20);
    const rlimit lim{limit, limit};
    setrlimit(RLIMIT_AS, &lim);
    std::string said;
    try {
      said = "accepted: " + run();
    } catch (const std::bad_alloc&) {
      said = "bad_alloc";
    } catch (const std::exception& e) {
      said = std::string("refused: ") + e.what();
    }
    write_text(out, said);
    _exit(0);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFSIGNALED(status)) return fmt("crashed (signal %d)", WTERMSIG(status));
  return read_text(out);
}

RewardItem item(const std::string& text, const std::string& answer) {
  RewardItem r;
  r.text = text;
  r.answer = answer;
  return r;
}
const std::vector<RewardItem> kTwo = {item("1", "1"), item("2", "1")};

std::unique_ptr<Reward> program(const std::string& command, double timeout_s) {
  RolloutSection r;
  r.reward = {"program"};
  r.reward_program = command;
  r.reward_timeout_s = timeout_s;
  return make_reward("program", r);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

std::string joined(const std::vector<double>& v) {
  std::string s;
  for (double x : v) s += (s.empty() ? "" : ",") + fmt("%g", x);
  return s;
}

}  // namespace

TEST_SUITE("rl_faults") {

// ---- the reward program and stop signals

// An inference rank got SIGUSR1 from mpirun (Open MPI forwards it to each rank's
// process group; Slurm's --signal does the like) while its reward program ran:
// the program died of the signal, the step failed with "was killed by signal
// 10", and the job ended with exit 1 instead of saving a checkpoint and exiting
// 75. Here a forked "inference rank" leads its own process group, holds the stop
// handlers, and is signalled as mpirun signals it.
TEST_CASE("reward program: a stop signal to the rank's process group is the job's; the program answers") {
  TempDir dir;
  const std::string started = dir / "started", go = dir / "go", runs = dir / "runs", result = dir / "result";
  const std::string command = "echo run >> " + runs + "; cat > /dev/null; touch " + started +
                              "; i=0; while [ ! -e " + go + " ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; "
                              "echo 1; echo 0";
  const pid_t rank = fork();
  REQUIRE(rank >= 0);
  if (rank == 0) {
    setpgid(0, 0);
    install_stop_signal_handlers();
    std::string said;
    try {
      const std::vector<double> rewards = program(command, 120)->score(kTwo, 4);
      said = "rewards " + joined(rewards) + fmt(", stop signal %d", stop_signal());
    } catch (const std::exception& e) {
      said = std::string("error: ") + e.what();
    }
    write_text(result, said);
    _exit(0);
  }
  setpgid(rank, rank);  // either of us may get here first
  const bool running = wait_until(60, [&] { return fs::exists(started); });
  CHECK(running);
  CHECK(kill(-rank, SIGUSR1) == 0);  // as mpirun forwards it: to the rank's process group
  // Let the signal land before the program may go on: on a build that shares
  // the rank's group with the program, the program is dead by then.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  write_text(go, "");
  int status = 0;
  while (waitpid(rank, &status, 0) < 0 && errno == EINTR) {
  }
  CHECK(WIFEXITED(status));
  const std::string said = read_text(result);
  CAPTURE(said);
  CHECK(said == "rewards 1,0, stop signal 10");  // scored; the stop is the checkpointer's to act on
  CHECK(count_lines(runs) == 1);                 // the program never saw the signal: it ran once
}

// Under Slurm a stop signal reaches every process of the job step, whatever its
// process group: a program killed by SIGUSR1, SIGTERM or SIGINT was stopped
// with the job, not judged; it runs once more, and twice is an error.
TEST_CASE("reward program: one killed by a stop signal runs once more; killed twice it is an error") {
  TempDir dir;
  const std::string runs = dir / "runs";
  const std::string once = "cat > /dev/null; echo run >> " + runs + "; if [ $(wc -l < " + runs +
                           ") -eq 1 ]; then kill -TERM $$; sleep 5; fi; echo 1; echo 0";
  std::vector<double> rewards;
  const std::string error = error_of([&] { rewards = program(once, 60)->score(kTwo, 2); });
  CHECK(error == "(no error)");
  CHECK(joined(rewards) == "1,0");
  CHECK(count_lines(runs) == 2);
  const std::string always = "cat > /dev/null; kill -USR1 $$; sleep 5";
  const std::string twice = error_of([&] { program(always, 60)->score(kTwo, 3); });
  CHECK(twice.find("reward program '" + always + "' (rollout.reward_program, rollout step 3) was killed by "
                   "signal 10") != std::string::npos);
  CHECK(twice.find("twice") != std::string::npos);
}

// ---- the reward program's time and output

// A reward program that closes stdout and keeps running was waited for without
// a limit (the timeout covered only reads): `cat >/dev/null; exec >&-; sleep 60`
// held the step for the whole minute.
TEST_CASE("reward program: one that closes stdout and keeps running is killed at rollout.reward_timeout_s") {
  const auto t0 = Clock::now();
  const std::string error = error_of([] { program("cat > /dev/null; exec >&-; sleep 60", 2)->score(kTwo, 6); });
  const double took_s = seconds_since(t0);
  CHECK(took_s < 40);
  CHECK(error.find("reward program 'cat > /dev/null; exec >&-; sleep 60' (rollout.reward_program, rollout step 6) "
                   "gave no complete answer within rollout.reward_timeout_s = 2 s") != std::string::npos);
}

// A timed-out program was killed, its children were not: `sleep 60 &` outlived
// the step holding the program's stdout.
TEST_CASE("reward program: on timeout its whole process group is killed") {
  TempDir dir;
  const std::string pid_file = dir / "child_pid";
  const std::string error =
      error_of([&] { program("cat > /dev/null; sleep 60 & echo $! > " + pid_file + "; sleep 60", 2)->score(kTwo, 7); });
  CHECK(error.find("gave no complete answer within rollout.reward_timeout_s = 2 s") != std::string::npos);
  const pid_t child = pid_t(std::atol(read_text(pid_file).c_str()));
  REQUIRE(child > 0);
  const bool ended = wait_until(10, [&] { return process_ended(child); });
  if (!ended) kill(child, SIGKILL);
  CHECK(ended);
}

// A program that answered and exited, leaving a background child with its
// stdout, was read until that child closed it: a good answer became "no
// complete answer" at the timeout. The answer is the program's lines when it
// exits; what it left running is killed.
TEST_CASE("reward program: a background child holding stdout does not spoil a complete answer") {
  TempDir dir;
  const std::string pid_file = dir / "child_pid";
  const auto t0 = Clock::now();
  std::vector<double> rewards;
  const std::string error = error_of([&] {
    rewards = program("cat > /dev/null; sleep 60 & echo $! > " + pid_file + "; echo 1; echo 0", 60)->score(kTwo, 8);
  });
  CHECK(seconds_since(t0) < 40);
  CHECK(error == "(no error)");
  CHECK(joined(rewards) == "1,0");
  const pid_t child = pid_t(std::atol(read_text(pid_file).c_str()));
  REQUIRE(child > 0);
  const bool ended = wait_until(10, [&] { return process_ended(child); });
  if (!ended) kill(child, SIGKILL);
  CHECK(ended);
}

// `yes` as a reward program was buffered without a cap (1.2 GB in 1.5 s), and
// a 100 MB line became a 100 MB error message. Now the answer is read line by
// line: a line that is no number, a line past the per-answer cap, or a line
// more than the completions, ends the exchange at once, quoting a short prefix.
TEST_CASE("reward program: output is bounded per answer and in lines; errors quote a short prefix") {
  TempDir dir;
  const auto bounded = [&](const std::string& command, Clock::time_point* t0) {
    *t0 = Clock::now();
    return in_bounded_child(dir, [&] { return joined(program(command, 60)->score(kTwo, 9)); });
  };
  Clock::time_point t0;
  const std::string yes = bounded("cat > /dev/null; yes", &t0);
  CAPTURE(yes);
  CHECK(seconds_since(t0) < 40);
  CHECK(yes.find("refused: reward program 'cat > /dev/null; yes' (rollout.reward_program, rollout step 9): line 1 of "
                 "its output is 'y', not a finite number") == 0);
  const std::string flood = bounded("cat > /dev/null; yes 1", &t0);
  CAPTURE(flood);
  CHECK(seconds_since(t0) < 40);
  CHECK(flood.find("answered more than 2 rewards for 2 completions") != std::string::npos);
  const std::string line = bounded("cat > /dev/null; head -c 50000000 /dev/zero | tr '\\0' 7; echo", &t0);
  CAPTURE(line.substr(0, 400));
  CHECK(seconds_since(t0) < 40);
  CHECK(line.find("line 1 of its output is longer than 4096 bytes") != std::string::npos);
  CHECK(line.find("(it starts '" + std::string(64, '7') + "...')") != std::string::npos);
  CHECK(line.size() < 600);  // the whole message, the program's command included
}

// ---- tokenizer.json: ids and merges

namespace {
// A byte-level BPE tokenizer.json: vocab a b c ab, merges "a b", added tokens as given.
std::string tokenizer_json(const std::string& vocab_extra, const std::string& merges, const std::string& added) {
  return R"({"added_tokens": [)" + added + R"(],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3)" + vocab_extra + R"(},
              "merges": )" + merges + "}}";
}
const std::string kGoodMerges = R"(["a b"])";

// Both readers of one tokenizer.json, as `shardlm generate --prompt` uses them:
// the encoder takes the prompt text, the decoder turns the ids back into text.
std::string load_and_encode(const TempDir& dir, const std::string& json) {
  const std::string file = dir / "tokenizer.json";
  write_text(file, json);
  return in_bounded_child(dir, [&] {
    const TokenDecoder decoder = TokenDecoder::load(file);
    const TokenEncoder encoder = TokenEncoder::load(file);
    std::string ids;
    for (int32_t id : encoder.encode("abc")) ids += (ids.empty() ? "" : ",") + std::to_string(id);
    return ids + " -> " + decoder.text(encoder.encode("abc"));
  });
}
}  // namespace

// A tokenizer.json whose added token has a negative id crashed `shardlm
// generate --prompt` (SIGSEGV: the decoder wrote before its table).
TEST_CASE("tokenizer.json: an added token with a negative id is refused, naming the file and the entry") {
  TempDir dir;
  const std::string file = dir / "tokenizer.json";
  CHECK(load_and_encode(dir, tokenizer_json("", kGoodMerges, "")) == "accepted: 3,2 -> abc");
  const std::string said = load_and_encode(dir, tokenizer_json("", kGoodMerges, R"({"id": -5, "content": "<x>"})"));
  CHECK(said == "refused: " + file + ": added_tokens[0] '<x>' has id -5; an id must be in [0, 4194304)");
  // The encoder alone (it is loaded on its own by `shardlm tokenize`).
  const std::string encoder = in_bounded_child(dir, [&] {
    TokenEncoder::from_json_text(tokenizer_json("", kGoodMerges, R"({"id": -5, "content": "<x>"})"), "t.json");
    return std::string();
  });
  CHECK(encoder == "refused: t.json: added_tokens[0] '<x>' has id -5; an id must be in [0, 4194304)");
  // An empty added token would match everywhere (the encoder looped, growing its ids without end).
  const std::string empty = load_and_encode(dir, tokenizer_json("", kGoodMerges, R"({"id": 4, "content": ""})"));
  CHECK(empty == "refused: " + file + ": added_tokens[0] has an empty 'content'");
}

// A vocabulary id of 2e9 made the decoder allocate a table of 2e9 entries: a bare
// std::bad_alloc with no file named. Past int32 the encoder cut the id silently.
TEST_CASE("tokenizer.json: a vocabulary id past the sane limit is refused before anything is allocated") {
  TempDir dir;
  const std::string file = dir / "tokenizer.json";
  const std::string huge = load_and_encode(dir, tokenizer_json(R"(, "d": 2000000000)", kGoodMerges, ""));
  CHECK(huge == "refused: " + file + ": model.vocab['d'] has id 2000000000; an id must be in [0, 4194304)");
  const std::string wide = in_bounded_child(dir, [&] {
    TokenEncoder::from_json_text(tokenizer_json(R"(, "d": 5000000000)", kGoodMerges, ""), "t.json");
    return std::string();
  });
  CHECK(wide == "refused: t.json: model.vocab['d'] has id 5000000000; an id must be in [0, 4194304)");
  const std::string added =
      load_and_encode(dir, tokenizer_json("", kGoodMerges, R"({"id": 2000000000, "content": "<x>"})"));
  CHECK(added == "refused: " + file + ": added_tokens[0] '<x>' has id 2000000000; an id must be in [0, 4194304)");
}

// Malformed merges were accepted (not an array: ignored; pieces that are not in
// the vocabulary: never matched), and every prompt was silently tokenized byte
// by byte. The rules are the `tokenizers` package's: each merge is two
// vocabulary pieces, as "left right" or [left, right], whose concatenation is
// in the vocabulary too.
TEST_CASE("tokenizer.json: malformed merges are refused, naming the entry") {
  TempDir dir;
  const std::string file = dir / "tokenizer.json";
  const auto said = [&](const std::string& merges) { return load_and_encode(dir, tokenizer_json("", merges, "")); };
  CHECK(said(R"([["a", "b"]])") == "accepted: 3,2 -> abc");
  CHECK(said(R"({"a b": 0})") == "refused: " + file + ": model.merges must be an array of pairs, found an object");
  const std::string not_two = " is not two pieces separated by one space";
  CHECK(said(R"(["a  b"])") == "refused: " + file + ": model.merges[0] 'a  b'" + not_two);
  CHECK(said(R"(["a b c"])") == "refused: " + file + ": model.merges[0] 'a b c'" + not_two);
  CHECK(said(R"(["a b", "x b"])") == "refused: " + file + ": model.merges[1] 'x b': 'x' is not in model.vocab");
  CHECK(said(R"(["b c"])") == "refused: " + file + ": model.merges[0] 'b c': 'bc' is not in model.vocab");
  CHECK(said(R"([["a", "b", "c"]])") == "refused: " + file + ": model.merges[0] is not a pair of strings");
}

// ---- prompt files: the 'answer' dataset

namespace {
// A prompt file of two prompts, its 'answer' strings of `answer_bytes` each
// (fixed length; or variable, as h5py writes them), written when `write` is
// set, else left as a declaration.
void write_prompts_with_answers(const std::string& path, size_t answer_bytes, bool write, bool variable = false,
                                const std::string& first_answer = "42") {
  using h5::Handle;
  Handle f(H5_CHECK(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT)), H5Fclose);
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5};
  const std::vector<int64_t> offsets = {0, 2, 5};
  auto put = [&](const char* name, hid_t type, hid_t mem, const void* data, hsize_t n) {
    Handle space(H5_CHECK(H5Screate_simple(1, &n, nullptr)), H5Sclose);
    Handle d(H5_CHECK(H5Dcreate2(f, name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)), H5Dclose);
    H5_CHECK(H5Dwrite(d, mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, data));
  };
  put("tokens", H5T_STD_I32LE, H5T_NATIVE_INT32, tokens.data(), tokens.size());
  put("offsets", H5T_STD_I64LE, H5T_NATIVE_INT64, offsets.data(), offsets.size());
  {
    Handle t(H5_CHECK(H5Tcopy(H5T_C_S1)), H5Tclose);
    H5_CHECK(H5Tset_size(t, H5T_VARIABLE));
    Handle scalar(H5_CHECK(H5Screate(H5S_SCALAR)), H5Sclose);
    Handle a(H5_CHECK(H5Acreate2(f, "format", t, scalar, H5P_DEFAULT, H5P_DEFAULT)), H5Aclose);
    const char* format = "shardlm-prompts-1";
    H5_CHECK(H5Awrite(a, t, &format));
  }
  Handle t(H5_CHECK(H5Tcopy(H5T_C_S1)), H5Tclose);
  H5_CHECK(H5Tset_size(t, variable ? H5T_VARIABLE : answer_bytes));
  const hsize_t n = 2;
  Handle space(H5_CHECK(H5Screate_simple(1, &n, nullptr)), H5Sclose);
  Handle d(H5_CHECK(H5Dcreate2(f, "answer", t, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)), H5Dclose);
  if (!write) return;
  if (variable) {
    const char* texts[2] = {first_answer.c_str(), "seven"};
    H5_CHECK(H5Dwrite(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, texts));
  } else {
    std::string both(2 * answer_bytes, '\0');
    both.replace(0, 2, "42");
    both.replace(answer_bytes, 5, "seven");
    H5_CHECK(H5Dwrite(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, both.data()));
  }
}

std::string answers_of(const TempDir& dir, const std::string& path) {
  return in_bounded_child(dir, [&] {
    const PromptSet p = read_prompts(path, 258);
    std::string s;
    for (const std::string& a : p.answers) s += (s.empty() ? "" : ",") + a;
    return s;
  });
}
}  // namespace

// A 6.6 KB prompt file declaring 'answer' as fixed-length strings of 100 MB
// each (the dataset never written) took 2.8 GB; larger ones threw a bare
// std::bad_alloc naming no file. The declared size is checked against the
// file's bytes (and a sane limit per answer) before anything is allocated.
TEST_CASE("prompt file: an 'answer' dataset declaring more than the file holds is refused before allocating") {
  TempDir dir;
  const std::string forged = dir / "forged.h5";
  write_prompts_with_answers(forged, size_t(1) << 31, /*write=*/false);  // 2 answers of 2 GiB, in a few KB
  CHECK(fs::file_size(forged) < 20000);
  const std::string said = answers_of(dir, forged);
  CAPTURE(said);
  CHECK(said.find("refused: prompt file '" + forged + "': dataset 'answer' declares 2 strings of 2147483648 bytes") ==
        0);
  // Within the per-answer limit, 2 x 1 MiB declared in a file of a few KB.
  const std::string unwritten = dir / "unwritten.h5";
  write_prompts_with_answers(unwritten, size_t(1) << 20, /*write=*/false);
  CHECK(answers_of(dir, unwritten).find("refused: prompt file '" + unwritten + "': dataset 'answer' declares 2 "
                                        "elements (2.097e+06 bytes) but the file has") == 0);
  // The same file with the answers written reads (fixed length and variable length, as h5py writes them).
  const std::string fixed = dir / "fixed.h5", variable = dir / "variable.h5";
  write_prompts_with_answers(fixed, 8, /*write=*/true);
  write_prompts_with_answers(variable, 0, /*write=*/true, /*variable=*/true);
  CHECK(answers_of(dir, fixed) == "accepted: 42,seven");
  CHECK(answers_of(dir, variable) == "accepted: 42,seven");
  // Sizes the file holds, written, but past what an answer can be: variable and fixed length.
  const std::string long_variable = dir / "long_variable.h5";
  write_prompts_with_answers(long_variable, 0, /*write=*/true, /*variable=*/true, std::string(size_t(2) << 20, 'x'));
  CHECK(answers_of(dir, long_variable) == "refused: prompt file '" + long_variable + "': answer 0 has 2097152 bytes; "
                                          "an answer holds at most 1048576 bytes");
  const std::string long_answers = dir / "long.h5";
  write_prompts_with_answers(long_answers, size_t(2) << 20, /*write=*/true);
  CHECK(answers_of(dir, long_answers).find("refused: prompt file '" + long_answers + "': dataset 'answer' declares 2 "
                                           "strings of 2097152 bytes; an answer holds at most 1048576") == 0);
}

}  // TEST_SUITE
