// EchoTreePlugin implementation (see EchoTreePlugin.h). The kernels come from the echo_plugin library's C ABI.
#include "EchoTreePlugin.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>

#include "echo/echo_abi.h"

namespace echo {
namespace trt {

using namespace nvinfer1;

namespace {

constexpr char const* kName = "EchoTreePlugin";
constexpr char const* kVersion = "2";  // 2: only the fields enqueue reads (k_max, max_nodes_per_request)

size_t align_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

int32_t words_per_row(int32_t m) { return (m + 31) / 32; }

// Byte offsets of everything enqueue keeps in the workspace, for N nodes and B requests.
struct Layout {
  size_t selected, phase, num_nodes, order, order_len, cu_out, parents_out, depths_out, alloc_ws, pack_ws, total;
  size_t alloc_bytes = 0, pack_bytes = 0;
  bool ok = true;  // both workspace queries succeeded (a failed query must not size a workspace)

  Layout(int32_t n, int32_t b) {
    ok = echo_allocate_budget_workspace_bytes(n, b, &alloc_bytes) == ECHO_OK &&
         echo_pack_workspace_bytes(n, &pack_bytes) == ECHO_OK;
    size_t at = 0;
    auto take = [&at](size_t bytes) {
      size_t here = at;
      at += align_up(bytes);
      return here;
    };
    selected = take(n);
    phase = take(n);
    num_nodes = take(sizeof(int32_t) * b);
    order = take(sizeof(int32_t) * std::max(n - b, 1));
    order_len = take(sizeof(int32_t));
    cu_out = take(sizeof(int32_t) * (b + 1));
    parents_out = take(sizeof(int32_t) * n);
    depths_out = take(sizeof(int32_t) * n);
    alloc_ws = take(alloc_bytes);
    pack_ws = take(pack_bytes);
    total = at;
  }
};

template <typename T>
T* at(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

}  // namespace

std::string validate(EchoTreeParams const& p) {
  if (p.k_max < 1) return "k_max must be >= 1";
  if (p.max_nodes_per_request < 1) return "max_nodes_per_request must be >= 1 (root included)";
  return "";
}

EchoTreePlugin::EchoTreePlugin(EchoTreeParams params) : mParams(std::move(params)) { refreshFields(); }

void EchoTreePlugin::refreshFields() noexcept {
  mFields = {
      PluginField("k_max", &mParams.k_max, PluginFieldType::kINT32, 1),
      PluginField("max_nodes_per_request", &mParams.max_nodes_per_request, PluginFieldType::kINT32, 1),
  };
  mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
  mFieldCollection.fields = mFields.data();
}

IPluginCapability* EchoTreePlugin::getCapabilityInterface(PluginCapabilityType type) noexcept {
  switch (type) {
    case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
    case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
  }
  return nullptr;
}

IPluginV3* EchoTreePlugin::clone() noexcept {
  auto* p = new (std::nothrow) EchoTreePlugin(mParams);
  if (p) p->setPluginNamespace(mNamespace.c_str());
  return p;
}

char const* EchoTreePlugin::getPluginName() const noexcept { return kName; }
char const* EchoTreePlugin::getPluginVersion() const noexcept { return kVersion; }
char const* EchoTreePlugin::getPluginNamespace() const noexcept { return mNamespace.c_str(); }

int32_t EchoTreePlugin::configurePlugin(DynamicPluginTensorDesc const*, int32_t nbInputs, DynamicPluginTensorDesc const*,
                                        int32_t nbOutputs) noexcept {
  return nbInputs == kNbInputs && nbOutputs == kNbOutputs ? 0 : -1;
}

int32_t EchoTreePlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const*,
                                           int32_t) const noexcept {
  if (nbOutputs != kNbOutputs) return -1;
  std::fill(outputTypes, outputTypes + nbOutputs, DataType::kINT32);
  return 0;
}

int32_t EchoTreePlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const*, int32_t,
                                        DimsExprs* outputs, int32_t nbOutputs, IExprBuilder& exprBuilder) noexcept {
  if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || inputs[3].nbDims != 1) return -1;
  IDimensionExpr const* batch =
      exprBuilder.operation(DimensionOperation::kSUB, *inputs[3].d[0], *exprBuilder.constant(1));
  IDimensionExpr const* m = exprBuilder.constant(mParams.max_nodes_per_request);
  IDimensionExpr const* k = exprBuilder.constant(mParams.k_max);
  outputs[0].nbDims = 1;
  outputs[0].d[0] = batch;
  outputs[1].nbDims = 2;
  outputs[1].d[0] = batch;
  outputs[1].d[1] = m;
  outputs[2].nbDims = 2;
  outputs[2].d[0] = k;
  outputs[2].d[1] = exprBuilder.constant(words_per_row(mParams.max_nodes_per_request));
  outputs[3].nbDims = 1;
  outputs[3].d[0] = k;
  outputs[4].nbDims = 1;
  outputs[4].d[0] = k;
  outputs[5].nbDims = 1;
  outputs[5].d[0] = exprBuilder.constant(1);
  return 0;
}

