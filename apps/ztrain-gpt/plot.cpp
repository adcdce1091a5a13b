// PNG encoding, a raster canvas with a bitmap font, and line charts of the training metrics.
//
// PNG layout written here: the 8-byte signature, then chunks (big-endian length, type, data,
// CRC-32 of type and data): IHDR (width, height, bit depth 8, colour type 2 = RGB, compression 0,
// filter 0, interlace 0), one IDAT, IEND. The IDAT data is a zlib stream: header 0x78 0x01, the
// filtered image (each row: filter byte 0, then width x RGB) cut into stored deflate blocks
// (a byte holding BFINAL and BTYPE = 00, then LEN and its complement NLEN, little-endian, then
// LEN raw bytes), and the Adler-32 of the filtered image, big-endian.
#include "plot.h"

#include "progress.h"

#include <ztrain/error.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <tuple>

namespace ztrain::gpt_app {

// ---- checksums -------------------------------------------------------------------------------

namespace detail {

uint32_t crc32(const uint8_t* data, size_t n, uint32_t crc) {
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t adler32(const uint8_t* data, size_t n, uint32_t adler) {
  constexpr uint32_t kMod = 65521;
  constexpr size_t kBlock = 5552;  // the most bytes before b can overflow 32 bits
  uint32_t a = adler & 0xFFFF, b = adler >> 16;
  while (n > 0) {
    const size_t len = std::min(n, kBlock);
    for (size_t i = 0; i < len; ++i) {
      a += data[i];
      b += a;
    }
    a %= kMod;
    b %= kMod;
    data += len;
    n -= len;
  }
  return (b << 16) | a;
}

}  // namespace detail

// ---- font ------------------------------------------------------------------------------------

namespace {

struct Glyph {
  char c;
  uint8_t rows[7];  // bit 4 is the leftmost column
};

constexpr Glyph kFont[] = {
    {' ', {0, 0, 0, 0, 0, 0, 0}},
    {'0', {0b01110, 0b10001, 0b10011, 0b10101, 0b11001, 0b10001, 0b01110}},
    {'1', {0b00100, 0b01100, 0b00100, 0b00100, 0b00100, 0b00100, 0b01110}},
    {'2', {0b01110, 0b10001, 0b00001, 0b00010, 0b00100, 0b01000, 0b11111}},
    {'3', {0b11111, 0b00010, 0b00100, 0b00010, 0b00001, 0b10001, 0b01110}},
    {'4', {0b00010, 0b00110, 0b01010, 0b10010, 0b11111, 0b00010, 0b00010}},
    {'5', {0b11111, 0b10000, 0b11110, 0b00001, 0b00001, 0b10001, 0b01110}},
    {'6', {0b00110, 0b01000, 0b10000, 0b11110, 0b10001, 0b10001, 0b01110}},
    {'7', {0b11111, 0b00001, 0b00010, 0b00100, 0b01000, 0b01000, 0b01000}},
    {'8', {0b01110, 0b10001, 0b10001, 0b01110, 0b10001, 0b10001, 0b01110}},
    {'9', {0b01110, 0b10001, 0b10001, 0b01111, 0b00001, 0b00010, 0b01100}},
    {'A', {0b01110, 0b10001, 0b10001, 0b11111, 0b10001, 0b10001, 0b10001}},
    {'B', {0b11110, 0b10001, 0b10001, 0b11110, 0b10001, 0b10001, 0b11110}},
    {'C', {0b01110, 0b10001, 0b10000, 0b10000, 0b10000, 0b10001, 0b01110}},
    {'D', {0b11100, 0b10010, 0b10001, 0b10001, 0b10001, 0b10010, 0b11100}},
    {'E', {0b11111, 0b10000, 0b10000, 0b11110, 0b10000, 0b10000, 0b11111}},
    {'F', {0b11111, 0b10000, 0b10000, 0b11110, 0b10000, 0b10000, 0b10000}},
    {'G', {0b01110, 0b10001, 0b10000, 0b10111, 0b10001, 0b10001, 0b01111}},
    {'H', {0b10001, 0b10001, 0b10001, 0b11111, 0b10001, 0b10001, 0b10001}},
    {'I', {0b01110, 0b00100, 0b00100, 0b00100, 0b00100, 0b00100, 0b01110}},
    {'J', {0b00111, 0b00010, 0b00010, 0b00010, 0b00010, 0b10010, 0b01100}},
    {'K', {0b10001, 0b10010, 0b10100, 0b11000, 0b10100, 0b10010, 0b10001}},
    {'L', {0b10000, 0b10000, 0b10000, 0b10000, 0b10000, 0b10000, 0b11111}},
    {'M', {0b10001, 0b11011, 0b10101, 0b10101, 0b10001, 0b10001, 0b10001}},
    {'N', {0b10001, 0b10001, 0b11001, 0b10101, 0b10011, 0b10001, 0b10001}},
    {'O', {0b01110, 0b10001, 0b10001, 0b10001, 0b10001, 0b10001, 0b01110}},
    {'P', {0b11110, 0b10001, 0b10001, 0b11110, 0b10000, 0b10000, 0b10000}},
    {'Q', {0b01110, 0b10001, 0b10001, 0b10001, 0b10101, 0b10010, 0b01101}},
    {'R', {0b11110, 0b10001, 0b10001, 0b11110, 0b10100, 0b10010, 0b10001}},
    {'S', {0b01111, 0b10000, 0b10000, 0b01110, 0b00001, 0b00001, 0b11110}},
    {'T', {0b11111, 0b00100, 0b00100, 0b00100, 0b00100, 0b00100, 0b00100}},
    {'U', {0b10001, 0b10001, 0b10001, 0b10001, 0b10001, 0b10001, 0b01110}},
    {'V', {0b10001, 0b10001, 0b10001, 0b10001, 0b10001, 0b01010, 0b00100}},
    {'W', {0b10001, 0b10001, 0b10001, 0b10101, 0b10101, 0b10101, 0b01010}},
    {'X', {0b10001, 0b10001, 0b01010, 0b00100, 0b01010, 0b10001, 0b10001}},
    {'Y', {0b10001, 0b10001, 0b10001, 0b01010, 0b00100, 0b00100, 0b00100}},
    {'Z', {0b11111, 0b00001, 0b00010, 0b00100, 0b01000, 0b10000, 0b11111}},
    {'.', {0b00000, 0b00000, 0b00000, 0b00000, 0b00000, 0b01100, 0b01100}},
    {',', {0b00000, 0b00000, 0b00000, 0b00000, 0b01100, 0b00100, 0b01000}},
    {'-', {0b00000, 0b00000, 0b00000, 0b11111, 0b00000, 0b00000, 0b00000}},
    {'+', {0b00000, 0b00100, 0b00100, 0b11111, 0b00100, 0b00100, 0b00000}},
    {':', {0b00000, 0b01100, 0b01100, 0b00000, 0b01100, 0b01100, 0b00000}},
    {'/', {0b00000, 0b00001, 0b00010, 0b00100, 0b01000, 0b10000, 0b00000}},
    {'(', {0b00010, 0b00100, 0b01000, 0b01000, 0b01000, 0b00100, 0b00010}},
    {')', {0b01000, 0b00100, 0b00010, 0b00010, 0b00010, 0b00100, 0b01000}},
    {'[', {0b01110, 0b01000, 0b01000, 0b01000, 0b01000, 0b01000, 0b01110}},
    {']', {0b01110, 0b00010, 0b00010, 0b00010, 0b00010, 0b00010, 0b01110}},
    {'<', {0b00010, 0b00100, 0b01000, 0b10000, 0b01000, 0b00100, 0b00010}},
    {'>', {0b01000, 0b00100, 0b00010, 0b00001, 0b00010, 0b00100, 0b01000}},
    {'_', {0b00000, 0b00000, 0b00000, 0b00000, 0b00000, 0b00000, 0b11111}},
    {'%', {0b11000, 0b11001, 0b00010, 0b00100, 0b01000, 0b10011, 0b00011}},
    {'=', {0b00000, 0b00000, 0b11111, 0b00000, 0b11111, 0b00000, 0b00000}},
    {'*', {0b00000, 0b00100, 0b10101, 0b01110, 0b10101, 0b00100, 0b00000}},
    {'\'', {0b00100, 0b00100, 0b01000, 0b00000, 0b00000, 0b00000, 0b00000}},
    {'?', {0b01110, 0b10001, 0b00001, 0b00010, 0b00100, 0b00000, 0b00100}},
};

const Glyph& glyph(char c) {
  if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
  for (const auto& g : kFont) {
    if (g.c == c) return g;
  }
  return glyph('?');
}

constexpr int kGlyphAdvance = 6;  // 5 columns and one of space

}  // namespace

// ---- Canvas ----------------------------------------------------------------------------------

Canvas::Canvas(int width, int height, Rgb background) : width_(width), height_(height) {
  ZTRAIN_CHECK(width >= 1 && height >= 1 && width <= 16384 && height <= 16384,
               "canvas size must be 1..16384 x 1..16384, got ", width, " x ", height);
  rgb_.resize(static_cast<size_t>(width) * height * 3);
  for (size_t i = 0; i < rgb_.size(); i += 3) {
    rgb_[i] = background.r;
    rgb_[i + 1] = background.g;
    rgb_[i + 2] = background.b;
  }
}

Rgb Canvas::pixel(int x, int y) const {
  ZTRAIN_CHECK(x >= 0 && x < width_ && y >= 0 && y < height_, "pixel (", x, ", ", y, ") is outside the ", width_,
               " x ", height_, " canvas");
  const size_t i = (static_cast<size_t>(y) * width_ + x) * 3;
  return {rgb_[i], rgb_[i + 1], rgb_[i + 2]};
}

void Canvas::set_pixel(int x, int y, Rgb c) {
  if (x < 0 || x >= width_ || y < 0 || y >= height_) return;
  const size_t i = (static_cast<size_t>(y) * width_ + x) * 3;
  rgb_[i] = c.r;
  rgb_[i + 1] = c.g;
  rgb_[i + 2] = c.b;
}

void Canvas::fill_rect(int x0, int y0, int x1, int y1, Rgb c) {
  if (x0 > x1) std::swap(x0, x1);
  if (y0 > y1) std::swap(y0, y1);
  x0 = std::max(x0, 0), y0 = std::max(y0, 0);
  x1 = std::min(x1, width_ - 1), y1 = std::min(y1, height_ - 1);
  for (int y = y0; y <= y1; ++y) {
    for (int x = x0; x <= x1; ++x) set_pixel(x, y, c);
  }
}

void Canvas::draw_line(int x0, int y0, int x1, int y1, Rgb c, int thickness) {
  const int lo = -(thickness - 1) / 2, hi = thickness / 2;
  const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0);
  const int sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
  int err = dx + dy;
  for (;;) {
    if (thickness <= 1) {
      set_pixel(x0, y0, c);
    } else {
      fill_rect(x0 + lo, y0 + lo, x0 + hi, y0 + hi, c);
    }
    if (x0 == x1 && y0 == y1) break;
    const int e2 = 2 * err;
    if (e2 >= dy) {
      err += dy;
      x0 += sx;
    }
    if (e2 <= dx) {
      err += dx;
      y0 += sy;
    }
  }
}

void Canvas::draw_text(int x, int y, std::string_view text, Rgb c, int scale) {
  for (char ch : text) {
    const auto& g = glyph(ch);
    for (int row = 0; row < 7; ++row) {
      for (int col = 0; col < 5; ++col) {
        if (g.rows[row] & (0x10 >> col)) {
          fill_rect(x + col * scale, y + row * scale, x + (col + 1) * scale - 1, y + (row + 1) * scale - 1, c);
        }
      }
    }
    x += kGlyphAdvance * scale;
  }
}

int Canvas::text_width(std::string_view text, int scale) {
  return text.empty() ? 0 : (static_cast<int>(text.size()) * kGlyphAdvance - 1) * scale;
}

// ---- PNG -------------------------------------------------------------------------------------

namespace {

void put_u32_be(std::vector<uint8_t>& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(v >> shift));
}

void put_chunk(std::vector<uint8_t>& out, const char (&type)[5], const std::vector<uint8_t>& data) {
  put_u32_be(out, static_cast<uint32_t>(data.size()));
  const size_t start = out.size();
  out.insert(out.end(), type, type + 4);
  out.insert(out.end(), data.begin(), data.end());
  put_u32_be(out, detail::crc32(out.data() + start, out.size() - start));
}

}  // namespace

