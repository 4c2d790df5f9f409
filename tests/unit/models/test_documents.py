"""Packed rows: a row of several documents (block-diagonal attention, positions restarting per document) trains
exactly like its documents run one at a time through the plain causal path, in loss and in every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from evenpipe.models import build_model, model_config
from evenpipe.models.documents import Documents, doc_ids_from_lengths

MODELS = ["gpt-tiny", "llama-tiny"]
ROWS = [[5, 9, 1, 7], [12, 3]]  # document lengths per row; each row is padded to SEQ
SEQ = 26
IGNORE = -100


def _docs(seed: int = 0) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """(tokens, targets) of each document, grouped by row."""
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, 256, (n,), generator=gen), torch.randint(0, 256, (n,), generator=gen))
             for n in row] for row in ROWS]


def _packed(docs: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.zeros(len(docs), SEQ, dtype=torch.int64)
    targets = torch.full((len(docs), SEQ), IGNORE, dtype=torch.int64)
    for r, row in enumerate(docs):
        used = sum(len(t) for t, _ in row)
        tokens[r, :used] = torch.cat([t for t, _ in row])
        targets[r, :used] = torch.cat([y for _, y in row])
    return tokens, targets


def _loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum",
                           ignore_index=IGNORE)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", MODELS)
def test_a_packed_row_trains_like_its_documents_one_by_one(name: str, attention: str) -> None:
    docs = _docs()
    model = build_model(model_config(name, attention=attention), seed=7)
    reference = torch.zeros(())
    for row in docs:
        for tokens, targets in row:  # the default path: no documents, one document per call
            loss = _loss_sum(model(tokens[None]), targets[None])
            loss.backward()
            reference = reference + loss.detach()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)

    tokens, targets = _packed(docs)
    packed = _loss_sum(model(tokens, Documents(doc_ids_from_lengths(ROWS, SEQ))), targets)
    packed.backward()
    torch.testing.assert_close(packed.detach(), reference)
    for n, g in _grads(model).items():
        torch.testing.assert_close(g, expected[n], msg=n)


@pytest.mark.parametrize("name", MODELS)
def test_without_documents_the_packed_row_attends_across_boundaries(name: str) -> None:
    """The check above can fail: the same row without its boundaries gives a different loss."""
    docs = _docs()
    model = build_model(model_config(name), seed=7)
    tokens, targets = _packed(docs)
    with torch.no_grad():
        masked = _loss_sum(model(tokens, Documents(doc_ids_from_lengths(ROWS, SEQ))), targets)
        unmasked = _loss_sum(model(tokens), targets)
    assert abs(float(masked) - float(unmasked)) > 1e-3


@pytest.mark.parametrize("name", MODELS)
def test_one_document_per_row_matches_the_causal_path(name: str) -> None:
    model = build_model(model_config(name), seed=3)
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(tokens)
        single = model(tokens, Documents(torch.zeros(2, 20, dtype=torch.int64)))
    torch.testing.assert_close(single, plain)


def test_positions_and_mask_follow_the_runs() -> None:
    docs = Documents(torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 3, 3]]))
    assert docs.positions.tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 1]]
    mask = docs.mask[1, 0].int().tolist()
    assert mask[4] == [0, 0, 0, 0, 1, 0] and mask[5] == [0, 0, 0, 0, 1, 1] and mask[3] == [1, 1, 1, 1, 0, 0]
    assert docs.segments == (((0, 2), (2, 5), (5, 6)), ((0, 4), (4, 6)))  # the runs the attention core takes
    assert doc_ids_from_lengths([[2, 1]], 5).tolist() == [[0, 0, 1, 2, 2]]
    with pytest.raises(ValueError, match="sum to at most 4"):
        doc_ids_from_lengths([[3, 2]], 4)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_hugging_face_stages_keep_attention_inside_documents(name: str) -> None:
    pytest.importorskip("transformers")
    import pathlib

    from evenpipe.models.hf import hf_model
    from evenpipe.runtime.stages import build_stage_modules

    built = hf_model(pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "hf" / name, seed=1)
    stages = build_stage_modules(built.parts, num_stages=2, stages=[0, 1])
    docs = _docs()
    reference = torch.zeros(())
    for row in docs:
        for tokens, targets in row:
            loss = _loss_sum(stages[1](stages[0](tokens[None])), targets[None])
            loss.backward()
            reference = reference + loss.detach()
    expected = {n: p.grad.clone() for n, p in built.module.named_parameters()}
    built.module.zero_grad(set_to_none=True)
    tokens, targets = _packed(docs)
    documents = Documents(doc_ids_from_lengths(ROWS, SEQ))
    packed = _loss_sum(stages[1](stages[0](tokens, documents), documents), targets)
    packed.backward()
    torch.testing.assert_close(packed.detach(), reference)
    for n, p in built.module.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], msg=n)
