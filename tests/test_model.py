"""The executor computes what Hugging Face transformers computes, on the same files.

Random tiny Llama (with llama3 RoPE scaling), Qwen2 and Qwen3 checkpoints are
built with transformers and saved to a temporary folder; greedy generation
through ModelExecutor, with several prompts of different lengths in one mixed
batch, prefill split at odd boundaries and block sizes 1 and 16, must equal
transformers' ``generate`` token for token, with logits within 1e-4.
"""

import pytest
import torch
from test_model_support import (
    assert_generates_as_transformers,
    dense_config,
    random_causal_lm,
    random_prompts,
    run_executor,
    saved,
)

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.tokenizer import Tokenizer
from trio_llm.gpu.builtin import resolve_model
from trio_llm.gpu.executor import ModelExecutor
from trio_llm.gpu.testing import DriverRequest, ExecutorDriver

transformers = pytest.importorskip("transformers")

# The Triton kernels' float32 dot products run in TF32 (10-bit mantissa) on CUDA.
CUDA_LOGITS_TOLERANCE = {"torch": 1e-3, "triton": 3e-2}


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory):
    """(directory, transformers model) for a random checkpoint of one family."""
    model = random_causal_lm(dense_config(request.param), seed=len(request.param))
    return saved(model, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def prompts():
    return random_prompts()


@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_generation_matches_transformers(checkpoint, prompts, block_size):
    directory, model = checkpoint
    requests, recorded = run_executor(directory, prompts, block_size=block_size)
    assert_generates_as_transformers(model, prompts, requests, recorded, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("attention_backend", ["torch", "triton"])
def test_cuda_greedy_generation_matches_transformers(checkpoint, prompts, attention_backend):
    directory, model = checkpoint
    requests, recorded = run_executor(directory, prompts, block_size=16, device="cuda",
                                      attention_backend=attention_backend)
    assert_generates_as_transformers(model, prompts, requests, recorded,
                                     atol=CUDA_LOGITS_TOLERANCE[attention_backend])


def test_tiny_builtin_matches_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIO_LLM_CACHE", str(tmp_path))
    directory = resolve_model("tiny")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    prompt = Tokenizer.from_dir(directory).encode("The cat sat by the fire and")
    executor = ModelExecutor.create(EngineConfig(model="tiny", num_kv_blocks=64, device="cpu",
                                                 dtype="float32"))
    request = DriverRequest(request_id="tiny", prompt_token_ids=prompt, max_tokens=12,
                            chunk_sizes=[5, 3])
    ExecutorDriver(executor).run([request])
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                                  do_sample=False, pad_token_id=0)
    assert request.output_token_ids == expected[0, len(prompt):].tolist()
    assert len(set(request.output_token_ids)) > 3  # the tiny model does not just repeat
