// ztrain-gpt plots: the PNG encoder (checked by an independent decoder written here, and by
// Python's zlib when a python3 is known), the canvas and font, chart layout and plot_metrics.
#include "plot.h"
#include "progress.h"
#include "test_util.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

namespace ztrain::gpt_app {
namespace {

namespace fs = std::filesystem;
using ztrain::test::error_message;

// ---- an independent PNG reader for what encode_png writes ------------------------------------

/// Bit by bit, unlike the table-driven encoder.
uint32_t reference_crc32(const uint8_t* p, size_t n) {
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1)));
  }
  return ~crc;
}

/// Reduced after every byte, unlike the encoder's blocks of 5552.
uint32_t reference_adler32(const std::vector<uint8_t>& d) {
  uint32_t a = 1, b = 0;
  for (uint8_t x : d) {
    a = (a + x) % 65521;
    b = (b + a) % 65521;
  }
  return (b << 16) | a;
}

uint32_t be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

struct Decoded {
  std::string error;  // empty when the file is valid
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;
  int stored_blocks = 0;
  Rgb at(int x, int y) const {
    const size_t i = (static_cast<size_t>(y) * width + x) * 3;
    return {rgb[i], rgb[i + 1], rgb[i + 2]};
  }
};

/// Checks the signature, every chunk's CRC, IHDR, the zlib header, the stored deflate blocks,
/// the Adler-32, the filtered size and filter bytes; returns the pixels.
Decoded decode_png(const std::vector<uint8_t>& png) {
  Decoded d;
  const uint8_t sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  if (png.size() < 8 || !std::equal(sig, sig + 8, png.begin())) return {.error = "bad signature"};
  std::vector<uint8_t> zlib;
  bool seen_ihdr = false, seen_iend = false;
  for (size_t pos = 8; pos < png.size();) {
    if (pos + 12 > png.size()) return {.error = "truncated chunk header"};
    const uint32_t len = be32(&png[pos]);
    if (pos + 12 + len > png.size()) return {.error = "truncated chunk"};
    const std::string type(png.begin() + pos + 4, png.begin() + pos + 8);
    const uint8_t* data = &png[pos + 8];
    if (reference_crc32(&png[pos + 4], len + 4) != be32(data + len)) return {.error = "bad CRC in " + type};
    if (type == "IHDR") {
      if (len != 13) return {.error = "IHDR length"};
      d.width = static_cast<int>(be32(data));
      d.height = static_cast<int>(be32(data + 4));
      if (data[8] != 8 || data[9] != 2 || data[10] != 0 || data[11] != 0 || data[12] != 0) {
        return {.error = "IHDR is not 8-bit RGB, deflate, filter 0, no interlace"};
      }
      seen_ihdr = true;
    } else if (type == "IDAT") {
      zlib.insert(zlib.end(), data, data + len);
    } else if (type == "IEND") {
      seen_iend = true;
      if (pos + 12 + len != png.size()) return {.error = "bytes after IEND"};
    }
    pos += 12 + len;
  }
  if (!seen_ihdr || !seen_iend) return {.error = "IHDR or IEND missing"};
  if (zlib.size() < 6) return {.error = "zlib stream too short"};
  if ((zlib[0] & 0x0F) != 8 || ((zlib[0] << 8) | zlib[1]) % 31 != 0 || (zlib[1] & 0x20)) {
    return {.error = "bad zlib header"};
  }
  std::vector<uint8_t> raw;
  size_t pos = 2;
  for (bool final = false; !final;) {
    if (pos + 5 > zlib.size()) return {.error = "truncated deflate block"};
    final = zlib[pos] & 1;
    if ((zlib[pos] >> 1) != 0) return {.error = "not a stored block"};
    const unsigned n = zlib[pos + 1] | (zlib[pos + 2] << 8), nn = zlib[pos + 3] | (zlib[pos + 4] << 8);
    if ((n ^ 0xFFFF) != nn) return {.error = "NLEN is not the complement of LEN"};
    pos += 5;
    if (pos + n > zlib.size()) return {.error = "stored block runs past the stream"};
    raw.insert(raw.end(), zlib.begin() + pos, zlib.begin() + pos + n);
    pos += n;
    ++d.stored_blocks;
  }
  if (pos + 4 != zlib.size()) return {.error = "zlib stream does not end with the Adler-32"};
  if (be32(&zlib[pos]) != reference_adler32(raw)) return {.error = "bad Adler-32"};
  const size_t row = static_cast<size_t>(d.width) * 3 + 1;
  if (raw.size() != row * d.height) {
    return {.error = c10::str("inflated ", raw.size(), " bytes, expected ", row * d.height)};
  }
  for (int y = 0; y < d.height; ++y) {
    if (raw[y * row] != 0) return {.error = "a row with a filter other than None"};
    d.rgb.insert(d.rgb.end(), raw.begin() + y * row + 1, raw.begin() + (y + 1) * row);
  }
  return d;
}

