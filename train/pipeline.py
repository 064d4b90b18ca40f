"""From a validated config to a trained head: the wiring shared by `python -m specgraft.train` and `specgraft train`.

Order: process group (so each rank knows its device), target, optional
self-distillation (rank 0 writes, the others wait), records, tokenization,
train/held-out split, head, evaluator, `Trainer` (which extracts the offline
feature cache first under ``features: offline``). `run_feature_extraction`
does the same loading for the cache alone.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from specgraft.config import TrainConfig, check_files
from specgraft.model import Target, load_target
from specgraft.train.trainer import DistEnv, Trainer, init_distributed, shutdown_distributed

log = logging.getLogger(__name__)


def run_training(cfg: TrainConfig) -> Path:
    """Train the head ``cfg`` describes and return its exported directory (``output_dir/head``)."""
    from specgraft.heads import build_head
    from specgraft.train import data as data_lib

    check_files(cfg)
    if cfg.training.num_threads:
        torch.set_num_threads(cfg.training.num_threads)
    env = init_distributed()
    try:
        target = _load_target(cfg, env)
        train, heldout = _training_data(cfg, target, env)
        torch.manual_seed(cfg.training.seed)  # the head's initialisation (DeepSpeed then copies rank 0's to all)
        head = build_head(cfg.head, target)
        # EAGLE-3: the most frequent target tokens of the training data (a fine-tune keeps its head's own)
        if hasattr(head, "set_draft_vocab") and cfg.training.init_from is None:
            counts = torch.zeros(target.vocab_size, dtype=torch.long)
            for example in train:  # only tokens the head learns to predict, as EAGLE-3 and SpecForge count
                ids = torch.tensor(example["input_ids"])[torch.tensor(example["loss_mask"]).bool()]
                counts += torch.bincount(ids, minlength=target.vocab_size)
            head.set_draft_vocab(counts, target)
        pad = target.tokenizer.pad_token_id
        pad = pad if pad is not None else 0  # padding is masked out of attention and loss, so any id serves
        trainer = Trainer(
            cfg,
            target=target,
            head=head,
            train_data=train,
            collate=partial(data_lib.collate, pad_token_id=pad),
            evaluate=_evaluator(cfg, target, heldout),
        )
        return trainer.fit()
    finally:
        shutdown_distributed(env)


def run_feature_extraction(cfg: TrainConfig) -> Path:
    """``specgraft extract-features CONFIG``: write the offline feature cache a ``features: offline`` run reads.

    Loads the target and the training split exactly as `run_training` does (regenerating first if the
    config says so), builds the head only to learn which hidden states it reads, and extracts, each rank
    its share of the shards under ``torchrun`` / ``deepspeed`` (resuming an interrupted cache). Returns
    the cache directory (``training.features_dir``).
    """
    from specgraft.heads import build_head
    from specgraft.train.feature_cache import extract_features, features_dir

    check_files(cfg)
    if cfg.training.num_threads:
        torch.set_num_threads(cfg.training.num_threads)
    env = init_distributed()
    try:
        target = _load_target(cfg, env)
        train, _ = _training_data(cfg, target, env)
        hidden_layers = build_head(cfg.head, target).hidden_layers  # the head itself is not needed
        path = features_dir(cfg)
        extract_features(
            cfg, target, train, hidden_layers, path, rank=env.rank, world_size=env.world_size, barrier=dist.barrier
        )
        dist.barrier()
        return path
    finally:
        shutdown_distributed(env)


def _load_target(cfg: TrainConfig, env: DistEnv) -> Target:
    """The frozen target on this rank's device (its GPU under CUDA, else ``target.device``); it must have a tokenizer."""
    device = env.device if env.device.type == "cuda" else cfg.target.device
    target = load_target(
        cfg.target.path, dtype=cfg.target.dtype, device=device, attn_implementation=cfg.target.attn_implementation,
        threads=cfg.training.num_threads or "auto",
    )
    if target.tokenizer is None:
        raise ValueError(f"target.path={cfg.target.path!r} has no tokenizer; training data is text")
    return target


def _training_data(cfg: TrainConfig, target: Target, env: DistEnv) -> tuple[list[dict], list[dict]]:
    """Tokenized (train, held-out) examples, after self-distillation when ``data.regenerate`` is set.

    The train split's order is what the trainer's indices, and the offline feature cache, refer to. With
    ``data.recorded``: the recorded generations (the held-out split drawn from them) and ``data.original_share``
    of the mix from the original data (`specgraft.train.mix`).
    """
    from specgraft.train import data as data_lib

    if cfg.data.recorded:
        return _recorded_data(cfg, target, env)
    source = _regenerate(cfg, target, env) if cfg.data.regenerate is not None else cfg.data.train
    records = data_lib.load_records(source, format=cfg.data.format, on_error=cfg.data.on_error)
    dataset = data_lib.TokenizedDataset(records, target.tokenizer, cfg.data.max_length)
    train, heldout = data_lib.train_eval_split(dataset.examples, cfg.data.eval_fraction, seed=cfg.training.seed)
    train = data_lib.subsample(train, cfg.data.train_fraction, seed=cfg.training.seed)
    if env.is_main:
        log.info(
            "%d training and %d held-out sequences from %s (%d without trained tokens dropped; train_fraction %g)",
            len(train), len(heldout), source, dataset.dropped, cfg.data.train_fraction,
        )
    return train, heldout


