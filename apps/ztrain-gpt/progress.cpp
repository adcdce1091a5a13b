#include "progress.h"

#include <ztrain/error.h>

#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iterator>

namespace ztrain::gpt_app {

namespace {

template <class... Args>
std::string printf_string(const char* format, Args... args) {
  char buf[64];
  const int n = std::snprintf(buf, sizeof(buf), format, args...);
  return std::string(buf, static_cast<size_t>(std::clamp(n, 0, static_cast<int>(sizeof(buf)) - 1)));
}

std::string format_loss(double loss) { return std::isfinite(loss) ? printf_string("%.3f", loss) : "nan"; }

}  // namespace

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<int64_t>(std::llround(seconds));
  if (s < 60) return printf_string("%" PRId64 "s", s);
  if (s < 3600) return printf_string("%" PRId64 "m%02" PRId64 "s", s / 60, s % 60);
  if (s < 86400) return printf_string("%" PRId64 "h%02" PRId64 "m", s / 3600, s % 3600 / 60);
  return printf_string("%" PRId64 "d%02" PRId64 "h", s / 86400, s % 86400 / 3600);
}

std::string format_bytes(int64_t bytes) {
  if (bytes < 0) return "?";
  if (bytes < 1024) return printf_string("%" PRId64 " B", bytes);
  static const char* const kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes) / 1024;
  size_t unit = 0;
  while (v >= 1024 && unit + 1 < std::size(kUnits)) {
    v /= 1024;
    ++unit;
  }
  return printf_string(v < 10 ? "%.1f %s" : "%.0f %s", v, kUnits[unit]);
}

std::string format_rate(double per_second) {
  if (!std::isfinite(per_second) || per_second < 0) return "?";
  static const char* const kSuffixes[] = {"", "k", "M", "G", "T"};
  double v = per_second;
  size_t k = 0;
  while (v >= 999.5 && k + 1 < std::size(kSuffixes)) {
    v /= 1000;
    ++k;
  }
  const char* format = v >= 99.95 ? "%.0f%s" : v >= 9.995 ? "%.1f%s" : "%.2f%s";
  return printf_string(format, v, kSuffixes[k]);
}

bool stdout_is_terminal() { return ::isatty(::fileno(stdout)) == 1; }

// ---- ProgressBar -----------------------------------------------------------------------------

ProgressBar::ProgressBar(int64_t total_steps, bool interactive, ProgressOptions options, std::ostream& out)
    : total_(total_steps), interactive_(interactive), options_(options), out_(out) {
  ZTRAIN_CHECK(total_steps >= 0, "total steps must not be negative, got ", total_steps);
  ZTRAIN_CHECK(options.print_every >= 1, "print_every must be at least 1, got ", options.print_every);
  ZTRAIN_CHECK(options.bar_width >= 1, "bar_width must be at least 1, got ", options.bar_width);
  ZTRAIN_CHECK(options.start_step >= 0, "start_step must not be negative, got ", options.start_step);
}

ProgressBar::~ProgressBar() {
  try {
    finish();
  } catch (...) {  // a destructor never throws
  }
}

double ProgressBar::eta_seconds(int64_t step, double time_s) const {
  const int64_t done = step - options_.start_step;
  if (done <= 0 || !std::isfinite(time_s) || time_s <= 0) return -1;
  return static_cast<double>(std::max<int64_t>(total_ - step, 0)) * time_s / static_cast<double>(done);
}

std::string ProgressBar::render(int64_t step, const StepMetrics& m) const {
  std::string line = "step " + std::to_string(step) + "/" + std::to_string(total_);
  if (interactive_) {
    const double fraction = total_ > 0 ? std::clamp(static_cast<double>(step) / static_cast<double>(total_), 0.0, 1.0)
                                       : 1.0;
    const int width = options_.bar_width;
    const int filled = static_cast<int>(fraction * width);
    std::string bar(static_cast<size_t>(width), ' ');
    std::fill_n(bar.begin(), filled, '=');
    if (filled < width && filled > 0) bar[filled - 1] = '>';
    line.append(" [").append(bar).append("]");
  }
  line.append(" loss ").append(format_loss(m.loss));
  line.append(" lr ").append(printf_string("%.1e", m.lr));
  line.append(" ").append(format_rate(m.tokens_per_s)).append(" tok/s");
  line.append(" mem ").append(format_bytes(m.mem_bytes));
  if (!interactive_) line.append(" elapsed ").append(format_duration(m.time_s));
  line.append(" ETA ").append(format_duration(eta_seconds(step, m.time_s)));
  return line;
}

