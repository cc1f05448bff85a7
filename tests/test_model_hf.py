"""Our GPT-2 against Hugging Face's ``GPT2LMHeadModel`` with the same weights (tolerance, not exact)."""

import numpy as np
import pytest

from kvstate.impl import Cache
from kvstate.model import GPT2, load_safetensors
from kvstate.spec.errors import ConfigError

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[test])")
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """A tiny random HF GPT-2 saved to safetensors, and ours loaded from that file."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=101, n_positions=64, n_embd=48, n_layer=3, n_head=4,
                                     resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():     # HF zero-initialises biases; random ones test that we add them
        for name, param in hf.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.05)
    folder = tmp_path_factory.mktemp("gpt2")
    hf.save_pretrained(folder, safe_serialization=True)
    ours_config, weights = load_safetensors(folder / "model.safetensors")
    return hf, ours_config, weights


@pytest.fixture(params=["numpy", "torch"])
def ours(request, hf_pair):
    _, config, weights = hf_pair
    if request.param == "numpy":
        return GPT2(config, weights)
    from kvstate.model.torch_gpt2 import TorchGPT2

    return TorchGPT2(config, weights)


def hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].numpy()


def test_loader_reads_the_shape(ours):
    assert (ours.config.n_layer, ours.config.n_head, ours.config.n_embd, ours.config.vocab_size) == (3, 4, 48, 101)


@pytest.mark.parametrize("page_tokens", [4, 64])
def test_prefill_logits_match_hf(hf_pair, ours, page_tokens):
    hf = hf_pair[0]
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 101, 30)]
    ctx = Cache(ours.layout, page_tokens=page_tokens).allocate()
    np.testing.assert_allclose(ours.prefill(ctx, tokens), hf_logits(hf, tokens), rtol=1e-4, atol=1e-4)


def test_decode_steps_match_hf(hf_pair, ours):
    hf = hf_pair[0]
    tokens = [int(t) for t in np.random.default_rng(2).integers(0, 101, 20)]
    ctx = Cache(ours.layout, page_tokens=4).allocate()
    ours.prefill(ctx, tokens[:11])
    expected = hf_logits(hf, tokens)
    for i in range(11, 20):
        np.testing.assert_allclose(ours.decode(ctx, tokens[i]), expected[i], rtol=1e-4, atol=1e-4)


def test_loader_refuses_a_file_without_embeddings(tmp_path):
    from safetensors.numpy import save_file

    save_file({"something.weight": np.zeros((2, 2), np.float32)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ConfigError, match="embeddings"):
        load_safetensors(tmp_path / "x.safetensors")
