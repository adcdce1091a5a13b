// ztrain._C: the native side of the Python package (python/ztrain). Ordinary torch.Tensors
// cross the boundary as the same tensors (no copy); ztrain::Error and ztrain::CommError arrive
// as ztrain.Error and ztrain.CommError with the native message; blocking calls release the GIL.
#include <ztrain/ckpt/checkpoint.h>
#include <ztrain/ckpt/model_file.h>
#include <ztrain/ckpt/optimizer_state.h>
#include <ztrain/models/fused.h>
#include <ztrain/optim/adam.h>
#include <ztrain/optim/adam_offload.h>
#include <ztrain/optim/optim_manager.h>
#include <ztrain/pipe/boundary.h>
#include <ztrain/pipe/schedule.h>
#include <ztrain/runtime/device.h>
#include <ztrain/runtime/init.h>
#include <ztrain/zero/distributed_parameter.h>
#include <ztrain/zero/init_parameters.h>
#include <ztrain/zero/memory.h>
#include <ztrain/zero/sharded_module.h>

#include <torch/extension.h>

#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace py = pybind11;
namespace zt = ztrain;

namespace {

/// A Python callable the native side may keep and drop on any thread: the last owner takes the
/// GIL to release it.
std::shared_ptr<py::function> keep(const py::function& fn) {
  return std::shared_ptr<py::function>(new py::function(fn), [](py::function* f) {
    py::gil_scoped_acquire gil;
    delete f;
  });
}

using Hyper = std::tuple<double, double, double, double, double>;  // lr, beta1, beta2, eps, weight_decay

zt::optim::AdamOptions adam_options(const Hyper& h, bool decoupled) {
  const auto& [lr, beta1, beta2, eps, weight_decay] = h;
  return zt::optim::AdamOptions(lr)
      .betas({beta1, beta2})
      .eps(eps)
      .weight_decay(weight_decay)
      .decoupled_weight_decay(decoupled);
}

/// The native fused Adam/AdamW over the groups of a Python torch.optim.Optimizer, or AdamOffload
/// over a Python model's view (kept alive here: the optimizer refers to it).
class NativeAdam {
 public:
  NativeAdam(const std::vector<std::pair<std::vector<torch::Tensor>, Hyper>>& groups, bool decoupled,
             std::optional<int> num_threads)
      : decoupled_(decoupled), opt_(make(groups, decoupled, num_threads)) {}
  NativeAdam(std::shared_ptr<torch::nn::Module> model, const Hyper& h, std::optional<int> num_threads,
             std::optional<std::string> state_dir)
      : decoupled_(true),
        model_(std::move(model)),
        opt_(std::make_unique<zt::optim::AdamOffload>(
            *model_, adam_options(h, true),
            zt::optim::AdamEngineOptions{.num_threads = num_threads, .state_dir = std::move(state_dir)})) {}

  void set_options(size_t group, const Hyper& h) {
    ZTRAIN_CHECK(group < opt_->param_groups().size(), "optimizer group ", group, " does not exist (",
                 opt_->param_groups().size(), " groups)");
    static_cast<zt::optim::AdamOptions&>(opt_->param_groups()[group].options()) = adam_options(h, decoupled_);
  }
  void step() { opt_->step(); }
  /// Waits for AdamOffload's updates in flight and rethrows their error (nothing otherwise).
  void wait() {
    if (auto* offload = dynamic_cast<zt::optim::AdamOffload*>(opt_.get())) offload->wait();
  }
  /// The tensors of group g.
  std::vector<torch::Tensor> params(size_t group) const { return opt_->param_groups().at(group).params(); }

  /// (step, exp_avg, exp_avg_sq, master or None), or None before the parameter's first step.
  py::object state(const torch::Tensor& param) {
    const auto* s = opt_->state_of(param);
    if (!s) return py::none();
    return py::make_tuple(s->step, s->exp_avg, s->exp_avg_sq,
                          s->master.defined() ? py::cast(s->master) : py::object(py::none()));
  }
  void set_state(const torch::Tensor& param, int64_t step, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                 std::optional<torch::Tensor> master) {
    opt_->set_state(param, {.step = step, .exp_avg = std::move(exp_avg), .exp_avg_sq = std::move(exp_avg_sq),
                            .master = master ? *master : torch::Tensor()});
  }
  std::string kernel() const { return zt::optim::to_string(opt_->kernel()); }
  zt::optim::AdamW& optimizer() { return *opt_; }

