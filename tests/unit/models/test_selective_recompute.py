"""Selective recomputation (issue 33 point 2): the attention core recomputed in backward gives the same loss and
gradients as keeping it (dropout included: the backward replays the forward's random state), the stash keeps only
what the cost model's selective figure counts, and ``--recompute`` takes one mode or one per stage."""

from __future__ import annotations

import json
import pathlib
import tempfile

import pytest
import torch

from evenpipe.cost.activations import activation_bytes
from evenpipe.cost.parallel import Attention, ParallelConfig, Recompute
from evenpipe.errors import ConfigError
from evenpipe.models import model_config
from evenpipe.models.adapter import PipelineModel, reference_model
from evenpipe.models.recompute import set_selective_recompute
from evenpipe.runtime.stages import build_stage_modules
from evenpipe.runtime.stash import ActivationStash
from evenpipe.training.config import ScheduleOptions, parse_recompute

SEQ, B = 16, 2


HF = pathlib.Path(__file__).parents[2] / "fixtures" / "hf"


def _model(name: str, **overrides: object) -> PipelineModel:
    """A reference preset of 4 layers, or a Hugging Face fixture (``hf:NAME``, eager attention with
    ``overrides`` as its config's fields) of 4 layers."""
    if not name.startswith("hf:"):
        return reference_model(model_config(name, seq_len=SEQ, num_layers=4, **overrides), seed=0)
    pytest.importorskip("transformers")
    from evenpipe.models.hf import hf_model
    raw = json.loads((HF / name[3:] / "config.json").read_text())
    raw.update({"n_layer" if "n_layer" in raw else "num_hidden_layers": 4}, **overrides)
    path = pathlib.Path(tempfile.mkdtemp(prefix="evenpipe-sel-")) / "config.json"
    path.write_text(json.dumps(raw))
    return hf_model(path, seed=0, attention="eager")


def _run(name: str, selective: bool, **overrides: object) -> tuple[float, list[torch.Tensor], int]:
    """Loss, gradients (stage input first, then every parameter) and the stash's bytes of one micro-batch on a
    stage of two blocks (its input counted with the first block's norm input, which it is)."""
    built = _model(name, **overrides)
    stage = build_stage_modules(built.parts, num_stages=3, stages=[1], layout=(1, 2, 1))[1]
    set_selective_recompute(stage, selective)
    stage.train()
    x = torch.randn(B, SEQ, built.spec.hidden, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    stash = ActivationStash([stage])
    stash.hold((1, 0), x)
    torch.manual_seed(5)
    with stash.capture((1, 0)):
        out = stage(x)
    held = stash.bytes_of((1, 0))
    torch.manual_seed(123)  # other work moves the generator on before the backward: the replay must not care
    loss = out.float().square().mean()
    loss.backward()
    return float(loss.detach()), [x.grad, *(p.grad for p in stage.parameters())], held


@pytest.mark.parametrize("name,overrides", [
    ("gpt-tiny", {"attention": "eager", "dropout": 0.1}),
    ("gpt-tiny", {}),
    ("llama-tiny", {"attention": "eager"}),
    ("hf:tiny-llama", {}),
    ("hf:tiny-gpt2", {"attn_pdrop": 0.1}),
], ids=["gpt-eager-dropout", "gpt-sdpa", "llama-eager", "hf-llama", "hf-gpt2-dropout"])
def test_selective_equals_keeping_the_core(name: str, overrides: dict[str, object]) -> None:
    torch.set_num_threads(1)
    loss, grads, kept = _run(name, False, **overrides)
    sel_loss, sel_grads, sel_kept = _run(name, True, **overrides)
    assert sel_loss == loss
    assert len(grads) == len(sel_grads) and all(g is not None for g in sel_grads)
    for g, s in zip(grads, sel_grads):
        torch.testing.assert_close(s, g, rtol=1e-6, atol=1e-7)
    assert sel_kept < kept  # scores, softmax and dropout (eager), or the fused kernel's statistics, are gone


@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_stash_keeps_the_cost_models_selective_bytes(attention: str) -> None:
    """A block's bytes under selective recomputation (float32: twice the model's 2-byte elements) are the cost
    model's ``layer_saved`` within 1% (the norms' statistics are not counted by the model)."""
    torch.set_num_threads(1)
    cfg = model_config("gpt-tiny", seq_len=SEQ, num_layers=4, attention=attention)
    *_, two_blocks = _run("gpt-tiny", True, attention=attention)
    figure = activation_bytes(cfg, ParallelConfig(microbatch_size=B, global_batch=B, recompute=Recompute.SELECTIVE,
                                                  attention=Attention.parse(attention))).layer_saved
    assert two_blocks == pytest.approx(2 * 2 * figure, rel=0.01)


def test_one_mode_or_one_per_stage() -> None:
    assert parse_recompute("selective", 3) == (Recompute.SELECTIVE,) * 3
    assert parse_recompute(True, 2) == (Recompute.FULL,) * 2
    assert parse_recompute("full, none,selective,none", 4) == (Recompute.FULL, Recompute.NONE, Recompute.SELECTIVE,
                                                               Recompute.NONE)
    opts = ScheduleOptions(family="1f1b", num_ranks=2, num_microbatches=2, recompute="full,selective")
    assert opts.stages_recomputing(Recompute.FULL) == {0}
    assert {a.stage for acts in opts.build().actions for a in acts if a.kind.name == "RECOMPUTE"} == {0}
    with pytest.raises(ConfigError, match=r"^--recompute full,none: 2 entries for 4 stages; give one of none, "
                                          r"selective, full, or one per stage \(4, comma-separated\)$"):
        parse_recompute("full,none", 4)
    with pytest.raises(ConfigError, match=r"^--recompute half: each entry must be one of none, selective, full$"):
        parse_recompute("half", 4)
