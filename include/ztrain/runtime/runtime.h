#pragma once
/// The runtime area: initialisation, rank layout and seeds.
#include <ztrain/runtime/init.h>
#include <ztrain/runtime/rng.h>
#include <ztrain/runtime/topology.h>
