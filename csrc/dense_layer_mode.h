// The dense layer kernel's switch: which layers the CUDA ops run with dqn_ops's own GEMM with the
// work after it in its epilogue (csrc/cuda/dense_layer.h: dense hidden layers, the output layer,
// the backward's input gradients), and which with cuBLAS GEMMs and a pass after them. The two
// compute one formula; the F32 sums' order, so at times a last bit, differs.
//   - kAuto (the default): the launches dense_layer.cu's measured rule gives the kernel;
//   - kOn: every launch the kernel can run (the tests of the kernel itself);
//   - kOff: none.
// Set by
//   - the environment variable DQN_OPS_DENSE_KERNEL=auto|1|0 (or on|off; unset: auto), read once,
//     at the first call of dense_layer_mode() (switches.h: any other value raises there);
//   - dqn_ops._C._set_dense_layer_mode(name) (dqn_ops.dense_kernel.set_mode), which returns the
//     previous one.
// A process-wide setting read with one atomic load per layer. A CUDA graph keeps the kernels it
// was captured with. The CPU kernels ignore it. Defined in dense_layer_mode.cpp (built with or
// without CUDA).
#pragma once

#include <string>

namespace dqn_ops {

enum class DenseLayerMode { kAuto, kOn, kOff };

DenseLayerMode dense_layer_mode();
// Returns the previous setting.
DenseLayerMode set_dense_layer_mode(DenseLayerMode mode);
// "auto", "1" / "on", "0" / "off" -> *mode (false for any other name); the name of a mode ("auto",
// "on", "off").
bool parse_dense_layer_mode(const char* name, DenseLayerMode* mode);
const char* dense_layer_mode_name(DenseLayerMode mode);
// The names parse takes, as a message lists them.
std::string dense_layer_mode_choices();

}  // namespace dqn_ops
