"""caper_jax Qwen3.5 vs transformers' PyTorch Qwen3_5ForCausalLM on tiny random models.

Every reference number comes from transformers (fp32, eager attention, its torch fallbacks of the
gated delta rule). The models come from tests/helpers.build_hf_model with a fixed torch seed, and
the weights transformers initialises to constants (zero-centred norms, the gated norm, A_log,
dt_bias) are randomised so that a mis-wired norm or gate cannot hide. Each jitted program is compiled once per config.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from caper_jax.models import ConfigError, Qwen35Config, Qwen35ForCausalLM, from_hf
from tests.helpers import TINY_HF_CONFIGS, build_hf_model

# max |Δlogit| between two fp32 implementations (logits of order 1): each rounds at eps = 1.2e-7 per
# op, and a few hundred accumulations (GEMM rows, norms, softmax, the DeltaNet chunk solve) stay
# well under 1000 eps = 1.2e-4; a real defect moves logits by 1e-2 or more.
FP32_ATOL = 1e-4
BF16_VS_HF_BF16 = 2.0     # bf16 error vs fp32 reference <= 2 x transformers' own bf16 error (docs/model.md)
T = 150                   # > 2 DeltaNet chunks, not a multiple of 64
PAD = 37

@pytest.fixture(scope="module", params=list(TINY_HF_CONFIGS))
def pair(request, tmp_path_factory):
    """(transformers model, caper_jax model, config) for one tiny config, via a saved checkpoint."""
    hf_model = build_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(path)
    model, config = from_hf(path, dtype="float32")
    return hf_model, model, config, request.param


def jit_call(model, method: str):
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda s, *args: getattr(nnx.merge(graphdef, s), method)(*args))
    return lambda *args: fn(state, *args)


def left_padded_batch(vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Row 0: T real tokens; row 1: PAD left pads (token 0) then T - PAD real tokens."""
    ids = np.random.default_rng(seed).integers(1, vocab, (2, T))
    mask = np.ones((2, T), np.int64)
    mask[1, :PAD] = 0
    ids[1, :PAD] = 0
    return ids, mask


def hf_logits(hf_model, ids, mask) -> np.ndarray:
    positions = np.clip(mask.cumsum(-1) - 1, 0, None)  # what generate() passes: pads skipped
    with torch.no_grad():
        out = hf_model(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), position_ids=torch.as_tensor(positions))
    return out.logits.float().numpy()


def test_forward_and_hidden_states_match_transformers(pair):
    hf_model, model, config, _ = pair
    ids, mask = left_padded_batch(config.vocab_size)
    expected = hf_logits(hf_model, ids, mask)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, ids, mask):
        m = nnx.merge(graphdef, state)
        hidden = m.hidden_states(ids, mask)
        return hidden, m.project(hidden)

    hidden, logits = map(np.asarray, forward(state, jnp.asarray(ids, jnp.int32), jnp.asarray(mask)))
    real = mask.astype(bool)
    assert np.abs(expected[real]).max() > 0.5  # logits of order 1: the tolerance means something
    np.testing.assert_allclose(logits[real], expected[real], atol=FP32_ATOL, rtol=0)
    with torch.no_grad():
        expected_hidden = hf_model.model(torch.as_tensor(ids[:1])).last_hidden_state.numpy()
    np.testing.assert_allclose(hidden[:1], expected_hidden, atol=FP32_ATOL, rtol=0)


def greedy(model, ids: np.ndarray, mask: np.ndarray, new_tokens: int) -> np.ndarray:
    """A plain greedy loop over prefill / decode_step (the cache API the sampler builds on)."""
    prefill, step = jit_call(model, "prefill"), jit_call(model, "decode_step")
    cache = model.init_cache(ids.shape[0], ids.shape[1] + new_tokens)
    logits, cache = prefill(jnp.asarray(ids, jnp.int32), jnp.asarray(mask), cache)
    tokens = []
    for _ in range(new_tokens):
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        tokens.append(np.asarray(token))
        logits, cache = step(token, cache)
    return np.stack(tokens, axis=1)


def test_greedy_decoding_matches_generate(pair):
    hf_model, model, config, _ = pair
    rng = np.random.default_rng(2)
    ids = rng.integers(1, config.vocab_size, (3, 70))
    mask = np.ones_like(ids)
    mask[1, :20] = 0   # left padding, prompt crosses a chunk boundary
    mask[2, :67] = 0   # a 3-token prompt, shorter than the conv window
    ids[mask == 0] = 0
    new_tokens = 12
    with torch.no_grad():
        expected = hf_model.generate(
            torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        ).numpy()[:, ids.shape[1]:]
    np.testing.assert_array_equal(greedy(model, ids, mask, new_tokens), expected)


def test_packed_segments_match_separate_sequences(pair):
    """Two sequences packed in one row (segment_ids) give the logits transformers gives each alone."""
    hf_model, model, config, name = pair
    if name != "tied":
        pytest.skip("one config suffices: packing does not depend on the head (tied: cheaper to compile)")
    rng = np.random.default_rng(3)
    lengths = (83, 67)                       # the boundary falls inside the second chunk
    ids = rng.integers(0, config.vocab_size, (1, sum(lengths)))
    segment_ids = np.repeat([[1, 2]], lengths, axis=1)
    logits = np.asarray(
        jit_call(model, "__call__")(jnp.asarray(ids, jnp.int32), jnp.ones(ids.shape, bool), jnp.asarray(segment_ids))
    )
    start = 0
    for length in lengths:
        with torch.no_grad():
            expected = hf_model(torch.as_tensor(ids[:, start:start + length])).logits.numpy()
        np.testing.assert_allclose(logits[:, start:start + length], expected, atol=FP32_ATOL, rtol=0)
        start += length


