#include <ztrain/runtime/device.h>

#include <ztrain/error.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

#include <cstdlib>

namespace ztrain {

c10::Device parse_device(const std::string& text, std::string_view what) {
  try {
    return c10::Device(text);
  } catch (const c10::Error&) {
    throw Error(c10::str(what, ": '", text, "' is not a device; use cpu, cuda or cuda:N"));
  }
}

c10::Device resolve_device(c10::Device requested, std::string_view what) {
  if (requested.is_cpu()) {
    ZTRAIN_CHECK(!requested.has_index() || requested.index() == 0, what, ": there is one CPU device, got ", requested);
    return c10::Device(c10::kCPU);
  }
  ZTRAIN_CHECK(requested.is_cuda(), what, ": ztrain runs on cpu or cuda devices, got ", requested);
  const auto count = static_cast<int>(torch::cuda::device_count());
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  ZTRAIN_CHECK(count > 0, what, ": ", requested, " was asked for, but this process sees no CUDA device (CUDA_VISIBLE_DEVICES ",
               visible ? c10::str("= '", visible, "'") : std::string("unset"), "); run where a GPU is visible, or use device cpu");
  if (!requested.has_index()) {
    return c10::Device(c10::kCUDA, c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice().index());
  }
  ZTRAIN_CHECK(requested.index() < count, what, ": ", requested, " does not exist; this process sees ", count,
               " CUDA device", count == 1 ? "" : "s", " (cuda:0 to cuda:", count - 1, ")");
  return requested;
}

void set_current_device(c10::Device device) {
  if (device.is_cpu()) return;
  c10::impl::getDeviceGuardImpl(device.type())->setDevice(device);
}

}  // namespace ztrain
