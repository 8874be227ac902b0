"""Every private or version-dependent name chunkloss borrows (``chunkloss/_compat``) exists in the installed
torch, transformers, TRL and accelerate, each failure one line naming the symbol and the installed version;
each version workaround says when it can go; and the library outside ``chunkloss/_compat`` touches none of
those libraries' private names.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import warnings
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
import transformers
import trl
from packaging.version import Version
from torch import nn

from chunkloss._compat import accelerate as accelerate_compat
from chunkloss._compat import torch as torch_compat
from chunkloss._compat import transformers as transformers_compat
from chunkloss._compat import trl as trl_compat

ROOT = Path(__file__).resolve().parent.parent


def minimum(package: str) -> Version:
    """The lowest version of ``package`` that ``pyproject.toml`` allows (its ``>=`` bound)."""
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(rf'"{re.escape(package)}>=([0-9.]+)', text)
    assert found, f"pyproject.toml has no lower bound for {package}"
    return Version(found.group(1))


def resolve(path: str):
    """The object at a dotted path (``module.Class``), or None."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


# --- torch ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, name", torch_compat.PRIVATE_NAMES)
def test_torch_private_name_exists(path, name):
    try:
        module = importlib.import_module(path)
    except ImportError:
        module = resolve(path)
    if module is None or not hasattr(module, name):
        pytest.fail(f"torch {torch.__version__} has no {path}.{name}")


def test_saved_tensor_hooks_suspended_and_restored():
    def pack(t):
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, pack):
        assert torch_compat.top_saved_tensor_hooks() == (pack, pack)
        with torch_compat.no_saved_tensor_hooks():
            assert torch_compat.top_saved_tensor_hooks() is None
        assert torch_compat.top_saved_tensor_hooks() == (pack, pack)
    assert torch_compat.top_saved_tensor_hooks() is None


def test_module_hooks_and_version_counter():
    module = nn.Linear(2, 2)
    assert torch_compat.forward_hooks(module) == [] and torch_compat.backward_hooks(module) == []

    def pre(mod, args):
        return None

    def post(mod, args, out):
        return None

    def back(mod, grad_in, grad_out):
        return None

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)
    module.register_full_backward_hook(back)
    assert torch_compat.forward_hooks(module) == [pre, post]
    assert torch_compat.backward_hooks(module) == [back]
    t = torch.zeros(3)
    before = torch_compat.version_counter(t)
    t.add_(1)
    assert torch_compat.version_counter(t) == before + 1
    assert not accelerate_compat.has_hf_hook(module)


def test_fsdp2_hooks_live_in_the_named_module():
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    where = FSDPState._pre_forward.__module__
    if not where.startswith(torch_compat.FSDP2_HOOK_MODULE):
        pytest.fail(
            f"torch {torch.__version__}: FSDP2's hooks are in {where}, not {torch_compat.FSDP2_HOOK_MODULE}"
        )


def test_dynamo_names():
    assert issubclass(torch._dynamo.exc.BackendCompilerFailed, torch_compat.dynamo_error())
    torch_compat.mark_rows_dynamic(torch.zeros(4, 2))


def test_guard_location_fix_is_scoped(monkeypatch):
    """torch < 2.13 fails to print a shape guard without a source location, so dynamo cannot build that step;
    ``guard_location_fix`` gives ``SLoc`` torch 2.13's ``__str__`` inside the block only, where the installed
    one fails, and restores it after (an exception included)."""
    from torch._guards import SLoc
    from torch.utils._traceback import format_frame

    def str_2_11(self):  # torch 2.11's SLoc.__str__
        floc = self.framework_loc if isinstance(self.framework_loc, str) else format_frame(self.framework_loc)
        return f"{self.maybe_user_loc} ({floc})" if self.maybe_user_loc is not None else f"({floc})"

    monkeypatch.setattr(torch_compat, "GUARD_LOCATION_BUG", True)
    working = SLoc.__str__
    with torch_compat.guard_location_fix():
        assert SLoc.__str__ is working  # a torch that prints it is left alone
    monkeypatch.setattr(SLoc, "__str__", str_2_11)
    with pytest.raises(AttributeError):
        str(SLoc(None, None))
    with pytest.raises(KeyError), torch_compat.guard_location_fix():
        assert str(SLoc(None, None)) == "()"
        assert str(SLoc("base.py:10", "loss.py:3")) == "loss.py:3 (base.py:10)"
        raise KeyError("inside the block")
    assert SLoc.__str__ is str_2_11
    monkeypatch.setattr(torch_compat, "GUARD_LOCATION_BUG", False)  # torch >= 2.13: never touched
    with torch_compat.guard_location_fix():
        assert SLoc.__str__ is str_2_11


