"""Shared test set-up: nothing in the test suite may reach the network."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The models under test are tiny: one intra-op thread is faster than two, and
# leaves the other core to the trio thread and to pytest.
import torch  # noqa: E402

torch.set_num_threads(1)
