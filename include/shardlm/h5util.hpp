// h5util.hpp — small HDF5 helpers shared by the data reader and the checkpoint.
//
// Owns: H5_CHECK (every HDF5 call goes through it: call text, file:line and the
// innermost message of HDF5's error stack in one shardlm::Error), h5::Handle
// (RAII for hid_t), h5::silence_error_stack(), h5::dtype_name(),
// h5::check_declared_size() (a header's size checked before it is allocated). Knows nothing
// about MPI, datasets' meaning or shardlm types other than Error.
#pragma once

#include <hdf5.h>

#include <string>
#include <vector>
#include <utility>

#include "shardlm/error.hpp"

namespace shardlm::h5 {

// HDF5 prints its whole error stack to stderr on every failure by default; we
// turn that off and put the one useful line into our own message instead.
// Affects the default error stack of the calling thread (the whole process in
// a non-threadsafe build); call it once before the first HDF5 call.
inline void silence_error_stack() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

// The innermost (most specific) description on the current error stack, or "".
inline std::string error_stack_message() {
  std::string innermost;
  auto keep_first = [](unsigned n, const H5E_error2_t* err, void* out) -> herr_t {
    if (n == 0 && err->desc) *static_cast<std::string*>(out) = err->desc;
    return 0;
  };
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, keep_first, &innermost);
  return innermost;
}

// HDF5 calls report failure with a negative hid_t / herr_t / htri_t.
template <class T>
T check(T result, const char* call, const char* file, int line) {
  if (result < 0) {
    std::string detail = error_stack_message();
    H5Eclear2(H5E_DEFAULT);
    throw Error(fmt("HDF5 call %s failed at %s:%d%s%s", call, file, line,
                    detail.empty() ? "" : ": ", detail.c_str()));
  }
  return result;
}

// Owns one hid_t and closes it with the matching H5?close. Declare the file
// handle first so that objects inside it are closed before it.
class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle() = default;
  Handle(hid_t id, Closer close) : id_(id), close_(close) {}
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  Handle(Handle&& other) noexcept
      : id_(std::exchange(other.id_, H5I_INVALID_HID)), close_(other.close_) {}
  Handle& operator=(Handle&& other) noexcept {
    if (this != &other) {
      reset();
      id_ = std::exchange(other.id_, H5I_INVALID_HID);
      close_ = other.close_;
    }
    return *this;
  }
  ~Handle() { reset(); }

  hid_t get() const { return id_; }
  operator hid_t() const { return id_; }  // NOLINT: pass straight to H5 calls
  void reset() {
    // A close failing in a destructor has nowhere to go; the id is gone either way.
    if (id_ >= 0 && close_) close_(id_);
    id_ = H5I_INVALID_HID;
  }

 private:
  hid_t id_ = H5I_INVALID_HID;
  Closer close_ = nullptr;
};

// Opens dataset `name` of `file`, known to exist as a link; `what` names the file
// in the message when the link is something else ("data file 'x.h5'").
inline Handle open_dataset(hid_t file, const char* name, const std::string& what) {
  hid_t id = H5Dopen2(file, name, H5P_DEFAULT);
  if (id < 0) {
    H5Eclear2(H5E_DEFAULT);
    throw Error(fmt("%s: '%s' exists but is not a dataset", what.c_str(), name));
  }
  return Handle(id, H5Dclose);
}

// numpy-style name of an HDF5 datatype for messages: "int32", "uint8",
// "float64", "string", "compound", ...
inline std::string dtype_name(hid_t type) {
  const H5T_class_t cls = H5Tget_class(type);
  const size_t bits = H5Tget_size(type) * 8;
  switch (cls) {
    case H5T_INTEGER:
      return fmt("%sint%zu", H5Tget_sign(type) == H5T_SGN_NONE ? "u" : "", bits);
    case H5T_FLOAT: return fmt("float%zu", bits);
    case H5T_STRING: return "string";
    case H5T_BITFIELD: return fmt("bitfield%zu", bits);
    case H5T_OPAQUE: return "opaque";
    case H5T_COMPOUND: return "compound";
    case H5T_REFERENCE: return "reference";
    case H5T_ENUM: return "enum";
    case H5T_VLEN: return "vlen";
    case H5T_ARRAY: return "array";
    default: return "unknown";
  }
}

}  // namespace shardlm::h5

