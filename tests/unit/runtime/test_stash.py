"""Activation stash: exact gradients, export/drop/restore, dedupe, parameters untouched, accounting, recompute."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from evenpipe.models import build_model, lm_loss, model_config
from evenpipe.runtime.stages import build_stage_modules
from evenpipe.runtime.stash import (
    ActivationStash,
    StashError,
    StashMeta,
    forward_for_recompute,
    recompute_forward,
)

MODELS = [("gpt-tiny", "eager"), ("gpt-tiny", "sdpa"), ("llama-tiny", "eager"), ("llama-tiny", "sdpa")]
Batch = tuple[torch.Tensor, torch.Tensor]


def _batches(num: int, batch: int = 2, seq: int = 16) -> list[Batch]:
    gen = torch.Generator().manual_seed(num)
    return [(torch.randint(0, 256, (batch, seq), generator=gen), torch.randint(0, 256, (batch, seq), generator=gen))
            for _ in range(num)]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


def _reference_grads(model: nn.Module, batches: list[Batch]) -> dict[str, torch.Tensor]:
    model.zero_grad()
    for tokens, targets in batches:
        (lm_loss(model(tokens), targets) / len(batches)).backward()
    return _grads(model)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def _storage_bytes(model: nn.Module) -> list[int]:
    return [t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers())]


def _pipelined(model: nn.Module, batches: list[Batch], *, evict: bool) -> tuple[dict[str, torch.Tensor],
                                                                              ActivationStash]:
    """Two stages run by one process, all forwards first (GPipe order); with ``evict`` every key is exported,
    dropped and restored from a copy of its buffer before the backwards."""
    stages = build_stage_modules(model.pipeline_parts(), num_stages=2, stages=[0, 1])
    stash = ActivationStash(stages.values())
    kept = []
    for mb, (tokens, targets) in enumerate(batches):
        with stash.capture((0, mb)):
            out0 = stages[0](tokens)
        x1 = out0.detach().requires_grad_()  # what the receiving rank would hold
        stash.hold((1, mb), x1)
        with stash.capture((1, mb)):
            loss = lm_loss(stages[1](x1), targets) / len(batches)
        kept.append((out0, x1, loss))
    if evict:
        moved = {}
        for key in stash.keys():
            meta, flat = stash.export(key)
            stash.drop(key)
            moved[key] = (meta, flat.clone())  # the partner's copy; the original buffer goes away
            del flat
        assert stash.own_bytes == 0
        for key, (meta, flat) in moved.items():
            stash.restore(key, meta, flat)
    for mb, (out0, x1, loss) in reversed(list(enumerate(kept))):
        loss.backward()
        stash.release_all_of((1, mb))
        out0.backward(x1.grad)
        stash.release_all_of((0, mb))
    return _grads(model), stash


@pytest.mark.parametrize(("name", "attention"), MODELS)
def test_gradients_with_stash_equal_gradients_without(name: str, attention: str) -> None:
    # untied: a tied weight's two gradient contributions add up in another order when pipelined (not bitwise)
    model = build_model(model_config(name, attention=attention, tied_embeddings=False), seed=1)
    batches = _batches(2)
    ref = _reference_grads(model, batches)
    grads, stash = _pipelined(model, batches, evict=False)
    _assert_same(grads, ref)
    assert stash.is_empty() and stash.own_bytes == 0 and stash.peak_own_bytes > 0


@pytest.mark.parametrize(("name", "attention"), MODELS)
def test_export_drop_restore_gives_identical_gradients(name: str, attention: str) -> None:
    # untied: a tied weight's two gradient contributions add up in another order when pipelined (not bitwise)
    model = build_model(model_config(name, attention=attention, tied_embeddings=False), seed=2)
    batches = _batches(2)
    ref = _reference_grads(model, batches)
    params_before = _storage_bytes(model)
    grads, stash = _pipelined(model, batches, evict=True)
    _assert_same(grads, ref)
    assert _storage_bytes(model) == params_before  # no parameter or buffer was freed by drop
    assert stash.is_empty()


def _independent_unique_bytes(fn, params: set[int]) -> int:  # type: ignore[no-untyped-def]
    """Unique storage bytes of saved tensors, counted by data pointer with a plain hook (not the stash)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


