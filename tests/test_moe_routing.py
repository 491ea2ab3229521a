"""The fused routing kernel (gpu/kernels/moe_routing.py) against torch's routing.

On the CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py), on CUDA compiled. The rule it implements: softmax in float32, the
``top_k`` largest probabilities, equal ones in expert order (so exact ties at the
k-th value keep the lower experts, as torch.topk on CUDA keeps them), renormalised
and rounded as the family asks. Each family's flags are checked against
layers/moe.py's ``torch_route`` (transformers' code) where no two probabilities
tie, and against the rule where they do.
"""

from __future__ import annotations

import pytest
import torch

from trio_llm.gpu.kernels.moe_routing import route_topk
from trio_llm.gpu.layers.moe import MoeShape, torch_route

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

# (normalize, weights_in_float32) of each family's router
FAMILIES = {"qwen3_moe": (True, False), "qwen2_moe": (False, False), "mixtral": (True, True)}
FAMILY = pytest.mark.parametrize("family", list(FAMILIES))


def shape_of(family: str, num_experts: int, top_k: int) -> MoeShape:
    normalize, in_float32 = FAMILIES[family]
    return MoeShape(hidden_size=16, num_experts=num_experts, top_k=top_k, intermediate_size=16,
                    normalize=normalize, weights_in_float32=in_float32)


def kernel_route(logits: torch.Tensor, shape: MoeShape) -> tuple[torch.Tensor, torch.Tensor]:
    return route_topk(logits.to(DEVICE), shape.top_k, normalize=shape.normalize,
                      round_to_input=not shape.weights_in_float32)