bool EchoTreePlugin::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                               int32_t nbOutputs) noexcept {
  if (pos < 0 || pos >= nbInputs + nbOutputs) return false;
  PluginTensorDesc const& d = inOut[pos].desc;
  DataType want = pos == 0 ? DataType::kFLOAT : DataType::kINT32;
  return d.format == TensorFormat::kLINEAR && d.type == want;
}

int32_t EchoTreePlugin::getNbOutputs() const noexcept { return kNbOutputs; }

size_t EchoTreePlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t, DynamicPluginTensorDesc const*,
                                        int32_t) const noexcept {
  auto n = static_cast<int32_t>(inputs[0].max.d[0]);
  auto b = static_cast<int32_t>(inputs[3].max.d[0] - 1);
  const Layout L(std::max(n, 1), std::max(b, 1));
  return L.ok ? L.total : 0;  // a failed query: enqueue sees it again and fails
}

int32_t EchoTreePlugin::onShapeChange(PluginTensorDesc const*, int32_t nbInputs, PluginTensorDesc const*,
                                      int32_t nbOutputs) noexcept {
  return nbInputs == kNbInputs && nbOutputs == kNbOutputs ? 0 : -1;
}

int32_t EchoTreePlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const*, void const* const* inputs,
                                void* const* outputs, void* workspace, cudaStream_t stream) noexcept {
  const auto n = static_cast<int32_t>(inputDesc[0].dims.d[0]);
  const auto b = static_cast<int32_t>(inputDesc[3].dims.d[0] - 1);
  const int32_t m = mParams.max_nodes_per_request, k_max = mParams.k_max;
  auto* num_selected_out = static_cast<int32_t*>(outputs[5]);
  if (b == 0)  // no generation requests this step (TensorRT-LLM allows it): K = 0, nothing else to write
    return cudaMemsetAsync(num_selected_out, 0, sizeof(int32_t), stream) == cudaSuccess ? 0 : -1;
  if (b < 0 || n < b || k_max < b) return -1;  // every request needs its root within K_max
  const Layout L(n, b);
  if (!L.ok) return -1;
  auto* gen_lengths = static_cast<int32_t*>(outputs[0]);
  auto* offsets = static_cast<int32_t*>(outputs[1]);
  auto* mask = static_cast<int32_t*>(outputs[2]);
  auto* src_index = static_cast<int32_t*>(outputs[3]);
  auto* position_ids = static_cast<int32_t*>(outputs[4]);
  // Rows past K stay zero (src_index -1): the attention plugin reads generation_lengths rows only.
  if (cudaMemsetAsync(mask, 0, sizeof(int32_t) * size_t(k_max) * words_per_row(m), stream) != cudaSuccess ||
      cudaMemsetAsync(src_index, 0xFF, sizeof(int32_t) * size_t(k_max), stream) != cudaSuccess ||
      cudaMemsetAsync(position_ids, 0, sizeof(int32_t) * size_t(k_max), stream) != cudaSuccess)
    return -1;
  auto* selected = at<uint8_t>(workspace, L.selected);
  int rc = echo_allocate_budget_cuda(
      static_cast<float const*>(inputs[0]), static_cast<int32_t const*>(inputs[1]),
      static_cast<int32_t const*>(inputs[2]), static_cast<int32_t const*>(inputs[3]), b, n,
      static_cast<int32_t const*>(inputs[4]), k_max, m, selected, at<int8_t>(workspace, L.phase),
      at<int32_t>(workspace, L.num_nodes),
      n <= ECHO_FUSED_ALLOCATION_MAX_NODES ? nullptr : at<int32_t>(workspace, L.order),  // no order: fused
      at<int32_t>(workspace, L.order_len),
      at<void>(workspace, L.alloc_ws), L.alloc_bytes, stream);
  if (rc != ECHO_OK) return -1;
  auto* cu_out = at<int32_t>(workspace, L.cu_out);
  rc = echo_pack_cuda(static_cast<int32_t const*>(inputs[2]), static_cast<int32_t const*>(inputs[3]), selected,
                      static_cast<int32_t const*>(inputs[5]), b, n, std::min(k_max, n), m, cu_out, gen_lengths,
                      src_index, at<int32_t>(workspace, L.parents_out), at<int32_t>(workspace, L.depths_out),
                      position_ids, offsets, mask, at<void>(workspace, L.pack_ws), L.pack_bytes, stream);
  if (rc != ECHO_OK) return -1;
  return cudaMemcpyAsync(num_selected_out, cu_out + b, sizeof(int32_t), cudaMemcpyDeviceToDevice, stream) == cudaSuccess
             ? 0
             : -1;
}

