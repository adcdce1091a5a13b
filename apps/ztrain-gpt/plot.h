#pragma once
/// PNG plots of the metrics of ztrain-gpt, without external libraries.
///
/// Three layers: a PNG encoder (8-bit RGB; the zlib stream holds stored, i.e. uncompressed,
/// deflate blocks, with CRC-32 and Adler-32 computed here); a raster Canvas with lines and a
/// built-in 5x7 bitmap font; and line charts with axes, tick labels, a title and a legend.
///
///   auto paths = plot_metrics("runs/a/metrics.jsonl", "runs/a");  // runs/a/loss.png, ...
///
///   Canvas c(200, 100);
///   c.draw_line(0, 99, 199, 0, kBlack);
///   c.draw_text(4, 4, "LOSS 2.5", kBlack);
///   write_png("line.png", c);
///
/// Nothing here is collective; call it on one rank. Not thread-safe per object.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ztrain::gpt_app {

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
  bool operator==(const Rgb&) const = default;
};
inline constexpr Rgb kWhite{255, 255, 255};
inline constexpr Rgb kBlack{0, 0, 0};
inline constexpr Rgb kGrid{225, 225, 225};
inline constexpr Rgb kBlue{31, 119, 180};
inline constexpr Rgb kOrange{255, 127, 14};
inline constexpr Rgb kGreen{44, 160, 44};

/// An RGB raster, row-major from the top-left pixel. Drawing outside the canvas is clipped.
class Canvas {
 public:
  /// Raises ztrain::Error unless 1 <= width, height <= 16384.
  Canvas(int width, int height, Rgb background = kWhite);

  int width() const { return width_; }
  int height() const { return height_; }
  /// Raises ztrain::Error outside the canvas.
  Rgb pixel(int x, int y) const;
  void set_pixel(int x, int y, Rgb c);
  /// Fills x in [x0, x1], y in [y0, y1] (inclusive, either order).
  void fill_rect(int x0, int y0, int x1, int y1, Rgb c);
  /// Bresenham line from (x0, y0) to (x1, y1), both ends included; `thickness` px square pen.
  void draw_line(int x0, int y0, int x1, int y1, Rgb c, int thickness = 1);
  /// Text in the built-in 5x7 font with its top-left corner at (x, y), each font pixel a
  /// scale x scale block. Lower-case letters are drawn as capitals; a character the font lacks
  /// as '?'. Characters: A-Z 0-9 space . , - + : / ( ) _ % = ? < > [ ] * '
  void draw_text(int x, int y, std::string_view text, Rgb c, int scale = 1);
  static int text_width(std::string_view text, int scale = 1);
  static int text_height(int scale = 1) { return 7 * scale; }

  /// width * height * 3 bytes, RGB.
  const std::vector<uint8_t>& rgb() const { return rgb_; }

 private:
  int width_, height_;
  std::vector<uint8_t> rgb_;
};

/// The bytes of a PNG file of the canvas: 8-bit RGB, no interlace, filter 0 on every row, IDAT
/// a zlib stream of stored deflate blocks (<= 65535 bytes each).
std::vector<uint8_t> encode_png(const Canvas& canvas);
/// Writes encode_png(canvas) to `path`; raises ztrain::Error when it cannot.
void write_png(const std::string& path, const Canvas& canvas);

/// One data series of a chart. Points with a non-finite x or y are left out.
struct Series {
  std::string label;
  std::vector<double> x, y;
  Rgb color = kBlue;
  bool markers = false;  // squares at the points instead of a polyline
};

struct ChartOptions {
  std::string title;
  std::string x_label = "step";
  int width = 800;
  int height = 500;
};

/// Where a chart puts things: the plot area [left, right] x [top, bottom] in pixels, the data
/// ranges mapped onto it (the data's range with a small margin; a single value or a constant
/// series gets a range around it), and the tick values.
struct ChartLayout {
  int left = 0, top = 0, right = 0, bottom = 0;
  double x_min = 0, x_max = 1, y_min = 0, y_max = 1;
  std::vector<double> x_ticks, y_ticks;
  /// Pixel column of data x / pixel row of data y (larger y is higher up).
  double px(double x) const;
  double py(double y) const;
};

/// Raises ztrain::Error when no series has a finite point or a series' x and y differ in length.
ChartLayout chart_layout(const std::vector<Series>& series, const ChartOptions& options);
/// A line chart: grid, axes with ticks and labels, the series, title and legend.
Canvas render_chart(const std::vector<Series>& series, const ChartOptions& options);

/// "Nice" tick values (1, 2 or 5 x 10^k apart, about `target` of them) in [lo, hi].
std::vector<double> nice_ticks(double lo, double hi, int target = 6);
/// Tick labels for `ticks`, all with the same number of decimals; k/M suffixes from 10^4 up.
std::vector<std::string> tick_labels(const std::vector<double>& ticks);

/// Reads a metrics JSONL file (see MetricsLog) and writes into `output_dir` (created if needed):
///  - loss.png: "loss" against "step" as a line, and "val_loss" against "step" as markers when
///    present;
///  - throughput.png: "tokens_per_s" against "step", when present.
/// Where a step occurs more than once (a resumed run appends to the file) the last value counts.
/// Returns the paths written. Raises ztrain::Error when the file has no loss or val_loss.
std::vector<std::string> plot_metrics(const std::string& metrics_jsonl_path, const std::string& output_dir);

namespace detail {
uint32_t crc32(const uint8_t* data, size_t n, uint32_t crc = 0);
uint32_t adler32(const uint8_t* data, size_t n, uint32_t adler = 1);
}  // namespace detail

}  // namespace ztrain::gpt_app
