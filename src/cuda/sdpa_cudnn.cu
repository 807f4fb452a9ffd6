// sdpa_cudnn.cu — cuDNN's fused flash attention (graph API) for shardlm's
// causal, GQA, packed-document attention. See cuda/sdpa.hpp for the contract.
//
// The graphs are the operation patterns cuDNN's fused-attention engines recognise
// (cuDNN developer guide, "Scaled Dot Product Attention"), written against the
// backend API directly:
//   forward   S = (Q K^T) * scale; padding mask (row < len_q, col < len_kv);
//             causal mask (row >= col); M = rowmax S; E = exp(S - M); L = rowsum E;
//             lse = M + log L; O = (E / L) V
//   backward  softmax_sum = rowsum(dO * O); E = exp(mask(S) - lse);
//             dV = E^T dO; dS = E * (dO V^T - softmax_sum) * scale;
//             dK = dS^T Q; dQ = dS K (through an fp32 accumulator)
// with Q, K, V, O, their gradients and lse in the ragged (THD) layout: each
// document is one batch entry whose rows start at an element offset given per
// micro-batch, so the token-major (N, H, D) tensors are used in place. Grouped
// query heads are summed into dK and dV by a reduction over the head group.
//
// Plans are specialised on (batch entries, longest document); both are rounded up
// to powers of two (padding entries have length 0) so a run builds a handful of
// plans, each once.
#include "cuda/sdpa.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "cuda/ops.hpp"
#include "shardlm/error.hpp"

#if SHARDLM_CUDNN
#include <cudnn.h>
#include <dlfcn.h>
#endif

namespace shardlm::cuda {

namespace {
size_t align_up(size_t bytes) { return (bytes + 255) / 256 * 256; }
[[maybe_unused]] int64_t pow2_at_least(int64_t n, int64_t floor) {
  int64_t p = floor;
  while (p < n) p *= 2;
  return p;
}
}  // namespace

size_t CudnnSdpa::backward_buffer_bytes(int64_t max_tokens, int64_t H, int64_t KV, int64_t D) {
  const size_t n = static_cast<size_t>(max_tokens);
  const size_t full_head_grads = H != KV ? 2 * align_up(n * H * D * 2) : 0;
  return align_up(n * H * D * 4) + align_up(n * H * 4) + full_head_grads;
}

size_t CudnnSdpa::fp8_backward_workspace_bytes(int64_t max_tokens, int64_t H, int64_t D) {
  const size_t n = static_cast<size_t>(max_tokens);
  return 3 * align_up(n * H * D * 4) + align_up(n * H * 4) + kPlanWorkspaceBytes;
}

size_t CudnnSdpa::persistent_bytes(int64_t max_tokens) {
  const size_t n = static_cast<size_t>(max_tokens);
  return align_up(n * 4) + 3 * align_up((n + 1) * 4) + kPlanWorkspaceBytes;
}

#if !SHARDLM_CUDNN

bool cudnn_sdpa_available(std::string* why) {
  if (why) *why = "this build has no cuDNN (built with CUDNN=0 or without cuDNN's headers)";
  return false;
}
std::string cudnn_sdpa_version() { return ""; }
CudnnSdpa::CudnnSdpa(int64_t, int64_t, int64_t, int64_t, void*, cudaStream_t) {
  SHARDLM_FAIL("cuDNN attention requested, but this build has no cuDNN (rebuild with CUDNN=1 and CUDNN_HOME)");
}
CudnnSdpa::~CudnnSdpa() = default;
struct CudnnSdpa::Plan {};
void CudnnSdpa::set_documents(const int32_t*, int64_t) {}
bool CudnnSdpa::forward(__nv_bfloat16*, float*, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*) {
  return false;
}
bool CudnnSdpa::backward(__nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*, const __nv_bfloat16*,
                         const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
                         const __nv_bfloat16*, const float*, void*) {
  return false;
}
bool CudnnSdpa::forward_fp8(uint8_t*, float*, const uint8_t*, const uint8_t*, const uint8_t*, const Fp8Scales&) {
  return false;
}
bool CudnnSdpa::backward_fp8(uint8_t*, uint8_t*, uint8_t*, const uint8_t*, const uint8_t*, const uint8_t*,
                             const uint8_t*, const uint8_t*, const float*, const Fp8Scales&, void*) {
  return false;
}

#else  // SHARDLM_CUDNN

namespace {

// ------------------------------------------------------------ the library, at run time

// The entry points shardlm calls, resolved from libcudnn.so.9 when first needed.
struct Api {
  decltype(&cudnnGetVersion) GetVersion = nullptr;
  decltype(&cudnnCreate) Create = nullptr;
  decltype(&cudnnDestroy) Destroy = nullptr;
  decltype(&cudnnSetStream) SetStream = nullptr;
  decltype(&cudnnGetErrorString) GetErrorString = nullptr;
  decltype(&cudnnGetLastErrorString) GetLastErrorString = nullptr;
  decltype(&cudnnBackendCreateDescriptor) CreateDescriptor = nullptr;
  decltype(&cudnnBackendDestroyDescriptor) DestroyDescriptor = nullptr;
  decltype(&cudnnBackendSetAttribute) SetAttribute = nullptr;
  decltype(&cudnnBackendGetAttribute) GetAttribute = nullptr;
  decltype(&cudnnBackendFinalize) Finalize = nullptr;
  decltype(&cudnnBackendExecute) Execute = nullptr;
  bool ok = false;
  std::string why, version;
};

const Api& api() {
  static const Api loaded = [] {
    Api a;
    const char* env = std::getenv("SHARDLM_CUDNN_LIB");
    const std::string path = env && *env ? env : "libcudnn.so.9";
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* err = dlerror();
      a.why = fmt("cannot load %s (%s); put cuDNN 9's lib directory on LD_LIBRARY_PATH or set SHARDLM_CUDNN_LIB",
                  path.c_str(), err ? err : "not found");
      return a;
    }
    bool all = true;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn) all = false, a.why = fmt("%s has no symbol %s", path.c_str(), name);
    };
    sym(a.GetVersion, "cudnnGetVersion");
    sym(a.Create, "cudnnCreate");
    sym(a.Destroy, "cudnnDestroy");
    sym(a.SetStream, "cudnnSetStream");
    sym(a.GetErrorString, "cudnnGetErrorString");
    sym(a.GetLastErrorString, "cudnnGetLastErrorString");
    sym(a.CreateDescriptor, "cudnnBackendCreateDescriptor");
    sym(a.DestroyDescriptor, "cudnnBackendDestroyDescriptor");
    sym(a.SetAttribute, "cudnnBackendSetAttribute");
    sym(a.GetAttribute, "cudnnBackendGetAttribute");
    sym(a.Finalize, "cudnnBackendFinalize");
    sym(a.Execute, "cudnnBackendExecute");
    if (!all) return a;
    const size_t v = a.GetVersion();
    char where[4096] = "";
    if (dlinfo(lib, RTLD_DI_ORIGIN, where) != 0) where[0] = '\0';
    a.version = fmt("cuDNN %zu.%zu.%zu (%s/%s)", v / 10000, v / 100 % 100, v % 100, where,
                    path.find('/') == std::string::npos ? path.c_str() : path.substr(path.rfind('/') + 1).c_str());
    // From 9.6 the backward engines zero their own fp32 dq accumulator (older ones
    // needed the caller to), and the padded + causal THD patterns need no workarounds.
    if (v / 10000 != 9 || v < 90600) {
      a.why = fmt("%s is too old or of another major version: shardlm needs cuDNN 9.6 or newer", a.version.c_str());
      return a;
    }
    a.ok = true;
    return a;
  }();
  return loaded;
}

