"""Parallel text for translation: files, a joint subword vocabulary, length buckets with fixed shapes.

`dataset.path` holds `{prefix}.{lang}` files (one sentence per line, optionally .gz), e.g. train.en /
train.de and newstest2014.en / newstest2014.de. With no path, the embedded data is the German translations
of Django's own user-interface strings (the gettext catalogs inside the `django` package): a few hundred
real human translations, enough for a smoke run, nowhere near WMT.

Subwords: a joint sentencepiece model (ids: 0 pad, 1 unk, 2 bos, 3 eos) trained on the training text, or
loaded from `dataset.params.spm_model`: unigram on the raw text by default, or the published Multi30k
preparation (`dataset=multi30k_published`): lowercased, Moses-tokenized (sacremoses), a BPE vocabulary.
Either way decoding returns detokenized text, so BLEU is always scored against the raw references.
Batches are padded to their length bucket's boundary, so there are only a few fixed shapes: graph mode
compiles once per bucket and data sinking works.
"""
import errno
import gettext
import gzip
import hashlib
import importlib.util
import os
from collections import Counter
from pathlib import Path
from typing import List, Tuple

import mindspore.dataset as msds
import numpy as np
import sentencepiece as spm
from sacremoses import MosesDetokenizer, MosesTokenizer

from ampzoo import locks
from ampzoo.data.sampling import sampling
from ampzoo.errors import ConfigError
from ampzoo.registry import DATASETS

PAD, UNK, BOS, EOS = 0, 1, 2, 3
DEFAULTS = {"src_lang": "en", "tgt_lang": "de", "train_prefix": "train", "test_prefix": "test",
            "vocab_size": 8000, "max_len": 64, "buckets": [16, 32, 64], "spm_model": None,
            "cache_dir": "~/.cache/amp_zoo", "lowercase": False, "moses": False, "spm_type": "unigram"}
SPM_TYPES = ("unigram", "bpe")


def params(cfg) -> dict:
    unknown = set(cfg.params) - set(DEFAULTS)
    if unknown:
        raise ConfigError(f"dataset.params.{sorted(unknown)[0]} is not a translation option; "
                          f"valid: {', '.join(DEFAULTS)}")
    p = {**DEFAULTS, **{k: v for k, v in cfg.params.items()}}
    if p["spm_type"] not in SPM_TYPES:
        raise ConfigError(f"dataset.params.spm_type={p['spm_type']!r} is not a sentencepiece model type; "
                          f"valid: {', '.join(SPM_TYPES)}")
    return p


class Tokenizer:
    """Text <-> subword ids: the text preparation dataset.params asks for (Moses tokenization, lowercasing),
    then the joint sentencepiece model. `decode` gives detokenized target-language text."""

    def __init__(self, sp: spm.SentencePieceProcessor, p: dict):
        self.sp, self.lowercase = sp, p["lowercase"]
        self.moses = {lang: MosesTokenizer(lang) for lang in (p["src_lang"], p["tgt_lang"])} if p["moses"] else {}
        self.detok = MosesDetokenizer(p["tgt_lang"]) if p["moses"] else None
        self.scoring = MosesTokenizer(p["tgt_lang"])

    def prepare(self, text: str, lang: str) -> str:
        if self.moses:
            text = self.moses[lang].tokenize(text, return_str=True, escape=False)
        return text.lower() if self.lowercase else text

    def encode(self, text: str, lang: str) -> List[int]:
        return self.sp.encode(self.prepare(text, lang))

    def decode(self, ids) -> str:
        text = self.sp.decode(ids)
        return self.detok.detokenize(text.split()) if self.detok else text

    def decode_tokenized(self, ids) -> str:
        """The output as multi-bleu.perl scores it (fairseq's scorer, the paper's): lowercased Moses tokens,
        subwords joined (fairseq's --remove-bpe); a model of the raw text has its output Moses-tokenized."""
        text = self.sp.decode(ids)
        return (text if self.moses else self.tokenized(text)).lower()

    def tokenized(self, text: str) -> str:
        """A target-language text (a reference) as multi-bleu.perl scores it: Moses tokens, lowercased."""
        return self.scoring.tokenize(text, return_str=True, escape=False).lower()


