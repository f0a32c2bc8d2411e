// The one exception type of the compute library: every load, validation and
// runtime failure throws it with a message that names the file or the problem.
#pragma once
#include <stdexcept>
#include <string>

namespace disagg::gpu {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace disagg::gpu