std::string status_text(cudnnStatus_t s) {
  char last[1024] = "";
  api().GetLastErrorString(last, sizeof last);
  return fmt("%s%s%s", api().GetErrorString(s), last[0] ? ": " : "", last);
}

#define CUDNN_CALL(call)                                                                        \
  do {                                                                                          \
    const cudnnStatus_t status_ = (call);                                                       \
    if (status_ != CUDNN_STATUS_SUCCESS)                                                        \
      SHARDLM_FAIL("cuDNN: %s failed at %s:%d: %s", #call, __FILE__, __LINE__, status_text(status_).c_str()); \
  } while (0)

// ------------------------------------------------------------ descriptors

// One backend descriptor, destroyed with its owner.
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type) { CUDNN_CALL(api().CreateDescriptor(type, &d_)); }
  ~Desc() {
    if (d_) api().DestroyDescriptor(d_);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }

  template <class T>
  Desc& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count, const T* values) {
    CUDNN_CALL(api().SetAttribute(d_, name, type, count, values));
    return *this;
  }
  Desc& set_desc(cudnnBackendAttributeName_t name, const Desc& other) {
    cudnnBackendDescriptor_t o = other.get();
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &o);
  }
  Desc& set_i64(cudnnBackendAttributeName_t name, int64_t v) { return set(name, CUDNN_TYPE_INT64, 1, &v); }
  Desc& set_type(cudnnBackendAttributeName_t name, cudnnDataType_t t) {
    return set(name, CUDNN_TYPE_DATA_TYPE, 1, &t);
  }
  void finalize() { CUDNN_CALL(api().Finalize(d_)); }
  // Finalize without throwing (an engine that does not support the graph).
  bool try_finalize() { return api().Finalize(d_) == CUDNN_STATUS_SUCCESS; }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

using Dims = std::array<int64_t, 4>;

// The tensors and operations of one graph, kept alive until its plan is made.
class GraphBuilder {
 public:
  explicit GraphBuilder(cudnnHandle_t handle) : handle_(handle) {}

  // A tensor of the graph. uid > 0 names a tensor the variant pack binds; virtual
  // tensors get internal uids.
  const Desc& tensor(int64_t uid, cudnnDataType_t type, Dims dim, Dims stride, bool is_virtual = false,
                     const Desc* ragged = nullptr, bool by_value = false) {
    auto& t = keep(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t id = uid > 0 ? uid : next_virtual_uid_++;
    const bool v = is_virtual, bv = by_value;
    t.set_type(CUDNN_ATTR_TENSOR_DATA_TYPE, type)
        .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dim.data())
        .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, stride.data())
        .set_i64(CUDNN_ATTR_TENSOR_UNIQUE_ID, id)
        .set_i64(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, 16)
        .set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &v);
    if (bv) t.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &bv);
    if (ragged) t.set_desc(CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, *ragged);
    t.finalize();
    return t;
  }
  const Desc& virt(cudnnDataType_t type, Dims dim, Dims stride) { return tensor(0, type, dim, stride, true); }
  const Desc& scalar(int64_t uid) { return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, nullptr, true); }

  // y = mode(x [, b [, t]]) elementwise, computed in `math`.
  void pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t math, const Desc& x, const Desc* b, const Desc* t,
                 const Desc& y, int64_t axis = -1) {
    auto& pw = keep(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode).set_type(CUDNN_ATTR_POINTWISE_MATH_PREC, math);
    if (axis >= 0) pw.set_i64(CUDNN_ATTR_POINTWISE_AXIS, axis);
    pw.finalize();
    auto& op = keep(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw).set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b);
    if (t) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, *t);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    const float one = 1.0f;
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one)
        .set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
    op.finalize();
    ops_.push_back(op.get());
  }
  // c = a @ b (batched over the leading dims, fp32 accumulate); the overrides are
  // per-batch-entry row/column/inner counts (the documents' lengths).
  void matmul(const Desc& a, const Desc& b, const Desc& c, const Desc* m_override, const Desc* n_override,
              const Desc* k_override) {
    auto& mm = keep(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    mm.set_type(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_DATA_FLOAT).finalize();
    auto& op = keep(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, mm);
    if (m_override) op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, *m_override);
    if (n_override) op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, *n_override);
    if (k_override) op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, *k_override);
    op.finalize();
    ops_.push_back(op.get());
  }
  void reduction(cudnnReduceTensorOp_t reduce, const Desc& x, const Desc& y) {
    auto& rd = keep(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    rd.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &reduce)
        .set_type(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_DATA_FLOAT)
        .finalize();
    auto& op = keep(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd)
        .set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x)
        .set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y)
        .finalize();
    ops_.push_back(op.get());
  }
  // y is x seen through other strides (a transpose of the last two dims).
  void reshape(const Desc& x, const Desc& y) {
    auto& op = keep(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x).set_desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y).finalize();
    ops_.push_back(op.get());
  }

  // The graph, then the first engine configuration the heuristics rank that
  // finalises into a plan needing at most max_workspace bytes. nullptr when none.
  std::unique_ptr<CudnnSdpa::Plan> plan(size_t max_workspace, std::string* note);

 private:
  Desc& keep(cudnnBackendDescriptorType_t type) {
    descs_.push_back(std::make_unique<Desc>(type));
    return *descs_.back();
  }
  cudnnHandle_t handle_;
  std::vector<std::unique_ptr<Desc>> descs_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_virtual_uid_ = 1000;
};

}  // namespace

