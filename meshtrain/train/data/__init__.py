"""Training data: token files on disk read through memory maps in deterministic distributed
batches, the built-in corpus and the tokenizers that build them.

Modules: :mod:`~meshtrain.train.data` (token files, windows, distributed batches),
``corpus`` (the standard-library docstring corpus) and ``tokenizer`` (byte-level and
``tokenizer.json`` tokenizers).

    >>> TOKENS_BIN
    'tokens.bin'
"""

from meshtrain.train.data.loader import (
    TOKENS_BIN,
    TOKENS_JSON,
    ByteTokenizer,
    DataError,
    DistributedBatches,
    SyntheticTokens,
    TokenDataset,
    TokenFile,
    TokenFileInfo,
    TokenWindows,
    prepare_corpus,
    prepare_tokens,
)

__all__ = [
    "TOKENS_BIN",
    "TOKENS_JSON",
    "ByteTokenizer",
    "DataError",
    "DistributedBatches",
    "SyntheticTokens",
    "TokenDataset",
    "TokenFile",
    "TokenFileInfo",
    "TokenWindows",
    "prepare_corpus",
    "prepare_tokens",
]
