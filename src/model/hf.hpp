// hf.hpp — Hugging Face model-directory I/O: config.json and safetensors.
//
// Owns: reading and writing config.json (read_hf_config / write_hf_config), the
// safetensors reader (ranged reads of any element range of any tensor, so a rank
// reads only its shard) and writer (atomic: FILE.tmp then rename); the scalar
// conversions it uses are shardlm/dtype.hpp's.
// Knows nothing about parameters, units, shards, devices or MPI: the model owns
// the tensor names and shapes; this file only moves named fp32 ranges.
//
// Host byte order is little-endian (as the safetensors format is); hf.cpp
// checks this at compile time.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "shardlm/dtype.hpp"
#include "shardlm/model_config.hpp"

namespace shardlm {

// ---- config.json -----------------------------------------------------------

// Reads DIR/config.json of a LlamaForCausalLM, Qwen2ForCausalLM or
// Qwen3ForCausalLM model, in transformers 4.x (rope_theta + rope_scaling) or 5.x
// (rope_parameters) form. Throws Error naming the file, key and value for
// anything shardlm cannot run exactly (other architectures, RoPE types other
// than default/llama3, MLP biases, activations other than silu, sliding-window
// attention, quantized weights, missing or non-positive sizes).
ModelConfig read_hf_config(const std::filesystem::path& dir);

// Writes DIR/config.json (DIR must exist) that transformers 4.x and 5.x and
// vLLM load: rope in the 4.x form (rope_theta + rope_scaling), which 5.x still
// reads. torch_dtype: "float32" | "bfloat16" | "float16". Throws Error for a
// ModelConfig that the named architecture cannot express (Qwen2 without q/k/v
// biases, Qwen3 without q/k norms, q/k norms on Llama or Qwen2). Written as
// config.json.tmp, then renamed.
void write_hf_config(const std::filesystem::path& dir, const ModelConfig& config,
                     const std::string& torch_dtype);

// ---- the files served beside the weights -----------------------------------

// What vLLM or transformers need beside config.json and the weights to serve a
// model: tokenizer.json, tokenizer_config.json, special_tokens_map.json,
// generation_config.json, chat_template.jinja, chat_template.json, and the slow
// tokenizers' tokenizer.model, vocab.json, merges.txt, added_tokens.json.
const std::vector<std::string>& tokenizer_file_names();
// Copies those that `src_dir` (the model.hf a run loaded; "" = none) holds into
// `dst_dir` (each as .tmp, then renamed) and returns one sentence for the log:
// which files came from where, or why there were none. Throws Error naming the
// file when a copy fails.
std::string copy_tokenizer_files(const std::filesystem::path& src_dir, const std::filesystem::path& dst_dir);

// ---- safetensors reading ---------------------------------------------------

struct TensorInfo {
  std::string dtype;               // safetensors name: "BF16" | "F16" | "F32" | others (not readable)
  std::vector<int64_t> shape;
  std::filesystem::path file;
  int64_t numel = 0;
  int64_t data_offset_bytes = 0;   // absolute byte offset of element 0 in `file`
};

// Opens every safetensors file of a model directory (those named by
// model.safetensors.index.json's weight_map when it exists, else all
// *.safetensors), parses and validates their headers, and keeps one file
// descriptor per file. Tensor data is read on demand with pread(), so reading is
// thread-safe and reads only the bytes asked for.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::filesystem::path& dir);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;
  SafetensorsReader(SafetensorsReader&& other) noexcept;
  SafetensorsReader& operator=(SafetensorsReader&& other) noexcept;

  bool has(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;   // throws if absent
  std::vector<std::string> names() const;                  // sorted

  // Reads elements [elem_begin, elem_begin + elem_count) of the row-major
  // flattened tensor into out (elem_count floats), converting BF16/F16 to fp32.
  // Throws for an out-of-range slice or a dtype other than BF16, F16, F32.
  void read_f32(const std::string& name, int64_t elem_begin, int64_t elem_count,
                float* out) const;

 private:
  struct OpenFile {
    std::filesystem::path path;
    int fd = -1;
    int64_t size_bytes = 0;
  };
  std::filesystem::path dir_;
  std::vector<OpenFile> files_;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, size_t> tensor_file_;              // name -> index into files_

  void close_all() noexcept;
};

// ---- safetensors writing ---------------------------------------------------

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;               // "F32" | "BF16" (fp32 data is rounded, RNE)
};

struct TensorToWrite {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;               // "F32" | "BF16"
  const float* data = nullptr;     // numel(shape) floats, row-major
};

// Streaming writer: the header (all names, shapes, dtypes) is fixed at
// construction and written to FILE.tmp; tensor data then arrives in any order
// and in any number of element ranges (one gathered unit at a time, say);
// finish() checks every element was written exactly as often as there are
// elements, flushes to disk and renames FILE.tmp to FILE. Destroying an
// unfinished writer removes FILE.tmp, so FILE is either absent/old or complete.
// Data is laid out largest dtype first, then by name, so every tensor is
// aligned to its element size; the header is padded with spaces to a multiple
// of 8 bytes and carries __metadata__ {"format": "pt"} plus `metadata`.
class SafetensorsWriter {
 public:
  // Shared writing (several processes, one file): one process constructs with
  // Open::Create; after that, the others construct with Open::Existing (same
  // tensors and metadata give the same layout), write their element ranges and
  // call close_part(); then the creator calls finish(/*check_complete=*/false).
  enum class Open { Create, Existing };
  SafetensorsWriter(const std::filesystem::path& file, const std::vector<TensorSpec>& tensors,
                    const std::map<std::string, std::string>& metadata = {}, Open open = Open::Create);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  void write(const std::string& name, int64_t elem_begin, int64_t elem_count, const float* data);
  void finish(bool check_complete = true);
  void close_part();  // a participant of shared writing: flush and close, leave FILE.tmp

 private:
  struct Slot {
    std::string dtype;
    int64_t numel = 0;
    int64_t data_offset_bytes = 0;  // absolute, in the file
    int64_t elems_written = 0;
  };
  std::filesystem::path file_;
  std::filesystem::path tmp_file_;
  int fd_ = -1;
  bool finished_ = false;
  bool participant_ = false;
  std::map<std::string, Slot> slots_;
};

// Writes all tensors at once through SafetensorsWriter (atomic, see above).
void write_safetensors(const std::filesystem::path& file, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace shardlm
