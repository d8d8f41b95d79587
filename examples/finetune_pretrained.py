"""Fine-tune a pretrained BERT (loaded with ``from_pretrained``) to classify Python source lines.

The task: each non-blank line of the CPython standard library's top-level ``*.py`` sources
(``sysconfig.get_paths()["stdlib"]``), stripped of surrounding whitespace, is one of four classes:
``comment`` (starts with ``#``), ``import`` (``import x`` / ``from x import y``), ``def_or_class``
(``def``, ``async def``, ``class``) or ``other``. Files are split deterministically: every 10th file
in sorted order (index % 10 == 9) is held out, the rest train. Batches sample the four classes
equally (row ``r`` of a batch is of class ``r % 4``), so chance level is ``ln 4 = 1.386``.

There is no model hub here, so the "pretrained checkpoint" is made locally, once, by
:func:`ensure_pretrained`: a byte-level BPE tokenizer (vocabulary 2048, ``tokenizers``) trained on
the training files' lines, and a 2-layer, hidden-128 ``BertForMaskedLM`` pre-trained for
``PRETRAIN["steps"]`` steps of masked-LM on the same lines, packed into 64-token windows; both are
written with ``save_pretrained`` (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``). :func:`build_model` then does what a fine-tuning script does with a
downloaded checkpoint: ``BertForSequenceClassification.from_pretrained(directory, num_labels=4)``,
which loads the encoder and initialises the pooler and the classification head (seed 0).

The directory is ``$AUTOPREC_CACHE/finetune_pretrained/stdlib-bert-<hash>`` (default cache
``~/.cache/autoprec``; ``<hash>`` covers the recipe below and the Python version, whose stdlib is
the corpus). It is built in a temporary directory beside it and renamed into place, so two processes
building it at once both end up loading one complete directory. Delete it to rebuild.

Batches are padded to a fixed ``MAX_LEN`` = 64 tokens with an attention mask, so every batch has one
shape; ``padding="longest"`` in :func:`make_batch` gives pad-to-longest batches of varying length,
which ``tune`` and ``train`` also accept (one capture with dynamic dimensions); the fixed length keeps
the committed measurements comparable. Dropout is 0 so that tune's drift
measurement compares the same function in every precision. The first build of the checkpoint
takes ~10 s on 2 cores; later runs load it.

Run::

    make tune MODEL=examples/finetune_pretrained.py OUT=out/finetune.policy.json
    .venv/bin/autoprec train examples/finetune_pretrained.py --policy out/finetune.policy.json --steps 100

Entry points (docs/architecture.md#modelpy-contract): ``build_model``, ``get_batch``,
``get_heldout_batch``, ``tokens_per_batch``; the loss is the model's own ``output.loss``
(cross-entropy over the 4 classes; batches carry ``labels``) and the optimizer the default AdamW.
Needs torch, transformers and tokenizers (a transformers dependency).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

CLASSES = ("comment", "import", "def_or_class", "other")
MAX_LEN = 64  # tokens per line after padding/truncation, [CLS] and [SEP] included
BATCH_SIZE = 16  # lines per batch, 4 of each class
HELDOUT_EVERY = 10  # every 10th stdlib file (sorted) is held out
SPECIAL_TOKENS = ("[PAD]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..3, in this order
ENCODER = {"vocab_size": 2048, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 512, "max_position_embeddings": 128}
#: Masked-LM pre-training of the checkpoint: steps, windows per step, window length, AdamW lr,
#: masked fraction (BERT's 15%, all replaced by [MASK]), seed, and the stride over the training lines
#: that makes the token stream (every 8th line: ~180k tokens, more than the 123k the steps read).
PRETRAIN = {"steps": 120, "batch_size": 16, "seq_len": 64, "lr": 1e-3, "mask_prob": 0.15, "seed": 0,
            "line_stride": 8}
RECIPE_VERSION = 1  # bump when the code that builds the directory changes what it writes

_IMPORT = re.compile(r"(import|from)\s")
_DEF = re.compile(r"(async\s+def|def|class)\s")
_lines: dict[bool, list[list[str]]] = {}  # heldout -> per-class lists of lines, loaded once per process
_tokenizer: Any = None  # loaded once per process


def label_of(line: str) -> int:
    """The class index (into :data:`CLASSES`) of one stripped source line."""
    if line.startswith("#"):
        return 0
    if _IMPORT.match(line):
        return 1
    if _DEF.match(line):
        return 2
    return 3


def _stdlib_files() -> list[str]:
    """Sorted top-level ``*.py`` files of the running interpreter's standard library.

    Raises:
        RuntimeError: the directory has no sources (e.g. a stripped install).
    """
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    if len(files) < HELDOUT_EVERY:
        raise RuntimeError(f"examples/finetune_pretrained.py: only {len(files)} *.py files under {stdlib}; "
                           "this example needs the standard library's sources")
    return files


def _read_lines(heldout: bool) -> list[str]:
    """Non-blank stripped lines of the training (or held-out) files, in file then line order."""
    out: list[str] = []
    for i, name in enumerate(_stdlib_files()):
        if (i % HELDOUT_EVERY == HELDOUT_EVERY - 1) == heldout:
            with open(name, encoding="utf-8", errors="replace") as f:
                out.extend(s for s in (line.strip() for line in f) if s)
    return out


def lines_by_class(heldout: bool = False) -> list[list[str]]:
    """The split's lines grouped by class: ``[lines of class 0, ..., lines of class 3]`` (cached)."""
    if heldout not in _lines:
        groups: list[list[str]] = [[] for _ in CLASSES]
        for line in _read_lines(heldout):
            groups[label_of(line)].append(line)
        if any(not g for g in groups):
            raise RuntimeError("examples/finetune_pretrained.py: a class has no "
                               f"{'held-out' if heldout else 'training'} lines ({[len(g) for g in groups]})")
        _lines[heldout] = groups
    return _lines[heldout]