struct CudnnSdpa::Plan {
  std::unique_ptr<Desc> plan;
  int64_t workspace = 0;
};

namespace {

std::unique_ptr<CudnnSdpa::Plan> GraphBuilder::plan(size_t max_workspace, std::string* note) {
  Desc graph(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops_.size()),
            ops_.data())
      .set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_);
  if (!graph.try_finalize()) {
    *note = "the operation graph was refused: " + status_text(CUDNN_STATUS_NOT_SUPPORTED);
    return nullptr;
  }
  Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  heur.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph)
      .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode)
      .finalize();
  int64_t count = 0;
  CUDNN_CALL(api().GetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                                nullptr));
  std::vector<std::unique_ptr<Desc>> configs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    configs.push_back(std::make_unique<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
    raw.push_back(configs.back()->get());
  }
  if (count > 0)
    CUDNN_CALL(api().GetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count,
                                  &count, raw.data()));
  std::string tried;
  for (int64_t i = 0; i < count; ++i) {
    auto plan = std::make_unique<CudnnSdpa::Plan>();
    plan->plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    cudnnBackendDescriptor_t cfg = raw[size_t(i)];
    plan->plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_)
        .set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfg);
    if (!plan->plan->try_finalize()) {
      tried += fmt(" config %lld: not supported;", (long long)i);
      continue;
    }
    int64_t n = 0;
    CUDNN_CALL(api().GetAttribute(plan->plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1,
                                  &n, &plan->workspace));
    if (static_cast<size_t>(plan->workspace) > max_workspace) {
      tried += fmt(" config %lld: needs %lld bytes of workspace;", (long long)i, (long long)plan->workspace);
      continue;
    }
    Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
    cudnnBackendDescriptor_t e = engine.get();
    int64_t engine_index = -1;
    if (api().GetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &e) ==
        CUDNN_STATUS_SUCCESS)
      api().GetAttribute(e, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &engine_index);
    *note = fmt("engine %lld (heuristics choice %lld of %lld), workspace %lld bytes", (long long)engine_index,
                (long long)i + 1, (long long)count, (long long)plan->workspace);
    return plan;
  }
  *note = fmt("no engine among %lld heuristics choices supports it:%s %s", (long long)count, tried.c_str(),
              status_text(CUDNN_STATUS_NOT_SUPPORTED).c_str());
  return nullptr;
}

// Variant-pack uids of the tensors bound to memory.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kSeqLenQ, kSeqLenKv, kOffQ, kOffKv, kOffStats, kScale, kNegInf,
  kDO, kDQ, kDK, kDV, kOne, kSoftmaxSum, kDQAccum, kDKFull, kDVFull,
  // FP8's per-tensor scales and amaxes (device scalars), CudnnSdpa::Fp8Scales' order
  kDescaleQ, kDescaleK, kDescaleV, kDescaleO, kDescaleDO, kDescaleS, kDescaleDP,
  kScaleS, kScaleO, kScaleDP, kScaleDQ, kScaleDK, kScaleDV,
  kAmaxS, kAmaxO, kAmaxDP, kAmaxDQ, kAmaxDK, kAmaxDV,
};

// The shape every graph of one bucket shares, and the tensors both graphs declare.
struct Shape {
  int64_t B, S, H, KV, D;
  // Ragged: documents of different lengths, each padded to S in the index space
  // only (rows start at per-entry offsets; a padding mask hides rows and columns
  // past a document's length). Not ragged: B documents of exactly S tokens, back
  // to back, which the engines run without masks or offsets.
  bool ragged;
  Dims q_dim() const { return {B, H, S, D}; }
  Dims q_stride() const { return {S * H * D, D, H * D, 1}; }  // token-major rows; batch via the ragged offsets
  Dims kv_dim() const { return {B, KV, S, D}; }
  Dims kv_stride() const { return {S * KV * D, D, KV * D, 1}; }
  Dims kvt_dim() const { return {B, KV, D, S}; }               // K^T (and V^T) as the matmuls read them
  Dims kvt_stride() const { return {S * KV * D, D, 1, KV * D}; }
  Dims stats_dim() const { return {B, H, S, 1}; }
  Dims stats_stride() const { return {S * H, 1, H, 1}; }       // lse (N, H)
  Dims score_dim() const { return {B, H, S, S}; }
  Dims score_stride() const { return {H * S * S, S * S, S, 1}; }
  Dims score_t_stride() const { return {H * S * S, S * S, 1, S}; }
  Dims row_dim() const { return {B, H, S, 1}; }
  Dims row_stride() const { return {H * S, S, 1, 1}; }
};

// What both graphs declare. seq_q .. off_stats are null when the shape is not ragged.
struct Common {
  const Desc *seq_q = nullptr, *seq_kv = nullptr, *off_q = nullptr, *off_kv = nullptr, *off_stats = nullptr;
  const Desc *scale = nullptr, *neg_inf = nullptr;
};

Common declare_common(GraphBuilder& g, const Shape& s) {
  Common c{};
  if (s.ragged) {
    const Dims one_per_batch{s.B, 1, 1, 1}, ones{1, 1, 1, 1}, offsets{s.B + 1, 1, 1, 1};
    c.seq_q = &g.tensor(kSeqLenQ, CUDNN_DATA_INT32, one_per_batch, ones);
    c.seq_kv = &g.tensor(kSeqLenKv, CUDNN_DATA_INT32, one_per_batch, ones);
    c.off_q = &g.tensor(kOffQ, CUDNN_DATA_INT32, offsets, ones);
    c.off_kv = &g.tensor(kOffKv, CUDNN_DATA_INT32, offsets, ones);
    c.off_stats = &g.tensor(kOffStats, CUDNN_DATA_INT32, offsets, ones);
  }
  c.scale = &g.scalar(kScale);
  c.neg_inf = &g.scalar(kNegInf);
  return c;
}

