#pragma once
/// ztrain: distributed training for libtorch. Include this one header.
///
///   #include <ztrain/ztrain.h>
///   namespace zt = ztrain;
///   int main() {
///     auto& rt = zt::init_distributed({.seed = 0});
///     auto loss = ...;                          // this rank's mean loss
///     zt::print_rank("loss ", zt::sum_loss(loss).item<double>());
///   }
#include <ztrain/booster/booster.h>
#include <ztrain/booster/data_parallel.h>
#include <ztrain/booster/fully_shard.h>
#include <ztrain/booster/hybrid_parallel.h>
#include <ztrain/booster/low_level_zero.h>
#include <ztrain/booster/policy.h>
#include <ztrain/ckpt/checkpoint.h>
#include <ztrain/ckpt/model_file.h>
#include <ztrain/ckpt/optimizer_state.h>
#include <ztrain/ckpt/safetensors.h>
#include <ztrain/comm/comm.h>
#include <ztrain/error.h>
#include <ztrain/optim/adam.h>
#include <ztrain/optim/adam_offload.h>
#include <ztrain/models/fused.h>
#include <ztrain/models/gpt.h>
#include <ztrain/models/plain_gpt.h>
#include <ztrain/optim/loss_scaler.h>
#include <ztrain/optim/lr_scheduler.h>
#include <ztrain/optim/optim_manager.h>
#include <ztrain/optim/param_groups.h>
#include <ztrain/optim/state_view.h>
#include <ztrain/pipe/pipe.h>
#include <ztrain/runtime/runtime.h>
#include <ztrain/runtime/tp_rng.h>
#include <ztrain/tp/layers.h>
#include <ztrain/tp/nn.h>
#include <ztrain/tp/split.h>
#include <ztrain/version.h>
#include <ztrain/zero/block.h>
#include <ztrain/zero/block_list.h>
#include <ztrain/zero/layer_list.h>
#include <ztrain/zero/distributed_parameter.h>
#include <ztrain/zero/flat_param.h>
#include <ztrain/zero/gradient_place.h>
#include <ztrain/zero/init_parameters.h>
#include <ztrain/zero/level_policy.h>
#include <ztrain/zero/memory.h>
#include <ztrain/zero/sharded_module.h>
