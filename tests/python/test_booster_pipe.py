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
from test_booster import BATCH, CLIP, LR, TinyLM, batch, check_params, reference


def part(ids):
    """This rank's part of the batch: the ranks that take different data (dp x pp) split it."""
    index, count = ztrain.data_parallel()
    return ids[index * BATCH // count:(index + 1) * BATCH // count]


def TiedHeadLM(seed=0):
    """TinyLM with a head module tied to the embedding (Hugging Face's lm_head)."""
    model = TinyLM(seed, tied=False)
    model.head.weight = model.embed.weight
    return model


def boosted(zero_stage, micro_batches=None, make_model=TinyLM, policy=None):
    model = make_model()
    plugin = HybridParallelPlugin(tp_size=1, pp_size=ztrain._C._group_size("pp"), zero_stage=zero_stage,
                                  num_microbatches=micro_batches, tensor_parallel=policy)
    booster = Booster(plugin, max_grad_norm=CLIP)
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

    def test_execute_pipeline_cuts_one_batch_per_pipeline(self):
        want_losses, want_params, _ = reference(3)
        booster, model, optimizer = boosted(3, micro_batches=1)
        dp, me = ztrain._C._group_size("dp"), ztrain._C._group_rank("dp")
        # Every rank of a pipeline takes its dp rank's share, as a sampler over the dp group gives it.
        data = iter([{"ids": batch(step)[me * BATCH // dp:(me + 1) * BATCH // dp]} for step in range(3)])
        losses = []
        for _ in range(3):
            optimizer.zero_grad()
            out = booster.execute_pipeline(data, model, lambda loss, inputs: loss, optimizer, return_outputs=True)
            self.assertTrue(optimizer.step())
            self.assertEqual(out["outputs"].dim(), 0)  # what the model returned: this rank's part's loss
            losses.append(ztrain.sum_loss(out["loss"]).item())
        torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
        check_params(self, model, want_params)

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