// The two masks: scores of padding rows and columns (past a document's length),
// and of the future (col > row), set to -inf. Separate functions because backward
// subtracts lse between them, and because the engines match each pattern with its
// own types (the padding mask's indices computed in int32, the causal mask's in
// fp32, as cuDNN's own frontend writes them: the form its engines are known to take).
const Desc& padding_mask(GraphBuilder& g, const Shape& s, const Common& c, const Desc& scores) {
  const Dims sd = s.score_dim(), ss = s.score_stride();
  const Desc& row = g.virt(CUDNN_DATA_INT32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, scores, nullptr, nullptr, row, 2);
  const Desc& col = g.virt(CUDNN_DATA_INT32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, scores, nullptr, nullptr, col, 3);
  const Desc& row_ok = g.virt(CUDNN_DATA_BOOLEAN, sd, ss);
  g.pointwise(CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, row, c.seq_q, nullptr, row_ok);
  const Desc& col_ok = g.virt(CUDNN_DATA_BOOLEAN, sd, ss);
  g.pointwise(CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, col, c.seq_kv, nullptr, col_ok);
  const Desc& keep = g.virt(CUDNN_DATA_BOOLEAN, sd, ss);
  g.pointwise(CUDNN_POINTWISE_LOGICAL_AND, CUDNN_DATA_BOOLEAN, row_ok, &col_ok, nullptr, keep);
  const Desc& masked = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, scores, c.neg_inf, &keep, masked);
  return masked;
}

const Desc& causal_mask(GraphBuilder& g, const Shape& s, const Common& c, const Desc& scores) {
  const Dims sd = s.score_dim(), ss = s.score_stride();
  const Desc& row = g.virt(CUDNN_DATA_INT32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, scores, nullptr, nullptr, row, 2);
  const Desc& col = g.virt(CUDNN_DATA_INT32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, scores, nullptr, nullptr, col, 3);
  const Desc& keep = g.virt(CUDNN_DATA_BOOLEAN, sd, ss);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, &col, nullptr, keep);
  const Desc& masked = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, scores, c.neg_inf, &keep, masked);
  return masked;
}

// S = (Q K^T) * scale, fp32: the first matmul of every graph.
const Desc& scaled_scores(GraphBuilder& g, const Shape& s, const Common& c, const Desc& q, const Desc& kt) {
  const Dims sd = s.score_dim(), ss = s.score_stride();
  const Desc& qk = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.matmul(q, kt, qk, c.seq_q, c.seq_kv, nullptr);
  const Desc& scaled = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, qk, c.scale, nullptr, scaled);
  return scaled;
}

// The forward's softmax of the masked scores: P (in p_type) = E / rowsum E with
// E = exp(S - rowmax S), keeping lse = rowmax + log(rowsum) for the backward.
const Desc& softmax(GraphBuilder& g, const Shape& s, const Desc& masked, const Desc& lse, cudnnDataType_t p_type) {
  const Dims sd = s.score_dim(), ss = s.score_stride(), rd = s.row_dim(), rs = s.row_stride();
  const Desc& row_max = g.virt(CUDNN_DATA_FLOAT, rd, rs);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, masked, row_max);
  const Desc& shifted = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, masked, &row_max, nullptr, shifted);
  const Desc& e = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, shifted, nullptr, nullptr, e);
  const Desc& row_sum = g.virt(CUDNN_DATA_FLOAT, rd, rs);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, row_sum);
  const Desc& log_sum = g.virt(CUDNN_DATA_FLOAT, rd, rs);
  g.pointwise(CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, row_sum, nullptr, nullptr, log_sum);
  g.pointwise(CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, row_max, &log_sum, nullptr, lse);
  const Desc& p = g.virt(p_type, sd, ss);
  g.pointwise(CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT, e, &row_sum, nullptr, p);
  return p;
}

void build_forward(GraphBuilder& g, const Shape& s) {
  const Common c = declare_common(g, s);
  const Desc& q = g.tensor(kQ, CUDNN_DATA_BFLOAT16, s.q_dim(), s.q_stride(), false, c.off_q);
  const Desc& kt = g.tensor(kK, CUDNN_DATA_BFLOAT16, s.kvt_dim(), s.kvt_stride(), false, c.off_kv);
  const Desc& v = g.tensor(kV, CUDNN_DATA_BFLOAT16, s.kv_dim(), s.kv_stride(), false, c.off_kv);
  const Desc& o = g.tensor(kO, CUDNN_DATA_BFLOAT16, s.q_dim(), s.q_stride(), false, c.off_q);
  const Desc& lse = g.tensor(kStats, CUDNN_DATA_FLOAT, s.stats_dim(), s.stats_stride(), false, c.off_stats);

  const Desc& scaled = scaled_scores(g, s, c, q, kt);
  const Desc& masked = causal_mask(g, s, c, s.ragged ? padding_mask(g, s, c, scaled) : scaled);
  const Desc& p = softmax(g, s, masked, lse, CUDNN_DATA_BFLOAT16);  // P in the inputs' type for the second matmul
  g.matmul(p, v, o, c.seq_q, nullptr, c.seq_kv);
}

