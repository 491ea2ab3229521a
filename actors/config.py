"""The engine's configuration: one frozen struct, fields named as `vllm serve` names its flags."""

from typing import Annotated, Final, Literal

import msgspec

from trio_llm.actors.messages import PositiveInt

# Steps in flight at most: the scheduler plans one step ahead of the device, never more.
# The runner, its inbox and the CUDA executor's input slots are sized by it.
MAX_PIPELINE_DEPTH: Final = 2

# Sequences of two tokens or more in one step of a model with linear-attention layers
# (state slots), at most: the scheduler plans no more, the CUDA executor refuses more.
# They run fla's chunked kernel on this many seats, each loading and storing a whole
# recurrent state (2 MB a layer at qwen3.5-35b-a3b's sizes) even when empty; the step's
# one-token sequences update their states in place (gpu/kernels/fla_gated_delta_rule.py).
MAX_CHUNKED_SEQS: Final = 8


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything that shapes an engine. ``num_kv_blocks`` None sizes the cache
    from memory (``gpu_memory_utilization`` on CUDA, ``cpu_kv_cache_gib`` on the
    CPU). ``pipeline_depth`` 2 plans step N+1 while N runs; 1 plans after N.
    ``enable_prefix_caching``: reuse the KV of cached prompt prefixes (full
    blocks), as vLLM does by default. ``tensor_parallel_size`` N > 1 splits the
    model over N worker processes (one per GPU; on the CPU, N processes).
    ``runner`` (vLLM's ``--runner``): "generate" samples tokens; "pooling" serves
    the model as an embedding model (Engine.embed, /v1/embeddings) and generates
    nothing."""

    model: str = "tiny"
    revision: str | None = None  # of a Hugging Face id, looked up in the local cache
    tokenizer: str | None = None
    # a file, or the template inline: replaces the model's chat template
    chat_template: str | None = None
    # default sampling parameters: "auto" (the model's generation_config.json),
    # "vllm" (none) or a directory (actors/generation_defaults.py)
    generation_config: str = "auto"
    # most logprobs a request may ask for; -1: the whole vocabulary (vLLM's)
    max_logprobs: Annotated[int, msgspec.Meta(ge=-1)] = 20
    served_model_name: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    load_format: Literal["auto", "safetensors", "dummy"] = "auto"
    # online quantization of an unquantized checkpoint's linear weights (vLLM's
    # --quantization): "fp8", e4m3 with per-row scales (gpu/quantization.py)
    quantization: Literal["fp8"] | None = None
    # the KV cache's dtype (vLLM's --kv-cache-dtype): "auto" the model's; "fp8" (or
    # "fp8_e4m3") e4m3 with a scale per layer for keys and one for values, read from the
    # checkpoint where it has them, else 1.0 (gpu/quantization.py): twice the tokens
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = "auto"
    seed: int = 0
    max_num_seqs: PositiveInt = 256
    max_num_batched_tokens: PositiveInt = 8192
    # vLLM's --long-prefill-token-threshold: a prompt takes at most this many tokens of
    # one step (0: as many as the budget leaves), so a long prompt is chunked over
    # steps that other prompts and decodes share
    long_prefill_token_threshold: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_model_len: PositiveInt | None = None
    block_size: PositiveInt = 16
    num_kv_blocks: PositiveInt | None = None
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.9
    cpu_kv_cache_gib: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    priority_preemption_threshold: int | None = None
    max_waiting_requests: PositiveInt = 4096
    pipeline_depth: Literal[1, 2] = MAX_PIPELINE_DEPTH
    enforce_eager: bool = False
    # Worker processes, one per device, each holding a shard of the model (gpu/tp_executor.py).
    tensor_parallel_size: PositiveInt = 1
    enable_prefix_caching: bool = True
    # Models with linear-attention layers (the hybrid family): the states at the end
    # of cached prefixes kept for prefix caching (actors/state_slots.py), each a slot
    # of the state cache beside the max_num_seqs running ones. None: sized from
    # memory by the executor.
    max_state_snapshots: PositiveInt | None = None
    # ... and a decoding request's state saved every this many tokens (rounded up to
    # whole blocks) into its one pending snapshot, so that the next turn of a
    # conversation starts near the end of the answer: each save copies a whole state
    # (tens of MB at a 30B model's sizes), hence not every block.
    decode_snapshot_interval: PositiveInt = 64
    shutdown_grace_seconds: Annotated[float, msgspec.Meta(ge=0.0)] = 5.0
    runner: Literal["generate", "pooling"] = "generate"
    # Structured outputs: the shape a constraint may have (actors/constraint_cost.py
    # says why each; docs/http-api.md lists them), the compile deadline, and the bytes
    # of compiled grammars kept (vLLM's VLLM_XGRAMMAR_CACHE_MB default, 512 MiB).
    structured_outputs_max_bytes: PositiveInt = 64 * 1024
    structured_outputs_max_depth: PositiveInt = 32
    structured_outputs_max_nodes: PositiveInt = 2048
    structured_outputs_max_properties: PositiveInt = 384
    structured_outputs_max_alternatives: PositiveInt = 1024
    structured_outputs_max_repeat: PositiveInt = 1024
    structured_outputs_compile_timeout: Annotated[float, msgspec.Meta(gt=0.0)] = 10.0
    structured_outputs_cache_mb: PositiveInt = 512
    # Seats one request's choices (n, best_of, batched prompts) may hold at once,
    # as a share of max_num_seqs (at least one seat); 1.0: no bound of its own.
    max_seq_share: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.5
    # Generations one HTTP request may ask for (prompts times max(n, best_of)); ours,
    # vLLM bounds neither.
    max_request_choices: PositiveInt = 256

    @property
    def max_group_seats(self) -> int:
        """Seats the requests of one group may hold at once: ``max_seq_share`` of them."""
        return max(1, int(self.max_num_seqs * self.max_seq_share))
