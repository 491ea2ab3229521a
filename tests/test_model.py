"""The executor computes what Hugging Face transformers computes, on the same files.

Random tiny Llama (with llama3 RoPE scaling), Qwen2 and Qwen3 checkpoints are
built with transformers and saved to a temporary folder; greedy generation
through ModelExecutor, with several prompts of different lengths in one mixed
batch, prefill split at odd boundaries and block sizes 1 and 16, must equal
transformers' ``generate`` token for token, with logits within 1e-4.
"""

import random

import pytest
import torch

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.tokenizer import Tokenizer
from trio_llm.gpu.attention import get_attention_backend
from trio_llm.gpu.builtin import resolve_model
from trio_llm.gpu.executor import ModelExecutor
from trio_llm.gpu.testing import DriverRequest, ExecutorDriver, record_logits

transformers = pytest.importorskip("transformers")

VOCAB_SIZE = 384
NUM_NEW_TOKENS = 6
PROMPT_LENGTHS = [5, 23, 41, 1]
# Prefill chunk plans per prompt: odd boundaries, including single-token chunks.
CHUNK_PLANS = [[2, 3], [7, 1, 5], [13, 11], [4]]
ARRIVAL_STEPS = [0, 0, 2, 3]
# The Triton kernels' float32 dot products run in TF32 (10-bit mantissa) on CUDA.
CUDA_LOGITS_TOLERANCE = {"torch": 1e-3, "triton": 3e-2}


def _family_config(family: str):
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
                  pad_token_id=0)
    if family == "llama":
        return transformers.LlamaConfig(
            **common, rope_theta=500000.0, attention_bias=True,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if family == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    return transformers.Qwen3Config(**common, head_dim=32)


def _randomise(model, seed: int) -> None:
    """Weights with well-spread logits, so greedy choices are never near-ties."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if "norm" in name:
                parameter.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                parameter.copy_(0.1 * noise)
            elif "embed" in name or "lm_head" in name:
                parameter.copy_(0.6 * noise)
            else:
                parameter.copy_(noise * parameter.shape[1] ** -0.5)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory):
    """(directory, transformers model) for a random checkpoint of one family."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_family_config(request.param))
    _randomise(model, seed=len(request.param))
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return directory, model.eval()


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [[rng.randrange(VOCAB_SIZE) for _ in range(length)] for length in PROMPT_LENGTHS]


def _reference(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logits each was chosen from."""
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS,
                                min_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                                return_dict_in_generate=True, output_logits=True,
                                pad_token_id=0)
    tokens = output.sequences[0, len(prompt):].tolist()
    return tokens, torch.cat(output.logits)


def _run_executor(directory, prompts, *, block_size, device="cpu", attention_backend=None):
    executor = ModelExecutor.create(EngineConfig(model=str(directory), block_size=block_size,
                                                 num_kv_blocks=512, device=device,
                                                 dtype="float32"))
    if attention_backend is not None:
        executor.model.attention_backend = get_attention_backend(attention_backend)
    recorded = record_logits(executor)
    requests = [DriverRequest(request_id=f"r{index}", prompt_token_ids=prompt,
                              max_tokens=NUM_NEW_TOKENS, chunk_sizes=CHUNK_PLANS[index],
                              arrival_step=ARRIVAL_STEPS[index])
                for index, prompt in enumerate(prompts)]
    ExecutorDriver(executor, decode_input="previous_step").run(requests)
    return requests, recorded


@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_generation_matches_transformers(checkpoint, prompts, block_size):
    directory, model = checkpoint
    requests, recorded = _run_executor(directory, prompts, block_size=block_size)
    for request, prompt in zip(requests, prompts, strict=True):
        expected_tokens, expected_logits = _reference(model, prompt)
        assert request.output_token_ids == expected_tokens
        ours = torch.stack([recorded[(request.request_id, index)]
                            for index in range(NUM_NEW_TOKENS)])
        torch.testing.assert_close(ours, expected_logits, rtol=0, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("attention_backend", ["torch", "triton"])
def test_cuda_greedy_generation_matches_transformers(checkpoint, prompts, attention_backend):
    directory, model = checkpoint
    requests, recorded = _run_executor(directory, prompts, block_size=16, device="cuda",
                                       attention_backend=attention_backend)
    for request, prompt in zip(requests, prompts, strict=True):
        expected_tokens, expected_logits = _reference(model, prompt)
        assert request.output_token_ids == expected_tokens
        ours = torch.stack([recorded[(request.request_id, index)].cpu()
                            for index in range(NUM_NEW_TOKENS)])
        torch.testing.assert_close(ours, expected_logits, rtol=0,
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