void build_backward(GraphBuilder& g, const Shape& s) {
  const Common c = declare_common(g, s);
  const Desc& q = g.tensor(kQ, CUDNN_DATA_BFLOAT16, s.q_dim(), s.q_stride(), false, c.off_q);
  const Desc& kt = g.tensor(kK, CUDNN_DATA_BFLOAT16, s.kvt_dim(), s.kvt_stride(), false, c.off_kv);
  const Desc& vt = g.tensor(kV, CUDNN_DATA_BFLOAT16, s.kvt_dim(), s.kvt_stride(), false, c.off_kv);
  const Desc& o = g.tensor(kO, CUDNN_DATA_BFLOAT16, s.q_dim(), s.q_stride(), false, c.off_q);
  const Desc& lse = g.tensor(kStats, CUDNN_DATA_FLOAT, s.stats_dim(), s.stats_stride(), false, c.off_stats);
  const Desc& dout = g.tensor(kDO, CUDNN_DATA_BFLOAT16, s.q_dim(), s.q_stride(), false, c.off_q);
  const Desc& dq = g.tensor(kDQ, CUDNN_DATA_BFLOAT16, s.q_dim(), s.q_stride(), false, c.off_q);
  const Desc& dk = g.tensor(kDK, CUDNN_DATA_BFLOAT16, s.kv_dim(), s.kv_stride(), false, c.off_kv);
  const Desc& dv = g.tensor(kDV, CUDNN_DATA_BFLOAT16, s.kv_dim(), s.kv_stride(), false, c.off_kv);
  const Desc& one = g.scalar(kOne);
  // Workspace tensors in the ragged layout (sized by the micro-batch's tokens).
  const Desc& softmax_sum =
      g.tensor(kSoftmaxSum, CUDNN_DATA_FLOAT, s.stats_dim(), s.stats_stride(), false, c.off_stats);
  const Desc& dq_accum = g.tensor(kDQAccum, CUDNN_DATA_FLOAT, s.q_dim(), s.q_stride(), false, c.off_q);
  const Dims sd = s.score_dim(), ss = s.score_stride(), rd = s.row_dim(), rs = s.row_stride();
  const bool grouped = s.H != s.KV;

  // softmax_sum = rowsum(dO * O)
  const Desc& do_o = g.virt(CUDNN_DATA_FLOAT, s.q_dim(), {s.H * s.S * s.D, s.S * s.D, s.H * s.D, 1});
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, dout, &o, nullptr, do_o);
  const Desc& row_dot = g.virt(CUDNN_DATA_FLOAT, rd, rs);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, do_o, row_dot);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, row_dot, &one, nullptr, softmax_sum);

  // E = exp(mask(S * scale) - lse); dV = E^T dO
  const Desc& scaled = scaled_scores(g, s, c, q, kt);
  const Desc& padded = s.ragged ? padding_mask(g, s, c, scaled) : scaled;
  const Desc& shifted = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, padded, &lse, nullptr, shifted);
  const Desc& masked = causal_mask(g, s, c, shifted);
  const Desc& e = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, masked, nullptr, nullptr, e);
  const Desc& e_t = g.virt(CUDNN_DATA_BFLOAT16, sd, s.score_t_stride());
  g.reshape(e, e_t);
  // GQA: dK and dV per query head, then summed over each kv head's group. They are
  // buffers of ours in the token-major layout (sized by the tokens, not by
  // documents x longest), addressed through the kv offsets, which the engines scale
  // by the group size themselves.
  const Desc* dk_full = nullptr;
  const Desc* dv_full = nullptr;
  if (grouped) {
    dk_full = &g.tensor(kDKFull, CUDNN_DATA_BFLOAT16, s.q_dim(), s.q_stride(), false, c.off_kv);
    dv_full = &g.tensor(kDVFull, CUDNN_DATA_BFLOAT16, s.q_dim(), s.q_stride(), false, c.off_kv);
    g.matmul(e_t, dout, *dv_full, c.seq_kv, nullptr, c.seq_q);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, *dv_full, dv);
  } else {
    g.matmul(e_t, dout, dv, c.seq_kv, nullptr, c.seq_q);
  }

  // dS = E * (dO V^T - softmax_sum) * scale; dK = dS^T Q; dQ = dS K
  const Desc& dp = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.matmul(dout, vt, dp, c.seq_q, c.seq_kv, nullptr);
  const Desc& dp_centered = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, dp, &softmax_sum, nullptr, dp_centered);
  const Desc& ds_unscaled = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, dp_centered, &e, nullptr, ds_unscaled);
  const Desc& ds = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, ds_unscaled, c.scale, nullptr, ds);
  const Desc& ds_t = g.virt(CUDNN_DATA_BFLOAT16, sd, s.score_t_stride());
  g.reshape(ds, ds_t);
  if (grouped) {
    g.matmul(ds_t, q, *dk_full, c.seq_kv, nullptr, c.seq_q);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, *dk_full, dk);
  } else {
    g.matmul(ds_t, q, dk, c.seq_kv, nullptr, c.seq_q);
  }
  const Desc& k_rows = g.tensor(0, CUDNN_DATA_BFLOAT16, s.kv_dim(), s.kv_stride(), true, c.off_kv);
  g.reshape(kt, k_rows);
  g.matmul(ds, k_rows, dq_accum, c.seq_q, nullptr, c.seq_kv);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, dq_accum, nullptr, nullptr, dq);
}

// ------------------------------------------------------------ FP8 graphs
//
// The patterns cuDNN's FP8 fused-attention engines take (the order of cuDNN's
// own frontend, cudnn-frontend's sdpa_fp8 and sdpa_fp8_backward nodes): every
// matmul of e4m3 operands accumulates in fp32 and is followed by the
// descales of its two operands; a result stored in FP8 has its amax taken
// before its scale is applied.

// A per-tensor fp32 scalar in device memory (a scale, a descale or an amax out).
const Desc& device_scalar(GraphBuilder& g, int64_t uid) {
  return g.tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1});
}

// y = x * a * b, in fp32 (a matmul's two descales).
const Desc& descaled(GraphBuilder& g, const Desc& x, const Desc& a, const Desc& b, const Dims& dim, const Dims& stride) {
  const Desc& xa = g.virt(CUDNN_DATA_FLOAT, dim, stride);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, x, &a, nullptr, xa);
  const Desc& xab = g.virt(CUDNN_DATA_FLOAT, dim, stride);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, xa, &b, nullptr, xab);
  return xab;
}

// out = x * scale (FP8), amax = max |x| (before the scale).
void scaled_out(GraphBuilder& g, const Desc& x, const Desc& scale, const Desc& out, const Desc& amax) {
  g.reduction(CUDNN_REDUCE_TENSOR_AMAX, x, amax);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, x, &scale, nullptr, out);
}

Dims contiguous(const Dims& d) { return {d[1] * d[2] * d[3], d[2] * d[3], d[3], 1}; }

void build_forward_fp8(GraphBuilder& g, const Shape& s) {
  const cudnnDataType_t f8 = CUDNN_DATA_FP8_E4M3;
  const Common c = declare_common(g, s);
  const Desc& q = g.tensor(kQ, f8, s.q_dim(), s.q_stride(), false, c.off_q);
  const Desc& kt = g.tensor(kK, f8, s.kvt_dim(), s.kvt_stride(), false, c.off_kv);
  const Desc& v = g.tensor(kV, f8, s.kv_dim(), s.kv_stride(), false, c.off_kv);
  const Desc& o = g.tensor(kO, f8, s.q_dim(), s.q_stride(), false, c.off_q);
  const Desc& lse = g.tensor(kStats, CUDNN_DATA_FLOAT, s.stats_dim(), s.stats_stride(), false, c.off_stats);
  const Desc &descale_q = device_scalar(g, kDescaleQ), &descale_k = device_scalar(g, kDescaleK),
             &descale_v = device_scalar(g, kDescaleV), &descale_s = device_scalar(g, kDescaleS),
             &scale_s = device_scalar(g, kScaleS), &scale_o = device_scalar(g, kScaleO),
             &amax_s = device_scalar(g, kAmaxS), &amax_o = device_scalar(g, kAmaxO);
  const Dims sd = s.score_dim(), ss = s.score_stride();

  const Desc& scaled = scaled_scores(g, s, c, q, kt);
  const Desc& scores = descaled(g, scaled, descale_q, descale_k, sd, ss);
  const Desc& masked = causal_mask(g, s, c, s.ragged ? padding_mask(g, s, c, scores) : scores);
  const Desc& p = softmax(g, s, masked, lse, CUDNN_DATA_FLOAT);  // coded below, its amax taken first
  const Desc& p8 = g.virt(f8, sd, ss);
  scaled_out(g, p, scale_s, p8, amax_s);
  const Desc& pv = g.virt(CUDNN_DATA_FLOAT, s.q_dim(), contiguous(s.q_dim()));
  g.matmul(p8, v, pv, c.seq_q, nullptr, c.seq_kv);
  scaled_out(g, descaled(g, pv, descale_s, descale_v, s.q_dim(), contiguous(s.q_dim())), scale_o, o, amax_o);
}

