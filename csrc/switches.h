// The run-time switches' names and environment variables (the README's settings paragraph).
// Each switch takes a fixed set of value names, some of them aliases of one value, listed once
// in a table that its environment variable and its Python setter both read. Its variable is read
// once, at the switch's first use: unset or empty, the switch's default; a name not in the table
// raises, naming the variable, the names it takes and the value it got, and raises again at the
// next use (a function-local static whose initialiser throws stays uninitialised). Defined in
// switches.cpp (built with or without CUDA).
#pragma once

#include <string>
#include <string_view>

#include <c10/util/ArrayRef.h>

namespace dqn_ops {

struct SwitchName {
  std::string_view name;
  int value;
};
using SwitchNames = c10::ArrayRef<SwitchName>;

// The names of an on / off switch: "0" off, "1" on.
inline constexpr SwitchName kOffOnNames[] = {{"0", 0}, {"1", 1}};

// The value `name` names in `names`; false where none does.
bool switch_value(SwitchNames names, std::string_view name, int* value);
// The first name of `value` in `names` (list a value's canonical name before its aliases).
const char* switch_name(SwitchNames names, int value);
// The names as a message lists them: "auto, on, 1, off or 0".
std::string switch_choices(SwitchNames names);
// The value environment variable `var` names: `unset` where it is unset or empty.
int env_switch(const char* var, SwitchNames names, int unset);
// An on / off switch's setting (kOffOnNames): `unset` where its variable is unset or empty.
bool env_flag(const char* var, bool unset);

}  // namespace dqn_ops
