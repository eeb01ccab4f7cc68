// The side-streams switch (side_streams.h).
#include "side_streams.h"

#include <atomic>

#include "switches.h"

namespace dqn_ops {
namespace {
// The setting, initialised from the environment at its first use (switches.h; on unless it is 0).
std::atomic<bool>& side_streams_setting() {
  static std::atomic<bool> setting{env_flag("DQN_OPS_SIDE_STREAM", true)};
  return setting;
}
}  // namespace

bool side_streams_enabled() { return side_streams_setting().load(std::memory_order_relaxed); }

bool set_side_streams(bool on) { return side_streams_setting().exchange(on, std::memory_order_relaxed); }

}  // namespace dqn_ops
