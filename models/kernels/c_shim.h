// A second entry point for each of the project's ops: a C function that an AOTInductor package
// calls directly (``aot_inductor.custom_ops_to_c_shims``, declared by models/kernels/c_shims.py),
// in place of the boxed call through the package's proxy executor and the dispatcher. The
// function is named aoti_torch_cpu_<op> and takes the op's schema in AOTInductor's C types
// (Tensor: AtenTensorHandle; Tensor?: AtenTensorHandle*, null for None; int: int64_t; float:
// double; bool: int32_t), then one AtenTensorHandle* per output, which receives a new handle.
// An exception (a TORCH_CHECK) becomes AOTI_TORCH_FAILURE with its message logged, as for
// torch's own shims.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <utility>

namespace dualserve_shim {

inline const at::Tensor& tensor(AtenTensorHandle handle) {
  return *torch::aot_inductor::tensor_handle_to_tensor_pointer(handle);
}

inline void give(AtenTensorHandle* ret, at::Tensor&& t) { *ret = torch::aot_inductor::new_tensor_handle(std::move(t)); }

}  // namespace dualserve_shim

#define DUALSERVE_SHIM extern "C" __attribute__((visibility("default"))) AOTITorchError
