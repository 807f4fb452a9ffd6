// config.cpp — deck parsing and validation against one table of known keys.
//
// Every key the deck accepts is one row of key_table(): its path, its type, its
// constraint and whether its feature exists yet. Parsing walks the TOML tree and
// looks each key up there, so unknown keys, wrong types and out-of-range values
// are found by one mechanism and reported with the same FILE:LINE:COL prefix.
#include "shardlm/config.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include <toml++/toml.h>

#include "shardlm/checked_math.hpp"
#include "shardlm/error.hpp"
#include "shardlm/model.hpp"

namespace shardlm {
namespace {

enum class Type { Bool, Int, Float, String, Strings, Floats };

const char* type_name(Type t) {
  switch (t) {
    case Type::Bool: return "a boolean (true or false)";
    case Type::Int: return "an integer";
    case Type::Float: return "a number";
    case Type::String: return "a string";
    case Type::Strings: return "a string or an array of strings";
    case Type::Floats: return "an array of numbers";
  }
  return "?";
}

struct KeySpec {
  std::string path;                      // "section.key"
  Type type;
  std::function<void*(Config&)> ref;     // the field this key sets
  double min = -INFINITY;                // numbers: inclusive bounds ...
  double max = INFINITY;
  bool min_exclusive = false;            // ... or exclusive lower bound
  std::vector<std::string> choices;      // strings: accepted values (empty = any)
  std::vector<std::string> not_yet;      // strings: accepted later, refused now
  bool implemented = true;               // false: any appearance is refused
};

template <class F>
KeySpec key(std::string path, Type type, F field) {
  KeySpec k;
  k.path = std::move(path);
  k.type = type;
  k.ref = [field](Config& c) -> void* { return static_cast<void*>(&field(c)); };
  return k;
}
KeySpec at_least(KeySpec k, double min) { k.min = min; return k; }
KeySpec positive(KeySpec k) { k.min = 0; k.min_exclusive = true; return k; }
KeySpec within(KeySpec k, double min, double max) { k.min = min; k.max = max; return k; }
KeySpec up_to(KeySpec k, double max) { k.max = max; return k; }
// Timeouts: a year. Longer ones overflow the clocks' nanosecond counts long before they help anyone.
constexpr double kMaxSeconds = 3.2e7;
KeySpec one_of(KeySpec k, std::vector<std::string> choices, std::vector<std::string> not_yet = {}) {
  k.choices = std::move(choices);
  k.not_yet = std::move(not_yet);
  return k;
}
// For a key whose feature is not built yet (none today): refused with "not implemented yet".
[[maybe_unused]] KeySpec not_implemented(KeySpec k) { k.implemented = false; return k; }

#define FIELD(expr) [](Config& c) -> auto& { return c.expr; }

// The [model] keys of ModelConfig's members, one row of model_config.hpp's
// table each, after model.hf: a number > 0 (>= 0 where the row takes 0) and at
// most the row's max, a string one of its choices.
std::vector<KeySpec> with_model_fields(std::vector<KeySpec> table) {
  auto at = std::find_if(table.begin(), table.end(), [](const KeySpec& k) { return k.path == "model.hf"; }) + 1;
  for (const ModelField& f : model_fields()) {
    if (!f.name) continue;  // bos_token_id, eos_token_id: config.json's only
    KeySpec k;
    k.path = std::string("model.") + f.name;
    k.type = field_is<bool>(f) ? Type::Bool : field_is<int64_t>(f) ? Type::Int
           : field_is<double>(f) ? Type::Float : Type::String;
    k.ref = [&f](Config& c) -> void* { return visit_member(f, c.model.arch, [](auto& v) -> void* { return &v; }); };
    if (k.type == Type::Int || k.type == Type::Float)
      k = f.zero_ok ? within(std::move(k), 0, f.max) : up_to(positive(std::move(k)), f.max);
    if (k.type == Type::String) k = one_of(std::move(k), std::vector<std::string>(f.choices.begin(), f.choices.end()));
    at = table.insert(at, std::move(k)) + 1;
  }
  return table;
}

const std::vector<KeySpec>& key_table() {
  static const std::vector<KeySpec> table = with_model_fields({
      key("run.name", Type::String, FIELD(run.name)),
      key("run.dir", Type::String, FIELD(run.dir)),
      at_least(key("run.seed", Type::Int, FIELD(run.seed)), 0),
      at_least(key("run.max_steps", Type::Int, FIELD(run.max_steps)), 0),
      key("run.deterministic", Type::Bool, FIELD(run.deterministic)),
      at_least(key("run.max_bad_steps", Type::Int, FIELD(run.max_bad_steps)), 1),
      key("run.export_dir", Type::String, FIELD(run.export_dir)),
      one_of(key("run.export_dtype", Type::String, FIELD(run.export_dtype)), {"bf16", "fp32"}),

      key("model.hf", Type::String, FIELD(model.hf)),
      up_to(positive(key("model.init_std", Type::Float, FIELD(model.init_std))), 100),
      key("model.optim_cpu_offload", Type::Bool, FIELD(model.optim_cpu_offload)),
      one_of(key("model.optim_offload_grads", Type::String, FIELD(model.optim_offload_grads)), {"host", "device"}),
      within(key("model.optim_gpu_state_gib", Type::Float, FIELD(model.optim_gpu_state_gib)), -1, 1e6),
      key("model.optim_offload_speculate", Type::Bool, FIELD(model.optim_offload_speculate)),
      one_of(key("model.activation_checkpointing", Type::String, FIELD(model.activation_checkpointing)),
             {"none", "full", "selective"}),
      within(key("model.selective_layers", Type::Int, FIELD(model.selective_layers)), 0, kMaxLayers),
      key("model.reshard_after_forward", Type::Bool, FIELD(model.reshard_after_forward)),
      one_of(key("model.reduce_dtype", Type::String, FIELD(model.reduce_dtype)), {"fp32", "bf16"}),
      up_to(positive(key("model.context_parallel", Type::Int, FIELD(model.context_parallel))), 65536),
      up_to(positive(key("model.expert_parallel", Type::Int, FIELD(model.expert_parallel))), 65536),
      one_of(key("model.fp8", Type::String, FIELD(model.fp8)), {"none", "tensorwise", "rowwise"}),
      key("model.fp8_weight_cache", Type::Bool, FIELD(model.fp8_weight_cache)),
      key("model.fp8_attention", Type::Bool, FIELD(model.fp8_attention)),
      one_of(key("model.residual_dtype", Type::String, FIELD(model.residual_dtype)), {"bf16", "fp32"}),
      one_of(key("model.norm_dtype", Type::String, FIELD(model.norm_dtype)), {"bf16", "fp32"}),

      key("data.path", Type::Strings, FIELD(data.path)),
      within(key("data.weights", Type::Floats, FIELD(data.weights)), 0, 1e6),
      key("data.shuffle", Type::Bool, FIELD(data.shuffle)),
      within(key("data.seq_len", Type::Int, FIELD(data.seq_len)), 2, kMaxSeqLen),
      up_to(positive(key("data.micro_batch", Type::Int, FIELD(data.micro_batch))), kMaxTokensPerMicroBatch),
      up_to(positive(key("data.global_batch", Type::Int, FIELD(data.global_batch))), 2147483647),
      key("data.packing", Type::Bool, FIELD(data.packing)),
      key("data.rollout_dir", Type::String, FIELD(data.rollout_dir)),
      at_least(key("data.max_async", Type::Int, FIELD(data.max_async)), 0),
      up_to(positive(key("data.rollout_timeout_s", Type::Float, FIELD(data.rollout_timeout_s))), kMaxSeconds),

      key("eval.path", Type::String, FIELD(eval.path)),
      at_least(key("eval.interval", Type::Int, FIELD(eval.interval)), 0),
      at_least(key("eval.rows", Type::Int, FIELD(eval.rows)), 0),
      key("eval.at_end", Type::Bool, FIELD(eval.at_end)),
      key("eval.prompts", Type::String, FIELD(eval.prompts)),
      within(key("eval.samples", Type::Int, FIELD(eval.samples)), 0, 1 << 16),
      up_to(positive(key("eval.max_new_tokens", Type::Int, FIELD(eval.max_new_tokens))), kMaxPositions),
      up_to(positive(key("eval.batch", Type::Int, FIELD(eval.batch))), 65536),
      within(key("eval.correct_above", Type::Float, FIELD(eval.correct_above)), -1e6, 1e6),

      one_of(key("optim.name", Type::String, FIELD(optim.name)), {"adamw", "sgd", "muon"}),
      up_to(positive(key("optim.lr", Type::Float, FIELD(optim.lr))), 1000),
      within(key("optim.beta1", Type::Float, FIELD(optim.beta1)), 0, 0.999999),
      within(key("optim.beta2", Type::Float, FIELD(optim.beta2)), 0, 0.999999),
      up_to(positive(key("optim.eps", Type::Float, FIELD(optim.eps))), 1),
      within(key("optim.weight_decay", Type::Float, FIELD(optim.weight_decay)), 0, 1000),
      within(key("optim.momentum", Type::Float, FIELD(optim.momentum)), 0, 0.999999),
      within(key("optim.max_norm", Type::Float, FIELD(optim.max_norm)), 0, 1e12),
      within(key("optim.muon_momentum", Type::Float, FIELD(optim.muon_momentum)), 0, 0.999999),
      within(key("optim.ns_steps", Type::Int, FIELD(optim.ns_steps)), 1, 20),
      up_to(positive(key("optim.adamw_lr", Type::Float, FIELD(optim.adamw_lr))), 1000),
      within(key("optim.adamw_weight_decay", Type::Float, FIELD(optim.adamw_weight_decay)), 0, 1000),

      one_of(key("sched.name", Type::String, FIELD(sched.name)), {"constant", "linear", "cosine"}),
      at_least(key("sched.warmup", Type::Int, FIELD(sched.warmup)), 0),
      at_least(key("sched.decay", Type::Int, FIELD(sched.decay)), 0),
      within(key("sched.min_lr", Type::Float, FIELD(sched.min_lr)), 0, 1000),
      within(key("sched.min_lr_ratio", Type::Float, FIELD(sched.min_lr_ratio)), 0, 1),

      one_of(key("loss.type", Type::String, FIELD(loss.type)), {"sft", "rl"}),
      up_to(positive(key("loss.chunk_tokens", Type::Int, FIELD(loss.chunk_tokens))), kMaxTokensPerMicroBatch),
      within(key("loss.mask_high", Type::Float, FIELD(loss.mask_high)), 0, 1000),
      within(key("loss.mask_low", Type::Float, FIELD(loss.mask_low)), 0, 1000),
      within(key("loss.kl_coef", Type::Float, FIELD(loss.kl_coef)), 0, 1e6),
      within(key("loss.ce_coef", Type::Float, FIELD(loss.ce_coef)), 0, 1e6),
      one_of(key("loss.objective", Type::String, FIELD(loss.objective)), {"masked", "clipped", "gspo", "cispo"}),
      within(key("loss.clip_low", Type::Float, FIELD(loss.clip_low)), 0, 1),
      within(key("loss.clip_high", Type::Float, FIELD(loss.clip_high)), 0, 1000),
      one_of(key("loss.normalize", Type::String, FIELD(loss.normalize)), {"token", "sequence", "constant"}),
      up_to(positive(key("loss.normalize_constant", Type::Float, FIELD(loss.normalize_constant))), 1e15),
      one_of(key("loss.is_level", Type::String, FIELD(loss.is_level)), {"none", "token", "sequence"}),
      within(key("loss.is_cap", Type::Float, FIELD(loss.is_cap)), 1, 1e6),
      within(key("loss.is_mask", Type::Float, FIELD(loss.is_mask)), 0, 1e6),
      within(key("loss.entropy_coef", Type::Float, FIELD(loss.entropy_coef)), 0, 1e6),
      within(key("loss.epochs", Type::Int, FIELD(loss.epochs)), 1, 1000),
      within(key("loss.mini_batches", Type::Int, FIELD(loss.mini_batches)), 1, 1 << 20),
      within(key("loss.ref_kl_coef", Type::Float, FIELD(loss.ref_kl_coef)), 0, 1e6),
      one_of(key("loss.ref_kl_estimator", Type::String, FIELD(loss.ref_kl_estimator)), {"k1", "k2", "k3"}),
      key("loss.router_replay", Type::Bool, FIELD(loss.router_replay)),

      at_least(key("ckpt.interval", Type::Int, FIELD(ckpt.interval)), 0),
      at_least(key("ckpt.keep_last", Type::Int, FIELD(ckpt.keep_last)), 1),
      at_least(key("ckpt.keep_interval", Type::Int, FIELD(ckpt.keep_interval)), 0),
      key("ckpt.resume", Type::String, FIELD(ckpt.resume)),
      key("ckpt.save_final", Type::Bool, FIELD(ckpt.save_final)),
      key("ckpt.async", Type::Bool, FIELD(ckpt.async)),
      at_least(key("ckpt.async_host_gib", Type::Float, FIELD(ckpt.async_host_gib)), 0),
      one_of(key("ckpt.on_error", Type::String, FIELD(ckpt.on_error)), {"stop", "continue"}),

      one_of(key("broadcast.backend", Type::String, FIELD(broadcast.backend)), {"none", "nccl", "filesystem"}),
      positive(key("broadcast.interval", Type::Int, FIELD(broadcast.interval))),
      key("broadcast.dir", Type::String, FIELD(broadcast.dir)),
      positive(key("broadcast.keep", Type::Int, FIELD(broadcast.keep))),

      key("rollout.prompts", Type::String, FIELD(rollout.prompts)),
      up_to(positive(key("rollout.prompts_per_step", Type::Int, FIELD(rollout.prompts_per_step))), 1 << 20),
      up_to(positive(key("rollout.n", Type::Int, FIELD(rollout.n))), 1 << 16),
      up_to(positive(key("rollout.max_new_tokens", Type::Int, FIELD(rollout.max_new_tokens))), kMaxPositions),
      up_to(positive(key("rollout.temperature", Type::Float, FIELD(rollout.temperature))), 1000),
      within(key("rollout.top_p", Type::Float, FIELD(rollout.top_p)), 0, 1),
      within(key("rollout.top_k", Type::Int, FIELD(rollout.top_k)), 0, 2147483647),
      up_to(positive(key("rollout.batch", Type::Int, FIELD(rollout.batch))), 65536),
      within(key("rollout.kv_cache_tokens", Type::Int, FIELD(rollout.kv_cache_tokens)), 0, 2147483647),
      within(key("rollout.kv_cache_memory", Type::Float, FIELD(rollout.kv_cache_memory)), 0, 1),
      key("rollout.in_flight_updates", Type::Bool, FIELD(rollout.in_flight_updates)),
      one_of(key("rollout.reward", Type::Strings, FIELD(rollout.reward)), {"exact", "numeric", "regex", "program", "env"}),
      up_to(positive(key("rollout.max_turns", Type::Int, FIELD(rollout.max_turns))), 1024),
      within(key("rollout.reward_weights", Type::Floats, FIELD(rollout.reward_weights)), -1e6, 1e6),
      key("rollout.reward_regex", Type::String, FIELD(rollout.reward_regex)),
      key("rollout.reward_program", Type::String, FIELD(rollout.reward_program)),
      up_to(positive(key("rollout.reward_timeout_s", Type::Float, FIELD(rollout.reward_timeout_s))), kMaxSeconds),
      one_of(key("rollout.advantage", Type::String, FIELD(rollout.advantage)), {"mean_std", "mean", "rloo", "batch_std"}),
      key("rollout.dynamic_sampling", Type::Bool, FIELD(rollout.dynamic_sampling)),
      up_to(positive(key("rollout.dynamic_max_rounds", Type::Int, FIELD(rollout.dynamic_max_rounds))), 1000),
      one_of(key("rollout.truncated", Type::String, FIELD(rollout.truncated)), {"train", "mask", "penalty"}),
      within(key("rollout.overlong_window", Type::Int, FIELD(rollout.overlong_window)), 0, kMaxPositions),

      key("env.program", Type::String, FIELD(env.program)),
      up_to(positive(key("env.timeout_s", Type::Float, FIELD(env.timeout_s))), kMaxSeconds),

      positive(key("log.interval", Type::Int, FIELD(log.interval))),
      key("log.jsonl", Type::String, FIELD(log.jsonl)),
      key("log.tensorboard", Type::Bool, FIELD(log.tensorboard)),

      one_of(key("device.backend", Type::String, FIELD(device.backend)), {"auto", "cpu", "cuda"}),
      within(key("device.cpu_threads", Type::Int, FIELD(device.cpu_threads)), 0, 4096),
      within(key("device.memory_limit_gib", Type::Float, FIELD(device.memory_limit_gib)), 0, 1e6),
      one_of(key("device.attention", Type::String, FIELD(device.attention)), {"auto", "cudnn", "flash"}),

      one_of(key("comm.backend", Type::String, FIELD(comm.backend)), {"auto", "mpi", "nccl"}),
      up_to(positive(key("comm.timeout_s", Type::Float, FIELD(comm.timeout_s))), kMaxSeconds),
  });
  return table;
}
#undef FIELD

const KeySpec* find_key(const std::string& path) {
  for (const auto& k : key_table())
    if (k.path == path) return &k;
  return nullptr;
}

std::vector<std::string> section_names() {
  std::vector<std::string> out;
  for (const auto& k : key_table()) {
    std::string s = k.path.substr(0, k.path.find('.'));
    if (std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
  }
  return out;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// The known key a user most likely meant: a near spelling in the same section,
// else a key of that section that the unknown one starts with (or the reverse),
// else a near spelling in another section (a key put under the wrong header).
std::string suggest(const std::string& unknown, const std::vector<std::string>& candidates) {
  auto section_of = [](const std::string& p) { return p.substr(0, p.find('.')); };
  auto name_of = [](const std::string& p) { return p.substr(p.find('.') + 1); };
  const std::string section = section_of(unknown), name = name_of(unknown);
  std::string best;
  size_t best_d = 3;  // at most 2 edits
  for (const auto& c : candidates) {
    if (section_of(c) != section) continue;
    size_t d = edit_distance(name, name_of(c));
    if (d < best_d) best_d = d, best = c;
  }
  if (!best.empty()) return best;
  size_t best_len = 0;
  for (const auto& c : candidates) {
    const std::string n = name_of(c);
    if (section_of(c) != section || n.size() < 2) continue;
    bool prefix = name.rfind(n, 0) == 0 || n.rfind(name, 0) == 0;
    if (prefix && n.size() > best_len) best_len = n.size(), best = c;
  }
  if (!best.empty()) return best;
  best_d = 2;
  for (const auto& c : candidates) {
    size_t d = edit_distance(name, name_of(c));
    if (d < best_d) best_d = d, best = c;
  }
  return best;
}

std::string with_hint(std::string message, const std::string& hint) {
  if (!hint.empty()) message += " (did you mean '" + hint + "'?)";
  return message;
}

// Where a node came from: FILE:LINE:COL, or the --set argument that made it.
struct Locator {
  std::string deck_name;
  std::map<std::string, std::string> overridden;  // path -> "--set ..." text

  std::string at(const std::string& path, const toml::source_region& src) const {
    if (auto it = overridden.find(path); it != overridden.end()) return it->second;
    if (src.begin.line == 0) return deck_name;
    return fmt("%s:%u:%u", deck_name.c_str(), src.begin.line, src.begin.column);
  }
};

std::string show(const toml::node& node) {
  std::ostringstream os;
  if (auto s = node.as_string()) os << '"' << s->get() << '"';
  else if (node.is_table()) os << "a table";
  else if (node.is_array()) os << "an array";
  else node.visit([&](auto&& v) { os << v; });
  return os.str();
}

// A bound as a user writes it: integers in full (16777216, not 1.67772e+07).
std::string number_text(double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e15) return fmt("%lld", (long long)v);
  return fmt("%g", v);
}

std::string describe_range(const KeySpec& k) {
  // An integer > 0 is an integer >= 1.
  const bool exclusive = k.min_exclusive && k.type != Type::Int;
  const double min = k.min_exclusive && k.type == Type::Int ? k.min + 1 : k.min;
  const std::string kind = k.type == Type::Float || k.type == Type::Floats ? "a finite number " : "";
  if (std::isfinite(min) && std::isfinite(k.max))
    return exclusive ? kind + "> " + number_text(min) + " and <= " + number_text(k.max)
                     : kind + "between " + number_text(min) + " and " + number_text(k.max);
  if (std::isfinite(min)) return kind + (exclusive ? "> " : ">= ") + number_text(min);
  return kind + "<= " + number_text(k.max);
}

std::string quoted_list(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", \"" : "\"") + items[i] + "\"";
  return out;
}

// Set one field from one TOML value; returns an error message or "".
std::string assign(Config& config, const KeySpec& k, const toml::node& value, const std::string& where) {
  const std::string head = where + ": " + k.path + " = " + show(value);
  void* field = k.ref(config);
  switch (k.type) {
    case Type::Bool: {
      auto v = value.as_boolean();
      if (!v) return head + " has the wrong type: expected " + type_name(k.type);
      *static_cast<bool*>(field) = v->get();
      return "";
    }
    case Type::Int:
    case Type::Float: {
      double number;
      if (auto i = value.as_integer()) number = static_cast<double>(i->get());
      else if (auto f = value.as_floating_point(); f && k.type == Type::Float) number = f->get();
      else return head + " has the wrong type: expected " + type_name(k.type);
      // inf and nan fail every comparison but the one that must fail for them.
      const bool low = k.min_exclusive ? !(number > k.min) : !(number >= k.min);
      if (low || !(number <= k.max) || !std::isfinite(number))
        return head + " is out of range: it must be " + describe_range(k);
      if (k.type == Type::Int) *static_cast<int64_t*>(field) = value.as_integer()->get();
      else *static_cast<double*>(field) = number;
      return "";
    }
    case Type::String: {
      auto v = value.as_string();
      if (!v) return head + " has the wrong type: expected " + type_name(k.type);
      const std::string s = v->get();
      if (!k.choices.empty() && std::find(k.choices.begin(), k.choices.end(), s) == k.choices.end())
        return head + " is not accepted: it must be one of " + quoted_list(k.choices);
      if (std::find(k.not_yet.begin(), k.not_yet.end(), s) != k.not_yet.end())
        return head + " is not implemented yet";
      *static_cast<std::string*>(field) = s;
      return "";
    }
    case Type::Strings: {  // one string, or an array of them ("" = none)
      auto& out = *static_cast<std::vector<std::string>*>(field);
      out.clear();
      if (auto v = value.as_string()) {
        if (!k.choices.empty() && std::find(k.choices.begin(), k.choices.end(), v->get()) == k.choices.end())
          return head + " is not accepted: it must be one of " + quoted_list(k.choices) + " (or an array of them)";
        if (!v->get().empty()) out.push_back(v->get());
        return "";
      }
      const toml::array* items = value.as_array();
      if (!items) return head + " has the wrong type: expected " + type_name(k.type);
      for (size_t i = 0; i < items->size(); ++i) {
        auto item = items->get(i)->as_string();
        if (!item || item->get().empty())
          return head + fmt(": entry %zu is not a non-empty string", i);
        if (!k.choices.empty() && std::find(k.choices.begin(), k.choices.end(), item->get()) == k.choices.end())
          return head + fmt(": entry %zu (\"%s\") is not accepted: each must be one of ", i, item->get().c_str()) +
                 quoted_list(k.choices);
        out.push_back(item->get());
      }
      return "";
    }
    case Type::Floats: {  // an array of numbers within the key's range
      auto& out = *static_cast<std::vector<double>*>(field);
      out.clear();
      const toml::array* items = value.as_array();
      if (!items) return head + " has the wrong type: expected " + type_name(k.type);
      for (size_t i = 0; i < items->size(); ++i) {
        const toml::node* item = items->get(i);
        double number;
        if (auto n = item->as_integer()) number = static_cast<double>(n->get());
        else if (auto f = item->as_floating_point()) number = f->get();
        else return head + fmt(": entry %zu is not a number", i);
        if (!(number >= k.min) || !(number <= k.max) || !std::isfinite(number))
          return head + fmt(": entry %zu is out of range: it must be ", i) + describe_range(k);
        out.push_back(number);
      }
      return "";
    }
  }
  return "";
}

// Turn "section.key=value" into a TOML node placed in `root`.
std::string apply_override(toml::table& root, const std::string& text, Locator& where) {
  const std::string origin = "--set " + text;
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0)
    return origin + ": expected section.key=value (e.g. --set optim.lr=3e-4)";
  const std::string path = text.substr(0, eq), raw = text.substr(eq + 1);
  const auto dot = path.find('.');
  if (dot == std::string::npos || path.find('.', dot + 1) != std::string::npos)
    return origin + ": '" + path + "' is not of the form section.key";
  const std::string section = path.substr(0, dot), name = path.substr(dot + 1);

