// Running the built executables from tests.
#pragma once
#include <string>
#include <utility>

namespace disagg::test {

// Runs `command` through /bin/sh; returns its standard output and exit status
// (-1 when it did not exit normally).
std::pair<std::string, int> run_command(const std::string& command);

// `s` as one single-quoted shell word.
std::string shell_quoted(const std::string& s);

}  // namespace disagg::test
