#pragma once
/// The runtime area: initialisation, devices, parallel contexts, rank layout, parameter records and seeds.
#include <ztrain/runtime/device.h>
#include <ztrain/runtime/init.h>
#include <ztrain/runtime/parallel_context.h>
#include <ztrain/runtime/parameter_record.h>
#include <ztrain/runtime/rng.h>
#include <ztrain/runtime/topology.h>
