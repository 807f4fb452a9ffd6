// data.cpp — the SFT reader: cutting the row stream into steps and
// micro-batches (which rows a rank takes), filling rows from the packed files,
// the counts a step's loss is normalised by, the saved position, and the next
// micro-batch read on a background thread. The token files are
// data/token_file.hpp's, each file's order and packing data/order.hpp's, the
// mix data/mixing.hpp's. Rules: docs/data.md.
//
// Threading: HDF5 is not thread-safe (the parallel build never is), so it is
// called only while opening a file, on the caller's thread; the prefetch thread
// reads with pread(2) (data/token_file.hpp). The caller's thread and the
// prefetch thread never work at once: every public call first waits until the
// thread is idle.
#include "data/data.hpp"

#include <climits>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

#include "data/mixing.hpp"
#include "data/order.hpp"
#include "data/token_file.hpp"
#include "shardlm/error.hpp"
#include "shardlm/memory.hpp"

namespace shardlm {

using data::FileMix;
using data::PackedFile;
using data::TokenFile;

namespace {

constexpr int64_t kPositionFormat = 2;
constexpr size_t kPositionFormat1Values = 7;

}  // namespace

// ------------------------------------------------------------------ position

// Format 2: [2, step, rows_consumed, seq_len, seed, documents, shuffle, files,
// then per file: documents, rows_consumed]. Format 1 (one file): the first 7.
std::vector<int64_t> DataPosition::to_vector() const {
  std::vector<int64_t> v{kPositionFormat, step, rows_consumed, seq_len, static_cast<int64_t>(seed),
                         documents, shuffle ? 1 : 0, static_cast<int64_t>(sources.size())};
  for (const SourcePosition& s : sources) v.push_back(s.documents), v.push_back(s.rows_consumed);
  return v;
}

DataPosition DataPosition::from_vector(std::span<const int64_t> values) {
  const bool format1 = values.size() == kPositionFormat1Values && values[0] == 1;
  const bool format2 = values.size() >= 8 && values[0] == kPositionFormat && values[7] >= 0 &&
                       values.size() == 8 + 2 * static_cast<size_t>(values[7]);
  SHARDLM_CHECK(format1 || format2,
                "data position: expected format 1 (7 values) or format 2 (8 + 2 per file), got %zu values%s",
                values.size(), values.empty() ? "" : fmt(" starting with %ld", static_cast<long>(values[0])).c_str());
  DataPosition pos;
  pos.step = values[1];
  pos.rows_consumed = values[2];
  pos.seq_len = values[3];
  pos.seed = static_cast<uint64_t>(values[4]);
  pos.documents = values[5];
  pos.shuffle = values[6] != 0;
  if (format1) {
    pos.sources = {{pos.documents, pos.rows_consumed}};
  } else {
    for (int64_t k = 0; k < values[7]; ++k) pos.sources.push_back({values[8 + 2 * k], values[9 + 2 * k]});
  }
  return pos;
}

// ------------------------------------------------------------------- the reader

struct TokenDataset::Impl {
  DataSpec spec;
  std::vector<std::unique_ptr<PackedFile>> sources;
  std::optional<FileMix> mix;          // set once the files are open
  int64_t anchor_step = 0;             // the restored position's step; its first row is mix->anchor_row()
  std::vector<int32_t> stage_tokens;   // (seq_len + 1) one piece's tokens
  std::vector<uint8_t> stage_mask;     // (seq_len + 1) and its loss_mask

  // Prefetch: at most one job, run by `worker`; the caller's thread touches the
  // state above only while no job runs.
  struct Key {
    int64_t step = -1;
    int accum = 0, rank = 0, world = 0;
    bool operator==(const Key&) const = default;
  };
  std::thread worker;
  std::mutex mutex;
  std::condition_variable wake, idle;
  bool stop = false, job_pending = false, job_running = false, job_ready = false, job_failed = false;
  Key job_key;
  bool job_counts = false;           // the job also counts job_key.step's rows of the rank
  StepCounts counts;                 // ... here
  MicroBatch spare;                  // the prefetched micro-batch
  int64_t tracked_bytes = 0;         // what memory.hpp's counters hold for this reader

  int64_t files() const { return static_cast<int64_t>(sources.size()); }

  int64_t first_row_of_step(int64_t step) const {
    SHARDLM_CHECK(step >= anchor_step, "data: step %ld comes before the restored position (step %ld)", step,
                  anchor_step);
    return mix->anchor_row() + (step - anchor_step) * spec.global_batch;
  }