 private:
  static std::unique_ptr<zt::optim::AdamW> make(const std::vector<std::pair<std::vector<torch::Tensor>, Hyper>>& groups,
                                                bool decoupled, std::optional<int> num_threads) {
    ZTRAIN_CHECK(!groups.empty(), "the optimizer got no parameter groups");
    std::vector<torch::optim::OptimizerParamGroup> native;
    for (const auto& [params, h] : groups) {
      native.emplace_back(params, std::make_unique<zt::optim::AdamOptions>(adam_options(h, decoupled)));
    }
    return std::make_unique<zt::optim::AdamW>(std::move(native), adam_options(groups.front().second, decoupled),
                                              zt::optim::AdamEngineOptions{.num_threads = num_threads});
  }

  bool decoupled_;
  std::shared_ptr<torch::nn::Module> model_;  // AdamOffload's model view
  std::unique_ptr<zt::optim::AdamW> opt_;
};

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

/// A module of a Python model's C++ view: it keeps records of its own parameters (the
/// tensor-parallel splits the Python side declares).
struct Holder : torch::nn::Module, zt::ParameterRecords {
  using torch::nn::Module::Module;
};

/// The module at the dotted `path` below `root` without its last part, made on the way, and
/// that last part.
std::pair<Holder*, std::string> parent_of(Holder& root, const std::string& path) {
  Holder* at = &root;
  size_t begin = 0;
  for (size_t dot = path.find('.'); dot != std::string::npos; begin = dot + 1, dot = path.find('.', begin)) {
    const auto part = path.substr(begin, dot - begin);
    auto children = at->named_children();
    at = children.contains(part) ? dynamic_cast<Holder*>(children[part].get())
                                 : at->register_module(part, std::make_shared<Holder>()).get();
    ZTRAIN_CHECK(at, "the model view has a Block at '", path.substr(0, dot), "' and parameters below it");
  }
  return {at, path.substr(begin)};
}

/// Tensor-parallel splits by parameter name: the dimension along which each named parameter is
/// this rank's slice of its full tensor over the default context's tp group (Megatron's cut).
using Splits = std::map<std::string, int64_t>;

/// A C++ module tree holding `named` (the Python module's parameters, the same tensors) under
/// the same dotted names, which the ZeRO engine then points into its flat buffers: what it does
/// to them, the Python module's parameters see. The parameters in `splits` are declared
/// tensor-parallel slices.
std::shared_ptr<torch::nn::Module> holder_of(const NamedTensors& named, const Splits& splits) {
  auto root = std::make_shared<Holder>("Python module");
  for (const auto& [name, tensor] : named) {
    auto [parent, last] = parent_of(*root, name);
    parent->register_parameter(last, tensor, tensor.requires_grad());
    if (const auto it = splits.find(name); it != splits.end()) {
      parent->declare_split(last, tensor, {.dim = it->second}, &zt::default_context().tp());
    }
  }
  for (const auto& [name, dim] : splits) {
    ZTRAIN_CHECK(std::ranges::any_of(named, [&](const auto& p) { return p.first == name; }), "Block: the split parameter '",
                 name, "' is not a parameter of the module");
  }
  return root;
}

/// A Python module under the ZeRO protocol (ShardedModule): its forward is a Python callable
/// over the tensors, run again in backward under recomputation.
class PyBlock : public zt::ShardedModule {
 public:
  PyBlock(const NamedTensors& named, const Splits& splits, zt::BlockOptions options)
      : ShardedModule(holder_of(named, splits), options, "Block") {}

