#pragma once
/// Communication: the Communicator and its backends' factory, the transport interface,
/// asynchronous streams, host-shared buffers and autograd-aware collectives.
#include <ztrain/comm/backend.h>
#include <ztrain/comm/comm_stream.h>
#include <ztrain/comm/communicator.h>
#include <ztrain/comm/functional.h>
#include <ztrain/comm/host_shared.h>
#include <ztrain/comm/transport.h>
#include <ztrain/comm/work.h>