  // Writes stream row `row` into out[slot]; seq_id continues from `next_seq_id`.
  void fill_row(int64_t row, int64_t slot, int32_t& next_seq_id, MicroBatch& out) {
    int64_t k = 0, file_row = 0;
    mix->locate(row, k, file_row);
    PackedFile& src = *sources[static_cast<size_t>(k)];
    TokenFile& file = src.file;
    const int64_t seq_len = spec.seq_len;
    const int64_t base = slot * seq_len;
    int64_t used = 0;
    src.walk_stream_row(file_row, [&](int64_t first, int64_t pairs) {
      // inputs tokens[first .. first+pairs), targets one further; loss at the target
      file.read_tokens(first, pairs + 1, stage_tokens.data());
      if (file.has_loss_mask) file.read_loss_mask(first + 1, pairs, stage_mask.data());
      for (int64_t j = 0; j < pairs; ++j) {
        const int64_t at = base + used + j;
        const float weight = file.has_loss_mask ? static_cast<float>(stage_mask[static_cast<size_t>(j)]) : 1.0f;
        out.tokens[at] = stage_tokens[static_cast<size_t>(j)];
        out.targets[at] = stage_tokens[static_cast<size_t>(j + 1)];
        out.weights[at] = weight;
        out.positions[at] = static_cast<int32_t>(j);
        out.seq_ids[at] = next_seq_id;
        out.loss_tokens += weight > 0.0f;
      }
      used += pairs;
      ++next_seq_id;
    });
    pad_row(base + used, base + seq_len, next_seq_id, out);
  }

  // Padding: one sequence of its own that nothing attends into.
  static void pad_row(int64_t from, int64_t to, int32_t& next_seq_id, MicroBatch& out) {
    if (from >= to) return;
    for (int64_t at = from; at < to; ++at) {
      out.tokens[at] = 0;
      out.targets[at] = -1;
      out.weights[at] = 0.0f;
      out.positions[at] = 0;
      out.seq_ids[at] = next_seq_id;
    }
    ++next_seq_id;
  }

  void size_micro_batch(MicroBatch& out) const {
    const int64_t numel = spec.micro_batch * spec.seq_len;
    out.rows = spec.micro_batch;
    out.seq_len = spec.seq_len;
    out.tokens.resize(numel);
    out.targets.resize(numel);
    out.weights.resize(numel);
    out.positions.resize(numel);
    out.seq_ids.resize(numel);
    out.loss_tokens = 0;
  }

  // `rows` stream rows from `first_row`, then empty rows up to micro_batch.
  void fill_rows(int64_t first_row, int64_t rows, MicroBatch& out) {
    size_micro_batch(out);
    int32_t next_seq_id = 0;
    for (int64_t i = 0; i < rows; ++i) fill_row(first_row + i, i, next_seq_id, out);
    for (int64_t i = rows; i < spec.micro_batch; ++i)
      pad_row(i * spec.seq_len, (i + 1) * spec.seq_len, next_seq_id, out);
  }

  void fill_micro_batch(const Key& key, MicroBatch& out) {
    const int64_t number = static_cast<int64_t>(key.accum) * key.world + key.rank;
    fill_rows(first_row_of_step(key.step) + number * spec.micro_batch, spec.micro_batch, out);
  }

  void count_row(int64_t row, StepCounts& c) {
    int64_t k = 0, file_row = 0;
    mix->locate(row, k, file_row);
    PackedFile& src = *sources[static_cast<size_t>(k)];
    src.walk_stream_row(file_row, [&](int64_t first, int64_t pairs) {
      c.tokens += pairs;
      if (!src.file.has_loss_mask) {
        c.loss_tokens += pairs;
        return;
      }
      src.file.read_loss_mask(first + 1, pairs, stage_mask.data());
      for (int64_t j = 0; j < pairs; ++j) c.loss_tokens += stage_mask[static_cast<size_t>(j)];
    });
  }

  StepCounts rank_counts(int64_t step, int rank, int world) {
    const int64_t per_rank = spec.global_batch / world;  // rows
    const int64_t accum_steps = per_rank / spec.micro_batch;
    StepCounts c;
    c.positions = per_rank * spec.seq_len;
    const int64_t first = first_row_of_step(step);
    for (int64_t a = 0; a < accum_steps; ++a) {
      const int64_t number = a * world + rank;
      for (int64_t i = 0; i < spec.micro_batch; ++i) count_row(first + number * spec.micro_batch + i, c);
    }
    return c;
  }

