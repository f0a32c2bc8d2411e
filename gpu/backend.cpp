// Backend selection by name.
#include "gpu/backend.h"

#include "gpu/error.h"

#if defined(DISAGG_HAVE_CUDA) && DISAGG_HAVE_CUDA
#include "gpu/backend_cuda.h"
#define DISAGG_CUDA_BUILT 1
#else
#define DISAGG_CUDA_BUILT 0
#endif

namespace disagg::gpu {

int cuda_device_count() {
#if DISAGG_CUDA_BUILT
  return cuda_runtime_device_count();
#else
  return 0;
#endif
}

std::unique_ptr<Backend> make_backend(const std::string& name) {
  if (name == "cpu") return make_cpu_backend();
  if (name == "auto" || name == "cuda") {
#if DISAGG_CUDA_BUILT
    std::string why_none;
    if (cuda_runtime_device_count(&why_none) > 0) return make_cuda_backend(0);
#else
    const std::string why_none = "this build has no CUDA backend";
#endif
    if (name == "auto") return make_cpu_backend();
    throw Error("no CUDA device: " + why_none + " (backend \"cuda\" requested)");
  }
  throw Error("unknown backend \"" + name + "\" (expected auto, cpu or cuda)");
}

}  // namespace disagg::gpu