  const KeySpec* spec = find_key(path);
  toml::table parsed;
  bool parsed_ok = true;
  try {
    parsed = toml::parse("v = " + raw);
  } catch (const toml::parse_error&) {
    parsed_ok = false;
  }
  toml::node* value = parsed_ok ? parsed.get("v") : nullptr;
  toml::table holder;
  // Unquoted strings are taken as they are; so is any value of an unknown key,
  // whose error ("unknown key ... did you mean") says more than a parse error.
  if ((!spec && !value) || (spec && spec->type == Type::String && (!value || !value->is_string())) ||
      (spec && spec->type == Type::Strings && (!value || !(value->is_string() || value->is_array())))) {
    holder.insert_or_assign("v", raw);
    value = holder.get("v");
  }
  if (!value) {
    const std::string expect = spec ? std::string(" (") + path + " expects " + type_name(spec->type) + ")" : "";
    return origin + ": '" + raw + "' is not a valid TOML value" + expect;
  }
  toml::node* sec = root.get(section);
  if (!sec) sec = &root.insert_or_assign(section, toml::table{}).first->second;
  if (!sec->is_table()) return origin + ": '" + section + "' is not a table in the deck";
  sec->as_table()->insert_or_assign(name, *value);
  where.overridden[path] = origin;
  return "";
}

// "" when `path` means something with the rest of this deck (its optimizer, its
// checkpointing mode); else why not ("has no meaning for ..."). validate() refuses
// such keys when given, and the resolved deck writes them as comments, so that it
// parses back.
std::string meaningless_with_the_rest(const Config& c, const std::string& path) {
  const std::string& name = c.optim.name;
  if (name == "sgd" && (path == "optim.beta1" || path == "optim.beta2" || path == "optim.eps"))
    return "has no meaning for optim.name = \"sgd\" (use optim.momentum)";
  if (name != "sgd" && path == "optim.momentum")
    return fmt("is SGD's; it has no meaning for optim.name = \"%s\" (AdamW's is optim.beta1%s)", name.c_str(),
               name == "muon" ? ", Muon's optim.muon_momentum" : "");
  if (name != "muon" && (path == "optim.muon_momentum" || path == "optim.ns_steps" || path == "optim.adamw_lr" ||
                         path == "optim.adamw_weight_decay"))
    return fmt("has no meaning for optim.name = \"%s\" (it sets Muon; see docs/muon.md)", name.c_str());
  if (c.loss.type != "rl" && (path == "loss.objective" || path == "loss.normalize" || path == "loss.clip_low" ||
                              path == "loss.clip_high" || path == "loss.normalize_constant" || path == "loss.is_level" ||
                              path == "loss.is_cap" || path == "loss.is_mask" || path == "loss.entropy_coef" ||
                              path == "loss.epochs" || path == "loss.mini_batches" || path == "loss.ref_kl_coef" ||
                              path == "loss.ref_kl_estimator" || path == "loss.router_replay"))
    return "sets the RL policy loss; it needs loss.type = \"rl\"";
  if (c.loss.objective == "masked" && (path == "loss.clip_low" || path == "loss.clip_high"))
    return "bounds the ratio of loss.objective = \"clipped\", \"gspo\" or \"cispo\"; loss.objective is \"masked\" here";
  if (c.loss.objective != "masked" && (path == "loss.mask_high" || path == "loss.mask_low"))
    return fmt("is loss.objective = \"masked\"'s; with \"%s\" the ratio is bounded by loss.clip_low / loss.clip_high",
               c.loss.objective.c_str());
  if (c.loss.normalize != "constant" && path == "loss.normalize_constant")
    return fmt("is the divisor of loss.normalize = \"constant\"; loss.normalize is \"%s\" here",
               c.loss.normalize.c_str());
  if (c.loss.is_level == "none" && (path == "loss.is_cap" || path == "loss.is_mask"))
    return "bounds the importance weight of loss.is_level = \"token\" or \"sequence\"; loss.is_level is \"none\" here";
  if (c.loss.ref_kl_coef == 0 && path == "loss.ref_kl_estimator")
    return "estimates the KL term against the starting weights, which loss.ref_kl_coef = 0 turns off";
  if (path == "eval.prompts" && !c.eval.prompts.empty() && (c.loss.type != "rl" || c.rollout.prompts.empty()))
    return "is scored by an RL job's inference ranks (`shardlm generate DECK` beside the trainers): it needs "
           "loss.type = \"rl\" and rollout.prompts (to score an exported model, run `shardlm generate` and "
           "tools/score_generate.py)";
  if (c.eval.prompts.empty() && (path == "eval.samples" || path == "eval.max_new_tokens" || path == "eval.batch" ||
                                 path == "eval.correct_above"))
    return "sets the accuracy evaluation on eval.prompts, which is not set";
  if (c.env.program.empty() && (path == "env.timeout_s" || path == "rollout.max_turns"))
    return "bounds the episodes of an environment program, and env.program is not set";
  if (path == "model.selective_layers" && c.model.activation_checkpointing != "selective")
    return fmt("says how many layers keep their attention output under model.activation_checkpointing = "
               "\"selective\"; it is \"%s\" here", c.model.activation_checkpointing.c_str());
  return "";
}

// "" when `pattern` is an ECMAScript regex ({answer} taken as a literal), else why not.
std::string regex_error(std::string pattern) {
  for (size_t at; (at = pattern.find("{answer}")) != std::string::npos;) pattern.replace(at, 8, "x");
  try {
    std::regex re(pattern);
  } catch (const std::regex_error& e) {
    return e.what();
  }
  return "";
}

// validate()'s messages, each after the deck's name.
struct Errors {
  const std::string& deck;
  std::vector<std::string>& messages;
  void operator()(const std::string& message) const { messages.push_back(deck + ": " + message); }
};

// ckpt.resume: a checkpoint that exists, when it names one.
void check_resume(const Config& c, const Errors& err) {
  if (c.ckpt.resume != "latest" && c.ckpt.resume != "none" && !std::filesystem::is_regular_file(c.ckpt.resume))
    err("ckpt.resume = \"" + c.ckpt.resume + "\" is not a file: give \"latest\", \"none\" or the path of a "
        "checkpoint (<run.dir>/checkpoints/step_<N>.h5)");
}

// A micro-batch's tokens; without model.hf, the deck's sizes against each other,
// the positions, the activations and model.fp8's GEMMs (config.json's sizes are
// checked where it is read).
void check_model(const Config& c, const std::set<std::string>& given, const Errors& err) {
  const ModelConfig& a = c.model.arch;
  const auto tokens = checked_product({c.data.micro_batch, c.data.seq_len});
  if (!tokens || *tokens > kMaxTokensPerMicroBatch)
    err(fmt("data.micro_batch x data.seq_len = %lld x %lld tokens per micro-batch is more than %lld (positions are "
            "int32): lower data.micro_batch and raise data.global_batch's accumulation instead",
            (long long)c.data.micro_batch, (long long)c.data.seq_len, (long long)kMaxTokensPerMicroBatch));
  if (c.model.hf.empty()) {
    const char* missing = nullptr;
    std::string required;  // the sizes with no default: "vocab_size, hidden_size, ..."
    for (const ModelSizeField& f : model_size_fields()) {
      if (f.derived) continue;
      if (!missing && member_of<int64_t>(f, a) <= 0) missing = f.name;
      required += (required.empty() ? "" : ", ") + std::string(f.name);
    }
    const bool head_dim_given = given.count("model.head_dim") != 0;
    if (missing)
      err(fmt("model.%s is not set: without model.hf the deck must give the model's sizes (%s)", missing,
              required.c_str()));
    else if (check_model_sizes(a).rule == ModelSizeProblem::Rule::HeadsNotMultipleOfKvHeads)
      err(fmt("model.num_heads = %lld is not a multiple of model.num_kv_heads = %lld",
              (long long)a.num_heads, (long long)a.num_kv_heads));
    else if (!head_dim_given && a.hidden_size % a.num_heads != 0)
      err(fmt("model.hidden_size = %lld is not a multiple of model.num_heads = %lld; set model.head_dim",
              (long long)a.hidden_size, (long long)a.num_heads));
    else if (a.head_dim % 2 != 0)
      err(head_dim_given ? fmt("model.head_dim = %lld must be even (RoPE rotates pairs)", (long long)a.head_dim)
                         : fmt("model.hidden_size / model.num_heads = %lld (the head_dim) must be even (RoPE rotates "
                               "pairs); set model.head_dim", (long long)a.head_dim));
    else if (a.max_position_embeddings > 0 && c.data.seq_len > a.max_position_embeddings)
      err(fmt("data.seq_len = %lld is larger than model.max_position_embeddings = %lld",
              (long long)c.data.seq_len, (long long)a.max_position_embeddings));
    else if (std::string e = moe_config_error(a); !e.empty())
      err(e);
    else if (std::string e = moe_deck_error(c, a); !e.empty())
      err(e);
    else if (std::string e = hf_attention_error(a); !e.empty() && !c.run.export_dir.empty())
      err("run.export_dir is set, but " + e);
    else if (tokens && *tokens <= kMaxTokensPerMicroBatch)
      if (std::string e = model_scale_error(a, *tokens, c.loss.chunk_tokens); !e.empty()) err("model: " + e);
    if (c.model.fp8 != "none" && c.model.context_parallel > 0)
      if (std::string e = fp8_shape_error(a, c.data.seq_len / c.model.context_parallel); !e.empty()) err(e);
  }
}

// Where the batches come from: SFT token files or RL rollouts.
void check_data_source(const Config& c, const Errors& err) {
  if (c.loss.type == "sft" && c.data.path.empty())
    err("data.path is not set: SFT needs a token file (see docs/data.md)");
  if (c.loss.type == "rl" && c.data.rollout_dir.empty())
    err("loss.type = \"rl\" needs data.rollout_dir (where step_<N>.h5 rollout files appear; docs/rollouts.md)");
  if (c.loss.type == "rl" && !c.data.path.empty())
    err("data.path is for SFT token files; with loss.type = \"rl\" the batches come from data.rollout_dir");
}

// model.expert_parallel = P > 1: whatever does not run with it yet, before
// the model's own rules (expert_parallel_error); "" when none.
std::string expert_parallel_deck_error(const Config& c, const ModelConfig& arch) {
  const int64_t P = c.model.expert_parallel;
  if (P <= 1) return "";
  const std::string knob = fmt("model.expert_parallel = %lld", (long long)P);
  if (c.model.context_parallel > 1)
    return fmt("%s with model.context_parallel = %lld: the two do not combine yet (the experts' rows would be "
               "exchanged over a group that shares sequences); set one of them to 1",
               knob.c_str(), (long long)c.model.context_parallel);
  if (c.optim.name == "muon")
    return knob + " with optim.name = \"muon\": Muon's owner exchange is not built over the experts' units; use "
                  "adamw or sgd, or set model.expert_parallel = 1";
  if (c.broadcast.backend != "none")
    return fmt("%s with broadcast.backend = \"%s\": the inference ranks receive the model laid out whole; set "
               "model.expert_parallel = 1 for a run that broadcasts weights", knob.c_str(), c.broadcast.backend.c_str());
  // The world is checked in check_expert_parallel, where it is known.
  return expert_parallel_error(arch, int(P), P);
}

// model.expert_parallel against the number of training ranks.
void check_expert_parallel(const Config& c, int world, const Errors& err) {
  const int64_t P = c.model.expert_parallel;
  if (P > 1 && world > 0 && world != P)
    err(fmt("model.expert_parallel = %lld with %d training ranks: it must equal the number of training ranks "
            "(each rank holds num_experts / %lld whole experts; experts are not replicated over groups of ranks): "
            "run %lld ranks or set model.expert_parallel = %d",
            (long long)P, world, (long long)P, (long long)P, world));
}

// model.context_parallel: groups of ranks that share one sequence.
void check_context_parallel(const Config& c, int world, const Errors& err) {
  const int64_t cp = c.model.context_parallel;
  if (cp > 1) {
    if (world > 0 && world % cp != 0)
      err(fmt("model.context_parallel = %lld does not divide the %d training ranks: the ranks form groups of "
              "model.context_parallel that share one sequence; run a multiple of %lld ranks or change it",
              (long long)cp, world, (long long)cp));
    if (c.data.seq_len % (2 * cp) != 0)
      err(fmt("data.seq_len = %lld does not split into 2 x model.context_parallel = %lld equal chunks (each rank of "
              "a group keeps an early and a late chunk): make data.seq_len a multiple of %lld",
              (long long)c.data.seq_len, (long long)(2 * cp), (long long)(2 * cp)));
    if (c.device.backend != "cpu" && c.device.attention == "cudnn")
      err("device.attention = \"cudnn\" with model.context_parallel > 1: the ring attends block by block with "
          "shardlm's masked flash kernels, not cuDNN's; set device.attention = \"auto\" or \"flash\"");
  }
}

// model.fp8 and its weight cache.
void check_fp8(const Config& c, const Errors& err) {
  const int64_t cp = c.model.context_parallel;
  if (c.model.fp8 != "none" && cp > 1)
    err("model.fp8 with model.context_parallel > 1 is not built yet: the scales that run over tokens (an activation "
        "tensor's, or under \"rowwise\" the weight gradient's per column) would be each rank's share's, so the "
        "numbers would change with model.context_parallel (it needs the amaxes all-reduced over the group); set "
        "model.fp8 = \"none\" or model.context_parallel = 1");
  if (c.model.fp8_weight_cache && c.model.fp8 == "none")
    err("model.fp8_weight_cache = true keeps the FP8 codes of the weights, but model.fp8 = \"none\" makes none: set "
        "model.fp8 = \"tensorwise\" or \"rowwise\", or leave the cache off");
}

// data.global_batch against the training ranks (SFT).
void check_global_batch(const Config& c, int world, const Errors& err) {
  const int64_t cp = c.model.context_parallel;
  // One micro-batch on every data-parallel group (a group of context_parallel ranks reads the same rows).
  // (When the groups do not divide the ranks, that is the error to fix first.)
  const bool groups_fit = world > 0 && world % cp == 0;
  const int dp_world = groups_fit ? int(world / cp) : world;
  const auto rows_per_round = checked_product({c.data.micro_batch, dp_world});
  if (c.loss.type == "sft" && groups_fit && (!rows_per_round || c.data.global_batch % *rows_per_round != 0))
    err(fmt("data.global_batch = %lld must be a multiple of data.micro_batch x %s = %lld x %d = %s",
            (long long)c.data.global_batch, cp > 1 ? "data-parallel groups (ranks / model.context_parallel)"
                                                   : "training ranks",
            (long long)c.data.micro_batch, dp_world,
            rows_per_round ? std::to_string(*rows_per_round).c_str() : "more than 2^63"));
}

// sched: the warmup within the run, one end of the decay.
void check_schedule(const Config& c, const Errors& err) {
  if (c.sched.warmup > c.run.max_steps)
    err(fmt("sched.warmup = %lld is longer than run.max_steps = %lld", (long long)c.sched.warmup,
            (long long)c.run.max_steps));
  if (c.sched.min_lr > 0 && c.sched.min_lr_ratio > 0)
    err(fmt("sched.min_lr = %g and sched.min_lr_ratio = %g both set the end of the decay: give one (min_lr_ratio, "
            "a fraction of optim.lr, follows the peak in an lr sweep)", c.sched.min_lr, c.sched.min_lr_ratio));
  else if (c.sched.min_lr > c.optim.lr)
    err(fmt("sched.min_lr = %g is larger than optim.lr = %g (min_lr is absolute; sched.min_lr_ratio gives the floor "
            "as a fraction of optim.lr)", c.sched.min_lr, c.optim.lr));
}

// Keys given that mean nothing with the rest of the deck (another optimizer's,
// the RL loss's without RL, ...).
void check_meaningless_keys(const Config& c, const std::set<std::string>& given, const Errors& err) {
  for (const auto& k : key_table())
    if (given.count(k.path))
      if (std::string why = meaningless_with_the_rest(c, k.path); !why.empty()) err(k.path + " " + why);
}

// Where the optimizer runs: Muon on a GPU, the offload pipeline's keys.
void check_optimizer(const Config& c, const std::set<std::string>& given, const Errors& err) {
  if (c.optim.name == "muon" && c.device.backend == "cuda" && !c.model.optim_cpu_offload)
    err("optim.name = \"muon\" with device.backend = \"cuda\" needs model.optim_cpu_offload = true (the GPU-resident "
        "optimizer is AdamW/SGD; offloaded, Muon's momentum and exchange run on the host and its Newton–Schulz in bf16 "
        "on the GPU: docs/muon.md)");
  // Keys that tune the offload pipeline: meaningful with it, and for AdamW and SGD only.
  auto offload_pipeline_key = [&](bool set, const char* key, const char* what) {
    if (!set) return;
    if (!c.model.optim_cpu_offload) err(fmt("%s %s: it needs model.optim_cpu_offload = true", key, what));
    else if (c.optim.name == "muon")
      err(fmt("%s is for AdamW and SGD: Muon's offloaded step keeps all of its state on the host and updates it in "
              "one collective step (docs/muon.md)", key));
  };
  offload_pipeline_key(given.count("model.optim_gpu_state_gib") && c.model.optim_gpu_state_gib > 0,  // a cap
                       "model.optim_gpu_state_gib", "caps the optimizer state that model.optim_cpu_offload keeps on the GPU");
  offload_pipeline_key(c.model.optim_offload_speculate, "model.optim_offload_speculate",
                       "updates the offloaded units during the backward");
  if (c.model.optim_offload_grads == "device") {
    if (!c.model.optim_cpu_offload)
      err("model.optim_offload_grads = \"device\" sets where the offloaded optimizer's gradients wait: it needs "
          "model.optim_cpu_offload = true");
    else if (c.device.backend == "cpu")
      err("model.optim_offload_grads = \"device\" keeps gradients in GPU memory: it needs device.backend = \"cuda\"");
    else if (c.optim.name == "muon")
      err("model.optim_offload_grads = \"device\" is for AdamW and SGD: Muon's offloaded step reads every gradient "
          "on the host (docs/muon.md)");
  }
}

// model.selective_layers: no more than the deck's layers.
void check_selective_layers(const Config& c, const Errors& err) {
  const ModelConfig& a = c.model.arch;
  if (c.model.hf.empty() && a.num_layers > 0 && c.model.selective_layers > a.num_layers)
    err(fmt("model.selective_layers = %lld is more than model.num_layers = %lld", (long long)c.model.selective_layers,
            (long long)a.num_layers));
}

// Options for the GPU backend (CUDA, cuDNN, NCCL): refused on the CPU backend,
// and where the GPU kernels cannot honour another option.
void check_device(const Config& c, const Errors& err) {
  const int64_t cp = c.model.context_parallel;
  if (c.model.reduce_dtype == "bf16" && c.device.backend == "cpu")
    err("model.reduce_dtype = \"bf16\" needs device.backend = \"cuda\" (the CPU backend is the fp32 reference)");
  if (c.device.memory_limit_gib > 0 && c.device.backend == "cpu")
    err("device.memory_limit_gib caps GPU memory: it needs device.backend = \"cuda\" (or \"auto\" on a GPU machine)");
  if (c.device.attention == "cudnn" && c.device.backend == "cpu")
    err("device.attention = \"cudnn\" is cuDNN's GPU attention: it needs device.backend = \"cuda\" (or \"auto\" on "
        "a GPU machine)");
  if (c.device.attention == "cudnn" && c.run.deterministic)
    err("device.attention = \"cudnn\" with run.deterministic = true: cuDNN's attention backward is not bitwise "
        "reproducible on Hopper; use device.attention = \"auto\" or \"flash\" (shardlm's deterministic kernels)");
  if (c.model.fp8_attention) {  // cuDNN's FP8 graphs (cuda/fp8_attention.hpp): wherever cuDNN's attention runs
    if (c.device.backend == "cpu")
      err("model.fp8_attention = true runs cuDNN's FP8 attention on the GPU: it needs device.backend = \"cuda\" (or "
          "\"auto\" on a GPU machine); the CPU backend has no emulation of it");
    else if (c.device.attention == "flash")
      err("model.fp8_attention = true runs cuDNN's FP8 attention, but device.attention = \"flash\" keeps shardlm's "
          "bf16 kernels: set device.attention = \"auto\" or \"cudnn\", or leave model.fp8_attention off");
    else if (c.run.deterministic)
      err("model.fp8_attention = true with run.deterministic = true: cuDNN's attention backward is not bitwise "
          "reproducible on Hopper, so deterministic runs keep shardlm's bf16 kernels; leave model.fp8_attention off");
    else if (cp > 1)
      err("model.fp8_attention = true with model.context_parallel > 1: the ring attends block by block with "
          "shardlm's bf16 kernels; leave model.fp8_attention off");
  }
  if (c.comm.backend == "nccl" && c.device.backend == "cpu")
    err("comm.backend = \"nccl\" needs device.backend = \"cuda\" (NCCL moves device memory only; the CPU backend "
        "uses MPI)");
}

// RL: rollouts the trainer can wait for (data.max_async against
// broadcast.interval), and the reward's components.
void check_rl(const Config& c, const Errors& err) {
  if (c.loss.type == "rl" && c.broadcast.backend != "none" && c.data.max_async < c.broadcast.interval - 1)
    err(fmt("data.max_async = %lld is smaller than broadcast.interval - 1 = %lld: the trainer takes rollouts for "
            "step N sampled at policy step N - data.max_async or later, but new weights reach the inference ranks "
            "only every %lld steps, so step %lld would wait forever; set data.max_async >= %lld or broadcast.interval "
            "<= %lld", (long long)c.data.max_async, (long long)(c.broadcast.interval - 1),
            (long long)c.broadcast.interval, (long long)(c.data.max_async + 1), (long long)(c.broadcast.interval - 1),
            (long long)(c.data.max_async + 1)));
  const std::vector<std::string>& rewards = c.rollout.reward;
  const auto uses = [&](const char* kind) { return std::find(rewards.begin(), rewards.end(), kind) != rewards.end(); };
  if (rewards.empty())
    err("rollout.reward is empty: name at least one of \"exact\", \"numeric\", \"regex\", \"program\"");
  for (size_t i = 0; i < rewards.size(); ++i)
    if (std::find(rewards.begin(), rewards.begin() + long(i), rewards[i]) != rewards.begin() + long(i))
      err("rollout.reward names \"" + rewards[i] + "\" twice: each component at most once (its weight goes in "
          "rollout.reward_weights)");
  if (!c.rollout.reward_weights.empty() && c.rollout.reward_weights.size() != rewards.size())
    err(fmt("rollout.reward_weights has %zu entr%s but rollout.reward names %zu component%s: give one weight per "
            "component, in the same order", c.rollout.reward_weights.size(),
            c.rollout.reward_weights.size() == 1 ? "y" : "ies", rewards.size(), rewards.size() == 1 ? "" : "s"));
  else if (!c.rollout.reward_weights.empty() &&
           std::all_of(c.rollout.reward_weights.begin(), c.rollout.reward_weights.end(), [](double w) { return w == 0; }))
    err("rollout.reward_weights are all 0: the reward would be 0 for every completion");
  if (uses("regex")) {
    if (c.rollout.reward_regex.empty())
      err("rollout.reward = \"regex\" needs rollout.reward_regex (a pattern the completion must match; {answer} "
          "stands for the prompt's reference answer)");
    else if (std::string e = regex_error(c.rollout.reward_regex); !e.empty())
      err("rollout.reward_regex = \"" + c.rollout.reward_regex + "\" is not a regular expression: " + e);
  }
  if (c.loss.is_mask != 0 && c.loss.is_mask <= 1)
    err(fmt("loss.is_mask = %g: tokens (samples) whose importance ratio is outside [1 / is_mask, is_mask] carry no "
            "loss, so it must be > 1 (e.g. 2 or 8), or 0 to keep them all", c.loss.is_mask));
  if (c.loss.type == "rl" && c.rollout.n == 1)
    err(fmt("rollout.n = 1 with rollout.advantage = \"%s\": each prompt's group is one sample, its advantage "
            "(reward - group mean) is 0 and the step trains nothing; set rollout.n >= 2 (e.g. 4 or 8 samples per "
            "prompt)", c.rollout.advantage.c_str()));
  if (c.rollout.overlong_window > c.rollout.max_new_tokens)
    err(fmt("rollout.overlong_window = %lld is longer than rollout.max_new_tokens = %lld: the soft overlong penalty "
            "ramps over the last overlong_window tokens of the budget", (long long)c.rollout.overlong_window,
            (long long)c.rollout.max_new_tokens));
  if (c.rollout.overlong_window > 0 && c.rollout.truncated != "penalty")
    err(fmt("rollout.overlong_window = %lld is set but rollout.truncated = \"%s\": the window belongs to "
            "truncated = \"penalty\"", (long long)c.rollout.overlong_window, c.rollout.truncated.c_str()));
  if (c.rollout.kv_cache_memory > 0 && c.rollout.kv_cache_tokens > 0)
    err(fmt("rollout.kv_cache_memory = %g and rollout.kv_cache_tokens = %lld both size the KV pool: give one (a "
            "fraction of the device's memory, or the pool in positions)", c.rollout.kv_cache_memory,
            (long long)c.rollout.kv_cache_tokens));
  if (c.rollout.dynamic_sampling && c.rollout.n == 1)
    err("rollout.dynamic_sampling = true with rollout.n = 1: a group of one sample always has equal rewards, so "
        "every group would be dropped");
  if (uses("env") && c.env.program.empty())
    err("rollout.reward = \"env\" needs env.program (the environment program whose episodes end with a reward; "
        "docs/rl.md \"Environments\")");
  if (!c.env.program.empty() && c.loss.type != "rl")
    err("env.program is set but loss.type is not \"rl\": an environment talks to an RL job's inference ranks");
  if (uses("program") && c.rollout.reward_program.empty())
    err("rollout.reward = \"program\" needs rollout.reward_program (a command: completions as JSONL on its stdin, "
        "one reward per line on its stdout; docs/rl.md)");
}

// broadcast: where the weights go.
void check_broadcast(const Config& c, const Errors& err) {
  if (c.broadcast.backend == "filesystem" && c.broadcast.dir.empty())
    err("broadcast.backend = \"filesystem\" needs broadcast.dir (where step_<N>/ directories are written)");
}

// data: packing, and the mix of several token files.
void check_data_mix(const Config& c, const Errors& err) {
  if (!c.data.packing) err("data.packing = false is not implemented yet (rows are always packed)");
  if (!c.data.weights.empty() && c.data.weights.size() != c.data.path.size())
    err(fmt("data.weights has %zu entr%s but data.path lists %zu file%s: give one weight per file", c.data.weights.size(),
            c.data.weights.size() == 1 ? "y" : "ies", c.data.path.size(), c.data.path.size() == 1 ? "" : "s"));
  else if (!c.data.weights.empty() &&
           std::all_of(c.data.weights.begin(), c.data.weights.end(), [](double w) { return w == 0; }))
    err("data.weights are all 0: at least one file needs a positive weight");
}

// eval: a token file, and when its loss is computed.
void check_eval(const Config& c, const Errors& err) {
  if (c.eval.path.empty()) {  // a non-default eval key means an evaluation was wanted
    const bool when = c.eval.interval != 0 || !c.eval.at_end;  // eval.prompts' schedule as well
    const char* set = c.eval.rows != 0                        ? "eval.rows"
                      : when && c.eval.prompts.empty()        ? (c.eval.interval != 0 ? "eval.interval" : "eval.at_end")
                                                              : nullptr;
    if (set) err(fmt("%s is set but eval.path is not: give the token file to evaluate on (docs/data.md)%s", set,
                     c.eval.rows != 0 ? "" : ", or eval.prompts, a prompt file whose accuracy an RL job's inference "
                                             "ranks measure (docs/rl.md)"));
  }
  if (!c.eval.path.empty() && c.eval.interval == 0 && !c.eval.at_end)
    err("eval.path is set but the loss is never evaluated: set eval.interval > 0 or eval.at_end = true");
}

// run.dir: where the outputs go.
void check_run_dir(const Config& c, const Errors& err) {
  if (c.run.dir.empty()) err("run.dir is empty: give the directory where the run writes its outputs");
}

// [loss] defaults that follow other keys, resolved so that the echoed deck is
// concrete: the clip's bounds by objective (GSPO's sequence ratios are means of
// log-ratios, so its paper clips at 3e-4 / 4e-4; CISPO puts no lower bound on
// its weight), and normalize = "constant"'s divisor, the most loss tokens a
// step's rollouts (one update's part of them) can hold (Dr. GRPO divides by
// the generation budget).
void resolve_loss_defaults(Config& c, const std::set<std::string>& given) {
  LossSection& l = c.loss;
  if (!given.count("loss.clip_low")) l.clip_low = l.objective == "gspo" ? 3e-4 : l.objective == "cispo" ? 1.0 : 0.2;
  if (!given.count("loss.clip_high")) l.clip_high = l.objective == "gspo" ? 4e-4 : 0.28;
  // The divisor is each update's: with loss.mini_batches parts, a part's share of the budget.
  if (l.normalize == "constant" && !given.count("loss.normalize_constant"))
    l.normalize_constant = double(c.rollout.max_new_tokens) * double(c.rollout.prompts_per_step) *
                           double(c.rollout.n) / double(l.mini_batches);
}

// The cross-field rules, on the resolved values; `given` holds every key the
// deck or a --set gave (the rest are defaults or filled in from others). One
// concern after another; the messages come in this order.
void validate(const Config& c, int world, const std::set<std::string>& given, std::vector<std::string>& errors) {
  const Errors err{c.deck_path, errors};
  check_resume(c, err);
  check_model(c, given, err);
  check_data_source(c, err);
  check_context_parallel(c, world, err);
  check_expert_parallel(c, world, err);
  check_fp8(c, err);
  check_global_batch(c, world, err);
  check_schedule(c, err);
  check_meaningless_keys(c, given, err);
  check_optimizer(c, given, err);
  check_selective_layers(c, err);
  check_device(c, err);
  check_rl(c, err);
  check_broadcast(c, err);
  check_data_mix(c, err);
  check_eval(c, err);
  check_run_dir(c, err);
}

}  // namespace