std::vector<uint8_t> encode_png(const Canvas& canvas) {
  const int w = canvas.width(), h = canvas.height();
  const size_t row_bytes = static_cast<size_t>(w) * 3;
  std::vector<uint8_t> raw;
  raw.reserve((row_bytes + 1) * h);
  for (int y = 0; y < h; ++y) {
    raw.push_back(0);  // filter type None
    const auto* row = canvas.rgb().data() + y * row_bytes;
    raw.insert(raw.end(), row, row + row_bytes);
  }

  std::vector<uint8_t> zlib = {0x78, 0x01};  // deflate, 32 KiB window, no dictionary, check bits
  constexpr size_t kMaxStored = 65535;
  for (size_t pos = 0; pos < raw.size();) {
    const size_t len = std::min(kMaxStored, raw.size() - pos);
    const bool final = pos + len == raw.size();
    zlib.push_back(final ? 1 : 0);  // BFINAL, BTYPE = 00 (stored)
    const auto n = static_cast<uint16_t>(len), nn = static_cast<uint16_t>(~n);
    zlib.insert(zlib.end(), {static_cast<uint8_t>(n & 0xFF), static_cast<uint8_t>(n >> 8),
                             static_cast<uint8_t>(nn & 0xFF), static_cast<uint8_t>(nn >> 8)});
    zlib.insert(zlib.end(), raw.begin() + static_cast<std::ptrdiff_t>(pos),
                raw.begin() + static_cast<std::ptrdiff_t>(pos + len));
    pos += len;
  }
  put_u32_be(zlib, detail::adler32(raw.data(), raw.size()));

  std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  std::vector<uint8_t> ihdr;
  put_u32_be(ihdr, static_cast<uint32_t>(w));
  put_u32_be(ihdr, static_cast<uint32_t>(h));
  ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // bit depth, colour type RGB, compression, filter, interlace
  put_chunk(png, "IHDR", ihdr);
  put_chunk(png, "IDAT", zlib);
  put_chunk(png, "IEND", {});
  return png;
}

