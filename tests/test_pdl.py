"""Programmatic dependent launch (gpu/kernels/pdl.py; on unless ``TRIO_LLM_PDL=0``) changes
when a decode step's kernels launch, never what they compute: a model's steps give the
same tokens and logprobs with it on and off, captured in CUDA graphs and run at depth 2."""

from __future__ import annotations

import pytest
import torch


def test_a_pdl_setting_other_than_0_or_1_is_refused_by_name(monkeypatch):
    from trio_llm.gpu.kernels import pdl

    monkeypatch.setenv("TRIO_LLM_PDL", "off")
    pdl.pdl_enabled.cache_clear()
    with pytest.raises(ValueError, match=r"TRIO_LLM_PDL='off': expected 1 .* or 0"):
        pdl.pdl_enabled(torch.device("cpu"))
    monkeypatch.setenv("TRIO_LLM_PDL", "0")
    pdl.pdl_enabled.cache_clear()
    assert pdl.pdl_launch(torch.device("cpu")) == {"USE_PDL": False}
    pdl.pdl_enabled.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny", "qwen3-moe-small"])
def test_a_model_gives_the_same_results_with_pdl_on_and_off(model, enable_pdl):
    from test_gpu_executor import assert_same_results, scripted_batches

    from trio_llm.gpu.builtin import resolve_model
    from trio_llm.gpu.cuda_executor import CudaExecutorOptions, CudaModelExecutor
    from trio_llm.gpu.loader import load_model
    from trio_llm.gpu.testing import run_depth_2

    def run():
        path = resolve_model(model)
        weights = load_model(path, dtype=torch.bfloat16, device=torch.device("cuda"),
                             load_format="dummy")
        executor = CudaModelExecutor(weights, model_path=path, num_kv_blocks=64,
                                     block_size=16, max_model_len=256)
        executor.start(CudaExecutorOptions(max_num_seqs=4, use_cuda_graphs=True,
                                           use_fused_kernels=True))
        assert executor.graphs
        return run_depth_2(executor, scripted_batches())

    expected = run()
    enable_pdl()
    assert_same_results(run(), expected)