  std::vector<torch::Tensor> forward(const py::function& fn, const std::vector<torch::Tensor>& inputs) {
    // The engine keeps the callable for the backward (recomputation).
    auto call = keep(fn);
    Fn run_python = [call](const std::vector<torch::Tensor>& in) {
      py::gil_scoped_acquire gil;
      return (*call)(in).cast<std::vector<torch::Tensor>>();
    };
    py::gil_scoped_release release;
    return run(run_python, inputs);
  }
};

/// One parameter of a Python module, sharded outside any Block (ztrain.DistributedParameter):
/// the C++ DistributedParameter, named by where the model view registers it.
class PyParameter : public zt::DistributedParameterImpl {
 public:
  PyParameter(const torch::Tensor& value, int zero_level, std::optional<int64_t> tp_split_dim)
      : DistributedParameterImpl(value, {.zero_level = zero_level,
                                         .requires_grad = value.requires_grad(),
                                         .tp_split = tp_split_dim ? std::optional<zt::TensorSplit>({.dim = *tp_split_dim})
                                                                  : std::nullopt}) {}
  bool named_by_key() const override { return true; }
};

/// What the optimizer updates: one tensor per (dtype, requires_grad) group.
std::vector<torch::Tensor> shards(const zt::ShardedModule& module) {
  std::vector<torch::Tensor> out;
  for (const auto& g : module.groups()) out.push_back(g.shard);
  return out;
}

/// (group, parameter name, offset in the group's shard, elements) of each piece of a wrapped
/// parameter that this rank's shard holds (every parameter whole at level 0).
std::vector<std::tuple<size_t, std::string, int64_t, int64_t>> pieces(const zt::ShardedModule& module) {
  std::vector<std::tuple<size_t, std::string, int64_t, int64_t>> out;
  for (size_t g = 0; g < module.groups().size(); ++g) {
    const auto& entries = module.groups()[g].layout.entries();
    if (!module.policy().shards_optimizer_state) {
      for (const auto& e : entries) out.emplace_back(g, e.name, e.offset, e.numel);
      continue;
    }
    for (const auto& p : module.groups()[g].layout.pieces(module.context().dp().rank())) {
      out.emplace_back(g, entries[p.entry].name, p.shard_offset, p.end - p.begin);
    }
  }
  return out;
}

using Blocks = std::vector<std::pair<std::string, std::shared_ptr<zt::ShardedModule>>>;

/// A Python model as the C++ side sees one: its Blocks at their paths (a Block at "" is the
/// whole model), its DistributedParameters at their parameters' names, its other parameters
/// under their names — so that ztrain::save and load name every parameter as the model without
/// Blocks would.
std::shared_ptr<torch::nn::Module> model_view(const Blocks& blocks, const NamedTensors& params) {
  if (blocks.size() == 1 && blocks[0].first.empty() && params.empty()) return blocks[0].second;
  auto root = std::make_shared<Holder>("Python model");
  for (const auto& [path, block] : blocks) {
    ZTRAIN_CHECK(!path.empty(), "a Block that is the whole model cannot hold other parameters beside it");
    auto [parent, last] = parent_of(*root, path);
    parent->register_module(last, block);
  }
  // A plain parameter is replicated on every rank: on every pipeline stage too, since the
  // Python front's stages hold only their pipeline's blocks apart.
  const int stages = zt::is_initialized() ? zt::default_context().pp().size() : 1;
  for (const auto& [name, tensor] : params) {
    auto [parent, last] = parent_of(*root, name);
    parent->register_parameter(last, tensor, tensor.requires_grad());
    parent->record(last).tied_copies = stages;
  }
  return root;
}

/// A communicator of the default context by name.
zt::Communicator& group_named(const std::string& group) {
  auto& c = zt::default_context();
  if (group == "world") return c.world();
  if (group == "dp") return c.dp();
  if (group == "tp") return c.tp();
  if (group == "stage") return c.stage();
  ZTRAIN_CHECK(group == "pp", "unknown group '", group, "': world, dp, tp, pp or stage");
  return c.pp();
}

zt::ReduceOp reduce_op(const std::string& op) {
  if (op == "sum") return zt::ReduceOp::kSum;
  if (op == "avg") return zt::ReduceOp::kAvg;
  if (op == "max") return zt::ReduceOp::kMax;
  ZTRAIN_CHECK(op == "min", "unknown reduction '", op, "': sum, avg, max or min");
  return zt::ReduceOp::kMin;
}

/// The C++ OptimManager over a Python model's view and ztrain's native optimizers.
class PyOptimManager {
 public:
  PyOptimManager(const Blocks& blocks, const NamedTensors& params, zt::LossScaler scaler)
      : view_(model_view(blocks, params)), manager_(*view_, std::move(scaler)) {}
  void add_optimizer(const std::shared_ptr<NativeAdam>& optimizer) {
    manager_.add_optimizer(optimizer->optimizer());
    optimizers_.push_back(optimizer);  // alive as long as the manager steps it
  }
  zt::optim::OptimManager& operator*() { return manager_; }
  zt::optim::OptimManager* operator->() { return &manager_; }
  /// The model view, its one optimizer and this manager: what a checkpoint holds.
  zt::TrainingState training_state(const char* what) {
    ZTRAIN_CHECK(optimizers_.size() == 1, what, ": the OptimManager steps ", optimizers_.size(),
                 " optimizers; a checkpoint holds one (add exactly one with add_optimizer)");
    return {*view_, optimizers_[0]->optimizer(), manager_};
  }