def test_guard_location_fix_still_needed():
    """The workaround serves torch < 2.13; once that is below the minimum, it can go."""
    if minimum("torch") >= Version("2.13"):
        pytest.fail(f"the minimum torch is {minimum('torch')}: remove torch_compat.guard_location_fix")


# --- transformers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*transformers_compat.TRAINER_OVERRIDES, "_get_output_dir"])
def test_trainer_private_method_exists(name):
    if not callable(getattr(transformers.Trainer, name, None)):
        pytest.fail(f"transformers {transformers.__version__} has no Trainer.{name}")


def test_attn_implementation():
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2)
    if not hasattr(config, "_attn_implementation"):
        pytest.fail(f"transformers {transformers.__version__} has no PretrainedConfig._attn_implementation")
    assert transformers_compat.attn_implementation(config) == config._attn_implementation


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"])
def test_eager_attention_forward_per_family(model_type):
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    attention = next(
        v
        for k, v in vars(module).items()
        if k.endswith("Attention") and getattr(v, "__module__", "") == module.__name__
    )
    if not hasattr(module, "eager_attention_forward"):
        pytest.fail(
            f"transformers {transformers.__version__} has no {module.__name__}.eager_attention_forward"
        )
    assert (
        transformers_compat.eager_attention_forward(object.__new__(attention))
        is module.eager_attention_forward
    )


def test_cache_update_takes_the_attention_kwargs():
    cache = transformers.DynamicCache()
    k = torch.zeros(1, 2, 3, 4)
    out_k, out_v = transformers_compat.cache_update(cache, k, k + 1, 0, {})
    assert out_k.shape == k.shape and torch.equal(out_v, k + 1)


def test_output_cache_field():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    field = transformers_compat.OUTPUT_CACHE_FIELD
    if field not in CausalLMOutputWithPast.__dataclass_fields__:
        pytest.fail(f"transformers {transformers.__version__} has no CausalLMOutputWithPast.{field}")


def test_output_cache_field_fallback_still_needed():
    """``past_key_values`` serves transformers < 5.24; once that is below the minimum, the fallback can go."""
    if minimum("transformers") >= Version("5.24"):
        pytest.fail(f"the minimum transformers is {minimum('transformers')}: OUTPUT_CACHE_FIELD is 'cache'")


@pytest.mark.parametrize("name", transformers_compat.DEPRECATED_CHECKPOINTING_CALLS)
def test_deprecated_checkpointing_name_exists(name):
    if transformers_compat.CHECKPOINTING_RENAMED and not hasattr(transformers.PreTrainedModel, name):
        pytest.fail(f"transformers {transformers.__version__} has no PreTrainedModel.{name}")


def test_checkpointing_rename_fallback_still_needed():
    """The old checkpointing names serve transformers < 5.23 (and the deprecated aliases up to 6); once the
    minimum is 5.23, ``CHECKPOINTING_RENAMED`` is always True and the branches without it can go."""
    if minimum("transformers") >= Version("5.23"):
        pytest.fail(
            f"the minimum transformers is {minimum('transformers')}: CHECKPOINTING_RENAMED is always True"
        )
    fields = transformers.TrainingArguments.__dataclass_fields__
    expected = Version(transformers.__version__) >= Version("5.23")
    assert transformers_compat.CHECKPOINTING_RENAMED == expected
    for old, new in transformers_compat.CHECKPOINTING_RENAMES.items():
        assert old in fields and (new in fields) == expected, (old, new)


def test_activation_class_names():
    import transformers.activations as activations

    for kind, names in transformers_compat.ACTIVATION_CLASSES.items():
        for name in names:
            if not hasattr(activations, name) and not hasattr(nn, name):
                pytest.fail(f"transformers {transformers.__version__} has no activations.{name} ({kind})")
    assert "gelu_tanh" in transformers_compat.ACTIVATION_CLASSES


# --- TRL ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(trl_compat.TRAINER_OVERRIDES))
def test_trl_overridden_name_exists(name):
    for path in trl_compat.TRAINER_OVERRIDES[name]:
        cls = resolve(path)
        if cls is None or not hasattr(cls, name):
            pytest.fail(f"trl {trl.__version__} has no {path}.{name}")


