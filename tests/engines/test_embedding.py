"""The one-forward embedding reference (engines/embedding.py `embed`) against transformers' own model class on the
embedded small checkpoint: mean and last-token pooling of its final hidden states, normalised; a varlen batch
gives each input what it gets alone; the served path (the engine's step loop, `LLM.embed`) gives the same
vectors on both CPU forwards (what else it must hold there: test_embedding_engine.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines import LLM
from engines.embedding import embed
from engines.loader import load_checkpoint
from engines.tokenizer import Tokenizer

SMALL = Path(__file__).resolve().parents[2] / "models" / "tandem-tiny-s"
TEXTS = ["The quick brown fox", "def read_config(path):", "Once upon a time there was a sea"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return load_checkpoint(SMALL, dtype=torch.float32).model


@pytest.fixture(scope="module")
def ids():
    tokenizer = Tokenizer.from_pretrained(SMALL)
    return [tokenizer.encode(t) for t in TEXTS]


@pytest.mark.parametrize("source", ["one forward", "served, C forward", "served, PyTorch forward"])
@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_vectors_are_transformers_last_hidden_state_pooled_and_normalised(model, ids, pooling, source, monkeypatch):
    """`embed`, and the engine's step loop (`LLM.embed`) on either CPU forward."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(SMALL, dtype=torch.float32).eval()
    if source == "one forward":
        ours = embed(model, ids, pooling)
    else:
        c_forward = source == "served, C forward"
        monkeypatch.setenv("TANDEM_CPU_FORWARD", "1" if c_forward else "0")
        llm = LLM(SMALL, dtype="float32")
        assert (llm.engine.runner.cpu_forward is not None) == c_forward
        ours = llm.embed(ids, pooling)
        assert llm.stats()["used_pages"] == 0 and llm.engine.stats()["num_generated_tokens"] == 0
    assert ours.shape == (len(ids), hf.config.hidden_size)
    for i, one in enumerate(ids):
        with torch.no_grad():
            hidden = hf(torch.tensor([one]), output_hidden_states=True).hidden_states[-1][0]  # after the norm
        pooled = hidden.mean(0) if pooling == "mean" else hidden[-1]
        theirs = pooled / pooled.norm()
        assert torch.allclose(ours[i], theirs, atol=1e-4), (i, (ours[i] - theirs).abs().max())
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(ids)), atol=1e-5)
    assert (ours[0] @ ours[1]).item() < 0.9999  # different texts, different vectors


def test_a_batch_gives_each_input_what_it_gets_alone(model, ids):
    together = embed(model, ids)
    for i, one in enumerate(ids):
        assert torch.allclose(together[i], embed(model, [one])[0], atol=1e-5)


def test_bad_pooling_and_empty_inputs_are_refused(model):
    with pytest.raises(ValueError, match="pooling"):
        embed(model, [[1, 2]], "cls")
    with pytest.raises(ValueError, match="at least one token"):
        embed(model, [[1], []])
