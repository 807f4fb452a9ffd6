// layout.cpp — dataset names, attributes and the metadata phase of a
// save (checkpoint/layout.hpp).
#include "checkpoint/layout.hpp"

#include <algorithm>
#include <cstring>
#include <ctime>
#include <set>
#include <type_traits>

#include "checkpoint/checksum.hpp"
#include "train/muon.hpp"
#include "shardlm/model_config.hpp"
#include "shardlm/runtime.hpp"
#include "train/train.hpp"

namespace fs = std::filesystem;

namespace shardlm::ckpt {

std::string show_shape(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

std::string mib(double bytes) { return fmt("%.1f MiB", bytes / 1048576.0); }

// ------------------------------------------------------------ HDF5 attributes

namespace {
h5::Handle scalar_space() { return h5::Handle(H5_CHECK(H5Screate(H5S_SCALAR)), H5Sclose); }

void write_attr(hid_t obj, const char* name, hid_t file_type, hid_t mem_type, const void* value) {
  h5::Handle space = scalar_space();
  h5::Handle attr(H5_CHECK(H5Acreate2(obj, name, file_type, space, H5P_DEFAULT, H5P_DEFAULT)), H5Aclose);
  H5_CHECK(H5Awrite(attr, mem_type, value));
}
}  // namespace
void attr_i64(hid_t obj, const char* name, int64_t v) { write_attr(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &v); }
void attr_u64(hid_t obj, const char* name, uint64_t v) { write_attr(obj, name, H5T_STD_U64LE, H5T_NATIVE_UINT64, &v); }
void attr_f64(hid_t obj, const char* name, double v) { write_attr(obj, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &v); }
// Variable-length UTF-8: h5py reads it as str.
void attr_str(hid_t obj, const char* name, const std::string& v) {
  h5::Handle type(H5_CHECK(H5Tcopy(H5T_C_S1)), H5Tclose);
  H5_CHECK(H5Tset_size(type, H5T_VARIABLE));
  H5_CHECK(H5Tset_cset(type, H5T_CSET_UTF8));
  const char* text = v.c_str();
  write_attr(obj, name, type, type, &text);
}

namespace {
h5::Handle open_attr(hid_t obj, const char* name) {
  SHARDLM_CHECK(H5_CHECK(H5Aexists(obj, name)) > 0, "attribute '%s' is missing", name);
  return h5::Handle(H5_CHECK(H5Aopen(obj, name, H5P_DEFAULT)), H5Aclose);
}
}  // namespace

int64_t read_i64(hid_t obj, const char* name) {
  h5::Handle attr = open_attr(obj, name);
  int64_t v = 0;
  H5_CHECK(H5Aread(attr, H5T_NATIVE_INT64, &v));
  return v;
}
uint64_t read_u64(hid_t obj, const char* name) {
  h5::Handle attr = open_attr(obj, name);
  uint64_t v = 0;
  H5_CHECK(H5Aread(attr, H5T_NATIVE_UINT64, &v));
  return v;
}
double read_f64(hid_t obj, const char* name) {
  h5::Handle attr = open_attr(obj, name);
  double v = 0;
  H5_CHECK(H5Aread(attr, H5T_NATIVE_DOUBLE, &v));
  return v;
}
std::string read_str(hid_t obj, const char* name) {
  h5::Handle attr = open_attr(obj, name);
  h5::Handle type(H5_CHECK(H5Aget_type(attr)), H5Tclose);
  SHARDLM_CHECK(H5Tget_class(type) == H5T_STRING, "attribute '%s' is not a string", name);
  return h5::read_string_attribute_value(attr, type);
}

namespace {

// The architecture as attributes of /model: enough to rebuild the layout
// (export, inspect) without the deck or model.hf.
void write_arch(hid_t g, const ModelConfig& a, int64_t parameter_count, int64_t tensors) {
  for (const ModelField& f : model_fields())
    visit_member(f, a, [&](const auto& v) {
      using T = std::decay_t<decltype(v)>;
      if constexpr (std::is_same_v<T, std::string>) attr_str(g, f.attribute, v);
      else if constexpr (std::is_same_v<T, double>) attr_f64(g, f.attribute, v);
      else attr_i64(g, f.attribute, v);  // integers; flags as 0 or 1
    });
  attr_i64(g, "parameter_count", parameter_count);
  attr_i64(g, "tensors", tensors);
}

ModelConfig read_arch(hid_t g) {
  ModelConfig a;
  for (const ModelField& f : model_fields()) {
    // A checkpoint written before models of experts has none of their attributes: a dense model.
    if (f.hf == HfForm::Moe && H5Aexists(g, f.attribute) <= 0) continue;
    visit_member(f, a, [&](auto& v) {
      using T = std::decay_t<decltype(v)>;
      if constexpr (std::is_same_v<T, std::string>) v = read_str(g, f.attribute);
      else if constexpr (std::is_same_v<T, double>) v = read_f64(g, f.attribute);
      else if constexpr (std::is_same_v<T, bool>) v = read_i64(g, f.attribute) != 0;
      else v = read_i64(g, f.attribute);
    });
  }
  return a;
}

}  // namespace

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t end = s.find(sep, start);
    const std::string piece = s.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (!piece.empty()) out.push_back(piece);
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

CheckpointInfo read_info(hid_t file, const fs::path& path) {
  CheckpointInfo info;
  info.path = path;
  info.format = read_i64(file, "format_version");
  if (info.format < kOldestReadableFormat || info.format > kCheckpointFormat)  // not ours: refused, not damage
    throw CheckpointMismatch(fmt("checkpoint %s is in format %lld; this shardlm (%s) reads formats %lld to %lld",
                                 path.c_str(), (long long)info.format, shardlm_version(),
                                 (long long)kOldestReadableFormat, (long long)kCheckpointFormat));
  verify_attributes(file, info.format);
  info.step = read_i64(file, "step");
  info.tokens_seen = read_i64(file, "tokens_seen");
  info.world_size_at_save = read_i64(file, "world_size_at_save");
  info.shardlm_version = read_str(file, "shardlm_version");
  info.saved_at = read_str(file, "saved_at");
  info.deck = read_str(file, "deck");
  info.bad_steps_in_a_row = read_i64(file, "bad_steps_in_a_row");
  info.bad_steps_total = read_i64(file, "bad_steps_total");
  {
    h5::Handle g(H5_CHECK(H5Gopen2(file, "model", H5P_DEFAULT)), H5Gclose);
    info.arch = read_arch(g);
    info.parameter_count = read_i64(g, "parameter_count");
    info.tensors = read_i64(g, "tensors");
  }
  {
    h5::Handle g(H5_CHECK(H5Gopen2(file, "optim", H5P_DEFAULT)), H5Gclose);
    info.optimizer = read_str(g, "name");
    info.optimizer_states = split(read_str(g, "states"), ',');
    info.optimizer_steps = read_i64(g, "steps_taken");
  }
  {
    h5::Handle g(H5_CHECK(H5Gopen2(file, "rng", H5P_DEFAULT)), H5Gclose);
    info.seed = static_cast<uint64_t>(read_i64(g, "seed"));
  }
  return info;
}

namespace {

// "name=value" of one attribute, exact: integers in decimal, floats in hex, strings as they are.
herr_t append_attribute(hid_t obj, const char* name, const H5A_info_t*, void* data) {
  auto& lines = *static_cast<std::vector<std::string>*>(data);
  if (std::strcmp(name, "attributes_checksum") == 0) return 0;
  try {
    h5::Handle attr(H5_CHECK(H5Aopen(obj, name, H5P_DEFAULT)), H5Aclose);
    h5::Handle type(H5_CHECK(H5Aget_type(attr)), H5Tclose);
    std::string value;
    switch (H5Tget_class(type)) {
      case H5T_INTEGER:
        value = H5Tget_sign(type) == H5T_SGN_NONE ? "u" + std::to_string(read_u64(obj, name))
                                                   : "i" + std::to_string(read_i64(obj, name));
        break;
      case H5T_FLOAT: value = fmt("f%a", read_f64(obj, name)); break;
      case H5T_STRING: value = "s" + read_str(obj, name); break;
      default: value = "?" + h5::dtype_name(type);
    }
    lines.push_back(std::string(name) + "=" + value);
  } catch (const std::exception&) {
    return -1;  // H5Aiterate2 fails, and H5_CHECK says where
  }
  return 0;
}

}  // namespace

std::string attributes_text(hid_t file) {
  std::string text;
  for (const char* group : {"/", "/model", "/optim", "/data", "/rng"}) {
    std::vector<std::string> lines;
    h5::Handle g(H5_CHECK(H5Gopen2(file, group, H5P_DEFAULT)), H5Gclose);
    H5_CHECK(H5Aiterate2(g, H5_INDEX_NAME, H5_ITER_INC, nullptr, append_attribute, &lines));
    std::sort(lines.begin(), lines.end());
    for (const auto& l : lines) text += std::string(group) + ":" + l + "\n";
  }
  return text;
}

void verify_attributes(hid_t file, int64_t format) {
  if (format < 2) return;  // written before attributes carried a checksum
  const uint64_t stored = read_u64(file, "attributes_checksum");
  const uint64_t computed = checksum_text(attributes_text(file));
  SHARDLM_CHECK(stored == computed,
                "the root and group attributes do not match attributes_checksum (stored %016llx, computed %016llx): "
                "an attribute (step, tokens_seen, steps_taken, the deck, ...) was changed or damaged after the save",
                (unsigned long long)stored, (unsigned long long)computed);
}

std::vector<std::string> expected_datasets(const CheckpointInfo& info) {
  const ModelLayout layout(info.arch, 1);
  std::vector<std::string> out;
  for (const auto& [unit, p] : layout.all_params()) out.push_back("/model/" + p->name);
  // The same rule as Optimizer::state_name(i, unit, param), from the file's attributes.
  for (size_t k = 0; k < info.optimizer_states.size(); ++k)
    for (const auto& [unit, p] : layout.all_params()) {
      std::string state = info.optimizer_states[k];
      if (info.optimizer == "muon" && is_muon_param(*unit, *p)) state = k == 0 ? "momentum_buffer" : "";
      if (!state.empty()) out.push_back("/optim/" + p->name + "/" + state);
    }
  out.push_back("/data/position");
  return out;
}

std::vector<std::string> datasets_under(hid_t file, const char* group) {
  std::vector<std::string> links, out;
  h5::Handle g(H5_CHECK(H5Gopen2(file, group, H5P_DEFAULT)), H5Gclose);
  auto collect = [](hid_t, const char* name, const H5L_info_t*, void* data) -> herr_t {
    static_cast<std::vector<std::string>*>(data)->push_back(name);
    return 0;
  };
  H5_CHECK(H5Lvisit(g, H5_INDEX_NAME, H5_ITER_INC, collect, &links));
  for (const auto& name : links) {
    h5::Handle obj(H5_CHECK(H5Oopen(g, name.c_str(), H5P_DEFAULT)), H5Oclose);
    if (H5Iget_type(obj) == H5I_DATASET) out.push_back(std::string("/") + group + "/" + name);
  }
  return out;
}

std::vector<std::string> layout_problems(hid_t file, const CheckpointInfo& info) {
  const std::vector<std::string> expected = expected_datasets(info);
  std::vector<std::string> present = datasets_under(file, "model"), problems;
  for (const auto& n : datasets_under(file, "optim")) present.push_back(n);
  const std::set<std::string> want(expected.begin(), expected.end()), have(present.begin(), present.end());
  for (const auto& n : expected)
    if (!have.count(n) && !(n == "/data/position" && link_exists(file, n))) problems.push_back(n + ": missing");
  for (const auto& n : present)
    if (!want.count(n)) problems.push_back(n + ": not expected by the file's own layout (a renamed dataset?)");
  return problems;
}

std::vector<int64_t> dataset_shape(hid_t dset) {
  h5::Handle space(H5_CHECK(H5Dget_space(dset)), H5Sclose);
  const int nd = H5_CHECK(H5Sget_simple_extent_ndims(space));
  std::vector<hsize_t> dims(static_cast<size_t>(nd));
  H5_CHECK(H5Sget_simple_extent_dims(space, dims.data(), nullptr));
  return std::vector<int64_t>(dims.begin(), dims.end());
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool link_exists(hid_t loc, const std::string& path) {
  // Every intermediate group must exist for H5Lexists on a nested path.
  size_t pos = 0;
  while ((pos = path.find('/', pos + 1)) != std::string::npos)
    if (H5_CHECK(H5Lexists(loc, path.substr(0, pos).c_str(), H5P_DEFAULT)) <= 0) return false;
  return H5_CHECK(H5Lexists(loc, path.c_str(), H5P_DEFAULT)) > 0;
}

std::vector<std::string> state_names(const Optimizer& optimizer) {
  std::vector<std::string> out;
  for (int k = 0; k < optimizer.states(); ++k) out.push_back(optimizer.state_name(k));
  return out;
}

std::vector<Tensor> tensors_of(TrainSession& s) {
  std::vector<Tensor> out;
  const auto& units = s.model.layout.units;
  for (size_t u = 0; u < units.size(); ++u)
    for (const auto& p : units[u].params) out.push_back({"/model/" + p.name, u, &p, &s.model.param});
  // Muon keeps one state on its matrices: an empty name means "no such array here".
  for (int k = 0; k < s.optimizer.states(); ++k)
    for (size_t u = 0; u < units.size(); ++u)
      for (const auto& p : units[u].params)
        if (const std::string name = s.optimizer.state_name(k, units[u], p); !name.empty())
          out.push_back({"/optim/" + p.name + "/" + name, u, &p, &s.optimizer.state(k)});
  return out;
}

LocalRange local_range(const ShardedModel& model, const Tensor& t) {
  const Unit& u = model.layout.units[t.unit];
  for (const auto& seg : model.segments(u))
    if (seg.param == t.param) return {seg.param_begin, seg.count, seg.shard_offset};
  return {};
}

std::string now_text() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

std::vector<h5::Handle> write_metadata(hid_t file, TrainSession& s, const std::vector<Tensor>& tensors,
                                       const SaveMetadata& m) {
  // No timestamps in object headers: the same state gives the same bytes.
  h5::Handle gcpl(H5_CHECK(H5Pcreate(H5P_GROUP_CREATE)), H5Pclose);
  H5_CHECK(H5Pset_obj_track_times(gcpl, false));
  auto group = [&](hid_t parent, const std::string& name) {
    return h5::Handle(H5_CHECK(H5Gcreate2(parent, name.c_str(), H5P_DEFAULT, gcpl, H5P_DEFAULT)), H5Gclose);
  };
  attr_i64(file, "format_version", kCheckpointFormat);
  attr_i64(file, "step", m.steps_done);
  attr_i64(file, "tokens_seen", m.tokens_seen);
  attr_i64(file, "world_size_at_save", m.world_size);
  attr_str(file, "shardlm_version", std::string(shardlm_version()) + " (" + shardlm_git_rev() + ")");
  attr_str(file, "saved_at", m.saved_at);
  attr_str(file, "deck", resolved_deck(s.config));
  attr_i64(file, "bad_steps_in_a_row", s.bad_steps_in_a_row);
  attr_i64(file, "bad_steps_total", s.bad_steps_total);
  const ModelLayout& layout = s.model.layout;
  int64_t n_params = 0;
  for (const auto& u : layout.units) n_params += static_cast<int64_t>(u.params.size());
  const auto names = state_names(s.optimizer);
  {
    h5::Handle g = group(file, "model");
    write_arch(g, layout.config, layout.parameter_count(), n_params);
    h5::Handle o = group(file, "optim");
    attr_str(o, "name", s.optimizer.name());
    attr_str(o, "states", join(names, ","));
    attr_i64(o, "steps_taken", s.optimizer.steps_taken());
    const OptimSection& oc = s.config.optim;
    attr_f64(o, "lr", oc.lr);
    attr_f64(o, "beta1", oc.beta1);
    attr_f64(o, "beta2", oc.beta2);
    attr_f64(o, "eps", oc.eps);
    attr_f64(o, "weight_decay", oc.weight_decay);
    attr_f64(o, "momentum", oc.momentum);
    std::set<std::string> made;
    for (const auto& t : tensors)
      if (t.path.rfind("/optim/", 0) == 0 && made.insert(t.param->name).second) group(o, t.param->name);
    h5::Handle d = group(file, "data");
    attr_str(d, "position_fields", "format, step, rows_consumed, seq_len, seed, documents, shuffle");
    h5::Handle r = group(file, "rng");
    attr_i64(r, "seed", s.config.run.seed);
    attr_str(r, "note",
             "counter-based: initial weights = f(seed, name, index), data order = f(seed, epoch); "
             "no other generator state");
  }
  // Raw data is written once, by the ranks: no fill values, space allocated now.
  h5::Handle dcpl(H5_CHECK(H5Pcreate(H5P_DATASET_CREATE)), H5Pclose);
  H5_CHECK(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER));
  H5_CHECK(H5Pset_alloc_time(dcpl, H5D_ALLOC_TIME_EARLY));
  H5_CHECK(H5Pset_obj_track_times(dcpl, false));
  std::vector<h5::Handle> dsets;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& shape = tensors[i].param->shape;
    std::vector<hsize_t> dims(shape.begin(), shape.end());
    h5::Handle space(H5_CHECK(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr)), H5Sclose);
    dsets.emplace_back(H5_CHECK(H5Dcreate2(file, tensors[i].path.c_str(), H5T_IEEE_F32LE, space, H5P_DEFAULT, dcpl,
                                           H5P_DEFAULT)),
                       H5Dclose);
    attr_u64(dsets.back(), "checksum", (*m.sums)[i]);
  }
  const hsize_t n = static_cast<hsize_t>(m.position_size);
  h5::Handle space(H5_CHECK(H5Screate_simple(1, &n, nullptr)), H5Sclose);
  dsets.emplace_back(
      H5_CHECK(H5Dcreate2(file, "/data/position", H5T_STD_I64LE, space, H5P_DEFAULT, dcpl, H5P_DEFAULT)), H5Dclose);
  attr_u64(dsets.back(), "checksum", m.position_sum);
  // Last: the checksum of every attribute written above (read back, so the
  // writer and the reader hash the same text).
  attr_u64(file, "attributes_checksum", checksum_text(attributes_text(file)));
  return dsets;
}

}  // namespace shardlm::ckpt