def _sets_or_defines(cls: type, name: str) -> bool:
    """Whether ``cls`` or a TRL class it derives from defines ``name`` or sets ``self.name``."""
    if hasattr(cls, name):
        return True
    pattern = re.compile(rf"self\.{name}\s*(:[^=\n]*)?=(?!=)")
    return any(pattern.search(inspect.getsource(k)) for k in cls.__mro__ if k.__module__.startswith("trl."))


@pytest.mark.parametrize("name", sorted(trl_compat.PRIVATE_ATTRIBUTES))
def test_trl_private_attribute_exists(name):
    for path in trl_compat.PRIVATE_ATTRIBUTES[name]:
        cls = resolve(path)
        if cls is None or not _sets_or_defines(cls, name):
            pytest.fail(f"trl {trl.__version__} has no {path}.{name}")


def test_trl_label_smoothing_warning_text():
    from trl.trainer import sft_trainer

    if trl_compat.SFT_LABEL_SMOOTHING_WARNING not in inspect.getsource(sft_trainer):
        pytest.fail(
            f"trl {trl.__version__}'s SFTTrainer no longer warns {trl_compat.SFT_LABEL_SMOOTHING_WARNING!r}"
        )


def test_quiet_checkpointing_calls_still_needed():
    """TRL still calls the model's deprecated checkpointing names; once it does not, the quieting can go."""
    from trl.models import utils

    source = inspect.getsource(utils)
    called = [name for name in transformers_compat.DEPRECATED_CHECKPOINTING_CALLS if name in source]
    if not called:
        pytest.fail(
            f"trl {trl.__version__} calls none of {transformers_compat.DEPRECATED_CHECKPOINTING_CALLS}"
        )


def test_quiet_checkpointing_calls_drops_only_those_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with trl_compat.quiet_checkpointing_calls():
            for name in transformers_compat.DEPRECATED_CHECKPOINTING_CALLS:
                warnings.warn_explicit(
                    f"`{name}` is deprecated", FutureWarning, "m.py", 1, "transformers.modeling_utils"
                )
            warnings.warn("`other` is deprecated", FutureWarning)
    assert [str(w.message) for w in caught] == ["`other` is deprecated"]


def _chunked_trainers():
    import chunkloss.trainers as trainers

    found = [getattr(trainers, n) for n in trainers.__all__]
    return [c for c in found if isinstance(c, type) and hasattr(c, "_trl_trainer")]


@pytest.mark.parametrize("cls", _chunked_trainers(), ids=lambda c: c.__name__)
def test_chunked_trainers_override_only_listed_private_names(cls):
    """Every private name a chunked trainer (or a chunkloss class in its bases) defines that the TRL trainer
    has too is an override listed in ``_compat`` (``transformers.TRAINER_OVERRIDES``,
    ``trl.TRAINER_OVERRIDES``); an unlisted one would replace TRL's by accident."""
    trl_cls = cls._trl_trainer
    listed = {*transformers_compat.TRAINER_OVERRIDES, *trl_compat.TRAINER_OVERRIDES}
    for klass in cls.__mro__:
        if not klass.__module__.startswith("chunkloss."):
            continue
        for name in vars(klass):
            if name.startswith("_") and not name.startswith("__") and hasattr(trl_cls, name):
                assert name in listed, f"{klass.__name__}.{name} overrides {trl_cls.__name__}.{name} unlisted"


# --- the library uses none of those names outside chunkloss/_compat ----------------------------------------

#: Private names of other libraries that the accessors of ``chunkloss/_compat`` wrap.
BORROWED = {
    *(name for _, name in torch_compat.PRIVATE_NAMES),
    *trl_compat.PRIVATE_ATTRIBUTES,
    *trl_compat.RESUMED_STATE,
    "_get_output_dir",
    "_attn_implementation",
    "_name_or_path",
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_version",
    "_hf_hook",
    "_C",
    "_dynamo",
    "_guards",
}
#: Overrides by name: ``def name``, ``super().name(...)`` and ``self.name(...)`` (the override) are allowed.
OVERRIDES = {*transformers_compat.TRAINER_OVERRIDES, *trl_compat.TRAINER_OVERRIDES}
LIBRARIES = ("torch", "transformers", "trl", "peft", "accelerate")
_PRIVATE_PATH = re.compile(rf"\b(?:{'|'.join(LIBRARIES)})(?:\.\w+)*\._[a-zA-Z]")


