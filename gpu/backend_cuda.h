// Entry points of the CUDA backend (gpu/backend_cuda.cu, library disagg_cuda).
// Only gpu/backend.cpp uses them, and only when built with DISAGG_HAVE_CUDA.
#pragma once
#include <memory>
#include <string>

#include "gpu/backend.h"

namespace disagg::gpu {

// cudaGetDeviceCount, or 0 when it fails (no driver, no device). When it
// returns 0 and why_none is given, *why_none says why (the CUDA error name and
// string, or that no device was reported), for "no CUDA device: <why>" messages.
int cuda_runtime_device_count(std::string* why_none = nullptr);

// A backend on CUDA device `device`; throws Error when it cannot be initialised.
std::unique_ptr<Backend> make_cuda_backend(int device);

}  // namespace disagg::gpu