def _read_lines(path: Path, key: str) -> List[str]:
    """The lines of `path` (or `path`.gz); when neither is there, one line naming the files of its language that
    are, and the prefix key (`dataset.params.KEY`) that picks one."""
    for candidate in (path, path.with_name(path.name + ".gz")):
        if candidate.is_file():
            opener = gzip.open if candidate.suffix == ".gz" else open
            try:
                with opener(candidate, "rt", encoding="utf-8-sig") as f:  # -sig: a BOM (Notepad) is not text
                    return [line.rstrip("\n") for line in f]
            except UnicodeDecodeError as e:
                line = candidate.read_bytes()[:e.start].count(b"\n") + 1 if candidate.suffix != ".gz" else "?"
                raise ConfigError(f"{candidate} is not UTF-8 text (line {line}: {e.reason}); a translation data "
                                  f"set is UTF-8 text, one sentence per line") from None
            except (OSError, EOFError) as e:
                raise ConfigError(f"{candidate} cannot be read as {'gzip' if candidate.suffix == '.gz' else 'text'}: "
                                  f"{e}") from None
    lang = path.suffix
    here = sorted({f.name.split(lang)[0] for f in path.parent.glob(f"*{lang}*")
                   if f.name.endswith((lang, lang + ".gz"))})
    raise ConfigError(f"{path} (or .gz) does not exist; a translation data set is {{prefix}}.{{lang}} files, one "
                      f"sentence per line" + (f"; the {lang[1:]} files here are {', '.join(here)}: set "
                                              f"dataset.params.{key} to one of them" if here else ""))


def django_pairs() -> List[Tuple[str, str]]:
    """English UI strings and their German translations from Django's compiled gettext catalogs."""
    spec = importlib.util.find_spec("django")
    if spec is None or spec.origin is None:
        raise ConfigError("the embedded translation data needs the django package (its catalogs only): "
                          "pip install --no-deps django==5.2.19, or set dataset.path to parallel text files")
    pairs = {}
    for mo in sorted(Path(spec.origin).parent.glob("**/locale/de/LC_MESSAGES/*.mo")):
        with open(mo, "rb") as f:
            for src, tgt in gettext.GNUTranslations(f)._catalog.items():  # pylint: disable=protected-access
                if isinstance(src, str) and src.strip() and tgt.strip() and "\n" not in src + tgt:
                    pairs[src.strip()] = tgt.strip()
    return sorted(pairs.items())


def read_pairs(cfg, split: str) -> List[Tuple[str, str]]:
    p = params(cfg)
    if cfg.path is None:
        pairs = django_pairs()
        test = [pair for i, pair in enumerate(pairs) if i % 8 == 0]  # fixed: every 8th pair in msgid order
        train = [pair for i, pair in enumerate(pairs) if i % 8]
        return test if split == "test" else train
    root = Path(cfg.path).expanduser()
    key = "train_prefix" if split == "train" else "test_prefix"
    prefix = p[key]
    src = _read_lines(root / f"{prefix}.{p['src_lang']}", key)
    tgt = _read_lines(root / f"{prefix}.{p['tgt_lang']}", key)
    if len(src) != len(tgt):
        raise ConfigError(f"{root / prefix}.{p['src_lang']} has {len(src)} lines but .{p['tgt_lang']} has "
                          f"{len(tgt)}; parallel files must align line by line")
    pairs = list(zip(src, tgt))
    if not any(s.strip() and t.strip() for s, t in pairs):
        raise ConfigError(f"{root / prefix}.{p['src_lang']} and .{p['tgt_lang']} hold no sentence pair (" +
                          ("empty files" if not src else f"{len(src)} lines, every pair with an empty side") +
                          "); a translation data set is one sentence per line in each language")
    return pairs