@pytest.mark.parametrize(("name", "attention"), MODELS)
def test_drop_frees_everything_and_the_buffer_is_the_unique_storage_bytes(name: str, attention: str) -> None:
    model = build_model(model_config(name, attention=attention), seed=3)
    (tokens, targets), = _batches(1)
    params = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    expected = _independent_unique_bytes(lambda: lm_loss(model(tokens), targets), params)
    stash = ActivationStash([model])
    with stash.capture((0, 0)):
        loss = lm_loss(model(tokens), targets)
    assert stash.own_bytes == stash.bytes_of((0, 0)) == expected > 0
    meta, flat = stash.export((0, 0))
    assert flat.dtype == torch.uint8 and flat.numel() == meta.total_bytes == expected
    stash.drop((0, 0))
    assert stash.own_bytes == 0 and stash.bytes_of((0, 0)) == 0
    with pytest.raises(StashError, match="evicted; restore them before backward"):
        loss.backward()
    assert stash.peak_own_bytes == expected


def test_tensor_saved_twice_and_views_count_once() -> None:
    x = torch.randn(100, 10, requires_grad=True)
    stash = ActivationStash()
    with stash.capture((0, 0)):
        a = x * 2  # non-leaf, 4000 bytes
        y = a * a  # saves `a` twice
        view = a[10:20].t()  # a strided view of `a`
        z = view * view
        w = a.sum(dim=1, keepdim=True).exp()  # exp saves its 400-byte result
    assert stash.own_bytes == 4000 + 400
    meta, flat = stash.export((0, 0))
    assert meta.storage_bytes == (4000, 400)
    stash.drop((0, 0))
    stash.restore((0, 0), meta, flat.clone())
    (y.sum() + z.sum() + w.sum()).backward()
    a_ref = x.detach() * 2
    expected = 2 * (2 * a_ref)  # d(a*a)/dx
    expected[10:20] += 2 * (2 * a_ref[10:20])  # d(view*view)/dx
    expected += 2 * (a_ref.sum(dim=1, keepdim=True).exp())
    torch.testing.assert_close(x.grad, expected)
    assert stash.own_bytes == 0  # every handle freed by the backward
    stash.release_all_of((0, 0))
    assert stash.is_empty()


def test_parameters_and_buffers_are_never_captured() -> None:
    lin = nn.Linear(32, 16)
    lin.register_buffer("scale", torch.full((16,), 2.0))
    x = torch.randn(8, 32, requires_grad=True)
    stash = ActivationStash([lin])
    with stash.capture((0, 0)):
        out = (lin(x) * lin.scale).sum()  # linear saves x and a view of the weight; mul saves the buffer
    assert stash.own_bytes == x.numel() * 4
    meta, _ = stash.export((0, 0))
    assert meta.storage_bytes == (x.numel() * 4,)
    # a Parameter is recognised by type even without registering its module
    p = nn.Parameter(torch.randn(64))
    bare = ActivationStash()
    with bare.capture((0, 0)):
        kept = (p * x.sum()).sum()
    assert bare.own_bytes == 4  # the scalar x.sum(), not p
    del out, kept


def test_release_all_of_leaves_nothing_even_without_backward() -> None:
    model = build_model(model_config("gpt-tiny"), seed=0)
    stash = ActivationStash([model])
    (tokens, targets), = _batches(1)
    with stash.capture((0, 0)):
        loss = lm_loss(model(tokens), targets)
    stash.hold((0, 1), torch.randn(10))
    assert not stash.is_empty()
    stash.release_all_of((0, 0))
    stash.release_all_of((0, 1))
    assert stash.is_empty() and stash.own_bytes == 0
    with pytest.raises(StashError, match="were released"):
        loss.backward()
    del loss  # freeing the graph after release is harmless
    assert stash.own_bytes == 0


def test_peaks_follow_forwards_backwards_and_hosting() -> None:
    model = build_model(model_config("gpt-tiny"), seed=0)
    stash = ActivationStash([model])
    losses = []
    for mb, (tokens, targets) in enumerate(_batches(3)):
        with stash.capture((0, mb)):
            losses.append(lm_loss(model(tokens), targets))
    unit = stash.bytes_of((0, 0))
    assert stash.own_bytes == stash.peak_own_bytes == 3 * unit
    losses[0].backward()
    stash.release_all_of((0, 0))
    assert stash.own_bytes == 2 * unit and stash.peak_own_bytes == 3 * unit
    stash.reset_peaks()
    assert stash.peak_own_bytes == 2 * unit
    meta, flat = stash.export((0, 1))
    stash.drop((0, 1))
    stash.host((3, 1), meta, flat)  # pretend it is a partner's buffer
    assert stash.own_bytes == unit and stash.hosted_bytes == unit
    assert stash.peak_total_bytes == 2 * unit and stash.peak_hosted_bytes == unit
    back_meta, back = stash.unhost((3, 1))
    assert stash.hosted_bytes == 0 and back is flat and back_meta == meta
    stash.restore((0, 1), back_meta, back)
    assert stash.own_bytes == 2 * unit
    for mb in (1, 2):
        losses[mb].backward()
        stash.release_all_of((0, mb))
    assert stash.is_empty() and stash.peak_total_bytes == 2 * unit


