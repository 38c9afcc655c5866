"""Packing: inputs in the formats users have -> tar shards + index.json (written last).

In: a directory of .npy/.npz, parquet, csv, jsonl, text files, or any iterable of (key, array).
Out: a dataset at any fsspec URL. ``inputs`` reads each input file as sequences, ``pack``
encodes and writes shards and the manifest, ``scan`` re-reads shards to verify a dataset or to
index tar shards streamwin did not write. Knows nothing of the read side.
"""