 private:
  std::shared_ptr<torch::nn::Module> view_;
  zt::optim::OptimManager manager_;
  std::vector<std::shared_ptr<NativeAdam>> optimizers_;
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ztrain's native engine (the Python API is the ztrain package)";
  auto error = py::register_exception<zt::Error>(m, "Error", PyExc_RuntimeError);
  py::register_exception<zt::CommError>(m, "CommError", error.ptr());  // tried first: registered last

  using release = py::call_guard<py::gil_scoped_release>;
  m.def(
      "init_distributed",
      [](uint64_t seed, int tp_size, int pp_size, std::optional<double> timeout, std::optional<std::string> device,
         std::optional<int> threads, std::optional<std::string> backend) {
        zt::InitOptions o{.seed = seed, .backend = backend, .tp_size = tp_size, .pp_size = pp_size, .threads = threads};
        if (timeout) {
          ZTRAIN_CHECK(*timeout > 0, "init_distributed: timeout must be positive seconds, got ", *timeout);
          o.timeout = std::chrono::milliseconds(static_cast<int64_t>(*timeout * 1000));
        }
        if (device) o.device = zt::parse_device(*device, "init_distributed(device=...)");
        zt::init_distributed(o);
      },
      py::arg("seed"), py::arg("tp_size"), py::arg("pp_size"), py::arg("timeout"), py::arg("device"),
      py::arg("threads"), py::arg("backend"), release());
  m.def("is_initialized", &zt::is_initialized);
  // The fused CPU kernels of models/fused.h (ztrain.nn.dropout, gelu_tanh, cross_entropy,
  // scaled_dot_product_attention).
  m.def("_attention", &zt::models::attention, release());
  m.def("_dropout", &zt::models::dropout, release());
  m.def("_gelu_tanh", &zt::models::gelu_tanh, release());
  m.def("_cross_entropy", &zt::models::cross_entropy, release());
  // Which code they run ("scalar", "avx2", "avx512", "avx512_bf16" or "amx"; the default is the widest
  // the CPU has), for benchmarks that set them side by side.
  m.def("_fused_simd", [] { return zt::models::detail::simd_name(zt::models::detail::fused_simd()); });
  m.def("_set_fused_simd", [](const std::string& name) {
    zt::models::detail::set_fused_simd(zt::models::detail::simd_named(name));
  });
  m.def("finalize_distributed", &zt::finalize_distributed, release());
  m.def("rank", [] { return zt::rank(); });
  m.def("world_size", [] { return zt::world_size(); });
  m.def("local_rank", [] { return zt::runtime().local_rank(); });
  m.def("device", [] { return zt::runtime().device().str(); });
  m.def("synchronize", &zt::synchronize, release());
  m.def("sum_loss", [](const torch::Tensor& loss) { return zt::sum_loss(loss); }, release());
  m.def("abort_distributed", [](int code) { zt::abort_distributed(code); });

