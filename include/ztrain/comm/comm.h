#pragma once
/// Communication: the Communicator interface, its MPI backend's errors, asynchronous streams and
/// autograd-aware collectives.
#include <ztrain/comm/comm_stream.h>
#include <ztrain/comm/communicator.h>
#include <ztrain/comm/functional.h>
#include <ztrain/comm/host_shared.h>
#include <ztrain/comm/work.h>