def _recorded_data(cfg: TrainConfig, target: Target, env: DistEnv) -> tuple[list[dict], list[dict]]:
    """The recorded generations, split (train, held-out), and the original data's share beside their train split."""
    from specgraft.train.mix import open_recordings, recorded_examples, split_recorded, with_original_share

    recorded = recorded_examples(open_recordings(cfg.data.recorded), cfg.data.max_length)
    train, heldout = split_recorded(recorded, cfg.data.eval_fraction)
    original = []
    if cfg.data.original_share > 0 and (cfg.data.train is not None or cfg.data.regenerate is not None):
        rest = cfg.data.model_copy(update={"recorded": []})
        original, _ = _training_data(cfg.model_copy(update={"data": rest}), target, env)
    mixed = with_original_share(train, original, cfg.data.original_share, seed=cfg.training.seed)
    if env.is_main:
        log.info("%d recorded generations from %s (%d held out), with %d of %d original examples (original_share %g)",
                 len(recorded), ", ".join(cfg.data.recorded), len(heldout), len(mixed) - len(train), len(original),
                 cfg.data.original_share)
    return mixed, heldout


def run_regeneration(cfg: TrainConfig) -> str:
    """``specgraft regenerate CONFIG``: only the self-distillation step of a training config."""
    if cfg.data.regenerate is None:
        raise ValueError("the config has no data.regenerate section: nothing to regenerate")
    check_files(cfg)
    if cfg.training.num_threads:
        torch.set_num_threads(cfg.training.num_threads)
    env = init_distributed()
    try:
        if cfg.data.regenerate.endpoint:  # the server runs the model: its tokenizer and config are all we need
            target = tokenizer_only_target(cfg.target.path)
        else:
            target = _load_target(cfg, env)  # each rank's own GPU under torchrun
        return _regenerate(cfg, target, env)
    finally:
        shutdown_distributed(env)


def _regenerate(cfg: TrainConfig, target: Target, env: DistEnv) -> str:
    """Every rank writes its slice of the self-distilled data (or completes it), rank 0 merges the slices,
    and every rank then trains on the whole (a single process writes the output directly)."""
    from specgraft.train import data as data_lib
    from specgraft.train.evaluate import read_prompts
    from specgraft.train.heldout import HeldOut
    from specgraft.train.regeneration import merge_shards, regenerate

    regen = cfg.data.regenerate
    prompt_source = regen.prompts or cfg.data.train
    inputs = data_lib.load_records(prompt_source, on_error=cfg.data.on_error) if prompt_source else []
    eval_prompts = read_prompts(cfg.eval.prompts) if cfg.eval.prompts else []
    summary = regenerate(
        target,
        inputs,
        regen.output,
        max_new_tokens=regen.max_new_tokens,
        temperature=regen.temperature,
        batch_size=regen.batch_size,
        max_len=regen.max_len,
        seed=regen.seed,
        num_from_bos=regen.num_from_bos,
        self_instruct=regen.self_instruct,
        self_instruct_max_tokens=regen.self_instruct_max_tokens,
        min_user_tokens=regen.min_user_tokens,
        max_user_tokens=regen.max_user_tokens,
        dedupe=regen.dedupe,
        max_prompts=regen.max_prompts,
        held_out=HeldOut(eval_prompts, f"eval.prompts ({cfg.eval.prompts})"),
        endpoint=_endpoint(regen, target),
        concurrency=regen.concurrency,
        rank=env.rank,
        world_size=env.world_size,
        progress=env.is_main,
    )
    log.info(
        "rank %d: regenerated %d records into %s (%d already there; %d duplicates and %d outside the length "
        "limits left out; %d without room in the context)",
        env.rank, summary.written, regen.output, summary.skipped, summary.duplicates, summary.filtered,
        summary.too_long,
    )
    dist.barrier()
    if env.is_main and env.world_size > 1:
        merged = merge_shards(regen.output, env.world_size, summary.job_ids, dedupe=regen.dedupe)
        log.info("merged %d records of %d ranks into %s", merged, env.world_size, regen.output)
    dist.barrier()
    return regen.output


def _endpoint(regen, target: Target):
    """The OpenAI-compatible client ``data.regenerate.endpoint`` names, or None to generate in process."""
    if not regen.endpoint:
        return None
    from specgraft.train.endpoint import EndpointClient, api_key_from

    return EndpointClient(
        regen.endpoint, target.tokenizer, model=regen.model, api_key=api_key_from(regen.api_key_env),
        timeout_s=regen.request_timeout_s, max_retries=regen.max_retries,
    )


def tokenizer_only_target(path: str) -> Target:
    """A `Target` whose model is a shell on the meta device: the tokenizer, context length and stop ids of
    ``path`` without loading (or allocating) its weights, for regeneration through an endpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    local = Path(path).expanduser()
    source = str(local) if local.exists() else path
    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    try:
        model.generation_config = GenerationConfig.from_pretrained(source)
    except OSError:  # no generation_config.json: the config's own eos_token_id serves
        pass
    return Target(model, AutoTokenizer.from_pretrained(source), name=path, fast=False)


def _evaluator(cfg: TrainConfig, target: Target, heldout: list[dict]):
    """Per-depth accuracy on the held-out split and tau on ``eval.prompts``; None when there is neither."""
    prompts_file = cfg.eval.prompts
    if prompts_file is None and not heldout:
        return None
    from specgraft.train.evaluate import make_head_evaluator, read_prompts

    prompts = read_prompts(prompts_file, cfg.eval.num_prompts) if prompts_file else []
    return make_head_evaluator(
        target,
        prompts=prompts,
        heldout=[example["input_ids"] for example in heldout],
        tree=cfg.tree,
        max_new_tokens=cfg.eval.max_new_tokens,
    )