def _docstrings(tree: ast.AST) -> set[int]:
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def borrowed_private_uses(root: Path = ROOT) -> list[str]:
    """``file:line: what`` for each use of another library's private name outside ``chunkloss/_compat``: an
    import of a private module of torch, transformers, TRL, PEFT or accelerate; an attribute, ``getattr`` or
    ``hasattr`` name of :data:`BORROWED`; or a string (not a docstring) naming a private module path."""
    found = []
    for path in sorted((root / "chunkloss").rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[:2] == ("chunkloss", "_compat"):
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            what = None
            if isinstance(node, ast.ImportFrom) and node.module and _PRIVATE_PATH.search(node.module + "."):
                what = f"from {node.module} import"
            elif isinstance(node, ast.Import):
                what = next((f"import {a.name}" for a in node.names if _PRIVATE_PATH.search(a.name)), None)
            elif isinstance(node, ast.Attribute) and node.attr in BORROWED:
                what = f".{node.attr}"
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                if node.value in BORROWED or _PRIVATE_PATH.search(node.value):
                    what = repr(node.value)
            if what is not None:
                found.append(f"{rel}:{node.lineno}: {what}")
    return found


def test_library_uses_no_borrowed_private_name_outside_compat():
    assert borrowed_private_uses() == []


def test_the_scan_finds_borrowed_private_names(tmp_path):
    """The scan flags each kind of use, in a copy of the sources with one line added, and not chunkloss's own
    private names."""
    for path in (ROOT / "chunkloss").rglob("*.py"):
        target = tmp_path / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    assert borrowed_private_uses(tmp_path) == []
    lines = [
        "x = trainer._metrics",
        "x = getattr(config, '_attn_implementation', None)",
        "from torch._guards import SLoc",
        "import torch._dynamo",
        "x = torch._C",
        "x = 'torch.distributed.fsdp._fully_shard.'",
    ]
    target = tmp_path / "chunkloss" / "trainers" / "sft.py"
    original = target.read_text()
    for line in lines:
        target.write_text(original + line + "\n")
        assert borrowed_private_uses(tmp_path), line
    target.write_text(original + "x = self._chunk_offload\n")
    assert borrowed_private_uses(tmp_path) == []


def test_trainers_use_no_unlisted_private_name_of_trl_or_transformers():
    """A private name the chunked trainers use that TRL's or transformers' trainers define (``def _x``,
    ``self._x = ...`` or a class attribute ``_x``) is an override listed in ``_compat``: any other goes
    through an accessor there."""
    sources = [*Path(trl.__file__).parent.joinpath("trainer").glob("*.py")]
    sources += [*Path(trl.__file__).parent.joinpath("experimental").rglob("*_trainer.py")]
    sources.append(Path(transformers.__file__).parent / "trainer.py")
    theirs = set()
    for path in sources:
        text = path.read_text()
        theirs |= set(re.findall(r"self\.(_[a-z]\w*)\s*(?::[^=\n]*)?=(?!=)", text))
        theirs |= set(re.findall(r"def (_[a-z]\w*)", text))
        theirs |= set(re.findall(r"^    (_[a-z]\w*)\s*[:=]", text, re.M))
    found = []
    for path in sorted((ROOT / "chunkloss" / "trainers").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.append(item.name)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                        names += [t.id for t in targets if isinstance(t, ast.Name)]
            found += [f"{path.name}:{node.lineno}: {n}" for n in names if n in theirs and n not in OVERRIDES]
    assert found == []


def test_accelerate_hook_attribute():
    from accelerate.hooks import ModelHook, add_hook_to_module

    module = nn.Linear(2, 2)
    add_hook_to_module(module, ModelHook())
    if not accelerate_compat.has_hf_hook(module):
        pytest.fail(f"accelerate {version('accelerate')} sets no _hf_hook on a hooked module")


def test_layer_checkpointing_flag():
    from transformers.modeling_layers import GradientCheckpointingLayer

    name = "GradientCheckpointingLayer.gradient_checkpointing"
    if not hasattr(GradientCheckpointingLayer, "gradient_checkpointing"):
        pytest.fail(f"transformers {transformers.__version__} has no {name}")
    layer = GradientCheckpointingLayer()
    layer.gradient_checkpointing = True
    assert transformers_compat.layer_checkpointed(
        layer.train()
    ) and not transformers_compat.layer_checkpointed(layer.eval())
