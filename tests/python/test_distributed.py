"""ztrain's runtime from Python, on every rank of an mpirun launch (ZTRAIN_TEST_WORLD_SIZE ranks)."""
import os
import subprocess
import sys
import time
import unittest

import torch

import ztrain


class Runtime(unittest.TestCase):
    def test_ranks_and_device(self):
        self.assertTrue(ztrain.is_initialized())
        self.assertEqual(ztrain.world_size(), int(os.environ.get("ZTRAIN_TEST_WORLD_SIZE", "1")))
        self.assertIn(ztrain.rank(), range(ztrain.world_size()))
        self.assertEqual(ztrain.device(), torch.device(os.environ.get("ZTRAIN_DEVICE", "cpu")))

    def test_sum_loss_is_the_mean_over_ranks(self):
        loss = torch.tensor(float(ztrain.rank() + 1), requires_grad=True)
        mean = ztrain.sum_loss(loss)
        n = ztrain.world_size()
        self.assertEqual(mean.item(), (n + 1) / 2)
        self.assertFalse(mean.requires_grad)
        ztrain.synchronize()

    def test_a_second_init_is_refused(self):
        with self.assertRaisesRegex(ztrain.Error, "init_distributed"):
            ztrain.init_distributed()


class Launch(unittest.TestCase):
    """A job of its own, started here with mpirun (only from a one-rank run)."""

    def test_an_exception_on_one_rank_ends_the_job(self):
        if not os.environ.get("ZTRAIN_TEST_MPIRUN") or ztrain.world_size() != 1:
            self.skipTest("run at one rank with ZTRAIN_TEST_MPIRUN")
        script = ("import ztrain\n"
                  "ztrain.init_distributed(timeout=120)\n"
                  "if ztrain.rank() == 0:\n"
                  "    raise ValueError('only rank 0 failed')\n"
                  "ztrain.synchronize()\n")
        # Not this process's own MPI job: what its singleton launch put in the environment goes.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("OMPI_", "PMIX_", "OPAL_")) or k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
        start = time.monotonic()
        run = subprocess.run([os.environ["ZTRAIN_TEST_MPIRUN"], "-np", "2", "--oversubscribe", "--bind-to", "none",
                              sys.executable, "-c", script], capture_output=True, text=True, timeout=110, env=env)
        self.assertNotEqual(run.returncode, 0)
        self.assertIn("ValueError: only rank 0 failed", run.stderr + run.stdout)
        # Not the other rank's 120 s deadline: the job ends as soon as rank 0's error is printed.
        self.assertLess(time.monotonic() - start, 60)


def init_distributed():
    """The runtime this file's tests run in (conftest.py calls it under pytest)."""
    ztrain.init_distributed(seed=0)


if __name__ == "__main__":
    init_distributed()
    unittest.main()
