"""Tune the launch knobs of RoPE (``chunkloss.kernels.rope.RopeKnobs``) on one CUDA GPU.

For each case, forward + backward in bf16 as benchmarks/bench_kernels.py runs it (q, k are (B, T, H, D)
leaves handed over as (B, H, T, D) views, ``in_place=True`` as ``patch()`` uses it), timed inside a CUDA graph
(``triton.testing.do_bench_cudagraph``, the GPU's time alone): the defaults, Liger's ``liger_rotary_pos_emb``
(when importable), ``torch.compile`` of the reference, then every knob configuration. Stage 1 sweeps tokens
per program x warps x heads per tile; stage 2 retimes the best four of stage 1 with ``evict_first``. Prints
the best five and where the defaults stand; ``--out`` writes every timing to a json file.

    python -m benchmarks.tune_rope [--cases bench llama1b wide] [--budget-s 140] [--out tune_rope.json]

Every configuration compiles two kernels (forward and backward); a time budget (``--budget-s``, shared
evenly by the cases left) skips the rest of a case's configurations once spent, and says so.
"""

import argparse
import itertools
import json
import sys
import time

import torch

from benchmarks.bench_kernels import PEAK_BW, rope_inputs, step_fn

# name -> (batch, seq, q heads, kv heads, head_dim)
CASES = {
    "bench": (4, 4096, 32, 8, 128),  # benchmarks/bench_kernels.py's case (Llama-3-8B heads)
    "wide": (8, 2048, 16, 8, 128),  # 16 / 8 heads of 128
    "llama1b": (8, 2048, 32, 8, 64),  # Llama-3.2-1B: 32 / 8 heads of 64
}
GRID = {  # stage 1
    "tokens": (1, 2, 4, 8),
    "num_warps": (2, 4, 8),
    "block_h": (0, 8),
}
STAGE2_TOP = 4  # stage-1 configurations retimed with evict_first=True
REP_MS = 20  # do_bench_cudagraph's replay length per measurement


def _configs(n_q: int):
    """Stage-1 knob changes; a head tile at least as large as the q heads is the same as no cap."""
    seen = set()
    for values in itertools.product(*GRID.values()):
        changes = dict(zip(GRID, values))
        if changes["block_h"] >= n_q:
            changes["block_h"] = 0
        key = tuple(changes.values())
        if key not in seen:
            seen.add(key)
            yield changes


def _time(step):
    import triton.testing

    return triton.testing.do_bench_cudagraph(step, rep=REP_MS, return_mode="median")


def baselines(inputs):
    """{name: step} of the implementations to beat, each on the same inputs."""
    from chunkloss.kernels import apply_rotary_pos_emb_ref

    steps = {"torch": step_fn("rope", lambda q, k, c, s: apply_rotary_pos_emb_ref(q, k, c, s), inputs),
             "compile": step_fn("rope", torch.compile(apply_rotary_pos_emb_ref, dynamic=False), inputs)}
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        print(f"  liger_kernel unavailable: {exc!r}", flush=True)
    else:
        steps["liger"] = step_fn("rope", liger_rotary_pos_emb, inputs)
    return steps


def sweep(name, shape, deadline):
    """Time the baselines, the defaults and the knob configurations of one case until `deadline`."""
    from chunkloss.kernels import apply_rotary_pos_emb
    from chunkloss.kernels.rope import KNOBS, rope_knobs

    batch, seq, n_q, n_k, head_dim = shape
    inputs = rope_inputs(*shape)
    floor = 4 * batch * seq * (n_q + n_k) * head_dim * 2 / PEAK_BW * 1e3  # q, k and their grads, read + write
    ours = step_fn("rope", lambda q, k, c, s: apply_rotary_pos_emb(q, k, c, s, in_place=True), inputs)
    print(f"\n{name}: B={batch} T={seq} {n_q}/{n_k} heads x {head_dim}, floor {floor:.3f} ms "
          f"(bytes / {PEAK_BW / 1e12:.1f} TB/s)", flush=True)
    result = {"case": name, "shape": dict(zip(("batch", "seq", "n_q", "n_k", "head_dim"), shape)),
              "floor_ms": floor, "baselines": {}, "configs": [], "skipped": 0}
    for impl, step in baselines(inputs).items():
        try:
            ms = _time(step)
        except Exception as exc:  # noqa: BLE001 - a baseline that fails is reported, not fatal
            print(f"  {impl}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            continue
        result["baselines"][impl] = ms
        print(f"  {impl:<8} {ms:.3f} ms ({floor / ms:.0%} of floor)", flush=True)
    defaults = {f: getattr(KNOBS, f) for f in ("tokens", "num_warps", "block_h", "evict_first")}
    result["defaults"] = {"knobs": defaults, "ms": _time(ours)}
    print(f"  defaults {result['defaults']['ms']:.3f} ms  {defaults}", flush=True)

    def run(changes):
        if time.monotonic() > deadline:
            result["skipped"] += 1
            return None
        with rope_knobs(**changes):
            try:
                ms = _time(ours)
            except Exception as exc:  # noqa: BLE001 - e.g. out of resources: skip the configuration
                print(f"  {changes}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                return None
        result["configs"].append({"knobs": changes, "ms": ms})
        return ms

    stage1 = [(ms, c) for c in _configs(n_q) if (ms := run({**c, "evict_first": False})) is not None]
    stage1.sort(key=lambda r: r[0])
    for _, changes in stage1[:STAGE2_TOP]:
        run({**changes, "evict_first": True})
    timed = sorted(result["configs"], key=lambda r: r["ms"])
    print(f"  best of {len(timed)} configurations" + (f" ({result['skipped']} skipped: time budget)"
                                                    if result["skipped"] else ""), flush=True)
    for r in timed[:5]:
        print(f"    {r['ms']:.3f} ms ({floor / r['ms']:.0%} of floor)  {r['knobs']}", flush=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--budget-s", type=float, default=140.0,
                        help="seconds for all cases (compiles included); later configurations are skipped")
    parser.add_argument("--out", default=None, help="also write every timing to this json file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tune_rope.py needs a CUDA GPU; nothing was measured.")
    torch._dynamo.config.cache_size_limit = 64
    torch.manual_seed(0)
    end = time.monotonic() + args.budget_s
    results = []
    for i, name in enumerate(args.cases):
        now = time.monotonic()
        results.append(sweep(name, CASES[name], now + (end - now) / (len(args.cases) - i)))
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rep_ms": REP_MS, "results": results}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