void ProgressBar::draw(const std::string& line) {
  std::string padded = line;
  if (padded.size() < last_line_.size()) padded.append(last_line_.size() - padded.size(), ' ');
  out_ << '\r' << padded << std::flush;
  last_line_ = line;
  on_screen_ = true;
}

void ProgressBar::update(int64_t step, const StepMetrics& m, bool force) {
  const auto line = render(step, m);
  if (interactive_) {
    draw(line);
    return;
  }
  if (force || !printed_first_ || step % options_.print_every == 0 || step >= total_) {
    out_ << line << '\n' << std::flush;
    printed_first_ = true;
  }
}

void ProgressBar::print(const std::string& line) {
  if (interactive_ && on_screen_) {
    const std::string bar = last_line_;
    draw(line);
    out_ << '\n';
    last_line_.clear();
    draw(bar);
    return;
  }
  out_ << line << '\n' << std::flush;
}

void ProgressBar::finish() {
  if (interactive_ && on_screen_) {
    out_ << '\n' << std::flush;
    on_screen_ = false;
    last_line_.clear();
  }
}

// ---- MetricsLog ------------------------------------------------------------------------------

MetricsLog::MetricsLog(std::string path) : path_(std::move(path)) {
  const auto parent = std::filesystem::path(path_).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
    ZTRAIN_CHECK(!ec, "cannot create the directory of metrics file ", path_, ": ", ec.message());
  }
  out_.open(path_, std::ios::out | std::ios::app);
  ZTRAIN_CHECK(out_.is_open(), "cannot open metrics file ", path_, " for appending");
}

void MetricsLog::write(int64_t step, const StepMetrics& m, const nlohmann::json& extra) {
  ZTRAIN_CHECK(extra.is_object(), "extra metrics must be a JSON object, got ", extra.dump());
  // Ordered, so that a line reads step first; extra keys replace standard ones of the same name.
  nlohmann::ordered_json record = {{"step", step},           {"loss", m.loss},         {"lr", m.lr},
                                   {"tokens_per_s", m.tokens_per_s}, {"mem_bytes", m.mem_bytes},
                                   {"time_s", m.time_s}};
  for (const auto& [key, value] : extra.items()) record[key] = nlohmann::ordered_json::parse(value.dump());
  out_ << record.dump() << '\n' << std::flush;
  ZTRAIN_CHECK(out_.good(), "cannot write to metrics file ", path_);
}

void MetricsLog::write(const nlohmann::json& record) {
  ZTRAIN_CHECK(record.is_object(), "a metrics record must be a JSON object, got ", record.dump());
  out_ << record.dump() << '\n' << std::flush;
  ZTRAIN_CHECK(out_.good(), "cannot write to metrics file ", path_);
}

std::vector<nlohmann::json> read_metrics(const std::string& path) {
  std::ifstream in(path);
  ZTRAIN_CHECK(in.is_open(), "cannot open metrics file ", path);
  std::vector<nlohmann::json> records;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r\n") == std::string::npos) continue;
    auto record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    ZTRAIN_CHECK(!record.is_discarded(), path, ":", number, ": not valid JSON: ",
                 line.size() > 80 ? line.substr(0, 80) + "..." : line);
    ZTRAIN_CHECK(record.is_object(), path, ":", number, ": expected a JSON object, got ", record.type_name());
    records.push_back(std::move(record));
  }
  ZTRAIN_CHECK(!in.bad(), "error while reading metrics file ", path);
  return records;
}

}  // namespace ztrain::gpt_app
