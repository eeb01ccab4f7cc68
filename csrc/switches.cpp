// The run-time switches' names and environment variables (switches.h).
#include "switches.h"

#include <cstdlib>

#include "checks.h"

namespace dqn_ops {

bool switch_value(SwitchNames names, std::string_view name, int* value) {
  for (const SwitchName& n : names) {
    if (n.name == name) {
      *value = n.value;
      return true;
    }
  }
  return false;
}

const char* switch_name(SwitchNames names, int value) {
  for (const SwitchName& n : names)
    if (n.value == value) return n.name.data();  // the tables' names are string literals
  TORCH_INTERNAL_ASSERT(false, cat("dqn_ops: a switch's value without a name: ", value));  // one string (checks.h)
}

std::string switch_choices(SwitchNames names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i)
    out += cat(i == 0 ? "" : i + 1 == names.size() ? " or " : ", ", names[i].name);
  return out;
}

int env_switch(const char* var, SwitchNames names, int unset) {
  const char* env = std::getenv(var);
  if (env == nullptr || *env == '\0') return unset;
  int value = unset;
  DQN_CHECK(switch_value(names, env, &value), "dqn_ops: ", var, ": expected ", switch_choices(names), ", got '", env,
            "'");
  return value;
}

bool env_flag(const char* var, bool unset) { return env_switch(var, kOffOnNames, unset ? 1 : 0) == 1; }

}  // namespace dqn_ops
