"""ztrain.booster's HybridParallelPlugin with pipeline stages (init_distributed(pp_size=2) on an
even number of ranks: 2 stages, or 2 stages x 2 dp; one stage in one process): test_booster.py's
language model, whose forward loops over its ModuleList of three layers, trains unchanged — each
rank on its own part of the batch, or ColossalAI's execute_pipeline cutting one batch per
pipeline — at ZeRO stages 0, 1 and 3, and equals torch.optim.AdamW with clip_grad_norm_ in one
process on the whole batch; the saved model file is the plain model's."""
import os
import tempfile
import unittest

import torch

import ztrain
from ztrain.booster import Booster, HybridParallelPlugin
from test_booster import BATCH, CLIP, LR, Layer, TinyLM, batch, check_params, reference


def part(ids):
    """This rank's part of the batch: the ranks that take different data (dp x pp) split it."""
    index, count = ztrain.data_parallel()
    return ids[index * BATCH // count:(index + 1) * BATCH // count]


def TiedHeadLM(seed=0):
    """TinyLM with a head module tied to the embedding (Hugging Face's lm_head)."""
    model = TinyLM(seed, tied=False)
    model.head.weight = model.embed.weight
    return model


def FourLayerLM(seed=0):
    """TinyLM with a fourth layer: 2 stages x 2 model chunks of one layer each."""
    model = TinyLM(seed)
    model.layers.append(Layer())
    return model


def boosted(zero_stage, micro_batches=None, make_model=TinyLM, policy=None, pp_style="1f1b", loss_scale=None):
    model = make_model()
    plugin = HybridParallelPlugin(tp_size=1, pp_size=ztrain._C._group_size("pp"), zero_stage=zero_stage,
                                  num_microbatches=micro_batches, tensor_parallel=policy, pp_style=pp_style,
                                  num_model_chunks=2 if pp_style == "interleaved" else 1)
    booster = Booster(plugin, max_grad_norm=CLIP, loss_scale=loss_scale)
    model, optimizer, *_ = booster.boost(model, ztrain.optim.AdamW(model.parameters(), lr=LR))
    return booster, model, optimizer


class PipelineStages(unittest.TestCase):
    def test_each_rank_its_part_equals_one_process(self):
        want_losses, want_params, want_norms = reference(4)
        pp, stage = ztrain._C._group_size("pp"), ztrain._C._group_rank("pp")
        for zero_stage in (0, 1, 3):
            with self.subTest(zero_stage=zero_stage):
                booster, model, optimizer = boosted(zero_stage)
                self.assertEqual(len(model.layers), 3)
                self.assertEqual(list(model.layers._modules), {1: ["0", "1", "2"], 2: [["0", "1"], ["2"]][stage]}[pp])
                losses, norms = [], []
                for step in range(4):
                    optimizer.zero_grad()
                    loss = model(part(batch(step)))  # the forward's loop over model.layers runs the pipeline
                    booster.backward(loss, optimizer)
                    self.assertTrue(optimizer.step())
                    losses.append(ztrain.sum_loss(loss).item())
                    norms.append(optimizer.last_grad_norm)
                torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
                # The whole batch's gradient: the tied embedding and the norm, on both stages, count once.
                torch.testing.assert_close(norms, want_norms, rtol=1e-5, atol=1e-6)
                check_params(self, model, want_params)

    def test_embedding_and_tied_head_split_by_policy_on_every_stage(self):
        want_losses, want_params, want_norms = reference(3, TiedHeadLM)
        del want_params["head.weight"]  # the embedding's
        booster, model, optimizer = boosted(3, make_model=TiedHeadLM,
                                            policy={"embed": "vocab", "head": "column_gathered"})
        self.assertIsInstance(model.embed.weight, ztrain.DistributedParameter)
        self.assertIs(model.head.weight, model.embed.weight)
        losses, norms = [], []
        for step in range(3):
            optimizer.zero_grad()
            loss = model(part(batch(step)))
            booster.backward(loss, optimizer)
            self.assertTrue(optimizer.step())
            losses.append(ztrain.sum_loss(loss).item())
            norms.append(optimizer.last_grad_norm)
        torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(norms, want_norms, rtol=1e-5, atol=1e-6)  # the slice held by both stages once
        check_params(self, model, want_params)

    def test_execute_pipeline_runs_the_schedule_on_one_batch_per_pipeline(self):
        pp, stage = ztrain._C._group_size("pp"), ztrain._C._group_rank("pp")
        dp, me = ztrain._C._group_size("dp"), ztrain._C._group_rank("dp")

        def data(steps):  # every rank of a pipeline takes its dp rank's share, as a sampler over dp gives it
            return iter([{"ids": batch(step)[me * BATCH // dp:(me + 1) * BATCH // dp]} for step in range(steps)])

        want_losses, want_params, want_norms = reference(3)
        tied_losses, tied_params, tied_norms = reference(3, TiedHeadLM)
        del tied_params["head.weight"]
        four_losses, four_params, four_norms = reference(3, FourLayerLM)
        vocab = {"embed": "vocab", "head": "column_gathered"}
        cases = [("1f1b", 4, 3, TinyLM, None, None, want_losses, want_params, want_norms),
                 ("1f1b", 4, 0, TinyLM, None, 2.0 ** 10, want_losses, want_params, want_norms),
                 ("gpipe", 2, 1, TinyLM, None, None, want_losses, want_params, want_norms),
                 ("1f1b", 2, 3, TiedHeadLM, vocab, None, tied_losses, tied_params, tied_norms),
                 ("interleaved", 2, 3, FourLayerLM, None, None, four_losses, four_params, four_norms)]
        for style, micro_batches, zero_stage, make_model, policy, scale, losses_, params_, norms_ in cases:
            with self.subTest(pp_style=style, micro_batches=micro_batches, model=make_model.__name__, loss_scale=scale):
                booster, model, optimizer = boosted(zero_stage, micro_batches, make_model, policy, style, scale)
                if style == "interleaved" and pp > 1:  # chunk c of stage s: layer c * pp + s
                    self.assertEqual(list(model.layers._modules), [["0", "2"], ["1", "3"]][stage])
                    with self.assertRaisesRegex(ztrain.Error, "with 2 model chunks per stage the pipeline runs under "
                                                "Booster.execute_pipeline"):
                        model(batch(0))
                loss = booster.execute_pipeline(data(1), model, lambda loss, inputs: loss)["loss"]  # forward only
                self.assertAlmostEqual(ztrain.sum_loss(loss).item(), losses_[0], places=5)
                losses, norms = [], []
                for out in data(3):
                    optimizer.zero_grad()
                    out = booster.execute_pipeline(iter([out]), model, lambda loss, inputs: loss, optimizer,
                                                   return_outputs=True)
                    self.assertTrue(optimizer.step())
                    if stage == pp - 1:  # what the model returned: each micro-batch's loss
                        self.assertEqual(tuple(out["outputs"].shape), (micro_batches,))
                    else:
                        self.assertIsNone(out["outputs"])
                    losses.append(ztrain.sum_loss(out["loss"]).item())
                    norms.append(optimizer.last_grad_norm)
                torch.testing.assert_close(losses, losses_, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(norms, norms_, rtol=1e-5, atol=1e-6)
                check_params(self, model, params_)

    def test_1f1b_holds_fewer_micro_batches_than_gpipe(self):
        pp, stage = ztrain._C._group_size("pp"), ztrain._C._group_rank("pp")
        events = []

        class Recording(Layer):  # logs each micro-batch's forward, and its backward as it arrives
            def forward(self, x):
                y = super().forward(x)
                events.append(+1)
                y.register_hook(lambda grad: events.append(-1))
                return y

        for style, most in (("1f1b", min(pp - stage, 4)), ("gpipe", 4)):
            with self.subTest(pp_style=style):
                booster, model, optimizer = boosted(2, 4, lambda: TinyLM(layer=Recording), pp_style=style)
                events.clear()
                booster.execute_pipeline(iter([batch(0)]), model, lambda loss, inputs: loss, optimizer)
                alive = [sum(events[:i + 1]) for i in range(len(events))]  # layer outputs awaiting backward
                self.assertEqual(alive[-1], 0)
                self.assertEqual(max(alive), most * len(model.layers._modules))  # micro-batches x this stage's layers

    def test_saved_file_is_the_plain_model(self):
        booster, model, optimizer = boosted(1)
        path = os.path.join(tempfile.gettempdir(), f"ztrain_py_booster_pipe_{os.getppid()}.safetensors")
        booster.save_model(model, path)
        from safetensors.torch import load_file
        plain = TinyLM(seed=5)
        plain.load_state_dict(load_file(path))
        ids = batch(9)
        with torch.no_grad():
            self.assertAlmostEqual(ztrain.sum_loss(model(part(ids))).item(), plain(ids).item(), places=5)
        fresh_booster, fresh, _ = boosted(3)
        fresh_booster.load_model(fresh, path)
        check_params(self, fresh, dict(plain.state_dict()))
        ztrain.synchronize()
        if ztrain.rank() == 0:
            os.remove(path)

    def test_models_that_do_not_cut_are_named(self):
        pp = ztrain._C._group_size("pp")
        if pp == 1:
            self.skipTest("one stage")

        class TwoLists(TinyLM):
            def __init__(self):
                super().__init__()
                self.more = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

        model = TwoLists()
        with self.assertRaisesRegex(ztrain.Error, "cuts the modules of one ModuleList over the stages, but the units "
                                                  "are layers.0, layers.1, layers.2, more.0"):
            Booster(HybridParallelPlugin(tp_size=1, pp_size=pp)).boost(model, ztrain.optim.AdamW(model.parameters()))
        booster, model, optimizer = boosted(0, micro_batches=3)
        with self.assertRaisesRegex(ztrain.Error, "does not divide into 3 micro-batches"):
            model(part(batch(0)))


def init_distributed():
    """The runtime this file's tests run in (conftest.py calls it under pytest)."""
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    ztrain.init_distributed(seed=0, pp_size=2 if world % 2 == 0 else 1)


if __name__ == "__main__":
    init_distributed()
    unittest.main()
