"""The data pipeline: corpus → train/val split by document → tokenizer → token shards → batches.

::

    from openk3.data import prepare_data, TokenDataset, RandomBatches
    info = prepare_data(out_dir="data/shakespeare", vocab_size=8192)   # default corpus: Shakespeare
    print(info)                                                          # counts, token totals, timings
    batches = RandomBatches(TokenDataset(info.train_path), batch_size=8, seq_len=256, seed=0)
    x_BT, y_BT = next(batches)                                           # int64 [8, 256], y = x shifted

Files: ``corpus.py`` (inputs, documents, report, split), ``tokenizer.py`` (byte-level BPE / tokenizer.json /
.tiktoken behind :class:`Tokenizer`), ``shards.py`` (:func:`prepare_data`, :class:`TokenDataset`,
:class:`RandomBatches`).
"""

from openk3.data.corpus import (
    SHAKESPEARE_INSTALL,
    CorpusReport,
    Document,
    SourceFile,
    default_corpus_files,
    read_documents,
    resolve_inputs,
    split_documents,
)
from openk3.data.shards import (
    SHARD_FORMAT_VERSION,
    DataInfo,
    RandomBatches,
    SplitInfo,
    TokenDataset,
    data_fingerprint,
    prepare_data,
    shard_dtype,
)
from openk3.data.tokenizer import DEFAULT_SPECIAL_TOKENS, EOS_TOKEN, Tokenizer

__all__ = [
    "DEFAULT_SPECIAL_TOKENS",
    "EOS_TOKEN",
    "SHAKESPEARE_INSTALL",
    "SHARD_FORMAT_VERSION",
    "CorpusReport",
    "DataInfo",
    "Document",
    "RandomBatches",
    "SourceFile",
    "SplitInfo",
    "TokenDataset",
    "Tokenizer",
    "data_fingerprint",
    "default_corpus_files",
    "prepare_data",
    "read_documents",
    "resolve_inputs",
    "shard_dtype",
    "split_documents",
]
