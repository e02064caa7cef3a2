"""The run's shared tokenizer: given by the user, or a byte-level BPE trained here.

With no `--tokenizer`, `paths init` trains a byte-level BPE (the `tokenizers` library) on text that
every machine with Python has: the standard library's top-level `.py` sources (~4.7 MB of code and
English docstrings), read in sorted order, so the same Python gives the same tokenizer. Special
tokens: `<pad>` = 0, `<s>` = 1 (BOS), `</s>` = 2 (EOS), matching the presets' token ids. It carries
a minimal chat template (`paths.envs.chat.MINIMAL_TEMPLATE`), so chat prompts need no download.
"""

from __future__ import annotations

import glob
import os
import sysconfig
import tempfile
from typing import Any

from paths.errors import ConfigurationError

SPECIALS = ["<pad>", "<s>", "</s>"]


def local_corpus(max_bytes: int = 8 << 20) -> list[str]:
    """Text files found on this machine: the Python standard library's top-level sources."""
    files, total = [], 0
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        files.append(path)
        total += os.path.getsize(path)
        if total >= max_bytes:
            break
    if not files:
        raise ConfigurationError("found no local text to train a tokenizer on: pass --tokenizer DIR")
    return files


def train_bpe(vocab_size: int, files: list[str] | None = None):
    """A byte-level BPE tokenizer (transformers' fast tokenizer) of at most vocab_size tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIALS):
        raise ConfigurationError(f"tokenizer vocab_size {vocab_size} is below the 259 a byte-level BPE needs")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train(files or local_corpus(), trainer)
    from paths.envs.chat import MINIMAL_TEMPLATE

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token=None, chat_template=MINIMAL_TEMPLATE
    )


def load_tokenizer(path: str):
    """A tokenizer saved with save_pretrained, from a local folder."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"cannot load a tokenizer from {path} ({exc}): pass a folder saved with save_pretrained") from None


def tokenizer_files(tokenizer: Any) -> tuple[str, list[str]]:
    """Save to a fresh temp folder; (folder, file names)."""
    folder = tempfile.mkdtemp(prefix="paths-tok-")
    tokenizer.save_pretrained(folder)
    return folder, sorted(os.listdir(folder))


def check_vocab(tokenizer: Any, vocab_size: int, what: str) -> None:
    """A tokenizer must not produce ids beyond the model's embedding."""
    if len(tokenizer) > vocab_size:
        raise ConfigurationError(
            f"{what} has {len(tokenizer)} tokens but the model's embedding has {vocab_size}: "
            "use a smaller tokenizer or a config with a larger vocab_size"
        )
