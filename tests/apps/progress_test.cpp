// ztrain-gpt progress: formatting helpers, the interactive and plain progress display, the JSONL
// metrics log with its reader, and the TensorBoard writer's checksum.
#include "progress.h"
#include "tensorboard.h"
#include "test_util.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <sstream>

namespace ztrain::gpt_app {
namespace {

namespace fs = std::filesystem;
using ztrain::test::error_message;

TEST(Format, Duration) {
  EXPECT_EQ(format_duration(0), "0s");
  EXPECT_EQ(format_duration(45.2), "45s");
  EXPECT_EQ(format_duration(59.6), "1m00s");
  EXPECT_EQ(format_duration(83), "1m23s");
  EXPECT_EQ(format_duration(3600 + 180 + 20), "1h03m");
  EXPECT_EQ(format_duration(86400 + 3600 + 61), "1d01h");
  EXPECT_EQ(format_duration(-1), "?");
  EXPECT_EQ(format_duration(NAN), "?");
  EXPECT_EQ(format_duration(INFINITY), "?");
}

TEST(Format, Bytes) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1536), "1.5 KiB");
  EXPECT_EQ(format_bytes(int64_t{512} << 20), "512 MiB");
  EXPECT_EQ(format_bytes(int64_t{12} << 30), "12 GiB");
  EXPECT_EQ(format_bytes((int64_t{3} << 40) / 2), "1.5 TiB");
  EXPECT_EQ(format_bytes(-5), "?");
}

TEST(Format, Rate) {
  EXPECT_EQ(format_rate(0), "0.00");
  EXPECT_EQ(format_rate(950), "950");
  EXPECT_EQ(format_rate(12.34), "12.3");
  EXPECT_EQ(format_rate(1234), "1.23k");
  EXPECT_EQ(format_rate(12345), "12.3k");
  EXPECT_EQ(format_rate(123456), "123k");
  EXPECT_EQ(format_rate(999.7), "1.00k");
  EXPECT_EQ(format_rate(4.56e6), "4.56M");
  EXPECT_EQ(format_rate(NAN), "?");
}

StepMetrics metrics(double time_s) {
  return {.loss = 2.3451, .lr = 3e-4, .tokens_per_s = 12345, .mem_bytes = int64_t{512} << 20, .time_s = time_s};
}

TEST(ProgressBar, InteractiveRedrawsOneLineWithAllFields) {
  std::ostringstream out;
  ProgressBar bar(1000, /*interactive=*/true, {.bar_width = 10}, out);
  bar.update(120, metrics(12.0));  // 0.1 s per step: 880 steps left = 1m28s
  const std::string first = out.str();
  EXPECT_EQ(first, "\rstep 120/1000 [>         ] loss 2.345 lr 3.0e-04 12.3k tok/s mem 512 MiB ETA 1m28s");
  bar.update(500, {.loss = 1.5, .lr = 1e-4, .tokens_per_s = 10, .mem_bytes = 0, .time_s = 50.0});
  const std::string second = out.str().substr(first.size());
  EXPECT_EQ(second.rfind("\rstep 500/1000 [====>     ] loss 1.500 lr 1.0e-04 10.0 tok/s mem 0 B ETA 50s", 0), 0u)
      << second;
  EXPECT_GE(second.size(), first.size()) << "the shorter line must be padded over the previous one";
  EXPECT_EQ(out.str().find('\n'), std::string::npos);
  bar.update(1000, metrics(100.0));
  EXPECT_NE(out.str().find("[==========]"), std::string::npos);
  bar.print("validation loss 1.234");
  EXPECT_NE(out.str().find("validation loss 1.234"), std::string::npos);
  // After the message the bar is drawn again.
  EXPECT_NE(out.str().find("\rstep 1000/1000", out.str().find("validation loss")), std::string::npos);
  bar.finish();
  EXPECT_EQ(out.str().back(), '\n');
  const auto size = out.str().size();
  bar.finish();
  EXPECT_EQ(out.str().size(), size);
}

TEST(ProgressBar, PlainPrintsLinesEveryFewSteps) {
  std::ostringstream out;
  ProgressBar bar(25, /*interactive=*/false, {.print_every = 10}, out);
  for (int step = 1; step <= 25; ++step) bar.update(step, metrics(step * 2.0), step == 7);
  bar.finish();
  std::vector<std::string> lines;
  std::istringstream in(out.str());
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 5u) << out.str();  // the first, the forced 7, 10, 20, the last
  EXPECT_EQ(out.str().find('\r'), std::string::npos);
  EXPECT_EQ(out.str().find('['), std::string::npos);
  EXPECT_EQ(lines[0], "step 1/25 loss 2.345 lr 3.0e-04 12.3k tok/s mem 512 MiB elapsed 2s ETA 48s");
  EXPECT_EQ(lines[1].rfind("step 7/25 ", 0), 0u);
  EXPECT_EQ(lines[2].rfind("step 10/25 ", 0), 0u);
  EXPECT_EQ(lines[3].rfind("step 20/25 ", 0), 0u);
  EXPECT_EQ(lines[4], "step 25/25 loss 2.345 lr 3.0e-04 12.3k tok/s mem 512 MiB elapsed 50s ETA 0s");
  bar.print("done");
  EXPECT_EQ(out.str().substr(out.str().size() - 5), "done\n");
}

