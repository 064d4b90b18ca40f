"""The training loop: a frozen target, one trainable head, DeepSpeed around the head only.

Shaped like a torchtune recipe: `Trainer.setup` builds everything (process
group, DeepSpeed engine, data order, tracking, resume), `Trainer.train` is
the one visible loop, `save_checkpoint` and `export` write results, and
`cleanup` tears down. Heads plug in through their ``loss``; they never fork
the loop.

One loop serves every launch:

    python -m specgraft.train CONFIG.yaml                   # one plain process (a world of one)
    deepspeed --num_gpus 8 --module specgraft.train CONFIG.yaml
    torchrun --nproc_per_node 8 -m specgraft.train CONFIG.yaml

Each rank runs the frozen target on its own shard of every batch (online
features), or reads its rows of the offline feature cache, so the target is
replicated, never wrapped; DeepSpeed averages the head's gradients across ranks.

Checkpoints (``output_dir/checkpoints/step_XXXXXXXX``) hold DeepSpeed's
module, optimizer and scheduler states, every rank's RNG state and the step;
the data position follows from the step, because the data order is a pure
function of (seed, epoch). DeepSpeed writes into ``checkpoints/.partial``
and rank 0 renames the finished directory into place, so any ``step_*``
directory is complete. Several nodes need a shared ``output_dir``.

The last step's head is exported to ``output_dir/head``. Every evaluation
that reports ``simulated_tau`` (the held-out split's, see
`specgraft.train.evaluate`) and beats the earlier ones also saves the head
to ``output_dir/best``, with ``best.json`` naming its step and value: a head
that overfits late is not lost.

With ``training.init_from`` a fresh run starts from a trained head's weights
and evaluates that head before the first step (as step 0), so
``output_dir/best`` keeps it unless fine-tuning beats it; a closing line
says which head was kept.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import shutil
import socket
import time
import uuid
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler

from specgraft.config import TrainConfig, dump_config, to_deepspeed_config
from specgraft.heads.base import TrainableHead, TrainBatch, uses_target_logits
from specgraft.heads.checkpoint import save_head
from specgraft.heads.loading import load_head_weights
from specgraft.model import Target
from specgraft.progress import progress_bar
from specgraft.train.feature_cache import FeatureCache, extract_features, features_dir
from specgraft.train.features import target_batch
from specgraft.train.mix import RECORDED, MixedFeatures, recorded_features

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
PARTIAL = ".partial"  # DeepSpeed writes a checkpoint here; only a finished one is renamed out
STEP_DIR = re.compile(r"step_(\d+)")
STATE_FILE = "trainer_state.json"
BEST = "best"  # output_dir/best: the head with the highest BEST_METRIC of any evaluation
BEST_METRIC = "simulated_tau"
BEST_FILE = "best.json"  # in best/: the step and value it was chosen at
METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id"
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

Collate = Callable[[list[dict]], Mapping[str, torch.Tensor]]
Evaluate = Callable[[nn.Module], Mapping[str, float]]


# ---------------------------------------------------------------------------- processes


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, and what `init_distributed` changed so `shutdown_distributed` can undo it."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    created_group: bool  # this call created the process group (so its owner destroys it)
    set_env: tuple[str, ...]  # environment variables it set (plain single process)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> DistEnv:
    """Join the job's process group, creating a world of one when no launcher set one up.

    ``deepspeed`` and ``torchrun`` export RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT; a plain ``python -m specgraft.train`` has none,
    so they are set here (a free local port) and removed again on shutdown.
    The backend is DeepSpeed's choice: nccl on CUDA, gloo on CPU.
    """
    import deepspeed

    set_env: list[str] = []
    created = not dist.is_initialized()
    if created and "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        plain = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        plain["MASTER_PORT"] = os.environ.get("MASTER_PORT") or str(_free_port())
        for key, value in plain.items():
            if key not in os.environ:
                os.environ[key] = value
                set_env.append(key)
    cuda = torch.cuda.is_available()
    if not cuda:
        # DeepSpeed's shared-memory CPU allreduce is a C++ op JIT-built on first use (~45 s here);
        # a head's gradients are small, so plain gloo is as good.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if created:
        deepspeed.init_distributed(verbose=False)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return DistEnv(dist.get_rank(), local_rank, dist.get_world_size(), device, created, tuple(set_env))


def shutdown_distributed(env: DistEnv) -> None:
    """Destroy the process group if ``env`` created it, and unset what it set."""
    if env.created_group and dist.is_initialized():
        import deepspeed.comm

        deepspeed.comm.destroy_process_group()
    for key in env.set_env:
        os.environ.pop(key, None)


# ---------------------------------------------------------------------------- schedule


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based).

    Linear warmup from 1/(W+1) to 1 over W steps (never 0: a step at lr 0 is
    wasted), then cosine or linear decay towards 0 over the remaining steps,
    or constant.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    if schedule == "constant":
        return 1.0
    raise ValueError(f"training.schedule={schedule!r}: expected cosine, linear or constant")


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The highest-step complete checkpoint under ``output_dir/checkpoints``, or None."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and (p / STATE_FILE).is_file()]
    return max(done, key=lambda p: int(STEP_DIR.fullmatch(p.name).group(1)), default=None)


# ---------------------------------------------------------------------------- the recipe


class Trainer:
    """Fits one head on one frozen target.

    Args:
        cfg: the validated run config (training, tracking and head sections are read here).
        target: the frozen target; it is run under no_grad and never handed to DeepSpeed.
        head: a `TrainableHead` module on the target's device (built by the caller,
            so tests can pass toy heads).
        train_data: indexable examples, each a dict with ``input_ids`` and ``loss_mask`` lists.
        collate: list of examples -> dict of (B, T) tensors ``input_ids``, ``attention_mask``,
            ``loss_mask`` (e.g. ``partial(specgraft.train.data.collate, pad_token_id=...)``).
        evaluate: optional ``evaluate(head) -> metrics``, run on rank 0 every
            ``training.eval_every`` steps and at the end, logged as ``eval/<name>``.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        target: Target,
        head: nn.Module,
        train_data: Sequence[dict],
        collate: Collate,
        evaluate: Evaluate | None = None,
    ) -> None:
        missing = [name for name in ("config", "hidden_layers", "loss") if not hasattr(head, name)]
        if missing or not isinstance(head, TrainableHead):
            raise TypeError(
                f"{type(head).__name__} is not a trainable head: it lacks {', '.join(missing)} "
                "(see specgraft.heads.base.TrainableHead)"
            )
        if len(train_data) == 0:
            raise ValueError("train_data is empty: nothing to train on")
        self.cfg = cfg
        self.target = target
        self.head = head
        self.train_data = train_data
        self.collate = collate
        self.evaluate = evaluate
        self.output_dir = Path(cfg.training.output_dir)
        self.step = 0  # optimizer steps done
        self.history: list[dict[str, float]] = []  # rank 0's logged records
        self.best: dict[str, float] | None = None  # rank 0: {"step", BEST_METRIC} of the head in output_dir/best
        self.final_metrics: dict[str, float] = {}
        self.env: DistEnv | None = None
        self._wandb = None
        self._progress = None

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Process group, data order, step budget, DeepSpeed engine, tracking, and resume."""
        import deepspeed

        t = self.cfg.training
        if t.num_threads:
            torch.set_num_threads(t.num_threads)
        self.env = init_distributed()
        ds_config = to_deepspeed_config(self.cfg, self.env.world_size)
        # The JSON override may change these two; the loop must follow DeepSpeed's values.
        self.micro_batch_size = int(ds_config["train_micro_batch_size_per_gpu"])
        self.accumulation = int(ds_config["gradient_accumulation_steps"])

        # Every rank sees a disjoint 1/world of each epoch, in an order fixed by (seed, epoch).
        self.sampler = DistributedSampler(
            self.train_data, num_replicas=self.env.world_size, rank=self.env.rank, shuffle=True, seed=t.seed
        )
        self.batches_per_epoch = math.ceil(len(self.sampler) / self.micro_batch_size)
        self.total_steps = (t.epochs * self.batches_per_epoch) // self.accumulation
        if t.max_steps is not None:
            self.total_steps = min(self.total_steps, t.max_steps)
        if self.total_steps == 0:
            raise ValueError(
                f"{len(self.train_data)} examples over {self.env.world_size} ranks give {self.batches_per_epoch} "
                f"micro-batches per epoch: fewer than training.gradient_accumulation_steps={self.accumulation} "
                f"x training.epochs={t.epochs} allow for one optimizer step"
            )
        warmup_steps = round(t.warmup_ratio * self.total_steps)
        schedule = partial(lr_factor, schedule=t.schedule, warmup_steps=warmup_steps, total_steps=self.total_steps)

        # Per-rank seeds: ranks draw different training noise, reproducibly.
        torch.manual_seed(t.seed + self.env.rank)
        random.seed(t.seed + self.env.rank)
        checkpoint = self._checkpoint_to_resume()
        if t.init_from is not None:
            self._start_from_head(checkpoint)  # before DeepSpeed copies the weights (bf16 keeps fp32 masters)
        params = [p for p in self.head.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"{type(self.head).__name__} has no trainable parameters")
        self.engine, _, _, _ = deepspeed.initialize(
            model=self.head,
            model_parameters=params,
            config=ds_config,
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
        )
        self.head = self.engine.module  # the same module, moved and cast by DeepSpeed

        self._features = self._feature_source()
        self._prepare_output()
        if checkpoint is not None:
            self._load_checkpoint(checkpoint)
        if self.env.is_main:
            self._truncate_metrics()
            self._start_tracking()

    def _feature_source(self) -> Callable[[Sequence[int], Mapping[str, torch.Tensor]], TrainBatch]:
        """Where each batch's target states come from: the target's forward (online), the offline cache, and for
        recorded generations (``data.recorded``) the states the server recorded."""
        logits = uses_target_logits(self.head)
        recorded = [e for e in self.train_data if RECORDED in e]
        original = [e for e in self.train_data if RECORDED not in e] if recorded else self.train_data
        if self.cfg.training.features == "offline" and original:
            source = self._feature_cache(original).batch
        else:
            def source(indices, batch):
                return target_batch(self.target, batch, self.head.hidden_layers, logits)
        if not recorded:
            return source
        recordings = recorded_features(self.target, self.head.hidden_layers, logits)
        return MixedFeatures(self.train_data, recordings, source).batch

    def _feature_cache(self, examples: Sequence[Mapping[str, Any]]) -> FeatureCache:
        """Every rank extracts its share of the offline feature cache's shards (or of those an interrupted
        extraction left), then reads the whole cache."""
        path = features_dir(self.cfg)
        extract_features(
            self.cfg, self.target, examples, self.head.hidden_layers, path,
            rank=self.env.rank, world_size=self.env.world_size, barrier=dist.barrier,
        )
        dist.barrier()
        return FeatureCache(
            path, self.target, self.head.hidden_layers, examples=examples, logits=uses_target_logits(self.head)
        )

    def _start_from_head(self, checkpoint: Path | None) -> None:
        """Load ``training.init_from``'s weights into the head, unless a checkpoint to resume holds newer ones."""
        init_from = self.cfg.training.init_from
        if checkpoint is not None:
            if self.env.is_main:
                log.warning(
                    "training.init_from=%s is not loaded: training.resume=%s continues from %s (a new "
                    "training.output_dir, or training.resume=never, starts from the head)",
                    init_from, self.cfg.training.resume, checkpoint,
                )
            return
        load_head_weights(self.head, init_from, self.target, where=f"training.init_from={init_from!r}")
        if self.env.is_main:
            log.info("starting from the head in %s (training.init_from)", init_from)

    def _prepare_output(self) -> None:
        if self.env.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            if self.cfg.training.resume == "never" and (self.output_dir / CHECKPOINTS).exists():
                # Starting over: an old run's later checkpoints would otherwise win the next resume=auto.
                log.warning("training.resume=never: removing earlier checkpoints in %s", self.output_dir / CHECKPOINTS)
                shutil.rmtree(self.output_dir / CHECKPOINTS)
            best = self.output_dir / BEST
            if not best.exists() and best.with_name(BEST + ".old").exists():  # a crash between the swap's renames
                os.replace(best.with_name(BEST + ".old"), best)
            if self.cfg.training.resume == "never":
                shutil.rmtree(best, ignore_errors=True)  # an old run's best would outrank this run's
            elif (best / BEST_FILE).is_file():
                self.best = json.loads((best / BEST_FILE).read_text())
            (self.output_dir / "config.yaml").write_text(dump_config(self.cfg))
        dist.barrier()

    def _checkpoint_to_resume(self) -> Path | None:
        resume = self.cfg.training.resume
        if resume == "never":
            return None
        if resume == "auto":
            return latest_checkpoint(self.output_dir)
        return Path(resume)

    def _load_checkpoint(self, path: Path) -> None:
        state_file = path / STATE_FILE
        if not state_file.is_file():
            raise FileNotFoundError(f"training.resume: {path} is not a complete checkpoint ({STATE_FILE} is missing)")
        state = json.loads(state_file.read_text())
        now = {
            "world_size": self.env.world_size,
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.accumulation,
        }
        for key, value in now.items():
            if state[key] != value:
                raise ValueError(
                    f"checkpoint {path} was written with {key}={state[key]}, this run has {key}={value}; "
                    "an exact resume needs the same data layout (set training.resume=never to start over)"
                )
        loaded, _ = self.engine.load_checkpoint(str(path.parent), tag=path.name)
        if loaded is None:
            raise FileNotFoundError(f"DeepSpeed found no loadable checkpoint in {path}")
        rng_file = path / f"rng_rank{self.env.rank}.pt"
        _set_rng_state(torch.load(rng_file, weights_only=True))
        self.step = int(state["step"])
        if self.env.is_main:
            log.info("resumed from %s at step %d", path, self.step)

    def _truncate_metrics(self) -> None:
        """Keep the records up to the starting step: an interrupted run's later ones are logged again (a fresh run keeps none)."""
        path = self.output_dir / METRICS_FILE
        if path.is_file():
            lines = path.read_text().splitlines() if self.step else []  # a fresh run's initial head logs step 0 again
            kept = [line for line in lines if line and json.loads(line)["step"] <= self.step]
            self.history = [json.loads(line) for line in kept]
            path.write_text("".join(line + "\n" for line in kept))

    def _start_tracking(self) -> None:
        tracking = self.cfg.tracking
        if tracking.wandb == "disabled":
            return
        import wandb

        # One wandb run per output_dir: a resumed job continues the same run.
        id_file = self.output_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        wandb_dir = Path(tracking.dir or self.output_dir)
        wandb_dir.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb.init(
            project=tracking.project,
            name=tracking.run_name,
            dir=str(wandb_dir),
            id=run_id,
            resume="allow",
            mode=tracking.wandb,
            config=self.cfg.model_dump(mode="json"),
            settings=wandb.Settings(quiet=True, console="off"),
        )

    # ------------------------------------------------------------------ the loop

    def train(self) -> dict[str, float]:
        """Run optimizer steps until the step budget; return the final metrics."""
        t = self.cfg.training
        self.head.train()
        self._progress = progress_bar(
            total=self.total_steps, initial=self.step, desc="train", unit="step", enabled=self.env.is_main
        )
        if self.step == 0 and t.init_from is not None and self.evaluate is not None:
            self._run_evaluation()  # the initial head, as step 0: output_dir/best keeps it unless fine-tuning beats it
        consumed = self.step * self.accumulation  # micro-batches this rank has trained on
        window: list[float] = []
        window_metrics: dict[str, list[float]] = defaultdict(list)
        started = time.perf_counter()
        while self.step < self.total_steps:
            epoch, skip = divmod(consumed, self.batches_per_epoch)
            for indices, batch in self._batches(epoch, skip):
                features = self._features(indices, batch)
                with self._autocast():
                    # The head's entry point is `loss`, not forward; calling it on the module is what
                    # engine.forward would do for ZeRO 0-2 (stage 3 would need its parameter gathering).
                    loss, metrics = self.engine.module.loss(features)
                self.engine.backward(loss)  # scales by 1/accumulation
                lr = self.engine.get_lr()[0]  # the lr this step uses (the schedule advances inside engine.step)
                self.engine.step()  # at an accumulation boundary: clip, optimizer step, lr schedule, zero grads
                consumed += 1
                window.append(loss.item())
                for name, value in metrics.items():
                    window_metrics[name].append(float(value))
                if consumed % self.accumulation:
                    continue
                self.step += 1
                self._progress.update(1)
                if self.step % t.log_every == 0 or self.step == self.total_steps:
                    self._log_train(window, window_metrics, lr=lr, epoch=consumed / self.batches_per_epoch)
                    window, window_metrics = [], defaultdict(list)
                evaluate_now = self.evaluate is not None and t.eval_every and self.step % t.eval_every == 0
                if evaluate_now and self.step < self.total_steps:  # the last step's evaluation follows the loop
                    self._run_evaluation()
                if t.save_every and self.step % t.save_every == 0:
                    self.save_checkpoint()
                if self.step >= self.total_steps:
                    break
        self._progress.close()
        if self.evaluate is not None:
            self._run_evaluation()
        self.final_metrics = {}
        for record in self.history:  # the latest value of every logged name: train loss, lr, eval metrics
            self.final_metrics.update(record)
        self.final_metrics["train_seconds"] = round(time.perf_counter() - started, 1)
        kept = self._kept_head() if self.env.is_main else None
        if kept is not None:
            self._progress.write(kept)
        return self.final_metrics

    def _batches(self, epoch: int, skip: int) -> Iterator[tuple[list[int], Mapping[str, torch.Tensor]]]:
        """This rank's micro-batches of ``epoch`` (dataset indices, collated tensors), after the first ``skip``.

        Indexed by hand rather than through a DataLoader: a DataLoader draws a
        seed from the global RNG for every iterator it makes, which would give
        a resumed run a different random stream from an uninterrupted one.
        """
        self.sampler.set_epoch(epoch)
        indices = list(self.sampler)[skip * self.micro_batch_size :]
        for start in range(0, len(indices), self.micro_batch_size):
            chunk = indices[start : start + self.micro_batch_size]
            yield chunk, self.collate([self.train_data[i] for i in chunk])

    def _autocast(self):
        """bf16 runs the head under autocast (loss and evaluation), so fp32 target features and heads
        that upcast their inputs still meet bf16 weights."""
        if self.cfg.training.precision == "bf16":
            return torch.autocast(device_type=self.env.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _log_train(
        self, window: list[float], window_metrics: Mapping[str, list[float]], *, lr: float, epoch: float
    ) -> None:
        """Mean loss over the window across all ranks; the head's own metrics are rank 0's."""
        total = torch.tensor([sum(window), len(window)], dtype=torch.float64, device=self.env.device)
        dist.all_reduce(total)  # every rank reaches every log step, so this collective always matches
        if not self.env.is_main:
            return
        record: dict[str, float] = {
            "step": self.step,
            "epoch": round(epoch, 4),
            "loss": float(total[0] / total[1]),
            "lr": float(lr),
        }
        record.update({f"train/{k}": sum(v) / len(v) for k, v in window_metrics.items() if k != "loss"})
        self._record(record)
        self._progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")

    def _record(self, record: dict[str, float]) -> None:
        self.history.append(record)
        with (self.output_dir / METRICS_FILE).open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def _run_evaluation(self) -> None:
        """Rank 0 evaluates with its own random stream (training's is untouched); the others wait."""
        if self.env.is_main:
            self.head.eval()
            devices = [self.env.device.index] if self.env.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices), self._autocast():
                metrics = dict(self.evaluate(self.head))
            self.head.train()
            self._record({"step": self.step, **{f"eval/{k}": float(v) for k, v in metrics.items()}})
            name = f"step {self.step}" if self.step else "the initial head (step 0)"
            self._progress.write(f"{name}: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
            self._keep_best(metrics)
        dist.barrier()

    def _kept_head(self) -> str | None:
        """After a fine-tune (rank 0): which head ``output_dir/best`` holds, the initial one or a step's, with the
        initial head's BEST_METRIC and fine-tuning's best; None unless both were evaluated."""
        key = f"eval/{BEST_METRIC}"
        initial = next((r[key] for r in self.history if r["step"] == 0 and key in r), None)
        tuned = [(r[key], r["step"]) for r in self.history if r["step"] > 0 and key in r]
        if initial is None or not tuned or self.best is None:
            return None
        value, step = max(tuned, key=lambda vs: (vs[0], -vs[1]))  # the earliest of equal values, as _keep_best keeps
        where = f"{self.output_dir / BEST}"
        source = f"the initial head (training.init_from={self.cfg.training.init_from})"
        if self.best["step"] == 0:
            return (f"kept {source} in {where}: {BEST_METRIC} {initial:.4g}; fine-tuning's best, at step {step}, "
                    f"was {value:.4g}")
        return (f"kept step {self.best['step']} in {where}: {BEST_METRIC} {self.best[BEST_METRIC]:.4g}; "
                f"{source} had {initial:.4g}")

    def _keep_best(self, metrics: Mapping[str, float]) -> None:
        """Save the head to ``output_dir/best`` when this evaluation's BEST_METRIC beats every earlier one.

        The new directory is written aside and swapped in by renames, so a crash leaves one whole best head.
        """
        value = metrics.get(BEST_METRIC)
        if value is None or (self.best is not None and float(value) <= self.best[BEST_METRIC]):
            return
        self.best = {"step": self.step, BEST_METRIC: float(value)}
        best = self.output_dir / BEST
        partial_dir, old = best.with_name(BEST + ".partial"), best.with_name(BEST + ".old")
        shutil.rmtree(partial_dir, ignore_errors=True)
        save_head(self.head, partial_dir, self.target, self._card({f"eval/{k}": v for k, v in metrics.items()}))
        (partial_dir / BEST_FILE).write_text(json.dumps(self.best) + "\n")
        shutil.rmtree(old, ignore_errors=True)
        if best.exists():
            os.replace(best, old)
        os.replace(partial_dir, best)
        shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ outputs

    def save_checkpoint(self) -> Path:
        """Write a resumable checkpoint of this step; complete once renamed to ``checkpoints/step_N``."""
        root = self.output_dir / CHECKPOINTS
        tag = f"step_{self.step:08d}"
        partial_dir, final = root / PARTIAL / tag, root / tag
        if self.env.is_main:
            shutil.rmtree(partial_dir, ignore_errors=True)
            partial_dir.parent.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        self.engine.save_checkpoint(str(partial_dir.parent), tag=tag, save_latest=False)
        torch.save(_rng_state(), partial_dir / f"rng_rank{self.env.rank}.pt")
        dist.barrier()
        if self.env.is_main:
            state = {
                "step": self.step,
                "total_steps": self.total_steps,
                "world_size": self.env.world_size,
                "micro_batch_size": self.micro_batch_size,
                "gradient_accumulation_steps": self.accumulation,
            }
            (partial_dir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
            if final.exists():  # the same step from an earlier attempt
                shutil.rmtree(final)
            os.replace(partial_dir, final)
        dist.barrier()
        return final

    def export(self) -> Path:
        """Rank 0 writes the trained head to ``output_dir/head`` with a model card of config and final metrics."""
        out = self.output_dir / "head"
        if self.env.is_main:
            save_head(self.head, out, self.target, self._card(self.final_metrics))
            (self.output_dir / "final_metrics.json").write_text(json.dumps(self.final_metrics, indent=2) + "\n")
        dist.barrier()
        return out

    def _card(self, metrics: Mapping[str, float]) -> str:
        rows = "\n".join(f"| {k} | {v:.4g} |" for k, v in metrics.items())
        batch = self.micro_batch_size * self.accumulation * self.env.world_size
        init_from = self.cfg.training.init_from
        start = f"From the head in `{init_from}` (training.init_from): " if init_from else ""
        return (
            f"## Training\n\n{start}{self.step} optimizer steps of {batch} sequences "
            f"({self.env.world_size} rank(s) x {self.micro_batch_size} x {self.accumulation} accumulation), "
            f"{self.cfg.training.precision}, ZeRO stage {self.cfg.training.zero_stage}.\n\n"
            f"| metric | value |\n|---|---|\n{rows}\n\n"
            f"### Config\n\n```yaml\n{dump_config(self.cfg)}```\n"
        )

    def cleanup(self) -> None:
        """Finish tracking and leave the process group as it was found."""
        if self._progress is not None:
            self._progress.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self.env is not None:
            shutdown_distributed(self.env)
            self.env = None

    def fit(self) -> Path:
        """setup, train, export, cleanup; returns the exported head directory."""
        try:
            self.setup()
            self.train()
            return self.export()
        finally:
            self.cleanup()