  DataMemory memory(bool bound) const {
    DataMemory m;
    for (const auto& s : sources) {
      m.index += s->file.index_bytes();
      m.order += bound ? s->order_bytes_bound() : s->order_bytes();
      m.buffers += s->file.tokens.buffer_bytes() + s->file.loss_mask.buffer_bytes();
    }
    // The caller's micro-batch and the prefetched one: 5 arrays of 4 bytes per position.
    const int64_t micro_batch_bytes = 20 * spec.micro_batch * spec.seq_len;
    m.buffers += (spec.prefetch ? 2 : 1) * micro_batch_bytes +
                 static_cast<int64_t>(stage_tokens.capacity() * 4 + stage_mask.capacity()) + mix->buffer_bytes();
    return m;
  }

  // memory.hpp's counters follow what the reader holds (caller's thread only).
  void retrack() {
    const int64_t now = memory(false).total();
    host_mem_track(Mem::Data, now - tracked_bytes);
    tracked_bytes = now;
  }

  void run_worker() {
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      wake.wait(lock, [&] { return stop || job_pending; });
      if (stop) return;
      job_pending = false;
      job_running = true;
      const Key key = job_key;
      const bool with_counts = job_counts;
      lock.unlock();
      bool failed = false;
      try {
        fill_micro_batch(key, spare);
        if (with_counts) counts = rank_counts(key.step, key.rank, key.world);
      } catch (...) {
        failed = true;  // the caller's thread reads it again itself and gets the error there
      }
      lock.lock();
      job_running = false;
      job_ready = true;
      job_failed = failed;
      idle.notify_all();
    }
  }
};

TokenDataset::TokenDataset(const DataSpec& spec) : spec_(spec), impl_(std::make_unique<Impl>()) {
  SHARDLM_CHECK(spec.seq_len >= 2,
                "data.seq_len = %ld: a row needs at least 2 positions (one input, one target)", spec.seq_len);
  SHARDLM_CHECK(spec.micro_batch >= 1, "data.micro_batch = %ld: must be at least 1", spec.micro_batch);
  SHARDLM_CHECK(spec.global_batch >= 1 && spec.global_batch % spec.micro_batch == 0,
                "data.global_batch = %ld must be a positive multiple of data.micro_batch = %ld",
                spec.global_batch, spec.micro_batch);
  // positions and seq_ids are int32 across one micro-batch.
  SHARDLM_CHECK(spec.micro_batch * spec.seq_len <= INT32_MAX,
                "data.micro_batch * data.seq_len = %ld positions exceeds 2^31-1", spec.micro_batch * spec.seq_len);
  SHARDLM_CHECK(spec.vocab_size >= 1, "data: vocab_size = %ld, the model's vocabulary size must be set",
                spec.vocab_size);
  SHARDLM_CHECK(!spec.paths.empty(), "data.path is empty: give a token file (see docs/data.md)");
  SHARDLM_CHECK(spec.paths.size() <= 4096, "data.path lists %zu files; at most 4096 can be mixed (the checkpoint's "
                "position holds two numbers per file): merge some with tools/make_dataset.py", spec.paths.size());
  SHARDLM_CHECK(spec.weights.empty() || spec.weights.size() == spec.paths.size(),
                "data.weights has %zu entries but data.path has %zu files; give one weight per file",
                spec.weights.size(), spec.paths.size());
  Impl& m = *impl_;
  m.spec = spec;
  for (size_t k = 0; k < spec.paths.size(); ++k) {
    auto src = std::make_unique<PackedFile>();
    data::open_token_file(src->file, spec.paths[k], spec.vocab_size);
    // File k shuffles with seed + k: the first (or only) file's order is the
    // seed's, as with a single data.path.
    src->seed = spec.seed + k;
    src->shuffle = spec.shuffle;
    src->seq_len = spec.seq_len;
    m.sources.push_back(std::move(src));
  }
  std::vector<int64_t> pairs;
  for (const auto& s : m.sources) pairs.push_back(s->file.pairs);
  m.mix.emplace(spec.weights, pairs, spec.seed);
  m.stage_tokens.resize(static_cast<size_t>(spec.seq_len + 1));
  m.stage_mask.resize(static_cast<size_t>(spec.seq_len + 1));
  m.spare.tokens.reserve(static_cast<size_t>(spec.micro_batch * spec.seq_len));
  for (const auto& s : m.sources) s->plan();
  m.retrack();
  if (spec.prefetch) m.worker = std::thread([this] { impl_->run_worker(); });
}

