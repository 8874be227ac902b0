"""Why the compiled seq_coef step falls back on torch 2.11 (session 10, helper's probe).

Run on CUDA with case names, e.g. ``python3 probe_seq_coef.py dpo-logps dpo-head simpo orpo cpo grpo-q-beta``.
Prints, per case, the compile fallbacks (with tracebacks) and every shape guard dynamo issued, with whether
its source location is None (torch 2.11 fails to format such a guard).
"""

import os
import sys
import traceback
import warnings

import torch
from torch.fx.experimental import symbolic_shapes as ss

import chunkloss
import chunkloss.base as base
from chunkloss import (
    FusedLinearCPOLoss,
    FusedLinearDPOLoss,
    FusedLinearGRPOLoss,
    FusedLinearORPOLoss,
    FusedLinearSimPOLoss,
)

print("##", chunkloss.__file__, torch.__version__, flush=True)
RECORD = []
orig = ss.ShapeEnv.produce_guards_verbose


def pgv(self, *a, **k):
    guards = k.get("guards")
    for g in guards if guards is not None else self.guards:
        try:
            static = (
                self._maybe_evaluate_static(g.expr, axioms=(), size_oblivious=g.size_oblivious) is not None
            )
        except Exception as e:
            static = f"?{e}"
        RECORD.append(
            (
                str(g.expr),
                static,
                g.sloc.framework_loc is None,
                g.sloc.maybe_user_loc is None,
                str(g.sloc.maybe_user_loc)[-70:],
            )
        )
    return orig(self, *a, **k)


ss.ShapeEnv.produce_guards_verbose = pgv
orig_call = base._RowDynamic.__call__


def call(self, logits, *args):
    fn = self.fn
    if fn is None:
        return orig_call(self, logits, *args)

    def traced(*a, **k):
        try:
            return fn(*a, **k)
        except Exception:
            print("".join(traceback.format_exc().splitlines(True)[-30:]), flush=True)
            raise

    self.fn = traced
    try:
        return orig_call(self, logits, *args)
    finally:
        if self.fn is traced:
            self.fn = fn


base._RowDynamic.__call__ = call

H, V, dev = 64, 512, os.environ.get("PROBE_DEV", "cuda")
if dev == "cpu":
    real = base.FusedLinearBase._step_fn
    base.FusedLinearBase._step_fn = lambda self, kind, device_type="cuda": real(self, kind, "cuda")


def pref(mod, b, t, g, ref=None):
    hidden = torch.randn(2 * b, t, H, generator=g).to(dev).requires_grad_()
    weight = torch.randn(V, H, generator=g).to(dev).requires_grad_()
    labels = torch.randint(0, V, (2 * b, t), generator=g)
    labels[:, : t // 3] = -100
    labels = labels.to(dev)
    kw = {}
    if ref == "head":
        kw = dict(
            ref_hidden=torch.randn(2 * b, t, H, generator=g).to(dev),
            ref_weight=torch.randn(V, H, generator=g).to(dev),
        )
    elif ref == "logps":
        kw = dict(
            ref_chosen_logps=(-20 * torch.rand(b, generator=g)).to(dev),
            ref_rejected_logps=(-20 * torch.rand(b, generator=g)).to(dev),
        )
    return mod(hidden, weight, labels[:b], labels[b:], **kw)


def grpo(mod, b, t, g, ref=False):
    hidden = torch.randn(b, t, H, generator=g).to(dev).requires_grad_()
    weight = torch.randn(V, H, generator=g).to(dev).requires_grad_()
    ids = torch.randint(0, V, (b, t), generator=g).to(dev)
    mask = (torch.arange(t) < (t - torch.arange(b))[:, None].clamp(min=1)).long().to(dev)
    adv = torch.randn(b, generator=g).to(dev)
    kw = dict(ref_logps=torch.randn(b, t, generator=g).to(dev) - 5) if ref else {}
    return mod(hidden, weight, ids, mask, adv, **kw)


CASES = {
    "dpo-logps": (FusedLinearDPOLoss, dict(loss_type="sigmoid"), pref, dict(ref="logps")),
    "dpo-head": (FusedLinearDPOLoss, dict(loss_type="sigmoid"), pref, dict(ref="head")),
    "simpo": (FusedLinearSimPOLoss, {}, pref, {}),
    "orpo": (FusedLinearORPOLoss, {}, pref, {}),
    "cpo": (FusedLinearCPOLoss, {}, pref, {}),
    "grpo-q-ent": (
        FusedLinearGRPOLoss,
        dict(loss_type="dapo", top_entropy_quantile=0.2, entropy_coef=0.01),
        grpo,
        {},
    ),
    "grpo-q-beta": (
        FusedLinearGRPOLoss,
        dict(loss_type="dapo", top_entropy_quantile=0.2, beta=0.04),
        grpo,
        dict(ref=True),
    ),
}
for name in sys.argv[1:]:
    cls, opts, build, kw = CASES[name]
    torch._dynamo.reset()
    base._SHARED_STEPS.clear()
    RECORD.clear()
    g = torch.Generator().manual_seed(0)
    mod = cls(chunk_size=64, **opts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shapes = [(4, 12), (3, 12), (1, 12), (2, 40)] if build is pref else [(3, 20), (4, 30)]
        for b, t in shapes:
            build(mod, b, t, g, **kw).backward()
    fails = [str(w.message)[:200] for w in caught if "could not build" in str(w.message)]
    print(f"==== {name}: fallback={fails}", flush=True)
    seen = set()
    for expr, static, fnone, unone, uloc in RECORD:
        if static is True or expr in seen:
            continue
        seen.add(expr)
        print(f"   ISSUED {expr:60} floc_None={fnone} uloc_None={unone} {'' if unone else uloc}")
