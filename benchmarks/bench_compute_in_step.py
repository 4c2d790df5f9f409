"""Does a stage compute slower inside a pipeline step than the profiler's way of timing it? Measured in one world,
alternating, so that the host's drift hits both sides alike.

Every iteration, on each of P ranks (P=2 by default, one per core): (A) one traced executor step of the schedule
(``--schedule``, M micro-batches of size b, AdamW after it), timing each stage forward and each full backward
where it runs (a wrapper around the stage module's forward and around the executor's autograd call, so waits for
messages are not counted); then (B) the same stage module timed as :mod:`evenpipe.runtime.profile` times a layer:
a barrier, the forward under the activation stash's capture, a barrier, the backward from a random output
gradient, M times; (C) two forwards, then both backwards: the first backward runs after another micro-batch's
forward (its saved activations no longer the last ones touched, as in a 1F1B steady state), the second right
after its own; and (D) the profiler's own measurement (``_LayerBench.once`` after a barrier, as
:func:`~evenpipe.runtime.profile.measure_layers` runs it) of the stage's own blocks as a chain and of its end
(embedding or head with the loss), M/2 times, summed into a stage forward and backward as the prediction sums
them. Each iteration gives one ratio A/B and A/D for forwards and for backwards (medians over the iteration's
computes) and one C-first/C-second; the table shows their medians and quartiles over the iterations.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_compute_in_step.py --iters 40
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_compute_in_step.py --model gpt-mini --iters 20

Issue 10 asked whether the 3-12% low predictions at b=1 came from computes running slower inside training; see
BENCHMARKS.md for what this measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipe_probe import answers_or_exit  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TINY_LLAMA = os.path.join(HERE, "data", "tiny_llama_config.json")


def _build(opts: dict[str, Any]) -> Any:
    """The :class:`~evenpipe.models.adapter.PipelineModel` training builds: the tiny Llama or a preset."""
    if opts["model"] == "tiny-llama":
        from evenpipe.models.hf import hf_model
        return hf_model(TINY_LLAMA, seed=0)
    from evenpipe.models import model_config
    from evenpipe.models.adapter import reference_model
    return reference_model(model_config(opts["model"]), seed=0, source=opts["model"])


def _timing(fn: Any, seconds: list[float]) -> Any:
    """``fn``, appending each call's seconds to ``seconds``."""
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        seconds.append(time.perf_counter() - t0)
        return out
    return timed


