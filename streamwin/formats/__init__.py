"""The on-disk encoding, pure (no I/O): what a dataset's bytes mean.

In: bytes of a shard member or of index.json. Out: numpy dtypes and shapes, tar member
layouts, sequence keys, and the Manifest (per-sequence columns). ``npy`` and ``tar`` are the
two formats a shard is made of, ``zstd`` how a long member is compressed as independent
frames, ``keys`` the rules a sequence key obeys, ``manifest`` the index.json that describes
the shards and is written last as the commit marker.
"""