def tokenizer_file(cfg) -> Path:
    """The joint sentencepiece model's file: dataset.params.spm_model, or one trained on the training pairs
    (cached by content in dataset.params.cache_dir)."""
    p = params(cfg)
    if p["spm_model"]:
        path = Path(p["spm_model"]).expanduser()
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "does not exist"
            raise ConfigError(f"dataset.params.spm_model={p['spm_model']!r} {what}; give a sentencepiece .model file, "
                              f"or leave it unset to train one on the training text")
        return path
    pairs = read_pairs(cfg, "train")
    prepare = Tokenizer(None, p).prepare
    text = "\n".join(prepare(src, p["src_lang"]) + "\n" + prepare(tgt, p["tgt_lang"]) for src, tgt in pairs)
    kind = "" if p["spm_type"] == "unigram" else f"{p['spm_type']}\n"  # unigram keeps the key it always had
    key = hashlib.sha1(f"{p['vocab_size']}\n{kind}{text}".encode()).hexdigest()[:16]
    cache = Path(os.path.expanduser(p["cache_dir"]))
    model = cache / f"spm-{key}.model"
    if not model.is_file():
        try:
            build_cached(model, text, p)
        except locks.LockFailed as e:  # the file system, not the space on it
            raise ConfigError(f"could not lock the tokenizer cache {cache} ({e.strerror}); set "
                              f"dataset.params.cache_dir to a folder on a file system that takes locks (a local "
                              f"disk, say)") from None
        except OSError as e:
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            raise ConfigError(f"could not write the tokenizer cache {e.filename or cache}: {e.strerror or e}; "
                              + ("free space there, or " if full else "") + "set dataset.params.cache_dir to a "
                              "writable folder") from None
    return model


def build_cached(model: Path, text: str, p) -> None:
    """Train the sentencepiece model into `model`, once for every process that asks (msrun's ranks all do):
    the first takes an exclusive lock beside it (ampzoo.locks: an flock, or a lock file where the file system has
    none) and builds into names of its own, then renames the model into place; the others wait for the lock and
    find the model there."""
    model.parent.mkdir(parents=True, exist_ok=True)
    lock = locks.acquire(Path(f"{model}.lock"), wait=True)  # an flock dies with its process; a lock file is
    try:  # removed on release, at exit, or (a killed process's, on this host) by the next one
        if model.is_file():  # another process built it while this one waited
            return
        tmp_prefix = model.with_name(f"{model.stem}.tmp{os.getpid()}")
        corpus = Path(f"{tmp_prefix}.txt")
        corpus.write_text(text, encoding="utf-8")
        try:
            spm.SentencePieceTrainer.train(
                input=str(corpus), model_prefix=str(tmp_prefix), vocab_size=p["vocab_size"],
                model_type=p["spm_type"], character_coverage=1.0, pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS,
                hard_vocab_limit=False, num_threads=1, minloglevel=2, input_sentence_size=2_000_000,
                shuffle_input_sentence=False)
            os.replace(f"{tmp_prefix}.model", model)  # atomic: a reader without the lock never sees half a model
        finally:
            for leftover in (corpus, Path(f"{tmp_prefix}.vocab"), Path(f"{tmp_prefix}.model")):
                leftover.unlink(missing_ok=True)
    finally:
        lock.release()


def tokenizer(cfg) -> Tokenizer:
    """The joint sentencepiece model (tokenizer_file), loaded, behind the text preparation dataset.params asks for."""
    path = tokenizer_file(cfg)
    try:
        return Tokenizer(spm.SentencePieceProcessor(model_file=str(path)), params(cfg))
    except (OSError, RuntimeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{path} is not a sentencepiece model ({reason}); give the .model file spm_train wrote "
                          f"as dataset.params.spm_model, or leave it unset to train one") from None


def encode_pairs(cfg, split: str):
    """Token ids (src, tgt_in = BOS + y, tgt_out = y + EOS), dropping pairs longer than max_len."""
    p = params(cfg)
    sp = tokenizer(cfg)
    pairs = read_pairs(cfg, split)
    out = []
    for src, tgt in pairs:
        s = sp.encode(src, p["src_lang"])[: p["max_len"] - 1] + [EOS]
        t = sp.encode(tgt, p["tgt_lang"])
        if len(t) + 1 > p["max_len"] and split == "train":
            continue
        t = t[: p["max_len"] - 1]
        out.append((np.array(s, np.int32), np.array([BOS] + t, np.int32), np.array(t + [EOS], np.int32)))
    return out, pairs, sp