void write_png(const std::string& path, const Canvas& canvas) {
  const auto bytes = encode_png(canvas);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  ZTRAIN_CHECK(out.is_open(), "cannot open ", path, " for writing");
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  out.close();
  ZTRAIN_CHECK(out.good(), "cannot write ", path);
}

// ---- charts ----------------------------------------------------------------------------------

namespace {

constexpr int kTextScale = 2;

/// [lo, hi] widened by `fraction` of its span on each side; a zero span gets a range around it.
std::pair<double, double> padded_range(double lo, double hi, double fraction) {
  if (hi > lo) {
    const double pad = (hi - lo) * fraction;
    return {lo - pad, hi + pad};
  }
  const double pad = lo == 0 ? 1.0 : std::abs(lo) * 0.1;
  return {lo - pad, hi + pad};
}

}  // namespace

double ChartLayout::px(double x) const { return left + (x - x_min) / (x_max - x_min) * (right - left); }

double ChartLayout::py(double y) const { return bottom - (y - y_min) / (y_max - y_min) * (bottom - top); }

std::vector<double> nice_ticks(double lo, double hi, int target) {
  if (!(hi > lo) || !std::isfinite(lo) || !std::isfinite(hi)) return {lo};
  const double raw = (hi - lo) / std::max(target, 1);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / mag;
  const double step = (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
  std::vector<double> ticks;
  const auto first = static_cast<int64_t>(std::ceil(lo / step - 1e-9));
  const auto last = static_cast<int64_t>(std::floor(hi / step + 1e-9));
  for (int64_t i = first; i <= last && ticks.size() < 100; ++i) {
    double v = static_cast<double>(i) * step;
    if (std::abs(v) < step * 1e-9) v = 0;
    ticks.push_back(v);
  }
  return ticks;
}

std::vector<std::string> tick_labels(const std::vector<double>& ticks) {
  std::vector<std::string> labels;
  if (ticks.empty()) return labels;
  double max_abs = 0;
  for (double t : ticks) max_abs = std::max(max_abs, std::abs(t));
  const double step = ticks.size() > 1 ? ticks[1] - ticks[0] : (max_abs > 0 ? max_abs : 1.0);
  double divisor = 1;
  const char* suffix = "";
  if (max_abs >= 1e9) {
    divisor = 1e9, suffix = "G";
  } else if (max_abs >= 1e6) {
    divisor = 1e6, suffix = "M";
  } else if (max_abs >= 1e4) {
    divisor = 1e3, suffix = "k";
  }
  // The fewest decimals that show the step exactly (0.5: 1, 0.25: 2, 20: 0).
  int decimals = 0;
  for (double s = std::abs(step / divisor); decimals <= 6; ++decimals, s *= 10) {
    if (std::abs(s - std::round(s)) <= 1e-6 * std::max(1.0, s)) break;
  }
  for (double t : ticks) {
    char buf[48];
    if (decimals > 6) {
      std::snprintf(buf, sizeof(buf), "%.1e", t);
    } else {
      std::snprintf(buf, sizeof(buf), "%.*f%s", decimals, t / divisor, suffix);
    }
    labels.emplace_back(buf);
  }
  return labels;
}

ChartLayout chart_layout(const std::vector<Series>& series, const ChartOptions& options) {
  ZTRAIN_CHECK(options.width >= 200 && options.height >= 150, "a chart needs at least 200 x 150 pixels, got ",
               options.width, " x ", options.height);
  double x_lo = INFINITY, x_hi = -INFINITY, y_lo = INFINITY, y_hi = -INFINITY;
  for (const auto& s : series) {
    ZTRAIN_CHECK(s.x.size() == s.y.size(), "series \"", s.label, "\" has ", s.x.size(), " x values but ", s.y.size(),
                 " y values");
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i])) continue;
      x_lo = std::min(x_lo, s.x[i]), x_hi = std::max(x_hi, s.x[i]);
      y_lo = std::min(y_lo, s.y[i]), y_hi = std::max(y_hi, s.y[i]);
    }
  }
  ZTRAIN_CHECK(x_lo <= x_hi, "chart \"", options.title, "\" has no finite data point to plot");
  ChartLayout l;
  l.left = 110;
  l.right = options.width - 30;
  l.top = 50;
  l.bottom = options.height - 60;
  std::tie(l.x_min, l.x_max) = padded_range(x_lo, x_hi, 0.02);
  std::tie(l.y_min, l.y_max) = padded_range(y_lo, y_hi, 0.05);
  l.x_ticks = nice_ticks(l.x_min, l.x_max, std::max(2, (l.right - l.left) / 110));
  l.y_ticks = nice_ticks(l.y_min, l.y_max, std::max(2, (l.bottom - l.top) / 60));
  return l;
}

