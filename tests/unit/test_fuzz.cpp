// test_fuzz.cpp — generated bad input, counted: every case must end in a
// result or a clear shardlm::Error, never a crash, a hang or another exception.
//
// Deterministic (one seed per kind): decks (values from a pool of hostile
// numbers and types on every key, byte flips, truncations) and safetensors
// headers (hostile shapes, dtypes and offsets, byte flips of a valid file) run
// in this process; data files and checkpoints (byte flips of a valid file,
// truncations) run through the shardlm binary, as a user would meet them, so
// that a crash or hang inside HDF5 is counted instead of ending the suite.
// Headers that declare a huge size (a rollout file's 'tokens', a token file's
// 'offsets': 2^28 elements in a file of KBs) must be refused with a message
// in a child that may not grow by more than 512 MiB.
// Each kind prints "fuzz <kind>: N cases: X accepted, Y refused with a
// message, 0 crashes, 0 hangs".
#include <doctest/doctest.h>

#include <hdf5.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "data/prompts.hpp"
#include "data/rollouts.hpp"
#include "data/token_file.hpp"
#include "model/safetensors.hpp"
#include "run_command.hpp"
#include "shardlm/config.hpp"
#include "shardlm/error.hpp"
#include "train/engine.hpp"
#include "train/train.hpp"

using namespace shardlm;
namespace fs = std::filesystem;

namespace {

struct Counts {
  int cases = 0, accepted = 0, refused = 0, crashes = 0, hangs = 0, unclear = 0;
  std::vector<std::string> examples;  // the first few crashes, hangs and unclear errors
  void note(const std::string& what) {
    if (examples.size() < 5) examples.push_back(what);
  }
  void report(const char* kind) const {
    MESSAGE("fuzz " << std::string(kind) << ": " << cases << " cases: " << accepted << " accepted, " << refused
                    << " refused with a message, " << crashes << " crashes, " << hangs << " hangs, " << unclear
                    << " unclear errors");
    for (const auto& e : examples) MESSAGE("  " << e);
    CHECK(crashes == 0);
    CHECK(hangs == 0);
    CHECK(unclear == 0);
    CHECK(accepted + refused == cases);
  }
};

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}
void write_file(const fs::path& p, const std::string& bytes) { std::ofstream(p, std::ios::binary) << bytes; }

// Up to `flips` random bytes changed, sometimes the file cut short.
std::string damaged(std::string bytes, std::mt19937_64& rng, int flips) {
  if (bytes.empty()) return bytes;
  const int n = 1 + int(rng() % uint64_t(flips));
  for (int i = 0; i < n; ++i) bytes[rng() % bytes.size()] = static_cast<char>(rng() & 0xff);
  if (rng() % 6 == 0) bytes.resize(rng() % bytes.size());
  return bytes;
}

// Runs one case in this process: a shardlm::Error with text is a refusal;
// anything else thrown is an unclear error.
template <class F>
void in_process(Counts& c, const std::string& label, F&& f) {
  ++c.cases;
  try {
    f();
    ++c.accepted;
  } catch (const Error& e) {
    if (std::string(e.what()).empty()) ++c.unclear, c.note(label + ": empty message");
    else ++c.refused;
  } catch (const std::exception& e) {
    ++c.unclear;
    c.note(label + ": " + e.what());
  }
}

// Runs one case as a command: exit 0 accepted, another status with a message refused,
// a signal a crash, the hang guard's 124 a hang.
void as_command(Counts& c, const std::string& label, const std::string& command) {
  ++c.cases;
  const auto r = shardlm_test::run(command, 120);
  if (r.status == 0) ++c.accepted;
  else if (r.status == 124) ++c.hangs, c.note(label + ": hung");
  else if (r.status >= 128) ++c.crashes, c.note(label + ": signal " + std::to_string(r.status - 128));
  else if (r.output.empty()) ++c.unclear, c.note(label + ": exit status " + std::to_string(r.status) + ", no message");
  else ++c.refused;
}

std::string temp_dir(const char* what) {
  const fs::path d = fs::temp_directory_path() / (std::string("shardlm-fuzz-") + what + "-" + std::to_string(getpid()));
  fs::create_directories(d);
  return d.string();
}

}  // namespace