  py::class_<zt::ShardedModule, std::shared_ptr<zt::ShardedModule>>(m, "_Sharded")
      .def("shards", &shards)
      .def("pieces", &pieces)
      .def("group_members",
           [](const zt::ShardedModule& b) {  // the parameter names each shard holds, by shard
             std::vector<std::vector<std::string>> out;
             for (const auto& g : b.groups()) {
               auto& names = out.emplace_back();
               for (const auto& e : g.layout.entries()) names.push_back(e.name);
             }
             return out;
           })
      .def("train", [](zt::ShardedModule& b, bool on) { b.train(on); })
      .def("gathered_parameters", [](zt::ShardedModule& b) { return zt::gathered_parameters(b); }, release())
      .def("parameter_bytes", &zt::ShardedModule::parameter_bytes)
      .def("gathered_bytes", &zt::ShardedModule::gathered_bytes)
      .def("maps_shards", &zt::ShardedModule::maps_shards)
      .def("set_gradient_sync", &zt::ShardedModule::set_gradient_sync)
      .def("gradient_sync", &zt::ShardedModule::gradient_sync)
      .def("set_tied_copies",  // how many pipeline stages hold this module (a global norm counts each once)
           [](zt::ShardedModule& b, int copies) {
             ZTRAIN_CHECK(copies >= 1, "set_tied_copies: copies must be >= 1, got ", copies);
             for (const auto& p : b.named_parameters(/*recurse=*/false)) b.record(p.key()).tied_copies = copies;
           });
  py::class_<PyBlock, zt::ShardedModule, std::shared_ptr<PyBlock>>(m, "_Block")
      .def(py::init([](const NamedTensors& named, int zero_level, bool use_checkpoint, const Splits& splits,
                       std::optional<std::string> offload_dir) {
             return std::make_shared<PyBlock>(named, splits,
                                              zt::BlockOptions{.zero_level = zero_level,
                                                               .use_checkpoint = use_checkpoint,
                                                               .offload_dir = std::move(offload_dir)});
           }),
           release())
      .def("forward", &PyBlock::forward);
  py::class_<PyParameter, zt::ShardedModule, std::shared_ptr<PyParameter>>(m, "_Parameter")
      .def(py::init([](const torch::Tensor& value, int zero_level, std::optional<int64_t> tp_split_dim) {
             return std::make_shared<PyParameter>(value, zero_level, tp_split_dim);
           }),
           release())
      .def("gather", [](PyParameter& p) { return p.forward(); }, release())
      .def("new_forward", &PyParameter::new_forward);
  m.def(
      "_pipeline_schedule",  // the C++ schedule's instructions for one stage: (op, micro-batch, chunk)
      [](const std::string& kind, int stages, int stage, int micro_batches, int chunks) {
        std::vector<std::tuple<std::string, int, int>> out;
        for (const auto& ins : zt::pipe::make_schedule(
                 zt::pipe::parse_schedule_kind(kind),
                 {.stages = stages, .stage = stage, .micro_batches = micro_batches, .chunks = chunks})) {
          out.emplace_back(zt::pipe::to_string(ins.op), ins.micro_batch, ins.chunk);
        }
        return out;
      },
      py::arg("kind"), py::arg("stages"), py::arg("stage"), py::arg("micro_batches"), py::arg("chunks") = 1);
  // The C++ pipeline's stage boundary over the pp group (collective): sends run on their own
  // communication threads, receives check the message id; received tensors sent requiring grad
  // are leaves requiring grad.
  py::class_<zt::pipe::Boundary, std::shared_ptr<zt::pipe::Boundary>>(m, "_Boundary")
      .def(py::init([] { return std::make_shared<zt::pipe::Boundary>(group_named("pp"), zt::runtime().device()); }),
           release())
      .def("send_forward", [](zt::pipe::Boundary& b, const std::vector<torch::Tensor>& t, int64_t id) { b.send_forward(t, id); },
           release())
      .def("recv_forward", [](zt::pipe::Boundary& b, int64_t id) { return b.recv_forward(id).wait().tensors; }, release())
      .def("send_backward", [](zt::pipe::Boundary& b, const std::vector<torch::Tensor>& t, int64_t id) { b.send_backward(t, id); },
           release())
      .def("recv_backward", [](zt::pipe::Boundary& b, int64_t id) { return b.recv_backward(id).wait().tensors; }, release())
      .def("synchronize", &zt::pipe::Boundary::synchronize, release());
  m.def(
      "_link_blocks",
      [](const std::vector<std::shared_ptr<PyBlock>>& blocks, int depth) {
        ZTRAIN_CHECK(depth >= 0, "BlockList: prefetch_depth must be >= 0, got ", depth);
        const int n = static_cast<int>(blocks.size());
        for (int i = 0; i < n; ++i) {  // as the C++ BlockList links its blocks
          std::vector<zt::ShardedModule*> ahead, behind;
          for (int d = 1; d <= depth; ++d) {
            if (i + d < n) ahead.push_back(blocks[i + d].get());
            if (i - d >= 0) behind.push_back(blocks[i - d].get());
          }
          blocks[i]->set_prefetch_neighbours(std::move(ahead), std::move(behind));
        }
      },
      py::arg("blocks"), py::arg("depth"));