def cache_root() -> Path:
    """``$AUTOPREC_CACHE`` if set, else ``~/.cache/autoprec``."""
    return Path(os.environ.get("AUTOPREC_CACHE") or Path.home() / ".cache" / "autoprec")


def pretrained_dir(root: str | os.PathLike | None = None) -> Path:
    """Where the checkpoint lives: ``<root>/finetune_pretrained/stdlib-bert-<hash of recipe>``."""
    recipe = {"v": RECIPE_VERSION, "encoder": ENCODER, "pretrain": PRETRAIN, "special": SPECIAL_TOKENS,
              "heldout_every": HELDOUT_EVERY, "python": list(sys.version_info[:2])}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    return Path(root if root is not None else cache_root()) / "finetune_pretrained" / f"stdlib-bert-{digest}"


def _complete(path: Path) -> bool:
    return all((path / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def ensure_pretrained(root: str | os.PathLike | None = None) -> Path:
    """Make the pretrained checkpoint directory if it is not there yet; return its path.

    Builds into a fresh temporary directory beside the target and renames it into place; when
    another process renamed its own copy first, this copy is discarded and theirs is used.

    Args:
        root: Cache root (default :func:`cache_root`).

    Returns:
        The directory holding ``config.json``, ``model.safetensors`` and the tokenizer files.

    Raises:
        OSError: the cache root cannot be written, or ``target`` exists without the files above.
    """
    target = pretrained_dir(root)
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        lines = _read_lines(heldout=False)
        tokenizer = _train_tokenizer(lines)
        model = _pretrain(tokenizer, lines[::PRETRAIN["line_stride"]])
        with _quiet_transformers():
            tokenizer.save_pretrained(tmp)
            model.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache is readable like any other directory
        try:
            os.rename(tmp, target)
        except OSError as e:
            if not _complete(target):  # not a lost race: a real failure
                raise OSError("examples/finetune_pretrained.py: cannot move the built checkpoint to "
                              f"{target} ({e}); if that directory is a partial copy, delete "
                              "it to rebuild") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _train_tokenizer(lines: list[str]) -> Any:
    """A byte-level BPE tokenizer trained on ``lines``, wrapped for transformers (``[CLS] x [SEP]``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=ENCODER["vocab_size"], special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                       special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=MAX_LEN)


def _pretrain(tokenizer: Any, lines: list[str]) -> torch.nn.Module:
    """A ``BertForMaskedLM`` after ``PRETRAIN["steps"]`` masked-LM steps on packed windows of ``lines``.

    The lines' token ids (each line ``[CLS] ... [SEP]``) are concatenated into one stream; each step
    takes ``batch_size`` random windows of ``seq_len`` tokens and masks ``mask_prob`` of the
    non-special tokens. Runs on one thread; the global RNG state and thread count are restored.
    """
    ids_per_line = tokenizer(lines, truncation=True, max_length=MAX_LEN)["input_ids"]
    stream = torch.tensor([i for ids in ids_per_line for i in ids], dtype=torch.long)
    threads = torch.get_num_threads()
    # same reduction order on any core count; and 128-wide matmuls gain little from more
    torch.set_num_threads(1)
    try:
        return _pretrain_steps(stream)
    finally:
        torch.set_num_threads(threads)


def _pretrain_steps(stream: torch.Tensor) -> torch.nn.Module:
    """The masked-LM loop of :func:`_pretrain` over a LongTensor[n_tokens] stream, seeded, RNG restored."""
    from transformers import BertConfig, BertForMaskedLM

    p = PRETRAIN
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(p["seed"])
        model = BertForMaskedLM(BertConfig(**ENCODER, pad_token_id=0))
        opt = torch.optim.AdamW(model.parameters(), lr=p["lr"])
        for _ in range(p["steps"]):
            starts = torch.randint(0, len(stream) - p["seq_len"], (p["batch_size"],))
            ids = torch.stack([stream[s:s + p["seq_len"]] for s in starts.tolist()])
            masked = (torch.rand(ids.shape) < p["mask_prob"]) & (ids >= len(SPECIAL_TOKENS))
            labels = torch.where(masked, ids, torch.full_like(ids, -100))
            loss = model(input_ids=torch.where(masked, torch.full_like(ids, 3), ids), labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return model.eval()


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' info logs and progress bars inside the block; restore them after."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_tokenizer(directory: str | os.PathLike | None = None) -> Any:
    """The checkpoint's tokenizer (``AutoTokenizer.from_pretrained``), cached per process for the default
    directory."""
    global _tokenizer
    from transformers import AutoTokenizer

    if directory is not None:
        return AutoTokenizer.from_pretrained(directory)
    if _tokenizer is None:
        _tokenizer = AutoTokenizer.from_pretrained(ensure_pretrained())
    return _tokenizer


def load_classifier(directory: str | os.PathLike) -> torch.nn.Module:
    """``BertForSequenceClassification.from_pretrained(directory)`` as this example fine-tunes it.

    Four labels, single-label cross-entropy, dropout 0, SDPA attention; the pooler and the head
    (absent from the masked-LM checkpoint) are initialised with seed 0, the global RNG state restored.
    transformers' load report (which lists exactly those new weights) is silenced.

    Returns:
        The model, fp32, in training mode, on the CPU.
    """
    from transformers import BertForSequenceClassification

    with _quiet_transformers(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = BertForSequenceClassification.from_pretrained(
            directory, num_labels=len(CLASSES), problem_type="single_label_classification",
            id2label=dict(enumerate(CLASSES)), label2id={c: i for i, c in enumerate(CLASSES)},
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    return model.float().train()


def build_model() -> torch.nn.Module:
    """The model to fine-tune: the local pretrained checkpoint (made on first use) with a new 4-class head.

    Returns:
        ``BertForSequenceClassification``, ~0.7M fp32 parameters, training mode, CPU.
    """
    return load_classifier(ensure_pretrained())


def make_batch(step: int, device: torch.device | str, batch_size: int = BATCH_SIZE,
               heldout: bool = False) -> dict[str, torch.Tensor]:
    """``batch_size`` lines, row ``r`` of class ``r % 4``, drawn by a generator seeded with ``step``.

    Returns:
        ``{"input_ids": LongTensor[batch, 64], "attention_mask": LongTensor[batch, 64] (1 = token,
        0 = padding), "labels": LongTensor[batch] in 0..3}``.
    """
    groups = lines_by_class(heldout)
    gen = torch.Generator().manual_seed(step)
    labels = [r % len(CLASSES) for r in range(batch_size)]
    texts = [groups[c][int(torch.randint(len(groups[c]), (1,), generator=gen))] for c in labels]
    enc = load_tokenizer()(texts, padding="max_length", truncation=True, max_length=MAX_LEN,
                           return_tensors="pt", return_token_type_ids=False)
    return {"input_ids": enc["input_ids"].to(device), "attention_mask": enc["attention_mask"].to(device),
            "labels": torch.tensor(labels, dtype=torch.long, device=device)}


def get_batch(step: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """A training batch, deterministic in ``step``.

    Args:
        step: Seeds the choice of lines from the training files.
        device: Where the tensors are placed.

    Returns:
        ``{"input_ids": LongTensor[16, 64], "attention_mask": LongTensor[16, 64], "labels": LongTensor[16]}``.
    """
    return make_batch(step, device)


def get_heldout_batch(step: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """A batch from the held-out files (every 10th); same form as :func:`get_batch`.

    Args:
        step: Seeds the choice of lines. device: Where the tensors are placed.
    """
    return make_batch(step, device, heldout=True)


def evaluate(model: torch.nn.Module, batches: int = 16) -> dict[str, float]:
    """Held-out loss and accuracy of a classifier over ``get_heldout_batch(0..batches-1)``.

    Args:
        model: A ``BertForSequenceClassification`` (e.g. the stock class with an ``autoprec train``
            checkpoint loaded), on the CPU; evaluated in eval mode, without gradients.
        batches: Held-out batches to average over (16 lines each, classes balanced).

    Returns:
        ``{"heldout_loss": mean cross-entropy (nats), "heldout_accuracy": fraction correct}``.
    """
    was_training = model.training
    model.eval()
    loss, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for step in range(batches):
            batch = get_heldout_batch(step, "cpu")
            out = model(**batch)
            loss += float(out.loss)
            correct += int((out.logits.argmax(-1) == batch["labels"]).sum())
            seen += len(batch["labels"])
    model.train(was_training)
    return {"heldout_loss": loss / batches, "heldout_accuracy": correct / seen}


def tokens_per_batch(batch: dict[str, torch.Tensor]) -> int:
    """Real (non-padding) tokens of a batch: ``attention_mask.sum()``.

    The default (``input_ids.numel()``) would count padding, which is ~80% of these batches
    (a median line is ~11 tokens of the 64).
    """
    return int(batch["attention_mask"].sum())
