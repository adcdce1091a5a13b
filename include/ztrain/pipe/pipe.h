#pragma once
/// Pipeline parallelism: schedules as data, the stage boundary protocol, stages and the
/// executor.
#include <ztrain/pipe/boundary.h>
#include <ztrain/pipe/pipeline.h>
#include <ztrain/pipe/schedule.h>