std::string moe_deck_error(const Config& c, const ModelConfig& arch) {
  if (std::string e = expert_parallel_deck_error(c, arch); !e.empty()) return e;
  if (!arch.moe() && c.loss.router_replay)
    return fmt("loss.router_replay = true replays the experts a sampler's router chose, but arch %s has no experts "
               "(num_experts = 0): set loss.router_replay = false, or train a qwen3_moe / qwen2_moe model",
               arch.arch.c_str());
  if (!arch.moe()) return "";
  if (c.model.fp8 != "none")
    return fmt("model.fp8 = \"%s\" does not reach the experts of arch %s: set model.fp8 = \"none\"",
               c.model.fp8.c_str(), arch.arch.c_str());
  if (c.model.context_parallel > 1)
    return fmt("model.context_parallel = %lld: the load-balancing loss of arch %s counts a whole micro-batch's "
               "tokens on one rank; set model.context_parallel = 1", (long long)c.model.context_parallel,
               arch.arch.c_str());
  return "";
}

std::vector<std::string> known_keys() {
  std::vector<std::string> out;
  for (const auto& k : key_table()) out.push_back(k.path);
  return out;
}

DeckResult parse_deck_text(const std::string& text, const std::string& source_name,
                           const std::vector<std::string>& overrides, int world) {
  DeckResult result;
  Config& config = result.config;
  config.deck_path = source_name;
  auto& errors = result.errors;

  toml::table root;
  try {
    root = toml::parse(text, source_name);
  } catch (const toml::parse_error& e) {
    errors.push_back(fmt("%s:%u:%u: %s", source_name.c_str(), e.source().begin.line, e.source().begin.column,
                         std::string(e.description()).c_str()));
    return result;
  }

  Locator where{source_name, {}};
  for (const auto& text_override : overrides)
    if (auto e = apply_override(root, text_override, where); !e.empty()) errors.push_back(e);

  const std::vector<std::string> sections = section_names(), keys = known_keys();
  std::set<std::string> given;  // keys the deck or a --set gave
  for (auto&& [section_key, section_node] : root) {
    const std::string section(section_key.str());
    if (std::find(sections.begin(), sections.end(), section) == sections.end()) {
      std::string hint;
      size_t best = 3;
      for (const auto& s : sections)
        if (size_t d = edit_distance(section, s); d < best) best = d, hint = s;
      errors.push_back(with_hint(where.at(section, section_key.source()) + ": unknown section '" + section + "'", hint));
      continue;
    }
    const toml::table* table = section_node.as_table();
    if (!table) {
      errors.push_back(where.at(section, section_key.source()) + ": '" + section + "' must be a table ([" + section + "])");
      continue;
    }
    for (auto&& [name_key, value] : *table) {
      const std::string path = section + "." + std::string(name_key.str());
      const std::string loc = where.at(path, name_key.source());
      if (path == "model.fsdp_cpu_offload") {
        errors.push_back(loc + ": model.fsdp_cpu_offload was removed: shardlm never offloads parameters to the CPU. "
                               "Use model.optim_cpu_offload = true to keep the fp32 master weights, optimizer state and "
                               "gradient accumulation in host memory while the bf16 parameters stay on the GPU.");
        continue;
      }
      const KeySpec* spec = find_key(path);
      if (!spec) {
        errors.push_back(with_hint(loc + ": unknown key '" + path + "'", suggest(path, keys)));
        continue;
      }
      if (!spec->implemented) {
        errors.push_back(loc + ": " + path + " is not implemented yet");
        continue;
      }
      if (auto e = assign(config, *spec, value, loc); !e.empty()) errors.push_back(e);
      else given.insert(path);
    }
  }
  // Report in deck order (the TOML tree iterates keys alphabetically).
  auto line_of = [&](const std::string& e) -> long {
    if (e.rfind(source_name + ":", 0) != 0) return 0;  // --set errors first
    return std::strtol(e.c_str() + source_name.size() + 1, nullptr, 10);
  };
  std::stable_sort(errors.begin(), errors.end(),
                   [&](const std::string& a, const std::string& b) { return line_of(a) < line_of(b); });
  if (errors.empty()) {
    if (config.model.hf.empty() && config.model.arch.num_kv_heads == 0)
      config.model.arch.num_kv_heads = config.model.arch.num_heads;
    if (config.model.hf.empty() && config.model.arch.head_dim == 0 && config.model.arch.num_heads > 0)
      config.model.arch.head_dim = config.model.arch.hidden_size / config.model.arch.num_heads;
    if (config.model.hf.empty() && config.model.arch.max_position_embeddings == 0)
      config.model.arch.max_position_embeddings = config.data.seq_len;
    // Muon's AdamW group defaults to the matrices' lr and weight decay (the update
    // scale rule makes one setting fit both); resolved here so the echoed deck is concrete.
    if (config.optim.name == "muon" && config.optim.adamw_lr <= 0) config.optim.adamw_lr = config.optim.lr;
    if (config.optim.name == "muon" && config.optim.adamw_weight_decay < 0)
      config.optim.adamw_weight_decay = config.optim.weight_decay;
    resolve_loss_defaults(config, given);
    // The accuracy evaluation samples as the rollouts do unless told otherwise.
    if (!config.eval.prompts.empty() && config.eval.max_new_tokens == 0)
      config.eval.max_new_tokens = config.rollout.max_new_tokens;
    if (!config.eval.prompts.empty() && config.eval.batch == 0) config.eval.batch = config.rollout.batch;
    validate(config, world, given, errors);
  }
  return result;
}

