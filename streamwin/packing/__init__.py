"""Packing: inputs in the formats users have -> tar shards + index.json (written last).

In: a directory of .npy/.npz, parquet, Arrow, csv, jsonl, text files (any fsspec URL), a dataset
object (Ray, Dask, Hugging Face, pyarrow, pandas), or any iterable of (key, array).
Out: a dataset at any fsspec URL, and its Manifest. Knows nothing of the read side. The
public functions: ``pack.pack``, ``parts.merge``, ``compact.compact``, ``scan.verify`` and ``scan.index_shards``
(``streamwin`` re-exports them; this package does not, so ``streamwin.packing.pack`` stays
the module).

The stages, in import order: ``inputs`` reads each input file as sequences; ``nonfinite``
counts NaN and inf; ``encode`` turns one sequence into its tar member, ``records`` many short
ones at once; ``columns`` keeps the manifest's per-sequence columns in files; ``writer``
appends members to shards; ``tasks`` groups input files into units of work; ``fragments``
merges the units' index fragments; ``lock`` and ``dest`` keep a destination whole (one pack
at a time, generations of shards, the atomic commit); ``unit`` packs one unit, the pure
function everything runs; ``parallel``, ``cluster_ray`` and ``cluster_dask`` run units here,
on Ray or on Dask (``engines`` picks one); ``parts`` packs a part of the units and merges part
indexes; ``sources`` cuts an input into numbered units; ``grow`` and ``append`` add to a
dataset packed already (``pack(mode="append" | "extend")``), ``compact`` merges what extensions
added; ``pack`` runs it all; ``scan`` re-reads shards to verify a dataset or to index tar
shards streamwin did not write.
"""
