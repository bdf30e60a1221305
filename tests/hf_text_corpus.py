"""A corpus, a tokenizer and a tiny pretrained decoder that the ``data=hf_text`` tests write themselves.

The corpus: a JSONL of prompt/response pairs and plain documents, and plain text files, of very different
lengths (3 to ~400 tokens: some longer than a row). The tokenizer: a word-level ``tokenizers`` model trained on it
(saved with ``save_pretrained`` through ``PreTrainedTokenizerFast``, with eos and pad tokens). The model: a
``transformers`` decoder of widths <= 64 on that vocabulary, saved with ``save_pretrained`` beside it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["<pad>", "<eos>", "<unk>"]
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=512)
MOE = dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=False)


def _sentence(rng: random.Random, length: int) -> str:
    start = rng.randrange(len(WORDS))
    step = rng.choice([1, 2, 3])  # counting patterns: learnable in a few steps
    return " ".join(WORDS[(start + step * i) % len(WORDS)] for i in range(length))


def write_corpus(folder: Path, records: int = 48, texts: int = 6, seed: int = 0) -> dict[str, Path]:
    """``corpus.jsonl`` (prompt/response pairs and ``text`` documents) and ``texts/*.txt``; their paths."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    lengths = [3, 5, 9, 17, 40, 2, 70, 12, 150, 4, 25, 400]
    with open(folder / "corpus.jsonl", "w") as handle:
        for i in range(records):
            n = lengths[i % len(lengths)]
            if i % 3 == 0:
                record = {"prompt": _sentence(rng, 1 + n % 7), "response": _sentence(rng, n)}
            else:
                record = {"text": _sentence(rng, n)}
            handle.write(json.dumps(record) + "\n")
    (folder / "texts").mkdir(exist_ok=True)
    for i in range(texts):
        (folder / "texts" / f"doc{i}.txt").write_text(_sentence(rng, lengths[(5 * i + 3) % len(lengths)]))
    return {"jsonl": folder / "corpus.jsonl", "texts": folder / "texts"}


def train_tokenizer(files: list[Path], folder: Path):
    """A word-level tokenizer trained on ``files`` with ``tokenizers``, saved to ``folder``; the transformers one."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    texts = []
    for file in files:
        paths = sorted(file.glob("*.txt")) if file.is_dir() else [file]
        for path in paths:
            texts.extend(path.read_text().replace('"', " ").replace(":", " ").split("\n"))
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=SPECIAL))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")
    fast.save_pretrained(folder)
    return fast


def save_model(folder: Path, tokenizer, family: str = "llama", seed: int = 0) -> Path:
    """A tiny random ``family`` decoder on ``tokenizer``'s vocabulary, saved with its tokenizer to ``folder``."""
    import torch
    import transformers

    extra = MOE if family in ("mixtral", "qwen3_moe") else {}
    if family == "qwen3_moe":
        extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=False)
    vocab = -(-len(tokenizer) // 8) * 8  # rows padded to a multiple of 8, as released models do: tensor ranks divide it
    config = transformers.AutoConfig.for_model(
        family, vocab_size=vocab, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, tie_word_embeddings=False, **TINY, **extra)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def corpus_and_model(root: Path, family: str = "llama") -> tuple[dict[str, Path], Path]:
    """The corpus under ``root/data`` and a ``family`` model folder with its tokenizer under ``root/model``."""
    corpus = write_corpus(root / "data")
    tokenizer = train_tokenizer([corpus["jsonl"], corpus["texts"]], root / "tokenizer")
    return corpus, save_model(root / f"model_{family}", tokenizer, family)
