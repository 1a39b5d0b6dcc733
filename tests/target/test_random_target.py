"""``random:`` targets are a function of their spec: equal in every process (each run of a
pipeline file, each torchrun rank, a later ``evaluate``), and building one leaves the caller's
RNG where it was."""

from __future__ import annotations

import subprocess
import sys

import torch

from dflash_model.target.load import load_target
from dflash_stages.train.trainer import weights_digest
from tests.conftest import REPO

DIGEST = ("from dflash_model.target.load import load_target; from dflash_stages.train.trainer import weights_digest; "
          "print(weights_digest(load_target('random:tiny', 'cpu', 'float32', 'sdpa')[0]).hex())")


def test_fresh_processes_build_identical_random_targets():
    digests = [subprocess.run([sys.executable, "-c", DIGEST], cwd=REPO, capture_output=True, text=True,
                              check=True, timeout=300).stdout.strip() for _ in range(2)]
    here = weights_digest(load_target("random:tiny", "cpu", "float32", "sdpa")[0]).hex()
    assert digests == [here, here]


def test_building_a_random_target_leaves_the_global_rng_alone():
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    load_target("random:tiny", "cpu", "float32", "sdpa")
    assert torch.equal(torch.rand(4), expected)
