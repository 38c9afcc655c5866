"""Reading: a block of the plan's windows -> one buffer holding the steps they cover.

In: the plan's block (global window indices), the manifest, the dataset URL. Out: a Block
(bytes, and where each window starts in them). Local and cached shards are mapped, remote
ones read with ranged GETs, zstd members decompressed frame by frame; headers are checked
against the manifest and failures name the shard, member and byte offset.
"""