TEST_SUITE("fuzz") {

TEST_CASE("fuzz decks: hostile values on every key, byte flips and truncations") {
  const std::string deck = read_file("inputs/tiny-sft.toml");
  REQUIRE(!deck.empty());
  const std::vector<std::string> keys = known_keys();
  const std::vector<std::string> values = {
      "0", "-1", "1", "2", "3", "7", "66", "4611686018427387904", "9223372036854775807", "-9223372036854775808",
      "1000000000", "2147483648", "16777217", "inf", "-inf", "nan", "1e308", "-1e308", "1e-320", "0.5", "1.0",
      "true", "false", "\"\"", "\"x\"", "\"/dev/zero\"", "\"cuda\"", "\"muon\"", "\"sgd\"", "\"rl\"", "[1, 2]",
      "{a = 1}", "\"inputs\""};
  std::mt19937_64 rng(1717);
  Counts c;
  for (int i = 0; i < 1500; ++i) {
    std::vector<std::string> sets;
    std::string text = deck;
    if (i % 4 == 3) {
      text = damaged(text, rng, 8);
    } else {
      for (int k = 0, n = 1 + int(rng() % 4); k < n; ++k)
        sets.push_back(keys[rng() % keys.size()] + "=" + values[rng() % values.size()]);
    }
    const int world = 1 + int(rng() % 8);
    std::string label = "deck case " + std::to_string(i);
    for (const auto& s : sets) label += " --set " + s;
    in_process(c, label, [&] {
      const DeckResult r = parse_deck_text(text, "fuzz.toml", sets, world);
      for (const auto& e : r.errors)
        if (e.empty()) throw std::runtime_error("an empty deck error");
      if (!r.ok()) SHARDLM_FAIL("%s", r.errors[0].c_str());
      // A valid deck must lay out and plan without overflow or a giant allocation.
      if (!r.config.model.hf.empty()) return;
      const ModelLayout layout(model_config_for(r.config), world);
      plan_memory(layout.config, world, engine_options_for(r.config), 2, *make_cpu_backend());
      const DeckResult back = parse_deck_text(resolved_deck(r.config), "config.toml", {}, world);
      if (!back.ok()) throw std::runtime_error("the resolved deck does not parse back: " + back.errors[0]);
    });
  }
  c.report("decks");
}

TEST_CASE("fuzz safetensors headers: hostile shapes, dtypes and offsets; byte flips of a valid file") {
  const fs::path dir = temp_dir("safetensors");
  const fs::path file = fs::path(dir) / "model.safetensors";
  std::vector<float> w(24);
  for (size_t i = 0; i < w.size(); ++i) w[i] = float(i);
  write_safetensors(file, {{"a", {4, 3}, "F32", w.data()}, {"b", {12}, "BF16", w.data()}, {"c", {6}, "F32", w.data()}});
  const std::string valid = read_file(file);
  const std::vector<std::string> dims = {"0", "1", "3", "-1", "4611686018427387904", "18446744073709551615", "1.5",
                                         "\"3\"", "null"};
  const std::vector<std::string> dtypes = {"\"F32\"", "\"BF16\"", "\"F16\"", "\"I64\"", "\"Q4\"", "7", "null"};
  std::mt19937_64 rng(1718);
  Counts c;
  auto pick = [&](const std::vector<std::string>& v) { return v[rng() % v.size()]; };
  for (int i = 0; i < 400; ++i) {
    if (i % 2 == 0) {
      write_file(file, damaged(valid, rng, 6));
    } else {  // a header of 1-3 tensors with hostile fields over 64 data bytes
      std::string header = "{";
      for (int t = 0, n = 1 + int(rng() % 3); t < n; ++t) {
        const int64_t begin = int64_t(rng() % 80) - 8, end = begin + int64_t(rng() % 72);
        header += (t ? "," : "") + std::string("\"t") + std::to_string(t) + "\":{\"dtype\":" + pick(dtypes) +
                  ",\"shape\":[" + pick(dims) + (rng() % 2 ? "," + pick(dims) : "") + "],\"data_offsets\":[" +
                  std::to_string(begin) + "," + (rng() % 8 ? std::to_string(end) : pick(dims)) + "]}";
      }
      header += "}";
      std::string bytes(8, '\0');
      for (int b = 0; b < 8; ++b) bytes[size_t(b)] = char((header.size() >> (8 * b)) & 0xff);
      write_file(file, bytes + header + std::string(64, '\x3f'));
    }
    in_process(c, "safetensors case " + std::to_string(i), [&] {
      SafetensorsReader reader(dir);
      std::vector<float> out;
      for (const auto& name : reader.names()) {
        const TensorInfo& info = reader.info(name);
        out.resize(size_t(std::min<int64_t>(info.numel, 1 << 20)));
        reader.read_f32(name, 0, int64_t(out.size()), out.data());
      }
    });
  }
  fs::remove_all(dir);
  c.report("safetensors");
}

// ---- headers that declare a huge size

// A file of 1-D contiguous datasets of `n` elements each (name, HDF5 type),
// then every 8-byte little-endian `n` in it rewritten to `declared`: the
// dataspaces now declare `declared` elements in a file of a few KB. `n` is
// chosen so that it occurs only in the dataspaces.
void write_forged(const fs::path& path, const std::vector<std::pair<const char*, hid_t>>& datasets, uint64_t n,
                  uint64_t declared, const std::vector<std::pair<const char*, std::vector<int64_t>>>& exact = {}) {
  const hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  const std::vector<char> zeros(n * 8, 0);
  for (const auto& [name, type] : datasets) {
    const hsize_t dims = n;
    const hid_t space = H5Screate_simple(1, &dims, nullptr);
    const hid_t d = H5Dcreate2(file, name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dwrite(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, zeros.data());
    H5Dclose(d), H5Sclose(space);
  }
  for (const auto& [name, values] : exact) {  // small datasets written as they are (not forged)
    const hsize_t dims = values.size();
    const hid_t space = H5Screate_simple(1, &dims, nullptr);
    const hid_t d = H5Dcreate2(file, name, H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dwrite(d, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data());
    H5Dclose(d), H5Sclose(space);
  }
  H5Fclose(file);
  std::string bytes = read_file(path);
  const std::string from(reinterpret_cast<const char*>(&n), 8), to(reinterpret_cast<const char*>(&declared), 8);
  int patched = 0;
  for (size_t at = bytes.find(from); at != std::string::npos; at = bytes.find(from, at + 8)) {
    bytes.replace(at, 8, to);
    ++patched;
  }
  REQUIRE(patched >= 2);  // dims and maxdims of at least one dataspace
  write_file(path, bytes);
}

// Runs `read` in a child whose address space may grow by 512 MiB only: a
// reader that allocates what the header declares fails with bad_alloc there.
// Returns what the child ended with: "refused: <message>", "bad_alloc",
// "accepted" or "crashed".
template <class F>
std::string read_bounded(const fs::path& dir, F read) {
  const fs::path out = dir / "child.txt";
  const pid_t pid = fork();
  if (pid == 0) {
    long vm_kb = 0;
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);)
      if (line.rfind("VmSize:", 0) == 0) vm_kb = std::atol(line.c_str() + 7);
    const rlim_t limit = static_cast<rlim_t>(vm_kb) * 1024 + (rlim_t(512) << 20);
    const rlimit lim{limit, limit};
    setrlimit(RLIMIT_AS, &lim);
    std::string said;
    try {
      read();
      said = "accepted";
    } catch (const std::bad_alloc&) {
      said = "bad_alloc";
    } catch (const std::exception& e) {
      said = std::string("refused: ") + e.what();
    }
    write_file(out, said);
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? read_file(out) : std::string("crashed");
}

TEST_CASE("fuzz headers: a rollout, token or prompt file declaring 2^28 elements is refused before allocating") {
  const fs::path dir = fs::temp_directory_path() / fmt("shardlm-fuzz-sizes-%d", static_cast<int>(getpid()));
  fs::create_directories(dir);
  constexpr uint64_t n = 4099, huge = uint64_t(1) << 28;
  // Rollouts: 'tokens' (int32) declares 2^28 elements, 1 GiB, in a file of ~40 KB.
  const fs::path rollout = dir / "step_0.h5";
  write_forged(rollout, {{"tokens", H5T_STD_I32LE}, {"loss_mask", H5T_STD_U8LE}, {"advantages", H5T_IEEE_F32LE},
                         {"inference_logprobs", H5T_IEEE_F32LE}},
               n, huge, {{"offsets", {0, int64_t(n)}}});
  std::string said = read_bounded(dir, [&] { read_rollouts(rollout.string(), 258); });
  CAPTURE(said);
  CHECK(said.find("refused: rollout file '" + rollout.string() + "': dataset 'tokens' declares 268435456 elements") == 0);
  CHECK(said.find("a damaged or forged header") != std::string::npos);
  // Token file: 'offsets' (int64) declares 2^28 elements, 2 GiB; 'tokens' is real.
  const fs::path tokens = dir / "tokens.h5";
  write_forged(tokens, {{"offsets", H5T_STD_I64LE}}, n, huge);
  {  // 'tokens' added after the forging, so its length is not rewritten
    const hid_t file = H5Fopen(tokens.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    const hsize_t dims = 16;
    const std::vector<int32_t> values(16, 1);
    const hid_t space = H5Screate_simple(1, &dims, nullptr);
    const hid_t d = H5Dcreate2(file, "tokens", H5T_STD_I32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dwrite(d, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data());
    H5Dclose(d), H5Sclose(space), H5Fclose(file);
  }
  said = read_bounded(dir, [&] {
    data::TokenFile f;
    data::open_token_file(f, tokens.string(), 258);
  });
  CAPTURE(said);
  CHECK(said.find("refused: data file '" + tokens.string() + "': dataset 'offsets' declares 268435456 elements") == 0);
  // Prompt file (shardlm generate, the RL inference ranks): 'tokens' declares 2^28 int32.
  const fs::path prompts = dir / "prompts.h5";
  write_forged(prompts, {{"tokens", H5T_STD_I32LE}}, n, huge, {{"offsets", {0, int64_t(n)}}});
  {  // the format attribute the reader checks first
    const hid_t file = H5Fopen(prompts.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    const hid_t type = H5Tcopy(H5T_C_S1);
    const std::string format = "shardlm-prompts-1";
    H5Tset_size(type, format.size());
    const hid_t scalar = H5Screate(H5S_SCALAR);
    const hid_t attr = H5Acreate2(file, "format", type, scalar, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(attr, type, format.data());
    H5Aclose(attr), H5Sclose(scalar), H5Tclose(type), H5Fclose(file);
  }
  said = read_bounded(dir, [&] { read_prompts(prompts.string(), 258); });
  CAPTURE(said);
  CHECK(said.find("refused: prompt file '" + prompts.string() + "': dataset 'tokens' declares 268435456 elements") == 0);
  fs::remove_all(dir);
}

TEST_CASE("fuzz data files and checkpoints through the binary: byte flips and truncations") {
  const std::string dir = temp_dir("files");
  const std::string bin = shardlm_test::shardlm_bin();
  const std::string quiet = " --set log.interval=100 --set sched.warmup=0";
  // A small valid checkpoint to damage: 2 steps of the tiny deck.
  const auto made = shardlm_test::run(bin + " train inputs/tiny-sft.toml --set run.max_steps=2" + quiet +
                                      " --set run.dir=" + dir + "/source");
  REQUIRE_MESSAGE(made.status == 0, made.output);
  const std::string checkpoint = read_file(dir + "/source/checkpoints/step_2.h5");
  const std::string data = read_file("inputs/data/tiny.h5");
  REQUIRE(!checkpoint.empty());
  REQUIRE(!data.empty());
  std::mt19937_64 rng(1719);

  Counts d;
  for (int i = 0; i < 16; ++i) {  // train reads and validates the whole file, then takes 0 steps
    const std::string path = dir + "/data_" + std::to_string(i) + ".h5";
    write_file(path, damaged(data, rng, 64));
    as_command(d, "data case " + std::to_string(i),
               bin + " train inputs/tiny-sft.toml --set run.max_steps=0 --set ckpt.save_final=false" + quiet +
                   " --set data.path=" + path + " --set run.dir=" + dir + "/data_run");
  }
  d.report("data files");

  Counts k;
  for (int i = 0; i < 24; ++i) {
    const std::string path = dir + "/ckpt_" + std::to_string(i) + ".h5";
    write_file(path, damaged(checkpoint, rng, 64));
    if (i % 6 == 5)  // resume from it as a given file: refused or loaded, never a crash
      as_command(k, "checkpoint resume case " + std::to_string(i),
                 bin + " train inputs/tiny-sft.toml --set run.max_steps=3 --set ckpt.save_final=false" + quiet +
                     " --set ckpt.resume=" + path + " --set run.dir=" + dir + "/resume_" + std::to_string(i));
    else
      as_command(k, "checkpoint inspect case " + std::to_string(i), bin + " inspect " + path);
  }
  k.report("checkpoints");
  fs::remove_all(dir);
}

}  // TEST_SUITE
