#pragma once
/// Devices: ztrain runs each rank on one device, the CPU or one CUDA device.
///
/// A rank's device is its context's (ParallelContext::device): sharded modules place their flat
/// buffers there (moving the wrapped module's parameters at construction, wherever they were
/// built), optimizers keep their state beside the parameters they update, and checkpoints are
/// read and written from any device. init_distributed picks the device from
/// InitOptions::device or ZTRAIN_DEVICE: "cuda" alone means one device per rank on each host
/// (the host's local rank modulo the visible devices), which becomes the current device.
///
///   auto& rt = ztrain::init_distributed({.device = torch::kCUDA});   // rank r of a host: cuda:(r % n)
///   auto x = batch.to(rt.context().device());

#include <c10/core/Device.h>

#include <string>
#include <string_view>

namespace ztrain {

/// "cpu", "cuda" or "cuda:N" as a device; anything else raises ztrain::Error naming `what`
/// and the accepted forms.
c10::Device parse_device(const std::string& text, std::string_view what);

/// The device a rank runs on for `requested`: the CPU, or a CUDA device that exists, with its
/// index (CUDA without one: the current CUDA device). Raises ztrain::Error, naming `what`, for
/// a device type ztrain does not run on or a CUDA device this process cannot see (with how many
/// it sees and the alternative).
c10::Device resolve_device(c10::Device requested, std::string_view what);

/// Makes `device` (resolved) the current one of its type for this thread's allocations and
/// kernels; nothing for the CPU.
void set_current_device(c10::Device device);

}  // namespace ztrain
