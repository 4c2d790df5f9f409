"""Packed document batches: every step's documents land whole in its rows, the same fixed shape each step, the
step sequence deterministic; and stages that carry the boundaries in their activations compute what the whole
model computes with the boundaries given (loss and every gradient)."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from evenpipe.errors import ConfigError
from evenpipe.models import build_model, lm_loss, model_config
from evenpipe.models.documents import Documents
from evenpipe.runtime.document_batches import IGNORE_INDEX, DocumentBatches
from evenpipe.runtime.stages import build_stage_modules

SEQ = 16


def _docs_file(tmp: pathlib.Path, count: int = 40, seed: int = 0) -> tuple[pathlib.Path, list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 256, (int(torch.randint(2, SEQ + 2, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(count)]
    path = tmp / "docs.jsonl"
    path.write_text("".join(json.dumps({"tokens": d}) + "\n" for d in docs))
    return path, docs


def _batches(path: pathlib.Path, policy: str, **kw) -> DocumentBatches:
    args = {"path": str(path), "seq_len": SEQ, "vocab": 256, "seed": 1, "policy": policy, "num_replicas": 2,
            "num_microbatches": 2, "rows_per_microbatch": 2, **kw}
    return DocumentBatches(**args)


def _rows_as_documents(batch) -> list[list[int]]:
    """Each document of each row, rebuilt as its full token list (inputs plus its last target)."""
    out = []
    for tokens, ids, targets in zip(batch.tokens[:, 0], batch.tokens[:, 1], batch.targets):
        for d in ids.unique().tolist():
            at = (ids == d) & (targets != IGNORE_INDEX)
            if at.any():
                out.append(tokens[at].tolist() + [int(targets[at][-1])])
    return out


@pytest.mark.parametrize("policy", ["pad", "pack", "balance"])
def test_each_step_holds_its_documents_whole(tmp_path: pathlib.Path, policy: str) -> None:
    path, docs = _docs_file(tmp_path)
    data = _batches(path, policy)
    seen: list[int] = []
    for step in range(3):
        batch = data.batch(step, 8)
        assert batch.tokens.shape == (8, 2, SEQ) and batch.targets.shape == (8, SEQ)
        wanted = sorted(docs[i] for i in data.step_documents(step))
        assert sorted(_rows_as_documents(batch)) == wanted
        seen += data.step_documents(step)
    assert len(set(seen[:40])) == min(40, len(seen))  # no document twice within an epoch
    again = _batches(path, policy)
    assert torch.equal(again.batch(2, 8).tokens, data.batch(2, 8).tokens)  # planned from step 0, same result
    if policy == "pad":
        assert all(len(data.step_documents(s)) == 8 for s in range(3))
    else:
        assert len(data.step_documents(0)) > 8  # several documents a row


def test_pack_and_balance_take_the_same_documents(tmp_path: pathlib.Path) -> None:
    path, _ = _docs_file(tmp_path)
    assert _batches(path, "pack").step_documents(1) == _batches(path, "balance").step_documents(1)


def test_bad_documents_and_batch_sizes(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"tokens": list(range(40))}) + "\n" + json.dumps({"tokens": [1]}) + "\n")
    with pytest.raises(ConfigError, match="has 40 tokens, more than the budget of 17"):
        _batches(path, "pack")
    data = _batches(path, "pack", split_long=True)
    assert data.num_skipped == 1 and data.docs.lengths.tolist() == [17, 17, 6]
    with pytest.raises(ConfigError, match="fill dp x microbatches x microbatch-size = 8 rows"):
        data.batch(0, 4)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_packed_stages_compute_the_model_with_its_boundaries(tmp_path: pathlib.Path, name: str) -> None:
    path, _ = _docs_file(tmp_path)
    batch = _batches(path, "balance").batch(0, 8)
    tokens, ids, targets = batch.tokens[:2, 0], batch.tokens[:2, 1], batch.targets[:2]
    model = build_model(model_config(name, seq_len=SEQ), seed=4)
    lm_loss(model(tokens, Documents(ids)), targets).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    stages = build_stage_modules(model.pipeline_parts(), num_stages=3, stages=[0, 1, 2])
    x = batch.tokens[:2]
    for s in range(3):
        stages[s].packed = True
        x = stages[s](x)
        if s < 2:
            assert x.shape == (2, SEQ, model.cfg.hidden + 1)
    loss = lm_loss(x, targets)
    loss.backward()
    torch.testing.assert_close(loss, lm_loss(model(tokens, Documents(ids)), targets))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], msg=n)
