"""Prompts: loading a dataset (Hub, local file, in-memory), tokenizing it, and drawing batches."""
from __future__ import annotations

import itertools

import json
import os
from collections.abc import Iterator, Sequence

import datasets
import torch

from fastppo.embedded import PROMPTS_PATH
from fastppo.errors import MissingPathError, SettingsError, SettingsTypeError

SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")  # what datasets' save_to_disk writes
DATASET_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


def looks_local(path: str) -> bool:
    """A Hub id is 'name' or 'org/name'; anything else that is not on disk was meant as a local path."""
    return os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1 or "\\" in path


def load_prompt_dataset(name: str, split: str, config_name: str | None = None):
    """The ``split`` of a Hub dataset, a local file or a ``save_to_disk`` directory, as a ``datasets.Dataset``."""
    if os.path.isfile(name):
        ext = os.path.splitext(name)[1].lower()
        if ext not in DATASET_BUILDERS:
            raise SettingsError(f"dataset file {name!r}: unsupported extension {ext!r}; use one of {sorted(DATASET_BUILDERS)}")
        if ext in (".jsonl", ".json"):
            check_json_file(name)
        data = datasets.load_dataset(DATASET_BUILDERS[ext], data_files={split: name})
    elif os.path.isdir(name) and any(os.path.exists(os.path.join(name, f)) for f in SAVED_DATASET_FILES):
        data = datasets.load_from_disk(name)
    elif os.path.isdir(name):
        data = datasets.load_dataset(name, config_name)
    else:
        if looks_local(name):
            raise MissingPathError(f"--dataset_name {name!r}: no such file or directory")
        try:
            data = datasets.load_dataset(name, config_name)
        except Exception as e:
            raise SettingsError(f"could not load dataset {name!r} (not a local path; Hub load failed: {e})") from e
    if isinstance(data, (datasets.DatasetDict, dict)):
        if split not in data:
            raise SettingsError(f"dataset {name!r} has no split {split!r}; splits: {sorted(data.keys())}")
        data = data[split]
    return data


def split_names(name: str, config_name: str | None = None) -> list[str]:
    """The splits a dataset has (a local file: only the one it is loaded as; [] when they cannot be listed)."""
    if os.path.isfile(name):
        return []
    try:
        if os.path.isdir(name) and any(os.path.exists(os.path.join(name, f)) for f in SAVED_DATASET_FILES):
            data = datasets.load_from_disk(name)
            return list(data.keys()) if isinstance(data, datasets.DatasetDict) else []
        return list(datasets.get_dataset_split_names(name, config_name))
    except Exception:  # an unlistable dataset simply has no eval split here
        return []


