#include <ztrain/ckpt/checkpoint.h>

#include "background_save.h"
#include "sha256.h"

#include <ztrain/ckpt/model_file.h>
#include <ztrain/ckpt/optimizer_state.h>
#include <ztrain/ckpt/safetensors.h>
#include <ztrain/error.h>
#include <ztrain/runtime/parallel_context.h>
#include <ztrain/runtime/parameter_record.h>
#include <ztrain/runtime/rng.h>
#include <ztrain/runtime/tp_rng.h>

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>

namespace ztrain {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kFiles[] = {"model.safetensors", "optimizer.safetensors", "rng.safetensors"};

/// Runs fn on rank 0 of `world`; its failure becomes every rank's (no rank is left waiting).
void on_rank0(Communicator& world, const std::function<void()>& fn) {
  std::string error;
  if (world.rank() == 0) {
    try {
      fn();
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  error = world.broadcast_bytes(error, 0);
  ZTRAIN_CHECK(error.empty(), error);
}

/// The context a checkpoint of `model` runs over (throws without one: checkpoints need a runtime).
ParallelContext& context_for(torch::nn::Module& model) {
  auto* context = context_of(model);
  ZTRAIN_CHECK(context, "checkpoint: the distributed runtime is not initialised; call "
               "ztrain::init_distributed() at the start of main() before saving or loading checkpoints");
  return *context;
}

void fsync_path(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

void write_file_atomically(const fs::path& path, const std::string& text) {
  const auto tmp = fs::path(path.string() + ".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    ZTRAIN_CHECK(out, "checkpoint: cannot write '", tmp.string(), "'");
    out << text;
    out.flush();
    ZTRAIN_CHECK(out, "checkpoint: writing '", tmp.string(), "' failed");
  }
  fsync_path(tmp);
  fs::rename(tmp, path);
  fsync_path(path.parent_path());
}

/// The suffix of the entry of the same generator's tensor-parallel tracker state (runtime/tp_rng.h).
constexpr const char* kTrackerSuffix = ".tensor_parallel";

/// rng.safetensors' entry for a rank's generator: "rank<r>" for the CPU's (as ever),
/// "rank<r>.cuda" for a device's.
std::string generator_entry(size_t rank, const at::Generator& gen) {
  const auto type = gen.device().type();
  return type == c10::kCPU ? c10::str("rank", rank) : c10::str("rank", rank, ".", c10::DeviceTypeName(type, true));
}

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

json manager_json(const optim::OptimManagerState& s) {
  json scheds = json::array();
  for (const auto& sch : s.schedulers) scheds.push_back(sch ? json{{"kind", sch->kind}, {"step", sch->step}} : json());
  return {{"scaler",
           {{"mode", static_cast<int>(s.scaler.mode)},
            {"scale", s.scaler.scale},
            {"growth_tracker", s.scaler.growth_tracker},
            {"hysteresis_left", s.scaler.hysteresis_left}}},
          {"schedulers", scheds},
          {"steps", s.steps},
          {"skipped", s.skipped}};
}

optim::OptimManagerState manager_state(const json& j) {
  optim::OptimManagerState s;
  const auto& sc = j.at("scaler");
  s.scaler = {.mode = static_cast<LossScaleMode>(sc.at("mode").get<int>()),
              .scale = sc.at("scale").get<double>(),
              .growth_tracker = sc.at("growth_tracker").get<int64_t>(),
              .hysteresis_left = sc.at("hysteresis_left").get<int64_t>()};
  for (const auto& sch : j.at("schedulers")) {
    if (sch.is_null()) {
      s.schedulers.push_back(std::nullopt);
    } else {
      s.schedulers.push_back(LRSchedulerState{sch.at("kind").get<std::string>(), sch.at("step").get<int64_t>()});
    }
  }
  s.steps = j.at("steps").get<int64_t>();
  s.skipped = j.at("skipped").get<int64_t>();
  return s;
}

std::optional<int64_t> parse_step(const std::string& name) {
  if (name.size() != 13 || name.rfind("step-", 0) != 0) return std::nullopt;
  for (size_t i = 5; i < name.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(name[i]))) return std::nullopt;
  }
  return std::stoll(name.substr(5));
}

/// The manifest's checksum of itself: the SHA-256 of the rest of it, dumped (keys sorted), so
/// that a flipped bit in a field no file hash covers (the step, the world size, the extra JSON) is
/// caught too. It is checked whenever present and required from version 2 on, so that a flip in
/// its own name or in the version is caught as well; manifests written before it (no version)
/// are read as they are.
constexpr const char* kManifestChecksum = "manifest_sha256";
constexpr int kManifestVersion = 2;

json read_manifest(const fs::path& dir) {
  const auto path = dir / "manifest.json";
  std::ifstream in(path);
  ZTRAIN_CHECK(in, "checkpoint: '", path.string(), "' is missing (an incomplete checkpoint?)");
  json manifest;
  try {
    manifest = json::parse(in);
  } catch (const std::exception& e) {
    ZTRAIN_CHECK(false, "checkpoint: '", path.string(), "' is not valid JSON: ", e.what());
  }
  ZTRAIN_CHECK(manifest.is_object(), "checkpoint: '", path.string(), "' is not a JSON object");
  const json version = manifest.value("version", json(1));
  ZTRAIN_CHECK(version.is_number_integer() && version.get<int64_t>() >= 1 && version.get<int64_t>() <= kManifestVersion,
               "checkpoint: '", path.string(), "' has manifest version ", version.dump(), "; this ztrain reads 1 to ",
               kManifestVersion, " (a newer ztrain wrote it, or it is corrupt)");
  ZTRAIN_CHECK(version.get<int64_t>() < 2 || manifest.contains(kManifestChecksum), "checkpoint: '", path.string(),
               "' is corrupt: its own SHA-256 is missing");
  if (manifest.contains(kManifestChecksum)) {
    auto rest = manifest;
    rest.erase(kManifestChecksum);
    ZTRAIN_CHECK(manifest.at(kManifestChecksum).is_string() &&
                     manifest.at(kManifestChecksum).get<std::string>() == detail::sha256_hex(rest.dump()),
                 "checkpoint: '", path.string(), "' is corrupt: its content does not match its own SHA-256");
  }
  return manifest;
}

/// A checkpoint whose model file is written and whose optimizer file is being written into
/// `tmp`, with everything its publication needs, taken when the save was called.
struct Publication {
  fs::path root, tmp, final_dir;
  int64_t step = 0;
  std::vector<std::pair<std::string, std::string>> rng;  // every rank's generator states, by entry name
  json manifest;                 // all but "files"
  CheckpointOptions options;
};

/// The part of a save on the training thread that comes before the optimizer state: the
/// temporary directory, the model file, the generator states and the manifest's contents.
Publication prepare(const std::string& root, int64_t step, const TrainingState& state, const std::string& extra_json,
                    const CheckpointOptions& options) {
  ZTRAIN_CHECK(step >= 0, "save_checkpoint: step must be >= 0, got ", step);
  json extra;
  try {
    extra = json::parse(extra_json);
  } catch (const std::exception& e) {
    ZTRAIN_CHECK(false, "save_checkpoint: extra_json is not valid JSON: ", e.what());
  }
  auto& ctx = context_for(state.model);
  auto& world = ctx.world();
  std::string tmp_dir;
  on_rank0(world, [&] {
    fs::create_directories(root);
    tmp_dir = (fs::path(root) / c10::str(".", step_name(step), ".tmp-", ::getpid())).string();
    fs::remove_all(tmp_dir);
    fs::create_directories(tmp_dir);
  });
  Publication p{.root = root, .tmp = world.broadcast_bytes(tmp_dir, 0),
                .final_dir = fs::path(root) / step_name(step), .step = step, .options = options};
  save(state.model, (p.tmp / "model.safetensors").string());
  // Every rank's generator states and tensor-parallel tracker states, written by rank 0.
  auto gens = rng::default_generators(ctx.device());
  const auto tracker = rng::tensor_parallel_states(ctx.device());
  for (size_t g = 0; g < gens.size(); ++g) {
    std::vector<std::pair<std::string, torch::Tensor>> kinds;
    kinds.reserve(2);  // (built by emplace_back: GCC 12 warns falsely about a one-element initialiser list grown)
    kinds.emplace_back("", rng::get_state(gens[g]));
    if (g < tracker.size()) kinds.emplace_back(kTrackerSuffix, tracker[g]);
    for (const auto& [suffix, mine] : kinds) {
      const auto all = world.all_gather_bytes(
          std::string_view(reinterpret_cast<const char*>(mine.data_ptr()), static_cast<size_t>(mine.nbytes())));
      for (size_t r = 0; r < all.size(); ++r) p.rng.emplace_back(generator_entry(r, gens[g]) + suffix, all[r]);
    }
  }
  const auto& topo = ctx.topology();
  p.manifest = {{"format", "ztrain-checkpoint"},
                {"version", kManifestVersion},
                {"step", step},
                {"world", {{"size", ctx.world_size()}, {"dp", topo.dp_size()}, {"tp", topo.tp_size()}, {"pp", topo.pp_size()}}},
                {"optim_manager", manager_json(state.manager.state())},
                {"extra", extra}};
  return p;
}

/// Once every file but rng.safetensors is in p.tmp on every rank: calls before_publish, then
/// rank 0 writes the generator states and the manifest and publishes (collective over `world`).
void publish(const Publication& p, Communicator& world) {
  if (p.options.before_publish) p.options.before_publish();
  on_rank0(world, [&] {
    std::vector<std::pair<std::string, torch::Tensor>> rng;
    for (const auto& [name, bytes] : p.rng) {
      auto t = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
      std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
      rng.emplace_back(name, t);
    }
    ckpt::save_safetensors((p.tmp / "rng.safetensors").string(), rng);

    json files = json::object();
    for (const char* f : kFiles) files[f] = detail::sha256_file((p.tmp / f).string());
    auto manifest = p.manifest;
    manifest["files"] = files;
    manifest[kManifestChecksum] = detail::sha256_hex(manifest.dump());  // of all the rest
    write_file_atomically(p.tmp / "manifest.json", manifest.dump(2));
    fsync_path(p.tmp);
    // Into place: an older checkpoint of the same step is moved aside first, removed after.
    const fs::path aside = p.root / c10::str(".", step_name(p.step), ".old-", ::getpid());
    if (fs::exists(p.final_dir)) fs::rename(p.final_dir, aside);
    fs::rename(p.tmp, p.final_dir);
    fsync_path(p.root);
    write_file_atomically(p.root / "latest", step_name(p.step) + "\n");
    fs::remove_all(aside);
    if (p.options.keep_last > 0) {
      std::vector<std::pair<int64_t, fs::path>> dirs;
      for (const auto& d : fs::directory_iterator(p.root)) {
        if (auto s = parse_step(d.path().filename().string()); s && d.is_directory()) dirs.emplace_back(*s, d.path());
      }
      std::sort(dirs.begin(), dirs.end());
      for (size_t i = 0; i + p.options.keep_last < dirs.size(); ++i) fs::remove_all(dirs[i].second);
    }
  });
}

}  // namespace

std::string save_checkpoint(const std::string& root, int64_t step, const TrainingState& state,
                            const std::string& extra_json, const CheckpointOptions& options) {
  detail::wait_for_background_save();  // checkpoints are published in the order they were saved
  const auto p = prepare(root, step, state, extra_json, options);
  save_optimizer_state(state.model, state.optimizer, (p.tmp / "optimizer.safetensors").string());
  publish(p, context_for(state.model).world());
  return p.final_dir.string();
}

PendingSave save_checkpoint_async(const std::string& root, int64_t step, const TrainingState& state,
                                  const std::string& extra_json, const CheckpointOptions& options) {
  detail::wait_for_background_save();
  auto p = std::make_shared<const Publication>(prepare(root, step, state, extra_json, options));
  auto write_optimizer =
      detail::optimizer_state_writer(state.model, state.optimizer, (p->tmp / "optimizer.safetensors").string(), {});
  auto write = [p, write_optimizer = std::move(write_optimizer)](const detail::SaveComms& comms) {
    write_optimizer(comms);
    publish(*p, *comms.world);  // only once the optimizer file is complete on every rank
  };
  return detail::start_background_save(&context_for(state.model), p->final_dir.string(), std::move(write));
}

std::optional<std::string> latest_checkpoint(const std::string& root) {
  if (!fs::is_directory(root)) return std::nullopt;
  std::ifstream latest(fs::path(root) / "latest");
  std::string name;
  if (latest >> name && parse_step(name) && fs::exists(fs::path(root) / name / "manifest.json")) {
    return (fs::path(root) / name).string();
  }
  std::optional<std::pair<int64_t, fs::path>> best;
  for (const auto& d : fs::directory_iterator(root)) {
    auto s = parse_step(d.path().filename().string());
    if (s && fs::exists(d.path() / "manifest.json") && (!best || *s > best->first)) best = {{*s, d.path()}};
  }
  return best ? std::optional(best->second.string()) : std::nullopt;
}

std::vector<std::string> checkpoints(const std::string& root) {
  std::vector<std::pair<int64_t, std::string>> found;
  if (fs::is_directory(root)) {
    for (const auto& d : fs::directory_iterator(root)) {
      auto s = parse_step(d.path().filename().string());
      if (s && fs::exists(d.path() / "manifest.json")) found.emplace_back(*s, d.path().string());
    }
  }
  std::sort(found.begin(), found.end(), std::greater<>());
  std::vector<std::string> dirs;
  for (auto& [step, dir] : found) dirs.push_back(std::move(dir));
  return dirs;
}

namespace {

/// The manifest of `dir`, after checking every file against the SHA-256 it records.
json verified_manifest(const std::string& dir) {
  auto manifest = read_manifest(dir);
  ZTRAIN_CHECK(manifest.value("format", "") == "ztrain-checkpoint", "checkpoint: '", dir,
               "/manifest.json' is not a ztrain checkpoint manifest");
  for (const char* f : kFiles) {
    const auto path = (fs::path(dir) / f).string();
    ZTRAIN_CHECK(fs::exists(path), "checkpoint: '", path, "' is missing");
    const auto want = manifest.at("files").at(f).get<std::string>();
    const auto got = detail::sha256_file(path);
    ZTRAIN_CHECK(got == want, "checkpoint: '", path, "' is corrupt: its SHA-256 is ", got, ", the manifest says ", want);
  }
  return manifest;
}

CheckpointInfo info_of(const std::string& dir, const json& manifest) {
  return {.dir = dir,
          .step = manifest.at("step").get<int64_t>(),
          .world_size = manifest.at("world").at("size").get<int>(),
          .extra_json = manifest.at("extra").dump()};
}

}  // namespace

CheckpointInfo verify_checkpoint(const std::string& dir) {
  try {
    return info_of(dir, verified_manifest(dir));
  } catch (const json::exception& e) {
    ZTRAIN_CHECK(false, "checkpoint: '", dir, "/manifest.json' lacks a field: ", e.what());
  }
  return {};
}

CheckpointInfo load_checkpoint(const std::string& dir, const TrainingState& state) {
  auto& ctx = context_for(state.model);
  auto& world = ctx.world();
  json manifest;
  on_rank0(world, [&] { manifest = verified_manifest(dir); });
  manifest = json::parse(world.broadcast_bytes(world.rank() == 0 ? manifest.dump() : std::string(), 0));

  load(state.model, (fs::path(dir) / "model.safetensors").string());
  load_optimizer_state(state.model, state.optimizer, (fs::path(dir) / "optimizer.safetensors").string());
  state.manager.load_state(manager_state(manifest.at("optim_manager")));
  CheckpointInfo info = info_of(dir, manifest);
  if (info.world_size == world.size()) {
    ckpt::SafetensorsReader file((fs::path(dir) / "rng.safetensors").string());
    std::vector<torch::Tensor> tracker;
    for (auto& gen : rng::default_generators(ctx.device())) {
      // A checkpoint saved on the CPU has no device generator states: those keep their seeds.
      const auto name = generator_entry(world.rank(), gen);
      if (!file.contains(name)) continue;
      rng::set_state(gen, file.read(name));
      if (file.contains(name + kTrackerSuffix)) tracker.push_back(file.read(name + kTrackerSuffix));
    }
    if (!tracker.empty()) rng::set_tensor_parallel_states(ctx.device(), std::move(tracker));
  }
  return info;
}

}  // namespace ztrain