void build_backward_fp8(GraphBuilder& g, const Shape& s) {
  const cudnnDataType_t f8 = CUDNN_DATA_FP8_E4M3;
  const Common c = declare_common(g, s);
  const Desc& q = g.tensor(kQ, f8, s.q_dim(), s.q_stride(), false, c.off_q);
  const Desc& kt = g.tensor(kK, f8, s.kvt_dim(), s.kvt_stride(), false, c.off_kv);
  const Desc& vt = g.tensor(kV, f8, s.kvt_dim(), s.kvt_stride(), false, c.off_kv);
  const Desc& o = g.tensor(kO, f8, s.q_dim(), s.q_stride(), false, c.off_q);
  const Desc& lse = g.tensor(kStats, CUDNN_DATA_FLOAT, s.stats_dim(), s.stats_stride(), false, c.off_stats);
  const Desc& dout = g.tensor(kDO, f8, s.q_dim(), s.q_stride(), false, c.off_q);
  const Desc& dq = g.tensor(kDQ, f8, s.q_dim(), s.q_stride(), false, c.off_q);
  const Desc& dk = g.tensor(kDK, f8, s.kv_dim(), s.kv_stride(), false, c.off_kv);
  const Desc& dv = g.tensor(kDV, f8, s.kv_dim(), s.kv_stride(), false, c.off_kv);
  const Desc &descale_q = device_scalar(g, kDescaleQ), &descale_k = device_scalar(g, kDescaleK),
             &descale_v = device_scalar(g, kDescaleV), &descale_o = device_scalar(g, kDescaleO),
             &descale_do = device_scalar(g, kDescaleDO), &descale_s = device_scalar(g, kDescaleS),
             &descale_dp = device_scalar(g, kDescaleDP), &scale_s = device_scalar(g, kScaleS),
             &scale_dp = device_scalar(g, kScaleDP), &scale_dq = device_scalar(g, kScaleDQ),
             &scale_dk = device_scalar(g, kScaleDK), &scale_dv = device_scalar(g, kScaleDV),
             &amax_dp = device_scalar(g, kAmaxDP), &amax_dq = device_scalar(g, kAmaxDQ),
             &amax_dk = device_scalar(g, kAmaxDK), &amax_dv = device_scalar(g, kAmaxDV);
  const Dims sd = s.score_dim(), ss = s.score_stride(), rd = s.row_dim(), rs = s.row_stride();
  const Dims full = s.q_dim(), full_stride = contiguous(s.q_dim());  // per query head
  const Dims kv = s.kv_dim(), kv_stride = contiguous(s.kv_dim());
  const bool grouped = s.H != s.KV;

  // softmax_sum = rowsum(dO * O), descaled
  const Desc& do_o = g.virt(CUDNN_DATA_FLOAT, full, full_stride);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, dout, &o, nullptr, do_o);
  const Desc& row_dot = g.virt(CUDNN_DATA_FLOAT, rd, rs);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, do_o, row_dot);
  const Desc& softmax_sum = descaled(g, row_dot, descale_do, descale_o, rd, rs);

  // E = exp(mask(S * scale * descales) - lse); P = E coded with scale_s
  const Desc& scaled = scaled_scores(g, s, c, q, kt);
  const Desc& scores = descaled(g, scaled, descale_q, descale_k, sd, ss);
  const Desc& masked = causal_mask(g, s, c, s.ragged ? padding_mask(g, s, c, scores) : scores);
  const Desc& shifted = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, masked, &lse, nullptr, shifted);
  const Desc& e = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, shifted, nullptr, nullptr, e);
  const Desc& p8 = g.virt(f8, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, e, &scale_s, nullptr, p8);
  const Desc& p8_t = g.virt(f8, sd, s.score_t_stride());
  g.reshape(p8, p8_t);

  // An FP8 matmul's result per query head, summed over each kv head's group when
  // grouped, then descaled, its amax taken and coded into out.
  auto fp8_result = [&](const Desc& a, const Desc& b, const Desc& descale_a, const Desc& descale_b, const Desc& scale,
                        const Desc& out, const Desc& amax, bool reduce_groups, const Desc* m, const Desc* k) {
    const Desc& prod = g.virt(CUDNN_DATA_FLOAT, full, full_stride);
    g.matmul(a, b, prod, m, nullptr, k);
    const Desc* x = &prod;
    if (reduce_groups) {
      const Desc& summed = g.virt(CUDNN_DATA_FLOAT, kv, kv_stride);
      g.reduction(CUDNN_REDUCE_TENSOR_ADD, prod, summed);
      x = &summed;
    }
    const Dims& d = reduce_groups ? kv : full;
    scaled_out(g, descaled(g, *x, descale_a, descale_b, d, contiguous(d)), scale, out, amax);
  };
  // dV = P^T dO
  fp8_result(p8_t, dout, descale_s, descale_do, scale_dv, dv, amax_dv, grouped, c.seq_kv, c.seq_q);

  // dP = (dO V^T descaled - softmax_sum) * E * scale, coded with scale_dp
  const Desc& dov = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.matmul(dout, vt, dov, c.seq_q, c.seq_kv, nullptr);
  const Desc& dp_raw = descaled(g, dov, descale_do, descale_v, sd, ss);
  const Desc& dp_centered = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, dp_raw, &softmax_sum, nullptr, dp_centered);
  const Desc& ds_unscaled = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, dp_centered, &e, nullptr, ds_unscaled);
  const Desc& ds = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, ds_unscaled, c.scale, nullptr, ds);
  const Desc& ds8 = g.virt(f8, sd, ss);
  scaled_out(g, ds, scale_dp, ds8, amax_dp);

  // dQ = dS K; dK = dS^T Q
  const Desc& k_rows = g.tensor(0, f8, s.kv_dim(), s.kv_stride(), true, c.off_kv);
  g.reshape(kt, k_rows);
  fp8_result(ds8, k_rows, descale_dp, descale_k, scale_dq, dq, amax_dq, false, c.seq_q, c.seq_kv);
  const Desc& ds8_t = g.virt(f8, sd, s.score_t_stride());
  g.reshape(ds8, ds8_t);
  fp8_result(ds8_t, q, descale_dp, descale_q, scale_dk, dk, amax_dk, grouped, c.seq_kv, c.seq_q);
}