#define H5_CHECK(call) ::shardlm::h5::check((call), #call, __FILE__, __LINE__)

namespace shardlm::h5 {

// The text of an open string attribute of type `type` (the caller has checked
// its class): variable length (h5py's str) or fixed (null-padded or terminated),
// read in the attribute's own character set (HDF5 does not convert ASCII/UTF-8).
inline std::string read_string_attribute_value(hid_t attr, hid_t type) {
  Handle mem(H5_CHECK(H5Tcopy(H5T_C_S1)), H5Tclose);
  H5_CHECK(H5Tset_cset(mem, H5Tget_cset(type)));
  if (H5_CHECK(H5Tis_variable_str(type)) > 0) {
    H5_CHECK(H5Tset_size(mem, H5T_VARIABLE));
    char* text = nullptr;
    H5_CHECK(H5Aread(attr, mem, &text));
    std::string out = text ? text : "";
    H5free_memory(text);
    return out;
  }
  const size_t size = H5Tget_size(type);
  H5_CHECK(H5Tset_size(mem, size + 1));  // room for the terminator
  std::string out(size + 1, '\0');
  H5_CHECK(H5Aread(attr, mem, out.data()));
  out.resize(out.find('\0'));
  return out;
}

// A 1-D dataset `name` of v's values (file_type on disk, mem_type in memory).
template <class T>
void write_1d(hid_t file, const char* name, hid_t file_type, hid_t mem_type, const std::vector<T>& v) {
  const hsize_t n = v.size();
  Handle space(H5_CHECK(H5Screate_simple(1, &n, nullptr)), H5Sclose);
  Handle d(H5_CHECK(H5Dcreate2(file, name, file_type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)), H5Dclose);
  if (n > 0) H5_CHECK(H5Dwrite(d, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()));
}

// A scalar attribute for one value (when `scalar`), else a 1-D one.
template <class T>
void write_attr(hid_t file, const char* name, hid_t file_type, hid_t mem_type, const std::vector<T>& v,
                bool scalar = true) {
  const hsize_t n = v.size();
  Handle space(H5_CHECK(scalar && n == 1 ? H5Screate(H5S_SCALAR) : H5Screate_simple(1, &n, nullptr)), H5Sclose);
  Handle a(H5_CHECK(H5Acreate2(file, name, file_type, space, H5P_DEFAULT, H5P_DEFAULT)), H5Aclose);
  if (n > 0) H5_CHECK(H5Awrite(a, mem_type, v.data()));
}

// A file's header is data: a damaged or forged one may declare 2^40 elements
// in a file of 4 KB. Before a reader allocates for a dataset it asks this:
// `elements` of `elem_bytes` must fit in the `file_bytes` the file really has,
// or in 1032 times that when the dataset is filtered (chunked and compressed:
// 1032:1 is deflate's largest ratio). Refused with a message naming `what`
// (the file, "rollout file 'x.h5'") and the dataset.
constexpr int64_t kMaxFilterRatio = 1032;
inline void check_declared_size(hid_t dset, const char* name, int64_t elements, size_t elem_bytes,
                                int64_t file_bytes, const std::string& what) {
  Handle dcpl(H5_CHECK(H5Dget_create_plist(dset)), H5Pclose);
  const bool filtered = H5Pget_layout(dcpl) == H5D_CHUNKED && H5_CHECK(H5Pget_nfilters(dcpl)) > 0;
  const int64_t limit = file_bytes * (filtered ? kMaxFilterRatio : 1);
  if (elements < 0 || (elements > 0 && elements > limit / static_cast<int64_t>(elem_bytes)))
    throw Error(fmt("%s: dataset '%s' declares %lld elements (%.4g bytes) but the file has %lld bytes%s: a damaged "
                    "or forged header; nothing was read or allocated for it",
                    what.c_str(), name, static_cast<long long>(elements), double(elements) * double(elem_bytes),
                    static_cast<long long>(file_bytes), filtered ? " (compressed: at most 1032 times that)" : ""));
}

}  // namespace shardlm::h5