Decoded decode_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {.error = "cannot open " + path};
  return decode_png(std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {}));
}

class PlotFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / c10::str("ztrain_gpt_plot_test_", ::getpid(), "_",
                                                ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  fs::path dir_;
};

// ---- checksums and PNG -----------------------------------------------------------------------

TEST(Checksums, MatchKnownValues) {
  const std::string s = "123456789";
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  EXPECT_EQ(detail::crc32(p, s.size()), 0xCBF43926u);
  EXPECT_EQ(detail::crc32(p + 4, 5, detail::crc32(p, 4)), 0xCBF43926u);  // incremental
  const std::string w = "Wikipedia";
  EXPECT_EQ(detail::adler32(reinterpret_cast<const uint8_t*>(w.data()), w.size()), 0x11E60398u);
  std::vector<uint8_t> big(100000);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(255 - i % 7);
  EXPECT_EQ(detail::adler32(big.data(), big.size()), reference_adler32(big));
  EXPECT_EQ(detail::adler32(nullptr, 0), 1u);
}

TEST(Png, SmallImageRoundTrips) {
  Canvas c(3, 2, {1, 2, 3});
  c.set_pixel(0, 0, {255, 0, 0});
  c.set_pixel(2, 1, {0, 0, 255});
  c.set_pixel(5, 5, {9, 9, 9});  // clipped
  const auto d = decode_png(encode_png(c));
  ASSERT_EQ(d.error, "");
  EXPECT_EQ(d.width, 3);
  EXPECT_EQ(d.height, 2);
  EXPECT_EQ(d.rgb, c.rgb());
  EXPECT_EQ(d.at(0, 0), (Rgb{255, 0, 0}));
  EXPECT_EQ(d.at(1, 0), (Rgb{1, 2, 3}));
  EXPECT_EQ(d.at(2, 1), (Rgb{0, 0, 255}));
}

TEST(Png, LargeImageSpansSeveralStoredBlocks) {
  Canvas c(301, 257);  // 301 * 3 + 1 = 904 bytes a row, 232328 in all: four stored blocks
  for (int y = 0; y < c.height(); ++y) {
    for (int x = 0; x < c.width(); ++x) {
      c.set_pixel(x, y, {static_cast<uint8_t>(x), static_cast<uint8_t>(y), static_cast<uint8_t>(x ^ y)});
    }
  }
  const auto d = decode_png(encode_png(c));
  ASSERT_EQ(d.error, "");
  EXPECT_EQ(d.stored_blocks, 4);
  EXPECT_EQ(d.width, 301);
  EXPECT_EQ(d.height, 257);
  EXPECT_EQ(d.rgb, c.rgb());
}

TEST(Png, DecoderRejectsACorruptedFile) {  // the checker itself can fail
  const auto good = encode_png(Canvas(4, 4));
  auto bad = good;
  bad[bad.size() / 2] ^= 0x01;  // a pixel byte: IDAT's CRC breaks
  EXPECT_NE(decode_png(bad).error, "");
  EXPECT_EQ(decode_png(good).error, "");
}

