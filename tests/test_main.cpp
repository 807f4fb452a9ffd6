// test_main.cpp — the doctest main for every shardlm suite, MPI-aware.
//
// Debian's doctest has no MPI extension, so this main does what one would:
// every rank runs the same test cases; a listener records which cases failed on
// this rank; the failure flags are reduced (MAX) over ranks, so a case counts as
// failed if it failed anywhere; rank 0 prints "<suite>: N passed, N failed" and
// appends the counts to the file named by SHARDLM_TEST_RESULTS that tests/run.sh sums. Ranks other
// than 0 print only their failed assertions, prefixed with the rank.
//
// Built twice: without SHARDLM_TEST_MPI (unit suites, MPI never initialised, so
// they can spawn mpirun themselves) and with it (MPI suites under mpirun).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#ifdef SHARDLM_TEST_MPI
#include <mpi.h>
#endif

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

int g_rank = 0;
std::vector<int> g_case_failed;  // one flag per test case run, in order
std::vector<std::string> g_case_names;

// Counts test cases; runs on every rank alongside the visible reporter.
struct CaseCounter : doctest::IReporter {
  explicit CaseCounter(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData& tc) override {
    g_case_failed.push_back(0);
    g_case_names.push_back(tc.m_name);
  }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats& st) override {
    if (!st.testCaseSuccess) g_case_failed.back() = 1;
  }
  void test_case_exception(const doctest::TestCaseException&) override { g_case_failed.back() = 1; }
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_LISTENER("case_counter", 1, CaseCounter);

// What ranks other than 0 print: their failures only, each naming the rank.
struct RankFailures : doctest::IReporter {
  const char* current = "";
  explicit RankFailures(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData& tc) override { current = tc.m_name; }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException& e) override {
    std::fprintf(stderr, "[rank %d] test case '%s' threw: %s\n", g_rank, current, e.error_string.c_str());
  }
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData& ad) override {
    if (!ad.m_failed) return;
    std::fprintf(stderr, "[rank %d] %s:%d: in '%s': %s( %s ) failed, values: %s%s%s\n", g_rank, ad.m_file, ad.m_line,
                 current, doctest::assertString(ad.m_at), ad.m_expr, ad.m_decomp.c_str(),
                 ad.m_threw ? " threw: " : "", ad.m_threw ? ad.m_exception.c_str() : "");
  }
  void log_message(const doctest::MessageData& m) override {
    if (m.m_severity & doctest::assertType::is_warn) return;
    std::fprintf(stderr, "[rank %d] %s:%d: in '%s': %s\n", g_rank, m.m_file, m.m_line, current, m.m_string.c_str());
  }
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_REPORTER("rank_failures", 1, RankFailures);

}  // namespace

int main(int argc, char** argv) {
  // Line by line into a pipe or file too: a suite that dies still shows what it printed last.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  // Set by tests/run.sh (and forwarded by mpirun -x): where the counts go.
  const char* results_path = std::getenv("SHARDLM_TEST_RESULTS");
  const char* suite = std::getenv("SHARDLM_TEST_SUITE") ? std::getenv("SHARDLM_TEST_SUITE") : "tests";
  int nargs = argc;
  char** pargs = argv;

  int world = 1;
#ifdef SHARDLM_TEST_MPI
  int provided = 0;
  MPI_Init_thread(&nargs, &pargs, MPI_THREAD_FUNNELED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
#endif

  doctest::Context context;
  context.applyCommandLine(nargs, pargs);
  if (g_rank != 0) context.setOption("reporters", "rank_failures");
  context.setOption("no-version", true);
  const int rc = context.run();
  if (context.shouldExit()) return rc;

  int ncases = static_cast<int>(g_case_failed.size());
  std::vector<int> failed = g_case_failed;
#ifdef SHARDLM_TEST_MPI
  int min_cases = 0, max_cases = 0;
  MPI_Allreduce(&ncases, &min_cases, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&ncases, &max_cases, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (min_cases != max_cases) {
    // Ranks ran different cases: count everything as failed rather than guess.
    if (g_rank == 0) std::fprintf(stderr, "ranks ran different numbers of test cases (%d..%d)\n", min_cases, max_cases);
    failed.assign(max_cases, 1);
    ncases = max_cases;
  } else {
    MPI_Allreduce(MPI_IN_PLACE, failed.data(), ncases, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  }
#endif
  int nfailed = 0;
  for (int f : failed) nfailed += f;
  const int npassed = ncases - nfailed;
  if (g_rank == 0) {
    for (int i = 0; i < ncases && i < static_cast<int>(g_case_names.size()); ++i)
      if (failed[i] && !g_case_failed[i])
        std::fprintf(stderr, "test case '%s' failed on another rank\n", g_case_names[i].c_str());
    std::printf("%s (%d rank%s): %d passed, %d failed\n", suite, world, world == 1 ? "" : "s", npassed, nfailed);
    std::fflush(stdout);
    if (results_path) {
      if (FILE* f = std::fopen(results_path, "a")) {
        std::fprintf(f, "%d %d %s\n", npassed, nfailed, suite);
        std::fclose(f);
      }
    }
  }
#ifdef SHARDLM_TEST_MPI
  MPI_Finalize();
#endif
  return nfailed ? 1 : 0;
}
