// `moeforge <command> --help` and `moeforge help <command>`: what a command
// does, each flag with its default, and examples to copy.
#pragma once

#include <string>

namespace moeforge {

// The help of `command`, or nullptr for a name that is not a command.
const char *command_help(const std::string &command);

} // namespace moeforge
