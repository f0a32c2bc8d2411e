// What Checkpoint::open says of a bad model file or directory.
#pragma once
#include <string>

#include "gpu/checkpoint.h"
#include "gpu/error.h"

namespace disagg::test {

// The error's text, or "(opened)" when the model opened.
inline std::string open_error(const std::string& path) {
  try {
    gpu::Checkpoint::open(path);
  } catch (const gpu::Error& e) {
    return e.what();
  }
  return "(opened)";
}

}  // namespace disagg::test
