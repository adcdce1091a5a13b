#pragma once
/// Progress display and metrics log of ztrain-gpt.
///
/// ProgressBar draws one line per step: redrawn in place with '\r' on a terminal, or printed as
/// plain lines every few steps when the output is a file or a pipe. MetricsLog appends one JSON
/// object per line (JSONL) that read_metrics reads back.
///
///   ProgressBar bar(total_steps, stdout_is_terminal(), {.start_step = resumed_step});
///   MetricsLog log(out_dir + "/metrics.jsonl");
///   for (int64_t step = resumed_step + 1; step <= total_steps; ++step) {
///     ...
///     StepMetrics m{.loss = loss, .lr = lr, .tokens_per_s = tps, .mem_bytes = mem, .time_s = elapsed};
///     bar.update(step, m);
///     log.write(step, m, {{"grad_norm", norm}});
///   }
///   bar.finish();
///
/// Neither class is thread-safe, nor collective: create them on the one rank that reports.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace ztrain::gpt_app {

/// What one step reports.
struct StepMetrics {
  double loss = 0;
  double lr = 0;
  double tokens_per_s = 0;
  int64_t mem_bytes = 0;  // e.g. the peak resident memory of the process
  double time_s = 0;      // seconds since this run (this process) started, at the end of the step
};

/// "45s", "1m23s", "2h03m", "3d04h"; "?" for a negative or non-finite duration.
std::string format_duration(double seconds);
/// Binary units with one decimal under 10: "512 B", "1.5 KiB", "512 MiB", "12 GiB".
std::string format_bytes(int64_t bytes);
/// Three significant digits with a k/M/G suffix: "950", "1.23k", "12.3k", "123k", "4.56M".
std::string format_rate(double per_second);

/// Whether standard output is a terminal (isatty), i.e. whether a ProgressBar may redraw.
bool stdout_is_terminal();

struct ProgressOptions {
  int64_t start_step = 0;    // steps already done before this run (a resumed run); ETA counts from here
  int64_t print_every = 10;  // plain mode: print every this many steps (and the first and last)
  int bar_width = 30;        // characters between the brackets
};

/// A one-line progress display.
///
/// update(step, m) takes the number of steps done (1 after the first step) and that step's
/// metrics. Interactive: redraws "step 120/1000 [=====>    ] loss 2.345 lr 3.0e-04 12.3k tok/s
/// mem 512 MiB ETA 1m23s" in place ('\r', padded over the previous line). Plain: prints the same
/// fields without the bar, newline-terminated, on the first step of the run, every print_every
/// steps, on the last step, and when `force` is set. ETA = (total - step) x the mean step time of
/// this run, time_s / (step - start_step).
class ProgressBar {
 public:
  ProgressBar(int64_t total_steps, bool interactive, ProgressOptions options = {}, std::ostream& out = std::cout);
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  void update(int64_t step, const StepMetrics& m, bool force = false);
  /// Prints a line of its own (e.g. a validation result) without breaking the bar; the bar is
  /// redrawn below it on a terminal.
  void print(const std::string& line);
  /// Ends the bar's line on a terminal. Idempotent; the destructor calls it.
  void finish();

  /// The line update() would show, without '\r' or padding (with the bar when interactive).
  std::string render(int64_t step, const StepMetrics& m) const;
  /// (total - step) x mean step time of this run; negative when unknown.
  double eta_seconds(int64_t step, double time_s) const;

 private:
  void draw(const std::string& line);

  int64_t total_;
  bool interactive_;
  ProgressOptions options_;
  std::ostream& out_;
  std::string last_line_;  // the bar currently on screen (interactive)
  bool on_screen_ = false;
  bool printed_first_ = false;
};

/// Appends metrics to a JSONL file: one object per line, flushed at once, so that a crashed run
/// keeps everything up to its last step. The file is opened for appending (a resumed run adds
/// to it) and its directory is created. Raises ztrain::Error when it cannot be opened or written.
///
///   MetricsLog log("runs/a/metrics.jsonl");
///   log.write(10, {.loss = 2.1, .lr = 3e-4});      // {"step":10,"loss":2.1,"lr":0.0003,...}
///   log.write({{"step", 10}, {"val_loss", 2.3}});  // any object
class MetricsLog {
 public:
  explicit MetricsLog(std::string path);

  /// {"step", "loss", "lr", "tokens_per_s", "mem_bytes", "time_s"} plus the keys of `extra`
  /// (an object; its keys win over the standard ones). Non-finite numbers are written as null.
  void write(int64_t step, const StepMetrics& m, const nlohmann::json& extra = nlohmann::json::object());
  /// Writes `record`, which must be a JSON object, as one line.
  void write(const nlohmann::json& record);

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ofstream out_;
};

/// The objects of a JSONL file, in order; empty (whitespace-only) lines are skipped. Raises
/// ztrain::Error when the file cannot be read, or naming the file and the line number when a line
/// is not a JSON object.
std::vector<nlohmann::json> read_metrics(const std::string& path);

}  // namespace ztrain::gpt_app
