// layout.hpp — what a checkpoint file holds and what its datasets
// are called (docs/checkpoint.md, "Layout").
//
// Owns: the dataset names (/model/<HF name>, /optim/<HF name>/<state>,
// /data/position) and which shard buffer each comes from, this rank's element
// range of each, the root and group attributes (step, tokens, the deck, the
// architecture, the optimizer's name and step count) and how they are written
// and read, the metadata phase of a save (groups, attributes, datasets with
// their checksums). Knows HDF5 objects and the TrainSession's shards; knows
// nothing about how raw bytes reach the disk (checkpoint/io.hpp), MPI agreement,
// retention or signals.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.hpp"
#include "shardlm/h5util.hpp"
#include "shardlm/model.hpp"
#include "train/optim.hpp"
#include "train/shard.hpp"

namespace shardlm {
struct TrainSession;
}

namespace shardlm::ckpt {

// ---- text for messages
std::string show_shape(const std::vector<int64_t>& shape);
std::string mib(double bytes);
std::vector<std::string> split(const std::string& s, char sep);
std::string join(const std::vector<std::string>& v, const char* sep);
std::string now_text();  // UTC, ISO 8601

// ---- attributes (scalar; strings variable-length UTF-8, which h5py reads as str)
void attr_i64(hid_t obj, const char* name, int64_t v);
void attr_u64(hid_t obj, const char* name, uint64_t v);
void attr_f64(hid_t obj, const char* name, double v);
void attr_str(hid_t obj, const char* name, const std::string& v);
int64_t read_i64(hid_t obj, const char* name);
uint64_t read_u64(hid_t obj, const char* name);
double read_f64(hid_t obj, const char* name);
std::string read_str(hid_t obj, const char* name);

// The root, /model, /optim and /rng attributes of an open file. Throws
// CheckpointMismatch for another format version; HDF5 errors as Error.
CheckpointInfo read_info(hid_t file, const std::filesystem::path& path);

// The canonical text of every root attribute but `attributes_checksum`, and of
// the /model, /optim, /data and /rng attributes ("group:name=value" lines,
// sorted by name; floats in hex, so exact); its checksum_text is the file's
// `attributes_checksum`.
std::string attributes_text(hid_t file);
// Throws (naming both values) when format >= 2 and attributes_checksum does not
// match attributes_text: an attribute was changed or damaged after the save.
void verify_attributes(hid_t file, int64_t format);

// Every dataset a file with these attributes must hold, by name: /model/<name>
// for each parameter of info.arch's layout, /optim/<name>/<state> for each
// state the optimizer keeps on it (Muon: momentum_buffer on its matrices,
// AdamW's two elsewhere), /data/position. The file's own attributes decide, so
// a missing or renamed dataset is damage, not a mismatch with the run.
std::vector<std::string> expected_datasets(const CheckpointInfo& info);
// Paths (absolute, "/optim/x/exp_avg") of every dataset below `group`.
std::vector<std::string> datasets_under(hid_t file, const char* group);
// The expected datasets that are missing and the datasets of /model and /optim
// that are not expected, as "PATH: missing" / "PATH: not expected by the
// file's own layout (a renamed dataset?)"; empty when the file is complete.
std::vector<std::string> layout_problems(hid_t file, const CheckpointInfo& info);

// ---- datasets
std::vector<int64_t> dataset_shape(hid_t dset);
int64_t numel_of(const std::vector<int64_t>& shape);
bool link_exists(hid_t loc, const std::string& path);  // every group on the way must exist too

// The optimizer's state arrays by their checkpoint names, in order.
std::vector<std::string> state_names(const Optimizer& optimizer);

// One fp32 dataset of the checkpoint and the shard buffers it comes from.
struct Tensor {
  std::string path;                   // /model/<name> or /optim/<name>/<state>
  size_t unit = 0;
  const ParamInfo* param = nullptr;
  std::vector<Buffer<float>>* shards = nullptr;  // [unit] (shard_numel)
};
std::vector<Tensor> tensors_of(TrainSession& s);

// This rank's part of tensor t: elements [begin, begin + count) of the
// flattened parameter, at `shard_offset` in the unit's shard.
struct LocalRange {
  int64_t begin = 0, count = 0, shard_offset = 0;
};
LocalRange local_range(const ShardedModel& model, const Tensor& t);

// The metadata phase of a save, on an open (parallel) file: every rank makes
// the same calls with the same values. Creates the root, /model, /optim, /data
// and /rng attributes, and every dataset of `tensors` (space allocated now, no
// fill) with its checksum attribute, and /data/position; returns the dataset
// handles (tensors', then position's last).
struct SaveMetadata {
  int64_t steps_done = 0, tokens_seen = 0, world_size = 0;
  std::string saved_at;
  const std::vector<uint64_t>* sums = nullptr;  // [tensor]
  uint64_t position_sum = 0;
  int64_t position_size = 0;
};
std::vector<h5::Handle> write_metadata(hid_t file, TrainSession& s, const std::vector<Tensor>& tensors,
                                       const SaveMetadata& m);

}  // namespace shardlm::ckpt
