// test_context_split.cpp — the load-balanced split of a micro-batch over a
// context-parallel group (train/context_split.hpp).
#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

#include "shardlm/error.hpp"
#include "train/context_split.hpp"

using namespace shardlm;

TEST_CASE("context split: rank c keeps chunks c and 2C-1-c of every row; the ranks cover each token once") {
  CHECK(context_share_indices(1, 8, 0, 2) == std::vector<int32_t>{0, 1, 6, 7});
  CHECK(context_share_indices(1, 8, 1, 2) == std::vector<int32_t>{2, 3, 4, 5});
  CHECK(context_share_indices(2, 8, 3, 4) == std::vector<int32_t>{3, 4, 11, 12});
  std::vector<int32_t> all;
  for (int c = 0; c < 4; ++c) {
    const auto mine = context_share_indices(3, 16, c, 4);
    CHECK(mine.size() == 12);
    CHECK(std::is_sorted(mine.begin(), mine.end()));
    // Causal work is balanced: the sum of (index within row + 1) keys seen is the same on every rank.
    int64_t keys = 0;
    for (int32_t i : mine) keys += i % 16 + 1;
    CHECK(keys == 3 * 2 * (16 + 1));  // per row: an early and a late chunk, their tokens pairing to 17
    all.insert(all.end(), mine.begin(), mine.end());
  }
  std::sort(all.begin(), all.end());
  for (int32_t i = 0; i < 48; ++i) CHECK(all[size_t(i)] == i);
  CHECK_THROWS_WITH(context_share_indices(1, 10, 0, 2),
                    "data.seq_len = 10 does not split into 2 x model.context_parallel = 4 equal chunks");
}

TEST_CASE("context share: a rank's tokens keep their targets, weights, RoPE positions and document ids") {
  MicroBatch mb;
  mb.rows = 1, mb.seq_len = 8;
  mb.tokens = {10, 11, 12, 13, 14, 15, 16, 17};
  mb.targets = {11, 12, 13, -1, 15, 16, 17, -1};
  mb.weights = {1, 1, 1, 0, 1, 1, 1, 0};
  mb.positions = {0, 1, 2, 3, 0, 1, 2, 3};  // two documents of 4
  mb.seq_ids = {0, 0, 0, 0, 1, 1, 1, 1};
  ContextShare share(1, 2);
  const TokenBatch b = share.take(mb);
  REQUIRE(b.N == 4);
  CHECK(std::vector<int32_t>(b.tokens, b.tokens + 4) == std::vector<int32_t>{12, 13, 14, 15});
  CHECK(std::vector<int32_t>(b.targets, b.targets + 4) == std::vector<int32_t>{13, -1, 15, 16});
  CHECK(std::vector<float>(b.weights, b.weights + 4) == std::vector<float>{1, 0, 1, 1});
  CHECK(std::vector<int32_t>(b.positions, b.positions + 4) == std::vector<int32_t>{2, 3, 0, 1});
  CHECK(std::vector<int32_t>(b.seq_ids, b.seq_ids + 4) == std::vector<int32_t>{0, 0, 1, 1});
  CHECK(std::vector<int32_t>(b.token_index, b.token_index + 4) == std::vector<int32_t>{2, 3, 4, 5});
}