Canvas render_chart(const std::vector<Series>& series, const ChartOptions& options) {
  const auto l = chart_layout(series, options);
  Canvas c(options.width, options.height);
  const int text_h = Canvas::text_height(kTextScale);

  // Grid and ticks.
  const auto x_labels = tick_labels(l.x_ticks), y_labels = tick_labels(l.y_ticks);
  for (size_t i = 0; i < l.x_ticks.size(); ++i) {
    const int x = static_cast<int>(std::lround(l.px(l.x_ticks[i])));
    c.draw_line(x, l.top, x, l.bottom, kGrid);
    c.draw_line(x, l.bottom, x, l.bottom + 6, kBlack);
    c.draw_text(x - Canvas::text_width(x_labels[i], kTextScale) / 2, l.bottom + 12, x_labels[i], kBlack, kTextScale);
  }
  for (size_t i = 0; i < l.y_ticks.size(); ++i) {
    const int y = static_cast<int>(std::lround(l.py(l.y_ticks[i])));
    c.draw_line(l.left, y, l.right, y, kGrid);
    c.draw_line(l.left - 6, y, l.left, y, kBlack);
    c.draw_text(l.left - 12 - Canvas::text_width(y_labels[i], kTextScale), y - text_h / 2, y_labels[i], kBlack,
                kTextScale);
  }
  // Axes.
  c.draw_line(l.left, l.top, l.left, l.bottom, kBlack);
  c.draw_line(l.left, l.bottom, l.right, l.bottom, kBlack);
  c.draw_text((l.left + l.right - Canvas::text_width(options.x_label, kTextScale)) / 2, l.bottom + 12 + text_h + 10,
              options.x_label, kBlack, kTextScale);

  // Data.
  for (const auto& s : series) {
    bool have_previous = false;
    int px0 = 0, py0 = 0;
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i])) continue;
      const int px = static_cast<int>(std::lround(l.px(s.x[i])));
      const int py = static_cast<int>(std::lround(l.py(s.y[i])));
      if (s.markers) {
        c.fill_rect(px - 3, py - 3, px + 3, py + 3, s.color);
      } else if (have_previous) {
        c.draw_line(px0, py0, px, py, s.color, 2);
      } else {
        c.fill_rect(px, py, px + 1, py + 1, s.color);  // a lone first point stays visible
      }
      px0 = px, py0 = py, have_previous = true;
    }
  }

  // Title (top left) and legend (top right).
  const int header_y = (l.top - text_h) / 2;
  c.draw_text(l.left, header_y, options.title, kBlack, kTextScale);
  int x = l.right;
  for (auto it = series.rbegin(); it != series.rend(); ++it) {
    if (it->label.empty()) continue;
    x -= Canvas::text_width(it->label, kTextScale);
    c.draw_text(x, header_y, it->label, kBlack, kTextScale);
    x -= 30;
    const int y = header_y + text_h / 2;
    if (it->markers) {
      c.fill_rect(x + 8, y - 3, x + 14, y + 3, it->color);
    } else {
      c.draw_line(x, y, x + 22, y, it->color, 2);
    }
    x -= 24;
  }
  return c;
}