TEST(ProgressBar, EtaCountsFromTheStartStepOfAResumedRun) {
  std::ostringstream out;
  ProgressBar bar(1000, false, {.start_step = 900}, out);
  EXPECT_DOUBLE_EQ(bar.eta_seconds(950, 10.0), 50 * 0.2);
  EXPECT_LT(bar.eta_seconds(900, 10.0), 0);  // no step done yet: unknown
  EXPECT_NE(bar.render(900, metrics(0)).find("ETA ?"), std::string::npos);
  EXPECT_NE(error_message([&] { ProgressBar(10, false, {.print_every = 0}, out); }).find("print_every"),
            std::string::npos);
}

class MetricsFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / c10::str("ztrain_gpt_progress_test_", ::getpid(), "_",
                                                ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  void write_text(const fs::path& p, const std::string& text) {
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  fs::path dir_;
};

TEST_F(MetricsFile, RoundTripsAndAppends) {
  const auto path = (dir_ / "sub" / "metrics.jsonl").string();  // the directory is created
  {
    MetricsLog log(path);
    log.write(1, metrics(0.5));
    log.write(2, {.loss = NAN, .lr = 1e-3, .tokens_per_s = 100, .mem_bytes = 7, .time_s = 1.0},
              {{"grad_norm", 0.25}, {"lr", 2e-3}});
    log.write({{"step", 2}, {"val_loss", 2.5}});
    // Each line is on disk as soon as it is written.
    EXPECT_EQ(read_metrics(path).size(), 3u);
  }
  MetricsLog(path).write(3, metrics(1.5));  // a resumed run appends
  const auto records = read_metrics(path);
  ASSERT_EQ(records.size(), 4u);
  EXPECT_EQ(records[0].at("step"), 1);
  EXPECT_DOUBLE_EQ(records[0].at("loss").get<double>(), 2.3451);
  EXPECT_DOUBLE_EQ(records[0].at("lr").get<double>(), 3e-4);
  EXPECT_DOUBLE_EQ(records[0].at("tokens_per_s").get<double>(), 12345);
  EXPECT_EQ(records[0].at("mem_bytes"), int64_t{512} << 20);
  EXPECT_DOUBLE_EQ(records[0].at("time_s").get<double>(), 0.5);
  EXPECT_TRUE(records[1].at("loss").is_null());  // NaN
  EXPECT_DOUBLE_EQ(records[1].at("grad_norm").get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(records[1].at("lr").get<double>(), 2e-3);  // extra keys win
  EXPECT_EQ(records[2], (nlohmann::json{{"step", 2}, {"val_loss", 2.5}}));
  EXPECT_EQ(records[3].at("step"), 3);

  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line.rfind("{\"step\":1,\"loss\":", 0), 0u) << line;

  MetricsLog log(path);
  EXPECT_NE(error_message([&] { log.write(nlohmann::json::array({1, 2})); }).find("JSON object"), std::string::npos);
  EXPECT_NE(error_message([&] { log.write(4, metrics(0), nlohmann::json(3)); }).find("JSON object"),
            std::string::npos);
}

TEST_F(MetricsFile, NamesTheFileAndLineOfABadRecord) {
  const auto path = dir_ / "m.jsonl";
  write_text(path, "{\"step\":1,\"loss\":2}\n\n   \n{\"step\":2,\"loss\":\n{\"step\":3}\n");
  const auto msg = error_message([&] { read_metrics(path.string()); });
  EXPECT_NE(msg.find(path.string() + ":4:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not valid JSON"), std::string::npos) << msg;

  write_text(path, "{\"step\":1}\r\n\n[1, 2]\n");
  const auto msg2 = error_message([&] { read_metrics(path.string()); });
  EXPECT_NE(msg2.find(path.string() + ":3:"), std::string::npos) << msg2;
  EXPECT_NE(msg2.find("expected a JSON object"), std::string::npos) << msg2;

  write_text(path, "\n{\"step\":1}\r\n\n{\"step\":2}");  // blank lines, CRLF, no final newline
  EXPECT_EQ(read_metrics(path.string()).size(), 2u);
  EXPECT_NE(error_message([&] { read_metrics((dir_ / "missing.jsonl").string()); }).find("cannot open"),
            std::string::npos);
}

// The checksum of TFRecord frames: CRC-32C's check value (RFC 3720), and the empty input. The
// event files as a whole are checked by TensorBoard's own reader (tensorboard_test.sh).
TEST(TensorBoard, Crc32cMatchesTheStandardCheckValue) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
}

}  // namespace
}  // namespace ztrain::gpt_app