def check_json_file(path: str) -> None:
    """A JSON (lines) file that ``datasets`` would reject gets an error naming the file and the line."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        raise SettingsError(f"no prompts in {path!r}: the file is empty")
    if path.endswith(".json") and text.lstrip().startswith(("[", "{")):
        try:
            json.loads(text)
            return
        except json.JSONDecodeError:
            if text.lstrip().startswith("["):
                raise
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SettingsError(f"{path}, line {number}: not valid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(row, dict):
                raise SettingsError(f"{path}, line {number}: expected a JSON object per line, got {type(row).__name__}")


def as_dataset(data, what: str = "train_dataset", rows_needed: int | None = None):
    """A ``datasets.Dataset`` from a Dataset, a list of dicts, or an ``IterableDataset`` (a streamed one included):
    its first ``rows_needed`` rows, all of them when that is unset (then it must end)."""
    if isinstance(data, datasets.Dataset):
        return data
    if isinstance(data, datasets.IterableDataset):
        rows = list(itertools.islice(data, rows_needed))
        if not rows:
            raise SettingsError(f"{what} is empty")
        return datasets.Dataset.from_list(rows)
    if isinstance(data, (list, tuple)) and all(isinstance(row, dict) for row in data):
        if not data:
            raise SettingsError(f"{what} is empty")
        return datasets.Dataset.from_list(list(data))
    if isinstance(data, torch.utils.data.Dataset) and hasattr(data, "__len__"):
        return datasets.Dataset.from_list([dict(data[i]) for i in range(len(data))])
    raise SettingsTypeError(f"{what} must be a datasets.Dataset, a list of dicts or a path, got {type(data).__name__}")


VISION_COLUMNS = ("image", "images")  # TRL 1.16 GRPO hands these to a vision-language model with the prompt


def check_text_only(data, what: str) -> None:
    """Refuse a vision-language dataset (an ``image`` or ``images`` column, TRL GRPO's images of each prompt) by
    the column's name: fastppo does not train vision-language models, and would train on the text alone. ``data``:
    a dataset, a stream (its known columns; none read), a list of dicts, a path, or a dict of eval sets by name."""
    if isinstance(data, dict):
        for key, each in data.items():
            check_text_only(each, f"{what}[{key!r}]")
        return
    if isinstance(data, str):
        data = load_prompt_dataset(data, "train")  # as load_prompts reads a path
    if isinstance(data, (datasets.Dataset, datasets.IterableDataset)):
        columns = set(data.column_names or (data.features or {}))
    elif isinstance(data, (list, tuple)):
        columns = {k for row in data if isinstance(row, dict) for k in row}
    else:
        columns = set()
    column = next((c for c in VISION_COLUMNS if c in columns), None)
    if column is not None:
        raise SettingsError(f"{what} has an {column!r} column: a vision-language dataset, and fastppo does not train "
                            "vision-language models yet (it would train on the prompts' text with the images left "
                            f"out); remove the {column!r} column to train on the text alone")


def iterable_rows_needed(dataset, config, what: str) -> int | None:
    """How many rows of an ``IterableDataset`` train set a run reads: at most one per completion of its
    ``max_steps`` steps on every process (a stream has no length, so, as transformers' Trainer, the run needs
    ``max_steps``); the trainer then draws its prompts from those rows as from a map-style dataset. None for
    anything else (an eval set is read whole)."""
    if not isinstance(dataset, datasets.IterableDataset) or what != "train_dataset":
        return None  # an eval set is read whole, as an evaluation reads it
    steps = getattr(config, "max_steps", -1)
    if steps is None or steps <= 0:
        raise SettingsError(f"{what} is an IterableDataset, which has no length: set max_steps (as transformers' "
                            "Trainer asks), and the run reads the rows its steps use")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps * \
        max(getattr(config, "num_mini_batches", 1), 1)
    return steps * per_step * world


def prompt_column(dataset, text_field: str, name: str) -> str:
    """The column to read prompts from: ``text_field``, else pre-tokenized ``input_ids`` (TRL 0.26's format)."""
    if text_field in dataset.column_names:
        return text_field
    if "input_ids" in dataset.column_names:
        return "input_ids"
    raise SettingsError(
        f"dataset {name!r} has no column {text_field!r} (set --dataset_text_field) and no 'input_ids'; "
        f"its columns are {dataset.column_names}"
    )


ANSWER_MASKS = ("completion_mask", "assistant_masks")  # per-token answer flags beside input_ids (1: answer)


def prompt_messages(messages: list[dict]) -> tuple[list[dict], bool]:
    """The prompt of a conversation: its turns before the assistant's answer, and whether one was cut. A row of an
    SFT-style chat set (``messages`` holding the user's turns and the assistant's answers) ends in the answer the
    policy is to write: its trailing assistant turns are dropped, so the prompt ends with the last user (or tool,
    or system) turn, where the chat template's generation prompt goes (TRL GRPO's rule for conversational
    prompts). A conversation that ends in a user turn is the prompt as it is."""
    end = len(messages)
    while end and isinstance(messages[end - 1], dict) and messages[end - 1].get("role") == "assistant":
        end -= 1
    return list(messages[:end]), end < len(messages)


def chat_token_ids(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    """``messages`` through the tokenizer's chat template, as token ids (transformers returns a list, or a
    ``BatchEncoding`` with ``input_ids``, by version)."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)


def tokenize_prompts(dataset, column: str, tokenizer, log=None, what: str = "dataset",
                     chat_template_kwargs: dict | None = None, tools=None) -> list[list[int]]:
    """Token ids of every prompt (empty ones included): token-id lists as they are, chat messages through
    the chat template with its generation prompt, cut before a trailing assistant answer (``prompt_messages``;
    ``log`` gets the number of rows cut, once); token ids with a ``completion_mask`` or ``assistant_masks``
    column likewise keep only the tokens before the answer. Pre-tokenized ids with an ``attention_mask`` column
    (``tokenizer(prompts, padding=True)``) keep only their attended tokens: the padding is not prompt text.
    ``tools`` (``tools.ToolCalling``): chat messages are rendered with the tools shown to the model, and every prompt
    must be a conversation."""
    masks = dataset["attention_mask"] if column == "input_ids" and "attention_mask" in dataset.column_names else None
    # an SFT-tokenized set marks its answer tokens (TRL SFT's completion_mask, transformers' assistant_masks): the
    # prompt is what comes before the first of them
    answer_column = next((c for c in ANSWER_MASKS if c in dataset.column_names), None) if column == "input_ids" else None
    answers = dataset[answer_column] if answer_column is not None else None
    ids = []
    cut = cut_ids = 0
    for row, value in enumerate(dataset[column]):
        mask = masks[row] if masks is not None else None
        if masks is not None and (not isinstance(mask, list) or len(mask) != len(value)):
            raise SettingsError(f"row {row}: attention_mask must be a list as long as input_ids ({len(value)}), "
                                f"got {mask!r}")
        if answers is not None:
            flags = answers[row]
            if not isinstance(flags, list) or len(flags) != len(value):
                raise SettingsError(f"row {row}: {answer_column} must be a list as long as input_ids ({len(value)}), "
                                    f"got {flags!r}")
            first = next((i for i, flag in enumerate(flags) if flag), None)
            if first is not None:
                value, mask, cut_ids = value[:first], None if mask is None else mask[:first], cut_ids + 1
        if mask is not None:
            value = [t for t, keep in zip(value, mask) if keep]
        if isinstance(value, list) and value and isinstance(value[0], dict):
            value, answered = prompt_messages(value)
            cut += answered
            if not value:
                tokens = []
            elif tools is not None:
                tokens = tools.prompt_ids(value)
            else:
                tokens = chat_token_ids(tokenizer, value, add_generation_prompt=True, **(chat_template_kwargs or {}))
        elif tools is not None:
            raise SettingsError(f"{what}: tools need conversational prompts (lists of chat messages: the chat "
                                f"template shows the tools to the model), but row {row} of column {column!r} is "
                                f"{type(value).__name__}")
        elif isinstance(value, list) and all(isinstance(t, int) for t in value):
            tokens = value
        elif isinstance(value, str):
            tokens = tokenizer(value)["input_ids"]
        else:
            raise SettingsError(
                f"column {column!r} must hold strings, chat messages or token ids, got {type(value).__name__}"
            )
        ids.append(list(tokens))
    if cut_ids and log is not None:
        log(f"{what}: {cut_ids} of {len(ids)} row(s) mark answer tokens in {answer_column!r} (an SFT-tokenized set); "
            "their prompts are the tokens before the answer")
    if cut and log is not None:
        log(f"{what}: {cut} of {len(ids)} conversation(s) in column {column!r} end in an assistant turn (an SFT-style "
            "chat set); their prompts are the turns before it, with the chat template's generation prompt")
    return ids


def prompt_batches(num_prompts: int, local_batch_size: int, rank: int, world_size: int,
                   seed: int, shuffle: bool = True) -> Iterator[list[int]]:
    """Endless per-process batches of prompt indices, like DistributedSampler with drop_last.

    Every epoch all processes draw one shared permutation (seeded by ``seed`` and the epoch; the dataset's own
    order when ``shuffle`` is off, TRL GRPO's ``shuffle_dataset=False``) and process ``rank`` takes every
    ``world_size``-th index from ``rank``: disjoint shards of equal size, so every process runs the same number of
    episodes.
    """
    shard = num_prompts // world_size
    if shard == 0:
        raise SettingsError(f"{num_prompts} prompts cannot be shared by {world_size} processes")
    buffer: list[int] = []
    epoch = 0
    while True:
        while len(buffer) < local_batch_size:
            g = torch.Generator().manual_seed(seed + epoch)
            perm = (torch.randperm(num_prompts, generator=g) if shuffle else torch.arange(num_prompts))[
                : shard * world_size]
            buffer.extend(perm[rank::world_size].tolist())
            epoch += 1
        yield buffer[:local_batch_size]
        buffer = buffer[local_batch_size:]


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int, multiple_of: int | None = None):
    """[B, L] ids and attention mask, left-padded (L rounded up to ``multiple_of``)."""
    width = max(len(s) for s in sequences)
    if multiple_of:
        width = -(-width // multiple_of) * multiple_of
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        if len(s):
            ids[i, width - len(s):] = torch.as_tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


def right_pad(sequences: Sequence[torch.Tensor | Sequence[int]], pad_id: int):
    """[B, T] ids and bool mask, right-padded to the longest row (T >= 1)."""
    width = max(1, max(len(s) for s in sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for i, s in enumerate(sequences):
        if len(s):
            ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
            mask[i, : len(s)] = True
    return ids, mask


def load_prompts(dataset, config, tokenizer, what: str = "train_dataset", log=print, tools=None, environments=None):
    """(token ids of every prompt, the dataset): ``dataset`` is a Dataset, a list of dicts, a path (its train
    split), or None for the built-in prompts. Its other columns go to reward
    functions. Empty prompts are dropped and prompts longer than ``max_prompt_length`` keep their last
    tokens; both counts are logged. With ``environments`` (TRL GRPO's ``environment_factory``) a dataset needs no
    prompt column (TRL 1.16's environment-routed rows): each row's prompt is then an empty user message, which its
    environment's ``reset`` writes."""
    if dataset is None or isinstance(dataset, str):  # a path, or None: the built-in prompts
        name = dataset or PROMPTS_PATH
        dataset = load_prompt_dataset(name, "train")
    else:
        name = what
        dataset = as_dataset(dataset, what, iterable_rows_needed(dataset, config, what))
    read, field = dataset, config.dataset_text_field
    if environments is not None and field not in dataset.column_names and "input_ids" not in dataset.column_names:
        # tokenized from a copy: the rows keep only their own columns, which are reset's keywords (as in TRL)
        read = dataset.add_column(field, [[{"role": "user", "content": ""}]] * len(dataset))
    column = prompt_column(read, field, name)
    if len(dataset) == 0:
        raise SettingsError(f"no prompts in dataset {name!r} (it is empty)")
    ids = tokenize_prompts(read, column, tokenizer, log, what, config.chat_template_kwargs, tools)
    vocab = len(tokenizer)
    bad = next(((row, t) for row, prompt in enumerate(ids) for t in prompt
                if not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is not None:  # an id past the vocabulary has no embedding row: caught here, not as an index error mid-run
        raise SettingsError(f"{what} {name!r}: row {bad[0]} of column {column!r} holds token id {bad[1]!r}, outside "
                            f"the tokenizer's vocabulary (0..{vocab - 1}); tokenize the prompts with this tokenizer")
    keep = [i for i, t in enumerate(ids) if t]
    if not keep:
        raise SettingsError(f"no prompts in dataset {name!r}: every row of column {column!r} tokenizes to zero tokens")
    if len(keep) < len(ids):
        log(f"{what}: dropped {len(ids) - len(keep)} empty prompt(s) of {len(ids)}")
        ids, dataset = [ids[i] for i in keep], dataset.select(keep)
    limit = config.max_prompt_length
    if limit is not None:
        long = sum(len(t) > limit for t in ids)
        if long:
            log(f"{what}: {long} of {len(ids)} prompt(s) longer than max_prompt_length={limit} keep their last "
                f"{limit} tokens")
            ids = [t[-limit:] for t in ids]
    return ids, dataset