TEST_F(PlotFiles, PythonZlibReadsThePng) {
  const char* python = std::getenv("ZTRAIN_PYTHON3");
  if (!python || !*python) GTEST_SKIP() << "ZTRAIN_PYTHON3 not set (CMake found no python3)";
  Canvas c(123, 45);
  c.draw_line(0, 0, 122, 44, kBlue, 2);
  const auto png = (dir_ / "p.png").string();
  write_png(png, c);
  const auto script = dir_ / "check.py";
  std::ofstream(script) << R"(import struct, sys, zlib
d = open(sys.argv[1], 'rb').read()
assert d[:8] == b'\x89PNG\r\n\x1a\n'
pos, idat, w, h = 8, b'', 0, 0
while pos < len(d):
    n, = struct.unpack('>I', d[pos:pos + 4]); t = d[pos + 4:pos + 8]; body = d[pos + 8:pos + 8 + n]
    assert struct.unpack('>I', d[pos + 8 + n:pos + 12 + n])[0] == zlib.crc32(t + body), t
    if t == b'IHDR': w, h = struct.unpack('>II', body[:8])
    if t == b'IDAT': idat += body
    pos += 12 + n
raw = zlib.decompress(idat)
assert (w, h) == (123, 45) and len(raw) == h * (3 * w + 1), (w, h, len(raw))
row = raw[0:1 + 3 * w]
assert row[0] == 0 and row[1:4] == bytes([31, 119, 180]) and row[-3:] == b'\xff\xff\xff'
print('ok')
)";
  const std::string cmd = c10::str(python, " ", script.string(), " ", png, " 2>&1");
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string output;
  char buf[256];
  while (std::fgets(buf, sizeof(buf), p)) output += buf;
  const int rc = ::pclose(p);
  EXPECT_EQ(rc, 0) << output;
  EXPECT_EQ(output, "ok\n");
}

// ---- canvas ----------------------------------------------------------------------------------

int count(const Decoded& d, Rgb c, int x0 = 0, int y0 = 0, int x1 = -1, int y1 = -1) {
  if (x1 < 0) x1 = d.width - 1;
  if (y1 < 0) y1 = d.height - 1;
  int n = 0;
  for (int y = y0; y <= y1; ++y) {
    for (int x = x0; x <= x1; ++x) n += d.at(x, y) == c;
  }
  return n;
}

int count(const Canvas& c, Rgb color) {
  int n = 0;
  for (int y = 0; y < c.height(); ++y) {
    for (int x = 0; x < c.width(); ++x) n += c.pixel(x, y) == color;
  }
  return n;
}

TEST(Canvas, LinesIncludeBothEnds) {
  Canvas c(20, 10);
  c.draw_line(2, 1, 17, 8, kBlack);
  EXPECT_EQ(c.pixel(2, 1), kBlack);
  EXPECT_EQ(c.pixel(17, 8), kBlack);
  EXPECT_EQ(count(c, kBlack), 16);  // one pixel per column of an x-major line
  for (int x = 2; x <= 17; ++x) {
    int in_column = 0;
    for (int y = 0; y < 10; ++y) in_column += c.pixel(x, y) == kBlack;
    EXPECT_EQ(in_column, 1) << "column " << x;
  }
  Canvas v(5, 30);
  v.draw_line(2, 29, 2, 0, kBlue, 2);  // upwards, two pixels thick
  EXPECT_EQ(count(v, kBlue), 60);
  v.draw_line(-50, -50, 100, 100, kBlack);  // clipped, no crash
  EXPECT_EQ(v.pixel(0, 0), kBlack);
  EXPECT_NE(error_message([&] { v.pixel(5, 0); }).find("outside"), std::string::npos);
  EXPECT_NE(error_message([&] { Canvas(0, 5); }).find("canvas size"), std::string::npos);
}

TEST(Canvas, TextUsesTheBitmapFont) {
  Canvas c(40, 20);
  c.draw_text(1, 2, "1", kBlack);
  // '1': 00100 01100 00100 00100 00100 00100 01110
  EXPECT_EQ(c.pixel(1 + 2, 2 + 0), kBlack);
  EXPECT_EQ(c.pixel(1 + 1, 2 + 1), kBlack);
  EXPECT_EQ(c.pixel(1 + 0, 2 + 0), kWhite);
  EXPECT_EQ(c.pixel(1 + 1, 2 + 6), kBlack);
  EXPECT_EQ(c.pixel(1 + 3, 2 + 6), kBlack);
  EXPECT_EQ(c.pixel(1 + 4, 2 + 6), kWhite);
  EXPECT_EQ(count(c, kBlack), 10);

  Canvas big(40, 20);
  big.draw_text(0, 0, "1", kBlack, 2);
  EXPECT_EQ(count(big, kBlack), 40);
  EXPECT_EQ(big.pixel(4, 0), kBlack);
  EXPECT_EQ(big.pixel(5, 1), kBlack);

  Canvas lower(40, 10), upper(40, 10);
  lower.draw_text(0, 0, "loss e-3", kBlack);
  upper.draw_text(0, 0, "LOSS E-3", kBlack);
  EXPECT_EQ(lower.rgb(), upper.rgb());
  EXPECT_GT(count(lower, kBlack), 30);
  EXPECT_EQ(Canvas::text_width("abc", 2), (3 * 6 - 1) * 2);

  Canvas unknown(10, 10), question(10, 10);
  unknown.draw_text(0, 0, "~", kBlack);
  question.draw_text(0, 0, "?", kBlack);
  EXPECT_EQ(unknown.rgb(), question.rgb());
}

