// EchoTreePlugin: ECHO's verification-side control as a TensorRT IPluginV3 (written against TensorRT 10.x,
// NvInferRuntime.h / NvInferPluginBase.h; not built where TensorRT is absent).
//
// Inputs (device, linear):                          Outputs (device, linear, int32):
//   0 path_probs      [N]   float32                   0 generation_lengths [B]              spec_decoding_generation_lengths
//   1 depths          [N]   int32                     1 position_offsets   [B, M]           spec_decoding_position_offsets
//   2 parents         [N]   int32 (within request)    2 packed_mask        [K_max, ceil(M/32)] spec_decoding_packed_mask
//   3 cu_num_nodes    [B+1] int32                     3 src_index          [K_max]          tree node of each verified row
//   4 spine_depth     [B]   int32                     4 position_ids       [K_max]          context length + depth
//   5 context_lengths [B]   int32                     5 num_selected       [1]              K = sum of generation_lengths
// with M = max_nodes_per_request. Rows past K are zero (src_index -1). The drafting loop produces the candidate
// tree and each request's spine depth (its sparse gate's result: the gate is calibrated per batch size, so it
// stays with the loop instead of being a build-time field); the plugin allocates the K_max budget (priority 1
// depth, priority 2 width) and flattens & packs the verified nodes in one enqueue, with no host synchronisation.
// K reaches the host by reading `num_selected` (4 bytes) after the enqueue, or never: the attention plugin reads
// generation_lengths on the device. Fields: k_max, max_nodes_per_request (version 2; version 1 also serialised
// gate and beam fields that enqueue never read).
#pragma once

#include <NvInferRuntime.h>

#include <string>
#include <vector>

namespace echo {
namespace trt {

struct EchoTreeParams {
  int32_t k_max = 512;                 // the global verification budget: rows of the packed outputs
  int32_t max_nodes_per_request = 64;  // M: the per-request cap and the stride of position_offsets
};

class EchoTreePlugin : public nvinfer1::IPluginV3,
                       public nvinfer1::IPluginV3OneCore,
                       public nvinfer1::IPluginV3OneBuild,
                       public nvinfer1::IPluginV3OneRuntime {
 public:
  explicit EchoTreePlugin(EchoTreeParams params);

  // IPluginV3
  nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
  nvinfer1::IPluginV3* clone() noexcept override;

  // IPluginV3OneCore
  char const* getPluginName() const noexcept override;
  char const* getPluginVersion() const noexcept override;
  char const* getPluginNamespace() const noexcept override;

  // IPluginV3OneBuild
  int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
                          nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
  int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
                             nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
  int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
                          int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                          nvinfer1::IExprBuilder& exprBuilder) noexcept override;
  bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override;
  int32_t getNbOutputs() const noexcept override;
  size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                          nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

  // IPluginV3OneRuntime
  int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
                        int32_t nbOutputs) noexcept override;
  int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
                  void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
  nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
  nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

  void setPluginNamespace(char const* ns) noexcept { mNamespace = ns ? ns : ""; }
  EchoTreeParams const& params() const noexcept { return mParams; }

  static constexpr int32_t kNbInputs = 6;
  static constexpr int32_t kNbOutputs = 6;

 private:
  void refreshFields() noexcept;

  EchoTreeParams mParams;
  std::string mNamespace;
  std::vector<nvinfer1::PluginField> mFields;
  nvinfer1::PluginFieldCollection mFieldCollection{};
};

class EchoTreePluginCreator : public nvinfer1::IPluginCreatorV3One {
 public:
  EchoTreePluginCreator();
  nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
                                    nvinfer1::TensorRTPhase phase) noexcept override;
  nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
  char const* getPluginName() const noexcept override;
  char const* getPluginVersion() const noexcept override;
  char const* getPluginNamespace() const noexcept override;
  void setPluginNamespace(char const* ns) noexcept { mNamespace = ns ? ns : ""; }

 private:
  std::string mNamespace;
  std::vector<nvinfer1::PluginField> mFieldNames;
  nvinfer1::PluginFieldCollection mFieldCollection{};
};

// Field validation shared by the creator and tests: empty string = valid, else what was wrong.
std::string validate(EchoTreeParams const& p);

}  // namespace trt
}  // namespace echo
