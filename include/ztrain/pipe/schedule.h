#pragma once
/// Pipeline schedules as data: the instruction list each stage executes in one training step.
///
/// A schedule is a pure function of (kind, stages p, this stage s, micro-batches m, chunks v)
/// returning the operations stage s runs, in order: forward and backward of a micro-batch on
/// one of its model chunks, and the transfers around them. With v chunks per rank (interleaved
/// 1F1B) the model is cut into p·v virtual stages, and chunk c of rank s is virtual stage
/// c·p + s (Megatron-LM's layout): activations go from rank s to rank s+1 and from the last
/// rank back to rank 0 for the next chunk; gradients go the other way.
///
/// - GPipe: all forwards (micro-batch 0 … m−1), then all backwards (0 … m−1). Activations of
///   all m micro-batches are alive at once.
/// - 1F1B: stage s runs min(p−s−1, m) warm-up forwards, then alternates one forward and one
///   backward, then drains the remaining backwards. At most p−s micro-batches are in flight on
///   stage s (forwarded, not yet backwarded).
/// - Interleaved 1F1B (Megatron-LM): forward number k (0 ≤ k < m·v) of a stage runs chunk
///   (k mod p·v) / p on micro-batch (k / p·v)·p + k mod p; backward number k runs chunk
///   v−1−(k mod p·v)/p on the same micro-batch formula. The stage first runs
///   (p−s−1)·2 + (v−1)·p warm-up forwards (all m·v when m == p), then alternates, then drains.
///   Requires m to be a multiple of p.
///
/// Around each compute the schedule places the receive of its input before it and the send of
/// its result after it. Between two computes, the send and the receive are ordered so that the
/// lists of all stages complete even when every send and receive blocks until its partner is
/// there (the executor's sends are non-blocking, which is easier still): the order comes from
/// running all stages' computes together with matched transfers, so a stage's list depends on
/// the other stages' too (still a pure function of the arguments). Messages between two ranks
/// in one direction are sent and received in the same order.
///
///   auto list = ztrain::pipe::make_schedule(ztrain::pipe::ScheduleKind::k1F1B,
///                                           {.stages = 4, .stage = 1, .micro_batches = 8});
///   for (const auto& ins : list) std::cout << ins << " ";   // RF0 F0 RF1 SF0 F1 RF2 SF1 F2 SF2 RB0 B0 …

#include <ostream>
#include <string>
#include <vector>

namespace ztrain::pipe {

enum class Op { kRecvForward, kForward, kSendForward, kRecvBackward, kBackward, kSendBackward };

/// One step of a stage: an operation on a micro-batch and one of this rank's model chunks.
struct Instruction {
  Op op;
  int micro_batch = 0;
  /// Which of this rank's chunks (0 … v−1); always 0 without interleaving.
  int chunk = 0;
  bool operator==(const Instruction&) const = default;
};

enum class ScheduleKind { kGPipe, k1F1B, kInterleaved1F1B };

struct ScheduleShape {
  /// Pipeline ranks p (≥ 1).
  int stages = 1;
  /// This rank's stage s (0 ≤ s < p).
  int stage = 0;
  /// Micro-batches per step m (≥ 1).
  int micro_batches = 1;
  /// Model chunks per rank v (≥ 1); more than one only for kInterleaved1F1B.
  int chunks = 1;
};

const char* to_string(Op op);
const char* to_string(ScheduleKind kind);
/// "gpipe", "1f1b" or "interleaved" (as on the command line); throws ztrain::Error otherwise.
ScheduleKind parse_schedule_kind(const std::string& name);
/// Short form: "F3" (forward of micro-batch 3), "SB3.1" (send backward of micro-batch 3,
/// chunk 1), …
std::string to_string(const Instruction& instruction);
std::ostream& operator<<(std::ostream& out, const Instruction& instruction);

/// The virtual stage of `chunk` on `stage` (chunk · stages + stage).
inline int virtual_stage(int stage, int chunk, int stages) { return chunk * stages + stage; }

/// The instruction list of `shape.stage`. Pure; throws ztrain::Error on an invalid shape
/// (including m not a multiple of p for kInterleaved1F1B, or v > 1 for the others).
std::vector<Instruction> make_schedule(ScheduleKind kind, const ScheduleShape& shape);

std::vector<Instruction> gpipe_schedule(int stages, int stage, int micro_batches);
std::vector<Instruction> one_f_one_b_schedule(int stages, int stage, int micro_batches);
std::vector<Instruction> interleaved_schedule(int stages, int stage, int micro_batches, int chunks);

}  // namespace ztrain::pipe