def test_misuse_is_refused() -> None:
    stash = ActivationStash()
    x = torch.randn(10, requires_grad=True)
    with stash.capture((0, 0)):
        y = (x * 2).exp()
    with pytest.raises(StashError, match="never exported"):
        stash.drop((0, 0))
    meta, flat = stash.export((0, 0))
    stash.drop((0, 0))
    with pytest.raises(StashError, match="already evicted"):
        stash.drop((0, 0))
    with pytest.raises(StashError, match="are evicted"):
        with stash.capture((0, 0)):
            pass
    with pytest.raises(StashError, match="does not match"):
        stash.restore((0, 0), StashMeta(key=(0, 0), storage_bytes=(3,)), flat)
    with pytest.raises(StashError, match="needs a uint8 buffer of 40 bytes"):
        stash.restore((0, 0), meta, flat.float())
    with pytest.raises(StashError, match="not evicted"):
        stash.restore((1, 0), meta, flat)
    with pytest.raises(StashError, match="not hosting"):
        stash.unhost((1, 0))
    stash.restore((0, 0), meta, flat)
    y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * (x.detach() * 2).exp())


def test_a_storage_shared_by_two_keys_counts_once_and_cannot_be_dropped() -> None:
    stash = ActivationStash()
    out = torch.randn(50) * 1.0
    stash.hold((0, 0), out)
    stash.hold((1, 0), out.detach())  # the next stage on the same rank got the very tensor
    assert stash.own_bytes == 200
    stash.export((0, 0))
    with pytest.raises(StashError, match="shares 1 storage"):
        stash.drop((0, 0))
    stash.release((1, 0), out)
    stash.drop((0, 0))
    assert stash.own_bytes == 0
    assert out.untyped_storage().nbytes() == 0  # freed in place, though the caller still references it


def test_meta_is_small_picklable_and_tensor_roundtrips() -> None:
    meta = StashMeta(key=(2, 5), storage_bytes=(16, 0, 4096))
    assert pickle.loads(pickle.dumps(meta)) == meta
    assert StashMeta.from_tensor(meta.to_tensor()) == meta
    assert meta.total_bytes == 4112
    with pytest.raises(StashError, match="not a stash meta"):
        StashMeta.from_tensor(torch.tensor([1, 2, 5, 0]))


@pytest.mark.parametrize(("name", "attention"), [("gpt-tiny", "sdpa"), ("llama-tiny", "eager")])
@pytest.mark.parametrize("evict", [False, True])
def test_full_recompute_stashes_only_the_input(name: str, attention: str, evict: bool) -> None:
    model = build_model(model_config(name, attention=attention, num_layers=2, dropout=0.1), seed=4)
    stages = build_stage_modules(model.pipeline_parts(), num_stages=2, stages=[0, 1])
    (tokens, targets), = _batches(1)
    torch.manual_seed(11)
    with torch.no_grad():
        x1_ref = stages[0](tokens)  # stage 0's output, with its dropout draws
    x_ref = x1_ref.clone().requires_grad_()
    torch.manual_seed(12)
    lm_loss(stages[1](x_ref), targets).backward()  # stage 1 as one normal forward and backward
    ref = {n: p.grad.clone() for n, p in stages[1].named_parameters()}
    ref_input_grad = x_ref.grad.clone()
    model.zero_grad()

    stash = ActivationStash(stages.values())
    x1 = x1_ref.clone().requires_grad_()
    torch.manual_seed(12)
    out, rng = forward_for_recompute(stages[1], x1, stash=stash, key=(1, 0))
    assert stash.own_bytes == stash.bytes_of((1, 0)) == x1.numel() * 4  # only the input
    torch.manual_seed(99)  # other work moves the generator on; the recompute must not care
    if evict:
        meta, flat = stash.export((1, 0))
        stash.drop((1, 0))
        assert stash.own_bytes == 0 and flat.numel() == x1.numel() * 4
        stash.restore((1, 0), meta, flat.clone())
    logits = recompute_forward(stages[1], x1, stash=stash, key=(1, 0), rng=rng)
    torch.testing.assert_close(logits, out, rtol=0, atol=0)
    assert stash.own_bytes > x1.numel() * 4  # the full activations exist only now
    lm_loss(logits, targets).backward()
    stash.release_all_of((1, 0))
    assert stash.is_empty()
    _assert_same({n: p.grad for n, p in stages[1].named_parameters()}, ref)
    torch.testing.assert_close(x1.grad, ref_input_grad, rtol=0, atol=0)