def rule_route(logits: torch.Tensor, shape: MoeShape) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule, in torch: a stable descending sort keeps equal values in expert order."""
    probabilities = torch.softmax(logits.float(), dim=-1)
    ordered = torch.sort(probabilities, dim=-1, descending=True, stable=True)
    weights, ids = ordered.values[:, :shape.top_k], ordered.indices[:, :shape.top_k]
    if shape.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not shape.weights_in_float32:
        weights = weights.to(logits.dtype)
    return weights.float(), ids


def assert_routes_equal(ours, expected, dtype: torch.dtype) -> None:
    (weights, ids), (expected_weights, expected_ids) = ours, expected
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids.cpu().long(), expected_ids.cpu().long())
    # The row's sums may round in another order: a last-bit difference, one rounding
    # step of the weights' dtype at most.
    tolerance = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(weights.cpu(), expected_weights.float().cpu(), rtol=tolerance,
                               atol=1e-7)


@FAMILY
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [
    (1, 128, 8), (37, 8, 2), (5, 60, 4), (20, 256, 8), (3, 4, 4),
], ids=["decode-128x8", "37-tokens-8x2", "60-experts", "256-experts", "k-equals-experts"])
def test_matches_the_torch_routing(family, num_tokens, num_experts, top_k):
    shape = shape_of(family, num_experts, top_k)
    generator = torch.Generator().manual_seed(num_tokens * num_experts)
    logits = 2 * torch.randn(num_tokens, num_experts, generator=generator)
    weights, ids = torch_route(logits, shape)  # transformers' code, on the CPU
    assert_routes_equal(kernel_route(logits, shape), (weights.float(), ids), torch.float32)


@FAMILY
def test_exact_ties_keep_the_lower_experts(family):
    """Equal logits (duplicated experts, a router of zeros, a tie straddling the k-th
    place): the lower experts are picked, first among equals."""
    shape = shape_of(family, 8, 3)
    logits = torch.tensor([
        [0.0] * 8,
        [1.0, 3.0, 3.0, 2.0, 3.0, 0.0, 3.0, 1.0],  # four equal at the top, three taken
        [0.5, 2.0, 1.0, 1.0, 0.2, 1.0, 2.0, 1.0],  # two on top, then 2 of 4 equal
        [5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, -1.0],
        [-3.0, 1.5, -3.0, 1.5, -3.0, -3.0, 1.5, 7.0],
    ])
    ours = kernel_route(logits, shape)
    assert ours[1].tolist() == [[0, 1, 2], [1, 2, 4], [1, 6, 2], [0, 1, 2], [7, 1, 3]]
    assert_routes_equal(ours, rule_route(logits, shape), torch.float32)


@FAMILY
def test_near_ties_pick_the_larger_logit(family):
    """Logits a few float32 ulps apart, the larger one at the higher expert: the
    probabilities keep the order, so the higher expert comes first."""
    shape = shape_of(family, 16, 4)
    base = torch.linspace(-1.0, 0.5, 16).repeat(6, 1)
    for row, (low, high) in enumerate([(3, 9), (0, 15), (14, 15), (2, 5), (7, 8), (1, 12)]):
        value = 1.0 + row / 8
        base[row, low] = value
        # eight ulps above: more than the exponential's and the division's rounding
        base[row, high] = value + 8 * torch.finfo(torch.float32).eps * value
    ours = kernel_route(base, shape)
    weights, ids = torch_route(base, shape)
    assert ours[1][:, :2].tolist() == [[9, 3], [15, 0], [15, 14], [5, 2], [8, 7], [12, 1]]
    assert_routes_equal(ours, (weights.float(), ids), torch.float32)


def test_bfloat16_logits_one_rounding_step_apart():
    """The router's output on CUDA is bfloat16: neighbouring bf16 logits, widened to
    float32, stay ordered, and the weights are rounded to bf16 as transformers rounds
    them (held in float32 for the MoE kernel)."""
    shape = shape_of("qwen3_moe", 32, 8)
    logits = 0.2 * torch.randn(9, 32, generator=torch.Generator().manual_seed(2))
    logits = logits.to(torch.bfloat16)  # all below 1.25
    logits[:, 30] = 1.25
    logits[:, 4] = 1.25 + 2 ** -7  # one bf16 step above (8 significant bits)
    assert (logits[:, 4] > logits[:, 30]).all()
    ours = kernel_route(logits, shape)
    assert ours[1][:, 0].tolist() == [4] * 9
    assert torch.equal(ours[0], ours[0].to(torch.bfloat16).float())
    assert_routes_equal(ours, rule_route(logits, shape), torch.bfloat16)


def test_a_strided_view_and_no_tokens():
    shape = shape_of("qwen3_moe", 8, 2)
    wide = torch.randn(4, 12, generator=torch.Generator().manual_seed(1))
    logits = wide[:, 2:10]  # rows of stride 12
    assert_routes_equal(kernel_route(logits, shape), rule_route(logits, shape), torch.float32)
    weights, ids = kernel_route(torch.empty(0, 8), shape)
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 256, 8), (37, 4, 2)],
                         ids=["decode-256x8", "37-tokens-4x2"])
def test_a_stacked_shared_expert_is_every_tokens_last_pick(num_tokens, num_experts, top_k,
                                                           dtype):
    """Qwen3.5-MoE's router (its top-k renormalised) with the shared expert's gate as the
    logits' last column: the routed picks as without it, then expert ``num_experts``
    weighted by the sigmoid of that column, rounded to the logits' dtype
    (layers/moe.py's ``torch_route``, transformers' arithmetic)."""
    shape = MoeShape(hidden_size=16, num_experts=num_experts, top_k=top_k,
                     intermediate_size=16, normalize=True, shared_intermediate_size=16)
    assert shape.stacks_shared_expert and shape.num_stacked_experts == num_experts + 1
    generator = torch.Generator().manual_seed(num_tokens)
    logits = (2 * torch.randn(num_tokens, num_experts + 1, generator=generator)).to(dtype)
    weights, ids = route_topk(logits.to(DEVICE), top_k, normalize=True, round_to_input=True,
                              shared=True)
    assert weights.shape == ids.shape == (num_tokens, top_k + 1)
    routed = route_topk(logits[:, :-1].to(DEVICE), top_k, normalize=True, round_to_input=True)
    assert torch.equal(ids[:, :-1].cpu(), routed[1].cpu())
    assert torch.equal(weights[:, :-1].cpu(), routed[0].cpu())
    # (bf16 logits of 256 experts tie exactly, and torch.topk on the CPU breaks ties its
    # own way: the rule for the routed picks, transformers' code for the shared one)
    routed_shape = MoeShape(hidden_size=16, num_experts=num_experts, top_k=top_k,
                            intermediate_size=16, normalize=True)
    assert_routes_equal(routed, rule_route(logits[:, :-1], routed_shape), dtype)
    expected_weights, expected_ids = torch_route(logits, shape)
    assert ids[:, -1].tolist() == expected_ids[:, -1].tolist() == [num_experts] * num_tokens
    torch.testing.assert_close(weights[:, -1].cpu(), expected_weights[:, -1].float(),
                               rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6, atol=0)


def test_top_k_beyond_the_experts_is_refused():
    with pytest.raises(ValueError, match="top_k 9"):
        route_topk(torch.zeros(1, 8, device=DEVICE), 9, normalize=True, round_to_input=False)
    with pytest.raises(ValueError, match=r"top_k 8 must be in \[1, 7\]"):  # one a shared gate
        route_topk(torch.zeros(1, 8, device=DEVICE), 8, normalize=True, round_to_input=False,
                   shared=True)


@pytest.mark.gpu
@FAMILY
def test_cuda_picks_the_experts_torch_topk_picks_on_cuda(family):
    """Compiled, bf16 router logits as a model gives them: the experts of torch's own
    routing on CUDA (the same set: its order among equal values is its sort's), exact
    ties included, and weights within a bf16 rounding step."""
    shape = shape_of(family, 128, 8)
    generator = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(300, 128, device="cuda", generator=generator).to(torch.bfloat16)
    logits[:40] = logits[:40].round()  # many exact ties, some at the k-th value
    logits[40:60] = 0.0
    weights, ids = kernel_route(logits, shape)
    expected_weights, expected_ids = torch_route(logits, shape)
    ours_sorted, order = ids.long().sort(dim=-1)
    theirs_sorted, expected_order = expected_ids.sort(dim=-1)
    assert torch.equal(ours_sorted, theirs_sorted)
    torch.testing.assert_close(weights.gather(1, order),
                               expected_weights.float().gather(1, expected_order),
                               rtol=2 ** -7, atol=1e-7)


@pytest.mark.gpu
def test_cuda_routing_replays_in_a_graph():
    """No host synchronisation: captured once, replayed on new logits."""
    shape = shape_of("qwen3_moe", 128, 8)
    logits = torch.randn(4, 128, device="cuda").to(torch.bfloat16)
    kernel_route(logits, shape)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = kernel_route(logits, shape)
    logits.copy_(torch.randn(4, 128, device="cuda").to(torch.bfloat16))
    graph.replay()
    assert_routes_equal((weights, ids), rule_route(logits, shape), torch.bfloat16)