std::vector<std::string> plot_metrics(const std::string& metrics_jsonl_path, const std::string& output_dir) {
  const auto records = read_metrics(metrics_jsonl_path);
  // step -> value; a later record of the same step (a resumed run) replaces an earlier one.
  std::map<double, double> loss, val_loss, throughput;
  for (const auto& r : records) {
    if (!r.contains("step") || !r.at("step").is_number()) continue;
    const double step = r.at("step").get<double>();
    const auto take = [&](const char* key, std::map<double, double>& into) {
      if (r.contains(key) && r.at(key).is_number()) into[step] = r.at(key).get<double>();
    };
    take("loss", loss);
    take("val_loss", val_loss);
    take("tokens_per_s", throughput);
  }
  ZTRAIN_CHECK(!loss.empty() || !val_loss.empty(), "metrics file ", metrics_jsonl_path,
               " has no record with a numeric \"step\" and \"loss\" or \"val_loss\"; nothing to plot");
  const auto to_series = [](const std::map<double, double>& points, std::string label, Rgb color, bool markers) {
    Series s{.label = std::move(label), .color = color, .markers = markers};
    for (const auto& [x, y] : points) {
      s.x.push_back(x);
      s.y.push_back(y);
    }
    return s;
  };

  std::error_code ec;
  std::filesystem::create_directories(output_dir, ec);
  ZTRAIN_CHECK(!ec, "cannot create plot directory ", output_dir, ": ", ec.message());
  std::vector<std::string> written;

  std::vector<Series> loss_series;
  if (!loss.empty()) loss_series.push_back(to_series(loss, "train", kBlue, false));
  if (!val_loss.empty()) loss_series.push_back(to_series(val_loss, "validation", kOrange, true));
  const auto loss_path = (std::filesystem::path(output_dir) / "loss.png").string();
  write_png(loss_path, render_chart(loss_series, {.title = "loss"}));
  written.push_back(loss_path);

  if (!throughput.empty()) {
    const auto path = (std::filesystem::path(output_dir) / "throughput.png").string();
    write_png(path, render_chart({to_series(throughput, "", kGreen, false)}, {.title = "tokens/s"}));
    written.push_back(path);
  }
  return written;
}

}  // namespace ztrain::gpt_app
