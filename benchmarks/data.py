"""Deterministic benchmark corpus: the perf-notes setup, written once and reused.

The corpus is 10,963 sequences with lengths log-uniform in [200, 20,000] and F=8 float32
random-normal values (about 1.5 GB; about 694k windows per epoch at W=256, stride 64).
Every sequence is a pure function of (seed, index), so all systems in a benchmark read the
very same bytes, run after run.

Shards are tar files whose members are ``<key>.npy`` (webdataset layout). With streamwin
importable they are written by ``streamwin.pack`` (which also writes ``index.json``);
before that, plain tar shards are written with ``webdataset.TarWriter`` so the baselines
can be developed and tested. The webdataset baseline reads the same ``*.tar`` files.

Usage (pre-write a corpus, e.g. to keep generation out of a timed session):

    python benchmarks/data.py bench_data/full
    python benchmarks/data.py bench_data/quick --quick
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

#: Full-size corpus parameters (perf-notes.md).
FULL_N_SEQS = 10_963
#: The --quick corpus is this fraction of the full one.
QUICK_FRACTION = 20
#: Name of the file recording what a corpus directory holds, so a later run can reuse it.
MARKER = "corpus.json"


@dataclass(frozen=True)
class WindowSetup:
    """The window, batch and shuffle setup every benchmark runs with (perf-notes); each adds its own fields."""

    window: int = 256
    stride: int = 64
    batch_size: int = 256
    shuffle_buffer: int = 10_000
    seed: int = 0


@dataclass(frozen=True)
class CorpusSpec:
    """Everything that determines a corpus's bytes (plus the shard size and writer)."""

    n_seqs: int = FULL_N_SEQS
    min_len: int = 200
    max_len: int = 20_000
    features: int = 8
    dtype: str = "float32"
    seed: int = 0
    shard_bytes: int = 64 << 20

    @classmethod
    def quick(cls, **overrides: object) -> "CorpusSpec":
        """The --quick corpus: 1/20 of the full one (about 75 MB)."""
        params = {"n_seqs": FULL_N_SEQS // QUICK_FRACTION, "shard_bytes": 8 << 20}
        params.update(overrides)
        return cls(**params)  # type: ignore[arg-type]

    def scaled(self, factor: float) -> "CorpusSpec":
        """The same corpus recipe with ``factor`` times as many sequences."""
        fields = asdict(self)
        fields["n_seqs"] = max(1, int(round(self.n_seqs * factor)))
        return CorpusSpec(**fields)


def sequence_lengths(n_seqs: int = FULL_N_SEQS, min_len: int = 200, max_len: int = 20_000,
                     seed: int = 0) -> np.ndarray:
    """Lengths log-uniform in [min_len, max_len], as int64; a pure function of the arguments."""
    rng = np.random.default_rng([seed, 0x1E46])
    logs = rng.uniform(math.log(min_len), math.log(max_len), size=n_seqs)
    return np.clip(np.exp(logs).astype(np.int64), min_len, max_len)


def sequence_key(index: int) -> str:
    """Key of the index-th sequence (no dots: webdataset splits keys at the first dot)."""
    return f"seq{index:07d}"


def make_corpus(n_seqs: int = FULL_N_SEQS, min_len: int = 200, max_len: int = 20_000,
                features: int = 8, dtype: np.dtype | str = np.float32,
                seed: int = 0) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(key, array [T, features])`` for each sequence, deterministically.

    Values are standard normal drawn from an RNG keyed by (seed, index), so any one
    sequence can be regenerated alone and the corpus does not depend on iteration order.
    """
    lengths = sequence_lengths(n_seqs, min_len, max_len, seed)
    dtype = np.dtype(dtype)
    for index, length in enumerate(lengths):
        rng = np.random.default_rng([seed, 1, index])
        if dtype.kind == "f":
            values = rng.standard_normal((int(length), features), dtype=np.float32).astype(dtype, copy=False)
        else:
            values = rng.integers(0, 1 << 15, size=(int(length), features)).astype(dtype)
        yield sequence_key(index), values


def count_windows(lengths: np.ndarray, window: int, stride: int, horizon: int = 0) -> int:
    """Windows in one epoch: starts 0, S, 2S, ... while start + W + H <= T (design.md)."""
    span = window + horizon
    usable = lengths[lengths >= span]
    return int(((usable - span) // stride + 1).sum())


def corpus_bytes(spec: CorpusSpec) -> int:
    """Bytes of sequence values in the corpus (not counting .npy headers or tar padding)."""
    lengths = sequence_lengths(spec.n_seqs, spec.min_len, spec.max_len, spec.seed)
    return int(lengths.sum()) * spec.features * np.dtype(spec.dtype).itemsize


def streamwin_pack():
    """Return ``streamwin.pack`` if the library provides it, else None."""
    try:
        import streamwin  # noqa: PLC0415 - optional until the library lands
    except ImportError:
        return None
    return getattr(streamwin, "pack", None)


def streamwin_api():
    """The streamwin module if it provides pack, WindowDataset and WindowLoader, else None.

    The benchmarks are written against that public API before the library exists; until
    it does, the streamwin case is skipped and the corpus is written as plain tar shards.
    """
    try:
        import streamwin  # noqa: PLC0415
    except ImportError:
        return None
    needed = ("pack", "WindowDataset", "WindowLoader")
    return streamwin if all(hasattr(streamwin, name) for name in needed) else None


def shard_paths(directory: str | Path) -> list[str]:
    """Sorted ``*.tar`` files of a corpus directory (searched recursively if none at top)."""
    root = Path(directory)
    found = sorted(root.glob("*.tar")) or sorted(root.rglob("*.tar"))
    return [str(p) for p in found]


def default_dir(spec: CorpusSpec, root: str | Path | None = None) -> Path:
    """Where a corpus lives by default: ``bench_data/full``, ``bench_data/quick`` or one named
    by its parameters, under the repository (``bench_data/`` is git-ignored)."""
    root = Path(root) if root is not None else Path(__file__).resolve().parent.parent / "bench_data"
    if spec == CorpusSpec():
        return root / "full"
    if spec == CorpusSpec.quick():
        return root / "quick"
    return root / f"n{spec.n_seqs}-shard{spec.shard_bytes >> 20}M-seed{spec.seed}-f{spec.features}-{spec.dtype}"


def _read_marker(directory: Path) -> dict | None:
    """The marker a finished corpus directory holds, or None."""
    try:
        return json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _write_plain_shards(directory: Path, spec: CorpusSpec) -> None:
    """Write ``<key>.npy`` tar shards with webdataset's ShardWriter (no index.json)."""
    import webdataset as wds  # noqa: PLC0415 - only needed for the fallback writer

    pattern = str(directory / "shard-%06d.tar")
    with wds.ShardWriter(pattern, maxsize=spec.shard_bytes, maxcount=10**9, verbose=0) as sink:
        for key, array in make_corpus(spec.n_seqs, spec.min_len, spec.max_len, spec.features,
                                      spec.dtype, spec.seed):
            sink.write({"__key__": key, "npy": array})


def _log_stderr(message: str) -> None:
    """Progress goes to stderr so that stdout stays machine-readable."""
    print(message, file=sys.stderr, flush=True)


def write_corpus(directory: str | Path, spec: CorpusSpec | None = None, *, force: bool = False,
                 log: Callable[[str], None] = _log_stderr) -> Path:
    """Write the corpus ``spec`` to ``directory`` unless an identical one is already there.

    Uses ``streamwin.pack`` when importable (writing index.json too), otherwise plain
    webdataset tar shards. A corpus written by the fallback is rewritten once streamwin
    can pack, because the streamwin case needs the manifest. Returns the directory.
    """
    spec = spec or CorpusSpec()
    directory = Path(directory).resolve()
    pack = streamwin_pack()
    writer = "streamwin" if pack is not None else "webdataset"
    wanted = {"spec": asdict(spec), "writer": writer}
    if not force and _read_marker(directory) == wanted and shard_paths(directory):
        return directory
    if directory.exists():
        if _read_marker(directory) is None and any(directory.iterdir()):
            raise FileExistsError(f"{directory} exists and is not a benchmark corpus (no {MARKER}); "
                                  "refusing to overwrite it: choose another directory")
        shutil.rmtree(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    size_mb = corpus_bytes(spec) / 1e6
    log(f"[data] writing {spec.n_seqs} sequences ({size_mb:.0f} MB) to {directory} with {writer}")
    if pack is not None:
        sequences = make_corpus(spec.n_seqs, spec.min_len, spec.max_len, spec.features,
                                spec.dtype, spec.seed)
        options = {"progress": False} if "progress" in inspect.signature(pack).parameters else {}
        pack(sequences, str(directory), shard_bytes=spec.shard_bytes, **options)
    else:
        directory.mkdir()
        _write_plain_shards(directory, spec)
    directory.mkdir(exist_ok=True)
    (directory / MARKER).write_text(json.dumps(wanted, indent=1))
    log(f"[data] wrote {len(shard_paths(directory))} shards in {time.perf_counter() - started:.1f}s")
    return directory


def main(argv: list[str] | None = None) -> int:
    """CLI: write (or verify) a benchmark corpus and print its summary as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="where the shards go (e.g. bench_data/full)")
    parser.add_argument("--quick", action="store_true", help="1/20 of the full corpus")
    parser.add_argument("--n-seqs", type=int, help="override the number of sequences")
    parser.add_argument("--shard-bytes", type=int, help="override the shard size in bytes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rewrite even if present")
    args = parser.parse_args(argv)
    spec = CorpusSpec.quick(seed=args.seed) if args.quick else CorpusSpec(seed=args.seed)
    overrides = {k: v for k, v in (("n_seqs", args.n_seqs), ("shard_bytes", args.shard_bytes)) if v}
    if overrides:
        spec = CorpusSpec(**{**asdict(spec), **overrides})
    directory = write_corpus(args.directory, spec, force=args.force)
    lengths = sequence_lengths(spec.n_seqs, spec.min_len, spec.max_len, spec.seed)
    print(json.dumps({"directory": str(directory), "shards": len(shard_paths(directory)),
                      "bytes": corpus_bytes(spec), "windows_256_64": count_windows(lengths, 256, 64),
                      **asdict(spec)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
