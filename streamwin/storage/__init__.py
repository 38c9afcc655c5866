"""Where bytes live: fsspec URLs, atomic writes, retries, ranged and mapped reads, the node cache.

In: URLs and byte ranges. Out: filesystems, bytes in the caller's buffers (or mapped from the
page cache), manifests loaded from and written to storage, verified local copies of remote
shards. Nothing here knows windows, plans or torch.
"""
