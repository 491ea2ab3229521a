"""The slot-major StateStore (gpu/layers/linear_attention.py): every linear-attention
layer's states in one conv and one recurrent tensor, each layer's StateCache a view
``[:, layer]`` of them.

A copy of a slot moves every layer's states, in the batch's order. Each consumer
of a layer's view (the torch conv, the numba recurrence, the Triton kernels in the
interpreter on the CPU, compiled on CUDA) writes into the store itself: a write
into a temporary copy would leave the store unchanged and fail here, where every
result is compared with the same call on a dense, standalone state.
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()  # without it, conftest.py runs Triton's interpreter

from test_model_support import random_hybrid_model, saved  # noqa: E402

from trio_llm.actors.config import EngineConfig  # noqa: E402
from trio_llm.gpu.executor import ModelExecutor, copy_state_slots  # noqa: E402
from trio_llm.gpu.kernels import triton_linear_attention as kernels  # noqa: E402
from trio_llm.gpu.layers.linear_attention import (  # noqa: E402
    LinearAttentionShape,
    StateStore,
    causal_conv1d,
    gated_delta_rule,
)

SHAPE = LinearAttentionShape(num_key_heads=2, num_value_heads=4, key_head_dim=16,
                             value_head_dim=24, conv_kernel_size=4)
NUM_SLOTS, NUM_LAYERS, LAYER = 5, 3, 1
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def random(*shape, seed, dtype=torch.float32, device=DEVICE):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype).to(device)


def ints(values):
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def random_store(device=DEVICE) -> StateStore:
    store = SHAPE.allocate(NUM_SLOTS, NUM_LAYERS, dtype=torch.float32, device=device)
    store.conv.copy_(random(*store.conv.shape, seed=1, device=device))
    store.recurrent.copy_(random(*store.recurrent.shape, seed=2, device=device))
    return store


def assert_other_layers_untouched(store: StateStore, before: StateStore) -> None:
    for layer in range(NUM_LAYERS):
        if layer != LAYER:
            assert torch.equal(store.conv[:, layer], before.conv[:, layer])
            assert torch.equal(store.recurrent[:, layer], before.recurrent[:, layer])


def cloned(store: StateStore) -> StateStore:
    return StateStore(conv=store.conv.clone(), recurrent=store.recurrent.clone())


# -- the layout ------------------------------------------------------------------------


def test_layer_caches_are_views_with_the_stores_slot_stride():
    store = random_store(torch.device("cpu"))
    caches = store.layer_caches()
    assert len(caches) == NUM_LAYERS and store.num_slots == NUM_SLOTS
    assert store.conv.shape == (NUM_SLOTS, NUM_LAYERS, *SHAPE.conv_state_shape)
    assert store.recurrent.shape == (NUM_SLOTS, NUM_LAYERS, *SHAPE.recurrent_state_shape)
    assert store.recurrent.dtype == torch.float32 and store.recurrent[3].is_contiguous()
    for layer, cache in enumerate(caches):
        assert cache.conv.data_ptr() == store.conv[0, layer].data_ptr()
        assert cache.recurrent.data_ptr() == store.recurrent[0, layer].data_ptr()
        # a slot of a layer is a whole StateStore slot after the one before
        assert cache.recurrent.stride(0) == store.recurrent[0].numel()
        assert cache.conv.stride(0) == store.conv[0].numel()
        assert cache.recurrent[2].is_contiguous() and not cache.recurrent.is_contiguous()
    caches[2].recurrent[4].fill_(7.0)
    assert (store.recurrent[4, 2] == 7.0).all()


def test_one_copy_moves_every_layers_states_and_copies_run_in_order():
    """(0 -> 1) then (1 -> 3): slot 3 ends holding slot 0's states, in every layer
    (the second copy reads what the first wrote); slots outside the store refused."""
    store = random_store(torch.device("cpu"))
    before = cloned(store)
    copy_state_slots(store, [(0, 1), (1, 3)])
    for cache in store.layer_caches():
        assert torch.equal(cache.conv[3], cache.conv[0])
        assert torch.equal(cache.recurrent[1], cache.recurrent[0])
        assert torch.equal(cache.recurrent[3], cache.recurrent[0])
    assert torch.equal(store.recurrent[3], before.recurrent[0])
    assert torch.equal(store.recurrent[[0, 2, 4]], before.recurrent[[0, 2, 4]])
    with pytest.raises(ValueError, match="outside 0..4"):
        copy_state_slots(store, [(0, NUM_SLOTS)])


# -- the CPU layer's paths ---------------------------------------------------------------


def test_the_torch_conv_and_the_numba_recurrence_write_into_the_store():
    """GatedDeltaNet.forward's calls on a layer's slot (``cache.conv[slot]``,
    ``cache.recurrent[slot]``), continuing and from zeros: the store's slot holds what
    the same calls leave in a standalone state."""
    store = random_store(torch.device("cpu"))
    before = cloned(store)
    cache = store.layer_caches()[LAYER]
    weight = random(SHAPE.conv_channels, SHAPE.conv_kernel_size, seed=3, device="cpu")
    for slot, continues in [(2, True), (4, False)]:
        x = random(3, SHAPE.conv_channels, seed=10 + slot, device="cpu")
        dense_conv = cache.conv[slot].clone()
        out = causal_conv1d(x, cache.conv[slot], weight, continues)
        assert torch.equal(out, causal_conv1d(x, dense_conv, weight, continues))
        assert torch.equal(cache.conv[slot], dense_conv)
        assert not torch.equal(cache.conv[slot], before.conv[slot, LAYER])
        q = random(3, SHAPE.num_key_heads, SHAPE.key_head_dim, seed=20 + slot, device="cpu")
        k = random(3, SHAPE.num_key_heads, SHAPE.key_head_dim, seed=30 + slot, device="cpu")
        v = random(3, SHAPE.num_value_heads, SHAPE.value_head_dim, seed=40 + slot,
                   device="cpu")
        decay = -random(3, SHAPE.num_value_heads, seed=50 + slot, device="cpu").abs()
        beta = random(3, SHAPE.num_value_heads, seed=60 + slot, device="cpu").sigmoid()
        dense = cache.recurrent[slot].clone()
        out = gated_delta_rule(q, k, v, decay, beta, cache.recurrent[slot], continues)
        assert torch.equal(out, gated_delta_rule(q, k, v, decay, beta, dense, continues))
        assert torch.equal(store.recurrent[slot, LAYER], dense)
        assert not torch.equal(dense, before.recurrent[slot, LAYER])
    assert_other_layers_untouched(store, before)


# -- the Triton kernels --------------------------------------------------------------------


def step_layout():
    """A chunk continuing slot 3, one from zeros into slot 0, a decode row of slot 2, a
    padding sequence."""
    lengths, computed, slots = [5, 4, 1, 2], [6, 0, 9, 0], [3, 0, 2, -1]
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    contexts = [c + n for c, n in zip(computed, lengths, strict=True)]
    return sum(lengths), ints(starts), ints(contexts), ints(slots)


def test_the_conv_kernels_write_into_the_store():
    num_tokens, starts, contexts, slots = step_layout()
    store = random_store()
    before = cloned(store)
    conv = store.layer_caches()[LAYER].conv
    dense = conv.clone()
    x = random(num_tokens, SHAPE.conv_channels, seed=70)
    weight = random(SHAPE.conv_channels, SHAPE.conv_kernel_size, seed=71)
    out = kernels.causal_conv1d_varlen(x, weight, None, conv, starts, contexts, slots)
    expected = kernels.causal_conv1d_varlen(x, weight, None, dense, starts, contexts, slots)
    assert torch.equal(out, expected) and torch.equal(conv, dense)
    assert not torch.equal(conv, before.conv[:, LAYER])
    rows = random(3, SHAPE.conv_channels, seed=72)
    decode_contexts, decode_slots = ints([8, 1, 3]), ints([1, 4, -1])
    out = kernels.causal_conv1d_decode(rows, weight, None, conv, decode_contexts, decode_slots)
    expected = kernels.causal_conv1d_decode(rows, weight, None, dense, decode_contexts,
                                            decode_slots)
    assert torch.equal(out, expected) and torch.equal(conv, dense)
    assert_other_layers_untouched(store, before)


def delta_rule_inputs(num_rows, seed):
    return (random(num_rows, SHAPE.num_key_heads, SHAPE.key_head_dim, seed=seed),
            random(num_rows, SHAPE.num_key_heads, SHAPE.key_head_dim, seed=seed + 1),
            random(num_rows, SHAPE.num_value_heads, SHAPE.value_head_dim, seed=seed + 2),
            random(num_rows, SHAPE.num_value_heads, seed=seed + 3),
            random(num_rows, SHAPE.num_value_heads, seed=seed + 4),
            random(SHAPE.num_value_heads, seed=seed + 5),
            random(SHAPE.num_value_heads, seed=seed + 6))


def test_the_delta_rule_kernels_and_the_state_gather_write_into_the_store():
    """The decode kernel (row per sequence), the mixed step (its varlen decode, the
    chunked path's gathered states scattered back) and gather/scatter on a layer's
    view: what a standalone state gets."""
    from trio_llm.actors.config import MAX_CHUNKED_SEQS
    from trio_llm.gpu.kernels.fla_gated_delta_rule import mixed_gated_delta_rule

    store = random_store()
    store.recurrent.mul_(0.1)
    before = cloned(store)
    recurrent = store.layer_caches()[LAYER].recurrent
    dense = recurrent.clone()
    scale = SHAPE.key_head_dim ** -0.5
    inputs = delta_rule_inputs(3, seed=80)
    decode_contexts, decode_slots = ints([8, 1, 3]), ints([1, 4, -1])
    out = kernels.gated_delta_rule_decode(*inputs, recurrent, decode_contexts, decode_slots,
                                          scale)
    expected = kernels.gated_delta_rule_decode(*inputs, dense, decode_contexts, decode_slots,
                                               scale)
    assert torch.equal(out, expected) and torch.equal(recurrent, dense)
    assert not torch.equal(recurrent, before.recurrent[:, LAYER])
    num_tokens, starts, contexts, slots = step_layout()
    inputs = delta_rule_inputs(num_tokens, seed=90)
    out = mixed_gated_delta_rule(*inputs, recurrent, starts, contexts, slots, scale,
                                 MAX_CHUNKED_SEQS)
    expected = mixed_gated_delta_rule(*inputs, dense, starts, contexts, slots, scale,
                                      MAX_CHUNKED_SEQS)
    assert torch.equal(out, expected) and torch.equal(recurrent, dense)
    gathered = kernels.gather_states(recurrent, starts, contexts, slots)
    assert torch.equal(gathered[0], recurrent[3]) and not gathered[1].any()
    kernels.scatter_states(gathered + 1.0, recurrent, slots)
    kernels.scatter_states(gathered + 1.0, dense, slots)
    assert torch.equal(recurrent, dense) and torch.equal(recurrent[3], gathered[0] + 1.0)
    assert_other_layers_untouched(store, before)


# -- the executor --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid_checkpoint(tmp_path_factory):
    return saved(random_hybrid_model("Qwen3_5ForCausalLM"), tmp_path_factory.mktemp("hybrid"))[0]


def test_the_executors_state_caches_are_the_stores_views(hybrid_checkpoint):
    """The executor's linear-attention layers compute on views of its one StateStore;
    a batch's copy (``copy_state_slots``, as both executors call it) moves them all."""
    executor = ModelExecutor.create(EngineConfig(
        model=str(hybrid_checkpoint), block_size=16, num_kv_blocks=64, device="cpu",
        dtype="float32", max_num_seqs=4, enable_prefix_caching=False))
    store = executor.state_store
    assert store is not None and store.num_slots == executor.num_state_slots == 4
    assert store.recurrent.shape[1] == len(executor.state_caches) == 4
    for layer, cache in enumerate(executor.state_caches):
        assert cache.recurrent.data_ptr() == store.recurrent[0, layer].data_ptr()
        assert cache.conv.data_ptr() == store.conv[0, layer].data_ptr()
    store.recurrent[0].normal_()
    copy_state_slots(store, [(0, 2)])
    for cache in executor.state_caches:
        assert cache.recurrent[2].any() and torch.equal(cache.recurrent[2], cache.recurrent[0])
