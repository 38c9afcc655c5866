"""Packing: inputs in the formats users have -> tar shards + index.json (written last).

In: a directory of .npy/.npz, parquet, csv, jsonl, text files, or any iterable of (key, array).
Out: a dataset at any fsspec URL, and its Manifest. Knows nothing of the read side. The
public functions: ``pack.pack``, ``parts.merge``, ``scan.verify`` and ``scan.index_shards``
(``streamwin`` re-exports them; this package does not, so ``streamwin.packing.pack`` stays
the module).

The stages, in import order: ``inputs`` reads each input file as sequences; ``nonfinite``
counts NaN and inf; ``encode`` turns one sequence into its tar member, ``records`` many short
ones at once; ``columns`` keeps the manifest's per-sequence columns in files; ``writer``
appends members to shards; ``tasks`` and ``parallel`` encode the input in one process or in
many; ``parts`` packs a part of the input and merges part indexes; ``pack`` runs it all;
``scan`` re-reads shards to verify a dataset or to index tar shards streamwin did not write.
"""