def test_zero_bubble_split_keeps_units_until_the_weight_gradient() -> None:
    model = build_model(model_config("llama-tiny", num_layers=2), seed=6)
    stages = build_stage_modules(model.pipeline_parts(), num_stages=2, stages=[0, 1])
    (tokens, targets), = _batches(1)
    x = stages[0](tokens).detach().requires_grad_()
    loss = lm_loss(stages[1](x), targets)
    loss.backward()
    ref, ref_x = {n: p.grad.clone() for n, p in stages[1].named_parameters()}, x.grad.clone()
    model.zero_grad()

    stash = ActivationStash(stages.values())
    x = x.detach().requires_grad_()
    stash.hold((1, 0), x)
    stash.hold((1, 0), stages[1].last.head.weight)  # a parameter is never counted, even when held
    with stash.capture((1, 0)):
        loss = lm_loss(stages[1](x), targets)
    full = stash.own_bytes
    (gx,) = torch.autograd.grad(loss, (x,), retain_graph=True)  # I: input gradient only
    assert 0 < stash.own_bytes <= full  # what W needs is still alive
    params = list(stages[1].parameters())
    grads = torch.autograd.grad(loss, params)  # W: frees what it ran through
    stash.release((1, 0), x)
    del loss  # nodes W did not need keep their saved tensors until the graph goes
    assert stash.own_bytes == 0
    stash.release_all_of((1, 0))
    assert stash.is_empty()
    torch.testing.assert_close(gx, ref_x, rtol=0, atol=0)
    for (name, _), g in zip(stages[1].named_parameters(), grads):
        torch.testing.assert_close(g, ref[name], rtol=0, atol=0, msg=name)


def test_offload_moves_a_key_to_a_separate_host_copy_counted_apart() -> None:
    """Host offload (``train --offload``): the host copy is its own tensor, the device storages are freed (own
    bytes drop by the unit), the copy counts as offloaded bytes until unshelved, and the backward after restore
    gives the gradients of a run without offload."""
    model = build_model(model_config("gpt-tiny"), seed=0)
    (tokens, targets), = _batches(1)
    reference = _reference_grads(model, [(tokens, targets)])
    stash = ActivationStash([model])
    with stash.capture((0, 0)):
        loss = lm_loss(model(tokens), targets)
    unit = stash.bytes_of((0, 0))
    storages = [s.storage for s in stash._states[(0, 0)].slots.values()]
    meta, host = stash.export((0, 0), to_host=True)
    stash.drop((0, 0))
    stash.shelve((0, 0), meta, host)
    assert host.device.type == "cpu" and meta.total_bytes == unit
    assert all(s.nbytes() == 0 for s in storages)  # released, not just forgotten
    assert not any(host.untyped_storage()._cdata == s._cdata for s in storages)
    assert stash.own_bytes == 0 and stash.offloaded_bytes == stash.peak_offloaded_bytes == unit
    assert stash.hosted_bytes == 0 and not stash.is_empty()
    with pytest.raises(StashError, match="already offloaded"):
        stash.shelve((0, 0), meta, host)
    back_meta, back = stash.unshelve((0, 0))
    with pytest.raises(StashError, match="is not offloaded"):
        stash.unshelve((0, 0))
    stash.restore((0, 0), back_meta, back)
    assert stash.offloaded_bytes == 0 and stash.own_bytes == unit and stash.peak_offloaded_bytes == unit
    loss.backward()
    stash.release_all_of((0, 0))
    assert stash.is_empty()
    _assert_same(_grads(model), reference)
    stash.reset_peaks()
    assert stash.peak_offloaded_bytes == 0