  m.def(
      "_save",
      [](const Blocks& blocks, const NamedTensors& params, const std::string& path,
         const std::map<std::string, std::string>& metadata) {
        zt::save(*model_view(blocks, params), path, {.metadata = metadata});
      },
      release());
  m.def(
      "_init_parameters",
      [](const Blocks& blocks, const NamedTensors& params, std::optional<uint64_t> seed,
         const std::optional<py::function>& init, std::optional<std::set<std::string>> only) {
        zt::InitParametersOptions options{.seed = seed};
        if (init) {
          options.init = [fn = keep(*init)](const std::string& name, torch::Tensor& value, at::Generator& gen) {
            py::gil_scoped_acquire gil;
            (*fn)(name, value, gen);
          };
        }
        if (only) options.select = [only = std::move(*only)](const std::string& name) { return only.contains(name); };
        py::gil_scoped_release release;
        zt::init_parameters(*model_view(blocks, params), options);
      });
  m.def("_memory_stats", [](const Blocks& blocks, const NamedTensors& params, const std::shared_ptr<NativeAdam>& opt) {
    const auto s = zt::memory_stats(*model_view(blocks, params), opt ? &opt->optimizer() : nullptr);
    return std::map<std::string, int64_t>{{"parameter_bytes", s.parameter_bytes}, {"gathered_bytes", s.gathered_bytes},
                                          {"gradient_bytes", s.gradient_bytes}, {"optimizer_bytes", s.optimizer_bytes},
                                          {"rss_bytes", s.rss_bytes}, {"peak_rss_bytes", s.peak_rss_bytes}};
  });
  m.def(
      "_load",
      [](const Blocks& blocks, const NamedTensors& params, const std::string& path, bool strict) {
        zt::load(*model_view(blocks, params), path, {.strict = strict});
      },
      release());
  m.def(
      "_save_optimizer",
      [](const Blocks& blocks, const NamedTensors& params, const std::shared_ptr<NativeAdam>& opt,
         const std::string& path) { zt::save_optimizer_state(*model_view(blocks, params), opt->optimizer(), path); },
      release());
  m.def(
      "_load_optimizer",
      [](const Blocks& blocks, const NamedTensors& params, const std::shared_ptr<NativeAdam>& opt,
         const std::string& path) { zt::load_optimizer_state(*model_view(blocks, params), opt->optimizer(), path); },
      release());

  m.def(
      "_parameter_shapes",
      [](const Blocks& blocks, const NamedTensors& params) {
        std::vector<std::pair<std::string, std::vector<int64_t>>> out;
        for (const auto& ref : zt::named_parameter_refs(*model_view(blocks, params))) out.emplace_back(ref.name, ref.full_shape());
        return out;
      },
      release());
  m.def(
      "_gathered_parameters",
      [](const Blocks& blocks, const NamedTensors& params) { return zt::gathered_parameters(*model_view(blocks, params)); },
      release());

  // Collectives over a group of the default context, without autograd (ztrain.distributed adds it).
  m.def(
      "_all_reduce",
      [](const torch::Tensor& t, const std::string& op, const std::string& group) {
        group_named(group).all_reduce(t, reduce_op(op));
      },
      release());
  m.def(
      "_all_gather", [](const torch::Tensor& t, const std::string& group) { return group_named(group).all_gather(t); },
      release());
  m.def(
      "_reduce_scatter",
      [](const torch::Tensor& t, const std::string& op, const std::string& group) {
        return group_named(group).reduce_scatter(t, reduce_op(op));
      },
      release());
  m.def(
      "_send", [](const torch::Tensor& t, int dst, const std::string& group) { group_named(group).send(t, dst); },
      release());
  m.def(
      "_recv", [](const torch::Tensor& t, int src, const std::string& group) { group_named(group).recv(t, src); },
      release());
  m.def(
      "_broadcast", [](const torch::Tensor& t, int root, const std::string& group) { group_named(group).broadcast(t, root); },
      release());
  m.def("latest_checkpoint", &zt::latest_checkpoint, py::arg("root"));
  m.def("checkpoints", &zt::checkpoints, py::arg("root"));
  m.def("_group_rank", [](const std::string& group) { return group_named(group).rank(); });
  m.def("_group_size", [](const std::string& group) { return group_named(group).size(); });