IPluginV3* EchoTreePlugin::attachToContext(IPluginResourceContext*) noexcept { return clone(); }

PluginFieldCollection const* EchoTreePlugin::getFieldsToSerialize() noexcept {
  refreshFields();
  return &mFieldCollection;
}

// ------------------------------------------------------------------------------------------------ creator

EchoTreePluginCreator::EchoTreePluginCreator() {
  mFieldNames = {
      PluginField("k_max", nullptr, PluginFieldType::kINT32, 1),
      PluginField("max_nodes_per_request", nullptr, PluginFieldType::kINT32, 1),
  };
  mFieldCollection.nbFields = static_cast<int32_t>(mFieldNames.size());
  mFieldCollection.fields = mFieldNames.data();
}

IPluginV3* EchoTreePluginCreator::createPlugin(char const*, PluginFieldCollection const* fc, TensorRTPhase) noexcept {
  EchoTreeParams p;
  for (int32_t i = 0; fc && i < fc->nbFields; ++i) {
    PluginField const& f = fc->fields[i];
    if (!f.name || !f.data) continue;
    const bool is_int = f.type == PluginFieldType::kINT32 && f.length == 1;
    auto const* ints = static_cast<int32_t const*>(f.data);
    if (!std::strcmp(f.name, "k_max") && is_int) p.k_max = ints[0];
    else if (!std::strcmp(f.name, "max_nodes_per_request") && is_int) p.max_nodes_per_request = ints[0];
    else return nullptr;  // unknown field (e.g. version 1's gate fields) or wrong type: the creation fails
  }
  if (!validate(p).empty()) return nullptr;
  auto* plugin = new (std::nothrow) EchoTreePlugin(std::move(p));
  if (plugin) plugin->setPluginNamespace(mNamespace.c_str());
  return plugin;
}

PluginFieldCollection const* EchoTreePluginCreator::getFieldNames() noexcept { return &mFieldCollection; }
char const* EchoTreePluginCreator::getPluginName() const noexcept { return kName; }
char const* EchoTreePluginCreator::getPluginVersion() const noexcept { return kVersion; }
char const* EchoTreePluginCreator::getPluginNamespace() const noexcept { return mNamespace.c_str(); }

REGISTER_TENSORRT_PLUGIN(EchoTreePluginCreator);

}  // namespace trt
}  // namespace echo

// Dynamic loading (IPluginRegistry::loadLibrary, trtexec --dynamicPlugins): the library's creators and the hook
// through which TensorRT hands it a logger (the plugin reports failures through return codes and does not log).
extern "C" void setLoggerFinder(nvinfer1::ILoggerFinder*) {}

extern "C" nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  static echo::trt::EchoTreePluginCreator creator;
  static nvinfer1::IPluginCreatorInterface* const creators[] = {&creator};
  nbCreators = 1;
  return creators;
}