def _worker(rank: int, world: int, opts: dict[str, Any]) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    import evenpipe.runtime.executor as executor
    import evenpipe.runtime.step_compute as step_compute
    from evenpipe.runtime.comm import build_groups
    from evenpipe.runtime.data import TokenBatches
    from evenpipe.runtime.stages import build_stage_modules
    from evenpipe.runtime.stash import ActivationStash
    from evenpipe.schedule import build_schedule

    torch.set_num_threads(1)
    built = _build(opts)
    m, b = opts["microbatches"], opts["microbatch_size"]
    schedule = build_schedule(opts["schedule"], num_ranks=world, num_microbatches=m)
    (stage,) = schedule.stages_of(rank)
    module = build_stage_modules(built.parts, num_stages=schedule.num_stages, stages=[stage])[stage]
    last = stage == schedule.num_stages - 1
    stash = ActivationStash([module])
    groups = build_groups(world, 1)
    assert groups is not None
    ex = executor.PipelineExecutor(schedule=schedule, stages={stage: module}, groups=groups, loss_fn=built.loss,
                                   stash=stash, free_outputs=True)
    params = list(module.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    cfg = built.spec
    seq, vocab, hidden = cfg.seq_len, cfg.vocab, cfg.hidden
    data = TokenBatches(source="random", seq_len=seq, vocab=vocab, seed=0)
    tokens = torch.randint(0, vocab, (b, seq))
    x_hidden = torch.randn(b, seq, hidden) * 0.5

    timed: dict[str, list[float]] = {"F": [], "B": []}
    engine, forward = step_compute.run_backward, module.forward
    step_compute.run_backward = _timing(engine, timed["B"])  # type: ignore[assignment]
    module.forward = _timing(forward, timed["F"])  # type: ignore[method-assign]

    def profile_style_forward(key: tuple[int, int]) -> tuple[float, Any]:
        x = tokens if stage == 0 else x_hidden.detach().clone().requires_grad_(True)
        dist.barrier()
        with stash.capture(key):
            t0 = time.perf_counter()
            out = forward(x)
            if last:
                out = built.loss(out, tokens)
            return time.perf_counter() - t0, out

    def profile_style_backward(key: tuple[int, int], out: Any) -> float:
        grad = torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out)
        dist.barrier()
        t0 = time.perf_counter()
        engine([out], [grad], keep_graph=False)
        dt = time.perf_counter() - t0
        stash.release_all_of(key)
        return dt

    from evenpipe.cost.profile import LayerKind
    from evenpipe.runtime.profile import _blocks_as_stage, _Head, _LayerBench, _Timer
    timer = _Timer(torch.device("cpu"))
    blocks = list(module.blocks)
    chain = _LayerBench(LayerKind.BLOCK, _blocks_as_stage(blocks), device=torch.device("cpu"), timer=timer,
                        count=len(blocks))
    end = _LayerBench(LayerKind.EMBEDDING, built.parts.first, device=torch.device("cpu"), timer=timer) \
        if stage == 0 else _LayerBench(LayerKind.HEAD, _Head(built.parts.last, built.loss),
                                       device=torch.device("cpu"), timer=timer)
    end_input, end_extra = (tokens, ()) if stage == 0 else (x_hidden, (tokens,))

    def profiler_style() -> tuple[float, float]:
        """A stage's forward and backward as the profiler's samples add up: blocks times count, plus its end."""
        dist.barrier()
        body = chain.once(x_hidden, (), {"filled": 1.0})
        dist.barrier()
        tip = end.once(end_input, end_extra, {"filled": 1.0})
        n = len(blocks)
        return n * body["forward_s"] + tip["forward_s"], n * body["backward_s"] + tip["backward_s"]

    ratios: dict[str, list[float]] = {"F": [], "B": [], "cold": [], "PF": [], "PB": []}
    for it in range(opts["iters"] + 1):
        for p in params:
            p.grad = None
        timed["F"].clear()
        timed["B"].clear()
        dist.barrier()
        batch = data.batch(it, m * b)
        ex.step(batch.tokens, batch.targets)
        optimizer.step()
        in_step = {k: statistics.median(v) for k, v in timed.items()}
        alone_f, alone_b = [], []
        for mb in range(m):
            key = (stage, 10_000 + mb)
            dt, out = profile_style_forward(key)
            alone_f.append(dt)
            alone_b.append(profile_style_backward(key, out))
        first, second = [], []
        for pair in range(max(1, m // 2)):
            keys = [(stage, 20_000 + 2 * pair + j) for j in range(2)]
            outs = [profile_style_forward(k)[1] for k in keys]
            first.append(profile_style_backward(keys[0], outs[0]))
            second.append(profile_style_backward(keys[1], outs[1]))
        prof = [profiler_style() for _ in range(max(1, m // 2))]
        if it == 0:
            continue  # the first step learns shapes
        ratios["PF"].append(in_step["F"] / statistics.median(f for f, _ in prof))
        ratios["PB"].append(in_step["B"] / statistics.median(b for _, b in prof))
        ratios["F"].append(in_step["F"] / statistics.median(alone_f))
        ratios["B"].append(in_step["B"] / statistics.median(alone_b))
        ratios["cold"].append(statistics.median(first) / statistics.median(second))
    return ratios


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="tiny-llama", help="tiny-llama (benchmarks/data) or a reference preset")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--microbatch-size", type=int, default=1)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    opts = {"model": args.model, "schedule": args.schedule, "microbatches": args.microbatches,
            "microbatch_size": args.microbatch_size, "iters": args.iters}
    ranks = answers_or_exit(args.stages, _worker, opts)
    print(f"{args.model}, {args.schedule} P={args.stages} M={args.microbatches} b={args.microbatch_size}, "
          f"{args.iters} iterations (medians and quartiles over iterations)")
    columns = (("F", "forward in step / alone"), ("B", "backward in step / alone"),
               ("PF", "forward in step / profiler"), ("PB", "backward in step / profiler"),
               ("cold", "backward after another F / after its own"))
    print(f"{'rank':>4s}  " + "  ".join(f"{title:>28s}" if k != "cold" else f"{title:>42s}" for k, title in columns))
    for r, res in enumerate(ranks):
        cells = ["%.3f [%.3f-%.3f]" % (mid, lo, hi) for lo, mid, hi in (_quartiles(res[k]) for k, _ in columns)]
        print(f"{r:4d}  " + "  ".join(f"{c:>28s}" if k != "cold" else f"{c:>42s}"
                                      for c, (k, _) in zip(cells, columns)))


if __name__ == "__main__":
    main()
