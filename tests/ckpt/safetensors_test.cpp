#include <unistd.h>
#include <ztrain/ckpt/safetensors.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>

#include "test_util.h"

namespace safetensors_test {

namespace fs = std::filesystem;
namespace ck = ztrain::ckpt;
using ztrain::test::error_message;

namespace {

const std::vector<c10::ScalarType> kAllDtypes = {torch::kFloat64, torch::kFloat32, torch::kFloat16, torch::kBFloat16,
                                                 torch::kInt64,   torch::kInt32,   torch::kInt16,   torch::kInt8,
                                                 torch::kUInt8,   torch::kBool};

/// A fresh directory, removed with everything in it at the end of the test.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() / c10::str("ztrain_safetensors_", ::getpid(), "_", counter++);
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  /// Names of the files in the directory, sorted.
  std::vector<std::string> listing() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(path_)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  fs::path path_;
};

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// A safetensors file from a header text (not padded) and a data section.
std::string raw_file(const std::string& header, const std::string& data) {
  uint64_t n = header.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

/// Random values spanning the dtype's range (every bit pattern class that matters).
torch::Tensor random_tensor(c10::ScalarType dtype, const std::vector<int64_t>& shape) {
  auto opts = torch::TensorOptions().dtype(torch::kInt64);
  switch (dtype) {
    case torch::kBool:
      return torch::randint(0, 2, shape, opts).to(torch::kBool);
    case torch::kUInt8:
      return torch::randint(0, 256, shape, opts).to(dtype);
    case torch::kInt8:
      return torch::randint(-128, 128, shape, opts).to(dtype);
    case torch::kInt16:
      return torch::randint(-32768, 32768, shape, opts).to(dtype);
    case torch::kInt32:
      return torch::randint(std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max(), shape, opts)
          .to(dtype);
    case torch::kInt64:
      return torch::randint(-(int64_t{1} << 62), int64_t{1} << 62, shape, opts) * 2 + 1;
    default:
      return (torch::randn(shape, torch::kFloat64) * 1000).to(dtype);
  }
}

/// Same dtype, same shape and the same bits, element by element (NaN and -0.0 included).
::testing::AssertionResult same_bits(const torch::Tensor& got, const torch::Tensor& want) {
  if (got.scalar_type() != want.scalar_type()) {
    return ::testing::AssertionFailure() << "dtype " << got.scalar_type() << ", expected " << want.scalar_type();
  }
  if (got.sizes() != want.sizes()) {
    return ::testing::AssertionFailure() << "shape " << got.sizes() << ", expected " << want.sizes();
  }
  auto g = got.contiguous().reshape(-1), w = want.contiguous().reshape(-1);
  const auto item = static_cast<int64_t>(g.element_size());
  for (int64_t i = 0; i < g.numel(); ++i) {
    if (std::memcmp(static_cast<const char*>(g.data_ptr()) + i * item,
                    static_cast<const char*>(w.data_ptr()) + i * item, item) != 0) {
      return ::testing::AssertionFailure()
             << "element " << i << " of " << g.numel() << " is " << g[i].item() << ", expected " << w[i].item();
    }
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult has(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\"\n  does not contain \"" << part << "\"";
}

::testing::AssertionResult lacks(const std::string& text, const std::string& part) {
  if (text.find(part) == std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\"\n  contains \"" << part << "\"";
}

uint64_t header_length(const std::string& bytes) {
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  return n;
}

/// Bytes this thread has read with read/pread so far (Linux task I/O accounting).
int64_t thread_read_bytes() {
  std::ifstream in("/proc/thread-self/io");
  std::string key;
  int64_t value = 0;
  while (in >> key >> value) {
    if (key == "rchar:") return value;
  }
  ADD_FAILURE() << "/proc/thread-self/io has no rchar: this test needs Linux task I/O accounting";
  return 0;
}

}  // namespace

TEST(Safetensors, RoundtripsEveryDtypeAndShape) {
  TempDir dir;
  const std::vector<std::vector<int64_t>> shapes = {{}, {0}, {1}, {17}, {3, 5}, {2, 0, 3}, {1023}};
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (auto dtype : kAllDtypes) {
    for (const auto& shape : shapes) {
      // Names run against alphabetical order, so that "the order given" is observable.
      tensors.emplace_back(c10::str("t", 999 - tensors.size(), ".", dtype, c10::IntArrayRef(shape)),
                           random_tensor(dtype, shape));
    }
  }
  const ck::Metadata meta = {{"format", "pt"}, {"step", "12"}, {"note", "quoted \" and unicode é"}};
  const auto path = dir.file("model.safetensors");
  ck::save_safetensors(path, tensors, meta);

  const auto loaded = ck::load_safetensors(path);
  ASSERT_EQ(loaded.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(loaded[i].first, tensors[i].first);
    EXPECT_TRUE(same_bits(loaded[i].second, tensors[i].second)) << tensors[i].first;
  }
  ck::SafetensorsReader reader(path);
  EXPECT_EQ(reader.metadata(), meta);
  EXPECT_EQ(reader.data_offset() % 8, 0);
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(reader.contains(name)) << name;
    const auto& info = reader.info(name);
    EXPECT_EQ(info.dtype, t.scalar_type()) << name;
    EXPECT_EQ(c10::IntArrayRef(info.shape), t.sizes()) << name;
    EXPECT_EQ(info.numel(), t.numel()) << name;
    EXPECT_EQ(info.data_end - info.data_begin, t.numel() * t.element_size()) << name;
    EXPECT_TRUE(same_bits(reader.read(name), t)) << name;
  }
  EXPECT_FALSE(reader.contains("t.missing"));
  EXPECT_EQ(dir.listing(), std::vector<std::string>{"model.safetensors"}) << "the temporary file was left behind";
}

TEST(Safetensors, EmptyFileAndEmptyMetadataRoundtrip) {
  TempDir dir;
  const auto path = dir.file("empty.safetensors");
  ck::save_safetensors(path, {});
  ck::SafetensorsReader reader(path);
  EXPECT_TRUE(reader.entries().empty());
  EXPECT_TRUE(reader.metadata().empty());
  EXPECT_EQ(static_cast<int64_t>(file_bytes(path).size()), reader.data_offset());
}

TEST(Safetensors, DataSectionStartsEightByteAlignedForEveryHeaderLength) {
  TempDir dir;
  for (int len = 1; len <= 24; ++len) {
    const auto path = dir.file(c10::str("a", len, ".safetensors"));
    const auto t = torch::arange(3, torch::kFloat32);
    ck::save_safetensors(path, {{std::string(len, 'w'), t}});
    const auto bytes = file_bytes(path);
    const uint64_t n = header_length(bytes);
    EXPECT_EQ((8 + n) % 8, 0u) << "name length " << len;
    const std::string header = bytes.substr(8, n);
    const auto close = header.rfind('}');
    EXPECT_EQ(header.find_first_not_of(' ', close + 1), std::string::npos) << "padding is not spaces: " << header;
    EXPECT_EQ(bytes.size(), 8 + n + 12) << "the data section is not packed";
    ck::SafetensorsReader reader(path);
    EXPECT_EQ(reader.data_offset(), static_cast<int64_t>(8 + n));
    EXPECT_TRUE(same_bits(reader.read(std::string(len, 'w')), t));
  }
}

TEST(Safetensors, LaysOutDataAndHeaderInTheOrderGiven) {
  TempDir dir;
  const std::vector<ck::TensorSpec> specs = {{"z.weight", torch::kFloat32, {2, 3}},
                                             {"e.empty", torch::kFloat64, {0}},
                                             {"a.bias", torch::kInt64, {5}},
                                             {"d.empty", torch::kInt8, {4, 0}},
                                             {"m.x", torch::kBFloat16, {7}}};
  const auto path = dir.file("ordered.safetensors");
  ck::SafetensorsWriter writer(path, specs);
  int64_t offset = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& e = writer.entries()[i];
    EXPECT_EQ(e.name, specs[i].name);
    EXPECT_EQ(e.data_begin, offset) << e.name;
    offset = e.data_end;
  }
  EXPECT_EQ(offset, 24 + 40 + 14);
  for (const auto& s : specs) writer.write(s.name, random_tensor(s.dtype, s.shape));
  writer.commit();

  ck::SafetensorsReader reader(path);
  std::vector<std::string> names;
  for (const auto& e : reader.entries()) names.push_back(e.name);
  EXPECT_EQ(names, (std::vector<std::string>{"z.weight", "e.empty", "a.bias", "d.empty", "m.x"}));
  const auto header = file_bytes(path).substr(8, reader.data_offset() - 8);
  EXPECT_LT(header.find("\"z.weight\""), header.find("\"a.bias\"")) << header;
  EXPECT_LT(header.find("\"a.bias\""), header.find("\"m.x\"")) << header;
}

TEST(SafetensorsWriter, FillsEntriesFromPiecesWrittenInRandomOrder) {
  TempDir dir;
  const std::vector<ck::TensorSpec> specs = {{"a", torch::kFloat32, {1023}},  {"b", torch::kInt64, {17}},
                                             {"c", torch::kBFloat16, {5, 7}}, {"d", torch::kFloat64, {0}},
                                             {"e", torch::kUInt8, {1}},       {"f", torch::kBool, {3, 11}}};
  std::vector<torch::Tensor> full;
  for (const auto& s : specs) full.push_back(random_tensor(s.dtype, s.shape));

  std::mt19937 rng(7);
  struct Piece {
    size_t entry;
    int64_t begin, end;
  };
  std::vector<Piece> pieces;
  for (size_t i = 0; i < specs.size(); ++i) {
    const int64_t n = full[i].numel();
    std::vector<int64_t> cuts = {0, n};
    for (int k = 0; k < 5 && n > 1; ++k) cuts.push_back(std::uniform_int_distribution<int64_t>(1, n - 1)(rng));
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    for (size_t k = 0; k + 1 < cuts.size(); ++k) pieces.push_back({i, cuts[k], cuts[k + 1]});
  }
  std::shuffle(pieces.begin(), pieces.end(), rng);

  const auto path = dir.file("pieces.safetensors");
  ck::SafetensorsWriter writer(path, specs, {{"k", "v"}});
  EXPECT_EQ(fs::path(writer.temp_path()).parent_path(), fs::path(path).parent_path());
  EXPECT_EQ(writer.temp_path(), c10::str(path, ".tmp.", ::getpid()));
  for (const auto& p : pieces) {
    writer.write_range(specs[p.entry].name, p.begin, full[p.entry].reshape(-1).slice(0, p.begin, p.end));
  }
  EXPECT_FALSE(fs::exists(path)) << "the file appeared before commit";
  EXPECT_TRUE(fs::exists(writer.temp_path()));
  std::vector<int64_t> numels;
  for (const auto& t : full) numels.push_back(t.numel());
  EXPECT_EQ(writer.written_numel(), numels);
  writer.commit();
  EXPECT_TRUE(writer.committed());

  const auto loaded = ck::load_safetensors(path);
  ASSERT_EQ(loaded.size(), specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(loaded[i].first, specs[i].name);
    EXPECT_TRUE(same_bits(loaded[i].second, full[i])) << specs[i].name;
  }
  EXPECT_EQ(dir.listing(), std::vector<std::string>{"pieces.safetensors"});
}

TEST(SafetensorsWriter, CommitWithMissingEntriesFailsNamingThemAndKeepsThePreviousFile) {
  TempDir dir;
  const auto path = dir.file("model.safetensors");
  ck::save_safetensors(path, {{"old", torch::arange(6, torch::kFloat32)}});
  const auto previous = file_bytes(path);
  const std::vector<ck::TensorSpec> specs = {{"layer.0.weight", torch::kFloat32, {4, 4}},
                                             {"layer.1.weight", torch::kFloat32, {4, 4}},
                                             {"layer.2.bias", torch::kFloat32, {4}},
                                             {"layer.3.empty", torch::kFloat32, {0, 4}}};
  const auto w = torch::randn({4, 4});
  {
    ck::SafetensorsWriter writer(path, specs);
    writer.write("layer.0.weight", w);
    writer.write_range("layer.1.weight", 0, w.reshape(-1).slice(0, 0, 8));
    const auto msg = error_message([&] { writer.commit(); });
    EXPECT_TRUE(has(msg, "'layer.1.weight' (8 of 16 elements)"));
    EXPECT_TRUE(has(msg, "'layer.2.bias' (0 of 4 elements)"));
    EXPECT_TRUE(has(msg, path));
    EXPECT_TRUE(lacks(msg, "layer.0.weight"));
    EXPECT_TRUE(lacks(msg, "layer.3.empty"));
    EXPECT_TRUE(file_bytes(path) == previous) << "a failed commit changed the previous file";
    EXPECT_FALSE(writer.committed());
  }
  EXPECT_TRUE(file_bytes(path) == previous) << "the previous file changed";
  EXPECT_EQ(dir.listing(), std::vector<std::string>{"model.safetensors"}) << "the temporary was left behind";

  // Without a previous file, nothing is left at all.
  const auto fresh = dir.file("fresh.safetensors");
  {
    ck::SafetensorsWriter writer(fresh, specs);
    writer.write("layer.2.bias", torch::ones({4}));
    EXPECT_TRUE(has(error_message([&] { writer.commit(); }), "layer.0.weight"));
    EXPECT_FALSE(fs::exists(fresh));
  }
  EXPECT_FALSE(fs::exists(fresh));
  EXPECT_EQ(dir.listing(), std::vector<std::string>{"model.safetensors"});
}

TEST(SafetensorsWriter, CommitCanBeRetriedAfterTheMissingPiecesAreWritten) {
  TempDir dir;
  const auto path = dir.file("retry.safetensors");
  const auto t = torch::randn({10});
  ck::SafetensorsWriter writer(path, {{"t", torch::kFloat32, {10}}});
  writer.write_range("t", 0, t.slice(0, 0, 4));
  EXPECT_TRUE(has(error_message([&] { writer.commit(); }), "'t' (4 of 10 elements)"));
  writer.write_range("t", 4, t.slice(0, 4, 10));
  writer.commit();
  EXPECT_TRUE(same_bits(ck::SafetensorsReader(path).read("t"), t));
}

TEST(SafetensorsWriter, WritesNonContiguousTensorsInRowMajorOrder) {
  TempDir dir;
  const auto base = torch::randn({6, 8}, torch::kFloat64);
  const auto transposed = base.t();                           // 8x6, strides (1, 8)
  const auto strided = base.slice(1, 0, 8, 3);                // 6x3, step 3
  const auto expanded = torch::randn({1, 5}).expand({4, 5});  // stride 0
  const auto half = torch::randn({9, 4}).to(torch::kBFloat16).narrow(0, 2, 5).t();
  ASSERT_FALSE(transposed.is_contiguous());
  ASSERT_FALSE(strided.is_contiguous());
  ASSERT_FALSE(expanded.is_contiguous());
  ASSERT_FALSE(half.is_contiguous());
  const auto piece_src = torch::arange(20, torch::kInt32);
  const auto path = dir.file("strided.safetensors");
  ck::SafetensorsWriter writer(path, {{"transposed", torch::kFloat64, {8, 6}},
                                      {"strided", torch::kFloat64, {6, 3}},
                                      {"expanded", torch::kFloat32, {4, 5}},
                                      {"half", torch::kBFloat16, {4, 5}},
                                      {"pieces", torch::kInt32, {16}}});
  writer.write("transposed", transposed);
  writer.write("strided", strided);
  writer.write("expanded", expanded);
  writer.write("half", half);
  writer.write_range("pieces", 0, piece_src.slice(0, 0, 20, 2));                // 10 elements, stride 2
  writer.write_range("pieces", 10, piece_src.slice(0, 0, 6).view({2, 3}).t());  // 3x2 transposed
  writer.commit();

  ck::SafetensorsReader reader(path);
  EXPECT_TRUE(same_bits(reader.read("transposed"), transposed.contiguous()));
  EXPECT_TRUE(same_bits(reader.read("strided"), strided.contiguous()));
  EXPECT_TRUE(same_bits(reader.read("expanded"), expanded.contiguous()));
  EXPECT_TRUE(same_bits(reader.read("half"), half.contiguous()));
  const auto want = torch::tensor({0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 0, 3, 1, 4, 2, 5}, torch::kInt32);
  EXPECT_TRUE(same_bits(reader.read("pieces"), want));
}

TEST(SafetensorsWriter, RejectsWritesThatDoNotMatchTheEntries) {
  TempDir dir;
  const auto path = dir.file("strict.safetensors");
  ck::SafetensorsWriter writer(path, {{"w", torch::kFloat32, {4, 3}}, {"b", torch::kInt64, {4}}});
  auto msg = error_message([&] { writer.write("w", torch::zeros({4, 3}, torch::kFloat64)); });
  EXPECT_TRUE(has(msg, "'w'"));
  EXPECT_TRUE(has(msg, "Double"));
  EXPECT_TRUE(has(msg, path));
  msg = error_message([&] { writer.write("w", torch::zeros({3, 4})); });
  EXPECT_TRUE(has(msg, "[3, 4]"));
  EXPECT_TRUE(has(msg, "[4, 3]"));
  EXPECT_TRUE(has(error_message([&] { writer.write("nope", torch::zeros({4})); }), "'nope'"));
  EXPECT_TRUE(has(error_message([&] { writer.write_range("b", 2, torch::zeros({3}, torch::kInt64)); }),
                  "[2, 5) are outside entry 'b' of 4 elements"));
  EXPECT_TRUE(
      has(error_message([&] { writer.write_range("b", -1, torch::zeros({1}, torch::kInt64)); }), "outside entry 'b'"));
  EXPECT_TRUE(has(error_message([&] { writer.write_range("b", 0, torch::zeros({1}, torch::kInt32)); }), "Int"));

  writer.write_range("w", 3, torch::zeros({4}));
  EXPECT_TRUE(has(error_message([&] { writer.write_range("w", 6, torch::zeros({2})); }),
                  "elements [6, 8) of 'w' overlap elements [3, 7)"));
  EXPECT_TRUE(has(error_message([&] { writer.write_range("w", 0, torch::zeros({4})); }), "overlap"));
  EXPECT_TRUE(has(error_message([&] { writer.write("w", torch::zeros({4, 3})); }), "overlap"));
  writer.write_range("w", 0, torch::zeros({3}));  // adjacent ranges are fine
  writer.write_range("w", 7, torch::zeros({5}));
  writer.write("b", torch::zeros({4}, torch::kInt64));
  writer.commit();
  EXPECT_TRUE(has(error_message([&] { writer.write("b", torch::zeros({4}, torch::kInt64)); }), "after commit"));

  // Declarations.
  const auto other = dir.file("other.safetensors");
  EXPECT_TRUE(has(error_message([&] {
                    ck::SafetensorsWriter(other, {{"x", torch::kFloat32, {1}}, {"x", torch::kFloat32, {2}}});
                  }),
                  "'x' is declared twice"));
  EXPECT_TRUE(has(error_message([&] {
                    ck::SafetensorsWriter(other, {{"__metadata__", torch::kFloat32, {1}}});
                  }),
                  "reserved"));
  EXPECT_TRUE(has(error_message([&] {
                    ck::SafetensorsWriter(other, {{"neg", torch::kFloat32, {2, -1}}});
                  }),
                  "[2, -1]"));
  EXPECT_TRUE(has(error_message([&] {
                    ck::SafetensorsWriter(other, {{"c", torch::kComplexFloat, {2}}});
                  }),
                  "cannot hold dtype"));
  EXPECT_TRUE(has(error_message([&] { ck::SafetensorsWriter(dir.file("no/such/dir/x.safetensors"), {}); }),
                  "no/such/dir/x.safetensors"));
  EXPECT_EQ(dir.listing(), std::vector<std::string>{"strict.safetensors"});
}

TEST(SafetensorsWriter, SecondWriterOfTheSamePathInOneProcessFails) {
  TempDir dir;
  const auto path = dir.file("twice.safetensors");
  ck::SafetensorsWriter first(path, {{"t", torch::kFloat32, {3}}});
  const auto msg = error_message([&] { ck::SafetensorsWriter second(path, {{"t", torch::kFloat32, {3}}}); });
  EXPECT_TRUE(has(msg, "another SafetensorsWriter"));
  EXPECT_TRUE(has(msg, path));
  ASSERT_TRUE(fs::exists(first.temp_path())) << "the failed second writer removed the first one's file";
  first.write("t", torch::ones({3}));
  first.commit();
  EXPECT_TRUE(same_bits(ck::SafetensorsReader(path).read("t"), torch::ones({3})));
}

TEST(SafetensorsWriter, SeveralWritersFillOneFileAndTheCreatorCommits) {
  // What a gathered checkpoint does across ranks, with three writers in one process.
  TempDir dir;
  const auto path = dir.file("gathered.safetensors");
  const std::vector<ck::TensorSpec> specs = {
      {"a", torch::kFloat32, {10}}, {"b", torch::kInt16, {3, 3}}, {"c", torch::kFloat64, {5}}};
  const ck::Metadata meta = {{"step", "3"}};
  const auto a = torch::randn({10}), b = random_tensor(torch::kInt16, {3, 3}), c = torch::randn({5}, torch::kFloat64);

  ck::SafetensorsWriter owner(path, specs, meta);
  auto w1 = ck::SafetensorsWriter::open_existing(owner.temp_path(), specs, meta);
  auto w2 = ck::SafetensorsWriter::open_existing(owner.temp_path(), specs, meta);
  owner.write_range("a", 0, a.slice(0, 0, 3));
  w1.write_range("a", 3, a.slice(0, 3, 10));
  w1.write("b", b);
  w2.write_range("c", 2, c.slice(0, 2, 5));
  owner.write_range("c", 0, c.slice(0, 0, 2));
  w1.flush();
  w2.flush();
  EXPECT_TRUE(has(error_message([&] { w1.commit(); }), "open_existing cannot commit"));
  EXPECT_TRUE(has(error_message([&] { owner.commit(); }), "'a' (3 of 10 elements)"))
      << "the owner alone has not written everything";

  std::vector<int64_t> total(specs.size(), 0);
  for (const auto* w : {&owner, &w1, &w2}) {
    const auto counts = w->written_numel();
    for (size_t i = 0; i < total.size(); ++i) total[i] += counts[i];
  }
  auto too_many = total;
  ++too_many[1];
  EXPECT_TRUE(has(error_message([&] { owner.commit(too_many); }), "'b' (10 of 9 elements)"));
  owner.commit(total);

  ck::SafetensorsReader reader(path);
  EXPECT_TRUE(same_bits(reader.read("a"), a));
  EXPECT_TRUE(same_bits(reader.read("b"), b));
  EXPECT_TRUE(same_bits(reader.read("c"), c));
  EXPECT_EQ(reader.metadata(), meta);
}

TEST(SafetensorsWriter, OpenExistingChecksTheHeaderOnDisk) {
  TempDir dir;
  const auto path = dir.file("x.safetensors");
  const std::vector<ck::TensorSpec> specs = {{"a", torch::kFloat32, {10}}, {"b", torch::kInt16, {3}}};
  ck::SafetensorsWriter owner(path, specs, {{"k", "v"}});
  auto other_specs = specs;
  other_specs[1].shape = {4};
  EXPECT_TRUE(has(error_message([&] {
                    ck::SafetensorsWriter::open_existing(owner.temp_path(), other_specs, {{"k", "v"}});
                  }),
                  "does not hold the header"));
  EXPECT_TRUE(has(error_message([&] {
                    ck::SafetensorsWriter::open_existing(owner.temp_path(), specs, {{"k", "w"}});
                  }),
                  owner.temp_path()));
  EXPECT_TRUE(has(error_message([&] { ck::SafetensorsWriter::open_existing(dir.file("absent.tmp.1"), specs); }),
                  "absent.tmp.1"));
  { auto fine = ck::SafetensorsWriter::open_existing(owner.temp_path(), specs, {{"k", "v"}}); }
  EXPECT_TRUE(fs::exists(owner.temp_path())) << "a writer made by open_existing removed the creator's file";
}

TEST(SafetensorsReader, ReadsRangesAndIntoExistingTensors) {
  TempDir dir;
  const auto path = dir.file("ranges.safetensors");
  const auto mid = random_tensor(torch::kInt32, {31, 33});
  const auto flat = mid.reshape(-1);
  ck::save_safetensors(path,
                       {{"head", torch::randn({10})}, {"mid", mid}, {"tail", torch::randn({7}, torch::kFloat64)}});
  ck::SafetensorsReader reader(path);

  EXPECT_TRUE(same_bits(reader.read_range("mid", 100, 517), flat.slice(0, 100, 617)));
  EXPECT_TRUE(same_bits(reader.read_range("mid", 1022, 1), flat.slice(0, 1022, 1023)));
  EXPECT_EQ(reader.read_range("mid", 0, 0).numel(), 0);
  EXPECT_EQ(reader.read_range("mid", 1023, 0).numel(), 0);
  auto msg = error_message([&] { reader.read_range("mid", 1000, 24); });
  EXPECT_TRUE(has(msg, "[1000, 1024) are outside tensor 'mid' of 1023 elements"));
  EXPECT_TRUE(has(msg, path));
  EXPECT_TRUE(has(error_message([&] { reader.read_range("mid", -1, 2); }), "outside tensor 'mid'"));

  auto contiguous = torch::empty({3, 4}, torch::kInt32);
  reader.read_into("mid", 20, contiguous);
  EXPECT_TRUE(same_bits(contiguous, flat.slice(0, 20, 32).view({3, 4})));
  auto grid = torch::zeros({5, 3}, torch::kInt32);
  reader.read_into("mid", 10, grid.select(1, 1));  // a non-contiguous column
  EXPECT_TRUE(same_bits(grid.select(1, 1), flat.slice(0, 10, 15)));
  EXPECT_EQ(grid.select(1, 0).abs().sum().item<int64_t>() + grid.select(1, 2).abs().sum().item<int64_t>(), 0);
  EXPECT_TRUE(has(error_message([&] { reader.read_into("mid", 0, torch::empty({4}, torch::kInt64)); }),
                  "read_into was given a Long tensor"));
  EXPECT_TRUE(has(error_message([&] { reader.read_into("mid", 1020, torch::empty({4}, torch::kInt32)); }),
                  "outside tensor 'mid'"));

  msg = error_message([&] { reader.info("nope"); });
  EXPECT_TRUE(has(msg, "no tensor named 'nope'"));
  EXPECT_TRUE(has(msg, path));
  EXPECT_TRUE(has(error_message([&] { reader.read("nope"); }), "'nope'"));
}

TEST(SafetensorsReader, ReadRangeReadsOnlyTheBytesAskedFor) {
  TempDir dir;
  const auto path = dir.file("big.safetensors");
  const int64_t n = int64_t{8} << 20;  // 32 MiB of float32
  const auto big = torch::arange(n, torch::kFloat32);
  ck::save_safetensors(path, {{"big", big}});
  ck::SafetensorsReader reader(path);
  const int64_t before = thread_read_bytes();
  const auto piece = reader.read_range("big", n / 2, 1000);
  const int64_t read = thread_read_bytes() - before;
  EXPECT_TRUE(same_bits(piece, big.slice(0, n / 2, n / 2 + 1000)));
  EXPECT_GE(read, 4000);
  EXPECT_LT(read, 64 * 1024) << "read_range read " << read << " bytes for 4000";
}

TEST(SafetensorsReader, ReadsHeaderOrderThatDiffersFromDataOrderAndGaps) {
  // As Hugging Face's writer lays files out: keys sorted, data sorted by alignment.
  TempDir dir;
  const auto path = dir.file("foreign.safetensors");
  const auto x = torch::tensor({1.5, -2.0}, torch::kFloat64), y = torch::tensor({7, 8, 9}, torch::kInt16);
  std::string data(4, '\xAB');  // a gap before y
  data.append(static_cast<const char*>(y.data_ptr()), 6);
  data.append(static_cast<const char*>(x.data_ptr()), 16);
  write_file(path, raw_file(R"({"a.x":{"dtype":"F64","shape":[2],"data_offsets":[10,26]},)"
                            R"("b.y":{"dtype":"I16","shape":[3],"data_offsets":[4,10]},"__metadata__":null})",
                            data));
  ck::SafetensorsReader reader(path);
  ASSERT_EQ(reader.entries().size(), 2u);
  EXPECT_EQ(reader.entries()[0].name, "b.y");
  EXPECT_EQ(reader.entries()[1].name, "a.x");
  EXPECT_TRUE(same_bits(reader.read("a.x"), x));
  EXPECT_TRUE(same_bits(reader.read("b.y"), y));
  EXPECT_TRUE(reader.metadata().empty());
}

TEST(SafetensorsReader, ReportsEveryKindOfCorruptionNamingTheFile) {
  TempDir dir;
  const auto good_path = dir.file("good.safetensors");
  ck::save_safetensors(good_path, {{"w", torch::randn({4, 4})}, {"b", torch::randn({4})}});
  const auto good = file_bytes(good_path);

  struct Case {
    std::string name;
    std::string bytes;
    std::string expect;
  };
  std::string huge_length = good, past_end = good, garbage = good, cut = good.substr(0, good.size() - 1);
  const uint64_t big = uint64_t{1} << 40, one_past = good.size() - 8 + 1;
  std::memcpy(huge_length.data(), &big, 8);
  std::memcpy(past_end.data(), &one_past, 8);
  garbage[8] = 'x';
  const std::string f32x4(16, '\0');
  const std::vector<Case> cases = {
      {"empty", "", "truncated: 0 bytes"},
      {"five_bytes", std::string("\x10\0\0\0\0", 5), "truncated: 5 bytes"},
      {"huge_length", huge_length, "header length 1099511627776 runs past the end"},
      {"past_end", past_end, "runs past the end of the file"},
      {"garbage", garbage, "not valid JSON"},
      {"cut_data", cut, "tensor 'b': data_offsets [64, 80] run past the end of the data section (79 bytes)"},
      {"not_object", raw_file("[1, 2]", ""), "not a JSON object"},
      {"unknown_dtype", raw_file(R"({"q":{"dtype":"F8_E5M2","shape":[4],"data_offsets":[0,4]}})", "abcd"),
       "tensor 'q': unknown safetensors dtype \"F8_E5M2\""},
      {"overlap",
       raw_file(R"({"p":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                R"("q":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                f32x4),
       "tensors 'p' [0, 16) and 'q' [8, 16) overlap"},
      {"beyond", raw_file(R"({"p":{"dtype":"F32","shape":[4],"data_offsets":[4,20]}})", f32x4),
       "tensor 'p': data_offsets [4, 20] run past the end of the data section (16 bytes)"},
      {"wrong_size", raw_file(R"({"p":{"dtype":"F32","shape":[4],"data_offsets":[0,12]}})", f32x4),
       "tensor 'p': data_offsets [0, 12] hold 12 bytes but shape [4] of F32 needs 16"},
      {"reversed", raw_file(R"({"p":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", f32x4),
       "\"data_offsets\" must be [begin, end]"},
      {"float_offsets", raw_file(R"({"p":{"dtype":"F32","shape":[4],"data_offsets":[0.0,16.0]}})", f32x4),
       "\"data_offsets\" must be [begin, end]"},
      {"negative_dim", raw_file(R"({"p":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})", f32x4),
       "holds a non-integer or negative"},
      {"no_dtype", raw_file(R"({"p":{"shape":[4],"data_offsets":[0,16]}})", f32x4), "\"dtype\" is missing"},
      {"overflow", raw_file(R"({"p":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,16]}})", f32x4),
       "needs more than 2^63"},
      {"metadata_value", raw_file(R"({"__metadata__":{"step":3}})", ""), "metadata value of \"step\" is not a string"},
  };
  for (const auto& c : cases) {
    const auto path = dir.file(c.name + ".safetensors");
    write_file(path, c.bytes);
    const auto msg = error_message([&] { ck::SafetensorsReader reader(path); });
    EXPECT_TRUE(has(msg, path)) << c.name;
    EXPECT_TRUE(has(msg, c.expect)) << c.name;
  }

  const auto missing = dir.file("missing.safetensors");
  EXPECT_TRUE(has(error_message([&] { ck::load_safetensors(missing); }), missing + " does not exist"));

  // A BOOL byte other than 0 or 1 is found when the tensor is read.
  const auto bad_bool = dir.file("bad_bool.safetensors");
  write_file(bad_bool,
             raw_file(R"({"m":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})", std::string("\1\0\2", 3)));
  ck::SafetensorsReader reader(bad_bool);
  const auto msg = error_message([&] { reader.read("m"); });
  EXPECT_TRUE(has(msg, "BOOL tensor 'm' holds byte 2 at element 2"));
  EXPECT_TRUE(has(msg, bad_bool));
}

// ---- interop with an independent Python implementation ---------------------------------------
// Registered by tests/ckpt/CMakeLists.txt only when python3 with numpy is found: the
// safetensors_interop.* tests run safetensors_check.py write, then these two tests, then
// safetensors_check.py check. Disabled in the plain run, which has no Python file to read.

namespace {

struct InteropTensor {
  std::string name;
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
};

// Mirrors TENSORS in safetensors_check.py: change both together.
const std::vector<InteropTensor> kInteropTensors = {
    {"f64", torch::kFloat64, {3, 5}},       {"f32", torch::kFloat32, {17}},
    {"f16", torch::kFloat16, {2, 3, 4}},    {"bf16", torch::kBFloat16, {1023}},
    {"i64", torch::kInt64, {4, 4}},         {"i32", torch::kInt32, {7}},
    {"i16", torch::kInt16, {3, 1}},         {"i8", torch::kInt8, {9}},
    {"u8", torch::kUInt8, {2, 5}},          {"bool", torch::kBool, {11}},
    {"scalar", torch::kFloat32, {}},        {"empty", torch::kFloat32, {0}},
    {"empty_3d", torch::kInt64, {2, 0, 3}}, {"i64_extremes", torch::kInt64, {4}},
    {"f32_special", torch::kFloat32, {6}},  {"h.0.attn.c_attn.weight", torch::kFloat32, {2, 3}},
    {"unicode.名前", torch::kInt32, {2}},
};

torch::Tensor interop_value(const InteropTensor& t) {
  if (t.name == "i64_extremes") {
    return torch::tensor(
        std::vector<int64_t>{std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), 0, -1});
  }
  if (t.name == "f32_special") {
    const float inf = std::numeric_limits<float>::infinity();
    return torch::tensor(std::vector<float>{inf, -inf, -0.0f, std::ldexp(1.0f, -140), std::numeric_limits<float>::max(),
                                            std::numeric_limits<float>::quiet_NaN()});
  }
  int64_t n = 1;
  for (auto d : t.shape) n *= d;
  const auto k = torch::arange(n, torch::kInt64);
  torch::Tensor v;
  if (c10::isFloatingType(t.dtype)) {
    v = ((k % 50) - 17).to(torch::kFloat64) * 0.5;
  } else if (t.dtype == torch::kUInt8) {
    v = (k * 37) % 251;
  } else if (t.dtype == torch::kBool) {
    v = (k % 3) == 0;
  } else {
    v = (k * 37) % 251 - 125;
  }
  return v.to(t.dtype).reshape(t.shape);
}

std::string interop_dir() {
  const char* dir = std::getenv("ZTRAIN_SAFETENSORS_INTEROP_DIR");
  if (dir == nullptr) {
    ADD_FAILURE() << "ZTRAIN_SAFETENSORS_INTEROP_DIR is not set: run the safetensors_interop tests through ctest";
    return {};
  }
  return dir;
}

}  // namespace

TEST(SafetensorsInterop, DISABLED_ReadsAFileWrittenByPython) {
  const auto dir = interop_dir();
  ASSERT_FALSE(dir.empty());
  ck::SafetensorsReader reader(dir + "/from_python.safetensors");
  EXPECT_EQ(reader.metadata(), (ck::Metadata{{"format", "pt"}, {"writer", "numpy"}, {"step", "7"}}));
  ASSERT_EQ(reader.entries().size(), kInteropTensors.size());
  for (size_t i = 1; i < reader.entries().size(); ++i) {
    EXPECT_LE(reader.entries()[i - 1].data_end, reader.entries()[i].data_begin) << "entries() not in data order";
  }
  for (const auto& t : kInteropTensors) {
    ASSERT_TRUE(reader.contains(t.name)) << t.name;
    EXPECT_TRUE(same_bits(reader.read(t.name), interop_value(t))) << t.name;
  }
}

TEST(SafetensorsInterop, DISABLED_WritesAFileForPython) {
  const auto dir = interop_dir();
  ASSERT_FALSE(dir.empty());
  const auto path = dir + "/from_cpp.safetensors";
  fs::remove(path);
  std::vector<ck::TensorSpec> specs;
  for (const auto& t : kInteropTensors) specs.push_back({t.name, t.dtype, t.shape});
  ck::SafetensorsWriter writer(path, specs, {{"format", "pt"}, {"writer", "ztrain"}, {"step", "42"}});
  for (auto it = kInteropTensors.rbegin(); it != kInteropTensors.rend(); ++it) {
    const auto v = interop_value(*it);
    if (v.numel() > 1) {  // in two pieces, the second first
      const int64_t half = v.numel() / 2;
      writer.write_range(it->name, half, v.reshape(-1).slice(0, half));
      writer.write_range(it->name, 0, v.reshape(-1).slice(0, 0, half));
    } else {
      writer.write(it->name, v);
    }
  }
  writer.commit();
}

}  // namespace safetensors_test
