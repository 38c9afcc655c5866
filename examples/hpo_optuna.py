"""Hyper-parameter search with Optuna over one packed dataset, shared by every trial.

    python examples/hpo_optuna.py --data s3://bucket/ecg/ --trials 20 --steps 2000 --holdout 64
    python examples/hpo_optuna.py --data s3://bucket/ecg/ --split-by key --trials 20   # split by sequence

Each trial builds its own WindowDataset over the *same* shards: a dataset is only a URL plus a
window spec and a seed, so a trial costs no copy, no re-pack and no per-trial index. Each trial
has its own ``seed`` and therefore its own shuffling (and the window length is one of the
searched parameters: another window spec over the same bytes).

Validation never sees training data:

* ``--holdout N`` (the default, the forecasting convention): training windows lie in the first
  T - 2N steps of every sequence; validation windows forecast steps [T - 2N, T - N) (the last N
  are the test split's)
  (``split="train"/"val", holdout=N``).
* ``--split-by key``: whole sequences go to train or val by a stable hash of their key
  (``split_fractions``, ``split_seed``); the split does not depend on the trial's seed.

Trials run one after the other in this process (pruned early by a median rule when their
validation loss lags). To spread trials over machines, give every process the same
``--storage`` (e.g. ``sqlite:///hpo.db`` on a shared disk, or a database URL) and ``--study``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import optuna
import torch

import streamwin as sw

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_ddp import Forecaster, features_of, forecast_loss  # noqa: E402  (the model of the DDP example)

log = logging.getLogger("hpo_optuna")
CPU = torch.device("cpu")


def datasets(args: argparse.Namespace, window: int, seed: int) -> tuple[sw.WindowDataset, sw.WindowDataset]:
    """(train, val) views of the same shards for one trial: no copy, only a window spec and a seed."""
    if args.split_by == "holdout":
        split = dict(holdout=args.holdout)
    else:
        split = dict(split_fractions=(1 - args.val_fraction, args.val_fraction, 0.0), split_seed=args.split_seed)
    common = dict(horizon=args.horizon, batch_size=args.batch_size, rank=0, world_size=1)
    train = sw.WindowDataset(args.data, window=window, stride=max(1, window // 2), seed=seed,
                             shuffle_buffer=args.shuffle_buffer, select=sw.Select(split="train", **split), **common)
    # validation: every window once (equalize="pad" marks the filler with weight 0), in a fixed order
    val = sw.WindowDataset(args.data, window=window, stride=args.horizon, order=sw.Order(shuffle=False, equalize="pad"),
                           select=sw.Select(split="val", **split), **common)
    return train, val


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: sw.WindowLoader) -> float:
    model.eval()
    total = count = 0.0
    for batch in loader:
        w = batch["weight"].float() if "weight" in batch else torch.ones(len(batch["key"]))
        loss = forecast_loss(model, batch, CPU)  # weighted mean over the batch
        total += loss.item() * w.sum().item()
        count += w.sum().item()
    model.train()
    return total / max(count, 1.0)


def prune(trial: optuna.Trial, why: str) -> None:
    """Prune ``trial``, saying why (in the log, in the summary table and in the study's records)."""
    trial.set_user_attr("pruned", why)
    log.info("trial %d pruned: %s", trial.number, why)
    raise optuna.TrialPruned(why)


def lagging(trial: optuna.Trial, step: int, value: float) -> str:
    """Why the median rule prunes ``trial`` at ``step``: its value against the earlier trials' median there."""
    done = [t.intermediate_values[step] for t in trial.study.trials
            if t.state == optuna.trial.TrialState.COMPLETE and step in t.intermediate_values]
    median = f"{sorted(done)[len(done) // 2]:.4f}" if done else "?"
    return (f"val loss {value:.4f} at step {step} is worse than the median {median} of the {len(done)} completed "
            "trials at that step (MedianPruner)")


def objective(trial: optuna.Trial, args: argparse.Namespace) -> float:
    lr = trial.suggest_float("lr", 1e-4, 1e-2, log=True)
    hidden = trial.suggest_categorical("hidden", [32, 64, 128])
    window = trial.suggest_categorical("window", args.windows)
    seed = args.seed + trial.number  # its own seed, so its own order of windows
    trial.set_user_attr("seed", seed)

    train, val = datasets(args, window, seed)
    if len(train) == 0 or len(val) == 0:
        held = f"holdout {args.holdout}: val windows end in each sequence's last {2 * args.holdout} steps" \
            if args.split_by == "holdout" else f"val fraction {args.val_fraction}"
        prune(trial, f"window {window} + horizon {args.horizon}: {len(train)} train and {len(val)} val batches of "
                     f"{args.batch_size} ({held}); the sequences are too short for this window, or too few")
    train_loader, val_loader = sw.WindowLoader(train), sw.WindowLoader(val)
    torch.manual_seed(seed)
    model = Forecaster(window, args.horizon, features_of(train), hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    step, epoch, t0 = 0, 0, time.perf_counter()
    val_loss = float("nan")
    while step < args.steps:
        train_loader.set_epoch(epoch)
        for batch in train_loader:
            loss = forecast_loss(model, batch, CPU)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % args.eval_every == 0 or step == args.steps:
                val_loss = evaluate(model, val_loader)
                trial.report(val_loss, step)
                if trial.should_prune():
                    prune(trial, lagging(trial, step, val_loss))
            if step >= args.steps:
                break
        epoch += 1
    stats = train_loader.stats()
    log.info("trial %d: seed %d lr %.2e hidden %d window %d -> val loss %.4f (%d steps, %.1fs, %s windows/s)",
             trial.number, seed, lr, hidden, window, val_loss, step, time.perf_counter() - t0,
             f"{stats['windows_per_s']:,.0f}")
    return val_loss


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="dataset URL written by streamwin pack")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--steps", type=int, default=500, help="training steps per trial")
    p.add_argument("--eval-every", type=int, default=100, help="validate (and maybe prune) every N steps")
    p.add_argument("--windows", type=int, nargs="+", default=[32, 64], help="window lengths to search")
    p.add_argument("--horizon", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--shuffle-buffer", type=int, default=4096)
    p.add_argument("--split-by", choices=["holdout", "key"], default="holdout")
    p.add_argument("--holdout", type=int, default=32, help="steps at the end of each sequence kept for validation")
    p.add_argument("--val-fraction", type=float, default=0.2, help="with --split-by key: share of sequences in val")
    p.add_argument("--split-seed", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="trial k uses seed + k")
    p.add_argument("--storage", default=None, help="Optuna storage URL shared by parallel workers (default: in memory)")
    p.add_argument("--study", default="streamwin-hpo")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our own one line per trial instead
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    study = optuna.create_study(
        study_name=args.study, storage=args.storage, load_if_exists=True, direction="minimize",
        sampler=optuna.samplers.TPESampler(seed=args.seed),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=args.eval_every))
    study.optimize(lambda t: objective(t, args), n_trials=args.trials)

    print(f"\n{'trial':>5}  {'seed':>4}  {'lr':>8}  {'hidden':>6}  {'window':>6}  {'val loss':>9}  state")
    for t in study.trials:
        value = f"{t.value:9.4f}" if t.value is not None else f"{'-':>9}"
        why = f": {t.user_attrs['pruned']}" if "pruned" in t.user_attrs else ""
        print(f"{t.number:5d}  {t.user_attrs.get('seed', '-'):>4}  {t.params.get('lr', float('nan')):8.2e}  "
              f"{t.params.get('hidden', '-'):>6}  {t.params.get('window', '-'):>6}  {value}  {t.state.name.lower()}{why}")
    completed = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not completed:
        reasons = sorted({t.user_attrs.get("pruned", t.state.name.lower()) for t in study.trials})
        print(f"no trial completed: {len(study.trials)} trial(s) pruned or failed; why: " + "; ".join(reasons),
              file=sys.stderr)
        return 1
    best = study.best_trial
    print(f"best trial {best.number}: val loss {best.value:.4f} with {best.params} (seed {best.user_attrs['seed']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
