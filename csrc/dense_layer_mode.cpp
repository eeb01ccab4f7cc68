// The dense layer kernel's switch (dense_layer_mode.h).
#include "dense_layer_mode.h"

#include <atomic>

#include "switches.h"

namespace dqn_ops {
namespace {
constexpr SwitchName kModeNames[] = {{"auto", static_cast<int>(DenseLayerMode::kAuto)},
                                     {"on", static_cast<int>(DenseLayerMode::kOn)},
                                     {"1", static_cast<int>(DenseLayerMode::kOn)},
                                     {"off", static_cast<int>(DenseLayerMode::kOff)},
                                     {"0", static_cast<int>(DenseLayerMode::kOff)}};

// The setting, initialised from the environment at its first use (switches.h).
std::atomic<DenseLayerMode>& dense_layer_setting() {
  static std::atomic<DenseLayerMode> setting{static_cast<DenseLayerMode>(
      env_switch("DQN_OPS_DENSE_KERNEL", kModeNames, static_cast<int>(DenseLayerMode::kAuto)))};
  return setting;
}
}  // namespace

DenseLayerMode dense_layer_mode() { return dense_layer_setting().load(std::memory_order_relaxed); }

DenseLayerMode set_dense_layer_mode(DenseLayerMode mode) {
  return dense_layer_setting().exchange(mode, std::memory_order_relaxed);
}

bool parse_dense_layer_mode(const char* name, DenseLayerMode* mode) {
  int value = 0;
  if (!switch_value(kModeNames, name, &value)) return false;
  *mode = static_cast<DenseLayerMode>(value);
  return true;
}

const char* dense_layer_mode_name(DenseLayerMode mode) { return switch_name(kModeNames, static_cast<int>(mode)); }

std::string dense_layer_mode_choices() { return switch_choices(kModeNames); }

}  // namespace dqn_ops
