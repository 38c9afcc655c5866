#!/usr/bin/env python
"""Pack an input into tar shards + index.json: the same as ``streamwin pack SRC DEST [options]``.

    python tools/pack_shards.py data/ecg/ s3://bucket/ecg/ --shard-size 256MB --workers 4

See ``python tools/pack_shards.py --help`` for the options.
"""
import sys

from streamwin.cli import main

if __name__ == "__main__":
    sys.exit(main(["pack", *sys.argv[1:]]))
