// Entry points of the CUDA backend (gpu/backend_cuda.cu, library disagg_cuda).
// Only gpu/backend.cpp uses them, and only when built with DISAGG_HAVE_CUDA.
#pragma once
#include <memory>

#include "gpu/backend.h"

namespace disagg::gpu {

// cudaGetDeviceCount, or 0 when it fails (no driver, no device).
int cuda_runtime_device_count();

// A backend on CUDA device `device`; throws Error when it cannot be initialised.
std::unique_ptr<Backend> make_cuda_backend(int device);

}  // namespace disagg::gpu