// ---- charts ----------------------------------------------------------------------------------

TEST(Chart, NiceTicksAndLabels) {
  EXPECT_EQ(nice_ticks(0, 10, 5), (std::vector<double>{0, 2, 4, 6, 8, 10}));
  const auto t = nice_ticks(0.13, 0.87, 6);
  ASSERT_EQ(t.size(), 7u);
  EXPECT_NEAR(t.front(), 0.2, 1e-12);
  EXPECT_NEAR(t.back(), 0.8, 1e-12);
  EXPECT_EQ(tick_labels({0, 0.5, 1}), (std::vector<std::string>{"0.0", "0.5", "1.0"}));
  EXPECT_EQ(tick_labels({2, 2.25, 2.5}), (std::vector<std::string>{"2.00", "2.25", "2.50"}));
  EXPECT_EQ(tick_labels({0, 200, 400}), (std::vector<std::string>{"0", "200", "400"}));
  EXPECT_EQ(tick_labels({0, 20000, 40000}), (std::vector<std::string>{"0k", "20k", "40k"}));
  EXPECT_EQ(tick_labels({1.0e6, 1.5e6, 2.0e6}), (std::vector<std::string>{"1.0M", "1.5M", "2.0M"}));
  EXPECT_EQ(nice_ticks(3, 3), std::vector<double>{3});
}

TEST(Chart, SinglePointsAndConstantSeriesGetARange) {
  for (const auto& s : {Series{.x = {5}, .y = {2.5}}, Series{.x = {0, 1, 2}, .y = {0, 0, 0}},
                        Series{.x = {7, 7}, .y = {-3, -3}}}) {
    const auto l = chart_layout({s}, {});
    EXPECT_LT(l.x_min, s.x.front());
    EXPECT_GT(l.x_max, s.x.back());
    EXPECT_LT(l.y_min, s.y.front());
    EXPECT_GT(l.y_max, s.y.front());
    EXPECT_FALSE(l.y_ticks.empty());
    EXPECT_TRUE(std::isfinite(l.px(s.x[0])) && std::isfinite(l.py(s.y[0])));
    const auto canvas = render_chart({s}, {.title = "t"});
    EXPECT_GT(count(canvas, kBlue), 0);
  }
  EXPECT_NE(error_message([&] { chart_layout({Series{.x = {NAN}, .y = {1}}}, {}); }).find("no finite"),
            std::string::npos);
  EXPECT_NE(error_message([&] { chart_layout({Series{.x = {1, 2}, .y = {1}}}, {}); }).find("x values"),
            std::string::npos);
}

TEST(Chart, TheLineGoesThroughItsPointsInsideThePlotArea) {
  Series s{.x = {}, .y = {}, .color = kBlue};
  for (int i = 0; i <= 100; ++i) {
    s.x.push_back(i);
    s.y.push_back(10 - 0.08 * i + (i % 10 == 0 ? 0.3 : 0.0));  // falling, with spikes
  }
  const ChartOptions options{.title = "loss"};
  const auto l = chart_layout({s}, options);
  // Falling from the top left to the bottom right of the plot area.
  EXPECT_LT(l.py(s.y.front()), l.py(s.y.back()));
  EXPECT_GT(l.py(s.y.front()), l.top);
  EXPECT_LT(l.py(s.y.back()), l.bottom);
  EXPECT_GT(l.px(0), l.left);
  EXPECT_LT(l.px(100), l.right);

  const auto d = decode_png(encode_png(render_chart({s}, options)));
  ASSERT_EQ(d.error, "");
  EXPECT_EQ(d.width, 800);
  EXPECT_EQ(d.height, 500);
  for (size_t i = 0; i < s.x.size(); ++i) {
    const int x = static_cast<int>(std::lround(l.px(s.x[i]))), y = static_cast<int>(std::lround(l.py(s.y[i])));
    EXPECT_EQ(d.at(x, y), kBlue) << "point " << i << " at (" << x << ", " << y << ")";
  }
  const int blue = count(d, kBlue);
  EXPECT_GT(blue, 600);
  EXPECT_EQ(count(d, kBlue, l.left, l.top, l.right, l.bottom), blue) << "the line leaves the plot area";
  // Axes, ticks and labels are drawn in black; the title sits above the plot area.
  EXPECT_GT(count(d, kBlack, l.left, 0, l.right, l.top - 1), 20);
  EXPECT_GT(count(d, kBlack, 0, l.top, l.left - 1, l.bottom), 50);   // y tick labels
  EXPECT_GT(count(d, kBlack, l.left, l.bottom + 1, l.right, 499), 50);  // x tick labels
  for (int y = l.top; y <= l.bottom; ++y) EXPECT_EQ(d.at(l.left, y), kBlack);
}