def bucket_of(example, buckets) -> int:
    return next(b for b in buckets if max(len(example[0]), len(example[1])) <= b)


def batch_rows(length: int, max_tokens: int, batch_size: int) -> int:
    """Sentences in a batch of the `length`-token bucket."""
    return max(1, max_tokens // length) if max_tokens > 0 else batch_size


def make_batches(examples, buckets, max_tokens: int, batch_size: int, train: bool):
    """Fixed batches, each padded to its length bucket: a few static shapes, so graph mode compiles once per
    bucket. With max_tokens > 0 (fairseq's --max-tokens) a bucket of length L holds max_tokens // L sentences
    per batch, so every batch carries about the same number of (padded) tokens; otherwise batch_size sentences.
    Training: each bucket shuffled once (seed 0) and partial batches dropped; composition is fixed, and the
    sampler shuffles batch order every epoch (as fairseq's length-sorted batches). Test: file order within a
    bucket, nothing dropped."""
    by_bucket = {b: [] for b in buckets}
    for ex in examples:
        by_bucket[bucket_of(ex, buckets)].append(ex)
    rng = np.random.RandomState(0)
    batches = []
    for length, bucket in by_bucket.items():
        if train:
            bucket = [bucket[i] for i in rng.permutation(len(bucket))]
        size = batch_rows(length, max_tokens, batch_size)
        for i in range(0, len(bucket), size):
            chunk = bucket[i:i + size]
            if train and len(chunk) < size:
                continue
            batches.append(tuple(np.stack([np.pad(x, (0, length - len(x))) for x in column]) for column in zip(*chunk)))
    return batches


@DATASETS.register("translation", task="translation")
def translation(cfg, split: str, shard=None, start_epoch: int = 0, seed: int = 0,
            skip_batches: int = 0):
    p = params(cfg)
    buckets = sorted(p["buckets"])
    if buckets[-1] < p["max_len"]:
        raise ConfigError(f"dataset.params.buckets={buckets} must reach max_len={p['max_len']}")
    examples, _, _ = encode_pairs(cfg, split)
    train = split == "train"
    batch_size = cfg.batch_size if train else cfg.eval_batch_size
    if train and cfg.max_tokens <= 0 and len(examples) < batch_size:
        raise ConfigError(f"dataset.batch_size={batch_size} is larger than the {len(examples)} training pairs; "
                          f"use at most {len(examples)}")
    if train and 0 < cfg.max_tokens < buckets[-1]:
        raise ConfigError(f"dataset.max_tokens={cfg.max_tokens} cannot hold one sentence of the longest bucket "
                          f"({buckets[-1]} tokens); use at least {buckets[-1]}, or 0 for dataset.batch_size sentences")
    batches = make_batches(examples, buckets, cfg.max_tokens if train else 0, batch_size, train)
    if train and not batches:  # every bucket holds fewer pairs than one of its batches
        counts = Counter(bucket_of(ex, buckets) for ex in examples)
        length, n = max(counts.items(), key=lambda kv: kv[1] / batch_rows(kv[0], cfg.max_tokens, batch_size))
        unit = f"dataset.max_tokens={cfg.max_tokens}" if cfg.max_tokens > 0 else f"dataset.batch_size={batch_size}"
        raise ConfigError(f"the {len(examples)} training pairs fill no whole batch: the fullest length bucket "
                          f"({length} tokens) has {n} pair{'s' * (n != 1)}, and a batch of it holds "
                          f"{batch_rows(length, cfg.max_tokens, batch_size)} ({unit}); lower {unit.split('=')[0]}, "
                          f"or give more training pairs")
    return msds.GeneratorDataset(batches, column_names=["src", "tgt_in", "tgt_out"],
                                 **sampling(len(batches), split, shard, seed, start_epoch, skip_batches))

