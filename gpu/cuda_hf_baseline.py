"""The Hugging Face transformers baseline for `trio-llm bench throughput --backend transformers`.

Runs the same workload on transformers' own continuous batching
(``init_continuous_batching``), over the same architecture with random weights,
so anyone can put the two engines side by side on their own GPU. A time limit
bounds the run: what finished by then is reported, flagged incomplete.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from trio_llm.actors.config import EngineConfig

DEFAULT_TIME_LIMIT_SECONDS = 150.0


def run_transformers_throughput(config: EngineConfig, workload: list[Any], *,
                                temperature: float,
                                time_limit_seconds: float = DEFAULT_TIME_LIMIT_SECONDS
                                ) -> dict[str, Any]:
    """Generate every workload item (``prompt_token_ids``, ``max_tokens``) with transformers'
    continuous batching, ignoring EOS; returns output tokens/s and how far it got."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from trio_llm.gpu.builtin import resolve_model

    model_path = resolve_model(config.model, config.revision)
    hf_config = AutoConfig.from_pretrained(model_path)
    dtype = torch.float32 if config.dtype == "float32" else torch.bfloat16
    torch.manual_seed(config.seed)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    generation_config = GenerationConfig(
        do_sample=temperature > 0, temperature=temperature or None, top_k=None, top_p=None,
        eos_token_id=None, pad_token_id=0, max_new_tokens=max(i.max_tokens for i in workload))
    manager = model.init_continuous_batching(generation_config=generation_config)
    manager.start()
    try:
        return _drive(manager, workload, time_limit_seconds)
    finally:
        manager.stop(block=True, timeout=30)


def _drive(manager: Any, workload: list[Any], time_limit_seconds: float) -> dict[str, Any]:
    start = time.perf_counter()
    for index, item in enumerate(workload):
        manager.add_request(list(item.prompt_token_ids), request_id=f"r{index}",
                            max_new_tokens=item.max_tokens)
    num_output_tokens = num_finished = 0
    deadline = start + time_limit_seconds
    while num_finished < len(workload) and time.perf_counter() < deadline:
        result = manager.get_result(timeout=max(0.0, min(1.0, deadline - time.perf_counter())))
        if result is None or not result.is_finished():
            continue
        num_finished += 1
        num_output_tokens += len(result.generated_tokens)
    elapsed = time.perf_counter() - start
    return {
        "backend": "transformers",
        "num_requests": len(workload),
        "num_finished_requests": num_finished,
        "completed": num_finished == len(workload),
        "num_prompt_tokens": sum(len(item.prompt_token_ids) for item in workload),
        "num_output_tokens": num_output_tokens,
        "elapsed_seconds": elapsed,
        # a lower bound when the run hit its time limit (unfinished requests not counted)
        "output_tokens_per_second": num_output_tokens / elapsed,
    }