def test_bf16_within_documented_tolerance(pair, tmp_path):
    """bf16 vs the fp32 reference: no worse than twice transformers' own bf16 error on the same inputs."""
    hf_model, _, config, name = pair
    if name != "tied":
        pytest.skip("one config suffices for the bf16 tolerance (tied: cheaper to compile)")
    hf_model.save_pretrained(tmp_path)
    model, bf16_config = from_hf(tmp_path, dtype="bfloat16")
    assert bf16_config.dtype == "bfloat16" and model.embed_tokens[...].dtype == jnp.bfloat16
    ids, mask = left_padded_batch(config.vocab_size)
    expected = hf_logits(hf_model, ids, mask)
    hf_bf16 = hf_logits(build_hf_model(name).to(torch.bfloat16), ids, mask).astype(np.float32)
    logits = np.asarray(jit_call(model, "__call__")(jnp.asarray(ids, jnp.int32), jnp.asarray(mask)))
    real = mask.astype(bool)
    error = np.abs(logits[real] - expected[real]).max()
    hf_error = np.abs(hf_bf16[real] - expected[real]).max()
    assert FP32_ATOL < error <= BF16_VS_HF_BF16 * hf_error, (error, hf_error)


def test_config_reads_multimodal_layout_and_round_trips():
    text = transformers.Qwen3_5TextConfig(**TINY_HF_CONFIGS["tied"]).to_dict()
    multimodal = transformers.Qwen3_5Config(text_config=text, tie_word_embeddings=False).to_dict()
    config = Qwen35Config.from_hf_dict(multimodal)
    assert config.tie_word_embeddings is False          # the wrapper's flag wins
    assert config.rope_theta == 1e6 and config.partial_rotary_factor == 0.5 and config.rotary_dim == 12
    assert config.period == ("linear_attention", "full_attention") and config.num_groups == 2
    again = Qwen35Config.from_hf_dict(config.to_hf_dict())
    assert again == config
    nine_b = Qwen35Config.qwen35_9b()
    assert (nine_b.period, nine_b.num_groups, nine_b.rotary_dim) == (("linear_attention",) * 3 + ("full_attention",), 8, 64)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "rope_type"),
        (dict(model_type="llama"), "model_type"),
        (dict(layer_types=["linear_attention", "sliding_attention"] * 4), "unknown layer types"),
        (dict(layer_types=["linear_attention"] * 4), "4 entries for 8 layers"),
    ],
)
def test_config_refuses_what_it_cannot_represent(change, message):
    d = transformers.Qwen3_5TextConfig(**TINY_HF_CONFIGS["untied"]).to_dict()
    d.update(change)
    with pytest.raises(ConfigError, match=message):
        Qwen35Config.from_hf_dict(d)


def test_gradients_through_rematerialised_scan_match_torch(tmp_path):
    """Gradients through the scanned stack with remat="dots" equal torch autograd's."""
    hf_model = build_hf_model("tied", seed=1)
    ids = np.random.default_rng(4).integers(0, hf_model.config.vocab_size, (2, 70))
    weights = np.random.default_rng(5).normal(size=(2, 70, hf_model.config.vocab_size)).astype(np.float32)
    (hf_model(torch.as_tensor(ids)).logits * torch.as_tensor(weights)).sum().backward()
    hf_model.save_pretrained(tmp_path)
    model, _ = from_hf(tmp_path, dtype="float32", remat="dots")

    def objective(m):
        return jnp.sum(m(jnp.asarray(ids, jnp.int32)) * weights)

    grads = nnx.jit(nnx.grad(objective))(model)
    layers = hf_model.model.layers
    pairs = {  # layer 2 = group 1 of period position 0; layer 3 = group 1 of position 1
        "embed": (grads.embed_tokens[...], hf_model.model.embed_tokens.weight.grad),
        "A_log": (grads.layers[0].linear_attn.A_log[...][1], layers[2].linear_attn.A_log.grad),
        "conv1d": (grads.layers[0].linear_attn.conv1d[...][0], layers[0].linear_attn.conv1d.weight.grad[:, 0]),
        "q_proj": (grads.layers[1].self_attn.q_proj[...][1], layers[3].self_attn.q_proj.weight.grad.T),
        "q_norm": (grads.layers[1].self_attn.q_norm.weight[...][0], layers[1].self_attn.q_norm.weight.grad),
    }
    for key, (ours, theirs) in pairs.items():
        theirs = theirs.numpy()
        np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4 * np.abs(theirs).max(), rtol=1e-3, err_msg=key)


@pytest.mark.parametrize("remat, expected", [("none", False), ("full", True), ("dots", True)])
def test_remat_policy_wraps_the_layer_group(remat, expected):
    """The scan body is a checkpoint (remat) exactly when a policy is set (traced, not compiled)."""
    model = nnx.eval_shape(lambda: Qwen35ForCausalLM(Qwen35Config.tiny(remat=remat), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s).hidden_states(jnp.zeros((1, 8), jnp.int32)))(state)
    assert ("checkpoint" in str(jaxpr) or "remat" in str(jaxpr)) == expected