void execute(cudnnHandle_t handle, const CudnnSdpa::Plan& plan, const std::vector<int64_t>& uids,
             const std::vector<void*>& ptrs, void* workspace) {
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<int64_t>(uids.size()), uids.data())
      .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<int64_t>(ptrs.size()), ptrs.data())
      .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace)
      .finalize();
  CUDNN_CALL(api().Execute(handle, plan.plan->get(), pack.get()));
}

}  // namespace

bool cudnn_sdpa_available(std::string* why) {
  const Api& a = api();
  if (!a.ok) {
    if (why) *why = a.why;
    return false;
  }
  int dev = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = "no CUDA device";
    return false;
  }
  if (prop.major < 9) {
    if (why) *why = fmt("%s is sm_%d%d; shardlm uses cuDNN's attention on sm_90 and newer", prop.name, prop.major,
                        prop.minor);
    return false;
  }
  return true;
}

std::string cudnn_sdpa_version() { return api().ok ? api().version : ""; }

CudnnSdpa::CudnnSdpa(int64_t max_tokens, int64_t H, int64_t KV, int64_t D, void* persistent, cudaStream_t stream)
    : max_tokens_(max_tokens), H_(H), KV_(KV), D_(D), stream_(stream) {
  std::string why;
  SHARDLM_CHECK(cudnn_sdpa_available(&why), "cuDNN attention is not available: %s", why.c_str());
  SHARDLM_CHECK(H % KV == 0, "internal: %lld query heads over %lld kv heads", (long long)H, (long long)KV);
  cudnnHandle_t h = nullptr;
  CUDNN_CALL(api().Create(&h));
  handle_ = h;
  CUDNN_CALL(api().SetStream(h, stream));
  const size_t n = static_cast<size_t>(max_tokens);
  char* p = static_cast<char*>(persistent);
  auto take = [&](size_t bytes) {
    char* at = p;
    p += align_up(bytes);
    return at;
  };
  seq_len_ = reinterpret_cast<int32_t*>(take(n * 4));
  off_q_ = reinterpret_cast<int32_t*>(take((n + 1) * 4));
  off_kv_ = reinterpret_cast<int32_t*>(take((n + 1) * 4));
  off_stats_ = reinterpret_cast<int32_t*>(take((n + 1) * 4));
  plan_workspace_ = take(kPlanWorkspaceBytes);
}

CudnnSdpa::~CudnnSdpa() {
  buckets_.clear();  // plans before the handle they were made with
  if (handle_) api().Destroy(static_cast<cudnnHandle_t>(handle_));
}

void CudnnSdpa::set_documents(const int32_t* seq_id, int64_t N) {
  SHARDLM_CHECK(N >= 1 && N <= max_tokens_, "internal: a micro-batch of %lld tokens (planned %lld)", (long long)N,
                (long long)max_tokens_);
  std::vector<int32_t> lens;  // runs of equal seq_id
  int64_t longest = 0;
  for (int64_t i = 0; i < N;) {
    int64_t j = i + 1;
    while (j < N && seq_id[j] == seq_id[i]) ++j;
    lens.push_back(static_cast<int32_t>(j - i));
    longest = std::max(longest, j - i);
    i = j;
  }
  docs_ = static_cast<int64_t>(lens.size());
  // Documents of one length run as a plain batch (no masks, no offsets: the
  // engines' fastest form); others as a ragged batch with the count and the
  // longest rounded up to powers of two, so few plans serve a run (empty
  // padding entries, at offset N, cost nothing).
  ragged_ = std::any_of(lens.begin(), lens.end(), [&](int32_t l) { return l != lens[0]; });
  batch_ = ragged_ ? pow2_at_least(docs_, 1) : docs_;
  max_len_ = ragged_ ? pow2_at_least(longest, 64) : longest;
  if (!ragged_) return;
  const int64_t B = batch_;
  host_offsets_.assign(size_t(B + 3 * (B + 1)), 0);
  int32_t* len = host_offsets_.data();
  int32_t* oq = len + B;
  int32_t* okv = oq + (B + 1);
  int32_t* ost = okv + (B + 1);
  int64_t start = 0;
  for (int64_t b = 0; b <= B; ++b) {
    oq[b] = static_cast<int32_t>(start * H_ * D_);
    okv[b] = static_cast<int32_t>(start * KV_ * D_);
    ost[b] = static_cast<int32_t>(start * H_);
    if (b < B) {
      len[b] = b < docs_ ? lens[size_t(b)] : 0;
      start += len[b];
    }
  }
  auto up = [&](int32_t* dst, const int32_t* src, int64_t count) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(count) * 4, cudaMemcpyHostToDevice, stream_));
  };
  up(seq_len_, len, B);
  up(off_q_, oq, B + 1);
  up(off_kv_, okv, B + 1);
  up(off_stats_, ost, B + 1);
}

bool CudnnSdpa::plan_for(Pass pass, size_t max_workspace) {
  // int32 element offsets: the last row of q must be addressable.
  if (docs_ == 0 || double(max_tokens_) * double(H_) * double(D_) >= double(std::numeric_limits<int32_t>::max()))
    return false;
  Bucket& b = buckets_[{batch_, max_len_, ragged_}];
  std::unique_ptr<Plan>& plan = b.plan[pass];
  bool& failed = b.failed[pass];
  if (!plan && !failed) {
    const auto t0 = std::chrono::steady_clock::now();
    GraphBuilder g(static_cast<cudnnHandle_t>(handle_));
    const Shape shape{batch_, max_len_, H_, KV_, D_, ragged_};
    switch (pass) {
      case kForward: build_forward(g, shape); break;
      case kBackward: build_backward(g, shape); break;
      case kForwardFp8: build_forward_fp8(g, shape); break;
      default: build_backward_fp8(g, shape); break;
    }
    std::string note;
    plan = g.plan(max_workspace, &note);
    failed = !plan;
    plans_built_ += plan != nullptr;
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    static const char* const names[kPasses] = {"forward", "backward", "FP8 forward", "FP8 backward"};
    last_plan_note_ = fmt("%s %s B=%lld S=%lld: %s; built in %.0f ms", names[pass],
                          ragged_ ? "ragged" : "uniform", (long long)batch_, (long long)max_len_, note.c_str(), ms);
  }
  current_ = plan.get();
  return plan != nullptr;
}

