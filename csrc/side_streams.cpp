// The side-streams switch (side_streams.h).
#include "side_streams.h"

#include <atomic>
#include <cstdlib>
#include <string_view>

#include "checks.h"

namespace dqn_ops {
namespace {
// The setting, initialised from the environment at its first use (on unless it is 0). A value
// other than 0 or 1 raises there (and again at the next use: a static whose initialiser throws
// is not initialised).
std::atomic<bool>& side_streams_setting() {
  static std::atomic<bool> setting{[] {
    const char* env = std::getenv("DQN_OPS_SIDE_STREAM");
    const std::string_view value = env == nullptr ? "" : env;
    DQN_CHECK(value.empty() || value == "0" || value == "1", "dqn_ops: DQN_OPS_SIDE_STREAM: expected 0 or 1, got '",
              value, "'");
    return value != "0";
  }()};
  return setting;
}
}  // namespace

bool side_streams_enabled() { return side_streams_setting().load(std::memory_order_relaxed); }

bool set_side_streams(bool on) { return side_streams_setting().exchange(on, std::memory_order_relaxed); }

}  // namespace dqn_ops
