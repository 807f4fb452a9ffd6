// retention.cpp — step file names, retention, the order resume tries
// files in (checkpoint/retention.hpp).
#include "checkpoint/retention.hpp"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <fstream>

#include "shardlm/error.hpp"

namespace fs = std::filesystem;

namespace shardlm {

int64_t checkpoint_step_of(const std::string& name) {
  if (name.size() < 9 || name.rfind("step_", 0) != 0 || name.substr(name.size() - 3) != ".h5") return -1;
  const std::string digits = name.substr(5, name.size() - 8);
  if (digits.empty() || digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), ::isdigit)) return -1;
  return std::stoll(digits);
}

std::map<int64_t, fs::path> checkpoint_step_files(const fs::path& dir) {
  std::map<int64_t, fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const int64_t step = checkpoint_step_of(e.path().filename().string());
    if (step >= 0 && e.is_regular_file()) out[step] = e.path();
  }
  return out;
}

void apply_retention(const fs::path& dir, int64_t current, const CkptSection& ckpt) {
  std::vector<int64_t> present;
  const auto files = checkpoint_step_files(dir);
  for (const auto& [step, path] : files) present.push_back(step);
  for (int64_t step : checkpoints_to_delete(present, current, ckpt.keep_last, ckpt.keep_interval)) {
    std::error_code ec;
    fs::remove(files.at(step), ec);
    if (ec)
      std::fprintf(stderr, "shardlm: warning: retention could not remove %s: %s\n", files.at(step).c_str(),
                   ec.message().c_str());
  }
}

std::vector<int64_t> checkpoints_to_delete(const std::vector<int64_t>& present, int64_t current, int64_t keep_last,
                                           int64_t keep_interval) {
  std::vector<int64_t> older;
  for (int64_t s : present)
    if (s <= current) older.push_back(s);
  std::sort(older.rbegin(), older.rend());
  std::vector<int64_t> out;
  int64_t kept = 0;
  for (int64_t s : older) {
    const bool newest = kept < std::max<int64_t>(keep_last, 1) || s == current;
    if (newest) {
      ++kept;
      continue;
    }
    if (keep_interval > 0 && s % keep_interval == 0) continue;
    out.push_back(s);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<fs::path> resume_candidates(const fs::path& dir, std::string* note) {
  std::vector<fs::path> out;
  const auto files = checkpoint_step_files(dir);
  int64_t newest_allowed = INT64_MAX;
  std::ifstream in(dir / "latest");
  if (in) {
    std::string name;
    std::getline(in, name);
    while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
    const int64_t step = checkpoint_step_of(name);
    if (step >= 0 && files.count(step)) {
      out.push_back(files.at(step));
      newest_allowed = step - 1;
    } else if (note) {
      *note = fmt("%s names '%s', which is not a checkpoint file there; trying the newest step files",
                  (dir / "latest").c_str(), name.c_str());
    }
  } else if (note && !files.empty()) {
    *note = fmt("%s is missing; trying the newest step files", (dir / "latest").c_str());
  }
  for (auto it = files.rbegin(); it != files.rend(); ++it)
    if (it->first <= newest_allowed) out.push_back(it->second);
  return out;
}

fs::path checkpoint_dir(const Config& config) { return fs::path(config.run.dir) / "checkpoints"; }

fs::path checkpoint_path(const fs::path& dir, int64_t step) {
  return dir / ("step_" + std::to_string(step) + ".h5");
}

bool checkpoint_due(const CkptSection& ckpt, int64_t steps_done, int64_t max_steps) {
  if (steps_done <= 0) return false;
  if (steps_done == max_steps) return ckpt.save_final;
  return ckpt.interval > 0 && steps_done % ckpt.interval == 0;
}

}  // namespace shardlm