// The variant pack: the tensors every graph binds, then the ragged layout's.
void CudnnSdpa::run(std::vector<int64_t> uids, std::vector<void*> ptrs, void* workspace) {
  if (ragged_) {
    uids.insert(uids.end(), {kSeqLenQ, kSeqLenKv, kOffQ, kOffKv, kOffStats});
    ptrs.insert(ptrs.end(), {seq_len_, seq_len_, off_q_, off_kv_, off_stats_});
  }
  execute(static_cast<cudnnHandle_t>(handle_), *current_, uids, ptrs, workspace ? workspace : plan_workspace_);
}

bool CudnnSdpa::forward(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                        const __nv_bfloat16* v) {
  if (!plan_for(kForward)) return false;
  float scale = 1.0f / std::sqrt(float(D_));
  float neg_inf = -std::numeric_limits<float>::infinity();
  run({kQ, kK, kV, kO, kStats, kScale, kNegInf}, {(void*)q, (void*)k, (void*)v, out, lse, &scale, &neg_inf});
  return true;
}

bool CudnnSdpa::backward(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const __nv_bfloat16* dout,
                         const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                         const __nv_bfloat16* out, const float* lse, void* backward_buffers) {
  if (!plan_for(kBackward)) return false;
  // backward_buffer_bytes' layout: dq accumulator, row sums, then (GQA) dk and dv per query head.
  const size_t n = static_cast<size_t>(max_tokens_);
  char* p = static_cast<char*>(backward_buffers);
  float* dq_accum = reinterpret_cast<float*>(p);
  float* softmax_sum = reinterpret_cast<float*>(p += align_up(n * H_ * D_ * 4));
  void* dk_full = p += align_up(n * H_ * 4);
  void* dv_full = p + align_up(n * H_ * D_ * 2);
  float scale = 1.0f / std::sqrt(float(D_));
  float neg_inf = -std::numeric_limits<float>::infinity();
  float one = 1.0f;
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kScale, kNegInf, kOne, kSoftmaxSum, kDQAccum};
  std::vector<void*> ptrs{(void*)q, (void*)k,  (void*)v,   (void*)out,   (void*)lse,   (void*)dout, dq,
                          dk,       dv,        &scale,     &neg_inf,     &one,         softmax_sum,  dq_accum};
  if (H_ != KV_) {
    uids.insert(uids.end(), {kDKFull, kDVFull});
    ptrs.insert(ptrs.end(), {dk_full, dv_full});
  }
  run(std::move(uids), std::move(ptrs));
  return true;
}

namespace {
// The scales' variant-pack entries: what both passes read, then each pass's own.
void add_fp8_scales(const CudnnSdpa::Fp8Scales& s, bool backward_pass, std::vector<int64_t>& uids,
                    std::vector<void*>& ptrs) {
  using Entry = std::pair<Uid, const void*>;
  const Entry both[] = {{kDescaleQ, s.descale_q}, {kDescaleK, s.descale_k}, {kDescaleV, s.descale_v},
                        {kDescaleS, s.descale_s}, {kScaleS, s.scale_s}};
  const Entry forward[] = {{kScaleO, s.scale_o}, {kAmaxS, s.amax_s}, {kAmaxO, s.amax_o}};
  const Entry backward[] = {{kDescaleO, s.descale_o}, {kDescaleDO, s.descale_do}, {kDescaleDP, s.descale_dp},
                            {kScaleDP, s.scale_dp},   {kScaleDQ, s.scale_dq},     {kScaleDK, s.scale_dk},
                            {kScaleDV, s.scale_dv},   {kAmaxDP, s.amax_dp},       {kAmaxDQ, s.amax_dq},
                            {kAmaxDK, s.amax_dk},     {kAmaxDV, s.amax_dv}};
  auto add = [&](const auto& entries) {
    for (const auto& [uid, p] : entries) {
      uids.push_back(uid);
      ptrs.push_back(const_cast<void*>(p));
    }
  };
  add(both);
  if (backward_pass) add(backward);
  else add(forward);
}
}  // namespace

// Both FP8 passes take documents of one length only: on Hopper cuDNN refuses a
// ragged FP8 backward, and its FP8 forward accepted a ragged graph but faulted
// (an illegal instruction) when run, with 9.14 and 9.19 alike (tests/gpu/
// test_sdpa_fp8.cu). This refuses both, saying why.
bool CudnnSdpa::refuse_ragged_fp8(const char* pass) {
  if (!ragged_) return false;
  last_plan_note_ = fmt("FP8 %s: this micro-batch's %lld documents differ in length; cuDNN's FP8 graphs take "
                        "documents of one length", pass, (long long)docs_);
  return true;
}

bool CudnnSdpa::forward_fp8(uint8_t* out, float* lse, const uint8_t* q, const uint8_t* k, const uint8_t* v,
                            const Fp8Scales& scales) {
  if (refuse_ragged_fp8("forward") || !plan_for(kForwardFp8)) return false;
  float scale = 1.0f / std::sqrt(float(D_));
  float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale, kNegInf};
  std::vector<void*> ptrs{(void*)q, (void*)k, (void*)v, out, lse, &scale, &neg_inf};
  add_fp8_scales(scales, false, uids, ptrs);
  run(std::move(uids), std::move(ptrs));
  return true;
}

bool CudnnSdpa::backward_fp8(uint8_t* dq, uint8_t* dk, uint8_t* dv, const uint8_t* dout, const uint8_t* q,
                             const uint8_t* k, const uint8_t* v, const uint8_t* out, const float* lse,
                             const Fp8Scales& scales, void* workspace) {
  if (refuse_ragged_fp8("backward") || !plan_for(kBackwardFp8, fp8_backward_workspace_bytes(max_tokens_, H_, D_)))
    return false;
  float scale = 1.0f / std::sqrt(float(D_));
  float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kScale, kNegInf};
  std::vector<void*> ptrs{(void*)q, (void*)k, (void*)v, (void*)out, (void*)lse, (void*)dout, dq, dk, dv, &scale,
                          &neg_inf};
  add_fp8_scales(scales, true, uids, ptrs);
  run(std::move(uids), std::move(ptrs), workspace);
  return true;
}

#endif  // SHARDLM_CUDNN

}  // namespace shardlm::cuda
