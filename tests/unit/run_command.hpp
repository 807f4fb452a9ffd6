// run_command.hpp — run a shell command from a test, with a time limit, and
// capture its exit status and combined output.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace shardlm_test {

struct CommandResult {
  int status = -1;      // exit status; 124 when the time limit killed it
  std::string output;   // stdout and stderr together
};

// The time limit only guards against a hang: a loaded CI box runs a 1 s
// command 10x slower, so no test may pass or fail by how long a command took.
constexpr int kHangGuardSeconds = 600;

inline CommandResult run(const std::string& command, int timeout_s = kHangGuardSeconds) {
  std::string quoted;  // the command inside sh -c '...'
  for (char c : command) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  const std::string wrapped =
      "timeout --kill-after=5 " + std::to_string(timeout_s) + " sh -c '" + quoted + "' 2>&1";
  CommandResult r;
  std::FILE* pipe = popen(wrapped.c_str(), "r");
  if (!pipe) return r;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) r.output.append(buffer, n);
  const int raw = pclose(pipe);
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  return r;
}

inline std::string build_dir() {
  const char* b = std::getenv("BUILD");
  return b && *b ? b : "build";
}
inline std::string shardlm_bin() { return build_dir() + "/shardlm"; }

// "mpirun -np N ... " with the flags a test host needs (root, 2 cores).
inline std::string mpirun(int np) {
  const char* m = std::getenv("MPIRUN");
  return std::string(m && *m ? m : "mpirun") + " --oversubscribe --bind-to none -np " + std::to_string(np) + " ";
}

// This machine's host name, as the runs' messages print it.
inline std::string host_name() {
  char name[256] = {0};
  gethostname(name, sizeof name - 1);
  return name;
}

}  // namespace shardlm_test