  py::class_<PyOptimManager>(m, "_OptimManager")
      .def(py::init([](const Blocks& blocks, const NamedTensors& params, std::optional<double> loss_scale,
                       bool dynamic, double factor, int64_t interval, double min_scale, double max_scale) {
        auto scaler = !loss_scale ? zt::LossScaler::off()
                      : dynamic   ? zt::LossScaler::dynamic({.initial_scale = *loss_scale,
                                                             .growth_factor = factor,
                                                             .backoff_factor = 1 / factor,
                                                             .growth_interval = interval,
                                                             .min_scale = min_scale,
                                                             .max_scale = max_scale})
                                  : zt::LossScaler::static_scale(*loss_scale);
        return std::make_unique<PyOptimManager>(blocks, params, std::move(scaler));
      }))
      .def("add_optimizer", &PyOptimManager::add_optimizer)
      .def("zero_grad", [](PyOptimManager& m) { m->zero_grad(); })
      .def("backward", [](PyOptimManager& m, const torch::Tensor& loss) { m->backward(loss); }, release())
      .def("clip_grad_norm", [](PyOptimManager& m, double max_norm) { return m->clip_grad_norm(max_norm); },
           release())
      .def("grad_norm", [](PyOptimManager& m) { return m->grad_norm(); }, release())
      .def("step", [](PyOptimManager& m) { return m->step(); }, release())
      .def("state",
           [](PyOptimManager& m) {
             const auto s = m->state();
             return py::make_tuple(s.scaler.scale, s.scaler.growth_tracker, s.scaler.hysteresis_left, s.steps,
                                   s.skipped);
           })
      .def("load_state",
           [](PyOptimManager& m, double scale, int64_t growth_tracker, int64_t hysteresis_left, int64_t steps,
              int64_t skipped) {
             auto s = m->state();
             s.scaler.scale = scale;
             s.scaler.growth_tracker = growth_tracker;
             s.scaler.hysteresis_left = hysteresis_left;
             s.steps = steps;
             s.skipped = skipped;
             m->load_state(s);
           })
      .def(
          "save_checkpoint",
          [](PyOptimManager& m, const std::string& root, int64_t step, const std::string& extra_json, int keep_last) {
            return zt::save_checkpoint(root, step, m.training_state("save_checkpoint"), extra_json,
                                       {.keep_last = keep_last});
          },
          release())
      .def("load_checkpoint",
           [](PyOptimManager& m, const std::string& dir) {
             zt::CheckpointInfo info;
             {
               py::gil_scoped_release release;
               info = zt::load_checkpoint(dir, m.training_state("load_checkpoint"));
             }
             return py::make_tuple(info.dir, info.step, info.world_size, info.extra_json);
           })
      .def_property_readonly("loss_scale", [](PyOptimManager& m) { return m->loss_scale(); })
      .def_property_readonly("steps", [](PyOptimManager& m) { return m->steps(); })
      .def_property_readonly("skipped_steps", [](PyOptimManager& m) { return m->skipped_steps(); });

  py::class_<NativeAdam, std::shared_ptr<NativeAdam>>(m, "_Adam")
      .def(py::init<const std::vector<std::pair<std::vector<torch::Tensor>, Hyper>>&, bool, std::optional<int>>())
      .def_static(
          "offload",
          [](const Blocks& blocks, const NamedTensors& params, const Hyper& h, std::optional<int> num_threads,
             std::optional<std::string> state_dir) {
            return std::make_shared<NativeAdam>(model_view(blocks, params), h, num_threads, std::move(state_dir));
          },
          py::arg("blocks"), py::arg("params"), py::arg("hyper"), py::arg("num_threads"),
          py::arg("state_dir") = py::none(),
          release())
      .def("set_options", &NativeAdam::set_options)
      .def("params", &NativeAdam::params)
      .def("wait", &NativeAdam::wait, release())
      .def("step", &NativeAdam::step, release())
      .def("state", &NativeAdam::state)
      .def("set_state", &NativeAdam::set_state)
      .def_property_readonly("kernel", &NativeAdam::kernel);
}