TEST_F(PlotFiles, PlotMetricsWritesLossAndThroughput) {
  const auto metrics = (dir_ / "metrics.jsonl").string();
  {
    MetricsLog log(metrics);
    for (int step = 1; step <= 60; ++step) {
      log.write(step, {.loss = 5.0 / std::sqrt(step), .lr = 1e-3, .tokens_per_s = 1e4 + 50.0 * step,
                       .mem_bytes = 1 << 20, .time_s = step * 0.1});
      if (step % 20 == 0) log.write({{"step", step}, {"val_loss", 5.2 / std::sqrt(step)}});
    }
  }
  const auto out = (dir_ / "plots").string();
  const auto paths = plot_metrics(metrics, out);
  ASSERT_EQ(paths, (std::vector<std::string>{out + "/loss.png", out + "/throughput.png"}));
  const auto loss = decode_file(paths[0]);
  ASSERT_EQ(loss.error, "");
  EXPECT_EQ(loss.width, 800);
  EXPECT_EQ(loss.height, 500);
  EXPECT_GT(count(loss, kBlue), 300);
  EXPECT_GE(count(loss, kOrange), 3 * 49);  // three markers of 7 x 7, and the legend's
  EXPECT_EQ(count(loss, kGreen), 0);
  const auto throughput = decode_file(paths[1]);
  ASSERT_EQ(throughput.error, "");
  EXPECT_GT(count(throughput, kGreen), 300);
  EXPECT_EQ(count(throughput, kBlue), 0);

  // The loss line starts at the top left of the plot area and falls to the right.
  Series train{.x = {}, .y = {}};
  for (int step = 1; step <= 60; ++step) train.x.push_back(step), train.y.push_back(5.0 / std::sqrt(step));
  Series val{.x = {20, 40, 60}, .y = {5.2 / std::sqrt(20), 5.2 / std::sqrt(40), 5.2 / std::sqrt(60)},
             .markers = true};
  const auto l = chart_layout({train, val}, {});
  EXPECT_EQ(loss.at(static_cast<int>(std::lround(l.px(1))), static_cast<int>(std::lround(l.py(5.0)))), kBlue);
  EXPECT_EQ(loss.at(static_cast<int>(std::lround(l.px(50))), static_cast<int>(std::lround(l.py(5.0 / std::sqrt(50))))),
            kBlue);
  EXPECT_EQ(loss.at(static_cast<int>(std::lround(l.px(40))), static_cast<int>(std::lround(l.py(val.y[1])))),
            kOrange);
}

TEST_F(PlotFiles, PlotMetricsHandlesOnePointAConstantSeriesAndBadInput) {
  const auto one = dir_ / "one.jsonl";
  std::ofstream(one) << "{\"step\":3,\"loss\":2.0}\n";
  const auto paths = plot_metrics(one.string(), (dir_ / "one").string());
  ASSERT_EQ(paths.size(), 1u);  // no tokens_per_s: no throughput plot
  const auto d = decode_file(paths[0]);
  ASSERT_EQ(d.error, "");
  EXPECT_GT(count(d, kBlue), 0);

  const auto flat = dir_ / "flat.jsonl";
  {
    std::ofstream f(flat);
    for (int step = 0; step < 10; ++step) f << "{\"step\":" << step << ",\"loss\":1.0,\"tokens_per_s\":0}\n";
  }
  for (const auto& p : plot_metrics(flat.string(), (dir_ / "flat").string())) EXPECT_EQ(decode_file(p).error, "");

  const auto none = dir_ / "none.jsonl";
  std::ofstream(none) << "{\"step\":1,\"lr\":0.1}\n";
  EXPECT_NE(error_message([&] { plot_metrics(none.string(), dir_.string()); }).find("nothing to plot"),
            std::string::npos);
}

}  // namespace
}  // namespace ztrain::gpt_app
