"""Tiny, download-free building blocks for CPU runs and tests: a tokenizer trained locally with
``tokenizers``, small datasets built with ``datasets.Dataset.from_dict``, and tiny random models
built from a config.

The task is counting: the prompt ``"count 2 to 6 :"`` asks for the completion ``" 2 3 4 5 6"``. It
is learnable in a few dozen steps by a tiny model, so a falling loss means the run trains.
"""

from __future__ import annotations

import difflib
import random

from datasets import Dataset

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# Chat template with {% generation %} markers so TRL's assistant-only loss works.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>{% generation %}{{ message['content'] }}<|end|>"
    "{% endgeneration %}"
    "{% else %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _count_example(rng: random.Random, max_len: int = 8) -> tuple[str, str, str]:
    """(prompt, correct completion, wrong completion) of the counting task."""
    start = rng.randint(0, 20)
    n = rng.randint(2, max_len)
    prompt = f"count {start} to {start + n - 1} :"
    good = " " + " ".join(str(start + i) for i in range(n))
    wrong = list(range(start, start + n))
    rng.shuffle(wrong)
    bad = " " + " ".join(str(v) for v in wrong)
    if bad == good:
        bad = " " + " ".join(str(v) for v in reversed(wrong))
    return prompt, good, bad


def tiny_tokenizer(extra_text: list[str] | None = None):
    """A word-level tokenizer trained locally on the counting task's text (about 80 tokens).

    Returns a ``transformers.PreTrainedTokenizerFast`` with pad/eos/bos and a chat template.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = []
    for _ in range(2000):
        p, g, b = _count_example(rng)
        corpus += [p, g, b]
    corpus += extra_text or []
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=[PAD, EOS, BOS, UNK, *ROLE_TOKENS])
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, bos_token=BOS, unk_token=UNK
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.add_special_tokens({"additional_special_tokens": ROLE_TOKENS})
    return fast


def tiny_dataset(kind: str, n: int = 256, seed: int = 0) -> Dataset:
    """A small dataset of the counting task in the format TRL's trainer of ``kind`` expects.

    kind: 'sft' (prompt/completion), 'dpo' and 'orpo' (prompt/chosen/rejected), 'kto' (TRL's unpaired
    prompt/completion/label: the correct completion labelled True and the wrong one False, alternately),
    'grpo' (prompt and the answer for the reward), 'gkd' (conversational ``messages``), 'distillation'
    (prompt/completion).
    """
    rng = random.Random(seed)
    rows = [_count_example(rng) for _ in range(n)]
    if kind in ("sft", "distillation"):
        return Dataset.from_dict({"prompt": [p for p, _, _ in rows], "completion": [g for _, g, _ in rows]})
    if kind in ("dpo", "orpo", "cpo", "simpo"):
        return Dataset.from_dict(
            {
                "prompt": [p for p, _, _ in rows],
                "chosen": [g for _, g, _ in rows],
                "rejected": [b for _, _, b in rows],
            }
        )
    if kind == "kto":
        return Dataset.from_dict(
            {
                "prompt": [p for p, _, _ in rows],
                "completion": [(g, b)[i % 2] for i, (_, g, b) in enumerate(rows)],
                "label": [i % 2 == 0 for i in range(n)],
            }
        )
    if kind == "grpo":
        return Dataset.from_dict({"prompt": [p for p, _, _ in rows], "answer": [g for _, g, _ in rows]})
    if kind == "gkd":
        return Dataset.from_dict(
            {
                "messages": [
                    [{"role": "user", "content": p}, {"role": "assistant", "content": g.strip()}]
                    for p, g, _ in rows
                ]
            }
        )
    raise ValueError(
        f"unknown dataset kind {kind!r}; expected sft, dpo, orpo, kto, grpo, gkd or distillation"
    )


def _words(completion) -> list[str]:
    """The words of a completion, plain text or conversational."""
    return (completion if isinstance(completion, str) else completion[-1]["content"]).split()


def count_reward(completions, answer, **kwargs) -> list[float]:
    """GRPO reward of the counting task: the fraction of positions that match the answer, minus 0.1 per word
    of length difference. GRPO from a random tiny model does not raise it within a few dozen steps (the tiny
    GRPO config uses :func:`length_reward`)."""
    out = []
    for completion, target in zip(completions, answer):
        got, want = _words(completion), target.split()
        out.append(
            sum(a == b for a, b in zip(got, want)) / max(len(want), 1) - 0.1 * abs(len(got) - len(want))
        )
    return out


def length_reward(completions, max_words: int = 10, **kwargs) -> list[float]:
    """GRPO reward ``1 - words / max_words``, in [0, 1]: the shorter the completion, the higher.

    A tiny random model improves it within a few dozen steps (it only has to learn to end sooner), so the
    tiny GRPO demo shows the reward rising.
    """
    return [max(0.0, 1.0 - len(_words(c)) / max_words) for c in completions]


# The names a config's ``reward_funcs`` may use for a built-in reward.
REWARD_FUNCS = {"count": count_reward, "length": length_reward}

TINY_MODEL_KEYS = ("family", "hidden_size", "num_layers")


def check_tiny_model(spec: dict) -> None:
    """Raise ValueError unless ``spec`` (the keyword arguments of :func:`tiny_model`) builds a model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not isinstance(spec, dict):
        raise ValueError(f"must be a mapping with keys {', '.join(TINY_MODEL_KEYS)}, got {spec!r}")
    for key, value in spec.items():
        if key not in TINY_MODEL_KEYS:
            raise ValueError(f"unknown key {key!r}; expected {', '.join(TINY_MODEL_KEYS)}")
        if key != "family" and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    if spec.get("hidden_size", 64) % 4:
        raise ValueError(f"hidden_size must be a multiple of 4 (4 heads), got {spec['hidden_size']}")
    family = spec.get("family", "qwen3")
    if family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        close = difflib.get_close_matches(str(family), list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else " (a transformers model type)"
        raise ValueError(f"unknown causal LM family {family!r}{hint}")


def tiny_model(tokenizer, family: str = "qwen3", hidden_size: int = 64, num_layers: int = 2, **overrides):
    """A randomly initialised causal LM of ``family`` sized for CPU runs (nothing downloaded).

    ``family`` is a transformers model type with a causal LM class; ``hidden_size`` a multiple of 4 (the model
    has 4 attention heads); ``overrides`` are passed on to the model config.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    check_tiny_model({"family": family, "hidden_size": hidden_size, "num_layers": num_layers})

    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    cfg = AutoConfig.for_model(family, **{**kwargs, **overrides})
    return AutoModelForCausalLM.from_config(cfg)