DeckResult parse_deck(const std::string& deck_path, const std::vector<std::string>& overrides, int world) {
  std::string text;
  try {
    std::ifstream in(deck_path, std::ios::binary);
    if (!in) {
      DeckResult r;
      r.config.deck_path = deck_path;
      r.errors.push_back(deck_path + ": cannot open the deck (does the file exist and is it readable?)");
      return r;
    }
    std::ostringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  } catch (const std::exception& e) {
    DeckResult r;
    r.errors.push_back(deck_path + ": " + e.what());
    return r;
  }
  return parse_deck_text(text, deck_path, overrides, world);
}

std::string resolved_deck(const Config& config) {
  Config copy = config;  // key_table() hands out mutable references
  // Shortest text that reads back as the same double, always with a '.' or an
  // exponent so TOML keeps it a float.
  auto float_text = [](double v) {
    std::string out;
    for (int digits = 6; digits <= 17; ++digits) {
      out = fmt("%.*g", digits, v);
      if (std::strtod(out.c_str(), nullptr) == v) break;
    }
    if (out.find_first_of(".eEn") == std::string::npos) out += ".0";
    return out;
  };
  std::ostringstream out;
  out << "# resolved shardlm deck (from " << config.deck_path << "), every key with its value\n";
  std::string current;
  for (const auto& k : key_table()) {
    if (!k.implemented) continue;  // the echo must parse again as a deck
    const std::string s = k.path.substr(0, k.path.find('.')), name = k.path.substr(k.path.find('.') + 1);
    if (s != current) out << "\n[" << s << "]\n", current = s;
    const std::string unused = meaningless_with_the_rest(config, k.path);
    if (!unused.empty()) out << "# ";  // given, it would be refused: shown, not set
    out << name << " = ";
    void* field = k.ref(copy);
    switch (k.type) {
      case Type::Bool: out << (*static_cast<bool*>(field) ? "true" : "false"); break;
      case Type::Int: out << *static_cast<int64_t*>(field); break;
      case Type::Float: out << float_text(*static_cast<double*>(field)); break;
      case Type::String: out << toml::value<std::string>(*static_cast<std::string*>(field)); break;
      case Type::Strings: {
        const auto& items = *static_cast<std::vector<std::string>*>(field);
        if (items.size() == 1) {
          out << toml::value<std::string>(items[0]);
        } else if (items.empty()) {
          out << "\"\"";
        } else {
          out << "[";
          for (size_t i = 0; i < items.size(); ++i) out << (i ? ", " : "") << toml::value<std::string>(items[i]);
          out << "]";
        }
        break;
      }
      case Type::Floats: {
        const auto& items = *static_cast<std::vector<double>*>(field);
        out << "[";
        for (size_t i = 0; i < items.size(); ++i) out << (i ? ", " : "") << float_text(items[i]);
        out << "]";
        break;
      }
    }
    if (!unused.empty()) out << "  # " << k.path << " " << unused;
    out << "\n";
  }
  return out.str();
}

}  // namespace shardlm