TokenDataset::~TokenDataset() {
  if (impl_->worker.joinable()) {
    {
      std::lock_guard<std::mutex> lock(impl_->mutex);
      impl_->stop = true;
    }
    impl_->wake.notify_all();
    impl_->worker.join();
  }
  host_mem_track(Mem::Data, -impl_->tracked_bytes);
}

void TokenDataset::wait_idle() {
  Impl& m = *impl_;
  if (m.worker.joinable()) {
    std::unique_lock<std::mutex> lock(m.mutex);
    m.idle.wait(lock, [&] { return !m.job_pending && !m.job_running; });
  }
  m.retrack();
}

void TokenDataset::schedule_after(int64_t step, int accum_index, int rank, int world) {
  Impl& m = *impl_;
  if (!m.worker.joinable()) return;
  Impl::Key next{step, accum_index + 1, rank, world};
  bool with_counts = false;
  if (next.accum >= micro_batches_per_rank(world)) next = {step + 1, 0, rank, world}, with_counts = true;
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    m.job_key = next;
    m.job_counts = with_counts;
    m.job_ready = false;
    m.job_pending = true;
  }
  m.wake.notify_one();
}

// ------------------------------------------------------------ steps, batches

int64_t TokenDataset::micro_batches_per_rank(int world) const {
  const int64_t per_step = spec_.micro_batch * world;
  SHARDLM_CHECK(world >= 1 && spec_.global_batch % per_step == 0,
                "data.global_batch = %ld rows cannot be split into micro-batches of %ld rows over %d "
                "ranks; make it a multiple of micro_batch * ranks = %ld",
                spec_.global_batch, spec_.micro_batch, world, per_step);
  return spec_.global_batch / per_step;
}

void TokenDataset::micro_batch(int64_t step, int accum_index, int rank, int world, MicroBatch& out) {
  const int64_t accum_steps = micro_batches_per_rank(world);
  SHARDLM_CHECK(rank >= 0 && rank < world && accum_index >= 0 && accum_index < accum_steps,
                "data: micro-batch for rank %d of %d, accumulation index %d of %ld is out of range", rank, world,
                accum_index, accum_steps);
  wait_idle();
  Impl& m = *impl_;
  const Impl::Key key{step, accum_index, rank, world};
  if (m.job_ready && !m.job_failed && m.job_key == key) {
    // the prefetched buffers become the caller's; the caller's become the next spare
    out.rows = m.spare.rows, out.seq_len = m.spare.seq_len, out.loss_tokens = m.spare.loss_tokens;
    out.tokens.swap(m.spare.tokens);
    out.targets.swap(m.spare.targets);
    out.weights.swap(m.spare.weights);
    out.positions.swap(m.spare.positions);
    out.seq_ids.swap(m.spare.seq_ids);
    m.job_ready = m.job_counts;  // the counts stay until asked for
    if (m.job_counts) m.job_key.accum = -1;  // the micro-batch part is taken
  } else {
    m.fill_micro_batch(key, out);
  }
  schedule_after(step, accum_index, rank, world);
}

MicroBatch TokenDataset::micro_batch(int64_t step, int accum_index, int rank, int world) {
  MicroBatch out;
  micro_batch(step, accum_index, rank, world, out);
  return out;
}

StepCounts TokenDataset::rank_step_counts(int64_t step, int rank, int world) {
  (void)micro_batches_per_rank(world);
  SHARDLM_CHECK(rank >= 0 && rank < world, "data: rank %d of %d is out of range", rank, world);
  wait_idle();
  Impl& m = *impl_;
  if (m.job_ready && !m.job_failed && m.job_counts && m.job_key.step == step && m.job_key.rank == rank &&
      m.job_key.world == world)
    return m.counts;
  return m.rank_counts(step, rank, world);
}

StepCounts TokenDataset::step_counts(int64_t step) {
  wait_idle();
  StepCounts c = impl_->rank_counts(step, 0, 1);
  return c;
}

void TokenDataset::read_rows(int64_t first_row, int64_t rows, MicroBatch& out) {
  SHARDLM_CHECK(first_row >= 0 && rows >= 0 && rows <= spec_.micro_batch,
                "data: read_rows(%lld, %lld) with micro_batch %lld", (long long)first_row, (long long)rows,
                (long long)spec_.micro_batch);
  wait_idle();
  impl_->fill_rows(first_row, rows, out);
}

