"""Packed document batches: every step's documents land whole in its rows, each micro-batch as long as its
longest row (rounded up), the step sequence deterministic; and stages that carry the boundaries in their activations compute what the whole
model computes with the boundaries given (loss and every gradient)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch

from evenpipe.errors import ConfigError
from evenpipe.models import build_model, lm_loss, model_config
from evenpipe.models.documents import Documents
from evenpipe.runtime.document_batches import IGNORE_INDEX, DocumentBatches, microbatch_length
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
            "num_microbatches": 2, "rows_per_microbatch": 2, "length_multiple": 4, **kw}
    return DocumentBatches(**args)


def _rows_as_documents(batch) -> list[list[int]]:
    """Each document of each row, rebuilt as its full token list (inputs plus its last target)."""
    out = []
    rows = [(t, i, y) for part in batch.parts for t, i, y in zip(part.tokens[:, 0], part.tokens[:, 1], part.targets)]
    for tokens, ids, targets in rows:
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
        assert len(batch.parts) == 4  # dp x M micro-batches
        for part in batch.parts:
            longest = int((part.targets != IGNORE_INDEX).sum(dim=1).max())  # real positions of the longest row
            assert part.tokens.shape == (2, 2, part.targets.shape[1]) and part.targets.shape[0] == 2
            assert part.targets.shape[1] == min(SEQ, max(4, -(-longest // 4) * 4)), (longest, part.targets.shape)
        wanted = sorted(docs[i] for i in data.step_documents(step))
        assert sorted(_rows_as_documents(batch)) == wanted
        seen += data.step_documents(step)
    assert len(set(seen[:40])) == min(40, len(seen))  # no document twice within an epoch
    again = _batches(path, policy)
    assert all(torch.equal(a, b) for a, b in zip(again.batch(2, 8).tokens, data.batch(2, 8).tokens))  # from step 0
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
    part = _batches(path, "balance").batch(0, 8).parts[0]
    tokens, ids, targets = part.tokens[:, 0], part.tokens[:, 1], part.targets
    model = build_model(model_config(name, seq_len=SEQ), seed=4)
    lm_loss(model(tokens, Documents(ids)), targets).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    stages = build_stage_modules(model.pipeline_parts(), num_stages=3, stages=[0, 1, 2])
    x = part.tokens
    for s in range(3):
        stages[s].packed = True
        x = stages[s](x)
        if s < 2:
            assert x.shape == (2, tokens.shape[1], model.cfg.hidden + 1)
    loss = lm_loss(x, targets)
    loss.backward()
    torch.testing.assert_close(loss, lm_loss(model(tokens, Documents(ids)), targets))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], msg=n)


def test_microbatch_lengths_follow_their_rows(tmp_path: pathlib.Path) -> None:
    """pad with one row a micro-batch: each micro-batch is its document's length class; a multiple of seq_len
    gives every micro-batch the whole row (the fixed shape)."""
    path, docs = _docs_file(tmp_path, count=24)
    data = _batches(path, "pad", rows_per_microbatch=1, num_replicas=1, num_microbatches=4)
    lengths = [part.targets.shape[1] for s in range(3) for part in data.batch(s, 4).parts]
    wanted = [min(SEQ, max(4, -(-(len(docs[d]) - 1) // 4) * 4)) for s in range(3)
              for d in data.step_documents(s)]
    assert sorted(lengths) == sorted(wanted) and len(set(lengths)) > 1
    fixed = _batches(path, "pack", length_multiple=SEQ).batch(0, 8)
    assert {part.tokens.shape for part in fixed.parts} == {(2, 2, SEQ)}
    one = [np.arange(7), np.arange(3)]
    assert microbatch_length([one, []], seq_len=SEQ, multiple=8) == 8  # 6 + 2 positions
    assert microbatch_length([[], []], seq_len=SEQ, multiple=8) == 8
    assert microbatch_length([[np.arange(17)]], seq_len=SEQ, multiple=5) == SEQ  # capped at the row


@pytest.mark.parametrize("policy", ["pad", "pack", "balance"])
def test_simulated_order_permutes_each_replicas_microbatches(tmp_path: pathlib.Path, policy: str) -> None:
    """``--microbatch-order simulated``: each replica keeps its micro-batches (same documents, same shapes), in the
    order the orderer chose; two instances choose alike (every rank does, without a message); the report counts."""
    from evenpipe.plan.order_choice import MicrobatchOrderer
    from evenpipe.schedule import build_schedule
    path, _ = _docs_file(tmp_path, count=80)
    orderer = MicrobatchOrderer(build_schedule("1f1b", num_ranks=2, num_microbatches=4))
    planned = _batches(path, policy, num_microbatches=4)
    ordered, again = (_batches(path, policy, num_microbatches=4, orderer=orderer) for _ in range(2))
    changed = 0
    for step in range(4):
        a, b, c = planned.batch(step, 16), ordered.batch(step, 16), again.batch(step, 16)
        assert all(torch.equal(x.tokens, y.tokens) for x, y in zip(b.parts, c.parts))
        for rep in range(2):
            mine = [(p.tokens.shape, p.tokens.sum().item()) for p in a.parts[4 * rep:4 * rep + 4]]
            theirs = [(p.tokens.shape, p.tokens.sum().item()) for p in b.parts[4 * rep:4 * rep + 4]]
            assert sorted(mine, key=str) == sorted(theirs, key=str)
            changed += mine != theirs
    report = ordered.report()["order"]
    assert report["choices"] == 8 and report["changed"] == changed > 0
    assert report["predicted_gain_mean"] >= 0.0 and report["choice_ms_max"] >= report["choice_ms_median"] >= 0.0
    assert "order" not in planned.report()


@pytest.mark.parametrize("policy", ["pad", "pack", "balance"])
def test_a_memory_budget_bounds_every_microbatch(tmp_path: pathlib.Path, policy: str) -> None:
    """With ``max_bytes``, every micro-batch the runtime computes (its rows times its length, in positions) times
    the bytes per position stays within the budget; documents too long for it alone are cut (or refused, named)."""
    path, docs = _docs_file(tmp_path, count=60)
    per_position, budget = 100.0, 100.0 * 2 * 10  # two rows of 10 positions: with multiples of 4, 8 fit
    with pytest.raises(ConfigError, match=r"document \d+ of .* tokens: alone it needs more than "
                                          r"--microbatch-memory 2000 "):
        _batches(path, policy, max_bytes=budget, bytes_per_token=per_position)
    data = _batches(path, policy, max_bytes=budget, bytes_per_token=per_position, split_long=True)
    assert data.report()["cut"] > 0
    shapes = [part.tokens.shape for s in range(4) for part in data.batch(s, 8).parts]
    assert max(b * t * per_position for b, _, t in shapes) <= budget
    assert max(t for _, _, t in shapes) == 8  # the budget binds: rows of 12 would exceed it
    free = _batches(path, policy)
    assert max(part.tokens.shape[-1] for part in free.batch(0, 8).parts) > 8
    with pytest.raises(ConfigError, match="holds no micro-batch"):
        _batches(path, policy, max_bytes=budget, bytes_per_token=budget, split_long=True)


def test_step_shapes_are_the_runtime_shapes(tmp_path: pathlib.Path) -> None:
    """``step_shapes`` (what the cost model prices) has each micro-batch's rows and positions as run, replica by
    replica in running order, and its squared runs (each document, and each row's padding as one more run)."""
    path, _ = _docs_file(tmp_path, count=40)
    data = _batches(path, "balance")
    for step in range(2):
        parts = data.batch(step, 8).parts
        shapes = [sh for rep in data.step_shapes(step) for sh in rep]
        assert [sh.num_tokens for sh in shapes] == [p.tokens.shape[0] * p.tokens.shape[-1] for p in parts]
        squares = [sum(int(n) ** 2 for row in p.tokens[:, 1] for n in torch.unique_consecutive(row,
                       return_counts=True)[1]) for p in parts]
        assert [sh.sum_squares for sh in shapes] == squares
        assert all(not sh.padded for sh in shapes)
