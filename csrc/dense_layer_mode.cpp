// The dense layer kernel's switch (dense_layer_mode.h).
#include "dense_layer_mode.h"

#include <atomic>
#include <cstdlib>
#include <string_view>

#include "checks.h"

namespace dqn_ops {
namespace {
// The setting, initialised from the environment at its first use. An unknown value raises there
// (and again at the next use: a static whose initialiser throws is not initialised).
std::atomic<DenseLayerMode>& dense_layer_setting() {
  static std::atomic<DenseLayerMode> setting{[] {
    const char* env = std::getenv("DQN_OPS_DENSE_KERNEL");
    DenseLayerMode mode = DenseLayerMode::kAuto;
    DQN_CHECK(env == nullptr || *env == '\0' || parse_dense_layer_mode(env, &mode),
              "dqn_ops: DQN_OPS_DENSE_KERNEL: expected auto, on (1) or off (0), got '", env, "'");
    return mode;
  }()};
  return setting;
}
}  // namespace

DenseLayerMode dense_layer_mode() { return dense_layer_setting().load(std::memory_order_relaxed); }

DenseLayerMode set_dense_layer_mode(DenseLayerMode mode) {
  return dense_layer_setting().exchange(mode, std::memory_order_relaxed);
}

bool parse_dense_layer_mode(const char* name, DenseLayerMode* mode) {
  const std::string_view s = name;
  if (s == "auto") *mode = DenseLayerMode::kAuto;
  else if (s == "1" || s == "on") *mode = DenseLayerMode::kOn;
  else if (s == "0" || s == "off") *mode = DenseLayerMode::kOff;
  else return false;
  return true;
}

const char* dense_layer_mode_name(DenseLayerMode mode) {
  switch (mode) {
    case DenseLayerMode::kAuto: return "auto";
    case DenseLayerMode::kOn: return "on";
    case DenseLayerMode::kOff: return "off";
  }
  return "auto";
}

}  // namespace dqn_ops