DataPosition TokenDataset::position(int64_t step) {
  wait_idle();
  Impl& m = *impl_;
  DataPosition pos;
  pos.step = step;
  pos.rows_consumed = m.first_row_of_step(step);
  pos.seq_len = spec_.seq_len;
  pos.seed = spec_.seed;
  pos.documents = documents();
  pos.shuffle = spec_.shuffle;
  const std::vector<int64_t> rows = m.mix->rows_of_each_file_before(pos.rows_consumed);
  for (size_t k = 0; k < m.sources.size(); ++k) pos.sources.push_back({m.sources[k]->file.documents, rows[k]});
  return pos;
}

void TokenDataset::restore(const DataPosition& pos) {
  wait_idle();
  Impl& m = *impl_;
  SHARDLM_CHECK(pos.step >= 0 && pos.rows_consumed >= 0, "data position: step %ld, rows consumed %ld; both must be >= 0",
                pos.step, pos.rows_consumed);
  std::string changed;
  if (pos.seq_len != spec_.seq_len) {
    changed = fmt("data.seq_len was %ld then and is %ld now", pos.seq_len, spec_.seq_len);
  } else if (pos.sources.size() != m.sources.size()) {
    changed = fmt("data.path had %zu file%s then and has %zu now", pos.sources.size(),
                  pos.sources.size() == 1 ? "" : "s", m.sources.size());
  } else if (pos.shuffle != spec_.shuffle) {
    changed = fmt("shuffling was %s then and is %s now", pos.shuffle ? "on" : "off", spec_.shuffle ? "on" : "off");
  } else if ((pos.shuffle || m.sources.size() > 1) && pos.seed != spec_.seed) {
    changed = fmt("the seed was %lu then and is %lu now", static_cast<unsigned long>(pos.seed),
                  static_cast<unsigned long>(spec_.seed));
  }
  for (size_t k = 0; changed.empty() && k < m.sources.size(); ++k)
    if (pos.sources[k].documents != m.sources[k]->file.documents)
      changed = fmt("data.path had %ld documents then and has %ld now%s", pos.sources[k].documents,
                    m.sources[k]->file.documents,
                    m.sources.size() > 1 ? fmt(" in file %zu ('%s')", k, m.sources[k]->file.path.c_str()).c_str() : "");
  SHARDLM_CHECK(changed.empty(),
                "cannot continue the data order saved at step %ld: %s, so the saved row position "
                "would point at other rows",
                pos.step, changed.c_str());
  m.anchor_step = pos.step;
  std::vector<int64_t> rows_before;
  for (const SourcePosition& s : pos.sources) rows_before.push_back(s.rows_consumed);
  m.mix->restore(pos.rows_consumed, rows_before);
  m.job_ready = false;  // anything prefetched was read from the old anchor
}

// ------------------------------------------------------------------ inspection

int64_t TokenDataset::documents() const {
  int64_t n = 0;
  for (const auto& s : impl_->sources) n += s->file.documents;
  return n;
}

int64_t TokenDataset::total_tokens() const {
  int64_t n = 0;
  for (const auto& s : impl_->sources) n += s->file.tokens.length;
  return n;
}

int64_t TokenDataset::sources() const { return impl_->files(); }
int64_t TokenDataset::file_vocab_size() const { return impl_->sources[0]->file.vocab_attribute; }
const std::string& TokenDataset::tokenizer() const { return impl_->sources[0]->file.tokenizer; }

std::string TokenDataset::storage() const { return impl_->sources[0]->file.tokens.describe(); }

int64_t TokenDataset::rows_in_epoch(int64_t epoch) {
  wait_idle();
  return impl_->sources[0]->rows_in_epoch(epoch);
}

std::vector<int64_t> TokenDataset::document_order(int64_t epoch) const {
  const PackedFile& s = *impl_->sources[0];
  std::vector<uint32_t> order;
  s.fill_order(epoch, order);
  std::vector<int64_t> out(static_cast<size_t>(s.file.documents));
  for (size_t i = 0; i < out.size(); ++i) out[i] = order.empty() ? static_cast<int64_t>(i) : order[i];
  return out;
}

DataMemory TokenDataset::memory() const { return impl_->memory(/*bound=*/true); }

}  // namespace shardlm

